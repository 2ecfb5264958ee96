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

from rampserve.control.scores import top_label_and_error
from rampserve.ramps.cache import CacheRamp, CacheSpec
from rampserve.ramps.pooling import (
    DEEP_CNN_GRID,
    LINEAR_CNN_GRID,
    POOLING_REDUCTIONS,
    PooledLinear,
    grid_reduction,
    reduce_activation,
)


@dataclass(frozen=True)
class RampSpec:
    kind: str  # "linear" (Apparate's default), "mlp" (one hidden layer), "deep" or "cache" (Freeze Inference)
    reduce: str  # "spatial_mean", "grid_mean", "sampled_grid_mean", "spatial_grid", "first_token", "token_mean",
    # "token_mean_masked", "identity"
    feature_shape: tuple[int, ...]  # per-sample shape after `reduce`
    num_classes: int
    cache: CacheSpec | None = None  # for kind "cache"
    hidden: int | None = None  # for kind "mlp": the hidden layer's width

    def to_json(self) -> dict:
        # Left out where unused, so that a bundle of another kind reads as it did before these fields
        return {key: value for key, value in asdict(self).items() if key not in ("cache", "hidden") or value}

    @classmethod
    def from_json(cls, data: dict) -> RampSpec:
        return cls(
            kind=str(data["kind"]),
            reduce=str(data["reduce"]),
            feature_shape=tuple(int(d) for d in data["feature_shape"]),
            num_classes=int(data["num_classes"]),
            cache=CacheSpec.from_json(data["cache"]) if data.get("cache") else None,
            hidden=int(data["hidden"]) if data.get("hidden") else None,
        )


RAMP_KINDS = ("linear", "mlp", "deep", "cache")
# Kinds whose head is linear maps on the reduced features (an MLP's with a ReLU between): they learn on standardised
# features, keep the mean as their `center`, and fuse into the serving path's ONNX sessions
DENSE_KINDS = ("linear", "mlp")
# Width of an MLP ramp's hidden layer. On lite0-fmnist 64, 128 and 256 let the ramps after blocks 3-11 answer the
# same share of the stream within noise (0.49-0.68 at 1% disagreement), 0.03-0.07 more than a linear head; the
# first layer's weights (features x width) are most of what the ramp reads per run, so the narrowest was kept
MLP_HIDDEN = 64


def spec_for(kind: str, activation_shape: tuple[int, ...], num_classes: int, token_reduce: str = "first_token",
             cache: CacheSpec | None = None, hidden: int = MLP_HIDDEN) -> RampSpec:
    """The ramp of `kind` for a site whose per-sample activation has `activation_shape`. A cache ramp pools like
    a linear one and stores what `cache` (default: CacheSpec()) says; an MLP ramp reduces like a linear one and has
    a hidden layer `hidden` wide."""
    if kind not in RAMP_KINDS:
        raise ValueError(f"unknown ramp kind {kind!r}; known: {RAMP_KINDS}")
    cache = (cache or CacheSpec()) if kind == "cache" else None
    extra = {"cache": cache, "hidden": hidden if kind == "mlp" else None}
    rank = len(activation_shape)
    if rank == 3:  # (C, H, W) feature map
        channels = activation_shape[0]
        if kind == "deep":
            return RampSpec(kind, "spatial_grid", (channels, DEEP_CNN_GRID, DEEP_CNN_GRID), num_classes)
        return RampSpec(kind, grid_reduction(activation_shape), (channels * LINEAR_CNN_GRID**2,), num_classes,
                        **extra)
    if rank == 2:  # (tokens, hidden)
        return RampSpec(kind, token_reduce, (activation_shape[1],), num_classes, **extra)
    return RampSpec(kind, "identity", (_numel(activation_shape),), num_classes, **extra)


def make_ramp(spec: RampSpec) -> Ramp | CacheRamp:
    """An untrained ramp of `spec`'s kind (a cache ramp with empty arrays of the right shapes)."""
    return CacheRamp(spec) if spec.kind == "cache" else Ramp(spec)


def build_head(spec: RampSpec) -> nn.Module:
    if spec.kind == "linear":
        # Reductions already give flat (N, features): a bare Linear avoids a container's call overhead,
        # a sizeable share of a ramp's cost at batch 1.
        return nn.Linear(_numel(spec.feature_shape), spec.num_classes)
    if spec.kind == "mlp":
        if not spec.hidden:
            raise ValueError("an MLP ramp needs the width of its hidden layer")
        return nn.Sequential(nn.Linear(_numel(spec.feature_shape), spec.hidden), nn.ReLU(),
                             nn.Linear(spec.hidden, spec.num_classes))
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
    """reduce + head: maps a site's activation to the model's output space.

    A linear head computes `weight @ (features - center) + bias`, where `center` is the mean of its training
    features (the standardisation it learnt on, kept apart from the bias): folded into the bias, the mean of a
    feature that hardly varies (a text encoder's first token after its first layers) becomes a large weight
    times a large value cancelled by a large bias, and float32 loses the logits' last digits to it (1e-2 on
    MiniLM's early ramps, whose logits are about 2). An MLP head's first layer reads `features - center` alike."""

    def __init__(self, spec: RampSpec) -> None:
        super().__init__()
        self.spec = spec
        self.head = build_head(spec)
        if spec.kind in DENSE_KINDS:
            self.register_buffer("center", torch.zeros(_numel(spec.feature_shape)))
        self._pools = spec.kind in DENSE_KINDS and spec.reduce in POOLING_REDUCTIONS
        self._arrays: PooledLinear | None = None

    def dense_layers(self) -> list[nn.Linear]:
        """The linear maps of a linear or MLP head, in order (a ReLU between consecutive ones)."""
        if self.spec.kind not in DENSE_KINDS:
            raise ValueError(f"a {self.spec.kind} ramp's head is not linear maps")
        return [self.head] if isinstance(self.head, nn.Linear) else [self.head[0], self.head[2]]

    def forward(self, activation: torch.Tensor) -> torch.Tensor:
        return self.head_logits(reduce_activation(activation, self.spec.reduce))

    def head_logits(self, features: torch.Tensor) -> torch.Tensor:
        if isinstance(self.head, nn.Linear):  # skips a module call: a sizeable share of a ramp at batch 1
            return F.linear(features - self.center, self.head.weight, self.head.bias)
        if self.spec.kind == "mlp":
            return self.head(features - self.center)
        return self.head(features)

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
            self._arrays = arrays = PooledLinear.current(self._arrays, activation, self.spec.reduce, self._params())
            return top_label_and_error(arrays(activation), score)
        return top_label_and_error(self.forward(activation).detach().numpy(), score)

    def from_features(self, features: np.ndarray, score: str = "max_prob") -> tuple[np.ndarray, np.ndarray]:
        """Top label and error score per input from already reduced features (what training keeps)."""
        with torch.no_grad():
            logits = self.head_logits(torch.as_tensor(features, dtype=torch.float32))
        return top_label_and_error(logits.numpy(), score)

    def _params(self) -> dict[str, torch.Tensor]:
        """`PooledLinear`'s parameters: the (first) layer's, the center, and an MLP's output layer's."""
        head = self._modules["head"]
        if isinstance(head, nn.Linear):  # without nn.Module.__getattr__ calls (~1 us each): a linear ramp at batch 1
            first, out = head._parameters, None
        else:
            first, out = (layer._parameters for layer in self.dense_layers())
        params = {"weight": first["weight"], "bias": first["bias"], "center": self._buffers["center"]}
        if out is not None:
            params |= {"out_weight": out["weight"], "out_bias": out["bias"]}
        return params

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())
