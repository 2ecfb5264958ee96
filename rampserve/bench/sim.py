"""The trace simulator: replay a workload stream with an arrival trace through a batching queue, charging
each configuration's latency from the model's measured profile, and compare exit policies (Apparate §5).

Ramp outputs are real (computed once per input by `ramp_outputs`); time is simulated. The controller's
configurations apply only once it would have finished computing them (its measured decision time after the
batch that triggered them), and every active ramp's cost is charged to every batch it runs in.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from rampserve.bench.figures import controller_exit_mode, windows_below_share
from rampserve.bench.queueing import BatchOutcome, QueueResult, max_rate_within_slo, run_queue
from rampserve.bench.ramp_outputs import RampOutputs, ramp_outputs
from rampserve.control.controller import Controller, ControllerSettings
from rampserve.control.costs import CostModel
from rampserve.control.ramps import fits_budget, initial_sites
from rampserve.control.records import NO_EXIT, NO_LABEL, BatchRecord, Configuration
from rampserve.control.thresholds import ExitData, evaluate, tune_greedy
from rampserve.ramps.oracle import earliest_correct_exit
from rampserve.runtime.bundle import load_bundle
from rampserve.runtime.latency import max_batch_for_slo
from rampserve.workloads.streams import get_stream
from rampserve.workloads.traces import arrival_times

# Rates the saturation search spans, as multiples of what the model serves back to back at batch 1
SATURATION_LOW, SATURATION_HIGH = 0.01, 10.0
STATIC_SAMPLE = 0.1  # share of the evaluation stream the static baselines are tuned on (uniformly drawn)
SHARED_THRESHOLDS = np.round(np.arange(0.0, 1.0, 0.005), 6)


@dataclass(frozen=True)
class SimSettings:
    model: str = "resnet18-fmnist"
    workload: str = "fmnist-drift"
    trace: str = "maf"
    rate_rps: float | None = None  # default: `load` times what the model serves back to back at batch 1
    load: float = 0.2
    slo_ms: float | None = None  # default: twice the batch-1 latency (DESIGN §8)
    length: int = 120_000  # stream items, bootstrap included
    seed: int = 0
    controller: ControllerSettings = field(default_factory=ControllerSettings)
    risk_step_sweep: tuple[float, ...] = (0.02, 0.05, 0.2)  # rolling risk control's step (see control.risk)
    worst_window: int = 1000
    saturation_requests: int = 20_000  # stream prefix the saturation search replays at each rate
    small: bool = False
    bundle: Path | None = None  # a prepared bundle to use instead of the zoo model's


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


def replay(scenario: Scenario, start: Configuration, controller: Controller | None = None, stop: bool = False,
           feedback_share: float = 1.0, seed: int = 0) -> SystemRun:
    """Serve the scenario with a fixed configuration, or with one the controller keeps changing. With `stop`,
    inputs that exit leave their batch at the ramp (each segment is charged at the rows that run it), except a
    uniform `feedback_share` of the batch's inputs drawn (whatever their scores) to run to the end; the
    controller hears nothing more of the others, as a server in stop mode would tell it."""
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
        record = BatchRecord(config.version, config.sites, labels, errors, final, exits)
        correct[requests] = record.correct()
        if len(columns):  # NO_EXIT indexes the last column, masked out
            exit_column[requests] = np.where(exits == NO_EXIT, NO_EXIT, columns[exits])
        exit_index = np.where(exits == NO_EXIT, len(columns), exits)
        if stop and len(columns):
            kept = np.ones(len(requests), dtype=bool) if shadow else draw.random(len(requests)) < feedback_share
            leaves = np.where(kept, len(columns), exit_index)  # the segment after which each input stops running
            running = (leaves[:, None] >= np.arange(len(columns) + 1)[None, :]).sum(axis=0)
            release_ms, duration_ms = costs.stopping_batch(config.sites, running)
            record = _stopped(record, exits, kept, 1.0 if shadow else feedback_share)
        else:
            times = costs.times(config.sites, len(requests))
            release_ms, duration_ms = times.release_ms, times.duration_ms
        release = np.append(release_ms, duration_ms)[exit_index]
        if controller is not None:
            changed = controller.observe(record)
            if changed is not None:
                pending.append((start_ms + duration_ms + controller.last_decision_ms, changed))
        return BatchOutcome(duration_ms, release)

    queue = run_queue(scenario.arrivals_ms, scenario.max_batch, serve)
    return SystemRun(queue, correct, exit_column, controller, applied)


def _stopped(record: BatchRecord, exits: np.ndarray, kept: np.ndarray, feedback_share: float) -> BatchRecord:
    """What a stop-mode server records of a batch: an input that exited and was not kept has no final label,
    and no outputs at the ramps after its exit."""
    stopped = (exits != NO_EXIT) & ~kept
    after_exit = stopped[:, None] & (np.arange(len(record.sites))[None, :] > exits[:, None])
    return replace(record, labels=np.where(after_exit, NO_LABEL, record.labels),
                   errors=np.where(after_exit, np.nan, record.errors),
                   final=np.where(stopped, NO_LABEL, record.final), feedback_share=feedback_share)


def replay_oracle(scenario: Scenario) -> SystemRun:
    """Every input leaves at the earliest site (any site) whose ramp agrees with the final label; ramps are free."""
    outputs, profile = scenario.outputs, scenario.costs.profile
    exits = earliest_correct_exit(outputs.labels, outputs.final)

    def serve(start_ms: float, requests: np.ndarray) -> BatchOutcome:
        b = len(requests)
        release = np.append(profile.reach(b), profile.full(b))[np.where(exits[requests] == NO_EXIT, -1,
                                                                         exits[requests])]
        return BatchOutcome(profile.full(b), release)

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


def hindsight_configuration(scenario: Scenario, batch_sizes: np.ndarray, budget: float, budget_batch: int,
                            target_accuracy: float) -> tuple[Configuration, int]:
    """The paper's "-opt" baselines: the best fixed ramp set within the ramp budget and its thresholds, tuned
    with the whole evaluation stream in hand. Returns it and how many ramp sets were searched."""
    sites = scenario.costs.sites
    rows = np.arange(len(batch_sizes))
    sets = [s for k in range(1, len(sites) + 1) for s in itertools.combinations(sites, k)
            if fits_budget(scenario.costs, s, budget, budget_batch)]
    best = (-np.inf, Configuration(0, (), ()))
    for chosen in tqdm(sets, desc="static hindsight: ramp sets", unit="set"):
        tuned = tune_greedy(exit_data(scenario, rows, chosen, batch_sizes), target_accuracy)
        if tuned.saved_ms > best[0]:
            best = (tuned.saved_ms, Configuration(0, chosen, tuple(float(t) for t in tuned.thresholds)))
    return best[1], len(sets)


def mean_rate_rps(arrivals_ms: np.ndarray) -> float:
    """Arrivals per second from time 0 to the last one (traces start at 0)."""
    if len(arrivals_ms) == 0 or arrivals_ms[-1] <= 0:
        raise ValueError("a rate needs arrivals that end after time 0")
    return len(arrivals_ms) / float(arrivals_ms[-1]) * 1000.0


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
    return replace(scenario, outputs=outputs.subset(rows), arrivals_ms=scenario.arrivals_ms[rows])


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
        summary |= {
            "tune_ms_mean": float(np.mean(times.tune_ms)) if times.tune_ms else 0.0,
            "tunings": len(times.tune_ms),
            "adjust_ms_mean": float(np.mean(times.adjust_ms)) if times.adjust_ms else 0.0,
            "adjustments": len(times.adjust_ms),
            "configurations": len(run.controller.decisions),
            "mean_active_ramps": _mean_active_ramps(run),
        }
    elif run.applied and run.applied[0][1].sites:
        config = run.applied[0][1]
        summary |= {"sites": list(config.sites), "thresholds": list(config.thresholds)}
    return summary


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


def load_scenario(settings: SimSettings) -> tuple[Scenario, dict]:
    from rampserve.runtime.zoo_bundles import zoo_bundle

    bundle = settings.bundle or zoo_bundle(settings.model, settings.small)
    model = load_bundle(bundle)
    if model.profile is None:
        raise ValueError(f"{bundle} has no latency profile; run `rampserve profile {bundle}`")
    stream = get_stream(settings.workload, length=settings.length, seed=settings.seed)
    evaluation = stream.evaluation
    outputs = ramp_outputs(model, bundle, stream, evaluation.start, evaluation.stop)
    profile = model.profile
    rate = settings.rate_rps or settings.load * 1000.0 / profile.full(1)
    slo = settings.slo_ms or 2.0 * profile.full(1)
    arrivals = arrival_times(settings.trace, len(outputs.final), rate, seed=settings.seed)
    max_batch = max_batch_for_slo(profile.batch_sizes, profile.full_ms, slo)
    scenario = Scenario(outputs, CostModel(profile), arrivals, max_batch)
    info = {"model": settings.model, "workload": settings.workload, "trace": settings.trace,
            "rate_rps": rate, "load": rate * profile.full(1) / 1000.0, "slo_ms": slo, "max_batch": max_batch,
            "requests": len(arrivals), "sites": list(profile.sites), "vanilla_batch1_ms": profile.full(1)}
    return scenario, info


def run_sim(settings: SimSettings, progress: Callable[[str], None] = lambda _: None) -> SimResult:
    scenario, info = load_scenario(settings)
    control = settings.controller
    target = control.target_accuracy
    runs: dict[str, SystemRun] = {}

    progress("vanilla")
    runs["vanilla"] = replay(scenario, Configuration(0, (), ()))
    batch_sizes = runs["vanilla"].queue.batch_sizes[runs["vanilla"].queue.batch_of]
    budget_batch = control.budget_batch_size or int(np.median(batch_sizes))
    progress("oracle")
    runs["oracle"] = replay_oracle(scenario)

    n = len(batch_sizes)
    sample = np.sort(np.random.default_rng(settings.seed).choice(n, int(n * STATIC_SAMPLE), replace=False))
    all_sites = scenario.costs.sites
    sample_data = exit_data(scenario, sample, all_sites, batch_sizes[sample])
    shared = shared_threshold(sample_data, target)
    per_ramp = tune_greedy(sample_data, target).thresholds
    stop = control.stops  # static systems in stop mode stop every exit: they learn nothing from the end

    def static(config: Configuration, scenario_: Scenario = scenario) -> SystemRun:
        return replay(scenario_, config, stop=stop, feedback_share=0.0, seed=settings.seed)

    def managed(settings_: ControllerSettings, scenario_: Scenario = scenario) -> SystemRun:
        controller = Controller(scenario_.costs.profile, settings_)
        return replay(scenario_, controller.configuration(), controller, stop, settings_.kept_share, settings.seed)

    progress("static baselines")
    static_configs = {
        "static_shared": Configuration(0, all_sites, (shared,) * len(all_sites)),
        "static_per_ramp": Configuration(0, all_sites, tuple(float(t) for t in per_ramp))}
    hindsight, searched = hindsight_configuration(scenario, batch_sizes, control.ramp_budget, budget_batch, target)
    static_configs["static_hindsight"] = hindsight
    for name, config in static_configs.items():
        runs[name] = static(config)

    progress("rampserve")
    runs["rampserve"] = managed(control)
    spread = initial_sites(scenario.costs, control.ramp_budget, budget_batch)
    runs["rampserve_no_adjust"] = managed(replace(control, ramp_adjustment=False, initial=spread))
    runs["rampserve_no_tuning"] = managed(replace(control, threshold_tuning=False, start_thresholds=dict(
        zip(all_sites, (float(t) for t in per_ramp)))))
    systems = with_savings({name: summarize(run, settings.worst_window) for name, run in runs.items()})
    systems["static_hindsight"]["ramp_sets_searched"] = searched
    for name, run in runs.items():
        systems[name]["windows_below_share"] = windows_below_share(run.correct, target)
        if run.controller is not None:
            systems[name] |= controller_exit_mode(run.controller.settings)

    # Saturation: the trace replayed faster or slower (its shape kept) on a prefix of the stream, each run with a
    # fresh controller; then vanilla and rampserve at half of vanilla's saturation
    prefix = _prefix(scenario, settings.saturation_requests)
    runners: dict[str, Callable[[Scenario], SystemRun]] = {
        "vanilla": lambda sc: replay(sc, Configuration(0, (), ())), "oracle": replay_oracle,
        **{name: (lambda sc, c=config: static(c, sc)) for name, config in static_configs.items()},
        "rampserve": lambda sc: managed(control, sc),
        "rampserve_no_adjust": lambda sc: managed(replace(control, ramp_adjustment=False, initial=spread), sc),
        "rampserve_no_tuning": lambda sc: managed(replace(control, threshold_tuning=False, start_thresholds=dict(
            zip(all_sites, (float(t) for t in per_ramp)))), sc)}
    capacity = 1000.0 / scenario.costs.profile.full(1)
    for name, run_at in tqdm(runners.items(), desc="saturation", unit="system"):
        systems[name]["saturation_rps"] = trace_saturation(
            lambda arrivals, run=run_at: run(replace(prefix, arrivals_ms=arrivals)), prefix.arrivals_ms,
            info["slo_ms"], capacity)
    half_rate = systems["vanilla"]["saturation_rps"] / 2
    progress(f"vanilla and rampserve at half of vanilla's saturation ({half_rate:.0f} rps)")
    half = replace(scenario, arrivals_ms=scenario.arrivals_ms * (mean_rate_rps(scenario.arrivals_ms) / half_rate))
    at_half = {name: summarize(runners[name](half), settings.worst_window) for name in ("vanilla", "rampserve")}
    at_half = {"rate_rps": half_rate, "systems": at_half,
               "p50_ratio": at_half["rampserve"]["p50_ms"] / at_half["vanilla"]["p50_ms"],
               "p99_ratio": at_half["rampserve"]["p99_ms"] / at_half["vanilla"]["p99_ms"]}

    sweep = {}
    for step in settings.risk_step_sweep:
        if step == control.risk_step:
            sweep[str(step)] = systems["rampserve"]
            continue
        progress(f"rampserve, risk step {step}")
        run = managed(replace(control, risk_step=step))
        sweep[str(step)] = summarize(run, settings.worst_window) | {
            "windows_below_share": windows_below_share(run.correct, target)}
    kept = ("accuracy", "worst_window_accuracy", "windows_below_share", "p50_ms", "p95_ms", "exit_share", "tunings")
    sweep = {w: {k: s[k] for k in kept} | {"p50_savings": 1.0 - s["p50_ms"] / systems["vanilla"]["p50_ms"]}
             for w, s in sweep.items()}
    rampserve = runs["rampserve"].controller
    report = info | {
        "budget_batch_size": budget_batch,
        "controller": {k: v for k, v in vars(control).items() if k != "start_thresholds"},
        "systems": systems,
        "saturation_ratio": systems["rampserve"]["saturation_rps"] / systems["vanilla"]["saturation_rps"],
        "at_half_vanilla_saturation": at_half,
        "risk_step_sweep": sweep,
        "decisions": [d.to_json() for d in rampserve.decisions] if rampserve else [],
    }
    return SimResult(report, runs, scenario)
