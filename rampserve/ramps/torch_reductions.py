"""The reductions of a site's activation in torch: what training reduces a bootstrap's activations with, a deep
head's grid, and the reference `ramps.pooling`'s NumPy reductions and pooling matrices are checked against."""

from __future__ import annotations

import numpy as np
import torch
from torch.nn import functional as F

from rampserve.ramps.pooling import DEEP_CNN_GRID, LINEAR_CNN_GRID, sampling_stride


def reduce_activation(activation: torch.Tensor, how: str) -> torch.Tensor:
    if how == "spatial_mean":
        return activation.mean(dim=(2, 3))
    if how == "spatial_grid":
        return F.adaptive_avg_pool2d(activation, DEEP_CNN_GRID)
    if how == "grid_mean":
        return F.adaptive_avg_pool2d(activation, LINEAR_CNN_GRID).flatten(1)
    if how == "sampled_grid_mean":
        stride = sampling_stride(tuple(activation.shape[1:]), how)
        return F.adaptive_avg_pool2d(activation[:, :, ::stride, ::stride], LINEAR_CNN_GRID).flatten(1)
    if how == "first_token":
        return activation[:, 0]
    if how == "token_mean":
        return activation.mean(dim=1)
    if how == "token_mean_masked":
        return masked_token_mean(activation)
    if how == "identity":
        return activation.flatten(1)
    raise ValueError(f"unknown reduction {how!r}")


def masked_token_mean(activation: torch.Tensor) -> torch.Tensor:
    """(n, tokens, hidden) -> (n, hidden): the mean over the tokens whose rows are not all zero.

    An encoder whose layers zero the hidden states of padded positions (the zoo's and Hugging Face adapters'
    layers do) gives every input the same features however much the batch pads it, where `token_mean` divides
    by the padded length. A real token's row is never exactly zero after a layer norm; an input of padding
    only gives zeros."""
    present = activation.ne(0).any(dim=2, keepdim=True)
    count = present.sum(dim=1).clamp_min(1).to(activation.dtype)
    return activation.sum(dim=1) / count


def as_array(activation: torch.Tensor | np.ndarray) -> np.ndarray:
    """An activation as the backend gives it (a tensor of torch's, an array of ONNX Runtime's) as an array."""
    return activation if isinstance(activation, np.ndarray) else activation.numpy(force=True)
