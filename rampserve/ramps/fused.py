"""Ramps fused into the compiled serving path: each one a single call of a ramp operator (`kernel.py`).

On the serving path a ramp's arithmetic is small (a pooling and one matmul); what costs is dispatch. As torch
operators in a TorchScript graph, a pooling linear ramp with its softmax, max and exit test was seven operators
at about a microsecond each: 2-5% of resnet18-fmnist's 0.7 ms per ramp at batch 1. As one operator that
allocates nothing it is one dispatch and the multiply-adds. The operator writes the ramp's logits into the
batch's buffer (Python scores them exactly as the eager ramp's logits are scored) and, where some input may exit,
tells a releasing thread through a pipe, so that the model never stops for a ramp.

A ramp that runs in Python (a cache ramp: its centroids and label counts change with every batch it learns from,
where a compiled set holds constants; a deeper head) is fused as a stash: its activation is copied for the
releasing thread, which evaluates the ramp while the model runs on.

In the "stop" exit mode (`runtime.compiled.StopSetRunner`) a fused ramp's `stop` also takes the rows it exits
out of the batch (`rampserve::ramp_stop`); a stashed ramp never stops a row.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from rampserve.control.scores import ERROR_SCORES
from rampserve.ramps.cache import CacheRamp
from rampserve.ramps.kinds import Ramp
from rampserve.ramps.kernel_args import SCORE_CODES, KernelArgs
from rampserve.ramps.pooling import sampling_stride


class FusedRamp(nn.Module):
    """A linear ramp as one `rampserve::ramp_exit` call. `forward(activation, out, floor, notify, stashes)` writes
    the ramp's logits into `out[:, column]` and, where some row's confidence (1 - error score) exceeds `floor`,
    writes `column` to the pipe `notify`. A pooling ramp's pooling runs in the operator as a (positions, cells)
    matrix of one channel's weights, its cells padded to whole vectors with zeros."""

    __constants__ = ["reduce", "column", "score", "stride"]

    def __init__(self, ramp: Ramp, activation_shape: tuple[int, ...], column: int, score: int) -> None:
        super().__init__()
        self.stride = sampling_stride(activation_shape, ramp.spec.reduce)  # the operator pools the sampled map
        args = KernelArgs.of(ramp.arrays(), activation_shape)
        for name in ("pool", "weight", "bias", "center"):
            self.register_buffer(name, torch.from_numpy(getattr(args, name).copy()))
        self.reduce = args.reduce
        self.column, self.score = column, score

    def forward(self, activation: torch.Tensor, out: torch.Tensor, floor: float, notify: int,
                stashes: list[torch.Tensor]) -> bool:
        return torch.ops.rampserve.ramp_exit(self._sampled(activation), self.pool, self.weight, self.bias, self.center,
                                             self.reduce, out, self.column, floor, self.score, notify)

    def stop(self, activation: torch.Tensor, out: torch.Tensor, rows: torch.Tensor, keep: torch.Tensor,
             left: torch.Tensor, floor: float, stop_floor: float, notify: int,
             stashes: list[torch.Tensor]) -> Optional[torch.Tensor]:
        """The ramp of a run whose rows leave where they exit: the logits of the running rows (batch rows `rows`)
        go to `out[rows, column]`; a row whose confidence exceeds `stop_floor` stops unless `keep` holds it
        (`left` then records this column for it); returns the indices of the activation's rows that go on."""
        return torch.ops.rampserve.ramp_stop(self._sampled(activation), self.pool, self.weight, self.bias, self.center,
                                             self.reduce, out, rows, keep, left, self.column, floor, stop_floor,
                                             self.score, notify)

    def _sampled(self, activation: torch.Tensor) -> torch.Tensor:
        if self.stride == 1:
            return activation
        return activation[:, :, ::self.stride, ::self.stride].contiguous()


class StashedRamp(nn.Module):
    """A ramp that runs in Python, in the compiled path: its activation copied into `stashes[column]` (resized to
    fit) and `column` written to `notify`, for the releasing thread to evaluate it."""

    __constants__ = ["column"]

    def __init__(self, column: int) -> None:
        super().__init__()
        self.column = column

    def forward(self, activation: torch.Tensor, out: torch.Tensor, floor: float, notify: int,
                stashes: list[torch.Tensor]) -> bool:
        return torch.ops.rampserve.stash(activation, stashes[self.column], self.column, notify)

    def stop(self, activation: torch.Tensor, out: torch.Tensor, rows: torch.Tensor, keep: torch.Tensor,
             left: torch.Tensor, floor: float, stop_floor: float, notify: int,
             stashes: list[torch.Tensor]) -> Optional[torch.Tensor]:
        """Stashed for Python, which decides its exits after the fact: no row stops here (None: every row goes
        on). The stash holds the running rows only; `left` says which batch rows those are."""
        torch.ops.rampserve.stash(activation, stashes[self.column], self.column, notify)
        return None


def fused_ramp(ramp: Ramp | CacheRamp, score: str, activation_shape: tuple[int, ...], column: int
               ) -> FusedRamp | StashedRamp:
    """The fused form of `ramp` for its site's per-input activation shape, in column `column` of the batch's
    buffers: the ramp operator for a linear ramp, a stash for a ramp that runs in Python. Needs the ramp operators
    (`kernel.available()`)."""
    if score not in ERROR_SCORES:
        raise ValueError(f"unknown error score {score!r}; known: {ERROR_SCORES}")
    if isinstance(ramp, Ramp) and ramp.spec.kind == "linear":
        return FusedRamp(ramp, activation_shape, column, SCORE_CODES[score])
    return StashedRamp(column)
