"""A work-conserving single-server batch queue: the core of the trace simulator.

Whenever the server is free and requests wait, it starts a batch of the oldest ones (up to the max batch
size) at once; it never holds requests back to fill a batch. What a batch costs and when each of its inputs
is answered is the caller's (`ServeBatch`), called once per batch in time order, so a policy may change
between batches.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class BatchOutcome:
    duration_ms: float  # how long the server is busy with the batch
    release_ms: np.ndarray  # per input, offset from the batch start at which its answer is released


@dataclass(frozen=True)
class QueueResult:
    arrival_ms: np.ndarray
    start_ms: np.ndarray  # start of each request's batch
    release_ms: np.ndarray  # when each request was answered
    batch_of: np.ndarray  # batch index per request
    batch_sizes: np.ndarray  # per batch
    busy_ms: float

    @property
    def latency_ms(self) -> np.ndarray:
        return self.release_ms - self.arrival_ms

    @property
    def queue_ms(self) -> np.ndarray:
        return self.start_ms - self.arrival_ms

    def throughput_rps(self) -> float:
        span = float(self.release_ms.max() - self.arrival_ms.min()) if len(self.arrival_ms) else 0.0
        return len(self.arrival_ms) / span * 1000.0 if span > 0 else 0.0


ServeBatch = Callable[[float, np.ndarray], BatchOutcome]


def run_queue(arrival_ms: np.ndarray, max_batch: int, serve: ServeBatch) -> QueueResult:
    arrival_ms = np.asarray(arrival_ms, dtype=np.float64)
    if max_batch < 1:
        raise ValueError(f"max batch size must be at least 1, got {max_batch}")
    if len(arrival_ms) > 1 and np.any(np.diff(arrival_ms) < 0):
        raise ValueError("arrival times must be sorted")
    n = len(arrival_ms)
    start = np.empty(n)
    release = np.empty(n)
    batch_of = np.empty(n, dtype=np.int64)
    sizes: list[int] = []
    busy = 0.0
    now = 0.0
    head = 0  # oldest request not yet served
    while head < n:
        now = max(now, arrival_ms[head])
        arrived = int(np.searchsorted(arrival_ms, now, side="right"))
        stop = min(arrived, head + max_batch)
        requests = np.arange(head, stop)
        outcome = serve(now, requests)
        offsets = np.asarray(outcome.release_ms, dtype=np.float64)
        if offsets.shape != (len(requests),):
            raise ValueError(f"a batch of {len(requests)} got {offsets.shape} release offsets")
        if len(offsets) and (offsets.min() < 0 or offsets.max() > outcome.duration_ms + 1e-9):
            raise ValueError(f"release offsets must lie within the batch's {outcome.duration_ms} ms")
        start[head:stop] = now
        release[head:stop] = now + offsets
        batch_of[head:stop] = len(sizes)
        sizes.append(len(requests))
        busy += outcome.duration_ms
        now += outcome.duration_ms
        head = stop
    return QueueResult(arrival_ms, start, release, batch_of, np.array(sizes, dtype=np.int64), busy)


def fixed_cost(cost_ms: Callable[[int], float]) -> ServeBatch:
    """The vanilla server: a batch of b costs `cost_ms(b)` and every input is answered at its end."""
    def serve(_start: float, requests: np.ndarray) -> BatchOutcome:
        duration = cost_ms(len(requests))
        return BatchOutcome(duration, np.full(len(requests), duration))

    return serve


def max_rate_within_slo(p99_at: Callable[[float], float], slo_ms: float, low_rps: float, high_rps: float,
                        rel_tol: float = 0.01) -> float:
    """The highest arrival rate in [low_rps, high_rps] whose p99 latency (`p99_at(rate)`, ms) stays within the
    SLO: a system's saturation under a trace (the trace replayed faster or slower, its shape kept, is the caller's).

    Bisection on a log scale (rates span orders of magnitude) until the rate that met the SLO and the one that
    missed it are within `rel_tol` of each other; the one that met it is returned. It assumes p99 grows with the
    rate, as a queue fed faster never waits less on the same trace; where it does not, what is returned met the SLO
    at a rate at most `rel_tol` below one that missed it. 0.0 when even `low_rps` misses the SLO, `high_rps` when
    it meets it. A p99 that is NaN (no request answered) misses. `p99_at` is called at most
    2 + ceil(log2(ln(high/low) / ln(1 + rel_tol))) times, never twice at the same rate."""
    if not 0 < low_rps <= high_rps:
        raise ValueError(f"rate bounds must satisfy 0 < low <= high, got {low_rps}, {high_rps}")
    if rel_tol <= 0:
        raise ValueError(f"relative tolerance must be > 0, got {rel_tol}")

    def meets(rate: float) -> bool:
        return bool(p99_at(rate) <= slo_ms)  # False for NaN

    if not meets(low_rps):
        return 0.0
    if high_rps == low_rps or meets(high_rps):
        return high_rps
    low, high = low_rps, high_rps  # low meets the SLO, high misses it
    while high > low * (1.0 + rel_tol):
        middle = float(np.sqrt(low * high))
        if middle <= low or middle >= high:  # floating point: no rate left between them
            break
        if meets(middle):
            low = middle
        else:
            high = middle
    return low
