"""Ramps as torch modules that score their own logits, for fusing into the compiled stage that ends at their site.

On the serving path a ramp's arithmetic is tiny (a pooling, one small matmul); what costs is every call from
Python between two compiled stages. Fused into the stage's TorchScript graph, a ramp adds a handful of operators
to a graph that runs in C++, and the stage hands Python each row's top label and error score: Python only
compares them with thresholds.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from rampserve.ramps.cache import CacheRamp
from rampserve.ramps.kinds import Ramp
from rampserve.ramps.pooling import POOLING_REDUCTIONS, PooledLinear
from rampserve.ramps.scores import ERROR_SCORES


class FoldedPoolingHead(nn.Module):
    """A pooling linear ramp as one matmul over the flat activation: the pooling's fixed weights folded into the
    head's (equal to pooling then the head up to float rounding). At batch 1 an operator's dispatch costs more
    than its arithmetic, and this is one operator where pooling, flattening and the head were three."""

    def __init__(self, ramp: Ramp, activation_shape: tuple[int, ...]) -> None:
        super().__init__()
        head = ramp.head
        key = (tuple(activation_shape), head.weight.data_ptr(), head.bias.data_ptr())
        arrays = PooledLinear.build(key, ramp.spec.reduce, {"weight": head.weight, "bias": head.bias})
        channels, classes = activation_shape[0], arrays.weight_t.shape[1]
        per_channel = arrays.weight_t.reshape(channels, -1, classes)  # (channels, pooled positions, classes)
        folded = torch.einsum("pq,cqk->cpk", torch.from_numpy(arrays.pool_t), torch.from_numpy(per_channel))
        # (classes, inputs), as `linear` takes it: one operator, and for ten outputs BLAS runs its transposed
        # product 2x faster than activation @ (inputs, classes) at batch 16-64 (measured)
        self.register_buffer("weight", folded.reshape(channels * arrays.positions, classes).T.contiguous())
        self.register_buffer("bias", head.bias.detach().clone())

    def forward(self, activation: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(activation.flatten(1), self.weight, self.bias)


class ScoredRamp(nn.Module):
    """`ramp`'s top label and confidence per row, computed by torch from its logits: the fused counterpart of
    `Ramp.evaluate`, whose error score is 1 - confidence (labels equal; scores equal up to float32 rounding, where
    `evaluate` scores in float64). The subtraction is left to the caller: NumPy does it for a third of what one
    more operator in the graph costs at batch 1."""

    def __init__(self, ramp: Ramp, score: str, activation_shape: tuple[int, ...]) -> None:
        super().__init__()
        if score not in ERROR_SCORES:
            raise ValueError(f"unknown error score {score!r}; known: {ERROR_SCORES}")
        folds = ramp.spec.kind == "linear" and ramp.spec.reduce in POOLING_REDUCTIONS
        self.ramp = FoldedPoolingHead(ramp, activation_shape) if folds else ramp
        self.score = score
        self.log_classes = math.log(ramp.spec.num_classes)  # a constant: a trace must not read a shape as a number

    def forward(self, activation: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.ramp(activation)
        # One softmax kernel and one max (values and indices together): the fewest operators for the score
        probs = torch.softmax(logits, 1)
        top, labels = probs.max(1)
        if self.score == "max_prob":
            return labels, top
        entropy = -(probs * torch.log_softmax(logits, 1)).sum(1)
        return labels, 1.0 - (entropy / self.log_classes).clamp(0.0, 1.0)


def scored_ramp(ramp: Ramp | CacheRamp, score: str, activation_shape: tuple[int, ...]) -> ScoredRamp | None:
    """The fusable form of `ramp` for its site's per-input activation shape, or None for a ramp that stays in
    Python: a cache ramp, whose centroids and label counts change with every batch it learns from, where a
    compiled stage holds its tensors as constants."""
    return None if isinstance(ramp, CacheRamp) else ScoredRamp(ramp, score, activation_shape)
