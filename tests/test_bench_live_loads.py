"""`bench live`'s loads: the same load as the simulator's, `--loads` and what refuses it, the simulator's saving beside
the live one, and the latency–load table and plot (no server, no timing)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rich.console import Console
from typer.testing import CliRunner

from rampserve.bench.live import (
    LiveSettings,
    SimulatorSaving,
    beside_simulator,
    latency_by_load,
    load_table,
    parse_loads,
    read_simulator_saving,
    replay_rate,
    replay_schedule,
    versus_table,
    versus_vanilla,
    write_report,
)
from rampserve.bench.live_plots import write_load_plot
from rampserve.bench.load import DEFAULT_LOAD, batch1_capacity_rps
from rampserve.bench.loadgen import LoadResult
from rampserve.bench.sim import SimSettings, scenario_rate
from rampserve.bundle_format.latency import LatencyProfile
from rampserve.cli import app
from rampserve.workloads.streams import get_stream


def profile_with(batch1_ms: float) -> LatencyProfile:
    return LatencyProfile(batch_sizes=(1, 2), sites=(), full_ms=(batch1_ms, 1.9 * batch1_ms), segment_ms={},
                          ramp_ms={})


@settings(max_examples=200, deadline=None)
@given(load=st.floats(1e-3, 3.0), batch1_ms=st.floats(0.01, 1000.0), rate=st.none() | st.floats(0.1, 1e4))
def test_live_and_simulated_replays_take_the_same_rate_at_the_same_load(load, batch1_ms, rate):
    # Given what vanilla sustains back to back, a load is the same rate in both benches: the simulator's vanilla is
    # the profiled model at batch 1, the live one's is measured
    profile = profile_with(batch1_ms)
    simulated = scenario_rate(SimSettings(load=load, rate_rps=rate), profile)
    live = replay_rate(LiveSettings(loads=(load,), rate_rps=rate), load, batch1_capacity_rps(profile))
    assert live == pytest.approx(simulated, rel=1e-12)
    if rate is None:
        assert simulated == pytest.approx(load * 1000.0 / batch1_ms, rel=1e-12)
        assert simulated / batch1_capacity_rps(profile) == pytest.approx(load, rel=1e-12)  # the sim reports this
    else:
        assert live == rate


def test_both_benches_default_to_the_same_load():
    assert LiveSettings().loads == (DEFAULT_LOAD,) and SimSettings().load == DEFAULT_LOAD == 0.2


def test_a_replay_states_its_load_or_what_a_given_rate_came_to():
    stream = get_stream("fmnist-drift", length=3000, seed=0)
    stated = replay_schedule(LiveSettings(duration_s=2.0, warmup_requests=10), 0.3, 500.0, stream)
    assert (stated.load, stated.rate_rps, stated.requests, stated.warmup_requests) == (0.3, 150.0, 300, 10)
    assert stated.arrivals_ms[-1] == pytest.approx(2000.0)  # 300 arrivals at exactly 150 rps
    given = replay_schedule(LiveSettings(rate_rps=100.0, duration_s=2.0), DEFAULT_LOAD, 500.0, stream)
    assert (given.load, given.rate_rps) == (pytest.approx(0.2), 100.0)
    given_elsewhere = replay_schedule(LiveSettings(rate_rps=100.0, duration_s=2.0), DEFAULT_LOAD, 400.0, stream)
    assert given_elsewhere.load == pytest.approx(0.25)
    assert replay_schedule(LiveSettings(rate_rps=100.0, duration_s=2.0), DEFAULT_LOAD, None, stream).load is None
    with pytest.raises(ValueError, match="exceed the stream's 2700 evaluation items"):
        replay_schedule(LiveSettings(duration_s=60.0), 0.5, 500.0, stream)
    with pytest.raises(RuntimeError, match="answered nothing"):
        replay_schedule(LiveSettings(), 0.2, 0.0, stream)


def test_loads_are_read_in_rising_order():
    assert parse_loads("0.5, 0.1,0.3,0.2") == (0.1, 0.2, 0.3, 0.5)
    assert parse_loads("0.2") == (0.2,)


def said(output: str) -> str:
    """An error as the command line printed it, unwrapped from its panel's lines and borders."""
    return " ".join(output.replace("│", " ").split())


@pytest.mark.parametrize(("given", "why"), [
    (["--loads", "0.1,,0.2"], "'' in '0.1,,0.2' is not one"),
    (["--loads", "0.1,half"], "'half' in '0.1,half' is not one"),
    (["--loads", ""], "'' in '' is not one"),
    (["--loads", "0,0.2"], "a load is a positive share of vanilla's saturation, got 0.0"),
    (["--loads", "-0.1"], "got -0.1"),
    (["--loads", "0.1,nan"], "got nan"),
    (["--loads", "inf"], "got inf"),
    (["--load", "0"], "got 0.0"),
    (["--loads", "0.2,0.1,0.2"], "each load once, got (0.1, 0.2, 0.2)"),
    (["--load", "0.2", "--loads", "0.1,0.2"], "give --load or --loads, not both"),
    (["--rate", "100", "--loads", "0.1,0.2"], "not each of 2 loads'"),
    (["--rounds", "0"], "a load is replayed at least once, got 0 rounds"),
    (["--client", "curl"], "client is one of ('lean', 'aiohttp'), not 'curl'"),
    (["--simulated-seeds", "3"], "a simulated replay has no server to measure saturation on: give --rate"),
    (["--seed", "-1"], "a seed is a non-negative integer, got -1"),
])
def test_bad_loads_are_refused_before_anything_runs(given, why):
    result = CliRunner().invoke(app, ["bench", "live", *given])
    assert result.exit_code == 2, result.output
    assert why in said(result.output)


@pytest.mark.parametrize("command", [["demo"], ["bench", "peers"]])
def test_the_demo_and_peers_refuse_a_load_that_is_none(command):
    result = CliRunner().invoke(app, [*command, "--load", "-1"])
    assert result.exit_code == 2, result.output
    assert "a load is a positive share of vanilla's saturation, got -1.0" in said(result.output)


def sim_report(load: float, vanilla_p50: float, managed_p50: float, model: str = "resnet18-fmnist") -> dict:
    return {"model": model, "workload": "fmnist-drift", "trace": "maf", "load": load,
            "systems": {"vanilla": {"p50_ms": vanilla_p50, "p50_savings": 0.0},
                        "rampserve": {"p50_ms": managed_p50, "p50_savings": 1.0 - managed_p50 / vanilla_p50}}}


def test_the_simulators_saving_is_read_at_the_runs_load(tmp_path):
    path = tmp_path / "sim.json"
    # the simulator reports its load as rate over capacity: not always the very float it was given
    path.write_text(json.dumps(sim_report(0.2 * (1 + 1e-12), 1.0, 0.8)))
    saving = read_simulator_saving(path, LiveSettings(loads=(0.1, 0.2, 0.3)))
    assert (saving.load, saving.seeds, saving.source) == (0.2, 1, str(path))
    assert saving.p50_saving_ms == pytest.approx(0.2) and saving.p50_savings == pytest.approx(0.2)
    # several seeds: the median seed's saving
    path.write_text(json.dumps({"seeds": [sim_report(0.2, 1.0, 0.8), sim_report(0.2, 1.0, 0.5),
                                          sim_report(0.2, 1.0, 0.9)], "summary": {}}))
    saving = read_simulator_saving(path, LiveSettings())
    assert saving.p50_saving_ms == pytest.approx(0.2) and saving.seeds == 3


@pytest.mark.parametrize(("report", "settings_", "why"), [
    (sim_report(0.5, 1.0, 0.8), LiveSettings(loads=(0.1, 0.2)), "simulated load [0.5]"),
    (sim_report(0.2, 1.0, 0.8, model="minilm-rt"), LiveSettings(), "simulated model ['minilm-rt']"),
    ({"seeds": [sim_report(0.2, 1.0, 0.8), sim_report(0.3, 1.0, 0.8)]}, LiveSettings(loads=(0.2, 0.3)),
     "simulated load [0.2, 0.3]"),
    ({"model": "resnet18-fmnist"}, LiveSettings(), "is not a `bench sim --json` report: KeyError"),
    (sim_report(0.2, 1.0, 0.8), LiveSettings(rate_rps=100.0), "a given rate states none"),
])
def test_a_simulator_report_from_elsewhere_is_refused(tmp_path, report, settings_, why):
    path = tmp_path / "sim.json"
    path.write_text(json.dumps(report))
    with pytest.raises(ValueError) as refused:
        read_simulator_saving(path, settings_)
    assert why in str(refused.value)


def test_the_cli_refuses_a_simulator_report_at_another_load_before_anything_runs(tmp_path):
    path = tmp_path / "sim.json"
    path.write_text(json.dumps(sim_report(0.5, 1.0, 0.8)))
    result = CliRunner().invoke(app, ["bench", "live", "--loads", "0.1,0.2", "--sim-json", str(path)])
    assert result.exit_code == 2 and "name its load among them" in said(result.output)


def _system(p50: float | None, p99: float | None, shed: int = 0) -> dict:
    return {"p50_ms": p50, "p99_ms": p99, "answered": 100 - shed, "shed": shed, "failed": 0, "requests": 100,
            "accuracy": 0.995, "worst_window_accuracy": 0.99, "windows_below_share": 0.0, "saturation_rps": 500.0,
            "saturation": {"rounds_rps": [500.0]}}


def _entry(load: float, vanilla: dict, managed: dict) -> dict:
    systems = {"vanilla": vanilla, "rampserve": managed}
    return {"load": load, "rate_rps": load * 500.0, "systems": systems, "median_round": 0, "rounds": [systems],
            "versus_vanilla": versus_vanilla([(vanilla, managed)], load)}


def test_the_simulators_saving_stands_beside_the_live_one_at_its_load():
    simulator = SimulatorSaving("sim.json", 0.2, 0.5, 0.2, 1)
    entry = _entry(0.2, _system(2.0, 9.0), _system(1.6, 9.5))
    entry["versus_vanilla"]["p50_saving_ms"] = beside_simulator(*entry["systems"].values(), simulator)
    assert entry["versus_vanilla"]["p50_saving_ms"] == {"live": pytest.approx(0.4), "simulator": 0.5,
                                                        "ratio": pytest.approx(0.8), "load": 0.2}
    console = Console(width=200, record=True, file=io.StringIO())
    console.print(versus_table(entry))
    row = next(line for line in console.export_text().splitlines() if "p50 saving" in line)
    assert [cell.strip() for cell in row.split("│")[1:-1]] == ["p50 saving ms (live / simulator)", "", "0.40 / 0.50",
                                                               "0.80", "", ""]
    assert beside_simulator(_system(None, None), _system(1.0, 2.0), simulator)["ratio"] is None


def live_report(entries: list[dict]) -> dict:
    return json.loads(json.dumps({  # what the JSON file holds
        "model": "resnet18-fmnist", "workload": "fmnist-drift", "trace": "maf", "saturation_rps": 500.0,
        "slo_ms": 0.5, "loads": entries, "latency_by_load": latency_by_load(entries)}))


def test_latency_against_load_has_one_point_per_load_for_each_system(tmp_path):
    entries = [_entry(0.1, _system(2.0, 4.0), _system(1.5, 4.2)), _entry(0.3, _system(2.5, 9.0), _system(2.0, 8.0)),
               _entry(0.5, _system(4.0, 90.0), _system(None, None, shed=100))]
    report = live_report(entries)
    curves = report["latency_by_load"]
    assert list(curves) == ["vanilla", "rampserve"]
    assert [point["load"] for point in curves["vanilla"]] == [point["load"] for point in curves["rampserve"]] == \
        [0.1, 0.3, 0.5]
    assert [point["p99_ms"] for point in curves["vanilla"]] == [4.0, 9.0, 90.0]
    assert curves["rampserve"][0] == {"load": 0.1, "rate_rps": 50.0, "p50_ms": 1.5, "p99_ms": 4.2, "answered": 100,
                                      "shed": 0, "failed": 0}
    console = Console(width=250, record=True, file=io.StringIO())
    console.print(load_table(report))
    rows = [[cell.strip() for cell in line.split("│")[1:-1]] for line in console.export_text().splitlines()
            if line.startswith("│")]
    assert rows == [["0.1", "50", "2.00", "1.50", "0.75", "4.00", "4.20", "1.05", "0 / 0"],
                    ["0.3", "150", "2.50", "2.00", "0.80", "9.00", "8.00", "0.89", "0 / 0"],
                    # nothing answered: no latency, and why
                    ["0.5", "250", "4.00", "-", "-", "90.00", "-", "-", "0 / 100"]]

    path = write_load_plot(report, tmp_path)
    assert path == tmp_path / "live_latency_by_load.png" and path.stat().st_size > 0


def test_each_loads_plots_land_in_its_own_folder_beside_latency_against_load(tmp_path):
    def result(latency: list[float]) -> LoadResult:
        n = len(latency)
        scheduled = np.arange(n, dtype=float) * 100.0
        return LoadResult(scheduled_ms=scheduled, sent_ms=scheduled, done_ms=scheduled + np.asarray(latency),
                          status=np.full(n, 200), label=np.zeros(n), early=np.zeros(n, bool), exit_site=np.full(n, -1),
                          sites=(), errors={}, status_before=None, status_after=None)

    entries = [_entry(0.2, _system(2.0, 4.0), _system(1.5, 4.2)), _entry(0.5, _system(3.0, 8.0), _system(2.5, 9.0))]
    runs = [[{"vanilla": result([2.0, 3.0, 4.0]), "rampserve": result([1.0, 2.0, 5.0])}],
            [{"vanilla": result([3.0, 3.0, 8.0]), "rampserve": result([2.0, 2.5, 9.0])}]]
    report = write_report(live_report(entries), runs, tmp_path / "live.json", tmp_path / "plots")
    assert report["plots"] == [str(tmp_path / "plots" / name) for name in (
        "load-0.2/live_latency_cdf.png", "load-0.2/live_over_time.png", "load-0.5/live_latency_cdf.png",
        "load-0.5/live_over_time.png", "live_latency_by_load.png")]
    assert all(Path(path).stat().st_size > 0 for path in report["plots"])
    assert json.loads((tmp_path / "live.json").read_text())["plots"] == report["plots"]
