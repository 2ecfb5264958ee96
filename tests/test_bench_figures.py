"""Figures every benchmark reports per system: the share of 1,000-request windows below the accuracy target, a
managed system's exit mode, its configuration changes, and saturation as the highest rate whose p99 stays within
the SLO (pure helpers, and the simulators' use of them on a hand-made scenario)."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rampserve.bench.figures import (
    configuration_changes, controller_exit_mode, exit_mode_figures, windows_below_share,
)
from rampserve.bench.queueing import max_rate_within_slo
from rampserve.control.controller import ControllerSettings


# --- windows_below_share ------------------------------------------------------------------------------------------

def _brute_windows_below(correct: list[bool], min_accuracy: float, window: int) -> float | None:
    if not correct:
        return None
    full = len(correct) // window
    windows = [correct[i * window:(i + 1) * window] for i in range(full)] or [correct]
    return sum(sum(w) / len(w) < min_accuracy - 1e-12 for w in windows) / len(windows)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.booleans(), max_size=400), st.integers(1, 60), st.sampled_from([0.5, 0.9, 0.95, 0.99, 1.0]))
def test_windows_below_share_matches_a_window_by_window_count(correct, window, min_accuracy):
    share = windows_below_share(np.array(correct, dtype=bool), min_accuracy, window)
    expected = _brute_windows_below(correct, min_accuracy, window)
    assert share == (None if expected is None else pytest.approx(expected))
    if share is not None:
        assert 0.0 <= share <= 1.0


def test_windows_below_share_counts_full_windows_only_and_a_window_at_the_target_is_not_below():
    # 3 full windows of 1000: 990 right (exactly 0.99: not below), 989 right (below), all right; then a partial
    # window of 10 wrong answers, left out
    correct = np.ones(3010, dtype=bool)
    correct[:10] = False
    correct[1000:1011] = False
    correct[3000:] = False
    assert windows_below_share(correct, 0.99) == pytest.approx(1 / 3)
    assert windows_below_share(correct, 1 - 0.01) == pytest.approx(1 / 3)  # the constraint's rounding
    # no full window: the requests there are are the one window
    assert windows_below_share(np.array([True] * 98 + [False] * 2), 0.99) == 1.0
    assert windows_below_share(np.ones(999, dtype=bool), 0.99) == 0.0
    assert windows_below_share(np.zeros(0, dtype=bool), 0.99) is None
    with pytest.raises(ValueError):
        windows_below_share(correct, 0.99, window=0)


def test_exit_mode_figures_release_runs_every_row_to_the_end():
    assert exit_mode_figures("release", 0.1) == {"exit_mode": "release", "feedback_share": 1.0}
    assert exit_mode_figures("stop", 0.25) == {"exit_mode": "stop", "feedback_share": 0.25}
    with pytest.raises(ValueError):
        exit_mode_figures("sometimes", 0.1)

    assert controller_exit_mode(ControllerSettings(exit_mode="stop", feedback_share=0.2)) == \
        {"exit_mode": "stop", "feedback_share": 0.2}
    assert controller_exit_mode(ControllerSettings(exit_mode="release", feedback_share=0.2)) == \
        {"exit_mode": "release", "feedback_share": 1.0}


# --- configuration_changes --------------------------------------------------------------------------------------

@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.sampled_from("abcd"), max_size=3, unique=True).map(sorted), max_size=30))
def test_every_change_is_either_of_the_ramp_set_or_of_thresholds_alone(site_sets):
    changes = configuration_changes(site_sets)
    assert changes["ramp_set_changes"] + changes["threshold_changes"] == max(len(site_sets) - 1, 0)
    assert changes["ramp_set_changes"] == sum(site_sets[i] != site_sets[i - 1] for i in range(1, len(site_sets)))


def test_configuration_changes_compare_each_decision_with_the_one_before():
    decisions = [("a", "c"), ("a", "c"), ("b",), ("b",), ("b",), ("a", "c")]
    assert configuration_changes(decisions) == {"ramp_set_changes": 2, "threshold_changes": 3}
    assert configuration_changes([["a"]]) == configuration_changes([]) == \
        {"ramp_set_changes": 0, "threshold_changes": 0}


# --- max_rate_within_slo ----------------------------------------------------------------------------------------

def _counting(p99: Callable[[float], float]) -> tuple[Callable[[float], float], list[float]]:
    calls: list[float] = []

    def p99_at(rate: float) -> float:
        calls.append(rate)
        return p99(rate)

    return p99_at, calls


@settings(max_examples=200, deadline=None)
@given(st.floats(0.5, 5000.0), st.floats(0.001, 0.2), st.floats(1.0, 100.0))
def test_saturation_is_within_tolerance_below_where_a_monotone_p99_crosses_the_slo(threshold, rel_tol, slo):
    low, high = 0.1, 10_000.0
    # a queue's p99: flat below the knee, growing fast past it
    p99_at, calls = _counting(lambda r: slo * (0.5 if r <= threshold else 1.0 + (r - threshold)))
    rate = max_rate_within_slo(p99_at, slo, low, high, rel_tol)
    assert len(calls) <= 2 + math.ceil(math.log2(math.log(high / low) / math.log1p(rel_tol)))
    assert len(set(calls)) == len(calls)  # each rate asked once
    assert rate <= threshold and rate >= threshold / (1 + rel_tol) * (1 - 1e-12)
    assert p99_at(rate) <= slo


def test_saturation_at_the_bounds_and_for_bad_arguments():
    assert max_rate_within_slo(lambda r: 5.0, 1.0, 1.0, 100.0) == 0.0  # even the lowest rate misses
    assert max_rate_within_slo(lambda r: float("nan"), 1.0, 1.0, 100.0) == 0.0  # nothing answered misses
    assert max_rate_within_slo(lambda r: 0.5, 1.0, 1.0, 100.0) == 100.0  # the highest rate searched meets it
    assert max_rate_within_slo(lambda r: 0.5, 1.0, 3.0, 3.0) == 3.0
    assert max_rate_within_slo(lambda r: 1.0, 1.0, 1.0, 100.0) == 100.0  # at the SLO is within it
    for low, high, tol in ((0.0, 1.0, 0.01), (2.0, 1.0, 0.01), (1.0, 2.0, 0.0)):
        with pytest.raises(ValueError):
            max_rate_within_slo(lambda r: 0.0, 1.0, low, high, tol)


def test_saturation_of_a_simulated_queue_is_where_its_p99_crosses_the_slo():
    from rampserve.bench.queueing import fixed_cost, run_queue
    from rampserve.workloads.traces import arrival_times

    arrivals = arrival_times("poisson", 5000, 100.0, seed=1)

    def p99_at(rate: float) -> float:  # a 1 ms server, batches of 1: p99 within 3 ms well below 1000 rps
        queue = run_queue(arrivals * (100.0 / rate), 1, fixed_cost(lambda b: 1.0))
        return float(np.percentile(queue.latency_ms, 99))

    rate = max_rate_within_slo(p99_at, 3.0, 1.0, 5000.0, 0.01)
    assert 100.0 < rate < 1000.0
    assert p99_at(rate) <= 3.0 < p99_at(rate * 1.01)


# --- the simulators' (bench sim, bench freeze) saturation on a hand-made scenario -------------------------------------------------------------

def test_trace_saturation_keeps_the_trace_shape_and_finds_the_knee():
    from rampserve.bench.queueing import fixed_cost, run_queue
    from rampserve.bench.sim import SATURATION_HIGH, SystemRun, mean_rate_rps, trace_saturation
    from rampserve.workloads.traces import arrival_times

    arrivals = arrival_times("bursty", 4000, 50.0, seed=2)
    seen: list[np.ndarray] = []

    def run_at(scaled: np.ndarray) -> SystemRun:
        seen.append(scaled)
        queue = run_queue(scaled, 1, fixed_cost(lambda b: 2.0))
        n = len(scaled)
        return SystemRun(queue, np.ones(n, dtype=bool), np.full(n, -1))

    rate = trace_saturation(run_at, arrivals, slo_ms=4.0, capacity_rps=500.0, rel_tol=0.02)
    assert 0 < rate < 500.0 * SATURATION_HIGH
    for scaled in seen:  # every probe is the same trace, only faster or slower
        np.testing.assert_allclose(scaled / scaled[-1], arrivals / arrivals[-1])
    met = [mean_rate_rps(a) for a in seen
           if np.percentile(run_queue(a, 1, fixed_cost(lambda b: 2.0)).latency_ms, 99) <= 4.0]
    assert rate == pytest.approx(max(met))
