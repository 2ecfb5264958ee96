"""`bench live`'s statistics over what the load generator recorded, its trace slice, and the load generator's
request encoding and files (no server, no timing)."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rich.console import Console

from rampserve.bench.harness import closed_loop_throughput, mean_batch_size, percentiles
from rampserve.bench.live import (
    TABLE_COLUMNS,
    LiveSettings,
    binned_percentile,
    live_arrivals,
    managed_exit_mode,
    median_round,
    summarize_live,
    table_rows,
    versus_table,
    versus_vanilla,
    with_oracle_share,
    worst_tail_round,
)
from rampserve.bench.loadgen import (
    CLIENT_ERROR, TIMED_OUT, TRACE_STEPS, Job, LoadResult, encode_request, load_job, save_job,
)
from rampserve.bench.stages import (
    PATHS, STAGES, paired_stage_costs, stage_costs, tail_stage_costs, tail_table,
)
from rampserve.control.controller import ControllerSettings
from rampserve.workloads.traces import arrival_times


def load_result(scheduled, done, status, label, early=None, sent=None, exit_site=None, sites=()) -> LoadResult:
    n = len(scheduled)
    return LoadResult(
        scheduled_ms=np.asarray(scheduled, dtype=float), sent_ms=np.asarray(scheduled if sent is None else sent,
                                                                             dtype=float),
        done_ms=np.asarray(done, dtype=float), status=np.asarray(status), label=np.asarray(label),
        early=np.zeros(n, bool) if early is None else np.asarray(early, bool),
        exit_site=np.full(n, -1) if exit_site is None else np.asarray(exit_site), sites=tuple(sites), errors={},
        status_before=None, status_after=None)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(0.0, 1e4, allow_nan=False), min_size=1, max_size=200))
def test_percentiles_are_ordered_within_the_sample(values):
    p = percentiles(np.array(values))
    assert list(p) == ["p25_ms", "p50_ms", "p95_ms", "p99_ms"]
    assert min(values) <= p["p25_ms"] <= p["p50_ms"] <= p["p95_ms"] <= p["p99_ms"] <= max(values)


def test_percentiles_of_nothing_are_none_and_take_a_prefix():
    assert percentiles(np.zeros(0), prefix="x_") == {"x_p25_ms": None, "x_p50_ms": None, "x_p95_ms": None,
                                                      "x_p99_ms": None}
    assert percentiles(np.arange(101.0))["p95_ms"] == pytest.approx(95.0)


def test_summary_scores_answered_requests_and_counts_shed_and_failed_apart():
    # 6 requests: 4 answered (one wrong, two early), one shed (429), one timed out
    result = load_result(scheduled=[0, 100, 200, 300, 400, 500], done=[2, 104, 230, 301, 402, 10_500],
                         status=[200, 200, 429, 200, 200, TIMED_OUT], label=[1, 2, -1, 3, 9, -1],
                         early=[True, False, False, True, False, False], exit_site=[1, -1, -1, 0, -1, -1],
                         sites=("a", "b"), sent=[0.5, 100, 200, 300, 400, 500])
    reference = np.array([1, 2, 7, 3, 4, 5])
    s = summarize_live(result, reference, worst_window=2, batch_size=1.5, min_accuracy=0.99)
    assert (s["requests"], s["answered"], s["shed"], s["failed"]) == (6, 4, 1, 1)
    assert s["accuracy"] == pytest.approx(3 / 4)
    assert s["worst_window_accuracy"] == pytest.approx(1 / 2)  # answered in order: right, right, right, wrong
    assert s["windows_below_share"] == pytest.approx(1 / 2)  # windows of 2: (right, right), (right, wrong)
    assert summarize_live(result, reference, 2, None, min_accuracy=0.5)["windows_below_share"] == 0.0
    assert s["p50_ms"] == pytest.approx(np.median([2, 4, 1, 2]))
    assert s["mean_ms"] == pytest.approx(9 / 4)
    assert s["exit_share"] == pytest.approx(1 / 2)
    assert s["exit_share_by_site"] == {"a": pytest.approx(1 / 4), "b": pytest.approx(1 / 4)}
    # answered latencies 2, 4, 1, 2 ms released at b, the end, a, the end
    assert s["p50_ms_by_exit_site"] == {"a": 1.0, "b": 2.0, "final": pytest.approx(3.0)}
    assert s["throughput_rps"] == pytest.approx(4 / 0.402)  # first arrival to last answer
    assert s["rate_rps"] == pytest.approx(6 / 0.5)
    assert s["mean_batch_size"] == 1.5
    assert s["client_lateness_p99_ms"] == pytest.approx(np.percentile([0.5, 0, 0, 0, 0, 0], 99))


def test_summary_of_a_run_with_no_answer_has_no_latency_and_no_accuracy():
    result = load_result(scheduled=[0, 1], done=[1, 2], status=[503, CLIENT_ERROR], label=[-1, -1])
    s = summarize_live(result, np.array([0, 0]), worst_window=1000, batch_size=None)
    assert s["accuracy"] is None and s["p50_ms"] is None and s["throughput_rps"] == 0.0
    assert s["windows_below_share"] is None
    assert (s["shed"], s["failed"]) == (1, 1)


def test_closed_loop_throughput_counts_answers_in_the_window_only():
    done = [500, 1500, 1600, 2500, 2999, 3000, 3100]
    result = load_result(scheduled=np.zeros(7), done=done, status=[200, 200, 503, 200, 200, 200, 200],
                         label=np.zeros(7))
    # answers within [1000, 3000): 1500, 2500, 2999 (1600 was shed) over 2 s
    assert closed_loop_throughput(result, 1000.0, 3000.0) == pytest.approx(1.5)


def test_mean_batch_size_is_the_change_in_requests_over_the_change_in_batches():
    before = {"models": {"m": {"batches": 10, "requests": 12}}}
    after = {"models": {"m": {"batches": 30, "requests": 62}}}
    assert mean_batch_size(before, after, "m") == pytest.approx(2.5)
    assert mean_batch_size(before, before, "m") is None
    assert mean_batch_size("GET /status: HTTP Error 404", after, "m") is None
    assert mean_batch_size(before, after, "other") is None
    # a request may carry several inputs: batch sizes count inputs where the server reports them
    before["models"]["m"]["inputs"], after["models"]["m"]["inputs"] = 20, 100
    assert mean_batch_size(before, after, "m") == pytest.approx(4.0)


def test_savings_and_oracle_share():
    systems = {"vanilla": {f"p{q}_ms": 10.0 for q in (25, 50, 95, 99)},
               "rampserve": {"p25_ms": 5.0, "p50_ms": 6.0, "p95_ms": 10.0, "p99_ms": 12.0}}
    out = with_oracle_share(systems, oracle_p50_savings=0.8)
    assert out["rampserve"]["p50_savings"] == pytest.approx(0.4)
    assert out["rampserve"]["p99_savings"] == pytest.approx(-0.2)
    assert out["rampserve"]["oracle_share"] == pytest.approx(0.5)
    assert out["vanilla"]["oracle_share"] == 0.0
    assert with_oracle_share(systems, 0.0)["rampserve"]["oracle_share"] is None


def test_binned_percentile_leaves_empty_bins_empty():
    starts, p50 = binned_percentile(np.array([100.0, 200, 900, 2500]), np.array([1.0, 3, 5, 7]), 1000.0, 50)
    np.testing.assert_allclose(starts, [0, 1000, 2000])
    assert p50[0] == pytest.approx(3.0) and np.isnan(p50[1]) and p50[2] == pytest.approx(7.0)


def test_table_rows_show_ratios_to_vanilla():
    def system(p50, p99, rps):
        return {"requests": 100, "shed": 1, "failed": 0, "p25_ms": 1.0, "p50_ms": p50, "p95_ms": 5.0, "p99_ms": p99,
                "throughput_rps": rps, "accuracy": 0.995, "worst_window_accuracy": None, "exit_share": 0.4,
                "mean_batch_size": None, "oracle_share": 0.5, "windows_below_share": 0.0}

    report = {"systems": {"vanilla": system(4.0, 10.0, 200.0) | {"saturation_rps": 400.0},
                          "rampserve": system(2.0, 11.0, 199.0) | {"saturation_rps": 600.0, "exit_mode": "stop",
                                                                  "feedback_share": 0.1}}}
    vanilla, rampserve = (dict(zip(TABLE_COLUMNS, row, strict=True)) for row in table_rows(report))
    assert vanilla["system"] == "vanilla" and vanilla["exit mode"] == "-"
    assert [vanilla[c] for c in ("sat ×van", "p50 ×van", "p99 ×van", "rps ×van")] == ["1.00"] * 4
    assert [rampserve[c] for c in ("sat ×van", "p50 ×van", "p99 ×van", "rps ×van", "oracle share")] == \
        ["1.50", "0.50", "1.10", "0.99", "0.50"]
    assert (rampserve["sat rps"], rampserve["1k <target"], rampserve["exit mode"]) == ("600.0", "0.0%", "stop 0.10")
    assert rampserve["worst 1k"] == "-" and rampserve["mean batch"] == "-"  # unknown


def _live_system(p50: float, p99: float, rounds: list[float], accuracy: float = 0.995, answered: int = 100,
                 requests: int = 100) -> dict:
    return {"p50_ms": p50, "p99_ms": p99, "accuracy": accuracy, "answered": answered, "requests": requests,
            "worst_window_accuracy": 0.98, "windows_below_share": 0.25,
            "saturation_rps": float(np.median(rounds)) if rounds else None,
            "saturation": {"rounds_rps": rounds}}


def test_versus_vanilla_reports_issue_31s_figures_and_goals():
    vanilla = _live_system(4.0, 20.0, [700.0, 720.0, 710.0]) | {"cpu_ms_per_answer": 2.0}
    managed = _live_system(1.9, 19.0, [1000.0, 1100.0, 1050.0], accuracy=0.992, answered=99) | \
        {"exit_mode": "stop", "feedback_share": 0.1, "cpu_ms_per_answer": 1.5}
    versus = versus_vanilla([(vanilla, managed)], load=0.2)
    assert (versus["exit_mode"], versus["feedback_share"]) == ("stop", 0.1)
    assert versus["load"] == 0.2
    saturation = versus["saturation_rps"]
    assert saturation["ratio"] == pytest.approx(1050 / 710)
    assert saturation["ratio_range"] == pytest.approx([1000 / 720, 1100 / 700])
    assert saturation["vanilla_rounds"] == [700.0, 720.0, 710.0]
    # each latency figure says at which load it was measured
    assert versus["p50_ms"] == {"vanilla": 4.0, "rampserve": 1.9, "ratio": pytest.approx(0.475),
                                "ratio_rounds": [pytest.approx(0.475)], "load": 0.2}
    assert versus["p99_ms"]["ratio"] == pytest.approx(0.95) and versus["p99_ms"]["load"] == 0.2
    assert versus["accuracy_over_all_requests"] == pytest.approx(0.992 * 0.99)
    assert versus["windows_below_share"] == 0.25
    assert versus["cpu_ms_per_answer"] == {"vanilla": 2.0, "rampserve": 1.5, "ratio": pytest.approx(0.75),
                                           "ratio_rounds": [pytest.approx(0.75)], "load": 0.2}
    # stop mode must raise saturation; what it skips leaves its CPU without a bar of its own
    assert versus["goals"] == {"saturation_at_least_1.3x": True, "p50_at_most_0.85x": True,
                               "p99_at_most_1.05x": True, "accuracy_at_least_0.99": True,
                               "cpu_per_answer_at_most_1.05x": None}
    # judged at whatever load the run states; slower, higher latency, dearer and less accurate: missed
    slow = managed | {"saturation_rps": 680.0, "accuracy": 0.98, "p50_ms": 3.5, "p99_ms": 21.5,
                      "exit_mode": "release", "cpu_ms_per_answer": 2.2}
    goals = versus_vanilla([(vanilla, slow)], load=0.3)["goals"]
    assert goals == {"saturation_at_least_0.97x": False, "p50_at_most_0.85x": False, "p99_at_most_1.05x": False,
                     "accuracy_at_least_0.99": False, "cpu_per_answer_at_most_1.05x": False}
    # nothing answered, no saturation rounds: the figures are missing, not made up
    empty = versus_vanilla([(vanilla, _live_system(None, None, []) | {"accuracy": None, "saturation_rps": None})],
                           load=0.5)
    assert empty["saturation_rps"]["ratio_range"] is None and set(empty["goals"].values()) == {None}
    console = Console(width=200, record=True, file=io.StringIO())
    console.print(versus_table({"versus_vanilla": versus}))
    text = console.export_text()
    assert "saturation rps" in text and "1.48 (1.39-1.57)" in text and "stop 0.10" in text
    assert "CPU ms per answer" in text and "0.75" in text
    assert "replay at load 0.2 " in text and "simulator" not in text


def test_over_rounds_ratios_are_paired_within_each_round_and_the_median_is_judged():
    saturation = [700.0]
    vanilla = [_live_system(p50, 20.0, saturation) | {"cpu_ms_per_answer": 2.0} for p50 in (4.0, 5.0, 6.0)]
    # round 2's machine was slow for both: paired, its ratio is the best; the median ratio is round 1's
    managed = [_live_system(p50, 21.0, saturation, accuracy=accuracy) | {"cpu_ms_per_answer": 2.0}
               for p50, accuracy in ((3.6, 0.995), (4.0, 0.985), (5.7, 0.996))]
    versus = versus_vanilla(list(zip(vanilla, managed)), load=0.2)
    p50 = versus["p50_ms"]
    assert p50["ratio_rounds"] == pytest.approx([0.9, 0.8, 0.95]) and p50["ratio"] == pytest.approx(0.9)
    assert (p50["vanilla"], p50["rampserve"], versus["rounds"]) == (5.0, 4.0, 3)
    assert median_round(p50["ratio_rounds"]) == 0
    # accuracy is judged in the worst round: a bad round is not averaged away
    assert versus["accuracy"] == 0.985 and versus["goals"]["accuracy_at_least_0.99"] is False
    assert versus["goals"]["p50_at_most_0.85x"] is False and versus["goals"]["p99_at_most_1.05x"] is True
    # a round with a figure missing leaves the median ratio missing rather than made up from the others
    missing = versus_vanilla(list(zip(vanilla, [managed[0], managed[1] | {"p50_ms": None}, managed[2]])), load=0.2)
    assert missing["p50_ms"]["ratio"] is None and missing["goals"]["p50_at_most_0.85x"] is None
    console = Console(width=220, record=True, file=io.StringIO())
    console.print(versus_table({"versus_vanilla": versus}))
    text = console.export_text()
    assert "0.90 (0.80-0.95)" in text and "3 round(s)" in text
    with pytest.raises(ValueError, match="no replay round"):
        versus_vanilla([], load=0.2)


@given(st.lists(st.one_of(st.none(), st.floats(0.1, 10.0)), min_size=1, max_size=9))
def test_the_median_round_holds_the_median_of_the_known_ratios(ratios):
    chosen = median_round(ratios)
    known = sorted(r for r in ratios if r is not None)
    if known:
        assert ratios[chosen] == known[(len(known) - 1) // 2]
    else:
        assert chosen == 0


def test_the_managed_exit_mode_is_what_the_server_reports_else_what_it_was_told():
    settings = LiveSettings(model="m", exit_mode="stop", feedback_share=0.2)
    assert managed_exit_mode(settings, 8, None) == {"exit_mode": "stop", "feedback_share": 0.2}
    # the server's model status carries its controller's figures (the controller may set the share itself)
    status = {"models": {"m": {"exit_mode": "stop", "feedback_share": 0.05}}}
    assert managed_exit_mode(settings, 8, status) == {"exit_mode": "stop", "feedback_share": 0.05}
    status = {"models": {"m": {"controller": {"exit_mode": "stop", "feedback_share": 0.3}}}}
    assert managed_exit_mode(settings, 8, status) == {"exit_mode": "stop", "feedback_share": 0.3}
    # release: every row runs to the end
    assert managed_exit_mode(LiveSettings(model="m", exit_mode="release"), 1, "GET /status: refused") == \
        {"exit_mode": "release", "feedback_share": 1.0}
    # told nothing and heard nothing: the default, resolved for the model's batch limit as the server resolves it
    assert managed_exit_mode(LiveSettings(model="m"), 8, None) == {"exit_mode": "release", "feedback_share": 1.0}
    assert managed_exit_mode(LiveSettings(model="m"), 2, None) == {"exit_mode": "stop", "feedback_share": 0.1}


def test_live_settings_pass_the_exit_mode_and_controller_settings_to_the_managed_server_only_when_given():
    assert LiveSettings().managed_args() == ("--accuracy-constraint", "0.01")
    assert LiveSettings(exit_mode="stop", feedback_share=0.1, accuracy_constraint=0.02).managed_args() == \
        ("--accuracy-constraint", "0.02", "--exit-mode", "stop", "--feedback-share", "0.1")
    assert LiveSettings(exit_mode="auto").managed_args() == ("--accuracy-constraint", "0.01", "--exit-mode", "auto")
    assert LiveSettings(controller={"objective": "p95", "search_every": 1024, "shadow_share": 0.1}).managed_args() == \
        ("--accuracy-constraint", "0.01", "--objective", "p95", "--search-every", "1024", "--shadow-share", "0.1")
    for bad in ({"exit_mode": "halt"}, {"feedback_share": 1.5}, {"feedback_share": 0.0}, {"saturation_rounds": 0},
                {"saturation_s": 2.0, "saturation_settle_s": 2.0}, {"controller": {"objective": "p75"}},
                {"controller": {"guarantee": "hopeful"}}):
        with pytest.raises(ValueError):
            LiveSettings(**bad)


def test_the_simulated_controller_takes_the_settings_the_managed_server_is_given():
    # The simulation on the replay's own requests runs the controller the managed server runs: what the run passes
    # it, the server's defaults for the rest
    assert LiveSettings().controller_settings() == ControllerSettings(accuracy_constraint=0.01)
    given = LiveSettings(exit_mode="stop", feedback_share=0.1, accuracy_constraint=0.02,
                         controller={"guarantee": "long-run", "search_every": 1024})
    assert given.controller_settings() == ControllerSettings(accuracy_constraint=0.02, exit_mode="stop",
                                                             feedback_share=0.1, guarantee="long-run",
                                                             search_every=1024)


@pytest.mark.parametrize("trace", ["maf", "poisson", "bursty"])
def test_live_arrivals_keep_the_mean_rate_and_the_trace_shape(trace):
    n, rate = 5_000, 200.0
    arrivals = live_arrivals(trace, n, rate, seed=3, trace_minutes=8)
    assert len(arrivals) == n and np.all(np.diff(arrivals) >= 0)
    assert n / (arrivals[-1] / 1000.0) == pytest.approx(rate)
    speedup = 8 * 60 * rate / n if trace == "maf" else 1.0
    drawn = arrival_times(trace, n, rate / speedup, seed=3)
    np.testing.assert_allclose(arrivals / arrivals[-1], drawn / drawn[-1])


def test_live_maf_replays_its_minutes_faster():
    n, rate = 12_000, 200.0  # a 60 s run holding 8 trace minutes: a level every 7.5 s
    arrivals = live_arrivals("maf", n, rate, seed=0, trace_minutes=8)
    levels, _ = np.histogram(arrivals, bins=np.linspace(0, arrivals[-1], 9))
    assert levels.std() / levels.mean() > 0.2  # the minute-to-minute swings survive
    poisson, _ = np.histogram(live_arrivals("poisson", n, rate, 0, 8), bins=np.linspace(0, arrivals[-1], 9))
    assert poisson.std() / poisson.mean() < 0.1
    # a run longer than the trace minutes is not slowed down
    slow = arrival_times("maf", 100, 0.1, 2)
    np.testing.assert_allclose(live_arrivals("maf", 100, 0.1, 2, 8), slow * (1000 * 1000 / slow[-1]))


def test_binary_request_body_is_the_json_header_then_the_raw_tensors():
    job = Job("http://x/infer", (("ids", "INT64"), ("pixels", "FP32")), "label", None)
    ids, pixels = np.array([[1, 2, 3]]), np.arange(4, dtype=np.float64).reshape(1, 2, 2)
    body, headers = encode_request(job, {"ids": ids, "pixels": pixels})
    length = int(headers["Inference-Header-Content-Length"])
    header = json.loads(body[:length])
    assert [(i["name"], i["shape"], i["datatype"], i["parameters"]["binary_data_size"]) for i in header["inputs"]] \
        == [("ids", [1, 3], "INT64", 24), ("pixels", [1, 2, 2], "FP32", 16)]
    assert header["outputs"] == [{"name": "label", "parameters": {"binary_data": False}}]
    np.testing.assert_array_equal(np.frombuffer(body[length:length + 24], "<i8"), [1, 2, 3])
    np.testing.assert_array_equal(np.frombuffer(body[length + 24:], "<f4"), [0, 1, 2, 3])


def test_job_and_result_files_round_trip(tmp_path):
    job = Job("http://x/infer", (("ids", "INT64"),), "label", "http://x/status", clients=0)
    requests = [{"ids": np.array([[1, 2, 3]])}, {"ids": np.array([[4]])}]  # ragged, as texts of their own length
    save_job(tmp_path / "job.npz", job, requests, np.array([5.0]), np.array([1.0]))
    loaded, loaded_requests, arrivals, warmup = load_job(tmp_path / "job.npz")
    assert loaded == job and arrivals.tolist() == [5.0] and warmup.tolist() == [1.0]
    assert [r["ids"].tolist() for r in loaded_requests] == [[[1, 2, 3]], [[4]]]

    result = load_result([0, 1], [2, 3], [200, 429], [4, -1], early=[True, False], exit_site=[0, -1], sites=("s",))
    result.save(tmp_path / "untraced.npz")
    assert LoadResult.load(tmp_path / "untraced.npz").trace_ms is None
    result.trace_ms = np.arange(2.0 * len(TRACE_STEPS)).reshape(2, -1)
    result.errors = {"HTTP 429: busy": 1}
    result.status_after = {"models": {}}
    result.save(tmp_path / "out.npz")
    back = LoadResult.load(tmp_path / "out.npz")
    assert back.sites == ("s",) and back.errors == result.errors and back.status_after == {"models": {}}
    np.testing.assert_array_equal(back.latency_ms, [2, 2])
    assert back.early.tolist() == [True, False] and back.shed.tolist() == [False, True]
    np.testing.assert_array_equal(back.trace_ms, result.trace_ms)


@settings(max_examples=50, deadline=None)
@given(st.integers(0, 10_000), st.integers(1, 40))
def test_stage_costs_cut_each_traced_answer_s_latency_into_stages_that_add_up(seed, n):
    """Over the answers whose trace has every step, the stages' means add up to the mean latency, each path apart;
    a refused request, one without a trace and one without the executor's steps (a cached answer) are left out."""
    rng = np.random.default_rng(seed)
    steps = np.cumsum(rng.exponential(1.0, (n, len(TRACE_STEPS) + 3)), axis=1)  # scheduled, sent, ..., done
    status = np.where(rng.random(n) < 0.8, 200, 503)
    early = rng.random(n) < 0.5
    trace = steps[:, 2:-1].copy()
    untraced = rng.random(n) < 0.2
    trace[untraced] = np.nan
    cached = rng.random(n) < 0.2
    trace[cached, 1:-1] = np.nan  # in and answered alone
    result = load_result(steps[:, 0], steps[:, -1], status, np.zeros(n, int), early=early, sent=steps[:, 1])
    result.trace_ms = trace
    costs = stage_costs(result)
    counted = (status == 200) & ~untraced & ~cached
    for path, taken in (("early", early), ("final", ~early)):
        rows = counted & taken
        if not rows.any():
            assert costs[path] is None
            continue
        cost = costs[path]
        assert cost["requests"] == rows.sum()
        whole = steps[rows, -1] - steps[rows, 0]
        assert cost["latency_ms"]["mean"] == pytest.approx(whole.mean())
        assert sum(s["mean"] for s in cost["stages_ms"].values()) == pytest.approx(whole.mean())
        assert list(cost["stages_ms"]) == [stage for stage, _, _ in STAGES]
        assert all(s["median"] > 0 for s in cost["stages_ms"].values())


@settings(max_examples=50, deadline=None)
@given(st.integers(0, 10_000), st.integers(1, 300), st.floats(0.001, 0.5))
def test_the_tail_is_the_slowest_traced_answers_and_its_stages_add_up(seed, n, share):
    """The tail holds the slowest `share` of the answers traced in full (at least one), every one of them at least
    as slow as any other traced answer; each side's stage means add up to its mean latency; refused and untraced
    requests are in neither side."""
    rng = np.random.default_rng(seed)
    steps = np.cumsum(rng.exponential(1.0, (n, len(TRACE_STEPS) + 3)), axis=1)
    status = np.where(rng.random(n) < 0.8, 200, 503)
    early = rng.random(n) < 0.5
    trace = steps[:, 2:-1].copy()
    untraced = rng.random(n) < 0.2
    trace[untraced] = np.nan
    result = load_result(steps[:, 0], steps[:, -1], status, np.zeros(n, int), early=early, sent=steps[:, 1])
    result.trace_ms = trace
    tail = tail_stage_costs(result, share)
    counted = np.flatnonzero((status == 200) & ~untraced)
    if not len(counted):
        assert tail is None
        return
    whole = steps[:, -1] - steps[:, 0]
    count = max(1, round(share * len(counted)))
    slowest = counted[np.argsort(whole[counted], kind="stable")[-count:]]
    others = np.setdiff1d(counted, slowest)
    assert tail["requests"] == count and tail["early"] == early[slowest].sum()
    assert tail["from_ms"] == pytest.approx(whole[slowest].min())
    assert len(others) == 0 or whole[others].max() <= tail["from_ms"] + 1e-9
    assert tail["scheduled_s"] == sorted(round(float(t) / 1000.0, 2) for t in steps[slowest, 0])
    for side, rows in (("tail", slowest), ("rest", others)):
        if not len(rows):
            assert tail["latency_ms"][side] is None
            continue
        assert tail["latency_ms"][side] == pytest.approx(whole[rows].mean())
        assert sum(s[side] for s in tail["stages_ms"].values()) == pytest.approx(whole[rows].mean())


def test_the_tail_table_names_each_system_s_slowest_and_the_worst_round_is_the_worst_p99_ratio():
    steps = np.cumsum(np.ones((200, len(TRACE_STEPS) + 3)), axis=1)
    steps[-2:, -1] += 100.0  # two stalled answers
    result = load_result(steps[:, 0], steps[:, -1], np.full(200, 200), np.zeros(200, int), sent=steps[:, 1])
    result.trace_ms = steps[:, 2:-1].copy()
    tail = tail_stage_costs(result)
    assert tail["requests"] == 2 and tail["stages_ms"]["encoded, to the client"]["tail"] == pytest.approx(101.0)
    out = io.StringIO()
    systems = {"vanilla": {"tail_stages": None}, "rampserve": {"tail_stages": tail}}
    Console(file=out, width=200).print(tail_table(systems, "tails"))
    text = out.getvalue()
    assert "rampserve: slowest 2" in text and "vanilla" not in text and "101.000" in text
    rounds = [{"vanilla": {"p99_ms": 10.0}, "rampserve": {"p99_ms": p99}} for p99 in (9.0, 30.0, None, 12.0)]
    assert worst_tail_round({"rounds": rounds}) == 1
    assert worst_tail_round({"rounds": [{"vanilla": {"p99_ms": None}, "rampserve": {"p99_ms": 5.0}}]}) == 0


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 10_000), st.integers(2, 40))
def test_paired_stage_costs_are_the_differences_on_the_same_requests(seed, n):
    """Managed answers that took vanilla's steps plus a known extra per stage: each path's paired medians are those
    extras exactly, and the whole latency's their sum; a request either system left untraced is not paired."""
    rng = np.random.default_rng(seed)
    width = len(TRACE_STEPS) + 3  # scheduled, sent, the server's steps, done
    gaps = rng.exponential(1.0, (n, width))
    gaps[:, 0] = 0.0
    early = rng.random(n) < 0.5
    extra = {path: rng.uniform(-0.5, 0.5, width - 1) for path in PATHS}
    shifted = gaps.copy()
    shifted[:, 1:] += np.where(early[:, None], extra["early"], extra["final"])
    shifted = np.maximum(shifted, 0.0)
    steps_vanilla, steps_managed = np.cumsum(gaps, axis=1), np.cumsum(shifted, axis=1)
    results = []
    for steps, early_ in ((steps_managed, early), (steps_vanilla, np.zeros(n, bool))):
        result = load_result(steps[:, 0], steps[:, -1], np.full(n, 200), np.zeros(n, int), early=early_,
                             sent=steps[:, 1])
        result.trace_ms = steps[:, 2:-1].copy()
        results.append(result)
    untraced = rng.integers(n)
    results[1].trace_ms[untraced] = np.nan
    paired = paired_stage_costs(*results)
    for path, taken in (("early", early), ("final", ~early)):
        rows = taken.copy()
        rows[untraced] = False
        if not rows.any():
            assert paired[path] is None
            continue
        assert paired[path]["requests"] == rows.sum()
        differences = shifted[:, 1:] - gaps[:, 1:]
        for k, (stage, _, _) in enumerate(STAGES):
            assert paired[path]["difference_ms"][stage] == pytest.approx(np.median(differences[rows, k]))
        whole = differences[rows].sum(axis=1)
        assert paired[path]["difference_ms"]["whole latency"] == pytest.approx(np.median(whole))
    assert paired["model_share_by_exit_site"] == {}  # no answer names its exit site here
    results[0].sites, results[0].exit_site = ("s",), np.where(early, 0, -1)
    model = [k for k, (stage, _, _) in enumerate(STAGES) if stage == "model to the exit"][0]
    at = early.copy()
    at[untraced] = False
    shares = paired_stage_costs(*results)["model_share_by_exit_site"]
    if at.any():
        ratio = np.median(shifted[at, 1 + model] / gaps[at, 1 + model])
        assert shares == {"s": pytest.approx(ratio)}
    else:
        assert shares == {}
    with pytest.raises(ValueError, match="different requests"):
        paired_stage_costs(results[0], load_result([0.0], [1.0], [200], [0]))


def _demo_entry(p50_rounds: list[float], p99_rounds: list[float], exits: float, accuracy: float = 0.995) -> dict:
    """`bench live`'s entry for one load, as the demo reads it: vanilla at 2 ms p50, 10 ms p99."""
    def paired(rounds: list[float]) -> dict:
        return {"ratio": float(np.median(rounds)), "ratio_rounds": rounds}

    vanilla = {"p50_ms": 2.0, "p99_ms": 10.0, "exit_share": 0.0, "worst_window_accuracy": 1.0, "throughput_rps": 100.0}
    served = {"p50_ms": 2.0 * float(np.median(p50_rounds)), "p99_ms": 10.0 * float(np.median(p99_rounds)),
              "exit_share": exits, "worst_window_accuracy": 0.99, "throughput_rps": 100.0}
    return {"systems": {"vanilla": vanilla, "rampserve": served},
            "versus_vanilla": {"p50_ms": paired(p50_rounds), "p99_ms": paired(p99_rounds), "accuracy": accuracy}}


def test_the_demo_says_what_its_numbers_show():
    from rampserve.cli import demo_verdict

    # no exits: a lower p50 is noise
    assert "saved nothing" in demo_verdict(_demo_entry([0.9, 0.95], [0.9, 0.9], 0.0))
    cut = demo_verdict(_demo_entry([0.58, 0.62], [0.9, 0.95], 0.5))
    assert "cut the median by 40%" in cut and "0.60x (0.58-0.62)" in cut and "tail was worse" not in cut
    # a cut no larger than the rounds' spread, or seen in one round, is not claimed
    within = demo_verdict(_demo_entry([0.8, 1.0], [0.9, 0.9], 0.5))
    assert "within the rounds' spread" in within and "cut the median" not in within
    single = demo_verdict(_demo_entry([0.6], [0.9], 0.5))
    assert "one round" in single and "cut the median" not in single
    slower = demo_verdict(_demo_entry([1.1, 1.3], [1.2, 1.4], 0.3))
    assert "did not lower the median" in slower and "p50 1.20x (1.10-1.30)" in slower
    assert "tail was worse: p99 1.30x" in slower and "fell below" not in slower
    assert "fell below the 99%" in demo_verdict(_demo_entry([0.6, 0.62], [0.9, 0.9], 0.5, accuracy=0.987))
