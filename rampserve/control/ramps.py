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
from rampserve.control.exit_rule import NO_EXIT, first_exits
from rampserve.control.objective import objective_ms
from rampserve.control.thresholds import ExitData


def fits_budget(costs: CostModel, sites: Sequence[str], budget: float, batch_size: int) -> bool:
    return costs.overhead_fraction(ordered(costs, sites), batch_size) <= budget + 1e-12


def no_ramp_fits(budget: float, batch_size: int) -> str:
    """Why a search judged no set but "no ramp", in the words the controller's decision and a certifying model's
    status give it."""
    return f"no ramp fits the ramp budget ({budget:.0%} of the model) at batch {batch_size}, the median batch served"


def affordable_sites(costs: CostModel, budget: float, batch_size: int | None = None) -> tuple[str, ...]:
    """The sites whose ramp alone fits the budget at `batch_size`, or at some batch size the profile holds where it
    is None (the budget is then judged at the median batch served, which may be any). A set holding any other site
    never fits, so shadow batches need not evaluate it: on ONNX Runtime each of resnet18-fmnist's eight ramps costs
    10-13% of the model at batch 1, and a shadow batch running them all made the managed server's every tenth batch
    nearly twice as long, for a search that could deploy nothing."""
    sizes = costs.profile.batch_sizes if batch_size is None else (batch_size,)
    return tuple(s for s in costs.sites if any(fits_budget(costs, (s,), budget, b) for b in sizes))


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

    @staticmethod
    def mean(estimates: Sequence[SetEstimate]) -> SetEstimate:
        """Estimates of one set under several threshold choices, averaged (thresholds: the first's)."""
        first = estimates[0]
        return SetEstimate(first.sites, first.thresholds, float(np.mean([e.objective_ms for e in estimates])),
                           float(np.mean([e.mean_ms for e in estimates])),
                           float(np.mean([e.exit_share for e in estimates])))

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


RampSet = tuple[str, ...]


def beam_search(sites: Sequence[str], fits: Callable[[RampSet], bool], score: Callable[[RampSet], object],
                width: int) -> list[RampSet]:
    """Ramp sets grown one site at a time within `fits`: every single site, then each size's sets that extend one
    of the `width` best (highest `score`; ties to the earlier set) of the size below. Returns every set scored, by
    size, then in the sites' order. Every k + 1-site set that fits has k-site subsets that fit, so with `width` at
    least the number of sets that fit, the search scores all of them."""
    if width < 1:
        raise ValueError(f"beam width must be at least 1, got {width}")
    position = {s: i for i, s in enumerate(sites)}

    def in_order(chosen: RampSet) -> list[int]:
        return [position[s] for s in chosen]

    scored: list[RampSet] = []
    level = [(s,) for s in sites if fits((s,))]
    while level:
        scored += level
        kept = sorted(level, key=score, reverse=True)[:width]  # stable: ties keep the earlier set
        grown = {tuple(sorted((*chosen, s), key=position.__getitem__)) for chosen in kept for s in sites
                 if s not in chosen}
        level = sorted((chosen for chosen in grown if fits(chosen)), key=in_order)
    return scored


def search_sets(costs: CostModel, judge: Callable[[RampSet], SetEstimate], budget: float, budget_batch: int,
                beam: int, excluded: Callable[[RampSet], bool] = lambda _: False) -> list[SetEstimate]:
    """No ramp and every set a `beam_search` within the budget judges, best first (by `SetEstimate.key`).
    `excluded` sets are neither judged nor grown (a set left recently: returning to it would flip the deployment
    back and forth)."""
    judged: dict[RampSet, SetEstimate] = {(): judge(())}

    def preference(sites: RampSet) -> tuple[float, float]:
        if sites not in judged:
            judged[sites] = judge(sites)
        return tuple(-k for k in judged[sites].key())

    grown = beam_search(costs.sites, lambda s: not excluded(s) and fits_budget(costs, s, budget, budget_batch),
                        preference, beam)
    return sorted([judged[()], *(judged[s] for s in grown)], key=SetEstimate.key)
