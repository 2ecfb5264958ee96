"""MLServer custom runtime of `rampserve bench peers`: the bundle's original model, traced to TorchScript (`.pt`, run
by torch) or exported to ONNX (`.onnx`, run by ONNX Runtime), with one intra-op thread as rampserve's executor and
the Ray Serve replica. Loaded by `mlserver start` in its own venv (`.venv-mlserver`), so it imports nothing from
rampserve; MLServer's adaptive batching (`max_batch_size`, `max_batch_time` in model-settings.json) merges requests
along the first axis before `predict` and splits the labels back."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from mlserver import MLModel
from mlserver.codecs import NumpyCodec
from mlserver.types import InferenceRequest, InferenceResponse


def _torchscript(path: str) -> Callable[[np.ndarray], np.ndarray]:
    import torch

    torch.set_num_threads(1)
    module = torch.jit.load(path).eval()

    def run(features: np.ndarray) -> np.ndarray:
        with torch.inference_mode():
            return module(torch.from_numpy(features)).numpy()

    return run


def _onnx(path: str) -> Callable[[np.ndarray], np.ndarray]:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    return lambda features: session.run(None, {name: features})[0]


class Labels(MLModel):
    async def load(self) -> bool:
        uri = self.settings.parameters.uri
        self._run = _torchscript(uri) if uri.endswith(".pt") else _onnx(uri)
        return True

    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        features = np.ascontiguousarray(NumpyCodec.decode_input(payload.inputs[0]), dtype=np.float32)
        labels = self._run(features).argmax(axis=1).astype(np.int64)
        return InferenceResponse(model_name=self.name, id=payload.id,
                                 outputs=[NumpyCodec.encode_output(name="label", payload=labels)])
