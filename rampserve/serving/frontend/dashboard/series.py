"""The dashboard's arithmetic, free of I/O and clocks: rates from counters, quantiles from histogram deltas, one
model's point of the time series from two readings, and the bounded ring of samples the browser pages through."""

from __future__ import annotations

import bisect
import itertools
import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace


def counter_delta(before: float, after: float) -> float:
    """What a counter counted between two readings. A counter that went down was reset (an executor process
    started again counts from 0): everything it holds now came after the reset, as Prometheus' rate() takes it."""
    return after - before if after >= before else after


def counter_deltas(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    """`counter_delta` per key of `after` (a key new since `before` counted from 0)."""
    return {key: counter_delta(before.get(key, 0.0), value) for key, value in after.items()}


def bucket_deltas(before: Sequence[float], after: Sequence[float]) -> list[float]:
    """Per-bucket counts between two readings of one cumulative histogram (Prometheus' `le` buckets, +Inf last).
    A reset (any cumulative count went down) restarts the histogram: then `after` is the interval's whole."""
    if len(before) != len(after) or any(a < b for b, a in zip(before, after)):
        return list(after)
    return [a - b for b, a in zip(before, after)]


def histogram_quantile(bounds: Sequence[float], cumulative: Sequence[float], q: float) -> float | None:
    """The q-quantile (0 < q < 1) of the observations a cumulative histogram counts (`bounds`: the buckets' upper
    bounds, +Inf last), interpolated linearly within its bucket as Prometheus' histogram_quantile does: the first
    bucket starts at 0, and a quantile in the +Inf bucket is the largest finite bound. None with no observations."""
    if not 0.0 < q < 1.0:
        raise ValueError(f"quantile must lie strictly between 0 and 1, got {q}")
    if len(bounds) != len(cumulative) or not bounds or not math.isinf(bounds[-1]):
        raise ValueError("a histogram's buckets end with +Inf, and each has a count")
    total = cumulative[-1]
    if total <= 0:
        return None
    rank = q * total
    i = bisect.bisect_left(cumulative, rank)  # the first bucket holding at least `rank` observations
    if i == len(bounds) - 1:
        return bounds[-2] if len(bounds) > 1 else None
    lower = 0.0 if i == 0 else bounds[i - 1]
    below = 0.0 if i == 0 else cumulative[i - 1]
    inside = cumulative[i] - below
    return lower + (bounds[i] - lower) * (rank - below) / inside


@dataclass(frozen=True)
class ModelReading:
    """What the sampler read of one model at one moment: counters (cumulative since the server or the executor
    process started) and gauges. Fields a model does not have (a predictor with no executor, a vanilla model with
    no controller) are None or empty."""

    requests: float = 0.0  # answered requests (the front end's count)
    errors: float = 0.0  # refused or failed ones
    latency: tuple[float, ...] = ()  # the front end's request latency histogram, cumulative bucket counts
    executor: int | None = None  # the executor's process (its pid): counters below are that process's
    # The executor did not answer: its counters are those of the last reading, its gauges unknown
    stale: bool = False
    queued: float | None = None  # inputs waiting in the executor's queue
    batches: float | None = None  # batches whose books are kept
    inputs: float | None = None  # inputs of those batches
    exits: Mapping[str, float] = field(default_factory=dict)  # inputs answered per site ("final": the last layer)
    thresholds: Mapping[str, float] = field(default_factory=dict)  # the configuration in force
    config_version: int | None = None
    window_accuracy: float | None = None
    # 1 - the guarantee's upper confidence bound on the share of answers that differ: accuracy it certifies
    accuracy_bound: float | None = None


def model_point(before: ModelReading, after: ModelReading, seconds: float,
                latency_bounds: Sequence[float]) -> dict:
    """One model's point of the time series over the `seconds` between two readings: rates per second, latency
    quantiles in ms from the requests answered in between, the queue now, the mean batch in between, inputs
    answered per site in between, and the configuration's and the controller's state now."""
    if seconds <= 0:
        raise ValueError(f"readings must be apart in time, got {seconds} s")
    if before.executor != after.executor:  # another process (a restart): its counters started from 0
        before = replace(before, batches=None, inputs=None, exits={})
    latency = bucket_deltas(before.latency, after.latency) if after.latency else []

    def quantile_ms(q: float) -> float | None:
        value = histogram_quantile(latency_bounds, latency, q) if latency else None
        return None if value is None else value * 1000.0

    batches = inputs = None
    if after.batches is not None and after.inputs is not None:
        batches = counter_delta(before.batches or 0.0, after.batches)
        inputs = counter_delta(before.inputs or 0.0, after.inputs)
    known = not after.stale
    return {
        "rps": counter_delta(before.requests, after.requests) / seconds,
        "errors_ps": counter_delta(before.errors, after.errors) / seconds,
        "p50_ms": quantile_ms(0.5),
        "p99_ms": quantile_ms(0.99),
        "queue": after.queued if known else None,
        "batch": inputs / batches if batches else None,
        "exits": counter_deltas(before.exits, after.exits),
        "thresholds": dict(after.thresholds) if known else {},
        "config_version": after.config_version if known else None,
        "accuracy": after.window_accuracy if known else None,
        "accuracy_bound": after.accuracy_bound if known else None,
    }


class SampleRing:
    """The last `capacity` samples, each numbered in order, so that a client that has seen up to sequence number
    `s` asks only for what came after it."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"a ring holds at least one sample, got {capacity}")
        self.capacity = capacity
        self._samples: deque[tuple[int, dict]] = deque(maxlen=capacity)
        self._numbers = itertools.count(1)

    def append(self, sample: dict) -> int:
        """Keep `sample` (dropping the oldest when full); returns its sequence number."""
        seq = next(self._numbers)
        self._samples.append((seq, sample))
        return seq

    @property
    def last_seq(self) -> int:
        return self._samples[-1][0] if self._samples else 0

    def since(self, seq: int) -> list[dict]:
        """The samples numbered after `seq`, oldest first, each with its number as "seq" (all when `seq` is older
        than the oldest kept: a client that fell behind starts over from what is left)."""
        samples = self._samples
        if not samples or seq >= samples[-1][0]:
            return []
        skip = max(0, seq - samples[0][0] + 1)  # numbers are consecutive: the position follows from the number
        return [{"seq": n, **sample} for n, sample in itertools.islice(samples, skip, None)]

    def __len__(self) -> int:
        return len(self._samples)
