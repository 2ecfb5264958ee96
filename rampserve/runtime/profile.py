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

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)


@dataclass(frozen=True)
class LatencyProfile:
    batch_sizes: tuple[int, ...]
    sites: tuple[str, ...]  # in model order
    full_ms: tuple[float, ...]  # whole model, per batch size
    segment_ms: dict[str, tuple[float, ...]]  # segment ending at each site, and "output" for the last one
    # Per batch size, the whole cost of having the ramp at a site active, which the controller charges
    # against its ramp budget: the ramp's evaluation (head, then top label and error score, as
    # `PreparedModel.evaluate_ramp` runs it), timed where the serving path runs it, between the model's
    # layers, plus an even share of whatever else the serving path with every ramp active takes beyond the
    # plain model: reporting activations (ONNX cuts the graph into sessions; torch's hooked module costs
    # nothing) and the model's own layers slowed by the caches the ramps took over.
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


def measure_profile(model, sample_feeds: Callable[[int], dict[str, np.ndarray]],
                    batch_sizes: tuple[int, ...] = DEFAULT_BATCH_SIZES, repeats: int = 7,
                    progress: bool = True, compiled: bool = True) -> LatencyProfile:
    """Median times over `repeats` interleaved runs of the whole model, of the split model, and of the serving
    path with every ramp active and with none.

    `model` is a `PreparedModel`; `sample_feeds(b)` gives real inputs of batch size b. `compiled`: time the paths
    the server runs by default (`PreparedModel.compile`, which leaves a model that does not trace eager), since a
    ramp's cost counts against the stages it is served with.
    """
    backend = model.backend
    sites = [s.name for s in model.sites]
    if compiled:
        example = sample_feeds(2)
        compiled = model.compile(sites, example) and model.compile((), example)
    _, stages = backend.serving_stages(sites, compiled)
    (full_stage,) = backend.serving_stages((), compiled)[1]
    primary, side_names = backend.input_names[0], backend.input_names[1:]
    full: list[float] = []
    segment: dict[str, list[float]] = {s: [] for s in (*sites, "output")}
    ramp: dict[str, list[float]] = {s: [] for s in sites}
    evaluated = dict.fromkeys(sites, 0.0)  # ms spent in each ramp during the current pair of active runs

    def evaluate_timed(site: str, activation: object) -> None:
        start = time.perf_counter()
        model.evaluate_ramp(site, activation)
        evaluated[site] += (time.perf_counter() - start) * 1000.0

    for batch_size in tqdm(batch_sizes, desc="profiling latency", unit="batch size", disable=not progress):
        raw_feeds = sample_feeds(batch_size)
        feeds = backend.native_feeds(raw_feeds)
        side = {n: feeds[n] for n in side_names}
        runs: dict[str, list[float]] = {k: [] for k in ("full", "rest", *segment, *(f"ramp:{s}" for s in sites))}
        with torch.inference_mode():
            for rep in range(repeats + 2):  # two warm-up runs, discarded
                _, t_full = _timed(full_stage, feeds[primary], side)
                # The serving path with every ramp active and with none, back to back in ABBA order so that
                # drift and machine noise largely cancel in the difference.
                evaluated.update(dict.fromkeys(sites, 0.0))
                plain_a, active_a, active_b, plain_b = (
                    _timed(backend.run_hooked, raw_feeds, cuts, evaluate_timed, compiled)[1]
                    for cuts in ((), sites, sites, ()))
                timings = {f"ramp:{s}": evaluated[s] / 2 for s in sites}
                timings["full"] = t_full
                timings["rest"] = (active_a + active_b - plain_a - plain_b - sum(evaluated.values())) / 2
                activation = feeds[primary]
                for name, stage in zip((*sites, "output"), stages):
                    activation, timings[name] = _timed(stage, activation, side)
                if rep >= 2:
                    for key, value in timings.items():
                        runs[key].append(value)
        full.append(float(np.median(runs["full"])))
        for name in segment:
            segment[name].append(float(np.median(runs[name])))
        # No ramp is charged less than its own evaluation, though torch's hooked module alone runs faster than
        # the original (it skips the containers' forward calls): a saving that no ramp brings about.
        rest_ms = max(0.0, float(np.median(runs["rest"]))) / max(1, len(sites))
        for name in sites:
            ramp[name].append(float(np.median(runs[f"ramp:{name}"])) + rest_ms)
    return LatencyProfile(
        batch_sizes=tuple(batch_sizes),
        sites=tuple(sites),
        full_ms=tuple(full),
        segment_ms={k: tuple(v) for k, v in segment.items()},
        ramp_ms={k: tuple(v) for k, v in ramp.items()},
    )
