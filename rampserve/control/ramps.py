"""Which ramps to keep active (Apparate §3.3, judged differently): every candidate set is estimated on the same
recent inputs, whose every ramp output a shadow batch recorded, for the objective the user asked to cut; the best
set within the ramp budget is searched for by a beam over set sizes.

Pure functions of recorded ramp outputs and the latency profile (through `CostModel`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from rampserve.control.costs import CostModel
from rampserve.control.objective import objective_ms
from rampserve.control.thresholds import ExitData
from rampserve.ramps.exit_rule import NO_EXIT, first_exits


def fits_budget(costs: CostModel, sites: Sequence[str], budget: float, batch_size: int) -> bool:
    return costs.overhead_fraction(ordered(costs, sites), batch_size) <= budget + 1e-12


def ordered(costs: CostModel, sites: Sequence[str]) -> tuple[str, ...]:
    return tuple(sorted(set(sites), key=costs.position.__getitem__))


def evenly_spaced(count: int, ramps: int) -> list[int]:
    """`ramps` positions among `count` sites, spread evenly, neither end favoured."""
    return sorted({int(round(p)) for p in np.linspace(0, count - 1, ramps + 2)[1:-1]}) if ramps else []


def initial_sites(costs: CostModel, budget: float, batch_size: int) -> tuple[str, ...]:
    """The most ramps the budget allows, spread evenly over the model's sites (a start for a controller that does
    not search)."""
    for ramps in range(len(costs.sites), 0, -1):
        sites = tuple(costs.sites[p] for p in evenly_spaced(len(costs.sites), ramps))
        if len(sites) == ramps and fits_budget(costs, sites, budget, batch_size):
            return sites
    return ()


@dataclass(frozen=True)
class SetEstimate:
    """A ramp set with the thresholds chosen for it, and what they give on the inputs it was judged on."""

    sites: tuple[str, ...]
    thresholds: tuple[float, ...]
    objective_ms: float  # lower is better
    mean_ms: float
    exit_share: float

    def key(self) -> tuple[float, float]:
        """Order of preference: the objective, then the mean (a quantile ties between sets that move no input
        across it, and the mean then says which moves more towards it)."""
        return self.objective_ms, self.mean_ms

    def to_json(self) -> dict:
        return {"sites": list(self.sites), "thresholds": list(self.thresholds), "objective_ms": self.objective_ms,
                "mean_ms": self.mean_ms, "exit_share": self.exit_share}


def estimate(data: ExitData, thresholds: np.ndarray, sites: tuple[str, ...], vanilla_ms: np.ndarray,
             objective: str) -> SetEstimate:
    """What `sites` at `thresholds` give on `data`'s inputs: each leaves at its first exit (or runs to the end,
    charged every active ramp), its latency the vanilla model's less the time saved there."""
    exits = first_exits(data.errors, thresholds) if sites else np.full(data.size, NO_EXIT)
    column = np.where(exits == NO_EXIT, len(sites), exits)
    latency = vanilla_ms - data.saved_ms[np.arange(data.size), column]
    weights = data.weights
    total = float(weights.sum()) or 1.0
    return SetEstimate(sites, tuple(float(t) for t in thresholds), objective_ms(latency, weights, objective),
                       float(np.dot(latency, weights) / total), float(np.dot(exits != NO_EXIT, weights) / total))


def search_sets(costs: CostModel, judge: Callable[[tuple[str, ...]], SetEstimate], budget: float,
                budget_batch: int, beam: int, excluded: Callable[[tuple[str, ...]], bool] = lambda _: False
                ) -> list[SetEstimate]:
    """Every set judged by a beam search within the budget, best first: from no ramp, each size's `beam` best sets
    (by `SetEstimate.key`) grow by one site each, until no set can grow within the budget. `excluded` sets are
    neither judged nor grown (a set left recently: returning to it would flip the deployment back and forth)."""
    judged: dict[tuple[str, ...], SetEstimate] = {(): judge(())}
    frontier: list[tuple[str, ...]] = [()]
    while frontier:
        grown = {ordered(costs, (*sites, site)) for sites in frontier for site in costs.sites if site not in sites}
        fresh = [s for s in sorted(grown, key=lambda s: [costs.position[x] for x in s])
                 if s not in judged and not excluded(s) and fits_budget(costs, s, budget, budget_batch)]
        for sites in fresh:
            judged[sites] = judge(sites)
        frontier = sorted(fresh, key=lambda s: judged[s].key())[:beam]
    return sorted(judged.values(), key=SetEstimate.key)
