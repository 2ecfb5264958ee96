"""Arrival traces and the work-conserving batch queue under the trace simulator."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rampserve.bench.queueing import BatchOutcome, fixed_cost, run_queue
from rampserve.bundle_format.latency import max_batch_for_slo
from rampserve.workloads.traces import TRACES, arrival_times, rate_over_time


@pytest.mark.parametrize("trace", TRACES)
def test_traces_are_deterministic_sorted_and_keep_their_mean_rate(trace):
    first = arrival_times(trace, 40_000, 200.0, seed=3)
    assert np.array_equal(first, arrival_times(trace, 40_000, 200.0, seed=3))
    assert not np.array_equal(first, arrival_times(trace, 40_000, 200.0, seed=4))
    assert len(first) == 40_000 and np.all(np.diff(first) >= 0) and first[0] >= 0
    rate = len(first) / (first[-1] / 1000.0)
    assert rate == pytest.approx(200.0, rel=0.35 if trace == "maf" else 0.1)


def test_bursty_gaps_vary_more_than_poisson_gaps():
    def variation(trace: str) -> float:
        gaps = np.diff(arrival_times(trace, 20_000, 100.0))
        return gaps.std() / gaps.mean()

    assert variation("bursty") > 1.2 * variation("poisson")


def test_maf_rate_changes_from_minute_to_minute():
    arrivals = arrival_times("maf", 100_000, 300.0, seed=0)
    _, per_minute = rate_over_time(arrivals, 60_000.0)
    assert len(per_minute) >= 5
    assert per_minute[:-1].max() > 1.5 * per_minute[:-1].min()


def test_bad_trace_arguments_are_refused():
    with pytest.raises(ValueError, match="known: poisson"):
        arrival_times("uniform", 10, 1.0)
    with pytest.raises(ValueError, match="positive rate"):
        arrival_times("poisson", 10, 0.0)


def test_vanilla_queue_matches_the_arithmetic():
    five = fixed_cost(lambda b: 5.0)
    batched = run_queue(np.array([0.0, 1.0, 2.0]), 8, five)
    np.testing.assert_allclose(batched.latency_ms, [5.0, 9.0, 8.0])  # [0] then [1, 2] together from 5 to 10
    fifo = run_queue(np.array([0.0, 1.0, 2.0]), 1, five)
    np.testing.assert_allclose(fifo.latency_ms, [5.0, 9.0, 13.0])
    idle = run_queue(np.array([0.0, 20.0]), 8, five)  # the server waits for the next arrival
    np.testing.assert_allclose(idle.start_ms, [0.0, 20.0])
    assert batched.batch_sizes.tolist() == [1, 2] and batched.busy_ms == 10.0


def test_early_release_offsets_set_each_requests_latency():
    def serve(start: float, requests: np.ndarray) -> BatchOutcome:
        return BatchOutcome(4.0, np.where(requests % 2 == 0, 1.0, 4.0))

    result = run_queue(np.array([0.0, 0.5, 0.6]), 2, serve)
    # [0] from 0 to 4 (released at 1); [1, 2] from 4: 1 leaves at the end, 2 at offset 1
    np.testing.assert_allclose(result.release_ms, [1.0, 8.0, 5.0])


def test_queue_refuses_unsorted_arrivals_and_bad_outcomes():
    with pytest.raises(ValueError, match="sorted"):
        run_queue(np.array([1.0, 0.0]), 2, fixed_cost(lambda b: 1.0))
    with pytest.raises(ValueError, match="at least 1"):
        run_queue(np.array([0.0]), 0, fixed_cost(lambda b: 1.0))
    with pytest.raises(ValueError, match="within the batch"):
        run_queue(np.array([0.0]), 1, lambda s, r: BatchOutcome(1.0, np.array([2.0])))
    with pytest.raises(ValueError, match="release offsets"):
        run_queue(np.array([0.0]), 1, lambda s, r: BatchOutcome(1.0, np.array([0.5, 0.5])))


def test_max_batch_is_the_largest_that_fits_the_slo():
    assert max_batch_for_slo((1, 2, 4, 8), (1.0, 1.5, 2.5, 4.0), 3.0) == 4
    assert max_batch_for_slo((1, 2), (5.0, 6.0), 3.0) == 1


@settings(max_examples=100, deadline=None)
@given(st.lists(st.floats(0, 100), min_size=1, max_size=60), st.integers(1, 6), st.floats(0.1, 10))
def test_queue_serves_everyone_once_and_never_idles_while_requests_wait(gaps, max_batch, cost):
    arrivals = np.cumsum(gaps)
    calls = []

    def serve(start: float, requests: np.ndarray) -> BatchOutcome:
        calls.append((start, requests.copy()))
        return BatchOutcome(cost, np.full(len(requests), cost))

    result = run_queue(arrivals, max_batch, serve)
    served = np.concatenate([r for _, r in calls])
    assert np.array_equal(served, np.arange(len(arrivals)))  # each once, oldest first
    assert all(len(r) <= max_batch for _, r in calls)
    assert np.all(result.start_ms >= arrivals)
    previous_end = 0.0
    for start, requests in calls:
        assert start == max(previous_end, arrivals[requests[0]])  # work-conserving
        waiting = arrivals[requests[-1] + 1:] <= start
        assert len(requests) == max_batch or not waiting.any()  # a partial batch left nobody waiting
        previous_end = start + cost
