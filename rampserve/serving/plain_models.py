"""Models without ramps that run in the server's own process, on a thread (`FunctionPredictor`): an ONNX graph on
ONNX Runtime, a torch module. Built by the server and handed to the front end as predictors: the front end itself
imports neither library, and a server that serves no such model never imports them."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from rampserve.serving.frontend.repository.predictors import FunctionPredictor, Predictor
from rampserve.serving.shared.protocol import TensorSpec

if TYPE_CHECKING:
    from torch import nn

ONNX_DATATYPES = {"tensor(float)": "FP32", "tensor(double)": "FP64", "tensor(float16)": "FP16",
                  "tensor(int64)": "INT64", "tensor(int32)": "INT32", "tensor(uint8)": "UINT8",
                  "tensor(bool)": "BOOL"}


def torch_predictor(name: str, module: nn.Module, inputs: Sequence[TensorSpec], version: str = "1") -> Predictor:
    """A plain torch module (no ramps), called with its inputs in the order of `inputs`."""
    import torch  # here: a server that serves no torch module imports no torch

    from rampserve.graph.torch_graph import TRACE_GUARD

    module = module.eval()
    names = [spec.name for spec in inputs]

    def run(feeds: dict[str, np.ndarray]) -> np.ndarray:
        with TRACE_GUARD.running(), torch.inference_mode():
            return module(*(torch.from_numpy(np.ascontiguousarray(feeds[n])) for n in names)).float().numpy()

    return FunctionPredictor(name, run, inputs, "torch", version)


def onnx_predictor(name: str, path: Path, version: str = "1") -> Predictor:
    """An ONNX graph on ONNX Runtime (CPU, one intra-op thread, like the server's executors); its first output
    is taken as the scores."""
    import onnxruntime as ort  # here: a server that serves no ONNX graph imports no ONNX Runtime

    options = ort.SessionOptions()
    options.intra_op_num_threads = int(os.environ.get("RAMPSERVE_ORT_THREADS", "1"))
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    specs = []
    for node in session.get_inputs():
        if node.type not in ONNX_DATATYPES:
            raise ValueError(f"{path}: input {node.name} has type {node.type}, which rampserve does not serve")
        shape = tuple(d if isinstance(d, int) else -1 for d in node.shape)
        specs.append(TensorSpec(node.name, ONNX_DATATYPES[node.type], (-1, *shape[1:])))

    def run(feeds: dict[str, np.ndarray]) -> np.ndarray:
        return session.run(None, {spec.name: feeds[spec.name] for spec in specs})[0]

    return FunctionPredictor(name, run, specs, "onnx", version)
