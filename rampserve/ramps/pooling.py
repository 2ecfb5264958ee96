"""Parameter-free reductions of a site's activation in NumPy, and pooling followed by a linear map.

Linear and MLP ramps (pooling, then the head) and cache ramps (pooling, then the projection to the cache's space)
start with a fixed pooling and a linear map; `PooledLinear` runs the two as small matmuls (and an MLP head's ReLU
and output layer after them). Free of torch: a server of an ONNX model evaluates its ramps here
(`ramps.arrays`); the same reductions in torch, for training, are `ramps.torch_reductions`'.
"""

from __future__ import annotations

from dataclasses import dataclass

from collections.abc import Callable

import numpy as np

# Spatial size the deeper CNN head keeps before its convolutions: enough structure for a 3x3 conv, small
# enough that the reduced activations of a bootstrap set fit in memory.
DEEP_CNN_GRID = 4
# Spatial size a linear CNN ramp pools to. A global mean throws away where things are: on resnet18-fmnist
# under drift, a 3x3 grid lets the ramps after layers 2 and 3 answer 47-64% of inputs at 99% agreement with
# the model, against 6-42% for the global mean, at nearly the same cost (one pooling, one small matmul).
LINEAR_CNN_GRID = 3
# Side of the map a sampled grid pooling ("sampled_grid_mean") averages: the map is read at every k-th row and
# column first (k = side // SAMPLED_SIDE). Pooling reads the whole site value, so a ramp on a large early map costs
# what the map weighs: on lite0-fmnist's stem (32x112x112 at batch 1) the 3x3 grid cost 2.7% of the 3.1 ms model,
# where a ramp on a 28x28 map costs under 1%. Averaged over a 3x3 grid, 28 samples a side still leave 9x9 per cell.
SAMPLED_SIDE = 28
# A linear ramp samples a map only where it reads at most every fourth row and column of it: ONNX Runtime's strided
# Slice costs about what pooling a whole 56x56 map does. The tap alone at batch 1 on one thread, in ONNX Runtime's
# blocked layout (medians of 15 interleaved rounds): 32x112x112 66 -> 24 us, 16x112x112 41 -> 16 us sampled 4x4;
# 24x56x56 17 -> 19 us sampled 2x2 (a ramp on a 28x28 map: 12 us)
MIN_SAMPLING_STRIDE = 4
# Reductions that average every channel's map with the same fixed weights: a linear ramp on one is evaluated
# in NumPy as two small matmuls, pooling as a matrix then the head (see `Ramp.evaluate`).
POOLING_REDUCTIONS = ("spatial_mean", "grid_mean", "sampled_grid_mean")
# Reductions of a (tokens, hidden) activation, one of which a text model's linear ramps take (`ZooEntry.token_reduce`)
TOKEN_REDUCTIONS = ("first_token", "token_mean", "token_mean_masked")


def grid_reduction(activation_shape: tuple[int, ...]) -> str:
    """How a linear ramp on a (C, H, W) map pools it: one `MIN_SAMPLING_STRIDE` times `SAMPLED_SIDE` a side or more
    is sampled first."""
    return "sampled_grid_mean" if min(activation_shape[1:]) >= MIN_SAMPLING_STRIDE * SAMPLED_SIDE else "grid_mean"


def sampling_stride(activation_shape: tuple[int, ...], reduce: str) -> int:
    """Every how many rows and columns of a (C, H, W) map `reduce` reads (1: all of them)."""
    return max(1, min(activation_shape[1:]) // SAMPLED_SIDE) if reduce == "sampled_grid_mean" else 1


def sampled(activation_shape: tuple[int, ...], reduce: str) -> tuple[tuple[int, ...], str]:
    """The (C, H, W) map a pooling reduction pools once sampled (`sampling_stride`), and the pooling it applies to it:
    sampling then "grid_mean" is "sampled_grid_mean"."""
    pooling = "grid_mean" if reduce == "sampled_grid_mean" else reduce
    stride = sampling_stride(activation_shape, reduce)
    if stride == 1:
        return activation_shape, pooling
    channels, height, width = activation_shape
    return (channels, -(-height // stride), -(-width // stride)), pooling


def separable_pooling(activation_shape: tuple[int, ...], reduce: str) -> tuple[np.ndarray, np.ndarray]:
    """A pooling reduction of (C, H, W) maps as a pooling of rows then of columns: (H, gh) and (W, gw) matrices of
    adaptive average pooling's bins (torch's: bin i of n over length L spans [floor(i L / n), ceil((i + 1) L / n))),
    so that pooling a map costs about gh passes over it instead of gh * gw."""
    if reduce not in POOLING_REDUCTIONS or len(activation_shape) != 3:
        raise ValueError(f"{reduce} over a {activation_shape} activation is no pooling of maps")
    grid = 1 if reduce == "spatial_mean" else LINEAR_CNN_GRID
    height, width = activation_shape[1:]

    def adaptive(length: int) -> np.ndarray:
        matrix = np.zeros((length, grid))
        for i in range(grid):
            start, stop = (i * length) // grid, -((-(i + 1) * length) // grid)
            matrix[start:stop, i] = 1.0 / (stop - start)
        return matrix

    return adaptive(height), adaptive(width)


def pooling_matrix(activation_shape: tuple[int, ...], reduce: str) -> np.ndarray:
    """(positions, pooled positions) in float64: a pooling reduction of one channel's (H, W) map as a matrix, cell
    i * gw + j the product of `separable_pooling`'s columns i and j, exact to float64 (the weights 1/3, 1/5... then
    round once, to whatever precision their user computes in)."""
    rows, columns = separable_pooling(activation_shape, reduce)
    height, width = activation_shape[1:]
    return np.einsum("hi,wj->hwij", rows, columns).reshape(height * width, -1)


def reduce_array(activation: np.ndarray, how: str) -> np.ndarray:
    """(n, features): the reduction `how` of a (tokens, hidden) or flattened activation, in NumPy, as
    `ramps.torch_reductions.reduce_activation` computes it (to float rounding). A pooling is `PooledLinear`'s."""
    if how == "first_token":
        return activation[:, 0]
    if how == "token_mean":
        return activation.mean(axis=1)
    if how == "token_mean_masked":  # see `ramps.torch_reductions.masked_token_mean`
        count = np.maximum((activation != 0).any(axis=2).sum(axis=1, keepdims=True), 1).astype(activation.dtype)
        return activation.sum(axis=1) / count
    if how == "identity":
        return activation.reshape(len(activation), -1)
    raise ValueError(f"{how!r} is not a reduction of tokens or the identity")


@dataclass(frozen=True, eq=False)  # holds arrays, which do not compare to a bool
class PooledLinear:
    """A pooling linear ramp as arrays for one activation shape: reduce(x) == (s.reshape(n * channels,
    positions) @ pool_t).reshape(n, -1) for the sampled map s (x itself unless `stride` > 1), and views of the
    head's parameters, through which in-place updates (optimiser steps, load_state_dict) show: the map is
    (reduce(x) - center) @ weight_t + bias, without a center for a map that has none, then for an MLP head
    max(0, that) @ out_weight_t + out_bias. `key` holds the shape and the parameters' storage addresses: a parameter
    replaced or moved to new storage makes it stale (the views keep the old storage alive, so its address cannot
    come back)."""

    key: tuple
    stride: int  # every how many rows and columns are pooled (`sampling_stride`)
    positions: int  # of the sampled map
    pool_t: np.ndarray  # (positions, pooled positions)
    weight_t: np.ndarray  # (features, outputs)
    bias: np.ndarray
    center: np.ndarray | None = None  # (features,)
    out_weight_t: np.ndarray | None = None  # an MLP head's output layer (hidden, classes)
    out_bias: np.ndarray | None = None

    @classmethod
    def build(cls, key: tuple, reduce: str, params: dict[str, np.ndarray]) -> PooledLinear:
        pool_t = pooling_matrix(*sampled(key[0], reduce)).astype(np.float32)
        center, out_weight = params.get("center"), params.get("out_weight")
        return cls(key, sampling_stride(key[0], reduce), len(pool_t), pool_t, params["weight"].T, params["bias"],
                   center, None if out_weight is None else out_weight.T, params.get("out_bias"))

    @classmethod
    def current(cls, arrays: PooledLinear | None, key: tuple, reduce: str,
                params: Callable[[], dict[str, np.ndarray]]) -> PooledLinear:
        """`arrays` if they were built for `key` (the activation's per-input shape first, then whatever identifies
        the parameters' storage), else new ones from `params()`: `weight` (outputs, features) as in nn.Linear,
        `bias`, an optional `center`, and an MLP head's `out_weight` and `out_bias`."""
        if arrays is None or arrays.key != key:
            arrays = cls.build(key, reduce, params())
        return arrays

    def __call__(self, activation: np.ndarray) -> np.ndarray:
        """(n, outputs): the linear map of the pooled activation (and an MLP head's output layer after it)."""
        flat = activation
        if self.stride > 1:
            flat = flat[:, :, ::self.stride, ::self.stride]
        pooled = (flat.reshape(-1, self.positions) @ self.pool_t).reshape(len(flat), -1)
        if self.center is not None:
            pooled -= self.center
        out = pooled @ self.weight_t
        out += self.bias
        if self.out_weight_t is not None:
            np.maximum(out, 0.0, out=out)
            out = out @ self.out_weight_t
            out += self.out_bias
        return out
