"""The controller: feed it batch records, read its current configuration.

Deterministic given its records (the decision times it measures are reported, never used to decide), and
free of threads and I/O: the live server and the trace simulator both drive it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from rampserve.control.costs import CostModel
from rampserve.control.monitor import AccuracyWindow, RampHistory
from rampserve.control.ramps import adjust_ramps, initial_sites, ramp_utilities
from rampserve.control.records import BatchRecord, Configuration
from rampserve.control.thresholds import ExitData, tune_greedy
from rampserve.runtime.profile import LatencyProfile


@dataclass(frozen=True)
class ControllerSettings:
    accuracy_constraint: float = 0.01  # allowed share of answers that differ from the original model's
    window: int = 16  # released answers whose accuracy triggers threshold tuning (Apparate: 16)
    history: int = 512  # recent inputs of the active set that tuning evaluates
    adjust_every: int = 128  # inputs between ramp adjustment rounds (Apparate: 128)
    # Outputs of its own a ramp needs before tuning may raise its threshold: a handful of lucky answers from a
    # ramp just activated would otherwise license a threshold that the next inputs break.
    min_ramp_outputs: int = 64
    # Share of the allowed loss that tuning may spend on its history: thresholds fitted to exactly the
    # constraint on past inputs lose more than that on the next ones (they are chosen to fit the past).
    tuning_share: float = 0.5
    ramp_budget: float = 0.02  # what active ramps may add to a non-exiting input, share of the model's latency
    budget_batch_size: int | None = None  # batch size the budget is judged at; None: the median one served
    initial_step: float = 0.1
    min_step: float = 0.01
    threshold_tuning: bool = True
    ramp_adjustment: bool = True
    initial: tuple[str, ...] | None = None  # active ramps to start from; None: spread the budget evenly
    # Threshold a ramp starts at when it becomes active (absent: 0, no exits until tuning raises it).
    start_thresholds: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 0.0 <= self.accuracy_constraint < 1.0:
            raise ValueError(f"accuracy constraint must lie in [0, 1), got {self.accuracy_constraint}")
        if self.history < self.adjust_every:
            raise ValueError(f"history ({self.history}) must cover a ramp adjustment round ({self.adjust_every})")
        if self.ramp_budget < 0:
            raise ValueError(f"ramp budget must be >= 0, got {self.ramp_budget}")

    @property
    def target_accuracy(self) -> float:
        return 1.0 - self.accuracy_constraint

    @property
    def tuning_target(self) -> float:
        return 1.0 - self.accuracy_constraint * self.tuning_share


@dataclass(frozen=True)
class Decision:
    """A configuration change, when it happened (inputs observed so far) and why."""

    configuration: Configuration
    observed: int
    reason: str
    decision_ms: float

    def to_json(self) -> dict:
        return {**self.configuration.to_json(), "observed": self.observed, "reason": self.reason,
                "decision_ms": self.decision_ms}


@dataclass
class DecisionTimes:
    tune_ms: list[float] = field(default_factory=list)
    adjust_ms: list[float] = field(default_factory=list)


class Controller:
    def __init__(self, profile: LatencyProfile, settings: ControllerSettings = ControllerSettings()) -> None:
        self.settings = settings
        self.costs = CostModel(profile)
        batch = settings.budget_batch_size or 1
        sites = settings.initial if settings.initial is not None else \
            initial_sites(self.costs, settings.ramp_budget, batch)
        unknown = [s for s in sites if s not in self.costs.position]
        if unknown:
            raise ValueError(f"{unknown} are not sites of this model; sites: {list(profile.sites)}")
        first = Configuration(0, tuple(sites), tuple(settings.start_thresholds.get(s, 0.0) for s in sites))
        self.window = AccuracyWindow(settings.window)
        self.history = RampHistory(first.sites, settings.history)
        self.decisions: list[Decision] = [Decision(first, 0, "initial: ramps spread over the budget", 0.0)]
        self.times = DecisionTimes()
        self.last_decision_ms = 0.0  # time the latest observe() spent deciding
        self._since_adjust = 0
        self.unverified = 0  # answers released before their batch failed (counted as disagreements)
        self._tighten_only = False
        self._caught_up = {"recent": [], "served": 0, "correct": 0, "unverified": 0}  # see catch_up
        self._measured: dict[tuple[str, ...], tuple[float, tuple[float, ...]]] = {}  # see ramps.Known

    def configuration(self) -> Configuration:
        return self.decisions[-1].configuration

    def status(self) -> dict:
        """What a server reports of its controller: accuracy over the window and over every answer counted, the
        answers counted, those that could not be verified, and the decisions."""
        window = self.window
        return {"window_accuracy": window.accuracy, "cumulative_accuracy": window.cumulative,
                "inputs_observed": window.served, "unverified_answers": self.unverified,
                "decisions": [d.to_json() for d in self.decisions]}

    def checkpoint(self) -> dict:
        """What a successor needs to report accuracy over every answer given before it took over: the window's
        and the total counts (its configuration travels apart, as its initial one)."""
        return {**self.window.checkpoint(), "unverified": self.unverified}

    def catch_up(self, checkpoint: dict) -> None:
        """Count the answers a lost predecessor had counted, as of `checkpoint`; safe to call with several
        checkpoints of the same predecessor (each replica holds the latest it saw): only what a later one adds
        beyond those already taken counts."""
        if checkpoint["served"] <= self._caught_up["served"]:
            return
        self.window.catch_up(checkpoint, self._caught_up)
        self.unverified += checkpoint["unverified"] - self._caught_up["unverified"]
        self._caught_up = checkpoint

    def observe(self, record: BatchRecord) -> Configuration | None:
        """Learn from one served batch; returns the new configuration when this record changed it."""
        self.last_decision_ms = 0.0
        current = self.configuration()
        self.window.add(record.correct())
        if record.cached:
            return None
        if record.unverified:
            # Answers nobody can check count against the constraint; until the next configuration, thresholds
            # may only tighten: a failure must never be what loosens them
            self.unverified += record.inputs
            self._tighten_only = True
            return None
        if record.sites != current.sites:
            return None  # served by an active set already replaced: its rows fit no column of the history
        self.history.add(record)
        self._since_adjust += record.inputs
        settings = self.settings
        if settings.threshold_tuning and self.window.accuracy < settings.target_accuracy:
            return self._decide(self.times.tune_ms, self._retune_recent, "window accuracy below the constraint")
        if self._since_adjust >= settings.adjust_every:
            self._since_adjust = 0
            if settings.ramp_adjustment:
                return self._decide(self.times.adjust_ms, self._adjust, "ramp adjustment")
            if settings.threshold_tuning:
                return self._decide(self.times.tune_ms, self._retune, "periodic retune")
        return None

    def _decide(self, timings: list[float], decide, reason: str) -> Configuration | None:
        start = time.perf_counter()
        change = decide()
        elapsed = (time.perf_counter() - start) * 1000.0
        timings.append(elapsed)
        self.last_decision_ms = elapsed
        if change is None:
            return None
        sites, thresholds, detail = change
        current = self.configuration()
        if self._tighten_only and sites == current.sites:
            thresholds = np.minimum(thresholds, current.thresholds)
        if sites == current.sites and tuple(thresholds) == current.thresholds:
            return None
        self._tighten_only = False
        configuration = Configuration(current.version + 1, sites, tuple(float(t) for t in thresholds))
        self.decisions.append(Decision(configuration, self.window.served, f"{reason}: {detail}", elapsed))
        self.window.clear()
        if sites != current.sites:
            self.history = self.history.for_sites(sites)
            self._since_adjust = 0
        return configuration

    def _exit_data(self, count: int | None = None) -> ExitData:
        correct, errors, batch = self.history.latest(count)
        return ExitData(correct, errors, self.costs.saved_ms(self.history.sites, batch))

    def tuned_thresholds(self, recent: int | None = None) -> np.ndarray:
        """Thresholds tuned on the newest `recent` inputs (every input kept by default)."""
        if not self.history.sites or not self.history.size:
            return np.zeros(len(self.history.sites))
        data = self._exit_data(recent)
        complete = np.isfinite(data.errors).all(axis=1)
        if complete.sum() >= self.settings.min_ramp_outputs:
            # Judge every ramp on the inputs that saw all of them. Past inputs that never reached a new ramp
            # would dilute its mistakes: 3 wrong exits in 64 look like 3 in 512, until every input reaches it.
            data, frozen = data.rows(complete), None
        else:
            frozen = np.isinf(data.errors).sum(axis=0) > data.size - self.settings.min_ramp_outputs
        return tune_greedy(data, self.settings.tuning_target, self.settings.initial_step, self.settings.min_step,
                           frozen).thresholds

    def _retune(self) -> tuple[tuple[str, ...], np.ndarray, str]:
        return self.history.sites, self.tuned_thresholds(), "thresholds retuned"

    def _retune_recent(self) -> tuple[tuple[str, ...], np.ndarray, str]:
        """After an accuracy drop, thresholds that hold on the recent inputs as well as on the whole history: the
        drop may be the workload changing, which the recent inputs show and the whole history still outweighs
        (an abrupt change of look let five wrong answers out before tuning on the history alone reacted)."""
        thresholds = np.minimum(self.tuned_thresholds(), self.tuned_thresholds(self.settings.adjust_every))
        return self.history.sites, thresholds, "thresholds retuned"

    def budget_batch(self) -> int:
        if self.settings.budget_batch_size is not None or not self.history.size:
            return self.settings.budget_batch_size or 1
        return int(np.median(self.history.latest()[2]))

    def _adjust(self) -> tuple[tuple[str, ...], Sequence[float], str] | None:
        current = self.configuration()
        _, errors, batch = self.history.latest(self.settings.adjust_every)
        if current.sites and min(current.thresholds) > 0:  # every ramp tuned: a fair measurement
            utility, _ = ramp_utilities(self.costs, current.sites, np.array(current.thresholds), errors, batch)
            self._measured[current.sites] = (float(utility.sum()) / len(batch), current.thresholds)
        adjustment = adjust_ramps(
            self.costs, current.sites, np.array(current.thresholds), errors, batch, self.settings.ramp_budget,
            self.budget_batch(), self.tuned_thresholds if self.settings.threshold_tuning else None,
            self.settings.start_thresholds, self._measured)
        if adjustment is not None:
            return adjustment.sites, adjustment.thresholds, adjustment.reason
        # Tuning is triggered by accuracy drops only; without this, thresholds that could safely rise after
        # the workload gets easier would stay where the last drop left them.
        return self._retune() if self.settings.threshold_tuning else None
