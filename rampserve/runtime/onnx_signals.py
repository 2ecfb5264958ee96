"""ONNX Runtime sets whose ramps signal from inside one session call.

Cut into stages, a set of ONNX ramps costs a session call per active site, and on a convolutional network the
conversions of each site's value out of and back into ONNX Runtime's blocked layout: on EfficientNet-Lite0 at
224x224 (5.5 ms at batch 1 on 2 cores), 3-4% of the model per ramp. Here the model runs whole, in one session of
the graph ONNX Runtime optimized for this machine, each ramp computed on its site's value in whatever layout it is
(`graph.onnx_graph.with_signals`), and handing its logits and the batch's highest confidence to a Python operator
(onnxruntime-extensions' PyOp) that does what `runtime.compiled.OnnxSetRunner` does between two stages: it writes
the logits where the releasing thread reads them and, where the confidence clears the exit floor, the ramp's
column to the notify pipe. The run goes on meanwhile. ONNX Runtime runs a session's nodes on the thread that
called it, so the operator finds that batch's buffers in a thread-local.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence

import numpy as np
import torch
from onnxruntime_extensions import PyCustomOpDef, get_library_path, onnx_op

SIGNAL_OP = "RampserveRampSignal"
_ZERO = np.zeros((), dtype=np.float32)
_batch = threading.local()  # (logits out (rows, sites, classes), exit floors, notify fd) of the run on this thread


@onnx_op(op_type=SIGNAL_OP, inputs=[PyCustomOpDef.dt_float, PyCustomOpDef.dt_float],
         outputs=[PyCustomOpDef.dt_float], attrs={"column": PyCustomOpDef.dt_int64})
def _signal(logits: np.ndarray, confidence: np.ndarray, column: int) -> np.ndarray:
    out, floors, notify = _batch.run
    out[:, column] = logits
    if notify >= 0 and confidence > floors[column]:
        os.write(notify, bytes((column,)))
    return _ZERO


def library() -> str:
    """The path of the library through which ONNX Runtime calls Python operators."""
    return get_library_path()


class OnnxSignalledRunner:
    """One active-ramp set of an ONNX model, called as an `OnnxSetRunner` is, in one session call whose ramps
    signal as they are computed (every ramp fused: nothing is stashed)."""

    runs_whole = True  # its output is the whole model's, not the stages'

    def __init__(self, runner, sites: Sequence[str], side_name: str | None) -> None:
        self.runner, self.side_name = runner, side_name
        self.tapped = (True,) * len(sites)

    def forward(self, activation: torch.Tensor, side: torch.Tensor, out: torch.Tensor, floors: list[float],
                notify: int, stashes: list[torch.Tensor]) -> torch.Tensor:
        sides = {} if self.side_name is None else {self.side_name: side.numpy()}
        _batch.run = (out.numpy(), floors, notify)
        try:
            return torch.from_numpy(self.runner(activation.numpy(), sides))
        finally:
            _batch.run = None
