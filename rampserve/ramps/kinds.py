"""Ramps as torch modules: a parameter-free reduction of a site's activation followed by a small trainable head
(what each kind is: `ramps.specs`).

Splitting every ramp into a fixed `reduce` and a trainable `head` lets training run the frozen model once,
keep only the reduced activations, and fit every head from them (Apparate §3.1, §4).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from rampserve.control.scores import top_label_and_error
from rampserve.ramps.arrays import RampArrays
from rampserve.ramps.cache import CacheRamp
from rampserve.ramps.pooling import POOLING_REDUCTIONS
from rampserve.ramps.specs import DENSE_KINDS, RampSpec, numel
from rampserve.ramps.torch_reductions import as_array, reduce_activation


def make_ramp(spec: RampSpec) -> Ramp | CacheRamp:
    """An untrained ramp of `spec`'s kind (a cache ramp with empty arrays of the right shapes)."""
    return CacheRamp(spec) if spec.kind == "cache" else Ramp(spec)


def ramp_from_state(spec: RampSpec, state: Mapping[str, np.ndarray]) -> Ramp | CacheRamp:
    """A ramp of `spec` with the arrays a bundle keeps for it (raises ValueError where they do not fit it)."""
    ramp = make_ramp(spec)
    try:  # copies: a bundle's arrays may be read-only views of its file
        ramp.load_state_dict({name: torch.from_numpy(np.array(value)) for name, value in state.items()}, strict=True)
    except RuntimeError as exc:
        raise ValueError(str(exc)) from exc
    # Served, never trained: no autograd graph however its caller runs it (an ONNX model's executor thread is not
    # in torch's inference mode, which a deep head's torch operators would otherwise record for)
    return ramp.eval().requires_grad_(False)


def build_head(spec: RampSpec) -> nn.Module:
    if spec.kind == "linear":
        # Reductions already give flat (N, features): a bare Linear avoids a container's call overhead,
        # a sizeable share of a ramp's cost at batch 1.
        return nn.Linear(numel(spec.feature_shape), spec.num_classes)
    if spec.kind == "mlp":
        if not spec.hidden:
            raise ValueError("an MLP ramp needs the width of its hidden layer")
        return nn.Sequential(nn.Linear(numel(spec.feature_shape), spec.hidden), nn.ReLU(),
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
    width = numel(spec.feature_shape)
    return nn.Sequential(nn.Flatten(), nn.Linear(width, width), nn.Tanh(), nn.Dropout(0.1),
                         nn.Linear(width, spec.num_classes))


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
            self.register_buffer("center", torch.zeros(numel(spec.feature_shape)))
        self._pools = spec.kind in DENSE_KINDS and spec.reduce in POOLING_REDUCTIONS
        self._arrays: tuple[tuple[int, ...], RampArrays] | None = None  # (its parameters' storage, the arrays)

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

    def evaluate(self, activation: torch.Tensor | np.ndarray, score: str = "max_prob") -> tuple[np.ndarray, np.ndarray]:
        """Top label and error score per input: what the serving path runs after each active ramp (and what
        the latency profile times), on the activation as the backend gives it. Scores `forward`'s logits up to float
        rounding.

        A pooling linear ramp runs in NumPy, pooling as a matmul: called between two of the model's layers,
        where caches are cold, each library call costs several times what it does in a loop, and NumPy's are
        the cheapest. With 8 such ramps on resnet18-fmnist the serving path's run takes +0.48-0.53 ms at
        batch 1 and +0.74-0.77 ms at batch 16, against +0.59-0.64 and +1.6-1.7 ms for adaptive pooling and
        F.linear in torch, and +0.51-0.59 and +0.85-0.87 ms for one matmul by the head folded with the pooling
        (a weight per input position evicts the model's own data from cache).
        """
        if self._pools:
            return self._current_arrays().evaluate(as_array(activation), score)
        return top_label_and_error(self.forward(torch.as_tensor(activation)).detach().numpy(), score)

    def arrays(self) -> RampArrays:
        """A linear or MLP ramp as arrays: views of its parameters (what `ramps.onnx_fused` builds a tap from)."""
        return RampArrays(self.spec, self.center.detach().numpy(),
                          tuple((layer.weight.detach().numpy(), layer.bias.detach().numpy())
                                for layer in self.dense_layers()))

    def from_features(self, features: np.ndarray, score: str = "max_prob") -> tuple[np.ndarray, np.ndarray]:
        """Top label and error score per input from already reduced features (what training keeps)."""
        with torch.no_grad():
            logits = self.head_logits(torch.as_tensor(features, dtype=torch.float32))
        return top_label_and_error(logits.numpy(), score)

    def _current_arrays(self) -> RampArrays:
        """`arrays()`, made again only when a parameter has moved to new storage: the arrays are views, through which
        in-place updates (optimiser steps, load_state_dict) show, and a view keeps its storage alive, so an address
        cannot come back."""
        head = self._modules["head"]  # without nn.Module.__getattr__ calls (~1 us each): a linear ramp at batch 1
        layers = (head,) if isinstance(head, nn.Linear) else (head._modules["0"], head._modules["2"])
        key = (self._buffers["center"].data_ptr(),
               *(p.data_ptr() for layer in layers for p in layer._parameters.values()))
        found = self._arrays
        if found is None or found[0] != key:
            self._arrays = found = (key, self.arrays())
        return found[1]

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())
