"""The docs' results tables (the README's headlines, docs/control.md's promises, docs/freeze.md's and
docs/selection.md's figures) are rendered from the kept JSON of the runs they quote: each page holds exactly its
rendering, and a figure that changes in a run's JSON changes the table (so a drifted page fails here)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rampserve.bench import freeze_tables, selection_tables
from rampserve.bench.headlines import KEPT, PROMISE_ROWS, ROWS, SECTIONS, Figure, at, get, promise_table, table
from rampserve.bench.rendering import EN_DASHED, spread

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
    assert all((KEPT / table.file).is_file() for table in (*freeze_tables.TABLES, *selection_tables.TABLES))


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
    kept = ({file for row in ROWS for file in row.files} | {row.file for row in PROMISE_ROWS}
            | {table.file for table in (*freeze_tables.TABLES, *selection_tables.TABLES)})
    for file in kept - {changed}:
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


def test_a_spread_is_the_median_and_its_range() -> None:
    assert spread([0.5, 0.25, 1.0], ".2f") == "0.50 (0.25-1.00)"
    assert spread([0.5, 0.25, 1.0], ".2f", EN_DASHED) == "0.50 (0.25–1.00)"
    assert spread([1.0, 1.0004, 0.9996], ".2f", EN_DASHED) == "1.00 (1.00–1.00)"
    # a range that shows as one figure
    assert spread([1.0, 1.0004, 0.9996], ".2f", EN_DASHED, single=True) == "1.00"
    assert spread([1.0, 1.01, 0.99], ".2f", EN_DASHED, single=True) == "1.00 (0.99–1.01)"


def differing_rows(table, folder: Path) -> list[tuple[str, str]]:
    """The rows of a page's table that differ, as (kept, rendered), rendered from the runs in `folder`."""
    kept, rendered = table.render(KEPT).splitlines(), table.render(folder).splitlines()
    assert len(kept) == len(rendered)
    return [(before, after) for before, after in zip(kept, rendered) if before != after]


def changed_rows(tmp_path: Path, table, change) -> list[tuple[str, str]]:
    """The rows of a page's table that differ once `change` is made to its run."""
    linked_runs(tmp_path, table.file, change)
    return differing_rows(table, tmp_path)


# (table, seed, system, its new p50 ratio, the row before, the row after): minilm-rt's median moves with a seed;
# lite0-fmnist's table drops a range that shows as one figure, and shows it again once a seed differs
P50_CHANGES = [(freeze_tables.MINILM_SYSTEMS, 0, "ramps", 0.5, "| ramps | 0.633 (0.628–0.661) |",
                "| ramps | 0.628 (0.500–0.633) |"),
               (freeze_tables.LITE0_SYSTEMS, 2, "ramps_oracle", 0.07, "| ramps_oracle | 0.064 |",
                "| ramps_oracle | 0.064 (0.064–0.070) |")]


@pytest.mark.parametrize(("table", "seed", "system", "p50_ratio", "kept_start", "rendered_start"), P50_CHANGES,
                         ids=["minilm-rt", "lite0-fmnist"])
def test_a_seeds_figure_that_changes_changes_the_freeze_systems_table(tmp_path, table, seed, system, p50_ratio,
                                                                      kept_start, rendered_start) -> None:
    """A seed's p50 ratio moves its system's cell, and only its row: every cell is computed from the seeds, not read
    from the run's summary."""

    def changed_seed(run: dict) -> None:
        run["per_seed"][seed]["systems"][system]["p50_ratio"] = p50_ratio

    [(kept, rendered)] = changed_rows(tmp_path, table, changed_seed)
    assert kept.startswith(kept_start) and rendered.startswith(rendered_start)


def test_a_seeds_share_answered_changes_the_freeze_sites_table(tmp_path) -> None:
    def more_answered(run: dict) -> None:
        run["sites"][0]["cache_answerable"][0] = 0.5

    [(kept, rendered)] = changed_rows(tmp_path, freeze_tables.MINILM_SITES, more_answered)
    assert "| 0.035 (0.030–0.039) |" in kept and "| 0.039 (0.035–0.500) |" in rendered
    assert rendered.startswith("| /layers.0/Mul_output_0 | 66 | 775 (1.44%) | 127 (0.55%) | 0.80 |")


def test_a_seeds_error_that_changes_changes_the_selection_policy_and_its_bar(tmp_path) -> None:
    """One seed's error after the failure moves its policy's row and, through the bench's own bars, turns Exp4's
    missed bar (after no worse than before) into a met one."""

    def better_after(run: dict) -> None:
        run["seeds"][2]["forgetting"]["detect+share"]["exp4"]["error_after"] = 0.1072  # 0.0010 under its before

    [(kept, rendered)] = changed_rows(tmp_path, selection_tables.SKLEARN_POLICIES, better_after)
    assert kept.startswith("| Exp4, **detect+share** (default) |") and "| 0.1107 [0.1102, 0.1110] |" in kept
    assert "| 0.1105 [0.1072, 0.1109] |" in rendered
    [(kept, rendered)] = differing_rows(selection_tables.SKLEARN_BARS, tmp_path)  # the same run
    assert kept.endswith("| **missed by 0.0005**: +0.0005 [-0.0010, +0.0028] |")
    assert rendered.endswith("| met: -0.0009 [-0.0010, +0.0019] |")


def test_a_seed_that_never_regains_shows_as_never(tmp_path) -> None:
    """A seed in which the failed model never regains its weight counts as the slowest (the bench's rule)."""

    def never_regained(run: dict) -> None:
        run["seeds"][0]["forgetting"]["detect"]["exp3"]["regained_after"] = None

    [(kept, rendered)] = changed_rows(tmp_path, selection_tables.SKLEARN_POLICIES, never_regained)
    assert kept.endswith("| 548 [136, 775] |") and rendered.endswith(" [136, never] |")
    assert selection_tables.summed({"median": None, "min": None, "max": None}, ".0f") == "never"


def test_a_page_without_the_markers_is_refused() -> None:
    for section in SECTIONS:
        with pytest.raises(ValueError):
            section.within("no table here", section.render(KEPT))
        assert section.start in (ROOT / section.page).read_text()
