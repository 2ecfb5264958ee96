"""The controller: feed it batch records, read its current configuration.

Deterministic given its records, and free of threads and I/O: the live server and the trace simulator both drive
it. What it does:
- Warm-up: the first inputs are served as shadow batches (every site's ramp evaluated, none exiting), so the
  first ramp set is chosen from data, not guessed.
- Search rounds, each time the inputs observed have doubled since the last and then every `search_every` inputs:
  every ramp set within the budget is estimated on the same shadow inputs (a share of batches keeps evaluating
  every ramp), spread over a long span of the stream, for the objective the user asked to cut, each
  at thresholds tuned to the risk target; the best replaces the deployed set only when it has beaten it by more
  than the hysteresis in `challenger_wins` searches since the set last changed, and was not left recently. The
  kept or new set's thresholds are then certified on every recent input that saw its ramps (one look per round).
- Between rounds, rolling risk control scales the certified thresholds (drift), and an anytime-valid monitor of
  the disagreement of the thresholds as tuned finds when they break the constraint: they are certified again at
  once, and where a change detector finds them far above it since some input, the stream is taken to have changed
  there: the inputs before are forgotten, thresholds are tuned again on those since, and a new warm-up (every batch
  a shadow batch) gathers the changed stream's inputs for the next search.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import numpy as np

from rampserve.bundle_format.latency import LatencyProfile
from rampserve.control.costs import CostModel
from rampserve.control.guarantee import ChangeDetector, DisagreementMonitor, RiskBound
from rampserve.control.monitor import AccuracyWindow, ExitHistory
from rampserve.control.objective import serving_waits
from rampserve.control.ramps import SetEstimate, affordable_sites, estimate, no_ramp_fits, ordered, search_sets
from rampserve.control.records import BatchRecord, Configuration
from rampserve.control.risk import rolled_scale, served_scale
from rampserve.control.settings import ControllerSettings
from rampserve.control.thresholds import ExitData, certified_thresholds, tune_greedy

# Modelled cost of a decision: tuning reads every row of every active ramp some hundred times. Charged per row and
# ramp of the data each threshold choice reads (certifying 4,096 inputs at 4 ramps took 70 ms on this 2-core
# machine), so that the simulator's decision delays, and with them its results, do not depend on the wall clock.
DECISION_NS_PER_CELL = 4000.0
DECISION_BASE_MS = 0.05
# The search's best sets (and the deployed one) are ranked again at the thresholds Learn-then-Test certifies for
# them, averaged over this many splits of the inputs into Learn-then-Test's parts. Tuned thresholds favour sets of
# many early ramps that certification then serves at a fraction of them; one split ranks sets by where its test part
# happens to fail first (the deployed set's estimate moved from 0.44 to 0.80 ms between rounds sharing 90% of their
# inputs). Certifying every candidate so costs ~24 s of modelled decision time a round, which left configurations stale
RERANKED_SETS = 5
RANKING_SPLITS = 4
# An alarm is taken as a change of the stream when the answers since the likeliest change point are 1 / delta times
# as likely at this many times the constraint as at the constraint (`ChangeDetector`); otherwise the thresholds are
# certified again on the whole history. Forgetting at every alarm cost lite0-fmnist's drifting stream a fifth of its
# median saving (oracle share 0.40 to 0.32 over 3 seeds: in stop mode the shadow rows tuning reads refill at one
# input in ten)
CHANGE_RATIO = 3.0


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
    """Wall-clock time of each decision, for reports (the simulator charges the modelled time instead)."""

    tune_ms: list[float] = field(default_factory=list)
    adjust_ms: list[float] = field(default_factory=list)


class Controller:
    def __init__(self, profile: LatencyProfile, settings: ControllerSettings = ControllerSettings(),
                 prior: BatchRecord | None = None) -> None:
        """`prior`: inputs served before this controller, every ramp evaluated (a bundle's validation inputs,
        `records.validation_record`); with `settings.prime`, the first configuration is decided on them unless the
        settings give start thresholds."""
        self.settings = settings
        self.costs = CostModel(profile, settings.stops)
        # What a client waits for (release times) whatever the exit mode; in stop mode `costs` also counts the
        # compute an exit frees, which is what the throughput objective and tuning's savings weigh
        self.latency = self.costs if settings.objective == "throughput" else CostModel(profile)
        sites = tuple(settings.initial or ())
        unknown = [s for s in sites if s not in self.costs.position]
        if unknown:
            raise ValueError(f"{unknown} are not sites of this model; sites: {list(profile.sites)}")
        every = self.costs.sites
        # Shadow batches evaluate the ramps a search could deploy (and the initial set's); with none, nothing is
        # searched and the managed server runs no batch that vanilla would not
        affordable = affordable_sites(self.costs, settings.ramp_budget, settings.budget_batch_size)
        self.searches = settings.searches and bool(affordable)
        self.shadow_sites = ordered(self.costs, (*affordable, *sites)) if self.searches else ()
        first = Configuration(0, sites, tuple(settings.start_thresholds.get(s, 0.0) for s in sites),
                              self.shadow_sites, int(self.searches))
        self.window = AccuracyWindow(settings.window)
        self.recent = ExitHistory(every, settings.history)
        self.shadow = ExitHistory(every, max(settings.history, settings.search_span))
        self.delta = 1.0 - settings.confidence
        self.monitor = DisagreementMonitor(settings.certified_rate, self.delta)
        self.changes = ChangeDetector(settings.certified_rate, CHANGE_RATIO)
        if self.searches:
            reason = "initial: shadow batches until the first search"
        elif settings.searches and not sites:
            reason = "initial: no ramp fits the ramp budget, so there is nothing to search"
        else:
            reason = "initial"
        self.decisions: list[Decision] = [Decision(first, 0, reason, 0.0)]
        self.times = DecisionTimes()
        self.last_decision_ms = 0.0  # modelled time the latest observe() spent deciding
        self.last_search: list[SetEstimate] = []  # the latest search's estimates, best first
        self.unverified = 0  # answers released before their batch failed (counted as disagreements)
        self._observed = 0  # inputs learned from (their sequence numbers)
        self._since_round = 0
        self._warm = False
        self._since = 0  # inputs numbered below this came before a change of the stream: tuning and search forget them
        self._changes = 0  # changes of the stream the monitor found
        self._left: dict[tuple[str, ...], int] = {}  # sets replaced, and when (inputs observed)
        self._challengers: dict[tuple[str, ...], int] = {}  # sets that beat the deployed one, and how often
        self._set_changes = 0  # decisions that changed the ramp set (the others moved thresholds alone)
        self._work = 0  # cells read by threshold choices in the decision under way
        self._tighten_only = False
        self._caught_up = {"recent": [], "served": 0, "correct": 0, "unverified": 0}  # see catch_up
        self.bound = 0.0  # see disagreement_bound
        self._looks = 0  # certifications published
        self._certifying = False  # the decision under way publishes newly tuned thresholds
        self.scale = 1.0  # rolling risk control's scale on the thresholds tuning chose (see `risk`)
        self._ceiling = np.array(first.thresholds)  # the thresholds tuning chose, served times the scale
        # Thresholds given to start from say how to start (a successor taking over a configuration, a test)
        if prior is not None and prior.inputs and settings.prime and not settings.start_thresholds and (
                self.searches or (settings.threshold_tuning and sites)):
            self._prime(prior)

    def _prime(self, prior: BatchRecord) -> None:
        """Learn from `prior` as from a warm-up's shadow batches (its waits unknown), and decide at once. A prior
        smaller than the warm-up leaves the rest of it to gather, every batch a shadow batch, before the next search:
        the search judges sets on shadow inputs alone, which after the warm-up come one batch in ten."""
        known = [i for i, site in enumerate(prior.sites) if site in self.costs.position]
        prior = replace(prior, sites=tuple(prior.sites[i] for i in known), labels=prior.labels[:, known],
                        errors=prior.errors[:, known])
        first = self._observed
        self._observed += prior.inputs
        self.recent.add(prior, first, wait_serves=False)
        if self.searches:
            self.shadow.add(prior, first, wait_serves=False)
        self._warm = self._gathered() >= self.settings.warmup
        self._round(f" on {prior.inputs} inputs served before (the bundle's validation inputs)")

    def configuration(self) -> Configuration:
        return self.decisions[-1].configuration

    @property
    def idle(self) -> bool:
        """Whether this controller can never change the configuration: it searches nothing (no ramp fits the budget
        at any batch size, or search is off) and started with no ramp to tune. Every answer is then the original
        model's, and a worker need not feed it records."""
        return not self.searches and not self.decisions[0].configuration.sites

    def status(self, latest_decisions: int | None = None) -> dict:
        """What a server reports of its controller: accuracy over the window and over every answer counted, the
        answers counted, those that could not be verified, the latest search, and the decisions (the latest
        `latest_decisions` of them; None: all, which grow with every change over the controller's life)."""
        window = self.window
        settings = self.settings
        return {"window_accuracy": window.accuracy, "cumulative_accuracy": window.cumulative,
                "inputs_observed": window.served, "unverified_answers": self.unverified,
                "exit_mode": settings.exit_mode, "feedback_share": settings.kept_share,
                "objective": settings.objective, "guarantee": settings.guarantee, "ramp_budget": settings.ramp_budget,
                "bound": {"disagreement_upper": self.bound, "confidence": settings.confidence,
                          "constraint": settings.accuracy_constraint, "history": self.recent.size,
                          "certifications": self._looks, "monitor_log_evidence": self.monitor.log_evidence()},
                "risk_scale": served_scale(self.scale),
                "shadow": {"every": self.configuration().shadow_every, "inputs": self.shadow.size},
                "stream_changes": self._changes, "forgotten_before": self._since,
                "search": [e.to_json() for e in self.last_search[:5]],
                # Sets that beat the deployed one since it was deployed, each replacing it once it has won as often
                # as `challenger_wins` asks
                "challengers": {"wins_needed": settings.challenger_wins,
                                "sets": [{"sites": list(sites), "wins": wins}
                                         for sites, wins in sorted(self._challengers.items(), key=lambda s: -s[1])]},
                # False once the latest search judged no set but "no ramp" (none fits at the budget's batch size, below)
                "ramps_fit": bool(self.searches) and len(self.last_search) != 1, "budget_batch": self.budget_batch(),
                "decisions_made": len(self.decisions), "set_changes": self._set_changes,
                "threshold_changes": len(self.decisions) - 1 - self._set_changes,
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
        if record.version == current.version:
            tested = self._tested(record)
            self.monitor.add(tested)
            if record.feedback_share == 1.0:
                # A likelihood ratio wants answers that are each 0 or 1: those of batches whose every input ran to
                # the end (every batch in release mode, shadow batches in stop mode). Stop mode's sampled exits
                # count 1 / share each, and one alone took the statistic past 1 / delta: every alarm of lite0-fmnist's
                # drifting stream was then a change, and forgetting at each cost it a fifth of its median saving
                self.changes.add(tested, self._observed)
        if record.unverified:
            # Answers nobody can check count against the constraint; until the next configuration, thresholds
            # may only tighten: a failure must never be what loosens them
            self.unverified += record.inputs
            self._tighten_only = True
        settings = self.settings
        served = served_scale(self.scale)
        self.scale = rolled_scale(self.scale, disagreement, settings.risk_target, settings.rolling_step)
        rescaled = settings.threshold_tuning and served_scale(self.scale) != served
        change = None
        if not (record.cached or record.unverified):
            change = self._learn(record)
        if change is None and settings.threshold_tuning and self._looks and self.monitor.alarm:
            if self.changes.statistic >= np.log(1.0 / self.delta):
                change = self._decide(self.times.tune_ms, self._after_change,
                                      "monitor: the stream changed (answers far above the constraint)")
            else:
                change = self._decide(self.times.tune_ms, self._recertify,
                                      "monitor: released answers above the constraint")
        if change is None and rescaled:
            change = self._decide(self.times.tune_ms, self._rescale, "risk control")
        return change

    def _tested(self, record: BatchRecord) -> np.ndarray:
        """What the monitor tests of a batch of the deployed configuration: the disagreement of the answers its
        thresholds as tuned would have released, before risk control's scale. Served at a lower scale, the answers
        that broke the constraint stop exiting after a few disagreements, while thresholds tuned on a stream that
        has since changed go on being what every later round starts from (a synthetic class change, when the
        monitor watched the answers served: the old set kept at thresholds 0 while another paid on the new stream)."""
        sites = self.configuration().sites
        if not sites or not set(sites) <= set(record.sites):  # a cached answer's record has no ramp outputs
            return record.wrong_estimate()
        return record.wrong_estimate_at(sites, self._ceiling)

    def _learn(self, record: BatchRecord) -> Configuration | None:
        """Add a batch's ramp outputs to the history (whatever configuration served them: outputs do not depend
        on thresholds), and search or retune when a round is due."""
        first = self._observed
        self._observed += record.inputs
        self.recent.add(record, first)
        if self.searches and record.sites == self.shadow_sites:  # a shadow batch's (its sites come in model order)
            self.shadow.add(record, first, wait_serves=self._warm)
        self._since_round += record.inputs
        settings = self.settings
        if not self._warm:
            if self._gathered() < settings.warmup:
                return None
            self._warm = True
        elif self._since_round < min(settings.search_every, self._observed - self._since - self._since_round):
            # A young server's history (or one since a change of the stream) doubles between its first rounds: each
            # certifies on twice the evidence, so its thresholds loosen as fast as that grows (minilm-rt on a
            # replay's first 2,700 inputs, simulated: p50 0.89x with one round at 1,024 inputs, 0.81x with another
            # at 2,048)
            return None
        return self._round()

    def _gathered(self) -> int:
        """Inputs the warm-up has gathered: shadow inputs, or without search those that saw the deployed set."""
        if self.searches:
            return len(self.shadow.rows((), since=self._since))
        return len(self.recent.rows(self.configuration().sites, since=self._since))

    def _round(self, on: str = "") -> Configuration | None:
        """A search (or, with search off, a retune of the deployed set) on what the histories hold (`on`: said of
        them in the decision's reason)."""
        self._since_round = 0
        if self.searches:
            return self._decide(self.times.adjust_ms, self._search, "search" + on)
        if self.settings.threshold_tuning:
            return self._decide(self.times.tune_ms, self._recertify, "periodic retune" + on)
        return None

    def _decide(self, timings: list[float], decide, reason: str) -> Configuration | None:
        start = time.perf_counter()
        self._certifying = False
        self._work = 0
        change = decide()
        timings.append((time.perf_counter() - start) * 1000.0)
        self.last_decision_ms = DECISION_BASE_MS + self._work * DECISION_NS_PER_CELL * 1e-6
        if change is None:
            return None
        sites, ceiling, detail = change
        current = self.configuration()
        thresholds = served_scale(self.scale) * np.asarray(ceiling, dtype=float)
        if self._tighten_only and sites == current.sites:
            thresholds = np.minimum(thresholds, current.thresholds)
        self._ceiling = np.asarray(ceiling, dtype=float)
        if self._certifying:
            self.monitor.reset()  # the thresholds it watched are replaced, or certified anew
        # every batch is a shadow batch until a warm-up is over, whatever decides before (risk control may)
        shadow_every = (self.settings.shadow_every if self._warm else 1) if self.searches else current.shadow_every
        if sites == current.sites and tuple(thresholds) == current.thresholds and \
                shadow_every == current.shadow_every:
            return None
        self._tighten_only = False
        if self._certifying:
            self._looks += 1
        if sites != current.sites:
            self._left[current.sites] = self._observed
            self._set_changes += 1
        configuration = Configuration(current.version + 1, sites, tuple(float(t) for t in thresholds),
                                      current.shadow_sites, shadow_every)
        self.decisions.append(Decision(configuration, self.window.served, f"{reason}: {detail}",
                                       self.last_decision_ms))
        self.window.clear()
        self.bound = self.disagreement_bound()
        return configuration

    def _data(self, rows: np.ndarray, history: ExitHistory, sites: tuple[str, ...]) -> ExitData:
        correct, errors = history.columns(rows, sites)
        batch, strata, weights, sequence = history.design(rows)
        return ExitData(correct, errors, self.costs.saved_ms(sites, batch), strata, weights, sequence)

    def tuning_data(self, sites: tuple[str, ...]) -> ExitData:
        """Every recent input that saw each of `sites`' ramps: those of the history, and the shadow inputs older
        than it (a set judged by the search before it served has those alone)."""
        if self.settings.stops and self.searches:
            # Stop mode's other batches see an exit only through the feedback sample, a stratified design whose
            # bound stays wide (30% exits at accuracy 0.9987 on resnet18-fmnist); shadow batches run every input
            # to the end, a uniform sample as large as the ring
            return self._data(self.shadow.rows(sites, since=self._since)[-self.settings.history:], self.shadow, sites)
        recent = self._data(self.recent.rows(sites, since=self._since), self.recent, sites)
        oldest = self.recent.oldest()
        older = self._data(self.shadow.rows(sites, before=oldest, since=self._since)[-self.settings.history:],
                           self.shadow, sites)
        fields = ("correct", "errors", "saved_ms", "strata", "weights", "sequence")
        return ExitData(*(np.concatenate([getattr(older, f), getattr(recent, f)]) for f in fields))

    def choose_thresholds(self, data: ExitData, sites: tuple[str, ...], ranking: bool = False) -> np.ndarray:
        """Thresholds for `sites` from `data`: certified at the configuration's confidence, at the constraint
        (certified promise) or at the windowed promise's rate (windowed), or tuned at the full constraint (average),
        or the start thresholds where tuning is off.

        `ranking`: the thresholds a candidate set is ranked at in a search, tuned at the disagreement rolling risk
        control holds answers to. Certifying each candidate instead ranks them by the noise of Learn-then-Test's
        first failing point as much as by their merit (the deployed set's certified estimate moved from 0.44 to
        0.80 ms between two rounds that shared 90% of their inputs), and the search flipped sets on it."""
        settings = self.settings
        if not settings.threshold_tuning:
            return np.array([settings.start_thresholds.get(s, 0.0) for s in sites])
        if not sites or not data.size:
            return np.zeros(len(sites))
        self._work += data.size * len(sites)
        if ranking or not settings.certifies:
            disagreement = settings.risk_target if ranking else settings.accuracy_constraint
            return tune_greedy(data, 1.0 - disagreement, settings.initial_step, settings.min_step).thresholds
        return certified_thresholds(data, settings.certified_rate, self.delta, settings.initial_step,
                                    settings.min_step)

    def _tuned(self, sites: tuple[str, ...]) -> np.ndarray:
        self._certifying = self.settings.threshold_tuning
        return self.choose_thresholds(self.tuning_data(sites), sites)

    def _recertify(self) -> tuple[tuple[str, ...], np.ndarray, str]:
        sites = self.configuration().sites
        return sites, self._tuned(sites), "thresholds retuned"

    def _after_change(self) -> tuple[tuple[str, ...], np.ndarray, str]:
        """The monitor found the answers above the constraint, and far above it since the change detector's change
        point. What came before that point is forgotten; the deployed set is tuned on what came since (on few inputs,
        tuning exits few of them), and with search a new warm-up gathers shadow inputs of the changed stream before
        the next search judges sets on them."""
        self._since = self.changes.start
        self._changes += 1
        self.changes.reset(self._observed)
        self._challengers = {}  # their wins were judged on the stream before the change
        if self.searches:
            self._warm = False
            self._since_round = 0
        sites = self.configuration().sites
        return sites, self._tuned(sites), \
            f"thresholds retuned on the last {self._observed - self._since} inputs, older ones forgotten"

    def _rescale(self) -> tuple[tuple[str, ...], np.ndarray, str]:
        return self.configuration().sites, self._ceiling, \
            f"thresholds served at {served_scale(self.scale):.2f} of tuned"

    def budget_batch(self) -> int:
        if self.settings.budget_batch_size is not None or not self.recent.size:
            return self.settings.budget_batch_size or 1
        batch = self.recent.design(self.recent.rows(()))[0]
        return int(np.median(batch))

    def _search(self) -> tuple[tuple[str, ...], np.ndarray, str]:
        """Estimate every set within the budget on the shadow inputs; deploy the best when it beats the deployed
        set by the hysteresis, then tune the deployed set's thresholds on all it has."""
        settings = self.settings
        current = self.configuration().sites
        # Spaced over the span, not the newest: the objective is the stream's quantile, and a phase where no set moves
        # its own median would otherwise take the set from the one that moves the stream's (lite0-fmnist: p50 0.55x
        # vanilla judged on the newest 2,048 shadow inputs, 0.078x over the span; DESIGN §9)
        span = self.shadow.rows((), since=self._since)[-settings.search_span:]
        rows = span[np.unique(np.linspace(0, len(span) - 1, min(len(span), settings.search_rows)).round().astype(int))]
        batch = self.shadow.design(rows)[0]
        # What a request waits for is its queueing too: where a third of them wait behind another batch, a set
        # that exits 68% of inputs still leaves the median request a non-exiting one (resnet18-fmnist, bursty
        # seeds: p50 1.01x vanilla when sets were judged on service time alone). Only waits measured while serving
        # count: the warm-up's, every batch running every ramp, were 15 times as long on minilm-rt, and so wide
        # that they hid the median's gain (an early ramp at 38% exits ranked with layer 3 at 77%).
        waits = serving_waits(self.shadow.waits(rows))
        vanilla = waits + np.array([self.costs.times((), int(b)).vanilla_ms for b in batch])

        shadow_inputs: dict[tuple[str, ...], tuple[ExitData, ExitData]] = {}

        def inputs_of(sites: tuple[str, ...]) -> tuple[ExitData, ExitData]:
            """The shadow rows as `sites`' tuning reads them, and with savings of what a request waits for."""
            if sites not in shadow_inputs:
                data = self._data(rows, self.shadow, sites)
                shadow_inputs[sites] = data, replace(data, saved_ms=self.latency.saved_ms(sites, batch))
            return shadow_inputs[sites]

        def judge(sites: tuple[str, ...]) -> SetEstimate:
            data, waited = inputs_of(sites)
            thresholds = self.choose_thresholds(data, sites, ranking=True)
            return estimate(waited, thresholds, sites, vanilla, settings.objective)

        def certified(chosen: SetEstimate) -> SetEstimate:
            """`chosen` ranked again at the thresholds Learn-then-Test certifies (kept where nothing certifies)."""
            if not chosen.sites or not settings.certifies or not settings.threshold_tuning:
                return chosen
            data, waited = inputs_of(chosen.sites)
            splits = [data.sequence, *(np.random.default_rng(k).permutation(data.size)
                                       for k in range(1, RANKING_SPLITS))]
            return SetEstimate.mean([
                estimate(waited, self.choose_thresholds(replace(data, sequence=split), chosen.sites), chosen.sites,
                         vanilla, settings.objective) for split in splits])

        settle = 2 * settings.search_every  # a set left this recently is not returned to
        recently_left = {s for s, when in self._left.items() if self._observed - when < settle}
        self.last_search = search_sets(self.costs, judge, settings.ramp_budget, self.budget_batch(), settings.beam,
                                       excluded=lambda s: s != current and s in recently_left)
        judged = {e.sites: e for e in self.last_search}
        finalists = [*self.last_search[:RERANKED_SETS], judged.get(current) or judge(current)]
        reranked = {e.sites: certified(e) for e in finalists}
        self.last_search = sorted(reranked.values(), key=SetEstimate.key) + \
            [e for e in self.last_search if e.sites not in reranked]
        deployed = reranked[current]
        best = self.last_search[0]
        gains = best.sites != current and self._gains(best, deployed)
        if gains:
            self._challengers[best.sites] = self._challengers.get(best.sites, 0) + 1
        if gains and (self._challengers[best.sites] >= settings.challenger_wins or not current):
            self._challengers = {}
            detail = (f"{list(best.sites)} estimated at {settings.objective} {best.objective_ms:.3f} ms "
                      f"({best.exit_share:.0%} exits) against {deployed.objective_ms:.3f} ms for {list(current)}, "
                      f"on {len(rows)} shadow inputs")
            return best.sites, self._tuned(best.sites), detail
        if len(self.last_search) == 1:  # only "no ramp" was judged
            return current, self._tuned(current), (
                f"{no_ramp_fits(settings.ramp_budget, self.budget_batch())}: the original model answers every input")
        return current, self._tuned(current), "set kept, thresholds retuned"

    def _gains(self, candidate: SetEstimate, deployed: SetEstimate) -> bool:
        keep = 1.0 - self.settings.hysteresis
        return candidate.objective_ms < keep * deployed.objective_ms or (
            candidate.objective_ms <= deployed.objective_ms and candidate.mean_ms < keep * deployed.mean_ms)

    def disagreement_bound(self) -> float:
        """The upper confidence bound on the current configuration's disagreement over the inputs its tuning reads
        (1 before there are any; 0 where no ramp can exit)."""
        current = self.configuration()
        thresholds = np.array(current.thresholds)
        if not current.sites or not (thresholds > 0).any():
            return 0.0
        data = self.tuning_data(current.sites)
        if not data.size:
            return 1.0
        bound = RiskBound.of(data.strata, data.weights, self.settings.accuracy_constraint, self.delta)
        return float(bound.upper(data.wrong_by_stratum(thresholds)))
