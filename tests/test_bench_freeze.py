"""`bench freeze` end to end on the small ResNet with a cache ramp at every site: every system reports its
saturation rate and the share of 1,000-request windows below the accuracy target; managed systems their exit mode."""

from __future__ import annotations

import json

import numpy as np
import pytest

from rampserve.bench import freeze
from rampserve.bench.freeze import FreezeSettings, freeze_model
from rampserve.bench.sim import SATURATION_HIGH
from rampserve.control.controller import ControllerSettings

MANAGED = ("managed", "managed_online", "managed_thresholds_only", "managed_default_budget")


def test_every_freeze_system_reports_saturation_and_windows_below_the_target(cache_bundle, monkeypatch):
    monkeypatch.setattr(freeze, "cache_bundle", lambda *_args, **_kwargs: cache_bundle)
    # A coarse saturation search (each step doubles or halves the rate): the test checks what is reported, and
    # each step is a whole replay
    settings = FreezeSettings(models=("resnet18-fmnist",), requests=1000, small=True, saturation_tolerance=1.0,
                              controller=ControllerSettings(ramp_budget=0.1))
    report = freeze_model("resnet18-fmnist", settings).report
    json.dumps(report)  # JSON-ready
    systems = report["systems"]
    assert set(systems) == {"static", "static_online", *MANAGED, "vanilla"}
    capacity = report["saturation"]["capacity_rps"]
    for name, s in systems.items():
        # one window of 1,000 requests: below the target or not
        assert s["windows_below_share"] in (0.0, 1.0), name
        assert 0.0 <= s["saturation_rps"] <= SATURATION_HIGH * capacity, name
        assert ("exit_mode" in s) == (name in MANAGED), name
    assert systems["vanilla"]["windows_below_share"] == 0.0  # the original model agrees with itself
    # vanilla at a p99 of twice its batch-1 time: it takes a load, and no more than it can serve
    assert 0.0 < systems["vanilla"]["saturation_rps"] <= capacity * 1.01
    for name in MANAGED:
        mode = systems[name]
        assert mode["exit_mode"] in ("release", "stop")
        assert mode["feedback_share"] == (1.0 if mode["exit_mode"] == "release" else pytest.approx(
            settings.controller.feedback_share))


def test_caches_beside_ramps_report_each_system_against_vanilla_over_seeds(resnet_bundle, cache_bundle, monkeypatch):
    from rampserve.bench.freeze import ExitKindsSettings, exit_kinds_tables, run_exit_kinds

    bundles = {"ramps": resnet_bundle, "caches": cache_bundle, "mixed": cache_bundle}
    monkeypatch.setattr(freeze, "exit_kind_bundles", lambda _settings: bundles)
    settings = ExitKindsSettings(model="resnet18-fmnist", seeds=2, length=1500, lookup_rounds=3, small=True,
                                 controller=ControllerSettings(ramp_budget=0.1))
    report = run_exit_kinds(settings)
    json.dumps(report)  # JSON-ready
    assert [r["seed"] for r in report["per_seed"]] == [0, 1]
    managed = ("ramps", "caches", "caches_every_site", "mixed", "ramps_and_caches", "caches_at_ramp_cost")
    for seed in report["per_seed"]:
        systems = seed["systems"]
        assert set(systems) == {"vanilla", *managed, "ramps_oracle", "caches_oracle"}
        assert systems["vanilla"]["p50_ratio"] == 1.0 and systems["vanilla"]["exit_share"] == 0.0
        for name in managed:
            assert systems[name]["exit_mode"] in ("release", "stop")
            assert systems[name]["p50_ratio"] == pytest.approx(
                systems[name]["p50_ms"] / seed["vanilla_p50_ms"][name.split("_")[0]])
        assert systems["caches_oracle"]["accuracy"] == systems["ramps_oracle"]["accuracy"] == 1.0
    summary = report["summary"]
    for name, figures in summary.items():
        assert figures["p50_ratio"]["min"] <= figures["p50_ratio"]["median"] <= figures["p50_ratio"]["max"], name
        assert figures["p50_ratio"]["seeds"] == 2
    sites = report["sites"]
    assert [row["site"] for row in sites] == report["per_seed"][0]["sites"]
    for row in sites:
        assert row["lookup_ms"] > 0 and len(row["cache_answerable"]) == len(row["ramp_answerable"]) == 2
        assert all(0.0 <= share <= 1.0 for share in (*row["cache_answerable"], *row["ramp_answerable"]))
        assert row["break_even_share"] == pytest.approx(
            row["charged_ms"] / (row["skipped_share_of_model"] * row["model_ms"]))
    assert len(exit_kinds_tables(report)) == 2


def test_ramps_and_caches_put_each_cache_beside_its_sites_ramp_at_its_share_of_the_model():
    from rampserve.bench.freeze import ramps_and_caches
    from rampserve.bench.ramp_outputs import RampOutputs
    from rampserve.bench.sim import Scenario
    from rampserve.bundle_format.latency import LatencyProfile
    from rampserve.control.costs import CostModel

    sites = ("a", "b")

    def side(full: float, ramp: float, labels: np.ndarray, errors: np.ndarray, python: bool) -> Scenario:
        profile = LatencyProfile((1, 2), sites, (full, 2 * full), {s: (full / 3, 2 * full / 3) for s in (*sites, "output")},
                                 {s: (ramp, 2 * ramp) for s in sites})
        outputs = RampOutputs(sites, labels, errors, np.array([1, 0]))
        return Scenario(outputs, CostModel(profile), np.zeros(2), 1, python_ramps=frozenset(sites if python else ()),
                        python_sets_stop=not python)

    ramps = side(3.0, 0.03, np.array([[0, 1], [0, 0]]), np.array([[0.1, 0.2], [0.3, 0.4]]), python=False)
    caches = side(6.0, 0.3, np.array([[1, 1], [1, 0]]), np.array([[0.5, 0.6], [0.7, 0.8]]), python=True)
    both = ramps_and_caches(ramps, caches)
    profile = both.costs.profile
    assert profile.sites == ("a", "a+cache", "b", "b+cache")
    np.testing.assert_allclose(both.outputs.labels, [[0, 1, 1, 1], [0, 1, 0, 0]])
    np.testing.assert_allclose(both.outputs.errors, [[0.1, 0.5, 0.2, 0.6], [0.3, 0.7, 0.4, 0.8]])
    # a cache is reached with its site, and costs its share of the model (5% in its own profile) of this model
    np.testing.assert_allclose(profile.reach(1), [1.0, 1.0, 2.0, 2.0])
    assert profile.full(1) == 3.0 and profile.ramp("a+cache", 1) == pytest.approx(0.15)
    assert profile.ramp("a", 1) == 0.03
    assert both.python_ramps == {"a+cache", "b+cache"} and not both.python_sets_stop
    assert both.stopping(("a", "b")) == (True, pytest.approx(np.array([True, True])))
    assert both.stopping(("a", "b+cache"))[0] is False
