"""`rampserve bench staging`: what staged execution costs against running the whole model.

With no active ramp the executor must run the model as one piece, at the original model's speed. The same
run also reports, for information, the cost of cutting at every site (without ramps): the price of the
finest split the controller could ever ask for.
"""

from __future__ import annotations

import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from rampserve.bench.timing import interleaved_medians
from rampserve.runtime.backends import Backend, OnnxBackend, TorchBackend
from rampserve.runtime.prepare import bootstrap_inputs, default_workload, feeds_for
from rampserve.runtime.sources import ModelSource, load_trained


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


def run_staging_bench(model: str = "resnet18-fmnist", batch_sizes: tuple[int, ...] = (1, 16),
                      rounds: int = 200, small: bool = False) -> dict:
    from rampserve.graph.onnx_graph import export_onnx

    source = ModelSource.parse(model, small=small)
    module = load_trained(source)
    bootstrap = bootstrap_inputs(default_workload(source), max(batch_sizes))
    encoder, items = bootstrap.encoder, bootstrap.items
    torch_backend = TorchBackend(module)
    cases: list[StagingCase] = []
    with tempfile.TemporaryDirectory() as tmp:
        example = feeds_for(torch_backend, encoder, items[:2])
        onnx_path = export_onnx(module, tuple(torch.from_numpy(v) for v in example.values()),
                                torch_backend.input_names, Path(tmp) / "model.onnx")
        backends: list[Backend] = [torch_backend, OnnxBackend(onnx_path)]
        for batch_size in batch_sizes:
            for backend in backends:
                feeds = feeds_for(backend, encoder, items[:batch_size])
                cases.extend(measure_backend(backend, feeds, rounds=rounds))
    return {
        "model": model,
        "cases": [asdict(c) for c in cases if c.cuts == "none"],
        "all_sites_cases": [asdict(c) for c in cases if c.cuts == "all"],
    }
