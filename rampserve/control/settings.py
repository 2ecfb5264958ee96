"""What a controller is asked to do (`ControllerSettings`), apart from the controller itself: the command line and
the settings parser read its fields and defaults without importing what the controller computes with."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from rampserve.control.exit_rule import EXIT_MODES
from rampserve.control.objective import OBJECTIVES
from rampserve.options import check_options, option

# What the accuracy constraint promises (docs/control.md shows what each costs):
# average (Apparate's): the disagreement over every answer served stays within the constraint; thresholds tuned on
#   recent inputs at the full constraint, rolling risk control alone bounds it (deterministically, whatever the
#   stream);
# windowed: at most `windows_below` of windows of `promise_window` answers break the constraint; thresholds tuned and
#   risk controlled at the rate that keeps that share for answers that disagree independently (`windowed_rate`);
# certified: thresholds certified at the stated confidence on recent inputs, rolling risk control below them.
GUARANTEES = ("average", "windowed", "certified")
FORMER_GUARANTEES = {"long-run": "average"}  # names a promise went by before, still accepted
# What `exit_mode` may be set to: one of the exit modes, or "auto", which the server resolves once it knows the
# model's batch limit (`ControllerSettings.resolved`)
EXIT_MODE_CHOICES = ("auto", *EXIT_MODES)
# "auto" serves stop mode where the SLO allows batches of at most this many inputs. There release mode's final
# layers of an exited input are the next request's wait (minilm-rt, max batch 2, `bench live` at load 0.2: p50
# 0.92x vanilla in stop mode against 1.01x in release, saturation 1.04-1.08x against 0.84x, accuracy 0.998 in
# both), while in larger batches an ONNX Runtime run stops only once every row has left, so stop mode would give
# up checking each exit against the final answer for little (DESIGN, exit modes)
STOP_MODE_BATCH_LIMIT = 2


@dataclass(frozen=True)
class ControllerSettings:
    accuracy_constraint: float = option(0.01, "allowed share of answers that differ from the original model's",
                                        ge=0, lt=1)
    window: int = 16  # released answers whose accuracy `/status` reports as the window's
    # Recent observed inputs that tuning reads, and as many shadow inputs that the ramp-set search reads. Learn-then-
    # Test certifies on two thirds of them: at 4,096 the bound left lite0-fmnist's certified promise 0.59 of the
    # constraint and its windowed promise 0.54 of the oracle; at 8,192, 0.62 and 0.61 (5 seeds, simulated; the
    # average promise 0.91 -> 0.81 of the oracle, every seed's accuracy >= 0.99 where one was 0.9897; docs/control.md)
    history: int = option(8192, "recent inputs threshold tuning judges", ge=1)
    # Inputs between ramp-set searches; each also recertifies the thresholds. Before that many have been observed,
    # a search comes each time the inputs observed have doubled since the last (DESIGN §9, search rounds)
    search_every: int = option(2048, "inputs between ramp-set searches", ge=1)
    warmup: int = 1024  # shadow inputs gathered before the first search (or, without search, the first tuning)
    shadow_share: float = option(0.1, "share of batches after warm-up that also run inactive ramps, to measure them "
                                      "(0: no ramp-set search)", ge=0, le=1)
    search_rows: int = 2048  # shadow inputs the search judges sets on, evenly spaced over ...
    search_span: int = 16384  # ... the newest this many (the shadow ring holds the larger of it and `history`)
    beam: int = 3  # sets of each size the search keeps growing
    # A set replaces the deployed one only when its estimated objective is lower by this share (or equal, with the
    # mean lower by this share): estimates from a few thousand inputs differ by noise alone, and a new set starts
    # with fewer inputs to certify its thresholds on (resnet18-fmnist, 108k inputs: 31 set changes at 0.03, 13 at
    # 0.1, the same p50)
    hysteresis: float = 0.1
    # Searches a set must win (by the hysteresis) before it replaces the deployed one, counted since the set last
    # changed: the best of some forty sets judged on one sample of shadow inputs often wins by noise and falls back
    # the next round (lite0-fmnist, average promise, 5 seeds: 29-36 set changes a stream at one win, 3-6 at two, the
    # oracle share 0.80-0.96 then 0.80-0.99; in a row, two wins held seed 1 on a worse set: 0.62)
    challenger_wins: int = 2
    # see `objective.OBJECTIVES`
    objective: str = option("p50", "what the ramp-set search minimises or raises: p50, p95, mean or throughput",
                            choices=OBJECTIVES)
    guarantee: str = option("certified", "what the accuracy constraint promises: average (over every answer served, "
                                         "Apparate's; long-run, its former name), windowed (at most --windows-below of "
                                         "windows of --promise-window answers break it) or certified (thresholds "
                                         "certified at --confidence on recent inputs, and held below)",
                            choices=GUARANTEES)
    promise_window: int = option(1000, "the windowed promise: answers per window", ge=1)
    windows_below: float = option(0.05, "the windowed promise: share of windows that may break the constraint",
                                  gt=0, lt=1)
    # Thresholds keep an upper confidence bound on released answers' disagreement with the original model within
    # the constraint at this confidence (see `guarantee`); the monitor's alarm uses it too
    confidence: float = option(0.95, "confidence of the bound on disagreement", gt=0, lt=1)
    # Rolling risk control (see `risk`): how far one disagreement moves the scale on the tuned thresholds (a share
    # of them); the constraint's worth of agreement moves it back as far
    risk_step: float = 0.05
    # Share of the constraint rolling risk control holds the long-run disagreement to (None: 0.65 with the certified
    # guarantee, 1 with average, the windowed promise's rate with windowed). The constraint is judged on windows of
    # answers too (1,000 in the benches); a long-run mean at the constraint itself leaves about a third of them
    # above it (static thresholds tuned at 0.99 on resnet18-fmnist: 36% of 1k windows below 0.99), one at 0.65 of it
    # about one in twenty
    risk_target_share: float | None = option(None, "share of the constraint rolling risk control holds long-run "
                                                   "disagreement to (default 0.65 with the certified promise, 1 with "
                                                   "average, the windowed promise's rate with windowed)", gt=0, le=1)
    # "release": every input runs to the end; "stop": exited inputs leave the batch; "auto": stop where batches are
    # small (`resolved`). Unresolved, "auto" is served as release mode
    exit_mode: str = option("auto", "release: every input runs to the end of the model; stop: an input released at a "
                                    "ramp leaves its batch there (compiled sets; on ONNX Runtime a batch stops once "
                                    "all its inputs have left; others serve it as release); auto: stop where the SLO "
                                    "allows batches of at most 2 inputs and sets compile, release otherwise",
                            choices=EXIT_MODE_CHOICES)
    feedback_share: float = option(0.1, "stop mode: share of the inputs, drawn at random, that run to the end whatever "
                                        "they exit at, to measure agreement", gt=0, le=1)
    ramp_budget: float = option(0.02, "what ramps may add to a non-exiting input, as a share of the model's latency",
                                ge=0)
    budget_batch_size: int | None = None  # batch size the budget is judged at; None: the median one served
    initial_step: float = 0.1
    min_step: float = 0.01
    threshold_tuning: bool = True
    ramp_adjustment: bool = True
    initial: tuple[str, ...] | None = None  # active ramps to start from; None: none until the first search
    # Take the first ramp set and thresholds from the inputs the bundle was validated on (its ramps' and the
    # model's answers there, `Controller(prior=...)`), so that exits begin with the first requests instead of after
    # the warm-up's shadow inputs; live inputs replace them in the history as they come. Not where
    # `start_thresholds` are given: they say how to start
    prime: bool = option(True, "take the first ramps and thresholds from the inputs the bundle was validated on, so "
                               "that exits begin with the first requests (--no-prime: after the warm-up's shadow "
                               "inputs)")
    # Threshold a ramp is served at while tuning is off, or until the first tuning (absent: 0, no exits)
    start_thresholds: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.guarantee in FORMER_GUARANTEES:
            object.__setattr__(self, "guarantee", FORMER_GUARANTEES[self.guarantee])
        check_options(self)
        if min(self.warmup, self.search_rows, self.search_span, self.beam) < 1:
            raise ValueError("warmup, search_rows, search_span and beam must be positive")
        if not 0.0 <= self.hysteresis < 1.0:
            raise ValueError(f"hysteresis must lie in [0, 1), got {self.hysteresis}")
        if self.challenger_wins < 1:
            raise ValueError(f"a set must win at least one search to be deployed, got {self.challenger_wins}")
        if self.risk_step <= 0:
            raise ValueError(f"risk step must be positive, got {self.risk_step}")

    @property
    def target_accuracy(self) -> float:
        return 1.0 - self.accuracy_constraint

    @property
    def stops(self) -> bool:
        return self.exit_mode == "stop"

    def resolved(self, batch_limit: int, compiled: bool = True) -> ControllerSettings:
        """These settings with "auto" made an exit mode, for a model served in batches of at most `batch_limit`:
        stop mode up to `STOP_MODE_BATCH_LIMIT` where the model runs compiled sets (stop mode needs them), release
        mode otherwise. A mode named explicitly stays."""
        if self.exit_mode != "auto":
            return self
        stop = compiled and batch_limit <= STOP_MODE_BATCH_LIMIT
        return replace(self, exit_mode="stop" if stop else "release")

    @property
    def kept_share(self) -> float:
        """Share of exited inputs that run to the end: all of them in release mode."""
        return self.feedback_share if self.stops else 1.0

    @property
    def certifies(self) -> bool:
        """Whether thresholds are certified (Learn-then-Test at `certified_rate`): under every promise but the
        average one, whose thresholds are tuned at the constraint."""
        return self.guarantee != "average"

    @property
    def certified_rate(self) -> float:
        """The disagreement thresholds are certified at, and the monitor and the change detector test answers
        against: the constraint, or under the windowed promise the highest rate at which answers that disagree
        independently break it in at most `windows_below` of windows (`guarantee.windowed_rate`). Under the average
        promise (nothing certified, `certifies`) the monitor tests against the constraint."""
        if self.guarantee == "windowed":
            from rampserve.control.guarantee import windowed_rate  # scipy: not for the command line's parsing

            return windowed_rate(self.accuracy_constraint, self.promise_window, self.windows_below)
        return self.accuracy_constraint

    @property
    def risk_target(self) -> float:
        """The long-run disagreement rolling risk control holds answers to."""
        if self.risk_target_share is not None:
            return self.accuracy_constraint * self.risk_target_share
        return self.certified_rate * (0.65 if self.guarantee == "certified" else 1.0)

    @property
    def rolling_step(self) -> float:
        """Rolling risk control's step on each answer's estimated disagreement. In stop mode a sampled exit's
        estimate is 1 / feedback share, so at `risk_step` one wrong answer observed moved the scale by half (at the
        defaults) and the median input's ramp closed for a thousand answers: one observed wrong answer moves it
        `risk_step`, as in release mode (lite0-fmnist, 3 seeds: p50 0.13-0.65x vanilla at the stated step,
        0.08-0.34x so; DESIGN §9). The windowed promise kept the faster step while its thresholds were tuned, not
        certified: its windows needed it then (1k windows below 0.99 rose from 0.9-7.4% to 6.5-13.9% with the slower
        one); certified at its rate they do not (DESIGN §9)."""
        return self.risk_step * self.kept_share

    @property
    def searches(self) -> bool:
        """Whether ramp sets are searched (which needs shadow batches)."""
        return self.ramp_adjustment and self.shadow_share > 0

    @property
    def shadow_every(self) -> int:
        """After warm-up, one batch in this many is a shadow batch."""
        return max(1, round(1.0 / self.shadow_share)) if self.searches else 0
