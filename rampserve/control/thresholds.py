"""Threshold tuning (Apparate §3.2): evaluate any threshold vector over recorded ramp outputs, without
inference, and search for the thresholds that save the most latency within the accuracy constraint: on the data
(`tune_greedy`), or with a stated confidence (`certified_thresholds`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from rampserve.control import exit_rule
from rampserve.control.exit_rule import NO_EXIT, first_exits
from rampserve.control.guarantee import FULLY_OBSERVED, STRATA, RiskBound

# Thresholds are placed just above an observed error score so that input exits (errors must be below it).
_ABOVE = 1e-9
# Thresholds never exceed 1, so an input whose error score is 1 or more can exit at no ramp: treating it as
# movable would let a raise that moves nothing be chosen again and again.
MAX_THRESHOLD = 1.0


@dataclass(frozen=True)
class ExitData:
    """Recent inputs of one active set, as threshold tuning reads them. In stop mode an input that exited is
    here only when drawn for feedback: it is in the SAMPLED stratum and stands for 1 / share inputs (`weights`)."""

    correct: np.ndarray  # (n, r) bool: ramp j's top label equals the final label
    errors: np.ndarray  # (n, r) error scores
    saved_ms: np.ndarray  # (n, r + 1) time saved against vanilla per exit ramp, last column: no exit
    strata: np.ndarray | None = field(default=None)  # (n,) FULLY_OBSERVED or SAMPLED; None: all fully observed
    weights: np.ndarray | None = field(default=None)  # (n,) inputs each row stands for; None: 1 each
    # (n,) a number each input keeps for life (the controller's count of inputs), which splits the rows into
    # Learn-then-Test's parts the same way however the window over them moves; None: rows in order
    sequence: np.ndarray | None = field(default=None)

    def __post_init__(self) -> None:
        n = len(self.errors)
        if self.strata is None:
            object.__setattr__(self, "strata", np.full(n, FULLY_OBSERVED, dtype=np.int64))
        if self.weights is None:
            object.__setattr__(self, "weights", np.ones(n))
        if self.sequence is None:
            object.__setattr__(self, "sequence", np.arange(n))

    @property
    def size(self) -> int:
        return len(self.errors)

    @property
    def ramps(self) -> int:
        return self.errors.shape[1]

    def rows(self, mask: np.ndarray) -> ExitData:
        return ExitData(self.correct[mask], self.errors[mask], self.saved_ms[mask], self.strata[mask],
                        self.weights[mask], self.sequence[mask])


    def stratum_weights(self) -> np.ndarray:
        """(STRATA,) the inputs a row of each stratum stands for, on average."""
        counts = np.bincount(self.strata, minlength=STRATA)
        return np.bincount(self.strata, weights=self.weights, minlength=STRATA) / np.maximum(counts, 1)

    def wrong_by_stratum(self, thresholds: np.ndarray) -> np.ndarray:
        """Disagreements of the released answers per stratum, (..., STRATA), for threshold vectors (..., r)."""
        exits = first_exits(self.errors, thresholds)
        rows = np.arange(self.size)
        wrong = (exits != NO_EXIT) & ~self.correct[rows, np.where(exits == NO_EXIT, 0, exits)]
        return np.stack([wrong[..., self.strata == s].sum(axis=-1) for s in range(STRATA)], axis=-1)


def _fits(target_accuracy: float, wrong: np.ndarray, stratum_weights: np.ndarray, total: float) -> np.ndarray:
    """Whether disagreement counts (..., STRATA) keep the accuracy over the `total` inputs the rows stand for at
    the target."""
    return (total - wrong @ stratum_weights) / total >= target_accuracy - 1e-12


def evaluate(data: ExitData, thresholds: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Accuracy and mean saved time of threshold vectors (..., r): each input exits at the earliest ramp whose
    error score is below its threshold, and is right when that ramp agrees with the final label."""
    exits = first_exits(data.errors, thresholds)
    column = np.where(exits == NO_EXIT, data.ramps, exits)
    rows = np.arange(data.size)
    right = np.concatenate([data.correct, np.ones((data.size, 1), dtype=bool)], axis=1)[rows, column]
    return right.mean(axis=-1), data.saved_ms[rows, column].mean(axis=-1)


@dataclass(frozen=True)
class TuningResult:
    thresholds: np.ndarray
    accuracy: float
    saved_ms: float  # mean per input over the tuning data
    evaluations: int  # threshold vectors evaluated


def tune_greedy(data: ExitData, target_accuracy: float, initial_step: float = 0.1,
                min_step: float = 0.01) -> TuningResult:
    """Apparate's hill climbing: from all-zero thresholds, each round tries raising every ramp's threshold by
    its own step and keeps the single raise with the most added savings per unit of added accuracy loss
    (doubling that ramp's step); a raise that breaks the constraint halves the step, and at the floor closes
    the ramp. Stops when no ramp can rise. Accuracy is over the inputs the rows stand for (`ExitData.weights`).

    Two refinements. A step that would move no input (it stays inside a gap between observed error scores) is
    stretched to just above the next error score that can move one, so rounds are never spent on no-ops and a
    threshold never rises past what the data supports. And before stopping, every ramp is raised as far as it
    can go alone (finer than the step floor) while any can: raises elsewhere may have taken the inputs that
    made it fail, and the floor may have stopped it short of its boundary.

    Each candidate raise only moves inputs that pass its ramp today, so a round is scored from per-input
    differences over (n, r) arrays instead of re-evaluating every candidate vector from scratch. Savings and
    losses are weighted by the inputs each row stands for.
    """
    n, r = data.size, data.ramps
    thresholds = np.zeros(r)
    step = np.full(r, initial_step)
    ceiling = np.full(r, np.inf)  # lowest threshold found to break the constraint, per ramp
    open_ramps = np.ones(r, dtype=bool)
    exit_column = np.full(n, r)  # column r: answered by the final layer
    right_now = np.ones(n, dtype=np.int8)
    saved_now = data.saved_ms[:, r].copy()
    weights = data.weights
    total = float(weights.sum()) or 1.0
    stratum_weights = data.stratum_weights()
    strata = np.eye(STRATA, dtype=np.int64)[data.strata]  # (n, STRATA) one-hot
    wrong = np.zeros(STRATA, dtype=np.int64)  # disagreements per stratum of the thresholds so far
    saved_at_ramps = data.saved_ms[:, :r]
    right_at_ramps = data.correct.astype(np.int8)
    evaluations = 1
    columns = np.arange(r)
    while True:
        # Raising ramp j can only move inputs that pass it today without exiting, and their error scores at
        # j are at or above its threshold already.
        passing_errors = np.where((exit_column[:, None] > columns[None, :])
                                  & exit_rule.exits(data.errors, MAX_THRESHOLD), data.errors, np.inf)
        movable = passing_errors.min(axis=0)
        open_ramps &= movable < np.inf
        if not open_ramps.any():
            break
        # Below a known failure, bisect instead of stepping: doubling after every success and halving after
        # every failure would otherwise creep towards the boundary one constant step at a time.
        stepped = thresholds + np.minimum(step, (ceiling - thresholds) / 2)
        stretched = ~exit_rule.exits(movable, stepped)  # the step moves no input, not even the lowest passing
        raised = np.minimum(np.where(stretched, movable + _ABOVE, stepped), MAX_THRESHOLD)
        open_ramps &= raised < ceiling
        if not open_ramps.any():
            continue
        moving = exit_rule.exits(passing_errors, np.where(open_ramps, raised, 0.0))
        right_change = moving * (right_at_ramps - right_now[:, None])  # (n, r): +1 fixed, -1 broken
        gain = (moving * (saved_at_ramps - saved_now[:, None]) * weights[:, None]).sum(axis=0) / total
        loss = -(right_change * weights[:, None]).sum(axis=0) / total
        wrong_after = wrong[None, :] - right_change.T @ strata  # (r, STRATA)
        evaluations += int(open_ramps.sum())
        feasible = open_ramps & _fits(target_accuracy, wrong_after, stratum_weights, total)
        # A stretched raise is already the smallest that moves anything: if it breaks the constraint, so would
        # any smaller step.
        failing = open_ramps & ~feasible
        give_up = failing & (stretched | (raised - thresholds <= min_step))
        open_ramps &= ~give_up
        halve = failing & ~give_up
        ceiling[halve] = raised[halve]
        step[halve] = np.maximum(step[halve] / 2, min_step)
        if not feasible.any():
            continue
        ratio = np.where(loss > 0, gain / np.where(loss > 0, loss, 1.0), np.inf)
        # Best ratio first, then the larger gain (among raises that cost no accuracy, ratios tie at infinity).
        order = np.lexsort((-gain, -ratio))
        chosen = int(order[feasible[order]][0])
        moved = moving[:, chosen]
        thresholds[chosen] = raised[chosen]
        step[chosen] = max(2 * step[chosen], min_step)
        exit_column[moved] = chosen
        right_now[moved] = right_at_ramps[moved, chosen]
        saved_now[moved] = saved_at_ramps[moved, chosen]
        wrong = wrong_after[chosen]
    # Finishing: the step floor may have stopped a ramp short of its boundary, and raises elsewhere may have
    # taken the inputs that made it fail. Raise each ramp as far as it can go alone (a line search over its
    # sorted error scores) and keep the best ratio, until no ramp can move.
    while True:
        best: tuple[float, float, int, float] | None = None
        for j in range(r):
            passing = (exit_column > j) & exit_rule.exits(data.errors[:, j], MAX_THRESHOLD)
            order = np.argsort(data.errors[passing, j], kind="stable")
            errors = data.errors[passing, j][order]
            if not len(errors):
                continue
            change = (right_at_ramps[passing, j] - right_now[passing])[order]
            wrong_after = wrong[None, :] - np.cumsum(change[:, None] * strata[passing][order], axis=0)
            # A threshold just above errors[k] moves every input whose error is at most errors[k].
            ends_tie = np.append(errors[1:] != errors[:-1], True)
            feasible = np.flatnonzero(_fits(target_accuracy, wrong_after, stratum_weights, total) & ends_tie)
            evaluations += 1
            if not len(feasible):
                continue
            k = feasible[-1]
            w = weights[passing][order][:k + 1]
            gain = float(((saved_at_ramps[passing, j] - saved_now[passing])[order][:k + 1] * w).sum()) / total
            loss = -float((change[:k + 1] * w).sum()) / total
            candidate = (gain / loss if loss > 0 else np.inf, gain, int(j),
                         min(float(errors[k]) + _ABOVE, MAX_THRESHOLD))
            if best is None or candidate[:2] > best[:2]:
                best = candidate
        if best is None:
            break
        _, _, chosen, threshold = best
        moved = (exit_column > chosen) & exit_rule.exits(data.errors[:, chosen], threshold)
        thresholds[chosen] = threshold
        exit_column[moved] = chosen
        wrong = wrong - ((right_at_ramps[moved, chosen] - right_now[moved]) @ strata[moved])
        right_now[moved] = right_at_ramps[moved, chosen]
        saved_now[moved] = saved_at_ramps[moved, chosen]
    accuracy = float((right_now * weights).sum() / total) if n else 1.0
    return TuningResult(thresholds, accuracy, float((saved_now * weights).sum() / total) if n else 0.0,
                        evaluations)


def tune_grid(data: ExitData, target_accuracy: float, grid_step: float = 0.05) -> TuningResult:
    """The reference: the best threshold vector on a grid, found exactly by depth-first search over ramps in
    model order. An input's exit is settled by the earlier ramps' thresholds, so the wrong answers of a prefix
    only grow as it extends (prune once over the allowance), and the inputs still undecided can at best exit
    at the next ramp (prune branches that cannot beat the best found)."""
    n, r = data.size, data.ramps
    grid = np.round(np.arange(0.0, 1.0 + grid_step / 2, grid_step), 10)
    allowed_wrong = int(np.floor(n * (1.0 - target_accuracy) + 1e-9))
    best = {"saved": -np.inf, "thresholds": np.zeros(r), "wrong": 0}
    evaluations = 0
    chosen = np.zeros(r)

    def search(ramp: int, undecided: np.ndarray, wrong: int, saved: float) -> None:
        nonlocal evaluations
        if ramp == r:
            total = saved + data.saved_ms[undecided, r].sum()
            evaluations += 1
            if total > best["saved"]:
                best.update(saved=total, thresholds=chosen.copy(), wrong=wrong)
            return
        if saved + data.saved_ms[undecided, ramp].sum() <= best["saved"]:
            return
        for value in grid:
            leaving = undecided & exit_rule.exits(data.errors[:, ramp], value)
            leaving_wrong = wrong + int((leaving & ~data.correct[:, ramp]).sum())
            if leaving_wrong > allowed_wrong:
                break
            chosen[ramp] = value
            search(ramp + 1, undecided & ~leaving, leaving_wrong, saved + data.saved_ms[leaving, ramp].sum())
        chosen[ramp] = 0.0

    search(0, np.ones(n, dtype=bool), 0, 0.0)
    return TuningResult(best["thresholds"], 1.0 - best["wrong"] / n if n else 1.0,
                        float(best["saved"] / n) if n else 0.0, evaluations)


# Learn-then-Test's split: one input in this many chooses the direction, the others test it. The bound, not the
# direction, is what holds exits back while a server is young: 1,774 shadow inputs (a minilm-rt server's first
# 8,500 requests) split in halves leave 887 to test, on which the bound allows 0.34% disagreement against the 1%
# constraint; a two-thirds test share (1,183) allows 0.5%. On the replays `bench live` serves (rt-drift, load 0.2,
# 8 seeds, the simulator on their requests) the median p50 went from 0.71x vanilla to 0.64-0.68x at one in three
# (0.68-0.69x at one in four, whose direction is noisier)
CHOOSER_EVERY = 3
# Points of the certified path: the direction's thresholds scaled by these (past 1: the test rows may allow more)
PATH_SCALES = np.round(np.arange(1, 81) / 40, 6)


def certified_thresholds(data: ExitData, constraint: float, delta: float, initial_step: float = 0.1,
                         min_step: float = 0.01) -> np.ndarray:
    """Thresholds whose released answers' disagreement is within `constraint` with probability at least
    1 - delta, by Learn-then-Test: tuning on a third of the inputs (`CHOOSER_EVERY`) chooses a direction, and the
    others test the path of scaled directions in order, from no exit up, each against the upper confidence bound
    (`RiskBound`); the last that passes before the first that fails is chosen (fixed-sequence testing: the path
    is fixed before the test rows are seen, so no share of delta is spent on its length). All zeros where even the
    first point fails: a ramp whose bound cannot be met yet stays at threshold 0."""
    choosing = data.sequence % CHOOSER_EVERY == 0
    chooser, tester = data.rows(choosing), data.rows(~choosing)
    direction = tune_greedy(chooser, 1.0 - constraint, initial_step, min_step).thresholds
    if not (direction > 0).any() or not tester.size:
        return np.zeros(data.ramps)
    path = np.minimum(PATH_SCALES[:, None] * direction[None, :], MAX_THRESHOLD)
    passed = RiskBound.of(tester.strata, tester.weights, constraint, delta).fits(tester.wrong_by_stratum(path))
    last = int(np.argmin(passed)) - 1 if not passed.all() else len(passed) - 1
    return path[last] if last >= 0 else np.zeros(data.ramps)
