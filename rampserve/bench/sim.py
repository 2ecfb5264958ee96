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

from rampserve.bench.queueing import BatchOutcome, QueueResult, run_queue
from rampserve.bench.ramp_outputs import RampOutputs, ramp_outputs
from rampserve.control.controller import Controller, ControllerSettings
from rampserve.control.costs import CostModel
from rampserve.control.ramps import fits_budget
from rampserve.control.records import NO_EXIT, BatchRecord, Configuration
from rampserve.control.thresholds import ExitData, evaluate, tune_greedy
from rampserve.ramps.oracle import earliest_correct_exit
from rampserve.runtime.bundle import load_bundle
from rampserve.runtime.profile import max_batch_for_slo
from rampserve.workloads.streams import get_stream
from rampserve.workloads.traces import arrival_times

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
    window_sweep: tuple[int, ...] = (16, 64, 256)
    worst_window: int = 1000
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


def replay(scenario: Scenario, start: Configuration, controller: Controller | None = None) -> SystemRun:
    """Serve the scenario with a fixed configuration, or with one the controller keeps changing."""
    outputs, costs = scenario.outputs, scenario.costs
    n = len(scenario.arrivals_ms)
    correct = np.ones(n, dtype=bool)
    exit_column = np.full(n, NO_EXIT, dtype=np.int64)
    pending: deque[tuple[float, Configuration]] = deque()
    applied = [(0.0, start)]
    current = {"config": start, "columns": np.array(outputs.columns(start.sites), dtype=np.int64)}

    def serve(start_ms: float, requests: np.ndarray) -> BatchOutcome:
        while pending and pending[0][0] <= start_ms:
            when, config = pending.popleft()
            current.update(config=config, columns=np.array(outputs.columns(config.sites), dtype=np.int64))
            applied.append((when, config))
        config, columns = current["config"], current["columns"]
        times = costs.times(config.sites, len(requests))
        labels = outputs.labels[requests][:, columns]
        errors = outputs.errors[requests][:, columns]
        exits = config.exits(errors)
        record = BatchRecord(config.version, config.sites, labels, errors, outputs.final[requests], exits)
        correct[requests] = record.correct()
        if len(columns):  # NO_EXIT indexes the last column, masked out
            exit_column[requests] = np.where(exits == NO_EXIT, NO_EXIT, columns[exits])
        release = np.append(times.release_ms, times.duration_ms)[np.where(exits == NO_EXIT, len(columns), exits)]
        if controller is not None:
            changed = controller.observe(record)
            if changed is not None:
                pending.append((start_ms + times.duration_ms + controller.last_decision_ms, changed))
        return BatchOutcome(times.duration_ms, release)

    queue = run_queue(scenario.arrivals_ms, scenario.max_batch, serve)
    return SystemRun(queue, correct, exit_column, controller, applied)


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
    progress("static baselines")
    runs["static_shared"] = replay(scenario, Configuration(0, all_sites, (shared,) * len(all_sites)))
    runs["static_per_ramp"] = replay(scenario, Configuration(0, all_sites, tuple(float(t) for t in per_ramp)))
    hindsight, searched = hindsight_configuration(scenario, batch_sizes, control.ramp_budget, budget_batch, target)
    runs["static_hindsight"] = replay(scenario, hindsight)

    def managed(settings_: ControllerSettings) -> SystemRun:
        controller = Controller(scenario.costs.profile, settings_)
        return replay(scenario, controller.configuration(), controller)

    progress("rampserve")
    runs["rampserve"] = managed(control)
    runs["rampserve_no_adjust"] = managed(replace(control, ramp_adjustment=False))
    runs["rampserve_no_tuning"] = managed(replace(control, threshold_tuning=False, start_thresholds=dict(
        zip(all_sites, (float(t) for t in per_ramp)))))
    systems = with_savings({name: summarize(run, settings.worst_window) for name, run in runs.items()})
    systems["static_hindsight"]["ramp_sets_searched"] = searched

    sweep = {}
    for window in settings.window_sweep:
        if window == control.window:
            sweep[str(window)] = systems["rampserve"]
            continue
        progress(f"rampserve, window {window}")
        sweep[str(window)] = summarize(managed(replace(control, window=window)), settings.worst_window)
    sweep = {w: {k: s[k] for k in ("accuracy", "worst_window_accuracy", "p50_ms", "p95_ms", "exit_share",
                                   "tunings")} | {"p50_savings": 1.0 - s["p50_ms"] / systems["vanilla"]["p50_ms"]}
             for w, s in sweep.items()}
    rampserve = runs["rampserve"].controller
    report = info | {
        "budget_batch_size": budget_batch,
        "controller": {k: v for k, v in vars(control).items() if k != "start_thresholds"},
        "systems": systems,
        "window_sweep": sweep,
        "decisions": [d.to_json() for d in rampserve.decisions] if rampserve else [],
    }
    return SimResult(report, runs, scenario)
