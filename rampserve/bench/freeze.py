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
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from rampserve.bench.figures import ACCURACY_WINDOW, controller_exit_mode, windows_below_share
from rampserve.bench.load import DEFAULT_LOAD
from rampserve.bench.ramp_outputs import RampOutputs, ramp_outputs
from rampserve.bench.sim import (
    SATURATION_HIGH,
    SATURATION_LOW,
    Scenario,
    SimSettings,
    SystemRun,
    load_scenario,
    mean_rate_rps,
    python_ramps,
    replay,
    replay_oracle,
    summarize,
    trace_saturation,
)
from rampserve.bundle_format.latency import serving_limits
from rampserve.bundle_format.manifest import read_manifest
from rampserve.control.controller import Controller, ControllerSettings
from rampserve.control.costs import CostModel
from rampserve.control.exit_rule import first_exits
from rampserve.control.records import BatchRecord, Configuration
from rampserve.ramps.cache import CacheRamp
from rampserve.ramps.oracle import NO_EXIT, answerable_share
from rampserve.ramps.specs import CacheSpec
from rampserve.runtime.bundle import load_bundle
from rampserve.runtime.prepare import PrepareConfig, default_workload, feeds_for, prepared_encoder
from rampserve.runtime.prepared import PreparedModel
from rampserve.runtime.sources import ModelSource
from rampserve.runtime.timing import interleaved_samples
from rampserve.runtime.torch_backend import site_activations
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


def cache_bundle(model: str, spec: CacheSpec, small: bool = False, kind: str = "cache") -> Path:
    """The zoo model with a cache ramp at every site (`kind` "mixed": per site a cache or the model's own kind of
    ramp), prepared on first use and kept beside the zoo bundles, on the engine the zoo bundle serves on (the
    fastest here): caches are judged where the model runs fastest."""
    engine = read_manifest(zoo_bundle(model, small))["meta"]["engine"]["engine"]
    return zoo_bundle(model, small, PrepareConfig(ramp_kind=kind, cache=spec, engine=engine), variant=kind)


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
        return replay(Scenario(outputs, costs, arrivals_ms, max_batch, **python_ramps(model)), start_config,
                      controller, mode.stops, mode.kept_share if control is not None else 0.0, settings.seed)

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


# ---- caches beside ramps on one model -----------------------------------------------------------------------

# Disagreement with the model that a site's own oracle may spend (`oracle.answerable_share`): the default constraint
ORACLE_DISAGREEMENT = 0.01
LOOKUP_INPUTS = 8  # distinct batch-1 inputs a lookup is timed on, in turn


@dataclass(frozen=True)
class ExitKindsSettings:
    model: str = "lite0-fmnist"
    seeds: int = 3
    length: int = 120_000  # stream items per seed, bootstrap included (as `bench sim`)
    load: float = DEFAULT_LOAD
    trace: str = "maf"
    cache: CacheSpec = CacheSpec()
    controller: ControllerSettings = ControllerSettings()
    lookup_rounds: int = 200
    # Also a prepared "mixed" bundle (per site whichever of a cache and the model's own ramp answers more,
    # `prepare.train_site_ramps`): one more preparation, which on minilm-rt kept the ramp at every site
    mixed_bundle: bool = True
    small: bool = False


def exit_kind_bundles(settings: ExitKindsSettings) -> dict[str, Path]:
    """The bundles compared, each managed by the controller: the zoo model's own ramps, a cache at every site and,
    with `mixed_bundle`, the prepared mixed one."""
    bundles = {"ramps": zoo_bundle(settings.model, settings.small),
               "caches": cache_bundle(settings.model, settings.cache, settings.small)}
    if settings.mixed_bundle:
        bundles["mixed"] = cache_bundle(settings.model, settings.cache, settings.small, kind="mixed")
    return bundles


def lookup_times(model: PreparedModel, feeds: list[dict[str, np.ndarray]], rounds: int) -> dict[str, float]:
    """Per cache site, the median milliseconds of one lookup at batch 1 on the site's own activation (pooling,
    projection, nearest centroid and its score: what the releasing thread computes for a batch of one), timed
    interleaved over sites and rounds, on `feeds` (batch-1 inputs) in turn."""
    sites = [s for s, ramp in model.ramps.items() if isinstance(ramp, CacheRamp)]
    activations = [found for found, _ in site_activations(model.backend, feeds, sites)]
    turn = {s: 0 for s in sites}

    def lookup(site: str) -> Callable[[], object]:
        def run() -> object:
            turn[site] += 1
            return model.evaluate_ramp(site, activations[turn[site] % len(activations)][site])
        return run

    with torch.inference_mode():
        samples = interleaved_samples({s: lookup(s) for s in sites}, rounds, block=4, desc="cache lookups")
    return {s: float(np.median(v)) for s, v in samples.items()}


def site_table(caches: Scenario, ramps: Scenario, lookup_ms: dict[str, float]) -> list[dict]:
    """Per site: what the cache costs (its lookup timed alone, and what the profile charges it on the serving path,
    at batch 1) against the model's time and the part of it an exit there skips, the share of the stream the
    cache can answer at ORACLE_DISAGREEMENT (its own oracle) beside the model's own ramp there, and the share it
    would have to answer to repay its charge to inputs that do not exit (charged / skipped)."""
    profile = caches.costs.profile
    full, reach = profile.full(1), profile.reach(1)
    ramp_profile = ramps.costs.profile
    rows = []
    for i, site in enumerate(profile.sites):
        charged, skipped = profile.ramp(site, 1), full - float(reach[i])
        answerable = {}
        for kind, scenario in (("cache", caches), ("ramp", ramps)):
            outputs = scenario.outputs
            column = outputs.columns((site,))[0]
            answerable[kind] = answerable_share(outputs.errors[:, column], outputs.labels[:, column] == outputs.final,
                                                ORACLE_DISAGREEMENT)
        rows.append({"site": site, "model_ms": full, "lookup_ms": lookup_ms.get(site), "charged_ms": charged,
                     "charged_share_of_model": charged / full, "ramp_charged_ms": ramp_profile.ramp(site, 1),
                     "skipped_share_of_model": skipped / full,
                     "cache_answerable": answerable["cache"], "ramp_answerable": answerable["ramp"],
                     "break_even_share": charged / skipped if skipped > 0 else None})
    return rows


def _managed(scenario: Scenario, control: ControllerSettings, seed: int) -> SystemRun:
    controller = Controller(scenario.costs.profile, control)
    return replay(scenario, controller.configuration(), controller, control.stops, control.kept_share, seed)


def _summary(run: SystemRun, vanilla: dict, target: float) -> dict:
    """`bench sim`'s summary of a run, its p50/p99 against the vanilla model timed with the same profile, and the
    sites active at the end."""
    summary = summarize(run, ACCURACY_WINDOW) | {"windows_below_share": windows_below_share(run.correct, target)}
    summary |= {f"{q}_ratio": summary[f"{q}_ms"] / vanilla[f"{q}_ms"] for q in ("p50", "p99")}
    if run.applied:
        summary["final_sites"] = list(run.applied[-1][1].sites)
    return summary


def at_same_load(scenario: Scenario, ramps: Scenario) -> Scenario:
    """`scenario` serving the ramps' requests in the same order, at the same load of its own model (its arrivals
    stretched by the ratio of the two profiles' batch-1 times) and in batches of at most the same size. Each bundle
    is profiled when it is prepared, and on a shared machine its vanilla comes out slower or faster (minilm-rt's
    three: 23, 54 and 38 ms at batch 1 under loads of 7-13 on 2 cores): at the same arrival times a slower profile
    would queue more, and each system is judged against its own vanilla."""
    stretch = scenario.costs.profile.full(1) / ramps.costs.profile.full(1)
    return replace(scenario, arrivals_ms=ramps.arrivals_ms * stretch, max_batch=ramps.max_batch, lengths=ramps.lengths)


def at_ramp_cost(caches: Scenario, ramps: Scenario) -> Scenario:
    """What-if, not measured: the caches charged what the model's own ramp at each site is charged and stopping
    inputs as it does: caches fused into the serving path as ramps are (`ramps.onnx_fused`), their lookup free.
    What they could save if they cost no more than a ramp."""
    profile, own = caches.costs.profile, ramps.costs.profile
    if profile.batch_sizes != own.batch_sizes or profile.sites != own.sites:
        raise ValueError("the cache and ramp bundles were profiled at other batch sizes or sites")
    profile = replace(profile, ramp_ms={s: own.ramp_ms[s] for s in profile.sites})
    return replace(caches, costs=CostModel(profile), python_ramps=frozenset())


CACHE_SITE = "{site}+cache"  # a cache's place beside the model's own ramp in `ramps_and_caches`


def ramps_and_caches(ramps: Scenario, caches: Scenario) -> Scenario:
    """Both kinds at every site, for the controller to choose among: the model's own ramp, then the cache as a
    site of its own (`CACHE_SITE`) reached with it, charged its share of the model as its own bundle's profile
    measured it (a set with a cache is cut into stages on ONNX Runtime: that profile's charge includes the cut).
    The two charges come from two profiles; a prepared "mixed" bundle measures one ramp per site together."""
    own, cache = ramps.costs.profile, caches.costs.profile
    if own.batch_sizes != cache.batch_sizes or own.sites != cache.sites:
        raise ValueError("the cache and ramp bundles were profiled at other batch sizes or sites")
    beside = {site: CACHE_SITE.format(site=site) for site in own.sites}
    scale = np.array(own.full_ms) / np.array(cache.full_ms)
    profile = replace(own, sites=tuple(x for site in own.sites for x in (site, beside[site])),
                      segment_ms=own.segment_ms | {b: (0.0,) * len(own.batch_sizes) for b in beside.values()},
                      ramp_ms=own.ramp_ms | {b: tuple(float(v) for v in np.array(cache.ramp_ms[site]) * scale)
                                             for site, b in beside.items()})
    columns = np.arange(2 * len(own.sites)).reshape(2, -1).T.ravel()  # ramp, cache, ramp, cache...
    ramp_out, cache_out = ramps.outputs, caches.outputs

    def paired(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return np.concatenate([a[:, ramp_out.columns(own.sites)], b[:, cache_out.columns(own.sites)]], axis=1)[
            :, columns]

    # the ramps' model answers: where the two bundles' runs differ in the last float, the ramps' is the truth
    outputs = RampOutputs(profile.sites, paired(ramp_out.labels, cache_out.labels),
                          paired(ramp_out.errors, cache_out.errors), ramp_out.final)
    return replace(ramps, outputs=outputs, costs=CostModel(profile),
                   python_ramps=ramps.python_ramps | frozenset(beside.values()),
                   python_sets_stop=caches.python_sets_stop)


def exit_kinds_seed(settings: ExitKindsSettings, bundles: dict[str, Path], seed: int) -> tuple[dict, dict]:
    """One seed: each bundle's ramp outputs on the stream, the same arrivals replayed through vanilla, the oracle
    and the managed controller per kind. Returns the seed's report and its scenarios."""
    base = SimSettings(model=settings.model, workload=default_workload(ModelSource.parse(settings.model)),
                       trace=settings.trace, load=settings.load, length=settings.length, seed=seed,
                       controller=settings.controller, saturation=False, small=settings.small)
    ramps, info = load_scenario(replace(base, bundle=bundles["ramps"]))
    scenarios = {kind: ramps if kind == "ramps" else at_same_load(load_scenario(replace(base, bundle=path))[0], ramps)
                 for kind, path in bundles.items()}
    scenarios["caches_at_ramp_cost"] = at_ramp_cost(scenarios["caches"], ramps)
    scenarios["ramps_and_caches"] = ramps_and_caches(ramps, scenarios["caches"])
    control = settings.controller.resolved(info["max_batch"])
    target = control.target_accuracy
    systems, vanillas = {}, {}
    for kind, scenario in scenarios.items():
        vanillas[kind] = summarize(replay(scenario, Configuration(0, (), ())), ACCURACY_WINDOW)
    systems["vanilla"] = _summary(replay(ramps, Configuration(0, (), ())), vanillas["ramps"], target)
    every = replace(control, initial=scenarios["caches"].costs.sites, ramp_budget=1.0)
    plan = {"ramps": ("ramps", control), "caches": ("caches", control), "caches_every_site": ("caches", every),
            "ramps_and_caches": ("ramps_and_caches", control),
            "caches_at_ramp_cost": ("caches_at_ramp_cost", control)}
    if "mixed" in scenarios:
        plan["mixed"] = ("mixed", control)
    for name, (kind, control_) in tqdm(plan.items(), desc=f"seed {seed}: managed systems", unit="system"):
        systems[name] = _summary(_managed(scenarios[kind], control_, seed), vanillas[kind], target)
        systems[name] |= controller_exit_mode(control_)
    for kind in ("ramps", "caches"):  # every input at the earliest site that agrees, exits free: the bound
        systems[f"{kind}_oracle"] = _summary(replay_oracle(scenarios[kind]), vanillas[kind], target)
    report = info | {"seed": seed, "exit_mode": control.exit_mode, "systems": systems,
                     "vanilla_p50_ms": {kind: v["p50_ms"] for kind, v in vanillas.items()},
                     "vanilla_batch1_ms": {kind: sc.costs.profile.full(1) for kind, sc in scenarios.items()}}
    return report, scenarios


# Figures summed up over seeds, as `bench sim` sums its (`seed_summary`)
KIND_FIGURES = ("accuracy", "windows_below_share", "p50_ratio", "p99_ratio", "exit_share", "mean_active_ramps")


def seeds_summary(per_seed: list[dict]) -> dict[str, dict[str, dict]]:
    """Per system and figure of KIND_FIGURES: the median over seeds, the lowest and the highest."""
    summary: dict[str, dict[str, dict]] = {}
    for name in per_seed[0]["systems"]:
        summary[name] = {}
        for figure in KIND_FIGURES:
            values = [r["systems"][name][figure] for r in per_seed if r["systems"][name].get(figure) is not None]
            if values:
                summary[name][figure] = {"median": float(np.median(values)), "min": float(min(values)),
                                         "max": float(max(values)), "seeds": len(values)}
    return summary


def run_exit_kinds(settings: ExitKindsSettings, progress: Callable[[str], None] = lambda _: None) -> dict:
    """`bench freeze --model`: caches, mixed caches and ramps, and ramps alone, each managed, against vanilla on the
    model's drifting stream over `settings.seeds` seeds; per site what a cache costs and answers."""
    progress(f"{settings.model}: bundles (prepared on first use)")
    bundles = exit_kind_bundles(settings)
    per_seed, tables = [], []
    for seed in range(settings.seeds):
        progress(f"{settings.model}: seed {seed}")
        report, scenarios = exit_kinds_seed(settings, bundles, seed)
        per_seed.append(report)
        if seed == 0:
            progress(f"{settings.model}: cache lookups at batch 1")
            caches = load_bundle(bundles["caches"])
            stream = get_stream(report["workload"], length=settings.length, seed=0)
            start = stream.evaluation.start
            encoder = prepared_encoder(caches, stream.task)
            feeds = [feeds_for(caches.backend, encoder, stream.items(start + i, start + i + 1))
                     for i in range(LOOKUP_INPUTS)]
            lookups = lookup_times(caches, feeds, settings.lookup_rounds)
        tables.append(site_table(scenarios["caches"], scenarios["ramps"], lookups))
    sites = [dict(row, cache_answerable=[t[i]["cache_answerable"] for t in tables],
                  ramp_answerable=[t[i]["ramp_answerable"] for t in tables]) for i, row in enumerate(tables[0])]
    manifests = {kind: read_manifest(path) for kind, path in bundles.items()}
    return {
        "model": settings.model, "workload": per_seed[0]["workload"], "trace": settings.trace, "load": settings.load,
        "length": settings.length, "seeds": settings.seeds, "cache": settings.cache.to_json(),
        "oracle_disagreement": ORACLE_DISAGREEMENT,
        "engine": manifests["ramps"]["meta"]["engine"]["engine"],
        "bundles": {kind: str(path) for kind, path in bundles.items()},
        "mixed_sites": {site["name"]: site["ramp"]["kind"] for site in manifests.get("mixed", {"sites": []})["sites"]},
        "sites": sites,
        "summary": seeds_summary(per_seed),
        "per_seed": per_seed,
        "simulated": "ramp outputs computed on the stream; latency charged from each bundle's measured profile "
                     "(bench sim's replay); lookups timed here",
    }


def exit_kinds_tables(report: dict) -> list:
    """`run_exit_kinds`' report as rich tables: the systems over seeds, then the sites."""
    from rich.table import Table

    def cell(figure: dict | None, spec: str) -> str:
        if figure is None:
            return "-"
        return f"{figure['median']:{spec}} ({figure['min']:{spec}}–{figure['max']:{spec}})"

    seeds = report["seeds"]
    systems = Table(title=f"{report['model']} on {report['workload']} ({report['engine']}), load {report['load']}, "
                          f"{report['trace']} trace: median (min–max) over {seeds} seeds")
    for col in ("system", "p50 × vanilla", "p99 × vanilla", "accuracy", "1k windows < target", "exit share",
                "active exits"):
        systems.add_column(col, justify="right")
    for name, s in report["summary"].items():
        systems.add_row(name, cell(s.get("p50_ratio"), ".3f"), cell(s.get("p99_ratio"), ".3f"),
                        cell(s.get("accuracy"), ".4f"), cell(s.get("windows_below_share"), ".3f"),
                        cell(s.get("exit_share"), ".3f"), cell(s.get("mean_active_ramps"), ".1f"))
    sites = Table(title=f"{report['model']}: per site at batch 1 (shares of the stream at "
                        f"{report['oracle_disagreement']:.0%} disagreement: median of seeds)")
    for col in ("site", "lookup µs", "charged µs", "charged / model", "ramp charged µs", "skipped / model",
                "cache answers", "ramp answers", "break-even share", "mixed keeps"):
        sites.add_column(col, justify="right")
    for row in report["sites"]:
        lookup = "-" if row["lookup_ms"] is None else f"{row['lookup_ms'] * 1000:.0f}"
        even = "-" if row["break_even_share"] is None else f"{row['break_even_share']:.3f}"
        sites.add_row(row["site"], lookup, f"{row['charged_ms'] * 1000:.0f}", f"{row['charged_share_of_model']:.2%}",
                      f"{row['ramp_charged_ms'] * 1000:.0f}", f"{row['skipped_share_of_model']:.2f}",
                      f"{np.median(row['cache_answerable']):.3f}", f"{np.median(row['ramp_answerable']):.3f}", even,
                      report["mixed_sites"].get(row["site"], "-"))
    return [systems, sites]
