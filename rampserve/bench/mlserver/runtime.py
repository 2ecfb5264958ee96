"""MLServer custom runtime of `rampserve bench peers`: the model as every peer runs it (`peers_engine`: the bundle's
ONNX file on ONNX Runtime, or its TorchScript trace), described by the model settings' `extra.peer_model`. Loaded by
`mlserver start` in its own venv (`.venv-mlserver`), which imports `peers_engine` alone from rampserve; MLServer's
adaptive batching (`max_batch_size`, `max_batch_time` in model-settings.json) merges requests along the first axis
before `predict` and splits the labels back."""

from __future__ import annotations

import numpy as np
from mlserver import MLModel
from mlserver.codecs import NumpyCodec
from mlserver.types import InferenceRequest, InferenceResponse

from rampserve.bench.peers_engine import PeerModel, label_function


class Labels(MLModel):
    async def load(self) -> bool:
        self._labels = label_function(PeerModel.from_json(self.settings.parameters.extra["peer_model"]))
        return True

    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        labels = self._labels({tensor.name: np.ascontiguousarray(NumpyCodec.decode_input(tensor))
                               for tensor in payload.inputs})
        return InferenceResponse(model_name=self.name, id=payload.id,
                                 outputs=[NumpyCodec.encode_output(name="label", payload=labels)])
