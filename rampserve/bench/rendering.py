"""What every table rendered from kept runs shares (rampserve/bench/headlines.py's and the pages' own modules beside
it, which it registers): a run's JSON, a system's figure over the seeds of a run, its median with its range, a
row of cells and a header. Shared so that "median (min-max)" is read and written one way whichever page shows it; they live apart
from the registry because the registry imports the pages' modules."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

# How a median and its range's two ends show, as each page typed them
HYPHENATED, EN_DASHED, BRACKETED = "{} ({}-{})", "{} ({}–{})", "{} [{}, {}]"


def read_run(root: Path, file: str) -> Any:
    """A kept run's JSON, `file` under the runs' folder `root`."""
    return json.loads((root / file).read_text())


def seed_values(seeds: list[dict], system: str, figure: str) -> list[float]:
    """One system's figure in every seed (a `bench sim` run's "seeds", a `bench freeze --model` run's "per_seed");
    "p50" and "p99" as ratios to vanilla's in the same seed (a figure such as "p50_ratio" is read as the run kept
    it)."""
    if figure in ("p50", "p99"):
        return [seed["systems"][system][f"{figure}_ms"] / seed["systems"]["vanilla"][f"{figure}_ms"]
                for seed in seeds]
    return [seed["systems"][system][figure] for seed in seeds]


def ranged(median: str, low: str, high: str, form: str = HYPHENATED, single: bool = False) -> str:
    """A median and its range's two ends, each shown already, in a page's `form`. With `single`, the median alone
    where the two ends show as one figure (a page that drops a range that says nothing)."""
    return median if single and low == high else form.format(median, low, high)


def spread(values: list[float], spec: str, form: str = HYPHENATED, single: bool = False) -> str:
    """The values' median and their lowest and highest, each formatted by `spec`, in a page's `form`."""
    return ranged(*(f"{value:{spec}}" for value in (statistics.median(values), min(values), max(values))), form,
                  single)


def table_row(cells: list[str]) -> str:
    """A Markdown table's row of `cells`."""
    return f"| {' | '.join(cells)} |"


def header(columns: tuple[str, ...]) -> str:
    """A Markdown table's header row and rule, from its columns (the page's words)."""
    return f"{table_row(list(columns))}\n|{'---|' * len(columns)}"
