"""docs/selection.md's figure tables, rendered from the `bench selection` runs they quote (registered as sections in
rampserve/bench/headlines.py), so that the page's figures cannot drift from its runs.

Every cell is computed from the run's seeds, not read from its "summary" or "bars", so that a seed's figure that
changes changes the page; the computing is the bench's own (`bench.selection.spread`: a seed that never regained
the failed model counts as the slowest; `bench.selection.bars`, under the run's own settings), so the page and the
bench cannot disagree on how a median over seeds is taken or when a bar is met."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rampserve.bench import selection
from rampserve.bench.rendering import BRACKETED, header, ranged, read_run, table_row

SKLEARN_RUN = "selection-forgetting4-sklearn5-seeds5.json"
CNN_RUN = "selection-forgetting4-cnn3-logreg-seeds5.json"
NEVER = "never"  # a seed in which the failed model never regained its weight (None in the run)


def shown(value: float | None, spec: str) -> str:
    """A figure of one seed or a median; None is a failed model that never regained its weight, as the bench says."""
    return NEVER if value is None else f"{value:{spec}}"


def summed(figure: dict, spec: str) -> str:
    """A figure summed over seeds (median, min, max) as "median [min, max]"; "never" alone where no seed reached it
    (its least is None only when every seed's is)."""
    if figure["min"] is None:
        return NEVER
    return ranged(*(shown(figure[key], spec) for key in ("median", "min", "max")), BRACKETED)


@dataclass(frozen=True)
class Policy:
    """A row of a policies table: the page's label for one bandit under one forgetting mechanism of the run."""

    label: str  # as the page says it
    mechanism: str  # the forgetting mechanism, a key of the run's "forgetting"
    bandit: str  # "exp3" or "exp4"


EVERY_POLICY = (Policy("Exp3, none (former)", "none", "exp3"), Policy("Exp3, **detect** (default)", "detect", "exp3"),
                Policy("Exp3, share", "share", "exp3"), Policy("Exp3, detect+share", "detect+share", "exp3"),
                Policy("Exp4, none (former)", "none", "exp4"), Policy("Exp4, detect", "detect", "exp4"),
                Policy("Exp4, share", "share", "exp4"),
                Policy("Exp4, **detect+share** (default)", "detect+share", "exp4"))
# the zoo CNNs' table shows the same rows but Exp3's two with fixed share (as the page was typed)
CNN_POLICIES = tuple(policy for policy in EVERY_POLICY if policy.bandit == "exp4" or "share" not in policy.mechanism)


@dataclass(frozen=True)
class PoliciesTable:
    """Per policy and forgetting mechanism: its error before, during and after the failure and the queries until the
    failed model regains half its weight, each "median [min, max]" over seeds; where `failing_weight`, also the
    failing model's weight before the failure (the median alone)."""

    file: str
    policies: tuple[Policy, ...]
    failing_weight: bool

    def columns(self) -> tuple[str, ...]:
        weight = ("failing weight before",) if self.failing_weight else ()
        return ("policy, forgetting", "before (0-5k)", "during the failure", "after (10k-20k)", *weight,
                "regained after (queries)")

    def cells(self, seeds: list[dict], policy: Policy) -> list[str]:
        runs = [seed["forgetting"][policy.mechanism][policy.bandit] for seed in seeds]

        def over_seeds(key: str) -> dict:
            return selection.spread([run[key] for run in runs])

        weight = [f"{over_seeds('failing_weight_before')['median']:.2f}"] if self.failing_weight else []
        return [policy.label, *(summed(over_seeds(key), ".4f") for key in ("error_before", "error_during",
                                                                           "error_after")),
                *weight, summed(over_seeds("regained_after"), ".0f")]

    def render(self, root: Path) -> str:
        seeds = read_run(root, self.file)["seeds"]
        return "\n".join([header(self.columns()), *(table_row(self.cells(seeds, policy)) for policy in self.policies)])


@dataclass(frozen=True)
class Bar:
    """A row of a bars table: one of the issue's bars, the margin `bench.selection.bars` judges it by, and how the
    page shows it."""

    label: str  # as the page says it
    key: str  # the bar's margin in `bench.selection.bars`
    spec: str
    missed_by: str | None = None  # where given, a missed bar says by how much (its median margin, in this format)

    def cell(self, figure: dict) -> str:
        if figure["met"]:
            verdict = "met"
        else:
            verdict = "**missed**" if self.missed_by is None else f"**missed by {figure['median']:{self.missed_by}}**"
        return f"{verdict}: {summed(figure, self.spec)}"


BARS = (Bar("below the best static model over the failure", "during_minus_best_static", "+.4f"),
        Bar("failed model regains half its weight within 2,000 queries", "regained_after", ".0f"),
        Bar("error over 10,000-20,000 no worse than over 0-5,000", "after_minus_before", "+.4f", missed_by=".4f"))
# the defaults' policies, as the columns show them: (bandit, its forgetting mechanism)
DEFAULTS = (("exp3", "detect"), ("exp4", "detect+share"))


@dataclass(frozen=True)
class BarsTable:
    """The issue's bars for the default policies: each the median of per-seed margins [min, max], and whether the
    bench judged it met, under the run's own settings."""

    file: str

    def render(self, root: Path) -> str:
        run = read_run(root, self.file)
        settings = selection.SelectionSettings(**{key: tuple(value) if isinstance(value, list) else value
                                                  for key, value in run["settings"].items()})
        found = [selection.bars(run["seeds"], mechanism, settings)[bandit] for bandit, mechanism in DEFAULTS]
        columns = ("bar", *(f"{bandit.capitalize()} ({mechanism})" for bandit, mechanism in DEFAULTS))
        return "\n".join([header(columns), *(table_row([bar.label, *(bar.cell(bars[bar.key]) for bars in found)])
                                             for bar in BARS)])


SKLEARN_POLICIES = PoliciesTable(SKLEARN_RUN, EVERY_POLICY, failing_weight=True)
SKLEARN_BARS = BarsTable(SKLEARN_RUN)
CNN_POLICIES_TABLE = PoliciesTable(CNN_RUN, CNN_POLICIES, failing_weight=False)
CNN_BARS = BarsTable(CNN_RUN)
TABLES = (SKLEARN_POLICIES, SKLEARN_BARS, CNN_POLICIES_TABLE, CNN_BARS)  # in the page's order
