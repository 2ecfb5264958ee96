"""The trace simulator: queueing arithmetic, exit release times, delayed configurations, and an end-to-end run."""

from __future__ import annotations

import numpy as np
import pytest

from rampserve.bench.ramp_outputs import RampOutputs
from rampserve.bench.sim import Scenario, SimSettings, replay, replay_oracle, run_sim
from rampserve.control.controller import Controller, ControllerSettings
from rampserve.control.costs import CostModel
from rampserve.control.records import Configuration
from rampserve.runtime.latency import LatencyProfile

SITES = ("a", "b", "c")


def hand_profile() -> LatencyProfile:
    """Batch 1: segments of 0.25 ms (whole model 1 ms), ramps 0.01 ms; batch 2: everything twice as long."""
    return LatencyProfile(batch_sizes=(1, 2), sites=SITES, full_ms=(1.0, 2.0),
                          segment_ms={s: (0.25, 0.5) for s in (*SITES, "output")},
                          ramp_ms={s: (0.01, 0.02) for s in SITES})


def scenario(arrivals: list[float], errors: np.ndarray, labels: np.ndarray, final: np.ndarray,
             max_batch: int = 2) -> Scenario:
    outputs = RampOutputs(SITES, labels, errors, final)
    return Scenario(outputs, CostModel(hand_profile()), np.array(arrivals, dtype=float), max_batch)


def test_vanilla_latency_matches_the_queueing_arithmetic():
    n = 3
    s = scenario([0.0, 0.5, 0.6], np.ones((n, 3)), np.zeros((n, 3), int), np.zeros(n, int))
    run = replay(s, Configuration(0, (), ()))
    # [0] alone from 0 to 1; [0.5, 0.6] together from 1 to 3 (a batch of 2 costs 2 ms)
    np.testing.assert_allclose(run.queue.latency_ms, [1.0, 2.5, 2.4])
    assert run.correct.all() and not run.exited.any()


def test_exits_release_at_their_ramp_and_every_batch_pays_its_ramps():
    errors = np.array([[0.9, 0.1, 0.9], [0.9, 0.9, 0.9]])
    labels = np.array([[0, 1, 0], [0, 0, 0]])
    s = scenario([0.0, 5.0], errors, labels, final=np.array([1, 1]))
    run = replay(s, Configuration(0, ("b", "c"), (0.5, 0.5)))
    # input 0 leaves at b: two segments + b's ramp; input 1 runs to the end: the model + both ramps
    np.testing.assert_allclose(run.queue.latency_ms, [0.5 + 0.01, 1.0 + 0.02])
    assert run.exited.tolist() == [True, False] and run.correct.tolist() == [True, True]


def test_oracle_leaves_at_the_earliest_agreeing_site_for_free():
    labels = np.array([[2, 1, 1], [0, 0, 0], [0, 0, 0]])
    s = scenario([0.0, 10.0, 20.0], np.zeros((3, 3)), labels, final=np.array([1, 0, 3]))
    np.testing.assert_allclose(replay_oracle(s).queue.latency_ms, [0.5, 0.25, 1.0])


def test_a_new_configuration_applies_only_after_the_controller_would_have_computed_it():
    n = 40
    # every ramp is confidently wrong: the first batch exits wrongly, and risk control (one disagreement moves
    # the scale all the way) scales the thresholds to 0
    s = scenario(list(np.arange(n) * 0.3), np.full((n, 3), 0.05), np.ones((n, 3), int), np.zeros(n, int))
    controller = Controller(hand_profile(), ControllerSettings(initial=("b",), risk_step=1.0, ramp_adjustment=False,
                                                               start_thresholds={"b": 0.5}))
    run = replay(s, controller.configuration(), controller)
    assert not run.correct[0] and controller.decisions[1].configuration.thresholds == (0.0,)
    applied_at, config = run.applied[1]
    first_batch_end = run.queue.start_ms[0] + 1.0 + 0.01
    assert config.version == 1 and applied_at == pytest.approx(first_batch_end + controller.decisions[1].decision_ms)
    # requests served from then on no longer exit
    later = run.queue.start_ms >= applied_at
    assert later.any() and run.correct[later].all()


def test_end_to_end_run_on_a_prepared_model(resnet_bundle):
    settings = SimSettings(model="resnet18-fmnist", workload="fmnist-drift", trace="poisson", length=3000,
                           bundle=resnet_bundle, risk_step_sweep=(0.05, 0.2),
                           controller=ControllerSettings(ramp_budget=0.1))
    report = run_sim(settings).report
    systems = report["systems"]
    assert set(systems) >= {"vanilla", "rampserve", "oracle", "static_shared", "static_per_ramp",
                            "static_hindsight", "rampserve_no_adjust", "rampserve_no_tuning"}
    for summary in systems.values():
        for key in ("accuracy", "worst_window_accuracy", "p25_ms", "p50_ms", "p95_ms", "p99_ms", "throughput_rps"):
            assert np.isfinite(summary[key])
        assert summary["p25_ms"] <= summary["p50_ms"] <= summary["p95_ms"] <= summary["p99_ms"]
    assert systems["vanilla"]["accuracy"] == systems["oracle"]["accuracy"] == 1.0
    assert systems["vanilla"]["exit_share"] == 0.0
    assert systems["oracle"]["p50_ms"] <= systems["vanilla"]["p50_ms"]
    assert "oracle_share" in systems["rampserve"] and systems["rampserve"]["tunings"] >= 0
    assert report["requests"] == 2700 and set(report["risk_step_sweep"]) == {"0.05", "0.2"}
    assert report["decisions"][0]["version"] == 0


def test_in_stop_mode_an_exit_leaves_its_batch_and_the_rest_runs_at_fewer_rows():
    errors = np.array([[0.9, 0.1, 0.9], [0.9, 0.9, 0.9]])
    labels = np.array([[0, 1, 0], [0, 0, 0]])
    s = scenario([0.0, 0.0], errors, labels, final=np.array([1, 1]))
    config = Configuration(0, ("b",), (0.5,))
    heard = []

    class Listener(Controller):
        def observe(self, record):
            heard.append(record)
            return None

    listener = Listener(hand_profile(), ControllerSettings(initial=("b",), exit_mode="stop"))
    run = replay(s, config, listener, stop=True, feedback_share=0.0)
    # both run a and b at 2 rows (1 ms) and b's ramp (0.02 ms); input 1 alone runs c and the output (0.5 ms)
    np.testing.assert_allclose(run.queue.latency_ms, [1.02, 1.52])
    assert run.correct.tolist() == [True, True]
    (record,) = heard
    assert record.observed().tolist() == [False, True] and record.feedback_share == 0.0
    # every input drawn for feedback runs to the end: the batch costs what it costs in release mode
    kept = replay(s, config, stop=True, feedback_share=1.0)
    np.testing.assert_allclose(kept.queue.latency_ms, replay(s, config).queue.latency_ms)
