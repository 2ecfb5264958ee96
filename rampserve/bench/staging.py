"""`rampserve bench staging`: what staged execution costs against running the whole model.

With no active ramp the executor must run the model as one piece, at the original model's speed. The same
run also reports, for information, the cost of cutting at every site (without ramps): the price of the
finest split the controller could ever ask for. `ramp_cases` measure what active ramps cost on the serving path
(the executor's path, compiled where the model compiles): 1, 4 and every ramp active against none, as a
share of the model's time per ramp.
"""

from __future__ import annotations

import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from rampserve.runtime.backends import Backend
from rampserve.runtime.bundle import load_bundle
from rampserve.runtime.engines import (
    AS_USERS_RUN_IT,
    CHOSEN_BY_USER,
    ENGINES,
    EngineChoice,
    choose_engine,
    engine_backends,
    engine_of,
    time_engines,
)
from rampserve.runtime.prepare import bootstrap_inputs, default_workload, feeds_for
from rampserve.runtime.prepared import PreparedModel, SiteInfo
from rampserve.runtime.profile import serving_path
from rampserve.runtime.sources import ModelSource, load_trained
from rampserve.runtime.timing import interleaved_medians, interleaved_samples, paired_difference
from rampserve.runtime.torch_backend import TorchBackend, site_activations
from rampserve.runtime.zoo_bundles import zoo_bundle


@dataclass(frozen=True)
class StagingCase:
    backend: str
    batch_size: int
    cuts: str  # "none" (no active ramp) or "all" (cut at every site)
    whole_ms: float
    staged_ms: float
    ratio: float  # staged over whole, medians of interleaved runs


def _run_stages(backend: Backend, feeds: dict[str, np.ndarray], cuts: tuple[str, ...]) -> None:
    for _ in backend.stage_outputs(feeds, cuts):
        pass


def measure_backend(backend: Backend, feeds: dict[str, np.ndarray], rounds: int) -> list[StagingCase]:
    batch_size = len(next(iter(feeds.values())))
    native = backend.native_feeds(feeds)
    all_sites = tuple(s.value for s in backend.sites)
    with torch.inference_mode():
        medians = interleaved_medians(
            {
                "whole": lambda: backend.split.full(native),
                "none": lambda: _run_stages(backend, feeds, ()),
                "all": lambda: _run_stages(backend, feeds, all_sites),
            },
            rounds=rounds,
            desc=f"{backend.kind} batch {batch_size}",
        )
    return [
        StagingCase(backend.kind, batch_size, cuts, medians["whole"], medians[cuts], medians[cuts] / medians["whole"])
        for cuts in ("none", "all")
    ]


# Runs of one set in a row in its turn, after an untimed one (see `interleaved_samples`)
RAMP_BLOCK = 5


@dataclass(frozen=True)
class RampCase:
    model: str
    backend: str
    batch_size: int
    active: int  # ramps active
    sites: tuple[str, ...]
    none_ms: float  # the serving path with no ramp, median of interleaved runs
    ramps_ms: float  # the same with these ramps active (at threshold 0: no input exits)
    marginal_share: float  # (ramps_ms - none_ms) / (active * none_ms)
    # 95% interval of the marginal share, from the rounds' paired differences: how far the machine's noise
    # leaves the figure uncertain
    marginal_share_ci95: tuple[float, float]
    # on ONNX: "one session" (the model whole, ramps signalling from inside the run: what is served) or "stages"
    # (a session call per active site); on torch: "torchscript"
    path: str = "torchscript"


def _spread(sites: list[str], count: int) -> tuple[str, ...]:
    """`count` sites spread evenly over the model (every site where count is all of them)."""
    if count >= len(sites):
        return tuple(sites)
    return tuple(sites[round(i * (len(sites) - 1) / max(1, count - 1))] for i in range(count)) if count > 1 \
        else (sites[len(sites) // 2],)


def measure_ramps(name: str, model: PreparedModel, feeds: dict[str, np.ndarray], example: dict[str, np.ndarray],
                  rounds: int) -> list[RampCase]:
    """Serving-path time with 1, 4 and every ramp active against none (no input exiting), interleaved, on the
    compiled path where the model compiles (else the eager one, as the server runs it); on ONNX also with the
    model cut into a session per active site, for reference."""
    sites = model.site_names
    batch_size = len(next(iter(feeds.values())))
    sets = {count: _spread(sites, count) for count in sorted({1, min(4, len(sites)), len(sites)})}
    paths = {"one session": True, "stages": False} if model.backend.kind == "onnx" else {"torchscript": True}
    runs = {f"{path}:{count}": serving_path(model, active, model.build_compiled(active, example, signals=signals)
                                            or False, feeds)
            for path, signals in paths.items() for count, active in sets.items()}
    runs["none:0"] = serving_path(model, (), model.build_compiled((), example) or False, feeds)
    with torch.inference_mode():  # as the executor runs
        samples = interleaved_samples(runs, rounds=rounds, desc=f"{model.backend.kind} ramps batch {batch_size}",
                                      block=RAMP_BLOCK)
    none = float(np.median(samples["none:0"]))
    cases = []
    for path in paths:
        for count, active in sets.items():
            _, low, high = paired_difference(samples[f"{path}:{count}"], samples["none:0"])
            ramps_ms = float(np.median(samples[f"{path}:{count}"]))
            cases.append(RampCase(name, model.backend.kind, batch_size, count, active, none, ramps_ms,
                                  (ramps_ms - none) / (count * none), (low / (count * none), high / (count * none)),
                                  path))
    return cases


def engine_twin(prepared: PreparedModel, backend: Backend, example: dict[str, np.ndarray]) -> PreparedModel:
    """`prepared`'s ramps on `backend`, the same model on another engine (its ONNX export, or the torch module an
    ONNX bundle was exported from): the same analysis finds the model's sites in both graphs in the same order,
    and each ramp moves to the next site of `backend` whose activation has its site's shape. A graph may have
    sites the other lacks (MiniLM's export has one at its head, its fx graph not): a ramp with no such site is
    left out."""
    activations, _ = next(site_activations(backend, [example], [s.value for s in backend.sites]))
    candidates = list(backend.sites)
    twins, ramps = [], {}
    for info in prepared.sites:
        match = next((i for i, s in enumerate(candidates)
                      if tuple(activations[s.value].shape[1:]) == info.activation_shape), None)
        if match is None:
            continue
        site, candidates = candidates[match], candidates[match + 1:]
        twins.append(SiteInfo(site.value, site.index, site.kind, site.scope, info.activation_shape, info.ramp,
                              info.val_accuracy))
        ramps[site.value] = prepared.ramps[info.name]
    return PreparedModel(backend, twins, ramps, error_score=prepared.error_score)


def run_staging_bench(model: str = "resnet18-fmnist", batch_sizes: tuple[int, ...] = (1, 16),
                      rounds: int = 200, small: bool = False) -> dict:
    """The engines timed again, staging on torch and ONNX Runtime, and what ramps cost on the engine the bundle
    serves on (and, as a reference, on the other backend)."""
    from rampserve.graph.onnx_graph import export_onnx

    source = ModelSource.parse(model, small=small)
    module = load_trained(source)
    bootstrap = bootstrap_inputs(default_workload(source), max(batch_sizes), source)
    encoder, items = bootstrap.encoder, bootstrap.items
    torch_backend = TorchBackend(module)
    cases: list[StagingCase] = []
    prepared = load_bundle(zoo_bundle(model, small=small))
    served = engine_of(prepared.meta, prepared.backend.kind)
    with tempfile.TemporaryDirectory() as tmp:
        example = feeds_for(torch_backend, encoder, items[:2])
        onnx_path = export_onnx(module, tuple(torch.from_numpy(v) for v in example.values()),
                                torch_backend.input_names, Path(tmp) / "model.onnx")
        backends = engine_backends(list(ENGINES.values()), torch_backend, onnx_path)
        feeds_of = lambda b: feeds_for(torch_backend, encoder, items[:b])  # noqa: E731
        engines = EngineChoice(served.name, prepared.meta.get("engine", {}).get("chosen_by", "?"), tuple(
            time_engines(backends, feeds_of, batch_sizes)))
        as_users_run_it = EngineChoice(served.name, CHOSEN_BY_USER, tuple(time_engines(
            {**engine_backends([AS_USERS_RUN_IT], None, onnx_path), served.name: backends[served.name]},
            feeds_of, batch_sizes))) if served.backend == "onnx" else None
        for batch_size in batch_sizes:
            for backend in (torch_backend, backends["onnxruntime"]):
                feeds = feeds_for(backend, encoder, items[:batch_size])
                cases.extend(measure_backend(backend, feeds, rounds=rounds))
        # The bundle's ramps on its own engine, and on the other backend for reference: compiled with the ramp
        # operators on torch, fused into the stages' sessions on ONNX
        other = backends["onnxruntime"] if prepared.backend.kind == "torch" else torch_backend
        ramp_cases = [case for model_on in (prepared, engine_twin(prepared, other, example))
                      for batch_size in batch_sizes for case in measure_ramps(
                          model, model_on, feeds_for(model_on.backend, encoder, items[:batch_size]), example, rounds)]
    return {
        "model": model,
        "served_engine": served.name,
        "engines": engines.to_json(),
        "fastest_now_at_batch_1": choose_engine(engines.timings),
        "as_users_run_it": None if as_users_run_it is None else as_users_run_it.to_json(),
        "cases": [asdict(c) for c in cases if c.cuts == "none"],
        "all_sites_cases": [asdict(c) for c in cases if c.cuts == "all"],
        "ramp_cases": [{**asdict(c), "served": c.backend == prepared.backend.kind and c.path != "stages"}
                       for c in ramp_cases],
    }
