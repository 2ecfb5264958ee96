"""What ramp sets are chosen for: a latency quantile or the mean, estimated from recorded ramp outputs and the
latency profile (through `CostModel`), before a set is ever deployed."""

from __future__ import annotations

import numpy as np

# p50/p95: that quantile of per-input latency; mean: mean latency; throughput: mean compute per input (stop mode,
# where an exited input leaves its batch and frees the rest of the model for others)
OBJECTIVES = ("p50", "p95", "mean", "throughput")
# A quantile is judged as the mean of the quantiles in a band around it: per-input latencies take a few values (one
# per exit site), so the quantile itself jumps from one to the next as an estimate's exit share crosses it, and a set
# estimated at 51% exits on a sample serves most windows of the stream at 49% (measured on resnet18-fmnist: the
# search flipped between such sets 32 times in 108k inputs)
_QUANTILES = {"p50": (0.5, 0.1), "p95": (0.95, 0.04)}  # (quantile, half-width of its band)
_BAND_POINTS = 9


def weighted_quantiles(values: np.ndarray, weights: np.ndarray, qs: np.ndarray) -> np.ndarray:
    """For each q, the smallest value whose weighted share of values at or below it reaches q (0 for no values)."""
    values = np.asarray(values, dtype=np.float64)
    if not len(values):
        return np.zeros(len(qs))
    order = np.argsort(values, kind="stable")
    cumulative = np.cumsum(np.asarray(weights, dtype=np.float64)[order])
    at = np.searchsorted(cumulative, np.asarray(qs) * cumulative[-1] - 1e-12)
    return values[order][np.minimum(at, len(values) - 1)]


def objective_ms(latency_ms: np.ndarray, weights: np.ndarray, objective: str) -> float:
    """The objective's value (lower is better) over inputs with these latencies, each standing for `weights`."""
    if objective in _QUANTILES:
        q, half = _QUANTILES[objective]
        band = np.linspace(q - half, min(q + half, 1.0), _BAND_POINTS)
        return float(weighted_quantiles(latency_ms, weights, band).mean())
    if objective in ("mean", "throughput"):
        total = float(np.sum(weights))
        return float(np.dot(latency_ms, weights) / total) if total else 0.0
    raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")


def serving_waits(waits: np.ndarray) -> np.ndarray:
    """Queue waits to judge sets with: each measured one (a number) as it is; each unknown one (NaN: measured in the
    warm-up, when every batch runs every ramp and queues for it: median 4.6 ms on minilm-rt at 60 rps against
    0.3 ms once one batch in ten does) drawn from the measured ones' distribution at evenly spaced quantiles in a
    fixed shuffled order, since in release mode what an input waits does not depend on what it is; none measured:
    no wait (service time alone)."""
    waits = np.asarray(waits, dtype=np.float64)
    unknown = np.isnan(waits)
    if not unknown.any():
        return waits
    known = waits[~unknown]
    filled = waits.copy()
    count = int(unknown.sum())
    quantiles = (np.random.default_rng(0).permutation(count) + 0.5) / count
    filled[unknown] = np.quantile(known, quantiles) if len(known) else 0.0
    return filled
