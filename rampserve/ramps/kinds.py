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
# Reductions that average every channel's map with the same fixed weights: a linear ramp on one is evaluated
# in NumPy as two small matmuls, pooling as a matrix then the head (see `Ramp.evaluate`).
_POOLING_REDUCTIONS = ("spatial_mean", "grid_mean")


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
        self._pools = spec.kind == "linear" and spec.reduce in _POOLING_REDUCTIONS
        self._arrays: _PooledLinear | None = None

    def forward(self, activation: torch.Tensor) -> torch.Tensor:
        reduced = reduce_activation(activation, self.spec.reduce)
        if isinstance(self.head, nn.Linear):  # skips a module call: a sizeable share of a ramp at batch 1
            return F.linear(reduced, self.head.weight, self.head.bias)
        return self.head(reduced)

    def evaluate(self, activation: torch.Tensor, score: str = "max_prob") -> tuple[np.ndarray, np.ndarray]:
        """Top label and error score per input: what the serving path runs after each active ramp (and what
        the latency profile times). Scores `forward`'s logits up to float rounding.

        A pooling linear ramp runs in NumPy, pooling as a matmul: called between two of the model's layers,
        where caches are cold, each library call costs several times what it does in a loop, and NumPy's are
        the cheapest. With 8 such ramps on resnet18-fmnist the serving path's run takes +0.48-0.53 ms at
        batch 1 and +0.74-0.77 ms at batch 16, against +0.59-0.64 and +1.6-1.7 ms for adaptive pooling and
        F.linear in torch, and +0.51-0.59 and +0.85-0.87 ms for one matmul by the head folded with the pooling
        (a weight per input position evicts the model's own data from cache).
        """
        if self._pools:
            flat = activation.numpy(force=True)
            # The head's current parameters, without two nn.Module.__getattr__ calls (~1 µs each).
            params = self._modules["head"]._parameters
            key = (flat.shape[1:], params["weight"].data_ptr(), params["bias"].data_ptr())
            arrays = self._arrays
            if arrays is None or arrays.key != key:
                arrays = self._arrays = _PooledLinear.build(key, self.spec.reduce, params)
            pooled = (flat.reshape(-1, arrays.positions) @ arrays.pool_t).reshape(len(flat), -1)
            logits = pooled @ arrays.weight_t
            logits += arrays.bias
            return top_label_and_error(logits, score)
        return top_label_and_error(self.forward(activation).detach().numpy(), score)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


@dataclass(frozen=True, eq=False)  # holds arrays, which do not compare to a bool
class _PooledLinear:
    """A pooling linear ramp as arrays for one activation shape: reduce(x) == (x.reshape(n * channels,
    positions) @ pool_t).reshape(n, -1), and views of the head's parameters, through which in-place updates
    (optimiser steps, load_state_dict) show. `key` holds the shape and the parameters' storage addresses: a
    parameter replaced or moved to new storage makes it stale (the views keep the old storage alive, so its
    address cannot come back)."""

    key: tuple[tuple[int, ...], int, int]
    positions: int
    pool_t: np.ndarray  # (positions, pooled positions)
    weight_t: np.ndarray  # (features, classes)
    bias: np.ndarray

    @classmethod
    def build(cls, key: tuple[tuple[int, ...], int, int], reduce: str, params: dict[str, torch.Tensor]
              ) -> _PooledLinear:
        sample_shape = key[0]
        with torch.inference_mode(False):  # the serving path runs under inference mode, without autograd
            probe = torch.zeros((1, 1, *sample_shape[1:]))  # one channel: every channel is pooled alike
            jacobian = torch.autograd.functional.jacobian(lambda x: reduce_activation(x, reduce), probe)
        pooled_positions, positions = jacobian.shape[1], probe.numel()
        pool_t = jacobian.reshape(pooled_positions, positions).numpy().T
        return cls(key, positions, pool_t, params["weight"].detach().numpy().T, params["bias"].detach().numpy())
