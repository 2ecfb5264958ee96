"""ONNX Runtime sets whose ramps signal from inside one session call.

Cut into stages, a set of ONNX ramps costs a session call per active site, and on a convolutional network the
conversions of each site's value out of and back into ONNX Runtime's blocked layout: on EfficientNet-Lite0 at
224x224 (5.5 ms at batch 1 on 2 cores), 3-4% of the model per ramp. Here the model runs whole, in one session of
the graph ONNX Runtime optimized for this machine, each ramp computed on its site's value in whatever layout it is
(`graph.onnx_graph.with_signals`). Where the batch's highest confidence clears the ramp's exit floor (fed with the
batch), the ramp hands its logits to a Python operator (onnxruntime-extensions' PyOp) that writes them where the
batch reads them and hands the ramp's column to the batch in progress (`runtime.column_handlers`), which releases
the inputs that exit there before the run goes on; with no batch to take it, the column goes to the notify pipe,
as a torch set's operator writes it. Elsewhere no Python runs (calling it costs
about 50 us with the caches cold from the model's layers, 1% of that 5.5 ms run): every ramp's logits are one
output of the run (`graph.onnx_graph.RAMP_LOGITS`), copied after it. ONNX Runtime runs a session's nodes on the
thread that called it, so the operator finds that batch's buffers in a thread-local.

Such a set's graph (optimized for this machine, with its ramps and signals) is kept on disk once built and checked
against the model (`signalled_key`), and a later start makes its session from it with ONNX Runtime's optimizations
off, checking nothing again (as a torch set compiled before is loaded).
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import json
import logging
import os
import sys
import threading
import types
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime

from rampserve.control.exit_rule import NEVER_STOP
from rampserve.control.scores import top_label_and_error
from rampserve.graph.onnx_graph import SignalledRunner
from rampserve.paths import cpu_flags
from rampserve.ramps import onnx_kernel
from rampserve.runtime.column_handlers import column_handler
from rampserve.runtime.compiled import FORMAT

# The modules whose code writes a signalled set's graph: a stored graph is keyed by their source, so that one written
# by other code is never loaded
GRAPH_WRITERS = ("rampserve.graph.onnx_graph", "rampserve.ramps.onnx_fused", "rampserve.ramps.pooling",
                 "rampserve.runtime.onnx_signals")


def _python_operators() -> types.ModuleType:
    """onnxruntime_extensions, loaded without its tokenizer converters (`cvt`), which its package imports whatever is
    asked of it: they import transformers (0.6-1.2 s of an executor process's start, most of what its first ONNX set
    cost) and set PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION=python in the environment of every process started after.
    Only its Python operators are used here; a placeholder stands for the converters while the package loads (it
    binds one name of theirs, `gen_processing_models`, never called here)."""
    if "onnxruntime_extensions" in sys.modules:
        return sys.modules["onnxruntime_extensions"]
    converters = "onnxruntime_extensions.cvt"
    placeholder = types.ModuleType(converters)
    placeholder.gen_processing_models = None
    sys.modules[converters] = placeholder
    try:
        import onnxruntime_extensions
    finally:
        del sys.modules[converters]  # imported by name later, the real converters load
    return onnxruntime_extensions


_extensions = _python_operators()
_FLOAT, _INT64 = _extensions.PyCustomOpDef.dt_float, _extensions.PyCustomOpDef.dt_int64
SIGNAL_OP = "RampserveRampSignal"
_ZERO = np.zeros((), dtype=np.float32)
# (logits out (rows, sites, classes), notify fd, column handler, stop-mode rows or None) of the run on this thread
_batch = threading.local()
log = logging.getLogger("rampserve.runtime")


@dataclass(frozen=True, eq=False)
class _Stopping:
    """A stop-mode run's rows (see `OnnxStoppingRunner`): per row the column it left the batch at (-1: none yet),
    those held to the end (`keep`), each site's stop floor, and the run's options, whose terminate flag ends it."""

    left: np.ndarray
    keep: np.ndarray
    floors: np.ndarray
    options: onnxruntime.RunOptions
    score: str

    def leave_at(self, column: int, logits: np.ndarray) -> None:
        """Rows not held whose confidence at the ramp of `column` clears its stop floor leave there (scored as the
        exit rule scores them: such a row is released there); once every row has left, the run ends."""
        confidence = 1.0 - top_label_and_error(logits, self.score)[1]
        leaving = (confidence > self.floors[column]) & ~self.keep & (self.left < 0)
        self.left[leaving] = column
        if (self.left >= 0).all():
            self.options.terminate = True


@_extensions.onnx_op(op_type=SIGNAL_OP, inputs=[_FLOAT, _FLOAT], outputs=[_FLOAT], attrs={"column": _INT64})
def _signal(logits: np.ndarray, confidence: np.ndarray, column: int) -> np.ndarray:
    out, notify, on_column, stopping = _batch.run
    out[:, column] = logits
    if on_column is not None:
        try:
            on_column(column)
        except Exception:  # an exception would fail the run: the executor takes the column from the pipe after it
            log.exception("releasing early answers inside the run failed; they are answered at the end of the batch")
            _batch.run = (out, notify, None, stopping)
            os.write(notify, bytes((column,)))
    elif notify >= 0:
        os.write(notify, bytes((column,)))
    if stopping is not None:
        stopping.leave_at(column, logits)
    return _ZERO


def float32_floors(floors: Sequence[float]) -> np.ndarray:
    """`floors` in float32 (as the session compares them), each rounded down where rounding to nearest would raise
    it: a confidence above a floor stays above its float32 one."""
    wanted = np.asarray(floors, dtype=np.float64)
    rounded = wanted.astype(np.float32)
    return np.where(rounded > wanted, np.nextafter(rounded, np.float32(-np.inf)), rounded).astype(np.float32)


def libraries() -> tuple[str, ...]:
    """The paths of the libraries a signalled session registers: the one through which ONNX Runtime calls Python
    operators and, where it is built, rampserve's ramp operator (`ramps.onnx_kernel`)."""
    ramp_operator = onnx_kernel.library()
    return (_extensions.get_library_path(), *([ramp_operator] if ramp_operator else []))


class OnnxSignalledRunner:
    """One active-ramp set of an ONNX model, called as an `OnnxSetRunner` is, in one session call whose ramps
    signal as they are computed (every ramp fused: nothing is stashed)."""

    runs_whole = True  # its output is the whole model's, not the stages'

    def __init__(self, runner: SignalledRunner, sites: Sequence[str], side_name: str | None) -> None:
        self.runner, self.side_name = runner, side_name
        self.tapped = (True,) * len(sites)
        self._silent = float32_floors([NEVER_STOP] * len(sites))  # no pipe to signal to: no Python in the run
        self._floors: tuple[list[float] | None, np.ndarray] = (None, self._silent)  # the last floors, converted

    def forward(self, activation: np.ndarray, side: np.ndarray | None, logits: np.ndarray, floors: list[float],
                notify: int, stashes: list) -> np.ndarray:
        return self._run(activation, side, logits, self._silent if notify < 0 else self._converted(floors), notify)

    def _run(self, activation: np.ndarray, side: np.ndarray | None, logits: np.ndarray, floors: np.ndarray,
             notify: int, stopping: _Stopping | None = None,
             options: onnxruntime.RunOptions | None = None) -> np.ndarray:
        """One session call with this batch's buffers on this thread (for `_signal`); the model's output, every
        ramp's logits copied into `logits` after it."""
        sides = {} if self.side_name is None else {self.side_name: side}
        _batch.run = (logits, notify, column_handler(notify), stopping)
        try:
            output, ramps = self.runner(activation, sides, floors, options)
        finally:
            _batch.run = None
        sites = len(self.tapped)
        logits[:, :sites] = ramps.reshape(len(ramps), sites, -1)
        return output

    def _converted(self, floors: list[float]) -> np.ndarray:
        """`floors` (one per site, then the last stage's) as the session's float32 input; a compiled set hands
        the same list until its thresholds change, so it is converted once per list."""
        last, converted = self._floors  # one item, read and replaced whole: threads may share a set
        if last is not floors:
            converted = float32_floors(floors[:len(self.tapped)])
            self._floors = (floors, converted)
        return converted


class OnnxStoppingRunner(OnnxSignalledRunner):
    """A signalled set in stop mode, called as a `StopSetRunner` is. One session call cannot drop some rows of its
    batch, so rows leave together: a row not held by `keep` whose confidence at a ramp clears that ramp's stop floor
    is marked as left there (`left`), and once every row of the batch has, the ramp's Python operator sets the run's
    terminate flag and ONNX Runtime ends the call before its next node (98-123 us for a stopped call, measured), the
    layers after it never computed. A batch with a row still running runs to the end; its rows marked as left keep
    no final answer, as if they had left (the feedback sample alone stands for the exits, `control.guarantee`). At
    batch 1 (minilm-rt's max batch is 1-2) a row that leaves stops its run.

    A stopped run leaves no logits for the ramps that did not signal before it stopped (theirs are outputs of a
    run that completes): NaN there, for rows that stopped, which have no final answer to judge them by."""

    def __init__(self, runner: SignalledRunner, sites: Sequence[str], side_name: str | None, score: str) -> None:
        super().__init__(runner, sites, side_name)
        self.score = score

    def forward(self, activation: np.ndarray, side: np.ndarray | None, logits: np.ndarray, floors: list[float],
                stop_floors: list[float], keep: np.ndarray, rows_left: np.ndarray, notify: int,
                stashes: list) -> tuple[np.ndarray, np.ndarray]:
        logits.fill(np.nan)
        options = onnxruntime.RunOptions()
        stopping = _Stopping(rows_left, keep, np.asarray(stop_floors[:len(self.tapped)]), options, self.score)
        try:
            output = self._run(activation, side, logits, self._converted(floors), notify, stopping, options)
        except onnxruntime.capi.onnxruntime_pybind11_state.Fail:
            if not options.terminate:
                raise
            return np.zeros((0, logits.shape[-1]), np.float32), np.zeros(0, dtype=np.int64)
        ran = np.flatnonzero(rows_left < 0)
        return output[ran], ran


def signalled_key(bundle_digest: str, sites: Sequence[str], score: str, threads: int) -> str:
    """The on-disk name of a signalled set's graph: what it was built from (the bundle, the set, the error score) and
    what wrote it for this machine at `threads` intra-op threads (ONNX Runtime's version and the CPU's instruction set,
    whose vector width its layout follows, rampserve's code that writes it and the ramp operator its linear ramps are,
    if any): an optimized graph is not portable."""
    what = {"format": FORMAT, "runner": "onnx-signalled", "bundle": bundle_digest, "sites": list(sites),
            "score": score, "intra_op_threads": threads, "onnxruntime": onnxruntime.__version__,
            "cpu": hashlib.sha256(cpu_flags()).hexdigest(), "writers": _writers_digest(),
            "ramp_operator": onnx_kernel.build_id() if onnx_kernel.library() else None}
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:32]


@functools.cache
def _writers_digest() -> str:
    sources = (Path(importlib.import_module(name).__file__).read_bytes() for name in GRAPH_WRITERS)
    return hashlib.sha256(b"".join(sources)).hexdigest()
