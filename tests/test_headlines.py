"""The docs' results tables (the README's headlines, docs/control.md's promises) are rendered from the kept JSON of
the runs they quote: each page holds exactly its rendering, and a figure that changes in a run's JSON changes the
table (so a drifted page fails here)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rampserve.bench.headlines import KEPT, PROMISE_ROWS, ROWS, SECTIONS, Figure, at, get, promise_table, table

ROOT = Path(__file__).resolve().parent.parent


README = SECTIONS[0]


@pytest.mark.parametrize("section", SECTIONS, ids=lambda section: section.name)
def test_each_page_holds_the_table_its_runs_render(section) -> None:
    page = (ROOT / section.page).read_text()
    assert section.within(page, section.render(KEPT)) == page, (
        f"the {section.name} table of {section.page} differs from its runs' JSON: `rampserve bench headlines "
        "--write` renders it")


def test_every_row_names_kept_runs_and_fills_every_figure() -> None:
    for row in ROWS:
        assert row.files and all((KEPT / file).is_file() for file in row.files), row.what
        assert row.result.count("{}") == len(row.figures), row.what
    assert all((KEPT / row.file).is_file() for row in PROMISE_ROWS)


def test_a_path_walks_keys_indices_and_every_element() -> None:
    run = {"loads": [{"ratio": 0.8, "rounds": [{"p": 1}, {"p": 3}]}], "spaced key": {"a b": 2}}
    assert get(run, "loads.0.ratio") == 0.8
    assert get(run, "loads.0.rounds.*.p") == [1, 3]
    assert get(run, "spaced key.a b") == 2
    assert get(run, "") is run
    assert at("loads.0.rounds.*.p", "{}", then=max).render([run]) == "3"
    assert Figure(lambda runs: len(runs), "{} runs").render([run, run]) == "2 runs"


def linked_runs(folder: Path, changed: str, change) -> None:
    """Every kept run linked under `folder`, but `changed`, copied there with `change` made to its JSON."""
    for file in ({file for row in ROWS for file in row.files} | {row.file for row in PROMISE_ROWS}) - {changed}:
        (folder / file).symlink_to(KEPT / file)
    run = json.loads((KEPT / changed).read_text())
    change(run)
    (folder / changed).write_text(json.dumps(run))


def test_a_figure_that_changes_in_its_json_changes_the_table(tmp_path) -> None:
    changed_run = ROWS[1].files[0]  # bench sim minilm-rt: its p50 median is the row's first figure
    linked_runs(tmp_path, changed_run, lambda run: run["summary"]["rampserve"]["p50_ratio"].update(median=0.4))
    page = (ROOT / "README.md").read_text()
    rendered = table(tmp_path)
    changed = README.within(page, rendered)
    assert changed != page
    assert "p50 0.40× /" in changed and "p50 0.40× /" not in page
    assert rendered.count("\n") == table(KEPT).count("\n")


def test_a_seeds_figure_that_changes_changes_the_promise_table(tmp_path) -> None:
    """A seed's accuracy moves the worst seed's accuracy, and with it the seeds' median the budget is spent at."""
    row = PROMISE_ROWS[0]

    def worse_seed(run: dict) -> None:
        run["seeds"][0]["systems"]["rampserve"]["accuracy"] = 0.9811

    linked_runs(tmp_path, row.file, worse_seed)
    rendered, kept = promise_table(tmp_path), promise_table(KEPT)
    changed_row = rendered.splitlines()[2]
    assert changed_row != kept.splitlines()[2] and "| 0.9811 |" in changed_row
    assert rendered.splitlines()[3:] == kept.splitlines()[3:]


def test_a_page_without_the_markers_is_refused() -> None:
    for section in SECTIONS:
        with pytest.raises(ValueError):
            section.within("no table here", section.render(KEPT))
        assert section.start in (ROOT / section.page).read_text()
