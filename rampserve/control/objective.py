"""What ramp sets are chosen for: a latency quantile or the mean, estimated from recorded ramp outputs and the
latency profile (through `CostModel`), before a set is ever deployed."""

from __future__ import annotations

import numpy as np

# p50/p95: that quantile of per-input latency; mean: mean latency; throughput: mean compute per input (stop mode,
# where an exited input leaves its batch and frees the rest of the model for others)
OBJECTIVES = ("p50", "p95", "mean", "throughput")
_QUANTILES = {"p50": 0.5, "p95": 0.95}


def weighted_quantile(values: np.ndarray, weights: np.ndarray, q: float) -> float:
    """The smallest value whose weighted share of values at or below it reaches q (0 for no values)."""
    values = np.asarray(values, dtype=np.float64)
    if not len(values):
        return 0.0
    order = np.argsort(values, kind="stable")
    cumulative = np.cumsum(np.asarray(weights, dtype=np.float64)[order])
    return float(values[order][min(int(np.searchsorted(cumulative, q * cumulative[-1] - 1e-12)), len(values) - 1)])


def objective_ms(latency_ms: np.ndarray, weights: np.ndarray, objective: str) -> float:
    """The objective's value (lower is better) over inputs with these latencies, each standing for `weights`."""
    if objective in _QUANTILES:
        return weighted_quantile(latency_ms, weights, _QUANTILES[objective])
    if objective in ("mean", "throughput"):
        total = float(np.sum(weights))
        return float(np.dot(latency_ms, weights) / total) if total else 0.0
    raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
