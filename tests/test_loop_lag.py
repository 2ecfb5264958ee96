"""The event-loop lag watch: its bookkeeping (pure), its wake-ups on a loop that is blocked on purpose, what a real
server reports of it in /metrics and /status, and what `bench live` makes of two status reports."""

from __future__ import annotations

import asyncio
import json
import re
import time
import urllib.request

import pytest
from bounded import run_bounded
from prometheus_client import generate_latest

from rampserve.bench.live import TABLE_COLUMNS, server_figures, table_rows
from rampserve.serving.executor.loading import load_served
from rampserve.serving.server import ServerSettings, build_state, running_server
from rampserve.serving.shared.metrics import SLOW_LAG_S, LagTracker, ServerMetrics, watch_loop_lag
from rampserve.serving.shared.settings import ModelSettings

STARTUP_GUARD_S = 30  # bounds a wait for the server's first samples: a hang fails instead of stalling the run


def test_the_tracker_keeps_the_latest_lag_the_largest_and_counts_the_slow_ones() -> None:
    tracker = LagTracker()
    assert tracker.to_json() == {"lag_ms": 0.0, "max_lag_ms": 0.0, "samples": 0, "lag_samples_over_5ms": 0}
    for lag in (0.001, 0.020, 0.002, SLOW_LAG_S, 0.006):
        tracker.observe(lag)
    assert (tracker.last_s, tracker.max_s, tracker.samples, tracker.slow) == (0.006, 0.020, 5, 2)
    assert tracker.to_json() == {"lag_ms": pytest.approx(6.0), "max_lag_ms": pytest.approx(20.0), "samples": 5,
                                 "lag_samples_over_5ms": 2}


def test_a_timer_that_fires_early_counts_as_no_lag() -> None:
    tracker = LagTracker()
    assert tracker.observe(-0.0008) == 0.0
    assert (tracker.last_s, tracker.max_s, tracker.samples) == (0.0, 0.0, 1)


def test_metrics_follow_the_tracker() -> None:
    metrics = ServerMetrics()
    for lag in (0.0002, 0.03, -0.0005):
        metrics.observe_loop_lag(lag)
    value = metrics.registry.get_sample_value
    assert value("rampserve_event_loop_lag_seconds") == 0.0
    assert value("rampserve_event_loop_lag_max_seconds") == pytest.approx(0.03)
    assert value("rampserve_event_loop_lag_distribution_seconds_count") == 3
    assert value("rampserve_event_loop_lag_distribution_seconds_bucket", {"le": "0.00025"}) == 2
    assert value("rampserve_event_loop_lag_distribution_seconds_sum") == pytest.approx(0.0302)


def test_the_watch_sees_a_loop_blocked_on_purpose_and_stops_when_cancelled() -> None:
    metrics = ServerMetrics()
    interval_s = 0.01
    blocked: list[float] = []  # when the block began and ended, on the watch's clock

    async def scenario() -> None:
        watch = asyncio.create_task(watch_loop_lag(metrics, interval_s=interval_s))
        while metrics.loop_lag.samples == 0:
            await asyncio.sleep(0.001)
        # The watch is suspended now, having read the clock before the block began: its next wake-up comes after
        # the block ends, so the lag it records covers the block, less the interval it meant to sleep
        blocked.append(time.perf_counter())
        time.sleep(0.1)
        blocked.append(time.perf_counter())
        seen = metrics.loop_lag.samples
        while metrics.loop_lag.samples == seen:
            await asyncio.sleep(0.001)
        watch.cancel()
        await asyncio.wait([watch])
        assert watch.cancelled()

    run_bounded(scenario())
    began, ended = blocked
    assert metrics.loop_lag.max_s >= ended - began - interval_s
    assert metrics.loop_lag.slow >= 1  # time.sleep(0.1) lasts 0.1 s at least: 90 ms of lag, over SLOW_LAG_S


def get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.read()


def test_a_running_server_reports_its_loop_lag(resnet_bundle) -> None:
    settings = ServerSettings(port=0, grpc=False)
    state = build_state([load_served(str(resnet_bundle))], ModelSettings(vanilla=True), settings)
    with running_server(state, settings) as url:
        deadline = time.monotonic() + STARTUP_GUARD_S
        while (event_loop := json.loads(get(url + "/status"))["event_loop"])["samples"] < 2:
            assert time.monotonic() < deadline, f"no lag samples within {STARTUP_GUARD_S} s: {event_loop}"
            time.sleep(0.01)
        metrics = get(url + "/metrics").decode()
    assert set(event_loop) == {"lag_ms", "max_lag_ms", "samples", "lag_samples_over_5ms"}
    assert 0.0 <= event_loop["lag_ms"] <= event_loop["max_lag_ms"]
    for name in ("rampserve_event_loop_lag_seconds", "rampserve_event_loop_lag_max_seconds",
                 "rampserve_event_loop_lag_distribution_seconds_count"):
        assert re.search(rf"^{name} \S+$", metrics, re.MULTILINE), name
    for family in ("rampserve_compiles_total counter", "rampserve_compile_seconds histogram",
                   "rampserve_configuration_changes_total counter"):
        assert f"# TYPE {family}\n" in metrics, family
    # the state's own registry is what /metrics serves
    assert "rampserve_event_loop_lag_max_seconds" in generate_latest(state.metrics.registry).decode()


def test_bench_live_reads_configuration_changes_and_loop_lag_from_two_status_reports() -> None:
    def status(version: int, slow: int, max_lag_ms: float) -> dict:
        return {"models": {"m": {"configuration": {"version": version, "sites": [], "thresholds": []}}},
                "event_loop": {"lag_ms": 0.1, "max_lag_ms": max_lag_ms, "samples": 100,
                               "lag_samples_over_5ms": slow}}

    figures = server_figures(status(3, 4, 12.5), status(7, 10, 30.0), "m")
    assert figures == {"config_changes": 4, "ramp_set_changes": None, "threshold_changes": None,
                       "max_loop_lag_ms": 30.0, "loop_lag_samples_over_5ms": 6}
    # a peer's status, a failed read, an unknown model: nothing to report
    assert set(server_figures({"replicas": 2}, {"replicas": 2}, "m").values()) == {None}
    assert server_figures("GET /status: timed out", status(1, 0, 1.0), "m") == \
        {"config_changes": None, "ramp_set_changes": None, "threshold_changes": None, "max_loop_lag_ms": 1.0,
         "loop_lag_samples_over_5ms": None}
    assert server_figures(status(1, 0, 1.0), status(1, 0, 1.0), "other")["config_changes"] is None


def test_bench_live_tells_ramp_set_changes_from_threshold_changes_made_between_two_status_reports() -> None:
    def decision(version: int, *sites: str) -> dict:
        return {"version": version, "sites": list(sites), "thresholds": [0.1] * len(sites), "observed": 0,
                "reason": ""}

    def status(*decisions: dict) -> dict:
        return {"models": {"m": {"configuration": decisions[-1], "decisions": list(decisions)}}}

    made = [decision(0, "a"), decision(1, "a"), decision(2, "b"), decision(3, "b", "c"), decision(4, "b", "c"),
            decision(5, "b", "c")]
    # decision 1 was in force at the first read: from it, 2 and 3 changed the set, 4 and 5 thresholds alone
    figures = server_figures(status(*made[:2]), status(*made), "m")
    assert (figures["config_changes"], figures["ramp_set_changes"], figures["threshold_changes"]) == (4, 2, 2)
    # nothing decided in between; no decisions at all (vanilla)
    assert server_figures(status(*made), status(*made), "m")["ramp_set_changes"] == 0
    vanilla = {"models": {"m": {"configuration": decision(0)}}}
    assert server_figures(vanilla, vanilla, "m")["threshold_changes"] is None


def test_the_live_table_shows_configuration_changes_and_loop_lag() -> None:
    system = {"requests": 100, "shed": 0, "failed": 0, "p25_ms": 1.0, "p50_ms": 2.0, "p95_ms": 5.0,
              "p99_ms": 9.0, "throughput_rps": 100.0, "accuracy": 1.0, "worst_window_accuracy": None,
              "exit_share": 0.0, "mean_batch_size": None, "oracle_share": None}
    report = {"systems": {"vanilla": system | {"config_changes": 0, "max_loop_lag_ms": 12.34,
                                               "loop_lag_samples_over_5ms": 3},
                          "peer": system,
                          "rampserve": system | {"config_changes": 7, "ramp_set_changes": 2, "threshold_changes": 5}}}
    vanilla, peer, managed = (dict(zip(TABLE_COLUMNS, row, strict=True)) for row in table_rows(report))
    assert (vanilla["configs"], vanilla["max loop lag ms"], vanilla["lag >5 ms"]) == ("0", "12.3", "3")
    assert (peer["configs"], peer["max loop lag ms"], peer["lag >5 ms"]) == ("-", "-", "-")
    assert (managed["configs"], managed["set changes"], managed["threshold changes"]) == ("7", "2", "5")
    assert (peer["set changes"], peer["threshold changes"]) == ("-", "-")
