"""Measuring a prepared model's latency profile (`bundle_format.latency.LatencyProfile`) on the serving machine.

Per batch size: the whole model in one piece, every segment between consecutive sites, and every ramp.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from rampserve.bundle_format.latency import LatencyProfile
from rampserve.control.exit_rule import NEVER_STOP
from rampserve.graph.torch_graph import torchscript_quietly
from rampserve.ramps.fused import StashedRamp, fused_ramp
from rampserve.runtime.compiled import CompiledSet
from rampserve.runtime.timing import interleaved_samples, paired_median

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)


def _timed(fn: Callable[..., object], *args: object) -> tuple[object, float]:
    start = time.perf_counter()
    out = fn(*args)
    return out, (time.perf_counter() - start) * 1000.0


# Time each batch size is measured for, at most: a ramp's marginal cost is a few microseconds against a batch of
# one's millisecond, so it takes hundreds of paired runs to stand out of the machine's noise.
PROFILE_BUDGET_S = 5.0
MAX_ROUNDS = 2000
# The smallest batch size is measured for this many times as long: a latency-first server runs it most, the ramp
# budget is judged there at low load, and a ramp's marginal time (25 us on minilm-rt's 4 ms run) is the hardest
# to see there: at 5 s the six ramps' sum came out between 0.15 and 0.33 ms in four profiles
SMALLEST_BATCH_BUDGET = 3
SEGMENT_ROUNDS = 200  # stage-by-stage runs per batch size (stage times are milliseconds: few runs settle them)


# Runs of one path in a row in its turn, after an untimed one (see `interleaved_samples`)
BLOCK = 4


def serving_path(model, active: tuple[str, ...], compiled: object, feeds: dict[str, np.ndarray]
                  ) -> Callable[[], object]:
    """A batch of `active` as the executor runs it when no input exits (thresholds 0): the compiled set, or the
    eager path where there is none."""
    if isinstance(compiled, CompiledSet):
        outputs = model.ramp_outputs(compiled, len(next(iter(feeds.values()))))
        thresholds = (0.0,) * len(compiled.sites)
        return lambda: model.run_compiled(compiled, feeds, outputs, thresholds)
    return lambda: model.run_eager(feeds, active, None)


class _Repeated(nn.Module):
    """A fused ramp called `times` times in a row inside TorchScript: its own time, free of Python's."""

    __constants__ = ["times"]

    def __init__(self, ramp: nn.Module, times: int) -> None:
        super().__init__()
        self.ramp, self.times = ramp, times

    def forward(self, activation: torch.Tensor, out: torch.Tensor, floor: float, stashes: list[torch.Tensor]) -> bool:
        stop = False
        for _ in range(self.times):
            stop = self.ramp(activation, out, floor, -1, stashes)
        return stop


REPEATS_ALONE = 20


def _ramp_alone(model, site: str, fused: bool) -> Callable[[torch.Tensor], float]:
    """Milliseconds of the ramp at `site` on its own, as the serving path runs it: its fused form where the model
    compiles (the ramp operator, timed over `REPEATS_ALONE` calls in TorchScript; a ramp that runs in Python is
    stashed there and evaluated by the releasing thread, so it costs the stash and that evaluation, which delays
    its exits and takes the model's cores); on ONNX, where it is fused into its stage's session, its nodes in a
    session of their own (that session's call stands for the call its site's stage adds); else the eager
    evaluation."""
    def evaluated(activation: torch.Tensor) -> float:
        return _timed(model.evaluate_ramp, site, activation)[1]

    if not fused:
        return evaluated
    if model.backend.kind == "onnx":
        if site not in model.onnx_taps:
            return evaluated
        tap = model.backend.split.tap_alone(site, model.onnx_taps[site])
        return lambda activation: _timed(tap, activation)[1]
    shape = next(s.activation_shape for s in model.sites if s.name == site)
    form = fused_ramp(model.ramps[site], model.error_score, shape, 0)
    with torchscript_quietly():
        repeated = torch.jit.script(_Repeated(form, REPEATS_ALONE)).forward
    buffers: dict[int, torch.Tensor] = {}  # one per batch size, as a batch has one for all its ramps
    stashes = [torch.zeros(0)]

    def alone(activation: torch.Tensor) -> float:
        rows = len(activation)
        if rows not in buffers:
            buffers[rows] = torch.empty((rows, 1, model.sites[0].ramp.num_classes))
        own = _timed(repeated, activation, buffers[rows], NEVER_STOP, stashes)[1] / REPEATS_ALONE
        return own + (evaluated(activation) if isinstance(form, StashedRamp) else 0.0)

    return alone


def in_place_factor(with_ramps: np.ndarray, without: np.ndarray, own: float) -> float:
    """What the ramps cost on the serving path over the sum of their own times: the paired marginal time of every
    ramp at once (`paired_median` of the two paths' samples) over `own`, where it stands out of the noise (twice
    the standard error of its median). Above 1 on torch, where caches go cold between the model's layers and the
    runner takes arguments; below 1 on ONNX Runtime, where a ramp's own time is its nodes in a session of their
    own, whose call the one-session path never makes (minilm-rt at batch 1: 0.26-0.32 ms for six alone, 0.15 ms on
    the serving path). Where the marginal time does not stand out, the most the measurement allows (its median, or
    0, plus twice its error), never more than `own`: charged their own time alone, minilm-rt's ramps cost 1.5% of
    the model each where they cost 0.6%, and a 2% budget kept one of them. On a run of 60 ms (MiniLM at batch 16)
    noise is a millisecond, and a factor fitted to it charged a 1 us ramp 0.2 ms."""
    median, error = paired_median(with_ramps, without)
    if own <= 0:
        return 1.0
    if median > 2 * error:
        return median / own
    return min(1.0, (max(median, 0.0) + 2 * error) / own)


def measure_profile(model, sample_feeds: Callable[[int], dict[str, np.ndarray]],
                    batch_sizes: tuple[int, ...] = DEFAULT_BATCH_SIZES, repeats: int = 3,
                    progress: bool = True, compiled: bool = True,
                    budget_s: float = PROFILE_BUDGET_S) -> LatencyProfile:
    """Per batch size: the whole model, each segment between consecutive sites, and each ramp's cost.

    `model` is a `PreparedModel`; `sample_feeds(b)` gives real inputs of batch size b. `compiled`: time the paths
    the server runs by default (each set's stages compiled with its ramps fused in, see
    `PreparedModel.build_compiled`), since that is what a ramp costs when served. A ramp's own time is its
    operator's (timed alone in TorchScript, free of the model's noise); what it costs the serving path is that
    times one factor for all ramps (see `in_place_factor`), from the marginal time of the set of every ramp
    against no ramp on the serving path with no input exiting (threshold 0: the releasing thread is not woken):
    each path run in a block (see `BLOCK`) in each round, in an order that alternates from round to round so
    that drift cancels in the difference (`interleaved_samples`), over at least `repeats` rounds and as many as
    `budget_s` allows. A single ramp's marginal time (a few microseconds on a run of a millisecond) is too noisy to measure alone: in
    one profile they came out between -15 and +36 us. The record's bookkeeping comes after the batch's answers
    are out (throughput, not latency)."""
    sites = model.site_names
    example = sample_feeds(2)

    def path(active: tuple[str, ...]) -> object:
        return (model.build_compiled(active, example) if compiled else None) or False

    whole, every = path(()), path(tuple(sites))
    # Segments are timed as traced stages without ramps where the model compiles (their sum is scaled to the
    # whole model's time by `LatencyProfile.reach`)
    split = model.backend.split
    traced = split.traced(split.build(sites), model.backend.native_feeds(example)) \
        if compiled and model.compiles_to_torchscript else None
    stages = traced or model.backend.plan(sites)[1]
    heads = {site: _ramp_alone(model, site, isinstance(every, CompiledSet)) for site in sites}
    full: list[float] = []
    segment: dict[str, list[float]] = {s: [] for s in (*sites, "output")}
    ramp: dict[str, list[float]] = {s: [] for s in sites}

    for batch_size in tqdm(batch_sizes, desc="profiling latency", unit="batch size", disable=not progress):
        feeds = sample_feeds(batch_size)
        primary, side = model.backend.split_feeds(feeds)
        none = serving_path(model, (), whole, feeds)
        ramps = serving_path(model, tuple(sites), every, feeds)
        with torch.inference_mode():
            _, once = _timed(none)
            allowed_ms = budget_s * 1000.0 * (SMALLEST_BATCH_BUDGET if batch_size == min(batch_sizes) else 1)
            rounds = int(np.clip(allowed_ms / (max(once, 1e-3) * (2 * (BLOCK + 1) + 1)), repeats, MAX_ROUNDS))
            samples = interleaved_samples({"none": none, "ramps": ramps}, rounds, block=BLOCK, progress=False)
            runs: dict[str, list[float]] = {k: [] for k in (*segment, *(f"head:{s}" for s in sites))}
            for _ in range(min(rounds, SEGMENT_ROUNDS)):
                activation = primary
                for name, stage in zip((*sites, "output"), stages):
                    activation, elapsed = _timed(stage, activation, side)
                    runs[name].append(elapsed)
                    if name in heads:
                        runs[f"head:{name}"].append(heads[name](activation))
        full.append(float(np.median(np.median(samples["none"], axis=1))))
        for name in segment:
            segment[name].append(float(np.median(runs[name])))
        own = {site: float(np.median(runs[f"head:{site}"])) for site in sites}
        factor = in_place_factor(samples["ramps"], samples["none"], sum(own.values()))
        for name in sites:
            ramp[name].append(own[name] * factor)
    return LatencyProfile(
        batch_sizes=tuple(batch_sizes),
        sites=tuple(sites),
        full_ms=tuple(full),
        segment_ms={k: tuple(v) for k, v in segment.items()},
        ramp_ms={k: tuple(v) for k, v in ramp.items()},
        **_length_times(model, whole, sample_feeds, batch_sizes, repeats, budget_s),
    )


# Positions a model whose inputs come in any length is timed at (those its signature allows), at batch 1
PROFILED_LENGTHS = (8, 16, 24, 32, 48, 64, 96, 128)
LENGTH_ROUNDS = 20


def at_length(feeds: dict[str, np.ndarray], length: int) -> dict[str, np.ndarray]:
    """`feeds` cut or repeated along their positions (axis 1) to `length`."""
    return {name: np.take(array, np.arange(length) % array.shape[1], axis=1) for name, array in feeds.items()}


def _length_times(model, whole: object, sample_feeds: Callable[[int], dict[str, np.ndarray]],
                  batch_sizes: tuple[int, ...], repeats: int, budget_s: float) -> dict[str, tuple]:
    """`LatencyProfile`'s lengths, length_ms and batch_lengths for a model whose inputs come in any length (a text
    model's: minilm-rt took 2.3 ms at 13 positions and 4.4 at 42 at batch 1), else nothing: the whole model on its
    first profiling input cut or repeated to each length, interleaved, over `LENGTH_ROUNDS` rounds or as many as
    `budget_s` allows (at least `repeats`)."""
    signature = model.signature
    if signature is None or signature.max_variable_dim is None:
        return {}
    one = sample_feeds(1)
    runs: dict[str, Callable[[], object]] = {}
    round_ms = 0.0
    with torch.inference_mode():
        for n in (n for n in PROFILED_LENGTHS if n <= signature.max_variable_dim):
            run = serving_path(model, (), whole, at_length(one, n))
            try:
                run()
            except Exception:  # more positions than the model has embeddings for: its encoder never sends as many
                break
            runs[str(n)] = run
            round_ms += BLOCK * _timed(run)[1]  # the first run warms the path up
        if not runs:
            return {}
        rounds = int(np.clip(budget_s * 1000.0 / max(round_ms, 1e-3), repeats, LENGTH_ROUNDS))
        samples = interleaved_samples(runs, rounds, block=BLOCK, progress=False)
    lengths = tuple(int(n) for n in runs)
    return {"lengths": lengths, "length_ms": tuple(float(np.median(samples[str(n)])) for n in lengths),
            "batch_lengths": tuple(int(next(iter(sample_feeds(b).values())).shape[1]) for b in batch_sizes)}
