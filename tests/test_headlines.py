"""The README's results table is rendered from the kept JSON of the runs it quotes: the page holds exactly that
rendering, and a figure that changes in a run's JSON changes the table (so a drifted page fails here)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rampserve.bench import headlines
from rampserve.bench.headlines import KEPT, ROWS, Figure, at, get, table, with_table

ROOT = Path(__file__).resolve().parent.parent


def test_the_readme_holds_the_table_its_runs_render() -> None:
    page = (ROOT / "README.md").read_text()
    assert with_table(page, table()) == page, ("the README's results table differs from its runs' JSON: "
                                               "`rampserve bench headlines --write` renders it")


def test_every_row_names_kept_runs_and_fills_every_figure() -> None:
    for row in ROWS:
        assert row.files and all((KEPT / file).is_file() for file in row.files), row.what
        assert row.result.count("{}") == len(row.figures), row.what


def test_a_path_walks_keys_indices_and_every_element() -> None:
    run = {"loads": [{"ratio": 0.8, "rounds": [{"p": 1}, {"p": 3}]}], "spaced key": {"a b": 2}}
    assert get(run, "loads.0.ratio") == 0.8
    assert get(run, "loads.0.rounds.*.p") == [1, 3]
    assert get(run, "spaced key.a b") == 2
    assert get(run, "") is run
    assert at("loads.0.rounds.*.p", "{}", then=max).render([run]) == "3"
    assert Figure(lambda runs: len(runs), "{} runs").render([run, run]) == "2 runs"


def test_a_figure_that_changes_in_its_json_changes_the_table(tmp_path) -> None:
    """Every kept run linked under a copy of bench-results/, one of them with its median ratio changed."""
    changed_run = ROWS[1].files[0]  # bench sim minilm-rt: its p50 median is the row's first figure
    for file in {file for row in ROWS for file in row.files} - {changed_run}:
        (tmp_path / file).symlink_to(KEPT / file)
    run = json.loads((KEPT / changed_run).read_text())
    run["summary"]["rampserve"]["p50_ratio"]["median"] = 0.4
    (tmp_path / changed_run).write_text(json.dumps(run))
    page = (ROOT / "README.md").read_text()
    rendered = table(tmp_path)
    changed = with_table(page, rendered)
    assert changed != page
    assert "p50 0.40× /" in changed and "p50 0.40× /" not in page
    assert rendered.count("\n") == table(KEPT).count("\n")


def test_a_page_without_the_markers_is_refused() -> None:
    with pytest.raises(ValueError):
        with_table("no table here", table())
    assert headlines.START in (ROOT / "README.md").read_text()
