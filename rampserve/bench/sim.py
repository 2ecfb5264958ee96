"""The trace simulator: replay a workload stream with an arrival trace through a batching queue, charging
each configuration's latency from the model's measured profile, and compare exit policies (Apparate §5).

Ramp outputs are real (computed once per input by `ramp_outputs`); time is simulated. The controller's
configurations apply only once it would have finished computing them (its decision time after the batch that
triggered them), and every active ramp's cost is charged to every batch it runs in.

A run is a function of its settings (model, stream, trace, seed and the rest): every draw is seeded, and what the
clock measured (each stage's seconds, the controller's measured decision times) is kept apart in the report's
`wall` section. `run_seeds` repeats a run over seeds and sums each system's figures up over them
(`seed_summary`).
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from rampserve.bench.figures import configuration_changes, controller_exit_mode, windows_below_share
from rampserve.bench.harness import ratio
from rampserve.bench.load import DEFAULT_LOAD, batch1_capacity_rps, rate_at_load
from rampserve.bench.own_data import OwnDataSettings, own_stream_of_bundle
from rampserve.bench.queueing import BatchOutcome, QueueResult, max_rate_within_slo, run_queue
from rampserve.bench.ramp_outputs import RampOutputs, ramp_outputs
from rampserve.bundle_format.latency import LatencyProfile, serving_limits
from rampserve.control.controller import Controller, ControllerSettings
from rampserve.control.costs import CostModel
from rampserve.control.ramps import RampSet, beam_search, fits_budget, initial_sites
from rampserve.control.records import NO_EXIT, NO_LABEL, BatchRecord, Configuration, validation_record
from rampserve.control.thresholds import ExitData, TuningResult, evaluate, tune_greedy
from rampserve.ramps.onnx_fused import can_tap
from rampserve.ramps.oracle import earliest_correct_exit
from rampserve.runtime.bundle import load_bundle
from rampserve.runtime.prepare import prepared_encoder
from rampserve.runtime.prepared import PreparedModel
from rampserve.workloads.streams import Stream, get_stream
from rampserve.workloads.traces import arrival_times

# Rates the saturation search spans, as multiples of what the model serves back to back at batch 1
SATURATION_LOW, SATURATION_HIGH = 0.01, 10.0
STATIC_SAMPLE = 0.1  # share of the evaluation stream the static baselines are tuned on (uniformly drawn)
SHARED_THRESHOLDS = np.round(np.arange(0.0, 1.0, 0.005), 6)
# The static-hindsight baseline tunes every ramp set within the budget when there are at most this many (resnet18:
# 162 at a 2% budget); beyond, a beam search of this width (mpnet-rt: 2,047 sets, 10 to 26 minutes exhaustively)
HINDSIGHT_EXHAUSTIVE_SETS = 256
HINDSIGHT_BEAM = 8


@dataclass(frozen=True)
class SimSettings(OwnDataSettings):
    model: str = "resnet18-fmnist"
    workload: str = "fmnist-drift"
    trace: str = "maf"
    rate_rps: float | None = None  # default: `load` times what the model serves back to back at batch 1
    load: float = DEFAULT_LOAD
    slo_ms: float | None = None  # default: twice the batch-1 latency (DESIGN §8)
    length: int = 120_000  # stream items, bootstrap included
    seed: int = 0
    controller: ControllerSettings = field(default_factory=ControllerSettings)
    risk_step_sweep: tuple[float, ...] = (0.02, 0.05, 0.2)  # rolling risk control's step (see control.risk)
    worst_window: int = 1000
    saturation: bool = True  # search each system's saturation, then run vanilla and rampserve at half of vanilla's
    saturation_requests: int = 20_000  # stream prefix the saturation search replays at each rate
    hindsight_exhaustive_sets: int = HINDSIGHT_EXHAUSTIVE_SETS
    hindsight_beam: int = HINDSIGHT_BEAM
    small: bool = False
    # A prepared bundle to use instead of the zoo model's; with `data`, one prepared on it (`prepare --data`)
    bundle: Path | None = None


@dataclass
class SystemRun:
    queue: QueueResult
    correct: np.ndarray  # per request: released answer equals the original model's
    exit_column: np.ndarray  # per request: the site (column of the outputs) that answered it, or NO_EXIT
    controller: Controller | None = None
    applied: list[tuple[float, Configuration]] = field(default_factory=list)  # (simulated ms, configuration)

    @property
    def exited(self) -> np.ndarray:
        """Per request: answered before the last stage."""
        return self.exit_column != NO_EXIT


@dataclass(frozen=True)
class Scenario:
    outputs: RampOutputs  # the evaluation part of the stream, in arrival order
    costs: CostModel
    arrivals_ms: np.ndarray
    max_batch: int
    # Per request, the positions its input takes where inputs come in any length (text): a batch then takes its
    # profiled time scaled to its longest input's (`LatencyProfile.length_scale`); None: every input one size
    lengths: np.ndarray | None = None
    # Sites whose ramps run in Python on the serving path (a cache ramp, stashed for the releasing thread:
    # `ramps.fused`): in stop mode an input that exits there is answered but runs on to the end. On ONNX Runtime a set
    # with such a ramp is cut into stages, which stop no input at any of its ramps (`python_sets_stop` False)
    python_ramps: frozenset[str] = frozenset()
    python_sets_stop: bool = True
    # The bundle's validation inputs, which a managed system's controller is primed with (`Controller(prior=...)`)
    prior: BatchRecord | None = None

    def stopping(self, sites: tuple[str, ...]) -> tuple[bool, np.ndarray]:
        """Whether a stop-mode batch of these active sites stops inputs at all, and per site whether an exit there
        stops its input."""
        python = np.array([s in self.python_ramps for s in sites], dtype=bool)
        return self.python_sets_stop or not python.any(), ~python

    def length_scale(self, requests: np.ndarray) -> float:
        """How much longer than the profile's figures for their batch size these requests' batch runs."""
        if self.lengths is None:
            return 1.0
        return self.costs.profile.length_scale(len(requests), int(self.lengths[requests].max()))


def replay(scenario: Scenario, start: Configuration, controller: Controller | None = None, stop: bool = False,
           feedback_share: float = 1.0, seed: int = 0) -> SystemRun:
    """Serve the scenario with a fixed configuration, or with one the controller keeps changing. With `stop`,
    inputs that exit leave their batch at the ramp (each segment is charged at the rows that run it), except a
    uniform `feedback_share` of the batch's inputs drawn (whatever their scores) to run to the end; the
    controller hears nothing more of the others, as a server in stop mode would tell it. Inputs do not leave at a
    ramp that runs in Python, nor at all where the set is cut into stages for one (`Scenario.stopping`)."""
    outputs, costs = scenario.outputs, scenario.costs
    n = len(scenario.arrivals_ms)
    correct = np.ones(n, dtype=bool)
    exit_column = np.full(n, NO_EXIT, dtype=np.int64)
    pending: deque[tuple[float, Configuration]] = deque()
    applied = [(0.0, start)]
    current = {"config": start, "batches": 0}
    draw = np.random.default_rng(seed)

    def serve(start_ms: float, requests: np.ndarray) -> BatchOutcome:
        while pending and pending[0][0] <= start_ms:
            when, config = pending.popleft()
            current.update(config=config, batches=0)
            applied.append((when, config))
        config = current["config"]
        # A shadow batch evaluates every site's ramp (inactive ones exit nothing) and, in stop mode, runs every
        # input to the end, as the live server's shadow batches do
        shadow = config.is_shadow_batch(current["batches"])
        current["batches"] += 1
        if shadow:
            config = config.shadowed()
        columns = np.array(outputs.columns(config.sites), dtype=np.int64)
        labels = outputs.labels[requests][:, columns]
        errors = outputs.errors[requests][:, columns]
        exits = config.exits(errors)
        final = outputs.final[requests]
        record = BatchRecord(config.version, config.sites, labels, errors, final, exits,
                             queue_ms=start_ms - float(scenario.arrivals_ms[requests].min()))
        correct[requests] = record.correct()
        if len(columns):  # NO_EXIT indexes the last column, masked out
            exit_column[requests] = np.where(exits == NO_EXIT, NO_EXIT, columns[exits])
        exit_index = np.where(exits == NO_EXIT, len(columns), exits)
        stops, stops_at = scenario.stopping(config.sites) if stop else (False, None)
        if stops and len(columns):
            kept = np.ones(len(requests), dtype=bool) if shadow else draw.random(len(requests)) < feedback_share
            forced = ~np.append(stops_at, True)[exit_index]  # exits at a ramp in Python run on to the end
            kept |= forced
            leaves = np.where(kept, len(columns), exit_index)  # the segment after which each input stops running
            running = (leaves[:, None] >= np.arange(len(columns) + 1)[None, :]).sum(axis=0)
            release_ms, duration_ms = costs.stopping_batch(config.sites, running)
            record = _stopped(record, exits, kept, 1.0 if shadow else feedback_share, forced)
        else:
            times = costs.times(config.sites, len(requests))
            release_ms, duration_ms = times.release_ms, times.duration_ms
        scale = scenario.length_scale(requests)
        release, duration_ms = np.append(release_ms, duration_ms)[exit_index] * scale, duration_ms * scale
        if controller is not None:
            changed = controller.observe(record)
            if changed is not None:
                pending.append((start_ms + duration_ms + controller.last_decision_ms, changed))
        return BatchOutcome(duration_ms, release)

    queue = run_queue(scenario.arrivals_ms, scenario.max_batch, serve)
    return SystemRun(queue, correct, exit_column, controller, applied)


def _stopped(record: BatchRecord, exits: np.ndarray, kept: np.ndarray, feedback_share: float,
             forced: np.ndarray) -> BatchRecord:
    """What a stop-mode server records of a batch: an input that exited and was not kept has no final label,
    and no outputs at the ramps after its exit; one that exited where no input stops (`forced`) ran to the end
    for sure and stands for itself alone."""
    stopped = (exits != NO_EXIT) & ~kept
    after_exit = stopped[:, None] & (np.arange(len(record.sites))[None, :] > exits[:, None])
    forced = forced & (exits != NO_EXIT)
    return replace(record, labels=np.where(after_exit, NO_LABEL, record.labels),
                   errors=np.where(after_exit, np.nan, record.errors),
                   final=np.where(stopped, NO_LABEL, record.final), feedback_share=feedback_share,
                   forced=forced if forced.any() else None)


def replay_oracle(scenario: Scenario) -> SystemRun:
    """Every input leaves at the earliest site (any site) whose ramp agrees with the final label; ramps are free."""
    outputs, profile = scenario.outputs, scenario.costs.profile
    exits = earliest_correct_exit(outputs.labels, outputs.final)

    def serve(start_ms: float, requests: np.ndarray) -> BatchOutcome:
        b = len(requests)
        scale = scenario.length_scale(requests)
        release = np.append(profile.reach(b), profile.full(b))[np.where(exits[requests] == NO_EXIT, -1,
                                                                         exits[requests])]
        return BatchOutcome(profile.full(b) * scale, release * scale)

    queue = run_queue(scenario.arrivals_ms, scenario.max_batch, serve)
    return SystemRun(queue, np.ones(len(exits), dtype=bool), exits)


def exit_data(scenario: Scenario, rows: np.ndarray, sites: tuple[str, ...], batch_sizes: np.ndarray) -> ExitData:
    outputs = scenario.outputs
    columns = outputs.columns(sites)
    correct = outputs.labels[rows][:, columns] == outputs.final[rows, None]
    return ExitData(correct, outputs.errors[rows][:, columns].astype(np.float64),
                    scenario.costs.saved_ms(sites, batch_sizes))


def shared_threshold(data: ExitData, target_accuracy: float) -> float:
    """BranchyNet/DeeBERT style: one threshold for every ramp, the highest-saving one that keeps accuracy."""
    best, best_saved = 0.0, -np.inf
    for chunk in np.array_split(SHARED_THRESHOLDS, 8):
        accuracy, saved = evaluate(data, np.repeat(chunk[:, None], data.ramps, axis=1))
        ok = accuracy >= target_accuracy
        if ok.any() and saved[ok].max() > best_saved:
            best_saved, best = float(saved[ok].max()), float(chunk[ok][np.argmax(saved[ok])])
    return best


def sets_within(sites: Sequence[str], fits: Callable[[RampSet], bool]) -> Iterator[RampSet]:
    """Every ramp set that `fits`, by size, then in the sites' order. A ramp's cost is never negative, so once
    no set of a size fits, no larger one does."""
    for size in range(1, len(sites) + 1):
        found = False
        for chosen in itertools.combinations(sites, size):
            if fits(chosen):
                found = True
                yield chosen
        if not found:
            return


@dataclass(frozen=True)
class HindsightSearch:
    configuration: Configuration
    saved_ms: float  # its mean saving on the evaluation stream (-inf when no set fits the budget)
    search: str  # "exhaustive" or "beam"
    tuned: int  # ramp sets whose thresholds were tuned


def hindsight_configuration(scenario: Scenario, batch_sizes: np.ndarray, budget: float, budget_batch: int,
                            target_accuracy: float, exhaustive_sets: int = HINDSIGHT_EXHAUSTIVE_SETS,
                            beam: int = HINDSIGHT_BEAM) -> HindsightSearch:
    """The paper's "-opt" baselines: the best fixed ramp set within the ramp budget and its thresholds, tuned
    with the whole evaluation stream in hand. Every set that fits when at most `exhaustive_sets` do, else the
    sets a `beam_search` of width `beam` reaches; among equal savings, the smaller set, then the earlier."""
    costs = scenario.costs
    rows = np.arange(len(batch_sizes))
    tuned: dict[RampSet, TuningResult] = {}

    def fits(chosen: RampSet) -> bool:
        return fits_budget(costs, chosen, budget, budget_batch)

    few = list(itertools.islice(sets_within(costs.sites, fits), exhaustive_sets + 1))
    search = "exhaustive" if len(few) <= exhaustive_sets else "beam"
    with tqdm(total=len(few) if search == "exhaustive" else None, desc=f"static hindsight: ramp sets ({search})",
              unit="set", leave=False) as bar:
        def saving(chosen: RampSet) -> float:
            if chosen not in tuned:
                tuned[chosen] = tune_greedy(exit_data(scenario, rows, chosen, batch_sizes), target_accuracy)
                bar.update()
            return tuned[chosen].saved_ms

        candidates = few if search == "exhaustive" else beam_search(costs.sites, fits, saving, beam)
        if not candidates:
            return HindsightSearch(Configuration(0, (), ()), -np.inf, search, 0)
        best = max(candidates, key=saving)  # the first of equals: candidates come by size, then in model order
    thresholds = tuple(float(t) for t in tuned[best].thresholds)
    return HindsightSearch(Configuration(0, best, thresholds), tuned[best].saved_ms, search, len(tuned))


def mean_rate_rps(arrivals_ms: np.ndarray) -> float:
    """Arrivals per second from time 0 to the last one (traces start at 0)."""
    if len(arrivals_ms) == 0 or arrivals_ms[-1] <= 0:
        raise ValueError("a rate needs arrivals that end after time 0")
    return len(arrivals_ms) / float(arrivals_ms[-1]) * 1000.0


def scenario_rate(settings: SimSettings, profile: LatencyProfile, mean_scale: float = 1.0) -> float:
    """The simulated replay's rate: `settings.rate_rps` if given, else `settings.load` (`bench.load`) of the model's
    batch-1 capacity on the stream's inputs, which take `mean_scale` times the profiled batch-1 time on average."""
    return settings.rate_rps or rate_at_load(settings.load, batch1_capacity_rps(profile) / mean_scale)


def trace_saturation(run_at: Callable[[np.ndarray], SystemRun], arrivals_ms: np.ndarray, slo_ms: float,
                     capacity_rps: float, rel_tol: float = 0.02) -> float:
    """The highest mean arrival rate (`mean_rate_rps`) at which the trace's arrivals, stretched or compressed in
    time (its shape kept), are served (`run_at(arrivals)`, each call a run of its own: a fresh controller) with
    their p99 latency within the SLO; searched between SATURATION_LOW and SATURATION_HIGH times `capacity_rps`
    (`max_rate_within_slo`)."""
    base = mean_rate_rps(arrivals_ms)

    def p99_at(rate: float) -> float:
        return float(np.percentile(run_at(arrivals_ms * (base / rate)).queue.latency_ms, 99))

    return max_rate_within_slo(p99_at, slo_ms, SATURATION_LOW * capacity_rps, SATURATION_HIGH * capacity_rps,
                               rel_tol)


def _prefix(scenario: Scenario, requests: int) -> Scenario:
    outputs = scenario.outputs
    rows = np.arange(min(requests, len(scenario.arrivals_ms)))
    return replace(scenario, outputs=outputs.subset(rows), arrivals_ms=scenario.arrivals_ms[rows],
                   lengths=None if scenario.lengths is None else scenario.lengths[rows])


def _rolling_min_mean(values: np.ndarray, window: int) -> float:
    window = min(window, len(values))
    sums = np.cumsum(np.concatenate([[0.0], values.astype(np.float64)]))
    return float(((sums[window:] - sums[:-window]) / window).min())


def summarize(run: SystemRun, worst_window: int) -> dict:
    latency = run.queue.latency_ms
    p25, p50, p95, p99 = np.percentile(latency, [25, 50, 95, 99])
    summary = {
        "accuracy": float(run.correct.mean()),
        "worst_window_accuracy": _rolling_min_mean(run.correct, worst_window),
        "p25_ms": float(p25), "p50_ms": float(p50), "p95_ms": float(p95), "p99_ms": float(p99),
        "mean_ms": float(latency.mean()),
        "throughput_rps": float(run.queue.throughput_rps()),
        "exit_share": float(run.exited.mean()),
        "mean_batch_size": float(run.queue.batch_sizes.mean()),
    }
    if run.controller is not None:
        times = run.controller.times
        decisions = run.controller.decisions
        summary |= {
            "tunings": len(times.tune_ms),
            "adjustments": len(times.adjust_ms),
            "configurations": len(decisions),
            **configuration_changes([d.configuration.sites for d in decisions]),
            "mean_active_ramps": _mean_active_ramps(run),
        }
    elif run.applied and run.applied[0][1].sites:
        config = run.applied[0][1]
        summary |= {"sites": list(config.sites), "thresholds": list(config.thresholds)}
    return summary


def measured_part(run: SystemRun, rows: np.ndarray) -> SystemRun:
    """`run` scored on its requests `rows` alone (those before them served it, and are not counted); its
    controller's books stay whole."""
    queue = run.queue
    batches, batch_of = np.unique(queue.batch_of[rows], return_inverse=True)
    part = QueueResult(queue.arrival_ms[rows], queue.start_ms[rows], queue.release_ms[rows], batch_of,
                       queue.batch_sizes[batches], queue.busy_ms)
    return replace(run, queue=part, correct=run.correct[rows], exit_column=run.exit_column[rows])


def measured_decision_times(controller: Controller) -> dict:
    """The controller's decision times as the clock measured them: they differ run to run (a decision's own
    `decision_ms`, which delays its configuration here, is modelled and does not)."""
    times = controller.times
    return {"tune_ms_mean": float(np.mean(times.tune_ms)) if times.tune_ms else 0.0,
            "adjust_ms_mean": float(np.mean(times.adjust_ms)) if times.adjust_ms else 0.0}


def _mean_active_ramps(run: SystemRun) -> float:
    starts = np.array([t for t, _ in run.applied])
    counts = np.array([len(c.sites) for _, c in run.applied])
    served = run.queue.start_ms
    return float(counts[np.searchsorted(starts, served, side="right") - 1].mean())


def with_savings(systems: dict[str, dict]) -> dict[str, dict]:
    vanilla, oracle = systems["vanilla"], systems.get("oracle")
    for summary in systems.values():
        for q in ("p25", "p50", "p95", "p99"):
            summary[f"{q}_savings"] = 1.0 - summary[f"{q}_ms"] / vanilla[f"{q}_ms"]
    for summary in systems.values():
        if oracle is not None and oracle["p50_savings"] > 0:
            summary["oracle_share"] = summary["p50_savings"] / oracle["p50_savings"]
    return systems


@dataclass
class SimResult:
    report: dict  # JSON-ready
    runs: dict[str, SystemRun]
    scenario: Scenario


def input_lengths(model: PreparedModel, stream: Stream, start: int, stop: int) -> np.ndarray:
    """Per item of the stream from `start` to `stop`, the positions it takes as a request of its own (its inputs'
    second dimension as the model's encoder makes them). A text stream revisits its sentences: each distinct one is
    encoded once."""
    encoder = prepared_encoder(model, stream.task)
    distinct, first, inverse = np.unique(stream.base_ids(start, stop), return_index=True, return_inverse=True)
    widths = np.array([next(iter(encoder(stream.items(start + p, start + p + 1)).values())).shape[1]
                       for p in tqdm(first, desc="input lengths", unit="input", leave=False)], dtype=np.int64)
    return widths[inverse]


def python_ramps(model: PreparedModel) -> dict:
    """`Scenario`'s `python_ramps` and `python_sets_stop` for a model as its compiled sets serve it: a ramp that is
    not fused into ONNX stages (`ramps.onnx_fused.can_tap`: a cache ramp) or, on torch, not a linear ramp (the
    ramp operator's kind) is evaluated in Python."""
    if model.backend.kind == "onnx":
        return {"python_ramps": frozenset(s for s, ramp in model.ramps.items() if not can_tap(ramp)),
                "python_sets_stop": False}
    return {"python_ramps": frozenset(s for s, ramp in model.ramps.items() if ramp.spec.kind != "linear"),
            "python_sets_stop": True}


def load_scenario(settings: SimSettings) -> tuple[Scenario, dict]:
    from rampserve.runtime.zoo_bundles import zoo_bundle

    own = None if settings.data is None else own_stream_of_bundle(settings.bundle, settings.data) \
        if settings.bundle else settings.own_stream(settings.model, settings.small)
    bundle = own.bundle if own else settings.bundle or zoo_bundle(settings.model, settings.small)
    model = load_bundle(bundle)
    if model.profile is None:
        raise ValueError(f"{bundle} has no latency profile; run `rampserve profile {bundle}`")
    stream = own.stream if own else get_stream(settings.workload, length=settings.length, seed=settings.seed)
    evaluation = stream.evaluation
    outputs = ramp_outputs(model, bundle, stream, evaluation.start, evaluation.stop)
    profile = model.profile
    lengths, mean_scale = None, 1.0
    if profile.lengths:
        lengths = input_lengths(model, stream, evaluation.start, evaluation.stop)
        distinct, counts = np.unique(lengths, return_counts=True)  # a scale per length, not per request
        mean_scale = float(np.average([profile.length_scale(1, n) for n in distinct], weights=counts))
    rate = scenario_rate(settings, profile, mean_scale)
    slo, max_batch = serving_limits(profile, settings.slo_ms)
    arrivals = arrival_times(settings.trace, len(outputs.final), rate, seed=settings.seed)
    scenario = Scenario(outputs, CostModel(profile), arrivals, max_batch, lengths, **python_ramps(model),
                        prior=validation_record(tuple(model.site_names), model.validation))
    info = {"model": settings.model, "workload": settings.workload_label, "trace": settings.trace,
            **({"data": own.record, "bundle": str(own.bundle)} if own else {}),
            "rate_rps": rate, "load": rate * mean_scale / batch1_capacity_rps(profile), "slo_ms": slo,
            "max_batch": max_batch, "requests": len(arrivals), "sites": list(profile.sites),
            "vanilla_batch1_ms": profile.full(1), "mean_length_scale": mean_scale}
    return scenario, info


@contextmanager
def _stage(name: str, seconds: dict[str, float], progress: Callable[[str], None]) -> Iterator[None]:
    """Announce a stage of a run and record the seconds it took."""
    progress(name)
    start = time.perf_counter()
    yield
    seconds[name] = time.perf_counter() - start


def run_sim(settings: SimSettings, progress: Callable[[str], None] = lambda _: None) -> SimResult:
    seconds: dict[str, float] = {}
    with _stage("scenario", seconds, progress):
        scenario, info = load_scenario(settings)
    control = settings.controller.resolved(info["max_batch"])  # the exit mode a server would serve this model in
    target = control.target_accuracy
    runs: dict[str, SystemRun] = {}

    with _stage("vanilla", seconds, progress):
        runs["vanilla"] = replay(scenario, Configuration(0, (), ()))
    batch_sizes = runs["vanilla"].queue.batch_sizes[runs["vanilla"].queue.batch_of]
    budget_batch = control.budget_batch_size or int(np.median(batch_sizes))
    with _stage("oracle", seconds, progress):
        runs["oracle"] = replay_oracle(scenario)

    n = len(batch_sizes)
    sample = np.sort(np.random.default_rng(settings.seed).choice(n, int(n * STATIC_SAMPLE), replace=False))
    all_sites = scenario.costs.sites
    stop = control.stops  # static systems in stop mode stop every exit: they learn nothing from the end

    def static(config: Configuration, scenario_: Scenario = scenario) -> SystemRun:
        return replay(scenario_, config, stop=stop, feedback_share=0.0, seed=settings.seed)

    def managed(settings_: ControllerSettings, scenario_: Scenario = scenario) -> SystemRun:
        controller = Controller(scenario_.costs.profile, settings_, scenario_.prior)
        return replay(scenario_, controller.configuration(), controller, stop, settings_.kept_share, settings.seed)

    with _stage("static hindsight", seconds, progress):
        hindsight = hindsight_configuration(scenario, batch_sizes, control.ramp_budget, budget_batch, target,
                                            settings.hindsight_exhaustive_sets, settings.hindsight_beam)
    with _stage("static baselines", seconds, progress):
        sample_data = exit_data(scenario, sample, all_sites, batch_sizes[sample])
        shared = shared_threshold(sample_data, target)
        per_ramp = tune_greedy(sample_data, target).thresholds
        static_configs = {
            "static_shared": Configuration(0, all_sites, (shared,) * len(all_sites)),
            "static_per_ramp": Configuration(0, all_sites, tuple(float(t) for t in per_ramp)),
            "static_hindsight": hindsight.configuration}
        for name, config in static_configs.items():
            runs[name] = static(config)

    managed_settings = {
        "rampserve": control,
        "rampserve_no_adjust": replace(control, ramp_adjustment=False,
                                       initial=initial_sites(scenario.costs, control.ramp_budget, budget_batch)),
        "rampserve_no_tuning": replace(control, threshold_tuning=False, start_thresholds=dict(
            zip(all_sites, (float(t) for t in per_ramp))))}
    with _stage("rampserve", seconds, progress):
        for name, settings_ in managed_settings.items():
            runs[name] = managed(settings_)
    systems = with_savings({name: summarize(run, settings.worst_window) for name, run in runs.items()})
    systems["static_hindsight"] |= {"ramp_set_search": hindsight.search, "ramp_sets_tuned": hindsight.tuned}
    for name, run in runs.items():
        systems[name]["windows_below_share"] = windows_below_share(run.correct, target)
        if run.controller is not None:
            systems[name] |= controller_exit_mode(run.controller.settings)

    at_half = None
    if settings.saturation:
        # The trace replayed faster or slower (its shape kept) on a prefix of the stream, each run with a fresh
        # controller; then vanilla and rampserve at half of vanilla's saturation
        prefix = _prefix(scenario, settings.saturation_requests)
        runners: dict[str, Callable[[Scenario], SystemRun]] = {
            "vanilla": lambda sc: replay(sc, Configuration(0, (), ())), "oracle": replay_oracle,
            **{name: (lambda sc, c=config: static(c, sc)) for name, config in static_configs.items()},
            **{name: (lambda sc, c=settings_: managed(c, sc)) for name, settings_ in managed_settings.items()}}
        capacity = batch1_capacity_rps(scenario.costs.profile)
        with _stage("saturation", seconds, progress):
            for name, run_at in tqdm(runners.items(), desc="saturation", unit="system", leave=False):
                systems[name]["saturation_rps"] = trace_saturation(
                    lambda arrivals, run=run_at: run(replace(prefix, arrivals_ms=arrivals)), prefix.arrivals_ms,
                    info["slo_ms"], capacity)
        half_rate = systems["vanilla"]["saturation_rps"] / 2
        with _stage("vanilla and rampserve at half of vanilla's saturation", seconds, progress):
            half = replace(scenario,
                           arrivals_ms=scenario.arrivals_ms * (mean_rate_rps(scenario.arrivals_ms) / half_rate))
            at_half = {name: summarize(runners[name](half), settings.worst_window) for name in ("vanilla", "rampserve")}
        at_half = {"rate_rps": half_rate, "systems": at_half,
                   "p50_ratio": at_half["rampserve"]["p50_ms"] / at_half["vanilla"]["p50_ms"],
                   "p99_ratio": at_half["rampserve"]["p99_ms"] / at_half["vanilla"]["p99_ms"]}

    sweep = {}
    for step in settings.risk_step_sweep:
        if step == control.risk_step:
            sweep[str(step)] = systems["rampserve"]
            continue
        with _stage(f"rampserve, risk step {step}", seconds, progress):
            run = managed(replace(control, risk_step=step))
        sweep[str(step)] = summarize(run, settings.worst_window) | {
            "windows_below_share": windows_below_share(run.correct, target)}
    kept = ("accuracy", "worst_window_accuracy", "windows_below_share", "p50_ms", "p95_ms", "exit_share", "tunings")
    sweep = {w: {k: s[k] for k in kept} | {"p50_savings": 1.0 - s["p50_ms"] / systems["vanilla"]["p50_ms"]}
             for w, s in sweep.items()}
    rampserve = runs["rampserve"].controller
    report = info | {
        "seed": settings.seed,
        "budget_batch_size": budget_batch,
        "controller": {k: v for k, v in vars(control).items() if k != "start_thresholds"},
        "systems": systems,
        "saturation_ratio": ratio(systems["rampserve"].get("saturation_rps"),
                                  systems["vanilla"].get("saturation_rps")),
        "at_half_vanilla_saturation": at_half,
        "risk_step_sweep": sweep,
        "decisions": [d.to_json() for d in rampserve.decisions],
        # measured by the clock: differs run to run, whatever the settings
        "wall": {"stage_s": seconds, "decisions": {name: measured_decision_times(run.controller)
                                                   for name, run in runs.items() if run.controller is not None}},
    }
    return SimResult(report, runs, scenario)



# --- several seeds --------------------------------------------------------------------------------------------

# Each figure `seed_summary` sums up over seeds, and which way is worse: "low" (the lowest seed is the worst) or
# "high". The configuration changes count a managed system's churn: its "worst" seed is the one with the most.
SEED_FIGURES: dict[str, str] = {
    "accuracy": "low", "windows_below_share": "high", "p50_ratio": "high", "p99_ratio": "high",
    "exit_share": "low", "oracle_share": "low", "saturation_ratio": "low",
    "ramp_set_changes": "high", "threshold_changes": "high"}


def seed_figures(report: dict) -> dict[str, dict[str, float | None]]:
    """Per system of one run's report, the figures of SEED_FIGURES: latency and saturation as ratios to vanilla's
    (None where the run has no such figure: no saturation search, no oracle savings, no controller)."""
    systems = report["systems"]
    vanilla = systems["vanilla"]
    return {name: {"accuracy": s["accuracy"], "windows_below_share": s.get("windows_below_share"),
                   **{f"{q}_ratio": ratio(s[f"{q}_ms"], vanilla[f"{q}_ms"]) for q in ("p50", "p99")},
                   "exit_share": s["exit_share"], "oracle_share": s.get("oracle_share"),
                   "saturation_ratio": ratio(s.get("saturation_rps"), vanilla.get("saturation_rps")),
                   "ramp_set_changes": s.get("ramp_set_changes"), "threshold_changes": s.get("threshold_changes")}
            for name, s in systems.items()}


def seed_summary(per_seed: Sequence[dict[str, dict[str, float | None]]]) -> dict[str, dict[str, dict | None]]:
    """Per system and figure (`seed_figures` of each seed's run, seeds in order), over the seeds that have it: the
    median, the worst value (SEED_FIGURES says which way) and its seed's index (the first of equals); None for a
    figure no seed has."""
    systems = list(dict.fromkeys(name for figures in per_seed for name in figures))
    summary: dict[str, dict[str, dict | None]] = {}
    for name in systems:
        summary[name] = {}
        for figure, worse in SEED_FIGURES.items():
            values = [(seed, figures[name][figure]) for seed, figures in enumerate(per_seed)
                      if figures.get(name, {}).get(figure) is not None]
            if not values:
                summary[name][figure] = None
                continue
            sign = -1.0 if worse == "high" else 1.0
            worst_seed, worst = min(values, key=lambda sv: sign * sv[1])
            summary[name][figure] = {"median": float(np.median([v for _, v in values])), "worst": worst,
                                     "worst_seed": worst_seed, "seeds": len(values)}
    return summary


@dataclass
class SeedsResult:
    results: list[SimResult]  # seed 0, 1, ...
    summary: dict  # `seed_summary` of their reports

    def report(self) -> dict:
        return {"seeds": [r.report for r in self.results], "summary": self.summary}


def kept_report(report: dict, decisions: bool = False) -> dict:
    """A report (one seed's, or several seeds' with their summary) as its JSON keeps it: each seed's log of the
    controller's every decision only where asked for (most of a long run's bytes; the command makes it again)."""
    if "seeds" in report:
        return {**report, "seeds": [kept_report(seed, decisions) for seed in report["seeds"]]}
    return report if decisions else {key: value for key, value in report.items() if key != "decisions"}


def run_seeds(settings: SimSettings, seeds: int, progress: Callable[[str], None] = lambda _: None) -> SeedsResult:
    """The whole simulation once per seed 0 .. seeds - 1 (each its own stream order and trace), and the
    summary of each system's figures over them; one seed: the run as `settings` has it."""
    if seeds < 1:
        raise ValueError(f"need at least one seed, got {seeds}")
    if seeds == 1:
        results = [run_sim(settings, progress)]
    else:
        results = [run_sim(replace(settings, seed=seed), lambda stage, seed=seed: progress(f"seed {seed}: {stage}"))
                   for seed in tqdm(range(seeds), desc="seeds", unit="seed")]
    return SeedsResult(results, seed_summary([seed_figures(r.report) for r in results]))
