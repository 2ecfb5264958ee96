"""Ramp kinds: a parameter-free reduction of a site's activation followed by a small trainable head.

Splitting every ramp into a fixed `reduce` and a trainable `head` lets training run the frozen model once,
keep only the reduced activations, and fit every head from them (Apparate §3.1, §4).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from rampserve.ramps.scores import top_label_and_error

# Spatial size the deeper CNN head keeps before its convolutions: enough structure for a 3x3 conv, small
# enough that the reduced activations of a bootstrap set fit in memory.
DEEP_CNN_GRID = 4
# Spatial size a linear CNN ramp pools to. A global mean throws away where things are: on resnet18-fmnist
# under drift, a 3x3 grid lets the ramps after layers 2 and 3 answer 47-64% of inputs at 99% agreement with
# the model, against 6-42% for the global mean, at nearly the same cost (one pooling, one small matmul).
LINEAR_CNN_GRID = 3
# A linear ramp whose reduction is pooling (a fixed linear map of the activation) serves as one F.linear on
# the activation with the pooling folded into the head's weight. On resnet18-fmnist at batch 1 that takes a
# ramp's head from ~22 µs (pooling, then F.linear) to ~8 µs, and at batch 16 from 60-240 µs (adaptive pooling
# of small maps is slow) to 13-40 µs. The folded weight is the head's times the activation's size per
# channel group, so past this many elements (2 MiB of float32; e.g. 10 classes x 64x14x14) it no longer stays
# in cache and reducing first is as fast or faster.
FOLD_MAX_WEIGHTS = 1 << 19
_FOLDABLE_REDUCTIONS = ("spatial_mean", "grid_mean")


@dataclass(frozen=True)
class RampSpec:
    kind: str  # "linear" (Apparate's default) or "deep"
    reduce: str  # "spatial_mean", "grid_mean", "spatial_grid", "first_token", "token_mean", "identity"
    feature_shape: tuple[int, ...]  # per-sample shape after `reduce`
    num_classes: int

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> RampSpec:
        return cls(
            kind=str(data["kind"]),
            reduce=str(data["reduce"]),
            feature_shape=tuple(int(d) for d in data["feature_shape"]),
            num_classes=int(data["num_classes"]),
        )


RAMP_KINDS = ("linear", "deep")


def reduce_activation(activation: torch.Tensor, how: str) -> torch.Tensor:
    if how == "spatial_mean":
        return activation.mean(dim=(2, 3))
    if how == "spatial_grid":
        return F.adaptive_avg_pool2d(activation, DEEP_CNN_GRID)
    if how == "grid_mean":
        return F.adaptive_avg_pool2d(activation, LINEAR_CNN_GRID).flatten(1)
    if how == "first_token":
        return activation[:, 0]
    if how == "token_mean":
        return activation.mean(dim=1)
    if how == "identity":
        return activation.flatten(1)
    raise ValueError(f"unknown reduction {how!r}")


def spec_for(kind: str, activation_shape: tuple[int, ...], num_classes: int, token_reduce: str = "first_token") -> RampSpec:
    """The ramp of `kind` for a site whose per-sample activation has `activation_shape`."""
    if kind not in RAMP_KINDS:
        raise ValueError(f"unknown ramp kind {kind!r}; known: {RAMP_KINDS}")
    rank = len(activation_shape)
    if rank == 3:  # (C, H, W) feature map
        channels = activation_shape[0]
        if kind == "deep":
            return RampSpec(kind, "spatial_grid", (channels, DEEP_CNN_GRID, DEEP_CNN_GRID), num_classes)
        return RampSpec(kind, "grid_mean", (channels * LINEAR_CNN_GRID**2,), num_classes)
    if rank == 2:  # (tokens, hidden)
        return RampSpec(kind, token_reduce, (activation_shape[1],), num_classes)
    width = 1
    for d in activation_shape:
        width *= d
    return RampSpec(kind, "identity", (width,), num_classes)


def build_head(spec: RampSpec) -> nn.Module:
    if spec.kind == "linear":
        # Reductions already give flat (N, features): a bare Linear avoids a container's call overhead,
        # a sizeable share of a ramp's cost at batch 1.
        return nn.Linear(_numel(spec.feature_shape), spec.num_classes)
    if spec.reduce == "spatial_grid":
        channels = spec.feature_shape[0]
        return nn.Sequential(
            nn.Conv2d(channels, channels, 3, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(channels, spec.num_classes),
        )
    # DeeBERT-style: the BERT pooler (dense + tanh) and a dropout before the classifier.
    width = _numel(spec.feature_shape)
    return nn.Sequential(nn.Flatten(), nn.Linear(width, width), nn.Tanh(), nn.Dropout(0.1),
                         nn.Linear(width, spec.num_classes))


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


class Ramp(nn.Module):
    """reduce + head: maps a site's activation to the model's output space."""

    def __init__(self, spec: RampSpec) -> None:
        super().__init__()
        self.spec = spec
        self.head = build_head(spec)
        self._folded: _FoldedHead | None = None

    def forward(self, activation: torch.Tensor) -> torch.Tensor:
        reduced = reduce_activation(activation, self.spec.reduce)
        if isinstance(self.head, nn.Linear):  # skips a module call: a sizeable share of a ramp at batch 1
            return F.linear(reduced, self.head.weight, self.head.bias)
        return self.head(reduced)

    def evaluate(self, activation: torch.Tensor, score: str = "max_prob") -> tuple[np.ndarray, np.ndarray]:
        """Top label and error score per input: what the serving path runs after each active ramp (and what
        the latency profile times). Gives `forward`'s logits up to float rounding."""
        folded = self._folded_head(activation)
        if folded is None:
            logits = self.forward(activation).detach()
        else:
            logits = F.linear(activation.flatten(1), folded.weight, folded.bias)
        return top_label_and_error(logits.numpy(), score)

    def _folded_head(self, activation: torch.Tensor) -> _FoldedHead | None:
        """The head folded with the reduction for this activation's shape, or None where that does not pay.
        Built once per shape and again whenever the head's weights change in place (training, loading)."""
        folded = self._folded
        if folded is None or not folded.fits(activation):
            if self.spec.kind != "linear" or self.spec.reduce not in _FOLDABLE_REDUCTIONS:
                return None
            folded = self._folded = _FoldedHead.build(self.head, self.spec.reduce, activation)
        return folded if folded.weight is not None else None

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


@dataclass(frozen=True)
class _FoldedHead:
    """A linear head acting on the whole activation: W·reduce(x) + b == W'·flatten(x) + b for a linear
    `reduce`, with W' = reduceᵀ(W) (its rows pulled back through the reduction by autograd). `weight` is
    None where W' would exceed FOLD_MAX_WEIGHTS."""

    sample_shape: torch.Size
    dtype: torch.dtype
    # The head's parameters and their versions when folded: in-place updates (optimiser steps,
    # load_state_dict) bump a tensor's version.
    sources: tuple[torch.Tensor, torch.Tensor]
    versions: tuple[int, int]
    weight: torch.Tensor | None
    bias: torch.Tensor

    def fits(self, activation: torch.Tensor) -> bool:
        weight, bias = self.sources
        return (activation.shape[1:] == self.sample_shape and activation.dtype == self.dtype
                and (weight._version, bias._version) == self.versions)

    @classmethod
    def build(cls, head: nn.Linear, reduce: str, activation: torch.Tensor) -> _FoldedHead:
        sample_shape, dtype = activation.shape[1:], activation.dtype
        sources = (head.weight, head.bias)
        versions = (head.weight._version, head.bias._version)
        weight = head.weight.detach().to(dtype)
        bias = head.bias.detach().to(dtype)
        if weight.shape[0] * _numel(tuple(sample_shape)) > FOLD_MAX_WEIGHTS:
            return cls(sample_shape, dtype, sources, versions, None, bias)
        # The serving path calls this under inference mode, where autograd is off.
        with torch.inference_mode(False), torch.enable_grad():
            basis = torch.zeros((weight.shape[0], *sample_shape), dtype=dtype, requires_grad=True)
            (folded,) = torch.autograd.grad(reduce_activation(basis, reduce), basis, weight)
        return cls(sample_shape, dtype, sources, versions, folded.flatten(1), bias)
