"""`bench executor`'s pure parts: ratios paired within rounds (process/thread, gRPC/HTTP), the tables, its settings,
the transports' order rotating by round; and the bare HTTP cores it times, each serving the lean client."""

from __future__ import annotations

from dataclasses import asdict

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from rampserve.bench.executor import (
    ENCODINGS, EXECUTORS, ExecutorBenchSettings, executor_table, grpc_over_binary, http_cores_table, over_echo,
    paired_ratios, rotated,
)
from rampserve.bench.harness import ServerProcess, run_loadgen
from rampserve.bench.http_cores import CORES, INFER_PATH
from rampserve.bench.loadgen import Job

FIGURES = ("overhead_binary_ms", "overhead_json_ms", "overhead_grpc_ms", "overhead_lean_ms", "closed_rps",
           "closed_p50_ms", "closed_p99_ms", "closed_mean_batch", "closed_grpc_rps", "closed_grpc_p50_ms",
           "closed_grpc_p99_ms", "closed_grpc_mean_batch")


def _round(value: float) -> dict:
    return {key: value for key in FIGURES} | {"closed_failed": 0}


@given(st.lists(st.tuples(st.floats(0.1, 100), st.floats(0.1, 100)), min_size=1, max_size=7))
def test_ratios_are_paired_within_each_round(pairs) -> None:
    rounds = {"process": [_round(p) for p, _ in pairs], "thread": [_round(t) for _, t in pairs]}
    ratios = paired_ratios(rounds)
    within = sorted(p / t for p, t in pairs)
    for key in FIGURES:
        assert ratios[key]["min_max"] == [within[0], within[-1]]
        assert within[0] <= ratios[key]["median"] <= within[-1]
    assert "closed_failed" not in ratios  # a count, not a figure to compare


def test_grpc_over_binary_is_paired_within_each_round_and_counts_the_models_time_in_latency() -> None:
    rounds = [_round(1.0) | {"overhead_grpc_ms": 2.0, "closed_grpc_rps": 0.5},
              _round(1.0) | {"overhead_grpc_ms": 0.5, "closed_grpc_rps": 2.0, "closed_grpc_p99_ms": None}]
    ratios = grpc_over_binary(rounds, batch1_ms=1.0)
    # (overhead + batch 1) in each round: (2 + 1) / (1 + 1) and (0.5 + 1) / (1 + 1)
    assert ratios["one_at_a_time_p50"] == {"median": pytest.approx(1.125), "min_max": [0.75, 1.5]}
    assert ratios["closed_rps"]["min_max"] == [0.5, 2.0] and ratios["closed_p99_ms"]["min_max"] == [1.0, 1.0]


def test_overhead_over_the_echo_is_paired_with_the_echo_of_its_own_round() -> None:
    rounds = [_round(1.0), _round(0.6) | {"overhead_grpc_ms": None}, _round(0.9)]
    cores = [{"uvicorn": 0.2, "uvicorn-raw": 0.1}, {"uvicorn": 0.3}, {"uvicorn": 0.3}]
    ratios = over_echo(rounds, cores)
    assert ratios["overhead_lean_ms"] == {"median": pytest.approx(3.0), "min_max": [pytest.approx(2.0),
                                                                                 pytest.approx(5.0)]}
    # the round without a gRPC figure is left out of its ratio
    assert ratios["overhead_grpc_ms"]["min_max"] == [pytest.approx(3.0), pytest.approx(5.0)]
    assert set(ratios) == {f"overhead_{encoding}_ms" for encoding in ENCODINGS}


def test_each_round_starts_the_transports_one_further_along() -> None:
    orders = [rotated(ENCODINGS, r) for r in range(len(ENCODINGS))]
    assert orders[0] == ENCODINGS and all(sorted(o) == sorted(ENCODINGS) for o in orders)
    assert len({o[0] for o in orders}) == len(ENCODINGS)  # each goes first once


def test_a_round_without_a_figure_is_left_out_of_its_ratio() -> None:
    rounds = {"process": [_round(2.0), _round(3.0) | {"closed_mean_batch": None}],
              "thread": [_round(1.0), _round(1.0)]}
    assert paired_ratios(rounds)["closed_mean_batch"] == {"median": 2.0, "min_max": [2.0, 2.0]}
    assert paired_ratios(rounds)["closed_rps"]["median"] == pytest.approx(2.5)


def test_the_table_shows_medians_spans_and_ratios() -> None:
    settings = ExecutorBenchSettings(rounds=2)
    systems = {kind: _round(value) | {"min_max": {key: [value, value] for key in FIGURES}, "rounds": []}
               for kind, value in (("thread", 1.0), ("process", 0.5))}
    grpc = {"one_at_a_time_p50": {"median": 0.9, "min_max": [0.8, 1.0]}}
    report = {"model": "m", "batch1_inprocess_ms": 1.2, "settings": asdict(settings), "systems": systems,
              "process_over_thread": {key: {"median": 0.5, "min_max": [0.4, 0.6]} for key in FIGURES},
              "grpc_over_binary": {kind: grpc for kind in EXECUTORS},
              "over_uvicorn_echo": {kind: {"overhead_lean_ms": {"median": 2.5, "min_max": [2.0, 3.0]}}
                                    for kind in EXECUTORS}}
    table = executor_table(report)
    assert [c.header for c in table.columns][1:] == ["executor thread", "executor process",
                                                     "process / thread (paired)"]
    assert list(table.columns[3].cells)[:len(FIGURES)] == ["0.50 (0.40–0.60)"] * len(FIGURES)
    ratio_rows = list(table.columns[0].cells).index("gRPC / binary: one at a time p50")
    assert [list(table.columns[i].cells)[ratio_rows] for i in (1, 2)] == ["0.90 (0.80–1.00)"] * 2
    echo_row = list(table.columns[0].cells).index("overhead lean / uvicorn echo (same round)")
    assert [list(table.columns[i].cells)[echo_row] for i in (1, 2)] == ["2.50 (2.00–3.00)"] * 2


def test_settings_refuse_a_closed_loop_shorter_than_its_settling() -> None:
    with pytest.raises(ValueError, match="outlast"):
        ExecutorBenchSettings(closed_s=1.0, closed_settle_s=2.0)


@pytest.mark.parametrize("core", list(CORES))
def test_every_bare_http_core_answers_the_lean_client_as_a_v2_server(core, tmp_path) -> None:
    """Each core the bench times serves the echo model on loopback: the lean client reads its label on every
    request of a kept-alive connection."""
    feeds = [{"x": np.zeros((1, 4), dtype=np.float32)}] * 3
    with ServerProcess(lambda port, _: CORES[core](port), tmp_path / f"{core}.log", 60.0) as server:
        job = Job(server.url(INFER_PATH), (("x", "FP32"),), "label", None, clients=1, requests=12, lean=True)
        result = run_loadgen(job, feeds, tmp_path, core, 1.0, False)
    assert result.ok.all() and len(result.label) == 12, result.errors
    assert (result.label == 0).all()


def test_the_cores_table_shows_each_cores_median_and_span() -> None:
    cores = {"median_ms": dict.fromkeys(CORES, 0.15), "min_max": dict.fromkeys(CORES, [0.1, 0.2]), "rounds": []}
    table = http_cores_table({"http_cores": cores, "settings": asdict(ExecutorBenchSettings(rounds=3))})
    assert list(table.columns[0].cells) == list(CORES)
    assert list(table.columns[1].cells) == ["0.150 (0.100–0.200)"] * len(CORES)
