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
from rampserve.control.guarantee import RiskBound, look_delta, smallest_certifying
from rampserve.control.monitor import AccuracyWindow, RampHistory
from rampserve.control.ramps import adjust_ramps, initial_sites, ramp_utilities
from rampserve.control.records import BatchRecord, Configuration
from rampserve.control.risk import rolled_scale, served_scale
from rampserve.control.thresholds import ExitData, certified_thresholds
from rampserve.runtime.profile import LatencyProfile


EXIT_MODES = ("release", "stop")
OBJECTIVES = ("p50", "p95", "mean", "throughput")
GUARANTEES = ("certified", "long-run")


@dataclass(frozen=True)
class ControllerSettings:
    accuracy_constraint: float = 0.01  # allowed share of answers that differ from the original model's
    window: int = 16  # released answers whose accuracy `/status` reports as the window's
    # Recent observed inputs of the active set that tuning evaluates. The bound needs many: at a 1% constraint
    # and 95% confidence, 300 inputs without one disagreement are the fewest that let anything exit.
    history: int = 4096
    adjust_every: int = 128  # inputs between ramp adjustment rounds (Apparate: 128)
    # Outputs of its own a ramp needs before tuning may raise its threshold (at least as many as the bound needs
    # to let anything exit): a handful of lucky answers from a ramp just activated would otherwise license a
    # threshold that the next inputs break.
    min_ramp_outputs: int = 64
    # Thresholds keep an upper confidence bound on released answers' disagreement with the original model within
    # the constraint at this confidence (see `guarantee`)
    confidence: float = 0.95
    # Rolling risk control (see `risk`): how far one disagreement moves the scale on the certified thresholds
    # (a share of them); the constraint's worth of agreement moves it back as far
    risk_step: float = 0.05
    # Share of the constraint rolling risk control holds the long-run disagreement to. The constraint is judged
    # on windows of answers too (1,000 in the benches); a long-run mean at the constraint itself would leave
    # about half of them above it (measured: 7.4% of 1,000-answer windows below 0.99 at 1, 1.9% at 0.5)
    risk_target_share: float = 0.5
    exit_mode: str = "release"  # "release": every input runs to the end; "stop": exited inputs leave the batch
    feedback_share: float = 0.1  # stop mode: share of the inputs kept running to the end to measure agreement
    ramp_budget: float = 0.02  # what active ramps may add to a non-exiting input, share of the model's latency
    budget_batch_size: int | None = None  # batch size the budget is judged at; None: the median one served
    initial_step: float = 0.1
    min_step: float = 0.01
    threshold_tuning: bool = True
    ramp_adjustment: bool = True
    initial: tuple[str, ...] | None = None  # active ramps to start from; None: spread the budget evenly
    # Threshold a ramp starts at when it becomes active (absent: 0, no exits until tuning raises it).
    start_thresholds: dict[str, float] = field(default_factory=dict)
    objective: str = "p50"  # what ramp-set search optimises: one of OBJECTIVES
    guarantee: str = "certified"  # how thresholds hold the constraint: one of GUARANTEES
    search_every: int = 2048  # inputs between ramp-set searches
    shadow_share: float = 0.05  # share of batches that evaluate inactive ramps (shadow batches)

    def __post_init__(self) -> None:
        if self.objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {OBJECTIVES}, got {self.objective!r}")
        if self.guarantee not in GUARANTEES:
            raise ValueError(f"guarantee must be one of {GUARANTEES}, got {self.guarantee!r}")
        if not 0.0 <= self.accuracy_constraint < 1.0:
            raise ValueError(f"accuracy constraint must lie in [0, 1), got {self.accuracy_constraint}")
        if self.history < self.adjust_every:
            raise ValueError(f"history ({self.history}) must cover a ramp adjustment round ({self.adjust_every})")
        if self.ramp_budget < 0:
            raise ValueError(f"ramp budget must be >= 0, got {self.ramp_budget}")
        if not 0.0 < self.confidence < 1.0:
            raise ValueError(f"confidence must lie in (0, 1), got {self.confidence}")
        if self.exit_mode not in EXIT_MODES:
            raise ValueError(f"exit mode must be one of {EXIT_MODES}, got {self.exit_mode!r}")
        if not 0.0 < self.feedback_share <= 1.0:
            raise ValueError(f"feedback share must lie in (0, 1], got {self.feedback_share}")
        if self.risk_step <= 0:
            raise ValueError(f"risk step must be positive, got {self.risk_step}")
        if not 0.0 < self.risk_target_share <= 1.0:
            raise ValueError(f"risk target share must lie in (0, 1], got {self.risk_target_share}")

    @property
    def target_accuracy(self) -> float:
        return 1.0 - self.accuracy_constraint

    @property
    def stops(self) -> bool:
        return self.exit_mode == "stop"

    @property
    def kept_share(self) -> float:
        """Share of exited inputs that run to the end: all of them in release mode."""
        return self.feedback_share if self.stops else 1.0


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
        self.costs = CostModel(profile, settings.stops)
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
        self.bound = 0.0  # see disagreement_bound
        self._looks = 0  # certifications published
        self._certifying = False  # the decision under way publishes newly certified thresholds
        self.scale = 1.0  # rolling risk control's scale on the thresholds tuning chose (see `risk`)
        self._ceiling = np.array(first.thresholds)  # the thresholds tuning chose, served times the scale

    def configuration(self) -> Configuration:
        return self.decisions[-1].configuration

    def status(self, latest_decisions: int | None = None) -> dict:
        """What a server reports of its controller: accuracy over the window and over every answer counted, the
        answers counted, those that could not be verified, and the decisions (the latest `latest_decisions` of
        them; None: all, which grow with every change over the controller's life)."""
        window = self.window
        settings = self.settings
        return {"window_accuracy": window.accuracy, "cumulative_accuracy": window.cumulative,
                "inputs_observed": window.served, "unverified_answers": self.unverified,
                "exit_mode": settings.exit_mode, "feedback_share": settings.kept_share,
                "bound": {"disagreement_upper": self.bound, "confidence": settings.confidence,
                          "constraint": settings.accuracy_constraint, "history": self.history.size,
                          "certifications": self._looks},
                "risk_scale": served_scale(self.scale),
                "decisions_made": len(self.decisions),
                "decisions": [d.to_json() for d in self.decisions[-latest_decisions if latest_decisions else 0:]]}

    def readings(self) -> dict[str, float]:
        """What a server exports as gauges: the window's accuracy, the bound next to it, and risk control's scale."""
        return {"window_accuracy": self.window.accuracy, "disagreement_upper": self.bound,
                "risk_scale": served_scale(self.scale)}

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
        disagreement = record.wrong_estimate()
        self.window.add(disagreement)
        if record.unverified:
            # Answers nobody can check count against the constraint; until the next configuration, thresholds
            # may only tighten: a failure must never be what loosens them
            self.unverified += record.inputs
            self._tighten_only = True
        settings = self.settings
        served = served_scale(self.scale)
        self.scale = rolled_scale(self.scale, disagreement, settings.accuracy_constraint * settings.risk_target_share,
                                  settings.risk_step)
        rescaled = settings.threshold_tuning and served_scale(self.scale) != served
        change = None
        if not (record.cached or record.unverified) and record.sites == current.sites:
            # (a record of an active set already replaced fits no column of the history)
            change = self._learn(record)
        if change is None and rescaled:
            change = self._decide(self.times.tune_ms, self._rescale, "risk control")
        return change

    def _learn(self, record: BatchRecord) -> Configuration | None:
        """Add a batch to the history, and adjust ramps or retune when a round is due."""
        self.history.add(record)
        self._since_adjust += record.inputs
        settings = self.settings
        if self._since_adjust >= settings.adjust_every:
            self._since_adjust = 0
            self._measure_bound()
            if settings.ramp_adjustment:
                return self._decide(self.times.adjust_ms, self._adjust, "ramp adjustment")
            if settings.threshold_tuning and not self._gathering():
                return self._decide(self.times.tune_ms, self._retune, "periodic retune")
        return None

    def _decide(self, timings: list[float], decide, reason: str) -> Configuration | None:
        start = time.perf_counter()
        self._certifying = False
        change = decide()
        elapsed = (time.perf_counter() - start) * 1000.0
        timings.append(elapsed)
        self.last_decision_ms = elapsed
        if change is None:
            return None
        sites, ceiling, detail = change
        current = self.configuration()
        thresholds = served_scale(self.scale) * np.asarray(ceiling, dtype=float)
        if self._tighten_only and sites == current.sites:
            thresholds = np.minimum(thresholds, current.thresholds)
        self._ceiling = np.asarray(ceiling, dtype=float)
        if sites == current.sites and tuple(thresholds) == current.thresholds:
            return None
        self._tighten_only = False
        if self._certifying:
            self._looks += 1
        configuration = Configuration(current.version + 1, sites, tuple(float(t) for t in thresholds))
        self.decisions.append(Decision(configuration, self.window.served, f"{reason}: {detail}", elapsed))
        self.window.clear()
        if sites != current.sites:
            self.history = self.history.for_sites(sites)
            self._since_adjust = 0
        self._measure_bound()
        return configuration

    def _exit_data(self) -> ExitData:
        correct, errors, batch = self.history.latest()
        strata, weights = self.history.sample_design()
        return ExitData(correct, errors, self.costs.saved_ms(self.history.sites, batch), strata, weights)

    def look_delta(self) -> float:
        """Error probability of the thresholds certified now: the k-th certification published gets
        delta / (k (k + 1)). Configurations that only scale certified thresholds (rolling risk control) are not
        new looks."""
        return look_delta(1.0 - self.settings.confidence, self._looks + 1)

    def _bound(self, data: ExitData) -> RiskBound:
        return RiskBound.of(data.strata, data.weights, self.settings.accuracy_constraint, self.look_delta())

    def _tuning_data(self) -> tuple[ExitData, np.ndarray | None]:
        """The inputs tuning judges, and the ramps it must leave at 0. Every ramp is judged on the inputs that saw
        all of them, once there are enough for the bound to let anything exit: past inputs that never reached a
        new ramp would dilute its mistakes (3 wrong exits in 64 look like 3 in 512). Until then the new ramps
        stay at 0."""
        data = self._exit_data()
        needed = self._outputs_needed()
        complete = np.isfinite(data.errors).all(axis=1)
        if complete.sum() >= needed:
            return data.rows(complete), None
        return data, np.isinf(data.errors).sum(axis=0) > data.size - needed

    def tuned_thresholds(self) -> np.ndarray:
        """Thresholds certified on the history within the constraint at the configuration's confidence."""
        if not self.history.sites or not self.history.size:
            return np.zeros(len(self.history.sites))
        settings = self.settings
        data, frozen = self._tuning_data()
        self._certifying = True
        return certified_thresholds(data, settings.accuracy_constraint, self.look_delta(), settings.initial_step,
                                    settings.min_step, frozen)

    def _gathering(self) -> bool:
        """Whether some active ramp has fewer outputs of its own than certifying it needs."""
        if not self.history.sites or not self.history.size:
            return bool(self.history.sites)
        _, errors, _ = self.history.latest()
        return bool((np.isfinite(errors).sum(axis=0) < self._outputs_needed()).any())

    def _outputs_needed(self) -> int:
        """Outputs of its own a ramp needs before tuning may raise it: enough for the bound to let anything exit,
        where half the inputs test the thresholds that the other half chose."""
        return max(self.settings.min_ramp_outputs,
                   2 * smallest_certifying(self.settings.accuracy_constraint, self.look_delta()))

    def _measure_bound(self) -> None:
        self.bound = self.disagreement_bound()

    def disagreement_bound(self) -> float:
        """The upper confidence bound on the current configuration's disagreement, over the history (1 before
        there is one; 0 where no ramp can exit). `bound` holds it as of the last decision or adjustment round."""
        current = self.configuration()
        thresholds = np.array(current.thresholds)
        if not current.sites or not (thresholds > 0).any():
            return 0.0
        if current.sites != self.history.sites or not self.history.size:
            return 1.0
        data, _ = self._tuning_data()
        return float(self._bound(data).upper(data.wrong_by_stratum(thresholds)))

    def _retune(self) -> tuple[tuple[str, ...], np.ndarray, str]:
        return self.history.sites, self.tuned_thresholds(), "thresholds retuned"

    def _rescale(self) -> tuple[tuple[str, ...], np.ndarray, str]:
        return self.history.sites, self._ceiling, f"thresholds served at {served_scale(self.scale):.2f} of tuned"

    def budget_batch(self) -> int:
        if self.settings.budget_batch_size is not None or not self.history.size:
            return self.settings.budget_batch_size or 1
        return int(np.median(self.history.latest()[2]))

    def _adjust(self) -> tuple[tuple[str, ...], Sequence[float], str] | None:
        current = self.configuration()
        if self._gathering():
            # A ramp still gathering the outputs its bound needs has exited nothing yet (unless it was given a
            # start threshold, which stands until the bound can judge it or risk control scales it): its utility says
            # nothing, and replacing it would restart the wait
            return None
        _, errors, batch = self.history.latest(self.settings.adjust_every)
        _, weights = self.history.sample_design(self.settings.adjust_every)
        # Ramps are judged at the thresholds tuning chose, not at the share risk control serves for now
        tuned = self._ceiling
        if current.sites and tuned.min() > 0:  # every ramp tuned: a fair measurement
            utility, _ = ramp_utilities(self.costs, current.sites, tuned, errors, batch, weights)
            self._measured[current.sites] = (float(utility.sum()) / weights.sum(), tuple(float(t) for t in tuned))
        adjustment = adjust_ramps(
            self.costs, current.sites, tuned, errors, batch, self.settings.ramp_budget,
            self.budget_batch(), self.tuned_thresholds if self.settings.threshold_tuning else None,
            self.settings.start_thresholds, self._measured, weights)
        if adjustment is not None:
            return adjustment.sites, adjustment.thresholds, adjustment.reason
        # Without this, thresholds that could safely rise after the workload gets easier would stay where the
        # last certification left them.
        return self._retune() if self.settings.threshold_tuning else None
