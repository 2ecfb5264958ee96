"""`bench executor`'s pure parts: ratios paired within rounds, the table, its settings."""

from __future__ import annotations

from dataclasses import asdict

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rampserve.bench.executor import ExecutorBenchSettings, executor_table, paired_ratios

FIGURES = ("overhead_binary_ms", "overhead_json_ms", "closed_rps", "closed_p50_ms", "closed_p99_ms",
           "closed_mean_batch")


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


def test_a_round_without_a_figure_is_left_out_of_its_ratio() -> None:
    rounds = {"process": [_round(2.0), _round(3.0) | {"closed_mean_batch": None}],
              "thread": [_round(1.0), _round(1.0)]}
    assert paired_ratios(rounds)["closed_mean_batch"] == {"median": 2.0, "min_max": [2.0, 2.0]}
    assert paired_ratios(rounds)["closed_rps"]["median"] == pytest.approx(2.5)


def test_the_table_shows_medians_spans_and_ratios() -> None:
    settings = ExecutorBenchSettings(rounds=2)
    systems = {kind: _round(value) | {"min_max": {key: [value, value] for key in FIGURES}, "rounds": []}
               for kind, value in (("thread", 1.0), ("process", 0.5))}
    report = {"model": "m", "batch1_inprocess_ms": 1.2, "settings": asdict(settings), "systems": systems,
              "process_over_thread": {key: {"median": 0.5, "min_max": [0.4, 0.6]} for key in FIGURES}}
    table = executor_table(report)
    assert [c.header for c in table.columns][1:] == ["executor thread", "executor process",
                                                     "process / thread (paired)"]
    assert list(table.columns[3].cells) == ["0.50 (0.40–0.60)"] * len(FIGURES)


def test_settings_refuse_a_closed_loop_shorter_than_its_settling() -> None:
    with pytest.raises(ValueError, match="outlast"):
        ExecutorBenchSettings(closed_s=1.0, closed_settle_s=2.0)
