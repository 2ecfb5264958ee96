"""`rampserve bench freeze`: Freeze Inference's intermediate caches as managed exits.

Per model, with a k-means cache ramp at every site (bundle `<model>-cache`, built on first use):
- memory per site: k-NN over raw activations, k-NN over reduced ones, and k-means centroids (the paper's
  Table 1), and each lookup's cost against the part of the model an exit there skips, at batch 1 and 16;
- on the drifting stream, Freeze's static thresholds (every site active, each threshold the lowest error score
  that was wrong on validation data) against the rampserve controller managing the same caches, without and
  with online cache updates (the paper's Figures 4/5: where inputs exit, and accuracy against the model);
- how quickly the exit share comes back after each phase shift of the stream, without and with updates;
- a Zipf stream with repeated requests: the exact-match prediction cache, the intermediate caches, and both.

Every system also reports, as `bench sim` does, `saturation_rps` (the highest mean arrival rate of the trace, replayed
faster or slower with its shape kept, whose p99 latency stays within the SLO: `trace_saturation`) and
`windows_below_share` (share of 1,000-request windows whose accuracy is below 1 − the constraint); managed systems
also their `exit_mode` and `feedback_share`.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from rampserve.bench.figures import controller_exit_mode, windows_below_share
from rampserve.bench.ramp_outputs import RampOutputs, ramp_outputs
from rampserve.bench.sim import (
    SATURATION_HIGH, SATURATION_LOW, Scenario, SystemRun, mean_rate_rps, replay, trace_saturation,
)
from rampserve.control.controller import Controller, ControllerSettings
from rampserve.control.costs import CostModel
from rampserve.control.records import BatchRecord, Configuration
from rampserve.ramps.cache import CacheSpec
from rampserve.ramps.exit_rule import first_exits
from rampserve.ramps.oracle import NO_EXIT
from rampserve.runtime.bundle import load_bundle
from rampserve.runtime.latency import serving_limits
from rampserve.runtime.prepare import PrepareConfig
from rampserve.runtime.prepared import PreparedModel
from rampserve.runtime.zoo_bundles import zoo_bundle
from rampserve.workloads.streams import FMNIST_PHASE_LENGTH, get_stream
from rampserve.workloads.traces import arrival_times

# Inputs per batch while caches learn online: what a busy server's batches look like at this model's SLO.
LEARN_BATCH = 16
# Exit share is compared over this many requests before a shift and in a rolling window after it.
SHIFT_WINDOW = 500
RECOVERY_LIMIT = 2000


@dataclass(frozen=True)
class FreezeSettings:
    models: tuple[str, ...] = ("resnet18-fmnist", "resnet50-fmnist")
    workload: str = "fmnist-drift"
    requests: int = 30_000  # evaluation requests replayed per system (ten phase shifts of fmnist-drift)
    load: float = 0.2  # arrival rate as a share of back-to-back batch-1 serving (as bench sim)
    trace: str = "maf"
    cache: CacheSpec = CacheSpec()
    controller: ControllerSettings = ControllerSettings()
    cache_budget: float = 1.0  # ramp budget of the managed systems: every cache may be active, as in Freeze
    zipf_exponent: float = 1.1
    zipf_pool: int = 5000  # distinct inputs the repeated-request stream draws from
    exact_cache_entries: int = 1000
    seed: int = 0
    small: bool = False
    saturation_tolerance: float = 0.02  # relative: saturation rates are searched to within this


def cache_bundle(model: str, spec: CacheSpec, small: bool = False) -> Path:
    """The zoo model with a cache ramp at every site, prepared on first use and kept beside the zoo bundles."""
    return zoo_bundle(model, small, PrepareConfig(ramp_kind="cache", cache=spec), variant="cache")


# ---- memory and lookup cost ---------------------------------------------------------------------------------

def memory_table(model: PreparedModel) -> list[dict]:
    """Per site, bytes of: k-NN over the raw activations of the bootstrap inputs, k-NN over their reduced
    form, and the k-means cache (projection included). k-NN entries also keep an int64 label each."""
    stored = int(model.meta["training"]["num_train"])
    rows = []
    for site in model.sites:
        raw = int(np.prod(site.activation_shape)) * 4
        reduced = site.ramp.cache.dim * 4
        kmeans = model.ramps[site.name].memory_bytes()
        knn_raw, knn_reduced = stored * (raw + 8), stored * (reduced + 8)
        rows.append({"site": site.name, "stored_inputs": stored, "knn_raw_bytes": knn_raw,
                     "knn_reduced_bytes": knn_reduced, "kmeans_bytes": kmeans,
                     "kmeans_share_of_knn_raw": kmeans / knn_raw})
    return rows


def lookup_cost_table(model: PreparedModel, batch_sizes: tuple[int, ...] = (1, 16)) -> list[dict]:
    """Per site and batch size, what the lookup costs on the serving path (from the profile: the lookup timed
    between the model's layers, plus its share of the slowdown of the layers themselves) against the part of
    the model an exit there skips."""
    profile = model.profile
    rows = []
    for b in batch_sizes:
        reach, full = profile.reach(b), profile.full(b)
        for i, site in enumerate(profile.sites):
            skipped = full - float(reach[i])
            lookup = profile.ramp(site, b)
            rows.append({"site": site, "batch_size": b, "lookup_ms": lookup, "skipped_ms": skipped,
                         "lookup_share_of_skipped": lookup / skipped if skipped > 0 else float("inf")})
    return rows


# ---- replaying the stream -----------------------------------------------------------------------------------

def summarize_exits(run: SystemRun, sites: tuple[str, ...], depth: np.ndarray, memory_bytes: int) -> dict:
    """`depth` holds, per site and then for the final layer, the share of the model run before the answer."""
    counts = np.bincount(run.exit_column + 1, minlength=len(sites) + 1)  # NO_EXIT (-1) counts first
    return {
        "accuracy": float(run.correct.mean()),
        "exit_share": float(run.exited.mean()),
        "mean_exit_depth": float(depth[run.exit_column].mean()),
        "memory_bytes": int(memory_bytes),
        "exit_counts": {site: int(c) for site, c in zip((*sites, "final"), (*counts[1:], counts[0]))},
        "p50_ms": float(np.median(run.queue.latency_ms)),
    }


def shift_recovery(exited: np.ndarray, correct: np.ndarray, boundaries: np.ndarray) -> list[dict]:
    """For each phase shift: the exit share over SHIFT_WINDOW requests before it, the lowest rolling exit share
    after it, and how many requests after it the rolling share first came back to within 10% of the level
    before (None: not within RECOVERY_LIMIT), with the accuracy over those requests."""
    rows = []
    for b in boundaries:
        before = float(exited[b - SHIFT_WINDOW:b].mean())
        after = exited[b:b + RECOVERY_LIMIT + SHIFT_WINDOW].astype(np.float64)
        rolling = np.convolve(after, np.ones(SHIFT_WINDOW) / SHIFT_WINDOW, mode="valid")
        back = np.flatnonzero(rolling[:RECOVERY_LIMIT + 1] >= 0.9 * before)
        recovered = int(back[0] + SHIFT_WINDOW) if len(back) else None
        rows.append({"position": int(b), "exit_share_before": before, "lowest_after": float(rolling.min()),
                     "recovered_after": recovered,
                     "accuracy_after": float(correct[b:b + RECOVERY_LIMIT].mean())})
    return rows


def _phase_shifts(start: int, stop: int) -> np.ndarray:
    """Positions (relative to `start`) where the stream changes phase, with room to measure on both sides."""
    first = (start // FMNIST_PHASE_LENGTH + 1) * FMNIST_PHASE_LENGTH
    shifts = np.arange(first, stop, FMNIST_PHASE_LENGTH) - start
    return shifts[(shifts >= SHIFT_WINDOW) & (shifts + RECOVERY_LIMIT + SHIFT_WINDOW <= stop - start)]


@dataclass
class ModelRuns:
    report: dict
    runs: dict[str, SystemRun]
    depth: np.ndarray  # per site, then the final layer: share of the model (batch-1 time) run before an answer
    model: PreparedModel  # as loaded, before any update
    outputs: RampOutputs  # its caches' outputs on the stream, without updates


def freeze_model(name: str, settings: FreezeSettings, progress=lambda _: None) -> ModelRuns:
    bundle = cache_bundle(name, settings.cache, settings.small)
    model = load_bundle(bundle)
    stream = get_stream(settings.workload, seed=settings.seed)
    start = stream.evaluation.start
    stop = min(start + settings.requests, stream.evaluation.stop)
    progress(f"{name}: cache outputs on the stream, without and with online updates")
    plain = ramp_outputs(model, bundle, stream, start, stop)
    learner = load_bundle(bundle)
    learned = ramp_outputs(learner, bundle, stream, start, stop, learn_batch=LEARN_BATCH)
    profile = model.profile
    costs = CostModel(profile)
    rate = settings.load * 1000.0 / profile.full(1)
    slo, max_batch = serving_limits(profile)
    arrivals = arrival_times(settings.trace, stop - start, rate, seed=settings.seed)
    # Indexed by a run's exit column: NO_EXIT (-1) picks the final layer's 1.0.
    depth = np.append(profile.reach(1) / profile.full(1), 1.0)
    all_sites = profile.sites
    static = Configuration(0, all_sites, tuple(float(model.meta["static_thresholds"][s]) for s in all_sites))
    # Managed like any ramp: thresholds tuned and caches (de)activated by utility, starting from every site with
    # a budget that lets every cache be active, as in Freeze; then the same thresholds-only, and the default
    # ramp budget.
    default = settings.controller.resolved(max_batch)  # the exit mode a server would serve this model in
    managed = replace(default, initial=all_sites, ramp_budget=settings.cache_budget)
    memory = sum(model.memory_bytes().values())
    # Each system: its stream outputs (without or with online updates), start, and controller settings.
    plan = {
        "static": (plain, static, None),
        "static_online": (learned, static, None),
        "managed": (plain, None, managed),
        "managed_online": (learned, None, managed),
        "managed_thresholds_only": (plain, None, replace(managed, ramp_adjustment=False)),
        "managed_default_budget": (learned, None, default),
    }
    plan["vanilla"] = (plain, Configuration(0, (), ()), None)
    capacity = 1000.0 * max_batch / profile.full(max_batch)  # vanilla's largest batch, back to back
    min_accuracy = default.target_accuracy

    def serve(outputs: RampOutputs, config: Configuration | None, control: ControllerSettings | None,
              arrivals_ms: np.ndarray) -> SystemRun:
        controller = Controller(profile, control) if control is not None else None
        start_config = config if config is not None else controller.configuration()
        mode = control or default  # static systems stop every exit in stop mode (no feedback)
        return replay(Scenario(outputs, costs, arrivals_ms, max_batch), start_config, controller, mode.stops,
                      mode.kept_share if control is not None else 0.0, settings.seed)

    systems, runs = {}, {}
    for system, (outputs, config, control) in plan.items():
        progress(f"{name}: {system}")
        runs[system] = serve(outputs, config, control, arrivals)
        systems[system] = summarize_exits(runs[system], all_sites, depth, 0 if system == "vanilla" else memory)
        systems[system]["windows_below_share"] = windows_below_share(runs[system].correct, min_accuracy)
        progress(f"{name}: {system}, saturation")
        systems[system]["saturation_rps"] = trace_saturation(
            lambda a, o=outputs, c=config, s=control: serve(o, c, s, a), arrivals, slo, capacity,
            settings.saturation_tolerance)
        if control is not None:
            systems[system] |= controller_exit_mode(control)
    shifts = _phase_shifts(start, stop)
    recovery = {system: shift_recovery(runs[system].exited, runs[system].correct, shifts)
                for system in ("static", "static_online", "managed", "managed_online")}
    memory_after = sum(learner.memory_bytes().values())
    report = {
        "bundle": str(bundle), "sites": list(all_sites), "requests": stop - start, "rate_rps": rate,
        "slo_ms": slo, "max_batch": max_batch, "cache": settings.cache.to_json(),
        "static_thresholds": model.meta["static_thresholds"],
        "val_agreement": {s.name: s.val_accuracy for s in model.sites},
        "memory": memory_table(model),
        "memory_bytes_before_updates": memory, "memory_bytes_after_updates": memory_after,
        "lookup_cost": lookup_cost_table(model),
        "saturation": {"capacity_rps": capacity, "searched_rps": [SATURATION_LOW * capacity,
                                                                  SATURATION_HIGH * capacity],
                       "tolerance": settings.saturation_tolerance, "trace_rate_rps": mean_rate_rps(arrivals),
                       "definition": "highest mean arrival rate of the trace (scaled in time) whose p99 <= SLO"},
        "systems": systems,
        "shift_recovery": {system: {"shifts": rows, "recovered": sum(r["recovered_after"] is not None for r in rows),
                                    "median_recovered_after": _median_or_none([r["recovered_after"] for r in rows])}
                           for system, rows in recovery.items()},
    }
    return ModelRuns(report, runs, depth, model, plain)


def _median_or_none(values: list) -> float | None:
    known = [v for v in values if v is not None]
    return float(np.median(known)) if known else None


# ---- repeated requests --------------------------------------------------------------------------------------

def repeated_requests(model: PreparedModel, outputs: RampOutputs, settings: FreezeSettings) -> dict:
    """A Zipf stream over `zipf_pool` distinct inputs: requests for the same input are byte-identical. Compares
    the exact-match prediction cache (LRU, `exact_cache_entries`), the intermediate caches (Freeze's static
    thresholds, every site), and both (exact match first). Hits answer before the model; a cache-ramp exit
    answers at its site's depth."""
    n = len(outputs.final)
    rng = np.random.default_rng(settings.seed)
    pool = min(settings.zipf_pool, n)  # a short run has fewer distinct inputs than the pool
    ranks = rng.zipf(settings.zipf_exponent, size=n)
    ranks = ranks[ranks <= pool] - 1
    items = rng.permutation(pool)[ranks]  # rows of `outputs`
    sites = tuple(model.site_names)
    thresholds = np.array([float(model.meta["static_thresholds"][s]) for s in sites])
    columns = outputs.columns(sites)
    errors = outputs.errors[items][:, columns]
    exits = first_exits(errors, thresholds)
    ramp_correct = BatchRecord(0, sites, outputs.labels[items][:, columns], errors, outputs.final[items], exits).correct()
    reach = np.append(model.profile.reach(1), model.profile.full(1)) / model.profile.full(1)
    ramp_depth = reach[exits]  # NO_EXIT (-1) picks the whole model
    lru: OrderedDict[int, None] = OrderedDict()
    exact_hit = np.zeros(len(items), dtype=bool)
    for i, item in enumerate(items):
        if item in lru:
            exact_hit[i] = True
            lru.move_to_end(item)
        else:
            lru[item] = None
            if len(lru) > settings.exact_cache_entries:
                lru.popitem(last=False)

    def summary(answered_early: np.ndarray, depth: np.ndarray, correct: np.ndarray) -> dict:
        return {"answered_before_final": float(answered_early.mean()), "mean_depth": float(depth.mean()),
                "accuracy": float(correct.mean())}

    ramp_exit = exits != NO_EXIT
    return {
        "requests": int(len(items)), "distinct": int(len(np.unique(items))),
        "exact_cache_entries": settings.exact_cache_entries, "zipf_exponent": settings.zipf_exponent,
        "exact": summary(exact_hit, np.where(exact_hit, 0.0, 1.0), np.ones(len(items), dtype=bool)),
        "intermediate": summary(ramp_exit, ramp_depth, ramp_correct),
        "both": summary(exact_hit | ramp_exit, np.where(exact_hit, 0.0, ramp_depth), exact_hit | ramp_correct),
    }


def run_freeze(settings: FreezeSettings, progress=lambda _: None) -> tuple[dict, dict[str, ModelRuns]]:
    models = {name: freeze_model(name, settings, progress) for name in settings.models}
    first = settings.models[0]
    report = {
        "workload": settings.workload, "trace": settings.trace, "load": settings.load,
        "accuracy_constraint": settings.controller.accuracy_constraint,
        "ramp_budget": settings.controller.ramp_budget,
        "models": {name: runs.report for name, runs in models.items()},
        "repeated_requests": {"model": first} | repeated_requests(models[first].model, models[first].outputs,
                                                                  settings),
    }
    return report, models
