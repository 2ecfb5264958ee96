"""Latency profile of a prepared model, measured on the serving machine.

Per batch size: the whole model in one piece, every segment between consecutive sites, and every ramp.
The controller and simulator read savings and overheads from it instead of timing anything themselves.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import numpy as np
import torch
from tqdm.auto import tqdm

from rampserve.ramps.fused import fused_ramp
from rampserve.runtime.compiled import NEVER_STOP, CompiledSet

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)


@dataclass(frozen=True)
class LatencyProfile:
    batch_sizes: tuple[int, ...]
    sites: tuple[str, ...]  # in model order
    full_ms: tuple[float, ...]  # whole model, per batch size
    segment_ms: dict[str, tuple[float, ...]]  # segment ending at each site, and "output" for the last one
    # Per batch size, what having the ramp at a site active costs an input that does not exit, which the
    # controller charges against its ramp budget: the marginal time of the serving path with that ramp alone
    # against the path with none, measured paired (see `measure_profile`), and never less than the ramp's own
    # operators timed alone.
    ramp_ms: dict[str, tuple[float, ...]]

    def _column(self, batch_size: int) -> int:
        """The profiled batch size at or above `batch_size` (the largest when beyond)."""
        return min(bisect.bisect_left(self.batch_sizes, batch_size), len(self.batch_sizes) - 1)

    def full(self, batch_size: int) -> float:
        return self.full_ms[self._column(batch_size)]

    def ramp(self, site: str, batch_size: int) -> float:
        return self.ramp_ms[site][self._column(batch_size)]

    def reach(self, batch_size: int) -> np.ndarray:
        """Time from the start of the model to each site, in site order, scaled so that reaching the output
        costs the whole model's time (segments measured apart add up to a little more than one piece)."""
        col = self._column(batch_size)
        segments = np.array([self.segment_ms[s][col] for s in (*self.sites, "output")])
        scale = self.full_ms[col] / segments.sum() if segments.sum() > 0 else 1.0
        return np.cumsum(segments)[:-1] * scale

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> LatencyProfile:
        return cls(
            batch_sizes=tuple(int(b) for b in data["batch_sizes"]),
            sites=tuple(data["sites"]),
            full_ms=tuple(float(v) for v in data["full_ms"]),
            segment_ms={k: tuple(float(x) for x in v) for k, v in data["segment_ms"].items()},
            ramp_ms={k: tuple(float(x) for x in v) for k, v in data["ramp_ms"].items()},
        )


def max_batch_for_slo(batch_sizes: Sequence[int], batch_ms: Sequence[float], slo_ms: float) -> int:
    """Clockwork's bound: the largest profiled batch size whose execution fits within the SLO (at least 1)."""
    fitting = [b for b, ms in zip(batch_sizes, batch_ms) if ms <= slo_ms]
    return max(fitting, default=1)


def _timed(fn: Callable[..., object], *args: object) -> tuple[object, float]:
    start = time.perf_counter()
    out = fn(*args)
    return out, (time.perf_counter() - start) * 1000.0


# Time each batch size is measured for, at most: a ramp's marginal cost is a few microseconds against a batch of
# one's millisecond, so it takes hundreds of paired runs to stand out of the machine's noise.
PROFILE_BUDGET_S = 5.0
MAX_ROUNDS = 400


# Runs of one path in a row, after one untimed run: a server runs the set in force batch after batch with its
# weights in cache, where a set timed right after another (each holds its own copy of the weights) finds them out
BLOCK = 4


def _block(run: Callable[[], object]) -> float:
    """Median milliseconds of `BLOCK` runs of `run` in a row, after an untimed one."""
    run()
    return float(np.median([_timed(run)[1] for _ in range(BLOCK)]))


def serving_path(model, active: tuple[str, ...], compiled: object, feeds: dict[str, np.ndarray]
                  ) -> Callable[[], object]:
    """A batch of `active` as the executor runs it when no input exits (thresholds 0): the compiled set, or the
    eager path where there is none."""
    if isinstance(compiled, CompiledSet):
        outputs = model.ramp_outputs(compiled, len(next(iter(feeds.values()))))
        thresholds = (0.0,) * len(compiled.sites)
        return lambda: model.run_compiled(compiled, feeds, outputs, thresholds)
    return lambda: model.run_eager(feeds, active, None)


def _ramp_alone(model, site: str, fused: bool) -> Callable[[torch.Tensor], object]:
    """The ramp at `site` on its own, as the serving path runs it: its fused form where the model compiles (the
    ramp operator, or the stash of a ramp that runs in Python), else the eager evaluation."""
    if not fused:
        return lambda activation: model.evaluate_ramp(site, activation)
    shape = next(s.activation_shape for s in model.sites if s.name == site)
    ramp = fused_ramp(model.ramps[site], model.error_score, shape, 0)
    buffers: dict[int, torch.Tensor] = {}  # one per batch size, as a batch has one for all its ramps
    stashes = [torch.zeros(0)]

    def alone(activation: torch.Tensor) -> bool:
        rows = len(activation)
        if rows not in buffers:
            buffers[rows] = torch.empty((rows, 1, model.sites[0].ramp.num_classes))
        return ramp.forward(activation, buffers[rows], NEVER_STOP, -1, stashes)

    return alone


def measure_profile(model, sample_feeds: Callable[[int], dict[str, np.ndarray]],
                    batch_sizes: tuple[int, ...] = DEFAULT_BATCH_SIZES, repeats: int = 3,
                    progress: bool = True, compiled: bool = True,
                    budget_s: float = PROFILE_BUDGET_S) -> LatencyProfile:
    """Per batch size: the whole model, each segment between consecutive sites, and each ramp's marginal cost.

    `model` is a `PreparedModel`; `sample_feeds(b)` gives real inputs of batch size b. `compiled`: time the paths
    the server runs by default (each set's stages compiled with its ramps fused in, see
    `PreparedModel.build_compiled`), since that is what a ramp costs when served. A ramp's cost is the marginal
    time of activating it: the serving path with that ramp alone active against the same path with none, each run
    in a block (see `BLOCK`) in each round, in an order that alternates from round to round so that drift cancels
    in the difference; median over at least `repeats` and as many rounds as `budget_s` allows. It is everything
    the ramp adds to an input that does not exit until its answer: its stage's cut and the fused ramp (threshold
    0: no input exits, so the releasing thread is not woken); the record's bookkeeping comes after the batch's
    answers are out (throughput, not latency)."""
    sites = model.site_names
    example = sample_feeds(2)

    def path(active: tuple[str, ...]) -> object:
        return (model.build_compiled(active, example) if compiled else None) or False

    whole = path(())
    alone = {site: path((site,)) for site in sites}
    # Segments are timed as traced stages without ramps where the model compiles (their sum is scaled to the
    # whole model's time by `LatencyProfile.reach`)
    split = model.backend.split
    traced = split.traced(split.build(sites), model.backend.native_feeds(example)) \
        if compiled and model.compiles else None
    stages = traced or model.backend.plan(sites)[1]
    heads = {site: _ramp_alone(model, site, isinstance(alone[site], CompiledSet)) for site in sites}
    full: list[float] = []
    segment: dict[str, list[float]] = {s: [] for s in (*sites, "output")}
    ramp: dict[str, list[float]] = {s: [] for s in sites}

    for batch_size in tqdm(batch_sizes, desc="profiling latency", unit="batch size", disable=not progress):
        feeds = sample_feeds(batch_size)
        primary, side = model.backend.split_feeds(feeds)
        none = serving_path(model, (), whole, feeds)
        one = {site: serving_path(model, (site,), alone[site], feeds) for site in sites}
        with torch.inference_mode():
            _, once = _timed(none)
            rounds = int(np.clip(budget_s * 1000.0 / (max(once, 1e-3) * ((2 * len(sites) + 1) * (BLOCK + 1) + 2)),
                                 repeats, MAX_ROUNDS))
            runs: dict[str, list[float]] = {k: [] for k in ("full", *segment, *(f"ramp:{s}" for s in sites),
                                                              *(f"head:{s}" for s in sites))}
            for rep in range(rounds + 2):  # two warm-up rounds, discarded
                timings = {"full": _block(none)}
                for site in sites:
                    if rep % 2:
                        timings[f"ramp:{site}"] = _block(one[site]) - _block(none)
                    else:
                        timings[f"ramp:{site}"] = -(_block(none) - _block(one[site]))
                activation = primary
                for name, stage in zip((*sites, "output"), stages):
                    activation, timings[name] = _timed(stage, activation, side)
                    if name in heads:
                        timings[f"head:{name}"] = _timed(heads[name], activation)[1]
                if rep >= 2:
                    for key, value in timings.items():
                        runs[key].append(value)
        full.append(float(np.median(runs["full"])))
        for name in segment:
            segment[name].append(float(np.median(runs[name])))
        for name in sites:
            # A ramp costs at least its own operators: the floor where noise buries its marginal time
            ramp[name].append(max(float(np.median(runs[f"head:{name}"])), float(np.median(runs[f"ramp:{name}"]))))
    return LatencyProfile(
        batch_sizes=tuple(batch_sizes),
        sites=tuple(sites),
        full_ms=tuple(full),
        segment_ms={k: tuple(v) for k, v in segment.items()},
        ramp_ms={k: tuple(v) for k, v in ramp.items()},
    )
