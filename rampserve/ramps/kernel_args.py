"""A linear ramp's arguments as the ramp operators take them (`kernels/ramp_math.h`): torch's (`kernel`, called by
`fused.FusedRamp`) and ONNX Runtime's (`onnx_kernel`, a node of `onnx_fused.ramp_tap`). Both operators compute
the same arithmetic, so both are handed the same arrays, made here."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from rampserve.ramps.arrays import RampArrays
from rampserve.ramps.pooling import POOLING_REDUCTIONS, pooling_matrix, sampled

KERNELS = Path(__file__).with_name("kernels")
ARITHMETIC = KERNELS / "ramp_math.h"  # included by both operators' sources: part of what each build depends on
# The reductions and error scores as the operators number them
REDUCE_CODES = {"identity": 0, "first_token": 1, "token_mean": 2, "token_mean_masked": 4}
POOLED = 3  # a pooling reduction, given to the operator as a matrix
LANES = 16  # the operators' vector width: a pooling matrix's cells are padded to a multiple of it
SCORE_CODES = {"max_prob": 0, "entropy": 1}
DISABLE_ENV = "RAMPSERVE_NO_RAMP_KERNEL"  # set to 1 to serve without the operators (ramps as the engine's own)


def takes(ramp: RampArrays) -> bool:
    """Whether the operators compute `ramp`: a linear one, reducing as they can."""
    return ramp.spec.kind == "linear" and (ramp.spec.reduce in REDUCE_CODES or ramp.spec.reduce in POOLING_REDUCTIONS)


@dataclass(frozen=True)
class KernelArgs:
    """weight (classes, features), bias, center (features,) in float32, contiguous; `pool` the (positions, cells
    rounded up to LANES) matrix of a pooling ramp on its sampled map, zero beyond its cells, else (0, 0)."""

    weight: np.ndarray
    bias: np.ndarray
    center: np.ndarray
    pool: np.ndarray
    reduce: int

    @classmethod
    def of(cls, ramp: RampArrays, activation_shape: tuple[int, ...]) -> KernelArgs:
        """`ramp` (see `takes`) on a site whose per-input activation has `activation_shape`."""
        if not takes(ramp):
            raise ValueError(f"the ramp operators take linear ramps, not a {ramp.spec.kind} ramp reducing by "
                             f"{ramp.spec.reduce}")
        (weight, bias), = ramp.layers
        pools = ramp.spec.reduce in POOLING_REDUCTIONS
        pool = pooling_matrix(*sampled(activation_shape, ramp.spec.reduce)) if pools else np.zeros((0, 0))
        padded = np.zeros((pool.shape[0], LANES * -(-pool.shape[1] // LANES)), dtype=np.float32)
        padded[:, :pool.shape[1]] = pool
        return cls(*(np.ascontiguousarray(a, dtype=np.float32) for a in (weight, bias, ramp.center)), padded,
                   POOLED if pools else REDUCE_CODES[ramp.spec.reduce])
