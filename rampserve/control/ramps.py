"""Latency-focused ramp adjustment (Apparate §3.3): which ramps to keep active, and where to try new ones.

Pure functions of recorded ramp outputs and the latency profile (through `CostModel`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from rampserve.control.costs import CostModel
from rampserve.ramps.exit_rule import NO_EXIT, first_exits


def fits_budget(costs: CostModel, sites: Sequence[str], budget: float, batch_size: int) -> bool:
    return costs.overhead_fraction(ordered(costs, sites), batch_size) <= budget + 1e-12


def ordered(costs: CostModel, sites: Sequence[str]) -> tuple[str, ...]:
    return tuple(sorted(set(sites), key=costs.position.__getitem__))


def evenly_spaced(count: int, ramps: int) -> list[int]:
    """`ramps` positions among `count` sites, spread evenly, neither end favoured."""
    return sorted({int(round(p)) for p in np.linspace(0, count - 1, ramps + 2)[1:-1]}) if ramps else []


def initial_sites(costs: CostModel, budget: float, batch_size: int) -> tuple[str, ...]:
    """The most ramps the budget allows, spread evenly over the model's sites."""
    for ramps in range(len(costs.sites), 0, -1):
        sites = tuple(costs.sites[p] for p in evenly_spaced(len(costs.sites), ramps))
        if len(sites) == ramps and fits_budget(costs, sites, budget, batch_size):
            return sites
    return ()


def ramp_utilities(costs: CostModel, sites: tuple[str, ...], thresholds: np.ndarray, errors: np.ndarray,
                   batch_sizes: np.ndarray, weights: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Per active ramp: (utility in ms summed over inputs, exits). Utility = time its exits saved against
    vanilla (and in stop mode the compute they saved) minus the time it added to the inputs that passed it
    without exiting. `weights`: the inputs each row stands for (stop mode's sample; 1 each by default)."""
    r = len(sites)
    exits = first_exits(errors, thresholds)
    saved = costs.saved_ms(sites, batch_sizes)[:, :r]
    ramp_ms = np.stack([costs.times(sites, int(b)).ramp_ms for b in batch_sizes]) if len(batch_sizes) else \
        np.zeros((0, r))
    columns = np.arange(r)
    w = np.ones(len(errors)) if weights is None else weights
    exit_here = (exits[:, None] == columns[None, :]) * w[:, None]
    passed = ((exits == NO_EXIT)[:, None] | (exits[:, None] > columns[None, :])) * w[:, None]
    utility = (saved * exit_here).sum(axis=0) - (ramp_ms * passed).sum(axis=0)
    return utility, exit_here.sum(axis=0)


# A configuration's active sites -> (time saved per input, its tuned thresholds) when last measured.
Known = Mapping[tuple[str, ...], tuple[float, tuple[float, ...]]]


@dataclass(frozen=True)
class Adjustment:
    sites: tuple[str, ...]
    thresholds: tuple[float, ...]
    reason: str


def _candidate_order(low: int, high: int) -> list[int]:
    """Free positions strictly between `low` and `high`: the middle first, then the middle of what lies after
    it, and so on (later ramps exit more, so the search moves toward the interval's end)."""
    order = []
    while high - low > 1:
        middle = (low + high) // 2
        order.append(middle)
        low = middle
    return order


def _candidate_utility(costs: CostModel, site: str, exits_bound: int, reaching: np.ndarray) -> float:
    """Projected utility of a ramp at `site` that exits `exits_bound` of the `reaching` inputs (batch sizes)."""
    if not len(reaching):
        return -np.inf
    times = [costs.times((site,), int(b)) for b in reaching]
    saved = np.mean([t.vanilla_ms - t.release_ms[0] for t in times])
    ramp_ms = np.mean([t.ramp_ms[0] for t in times])
    exiting = min(exits_bound, len(reaching))
    return exiting * saved - (len(reaching) - exiting) * ramp_ms


def adjust_ramps(costs: CostModel, sites: tuple[str, ...], thresholds: np.ndarray, errors: np.ndarray,
                 batch_sizes: np.ndarray, budget: float, budget_batch: int,
                 retune: Callable[[], np.ndarray] | None, start: Mapping[str, float],
                 known: Known | None = None, weights: np.ndarray | None = None) -> Adjustment | None:
    """One round of ramp adjustment over the recent inputs of the active set `sites`. None: keep as is.

    `start` gives the threshold a newly active ramp starts at (absent: 0, it exits nothing until tuned).
    `known`: configurations measured before with every ramp tuned, and what they saved per input. Apparate's
    probing never looks back; remembering lets a probe that did worse be undone and not be repeated.
    `weights`: the inputs each row stands for (stop mode's sample)."""
    if not sites:
        middle = costs.sites[evenly_spaced(len(costs.sites), 1)[0]] if costs.sites else None
        if middle is not None and fits_budget(costs, (middle,), budget, budget_batch):
            return Adjustment((middle,), (start.get(middle, 0.0),), "no active ramp: trial one mid-model")
        return None
    utility, exit_counts = ramp_utilities(costs, sites, thresholds, errors, batch_sizes, weights)
    if (utility < 0).any() and retune is not None:
        tuned = retune()
        tuned_utility, tuned_exits = ramp_utilities(costs, sites, tuned, errors, batch_sizes, weights)
        if tuned_utility.sum() >= utility.sum():
            if (tuned_utility >= 0).all():
                return Adjustment(sites, tuple(float(t) for t in tuned), "retuned: every ramp now pays off")
            thresholds, utility, exit_counts = tuned, tuned_utility, tuned_exits
    known = known or {}
    value = float(utility.sum()) / max(1.0, len(errors) if weights is None else float(weights.sum()))
    if (utility < 0).any():
        return _return_to_better(costs, known, sites, max(value, 0.0), budget, budget_batch) or _replace_negative(
            costs, sites, thresholds, errors, batch_sizes, utility, exit_counts, budget, budget_batch, start)
    return _return_to_better(costs, known, sites, value, budget, budget_batch) or _probe(
        costs, sites, thresholds, utility, budget, budget_batch, start, known)


def _return_to_better(costs: CostModel, known: Known, sites: tuple[str, ...], value: float, budget: float,
                      budget_batch: int) -> Adjustment | None:
    better = [(saved, past, thresholds) for past, (saved, thresholds) in known.items()
              if past != sites and saved > value and fits_budget(costs, past, budget, budget_batch)]
    if not better:
        return None
    saved, past, thresholds = max(better)
    return Adjustment(past, thresholds, f"back to {list(past)}, measured to save {saved:.3f} ms per input")


def _replace_negative(costs: CostModel, sites: tuple[str, ...], thresholds: np.ndarray, errors: np.ndarray,
                      batch_sizes: np.ndarray, utility: np.ndarray, exit_counts: np.ndarray, budget: float,
                      budget_batch: int, start: Mapping[str, float]) -> Adjustment:
    """Deactivate the negative ramps and trial (at its start threshold) the candidate with the best upper-bound
    utility after the latest positive ramp (§3.3, Figure 12)."""
    positions = np.array([costs.position[s] for s in sites])
    keep = utility >= 0
    kept_sites = tuple(s for s, k in zip(sites, keep) if k)
    kept_thresholds = tuple(float(t) for t, k in zip(thresholds, keep) if k)
    latest_positive = int(positions[keep].max()) if keep.any() else -1
    dropped = [(int(p), int(e)) for p, e, k in zip(positions, exit_counts, keep) if not k and p > latest_positive]
    reason = f"deactivated {[s for s, k in zip(sites, keep) if not k]} (negative utility)"
    if not dropped:
        return Adjustment(kept_sites, kept_thresholds, reason)
    # Inputs that would reach a candidate: those not exiting at a kept ramp before it.
    kept_exits = first_exits(errors[:, keep], thresholds[keep]) if keep.any() else np.full(len(errors), NO_EXIT)
    intervals = []
    low, bound = latest_positive, 0
    for position, exits in dropped:
        bound += exits  # inputs of earlier deactivations would have reached this one and might have exited
        intervals.append((_candidate_order(low, position), bound))
        low = position
    # The range after the last deactivation runs to the model's end, where no deactivated ramp bounds the exit
    # rate: bound it by every input that gets there. Without this interval ramps could only ever move earlier,
    # and a model whose useful ramps are late (small CNNs) would never find them.
    intervals.append((_candidate_order(low, len(costs.sites)), len(errors)))
    active_positions = set(positions[keep].tolist())
    for depth in range(max(len(order) for order, _ in intervals)):
        scored = []
        for order, bound in intervals:
            if depth >= len(order) or order[depth] in active_positions:
                continue
            site = costs.sites[order[depth]]
            if not fits_budget(costs, (*kept_sites, site), budget, budget_batch):
                continue
            before = np.array([costs.position[s] < order[depth] for s in kept_sites], dtype=bool)
            reaching = batch_sizes[~np.isin(kept_exits, np.flatnonzero(before))] if keep.any() else batch_sizes
            scored.append((_candidate_utility(costs, site, bound, reaching), site))
        positive = [c for c in scored if c[0] > 0]
        if positive:
            _, site = max(positive)
            new_sites = ordered(costs, (*kept_sites, site))
            chosen = dict(zip(kept_sites, kept_thresholds)) | {site: start.get(site, 0.0)}
            return Adjustment(new_sites, tuple(chosen[s] for s in new_sites), f"{reason}; trial {site}")
    return Adjustment(kept_sites, kept_thresholds, reason)


def _probe(costs: CostModel, sites: tuple[str, ...], thresholds: np.ndarray, utility: np.ndarray,
           budget: float, budget_batch: int, start: Mapping[str, float], known: Known) -> Adjustment | None:
    """Every ramp pays off: with budget left, add a ramp just before the best one; otherwise move the
    weakest ramp one site earlier, leaving the best untouched. A lone ramp (the weakest is the best) trials
    the next later site instead, or it would never learn whether another site pays more. Configurations
    measured before are not probed again."""
    current = dict(zip(sites, (float(t) for t in thresholds)))
    best, weakest = int(np.argmax(utility)), int(np.argmin(utility))
    probes: list[tuple[dict[str, float], str]] = []
    before_best = costs.position[sites[best]] - 1
    if before_best >= 0 and costs.sites[before_best] not in current:
        site = costs.sites[before_best]
        probes.append((current | {site: start.get(site, 0.0)}, f"added {site} before {sites[best]}"))
    if weakest != best:
        earlier = costs.position[sites[weakest]] - 1
        if earlier >= 0 and costs.sites[earlier] not in current:
            site = costs.sites[earlier]
            kept = {s: t for s, t in current.items() if s != sites[weakest]}
            probes.append((kept | {site: start.get(site, 0.0)}, f"moved {sites[weakest]} to {site}"))
    elif len(sites) == 1 and costs.position[sites[0]] + 1 < len(costs.sites):
        site = costs.sites[costs.position[sites[0]] + 1]
        probes.append(({site: start.get(site, 0.0)}, f"moved the lone ramp {sites[0]} to the next site {site}"))
    for chosen, reason in probes:
        new_sites = ordered(costs, tuple(chosen))
        if new_sites not in known and fits_budget(costs, new_sites, budget, budget_batch):
            return Adjustment(new_sites, tuple(chosen[s] for s in new_sites), reason)
    return None
