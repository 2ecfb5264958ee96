"""The engines a model can be served on, timed side by side on this machine, and the choice among them.

A user weighs a server against the fastest way to run their model on their own machine, so `prepare` serves a
model on the fastest engine it can run here at batch 1 (the latency early exits are about), keeps the timing
table in the bundle, and every benchmark's vanilla is that engine's. On the 2-core machine this was built on,
ONNX Runtime ran resnet18-fmnist 4-8x faster than TorchScript at batch 1 and minilm-rt 2x.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import weakref
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from rampserve.graph.sites import SitePolicy
from rampserve.runtime.backends import Backend, OnnxBackend
from rampserve.runtime.timing import interleaved_samples

if TYPE_CHECKING:
    from rampserve.runtime.torch_backend import TorchBackend

AUTO = "auto"
CHOSEN_BY_TIMING = "timing"
CHOSEN_BY_USER = "--engine"
ENGINE_BATCH_SIZES = (1, 16)
ENGINE_BUDGET_S = 2.0  # time per batch size for interleaved rounds of every engine, after one round at least
MAX_ROUNDS = 400
# Each engine's turn: runs in a row after an untimed one, after a pause in which the threads of the engine before it
# go quiet (torch's OpenMP pool spins on after a run, and a bare ONNX Runtime session's pool for about 24 ms of a
# core): interleaved without it, ONNX Runtime at default threads ran lite0-fmnist in 7.2 ms beside TorchScript
# against 5.1 ms alone
ENGINE_BLOCK, ENGINE_SETTLE_S = 3, 0.05
# How rampserve runs a model on ONNX Runtime (its threads; its ramps), kept in a bundle's engine record: a bundle
# timed and profiled otherwise is prepared again by the zoo's cache (see `zoo_bundles`)
ONNX_SERVING = "threads spin at most 200 us idle; ramps signal from one session where an input may exit"


@dataclass(frozen=True)
class Engine:
    name: str
    backend: str  # the `Backend.kind` that runs it
    intra_op_threads: int = 0  # ONNX Runtime's intra-op threads; 0 is its default, one per core
    spin_after_run: bool = False  # ONNX Runtime's idle pool threads spin as long as by its default (~24 ms)

    @property
    def cores(self) -> int:
        """How many cores its runs take: its intra-op threads (torch is timed at its default, one per core)."""
        return self.intra_op_threads or os.cpu_count() or 1


# In the order a tie at batch 1 is broken: ONNX Runtime first, as it serves without the torch package. "torch" is
# TorchScript, the model traced and frozen (rampserve's compiled torch path). ONNX Runtime's idle threads spin a
# bounded time (see `graph.onnx_graph.session_options`).
ENGINES: dict[str, Engine] = {e.name: e for e in (
    Engine("onnxruntime", "onnx"),
    Engine("onnxruntime-1thread", "onnx", intra_op_threads=1),
    Engine("torch", "torch"),
)}
# ONNX Runtime exactly as a bare session runs a model (threads spinning on after each run): what a user who loads
# the file into ONNX Runtime would time. Never served (its idle spinning starves the next session and the
# server's threads); `bench staging` times it beside the engines to show the served engine gives up nothing.
AS_USERS_RUN_IT = Engine("onnxruntime-defaults", "onnx", spin_after_run=True)


@dataclass(frozen=True)
class EngineTiming:
    engine: str
    batch_size: int
    median_ms: float
    p25_ms: float
    p75_ms: float


@dataclass(frozen=True)
class EngineChoice:
    """The engine a bundle serves on, why, and the table it was chosen from (empty when the user named it)."""

    engine: str
    chosen_by: str  # CHOSEN_BY_TIMING or CHOSEN_BY_USER
    timings: tuple[EngineTiming, ...] = ()
    unavailable: tuple[tuple[str, str], ...] = ()  # (engine, why) for engines this model could not run on

    def to_json(self) -> dict:
        return {"engine": self.engine, "chosen_by": self.chosen_by, "timings": [asdict(t) for t in self.timings],
                "unavailable": dict(self.unavailable), "onnxruntime_serving": ONNX_SERVING}

    @classmethod
    def from_json(cls, data: dict) -> EngineChoice:
        return cls(str(data["engine"]), str(data["chosen_by"]),
                   tuple(EngineTiming(**t) for t in data.get("timings", ())),
                   tuple((str(k), str(v)) for k, v in data.get("unavailable", {}).items()))

    def rows(self) -> list[dict]:
        """The table as rows, one per engine, with each batch size's median, its interquartile range, and each
        engine's time over the chosen one's."""
        chosen = {t.batch_size: t.median_ms for t in self.timings if t.engine == self.engine}
        rows = []
        for name in dict.fromkeys(t.engine for t in self.timings):
            row: dict = {"engine": name, "chosen": name == self.engine}
            for t in (t for t in self.timings if t.engine == name):
                row[f"b{t.batch_size}_ms"] = t.median_ms
                row[f"b{t.batch_size}_iqr_ms"] = (t.p25_ms, t.p75_ms)
                row[f"b{t.batch_size}_x_chosen"] = t.median_ms / chosen[t.batch_size] if t.batch_size in chosen \
                    else None
            rows.append(row)
        return rows


def choose_engine(timings: Sequence[EngineTiming], batch_size: int = 1) -> str:
    """The engine of `ENGINES` that is fastest at `batch_size` within the spread (other rows are references): of
    those whose median lies within the fastest's interquartile range, the one that takes the fewest cores, then
    the one listed first in `ENGINES`, then by name. Timed alone, a pool of a thread per core may edge out one
    thread; served, its threads compete with the front end and the executor's own Python for the cores at the
    moment a run ends (resnet18-fmnist, one request at a time on 2 cores: 0.72 ms over the model's time on one
    thread against 1.02 ms on two, timed alone 0.26 ms against 0.21 ms with overlapping quartiles)."""
    timed = [t for t in timings if t.batch_size == batch_size and t.engine in ENGINES]
    if not timed:
        raise ValueError(f"no engine was timed at batch size {batch_size}")
    fastest = min(t.median_ms for t in timed)
    # The widest upper quartile among the rows at that median: the choice must not depend on the table's order
    bound = max(t.p75_ms for t in timed if t.median_ms == fastest)
    within = [t for t in timed if t.median_ms <= bound]
    order = list(ENGINES)
    return min(within, key=lambda t: (ENGINES[t.engine].cores, order.index(t.engine), t.engine)).engine


def check_engine(name: str, source_kind: str) -> None:
    """Refuse an engine that does not exist or cannot run a model from a source of `source_kind`."""
    if name == AUTO:
        return
    if name not in ENGINES:
        raise ValueError(f"unknown engine {name!r} (known: {AUTO}, {', '.join(ENGINES)})")
    if source_kind == "onnx" and ENGINES[name].backend != "onnx":
        raise ValueError(f"an ONNX file runs on ONNX Runtime only, not on {name}")


def engine_of(meta: dict, backend_kind: str) -> Engine:
    """The engine a bundle's model runs on: the one its meta records, else its backend's default (bundles from
    before the engine choice)."""
    recorded = meta.get("engine", {}).get("engine")
    if recorded in ENGINES and ENGINES[recorded].backend == backend_kind:
        return ENGINES[recorded]
    return next(e for e in ENGINES.values() if e.backend == backend_kind)


def _vanilla_path(backend: Backend, feeds: dict[str, np.ndarray], example: dict[str, np.ndarray]
                  ) -> Callable[[], object]:
    """The model without ramps as the server runs it on `backend`: its compiled path with no active site."""
    from rampserve.runtime.prepared import PreparedModel
    from rampserve.runtime.profile import serving_path

    model = PreparedModel(backend=backend, sites=[], ramps={})
    return serving_path(model, (), model.build_compiled((), example) or False, feeds)


def time_engines(backends: dict[str, Backend], feeds_of: Callable[[int], dict[str, np.ndarray]],
                 batch_sizes: Sequence[int] = ENGINE_BATCH_SIZES, budget_s: float = ENGINE_BUDGET_S,
                 progress: bool = True) -> list[EngineTiming]:
    """Each backend's vanilla serving path at each batch size, in interleaved rounds (each round runs every
    engine `ENGINE_BLOCK` times in a row, in rotating order, each turn after `ENGINE_SETTLE_S` of quiet) for
    about `budget_s` per batch size: medians and quartiles in ms."""
    example = feeds_of(2)
    timings = []
    with contextlib.ExitStack() as modes:
        for backend in backends.values():
            modes.enter_context(backend.inference_mode())
        for batch_size in batch_sizes:
            feeds = feeds_of(batch_size)
            paths = {name: _vanilla_path(backend, feeds, example) for name, backend in backends.items()}
            once = interleaved_samples(paths, 1, warmup=2, progress=False)
            round_ms = sum(float(v.sum()) for v in once.values())
            turns_ms = round_ms * (ENGINE_BLOCK + 1) + 1000.0 * ENGINE_SETTLE_S * len(paths)
            rounds = int(np.clip(budget_s * 1000.0 / max(turns_ms, 1e-3), 5, MAX_ROUNDS))
            samples = interleaved_samples(paths, rounds, warmup=1, desc=f"engines, batch {batch_size}",
                                          block=ENGINE_BLOCK, progress=progress, settle_s=ENGINE_SETTLE_S)
            for name, values in samples.items():
                p25, median, p75 = np.percentile(values, [25, 50, 75])
                timings.append(EngineTiming(name, batch_size, float(median), float(p25), float(p75)))
    return timings


def engine_backends(engines: Sequence[Engine], torch_backend: TorchBackend | None, onnx_path: Path | None,
                    policy: SitePolicy | None = None) -> dict[str, Backend]:
    """The model on each of `engines`, by name: the torch backend as it is, or the ONNX file in sessions of
    that engine's thread settings."""
    return {e.name: torch_backend if e.backend == "torch" else
            OnnxBackend(onnx_path, policy, e.intra_op_threads, e.spin_after_run) for e in engines}


def _onnx_export(backend: TorchBackend, example: dict[str, np.ndarray]) -> Path:
    """`backend`'s module exported to ONNX in a directory of its own (the caller removes it)."""
    from rampserve.graph.onnx_graph import export_onnx

    directory = Path(tempfile.mkdtemp(prefix="rampserve-export-"))
    try:
        return export_onnx(backend.module, tuple(backend.native(example[n]) for n in backend.input_names),
                           backend.input_names, directory / "model.onnx")
    except BaseException:
        shutil.rmtree(directory, ignore_errors=True)
        raise


def serving_backend(torch_backend: TorchBackend | None, onnx_path: Path | None, policy: SitePolicy | None,
                    engine: str, feeds_of: Callable[[Backend], Callable[[int], dict[str, np.ndarray]]],
                    batch_sizes: Sequence[int] = ENGINE_BATCH_SIZES, budget_s: float = ENGINE_BUDGET_S,
                    progress: bool = True) -> tuple[Backend, EngineChoice]:
    """The backend to prepare and serve the model on, and the choice's record. The model comes as a torch
    module (`torch_backend`: exported to ONNX here when ONNX Runtime may run it) or as an ONNX file
    (`onnx_path`). `engine` names one (not timed) or is "auto": every engine the model runs on is timed
    (`time_engines`) and the fastest at batch 1 chosen. `feeds_of(backend)(b)` gives b real inputs."""
    names = [name for name, e in ENGINES.items()
             if (engine == AUTO or name == engine) and (e.backend == "onnx" or torch_backend is not None)]
    unavailable: list[tuple[str, str]] = []
    exported: Path | None = None
    if torch_backend is not None and onnx_path is None and any(ENGINES[n].backend == "onnx" for n in names):
        try:
            onnx_path = exported = _onnx_export(torch_backend, feeds_of(torch_backend)(2))
        except Exception as exc:  # noqa: BLE001 - a model the exporter cannot take is served on torch
            if engine != AUTO:
                raise ValueError(f"{engine} needs the model in ONNX, and exporting it failed: {exc}") from exc
            unavailable = [(n, f"export to ONNX failed: {exc}") for n in names if ENGINES[n].backend == "onnx"]
            names = [n for n in names if ENGINES[n].backend != "onnx"]
    backends = engine_backends([ENGINES[n] for n in names], torch_backend, onnx_path, policy)
    if engine != AUTO:
        choice = EngineChoice(engine, CHOSEN_BY_USER, (), tuple(unavailable))
    elif len(backends) == 1:
        choice = EngineChoice(names[0], CHOSEN_BY_TIMING, (), tuple(unavailable))
    else:
        timings = time_engines(backends, feeds_of(backends[names[0]]), batch_sizes, budget_s, progress)
        choice = EngineChoice(choose_engine(timings), CHOSEN_BY_TIMING, tuple(timings), tuple(unavailable))
    chosen = backends[choice.engine]
    if exported is not None:  # the file lives as long as the backend that serves from it (a bundle copies it)
        if isinstance(chosen, OnnxBackend):
            weakref.finalize(chosen, shutil.rmtree, exported.parent, True)
        else:
            shutil.rmtree(exported.parent, ignore_errors=True)
    return chosen, choice
