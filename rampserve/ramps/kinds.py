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

    def forward(self, activation: torch.Tensor) -> torch.Tensor:
        reduced = reduce_activation(activation, self.spec.reduce)
        if isinstance(self.head, nn.Linear):  # skips a module call: a sizeable share of a ramp at batch 1
            return F.linear(reduced, self.head.weight, self.head.bias)
        return self.head(reduced)

    def evaluate(self, activation: torch.Tensor, score: str = "max_prob") -> tuple[np.ndarray, np.ndarray]:
        """Top label and error score per input: what the serving path runs after each active ramp."""
        return top_label_and_error(self.forward(activation).detach().numpy(), score)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())
