"""One served model's queue, batcher and early-exit executor (a thread), and the thread that feeds its controller.

The executor runs a batch through the prepared model with the configuration's active ramps; after each ramp
it decides exits with that configuration and answers those requests at once, while the batch runs on to the
final layer. The batch's record then goes to the control thread, which hands it to the model's controller
through a `ControlLink` (the controller in this process, or one that several replicas share) and may get a new
configuration back; the executor picks it up between batches (one reference swap, so a batch never mixes two
configurations).

Exit modes (`ControllerSettings.exit_mode`). "release" (the default): every input runs to the end, its answer
released at the first confident ramp. "stop": on the compiled path of a torch model, an input released at a
fused ramp also leaves the batch there (`runtime.compiled.StopSetRunner`) and is never computed further, except
for the feedback sample: inputs drawn uniformly per batch (each with probability `feedback_share`, whatever its
scores) and those whose request wants the logits, which run to the end so that their final answers measure
the exits' agreement. The record then has no final label (NO_LABEL) for an input that left, and NO_LABEL labels
and NaN error scores at the ramps after the one it left at. ONNX models and the eager path (a set that does not
compile, or no ramp operator) serve stop mode as release mode.

Shadow batches (`Configuration.shadow_every`): the executor counts the batches it serves under each configuration
version, and serves each shadow batch among them with `Configuration.shadowed()`: the ramp at every shadow site
runs, the inactive ones at threshold 0, so the answers released are the configuration's own and the record tells
the controller what every ramp said on the same inputs. In stop mode a shadow batch keeps every input to the end,
so each is observed, standing for itself alone. A shadow batch runs the set of every shadow site, which is loaded
by the control thread once compiled (asked for ahead, never compiled on the serving path); until then shadow
batches are served plainly and counted as skipped.
"""

from __future__ import annotations

import asyncio
import gc
import heapq
import itertools
import logging
import math
import os
import queue
import selectors
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from rampserve.control.controller import Controller, ControllerSettings
from rampserve.control.records import NO_EXIT, NO_LABEL, BatchRecord, Configuration, merged
from rampserve.ramps import exit_rule, kernel
from rampserve.ramps.scores import top_label_and_error
from rampserve.runtime.compiled import CompiledSet
from rampserve.runtime.latency import max_batch_for_slo
from rampserve.runtime.prepared import COMPILED_SETS_KEPT
from rampserve.serving.batching import AdaptiveBatchSize, BatchTimeEstimate, expected_wait_ms
from rampserve.serving.compiler import CompileOutcome, CompileService, likely_next_sets
from rampserve.serving.metrics import ServerMetrics
from rampserve.serving.models import ServedModel, stack_inputs

log = logging.getLogger("rampserve.serving")

ANSWER_PATHS = ("early", "final", "cached", "unverified")
EXECUTORS = ("process", "thread")
RECENT_BATCHES = 64  # batch summaries kept for the status endpoint
CONTROL_POLL_S = 1.0  # how often an idle worker asks its controller for a configuration published meanwhile
CONTROL_GATHER_S = 0.005  # how long the control thread lets records gather once one has come
# How long a thread holding the GIL runs before a waiting one may take it. Python's default (5 ms) would let the
# executor, between two of the model's operators, keep the thread that sends an answer released early from it
# for longer than the whole model takes; 0.2 ms bounds that wait at a tenth of a small model's batch.
GIL_SWITCH_INTERVAL_S = 0.0002
# How long a starting server waits for its first configuration's set to compile (in the worker process) before
# it serves that set eagerly
START_COMPILE_WAIT_S = 300.0


def freeze_startup_objects() -> None:
    """Move every object made while starting (models, compiled sets, the libraries' own) out of the garbage
    collector's reach: a full collection stops every thread, and over them it took 100-200 ms on resnet18-fmnist
    (the event loop's lag reached 205 ms, every request waiting meanwhile); over what serving makes later, it
    takes a few ms. Call it once a process that serves is built, before it serves."""
    gc.collect()
    gc.freeze()


@dataclass(frozen=True)
class ModelSettings:
    slo_ms: float | None = None  # None: twice the model's profiled batch-1 latency
    max_batch: int | None = None  # None: the largest profiled batch size that fits the SLO (Clockwork)
    # Longest the oldest queued input waits for a batch to fill. 0: work-conserving (a free executor takes what
    # is queued at once), which suits latency: on these CPUs a batch of 2 costs nearly two batches of 1.
    max_delay_ms: float = 0.0
    adaptive_batching: bool = True  # Clipper's AIMD on the batch size against the SLO
    max_queue: int = 1024  # inputs waiting; beyond, requests are refused with 503
    # A request's deadline when it brings none (None: no deadline; the bounded queue still sheds). A request
    # that cannot meet its deadline is refused (429) rather than answered late.
    deadline_ms: float | None = None
    torch_threads: int | None = 1  # intra-op threads of the executor; None: torch's default (one per core)
    # Run a torch model's stages as TorchScript where they trace faithfully (bit-equal outputs; see
    # `trace_stages`): eager torch retakes the GIL after every operator, and waits for the event loop to give
    # it back.
    torchscript: bool = True
    vanilla: bool = False  # no ramps, no controller: the original model as any server would run it
    # Active cache ramps learn from every batch's final labels (Freeze's caches, kept current by live traffic).
    cache_updates: bool = True
    # How long a starting server waits for the sets its controller may ask for next to compile (in the worker
    # process) so that it loads them before it serves; the rest load when needed
    preload_s: float = 30.0
    # Where a bundle's executor runs: "process", a process of its own (`serving.executor`), so that the front end's
    # parsing and writing never holds the GIL the model's Python parts need; or "thread", in the server's process
    # (a model built in memory, with no bundle on disk to load, always runs there)
    executor: str = "process"
    controller: ControllerSettings = field(default_factory=ControllerSettings)

    def __post_init__(self) -> None:
        if self.executor not in EXECUTORS:
            raise ValueError(f"executor must be one of {EXECUTORS}, got {self.executor!r}")


class ControlLink(Protocol):
    """Where a worker's batch records go and its configurations come from."""

    def configuration(self) -> Configuration: ...

    def observe(self, record: BatchRecord) -> Configuration | None: ...

    def readings(self) -> dict[str, float]:
        """The controller's gauges (`Controller.readings`)."""

    def refresh(self) -> Configuration | None:
        """A configuration published since this worker last heard (by records of other workers), or None."""

    def status(self, latest_decisions: int | None = None) -> dict:
        """The controller's status (`Controller.status`) with its latest decisions (None: all)."""


class Worker(Protocol):
    """What the front end asks of a served bundle's executor, in this process (`ModelWorker`) or in one of its own
    (`executor.ProcessWorker`). Everything but `launch` and `shutdown` is called on the event loop and returns at
    once."""

    served: ServedModel

    async def launch(self) -> None:
        """Start serving (once the event loop runs)."""

    def submit(self, inputs: Mapping[str, np.ndarray], rows: int, needs_final: bool,
               deadline_ms: float | None = None, priority: int = 0,
               on_final: Callable[[Answer], None] | None = None) -> asyncio.Future:
        """Queue a request; the future resolves with its `Answer`. Raises `Shed` if refused."""

    def count_cached(self, labels: np.ndarray) -> None:
        """Answers the prediction cache gave, for the controller's books."""

    async def current_status(self, latest_decisions: int | None = None) -> dict:
        """The status, with the controller's latest decisions (None: all of them)."""

    async def exported_metrics(self) -> list[dict]:
        """Metric families kept outside the server's registry, as `executor.metric_families` gives them."""

    async def shutdown(self) -> None:
        """Answer everything accepted, then stop."""


class LocalControl:
    """The model's controller in this process, fed by one worker."""

    def __init__(self, controller: Controller) -> None:
        self.controller = controller
        self._lock = threading.Lock()  # the control thread observes while the status endpoint reads

    def configuration(self) -> Configuration:
        with self._lock:
            return self.controller.configuration()

    def observe(self, record: BatchRecord) -> Configuration | None:
        with self._lock:
            return self.controller.observe(record)

    def readings(self) -> dict[str, float]:
        with self._lock:
            return self.controller.readings()

    def refresh(self) -> Configuration | None:
        return None  # this worker's records are the controller's only input

    def status(self, latest_decisions: int | None = None) -> dict:
        with self._lock:
            return self.controller.status(latest_decisions)


class Shed(Exception):
    """A request refused (at admission) or dropped (its deadline passed in the queue)."""

    def __init__(self, status: int, reason: str, message: str, retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.status, self.reason, self.message, self.retry_after_s = status, reason, message, retry_after_s


class ExecutionFailed(Exception):
    """The model raised while running a batch; every request of the batch gets this."""


@dataclass(frozen=True)
class Answer:
    labels: np.ndarray  # (rows,) released label per input
    exit_sites: tuple[str | None, ...]  # per input: the ramp that answered, None for the final layer
    error_scores: tuple[float | None, ...]
    # per input: 1 - error score of the ramp that answered, or the final layer's top softmax probability
    confidences: np.ndarray
    logits: np.ndarray | None  # the original model's, when the request asked for them
    config_version: int
    batch_id: int
    released_at: float  # time.monotonic() in the server when the answer was released

    @property
    def early(self) -> bool:
        return all(site is not None for site in self.exit_sites)


@dataclass(eq=False)
class _Pending:
    inputs: Mapping[str, np.ndarray]
    rows: int
    arrival: float  # time.monotonic()
    deadline: float
    needs_final: bool  # asked for the logits: answered at the end of its batch
    # Called once, on the executor's or the releasing thread, with the request's answer or what failed it:
    # resolves an event loop's future (`future_reply`), or writes to the front end's channel (`executor`)
    reply: Callable[[Answer | BaseException], None]
    # Called on the executor thread with the request's final answer (every row's final label and the logits)
    # once its batch has run to the end, however early its response left: what a prediction cache may keep.
    # When the response carries the final answer, this is called before `reply` gets it
    on_final: Callable[[Answer], None] | None = None
    settled: bool = False

    def settle(self, result: Answer | BaseException) -> None:
        self.settled = True
        self.reply(result)


def future_reply(loop: asyncio.AbstractEventLoop, future: asyncio.Future) -> Callable[[Answer | BaseException], None]:
    """A reply that resolves `future` on its event loop, from any thread."""
    return lambda result: loop.call_soon_threadsafe(_set_future, future, result)


def _set_future(future: asyncio.Future, result: Answer | BaseException) -> None:
    if future.done():  # the client went away and its handler was cancelled
        return
    if isinstance(result, BaseException):
        future.set_exception(result)
    else:
        future.set_result(result)


class _BatchState:
    """One batch's ramp outputs, exits and answers. `ramp` runs on the executor (eager path, and the record's
    pass after the run) or on the releasing thread while the model runs (compiled path), never on both at once
    (`RampSignals` holds its lock around the releasing thread's calls, and `end` waits for them)."""

    def __init__(self, config: Configuration, batch: list[_Pending], batch_id: int, answer_time: object) -> None:
        self.config, self.batch, self.batch_id, self.answer_time = config, batch, batch_id, answer_time
        self.starts = np.cumsum([0] + [p.rows for p in batch])[:-1]
        self.n = int(self.starts[-1] + batch[-1].rows)
        r = len(config.sites)
        self.labels = np.zeros((self.n, r), dtype=np.int64)
        self.errors = np.ones((self.n, r))
        self.exits = np.full(self.n, NO_EXIT)  # where each input's released answer came from
        self.scored = np.zeros(r, dtype=bool)
        self.column = {site: j for j, site in enumerate(config.sites)}
        self.thresholds = np.array(config.thresholds)
        # Stop mode (a run whose exited inputs leave the batch), set by `stopped`: per input, the column (in this
        # state's order) of the ramp it left the batch at, NO_EXIT where it ran to the end; the feedback sample;
        # the inputs kept to the end whatever the draw (their request wants the logits); the columns whose ramp
        # cannot stop an input (it runs in Python)
        self.left: np.ndarray | None = None
        self.sample: np.ndarray | None = None
        self.wants_final: np.ndarray | None = None
        self.unstoppable: list[int] = []

    def ramp(self, j: int, ramp_labels: np.ndarray, ramp_errors: np.ndarray) -> None:
        """Ramp j's outputs: inputs not answered yet whose error score is under its threshold exit there, and
        requests whose every input has exited are answered (unless they wait for the logits)."""
        self.labels[:, j], self.errors[:, j] = ramp_labels, ramp_errors
        self.scored[j] = True
        leaving = (self.exits == NO_EXIT) & exit_rule.exits(ramp_errors, self.thresholds[j]) & self._open_rows()
        if not leaving.any():
            return
        self.exits[leaving] = j
        decided = np.logical_and.reduceat(self.exits != NO_EXIT, self.starts)
        for index, pending in enumerate(self.batch):
            if decided[index] and not pending.settled and not pending.needs_final:
                self._answer(pending, int(self.starts[index]), None, None, None)

    def site_ramp(self, site: str, ramp_labels: np.ndarray, ramp_errors: np.ndarray) -> None:
        self.ramp(self.column[site], ramp_labels, ramp_errors)

    def stopped(self, left: np.ndarray) -> int:
        """Stop mode, once the run is over: `left` holds per input the column it left the batch at (NO_EXIT: it
        ran to the end). An input leaves only where the release test certainly passes, and that ramp's column
        was handed to `ramp` before the run ended, so every one has been released; one that somehow was not is
        released now, at the ramp it left at (it has no final answer to wait for). Returns how many were not."""
        self.left = left
        lost = (left != NO_EXIT) & (self.exits == NO_EXIT)
        if not lost.any():
            return 0
        count = int(lost.sum())
        log.warning("%d inputs left their batch at a ramp without being released there; released now", count)
        self.exits[lost] = left[lost]
        decided = np.logical_and.reduceat(self.exits != NO_EXIT, self.starts)
        for index, pending in enumerate(self.batch):
            if decided[index] and not pending.settled and not pending.needs_final:
                self._answer(pending, int(self.starts[index]), None, None, None)
        return count

    def _open_rows(self) -> np.ndarray:
        """Inputs of requests not answered yet (a request answered with the final layer's labels keeps them)."""
        return np.repeat([not p.settled for p in self.batch], [p.rows for p in self.batch])

    def finish(self, final: np.ndarray, final_errors: np.ndarray, logits: np.ndarray) -> None:
        """Answer every request still open with the final layer's answers (in stop mode, an input that left the
        batch has none, NO_LABEL: it keeps the answer it left with)."""
        for index, pending in enumerate(self.batch):
            if not pending.settled:
                self._answer(pending, int(self.starts[index]), final, final_errors, logits)

    def _answer(self, pending: _Pending, start: int, final: np.ndarray | None, final_errors: np.ndarray | None,
                logits: np.ndarray | None) -> None:
        rows = np.arange(start, start + pending.rows)
        config = self.config
        if final is None:  # every input of the request exited at a ramp
            at = self.exits[rows]
            released, released_errors = self.labels[rows, at], self.errors[rows, at]
        else:
            # Released after the final layer (it asked for the logits, or a row did not exit): every row gets
            # the final answer, which it has waited for and which a ramp's can only differ from; the record
            # then counts those rows as final answers, since the controller must judge what was released.
            released, released_errors = final[rows], final_errors[rows]
            if self.left is not None and (gone := self.left[rows] != NO_EXIT).any():
                # Stop mode: a row that left the batch has no final answer; it keeps the one it left with
                at = np.where(gone, self.exits[rows], NO_EXIT)
                released = np.where(gone, self.labels[rows, at], released)
                released_errors = np.where(gone, self.errors[rows, at], released_errors)
            else:
                at = np.full(len(rows), NO_EXIT)
            self.exits[rows] = at
        now = time.monotonic()
        pending.settle(Answer(
            labels=released,
            exit_sites=tuple(None if j == NO_EXIT else config.sites[j] for j in at),
            error_scores=tuple(None if j == NO_EXIT else float(self.errors[i, j]) for i, j in zip(rows, at)),
            confidences=1.0 - released_errors,
            logits=None if logits is None or not pending.needs_final else logits[rows],
            config_version=config.version, batch_id=self.batch_id, released_at=now))
        self.answer_time.observe(now - pending.arrival)


@dataclass(eq=False)
class _Answered:
    """A batch whose answers are out, for its books: the ramps not scored during the run (their columns, and a
    copy of their logits), the final labels and the batch's times."""

    state: _BatchState
    final: np.ndarray
    unscored: list[int]
    late: np.ndarray | None
    started: float
    finished: float
    oldest_arrival: float
    feedback_share: float = 1.0  # stop mode: each input's chance to be kept running to the end (else 1)
    # Stop mode: per unscored column, the inputs that reached that ramp (the others left the batch before)
    unscored_rows: list[np.ndarray] | None = None

    def released_a_disagreement(self) -> bool:
        """Whether some input left at a ramp with another answer than the final layer's (where that is known: in
        stop mode an input that left the batch has none)."""
        exits = self.state.exits
        rows = np.flatnonzero((exits != NO_EXIT) & (self.final != NO_LABEL))
        return bool(np.any(self.state.labels[rows, exits[rows]] != self.final[rows]))


class RampSignals:
    """The pipe a compiled run's ramps write their column to where some input may exit (see `ramps.fused`), and
    the releasing thread that reads it and hands each column to the batch in progress, so that early answers
    leave while the model runs on, from the other core. Columns are read only under the lock, and `end` takes
    what is left before the next batch begins, so that no column reaches a batch it does not belong to."""

    def __init__(self, name: str) -> None:
        self._read_fd, self.write_fd = os.pipe()
        os.set_blocking(self._read_fd, False)
        self._lock = threading.Lock()
        self._on_column: Callable[[int], None] | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._listen, name=f"releaser-{name}", daemon=True)
        self._thread.start()

    def begin(self, on_column: Callable[[int], None]) -> None:
        with self._lock:
            self._on_column = on_column

    def end(self) -> bytes:
        """The run is over: wait for the column being handled; returns the columns signalled but not taken, which
        the caller handles itself, so that what a batch answers never depends on this thread's timing."""
        with self._lock:
            self._on_column = None
            return self._take()

    def close(self) -> None:
        with self._lock:
            self._closed = True
        os.close(self.write_fd)  # wakes the thread, which closes the read end
        self._thread.join()

    def _take(self) -> bytes:
        try:
            return os.read(self._read_fd, 4096)
        except BlockingIOError:
            return b""

    def _listen(self) -> None:
        with selectors.DefaultSelector() as selector:
            selector.register(self._read_fd, selectors.EVENT_READ)
            while True:
                selector.select()
                with self._lock:
                    if self._closed:
                        os.close(self._read_fd)
                        return
                    columns = self._take()
                    if self._on_column is None:
                        continue
                    try:
                        for column in columns:
                            self._on_column(column)
                    except Exception:  # the executor answers what was not released, with the final layer's answers
                        log.exception("releasing early answers failed; they are answered at the end of the batch")
                        self._on_column = None


class ModelWorker:
    def __init__(self, served: ServedModel, settings: ModelSettings, metrics: ServerMetrics,
                 control: ControlLink | None = None) -> None:
        """`control`: the model's controller (default: one of its own in this process; none when vanilla)."""
        self.served = served
        self.settings = settings
        self.metrics = metrics
        profile = served.model.profile
        if profile is None:
            raise ValueError(f"model {served.name} has no latency profile; run `rampserve profile` on its bundle")
        self.slo_ms = settings.slo_ms or 2.0 * profile.full(1)
        self.max_batch = settings.max_batch or max_batch_for_slo(profile.batch_sizes, profile.full_ms, self.slo_ms)
        self.deadline_ms = settings.deadline_ms
        self.batch_size = AdaptiveBatchSize(self.max_batch, self.slo_ms,
                                            limit=1.0 if settings.adaptive_batching else float(self.max_batch))
        self.batch_time = BatchTimeEstimate(profile.full(self.max_batch))
        if control is None and not settings.vanilla:
            control = LocalControl(Controller(profile, settings.controller))
        self.control = control
        # The configuration in force and the compiled set it runs (None: eager), swapped as one reference
        initial = Configuration(0, (), ()) if control is None else control.configuration()
        self._serving: tuple[Configuration, CompiledSet | None] = (initial, None)
        # A configuration the controller chose whose set is still compiling; the executor keeps the one in force
        self._pending: Configuration | None = None
        model = served.model
        # The exit mode, and the one compiled sets are made in: stop mode needs a torch model's compiled runner;
        # an ONNX model (and a vanilla one, which has no ramps) serves it as release mode
        self.exit_mode, self.feedback_share = settings.controller.exit_mode, settings.controller.feedback_share
        self._mode = "stop" if (self.exit_mode == "stop" and control is not None and settings.torchscript
                                and model.compiles_to_torchscript) else "release"
        if self.exit_mode == "stop" and self._mode != "stop" and control is not None:
            log.info("model %s: exit mode 'stop' needs a torch model's compiled path; every input runs to the end, "
                     "as in release mode", served.name)
        self._told_eager = False  # whether stop mode on the eager path was logged
        self._feedback = np.random.default_rng()  # stop mode's feedback sample: uniform, whatever the scores
        self.stopped_rows = 0  # inputs that left their batch at a ramp (stop mode)
        self._compiler = CompileService(model, served.example, self._compile_finished, self._mode) if (
            settings.torchscript and model.compiles_to_torchscript and model.bundle_dir is not None) else None
        # Compiled runs with ramps report where inputs may exit through a pipe, read by a releasing thread; the
        # ramp operators are loaded now, before serving, not with the first set that needs them
        self._signals = RampSignals(served.name) if (
            settings.torchscript and control is not None
            and (kernel.available() or not model.compiles_to_torchscript)) else None
        self.batches = 0  # run (each one's id is the count before it)
        # The version whose batches the executor is counting, and how many it has run, for its shadow batches
        self._counted_version: int | None = None
        self._version_batches = 0
        self.shadow_batches = 0
        self.shadow_batches_skipped = 0  # its set was not loaded yet: served plainly
        # The shadow sites and their set (None: eager) that shadow batches run, once loaded by the control thread:
        # the same whatever the configuration's thresholds, so one load serves every later configuration
        self._shadow_set: tuple[tuple[str, ...], CompiledSet | None] | None = None
        self.batches_booked = 0  # counted in the books, which lag the runs by a batch or two
        self.inputs_served = 0
        self.requests_served = 0
        # Answers given, one per input, by the path they took: what /status and /metrics report as the books
        self.answers = dict.fromkeys(ANSWER_PATHS, 0)
        self._answers_lock = threading.Lock()
        self.exits: dict[str, int] = {}  # inputs of booked batches by the site that answered ("final": the last layer)
        self.recent_batches: deque[dict] = deque(maxlen=RECENT_BATCHES)
        self._published_sites: tuple[str, ...] = ()
        # Told of every configuration the executor adopts (an executor process tells its front end)
        self.on_configuration: Callable[[Configuration], None] | None = None
        # In an executor process, what the executor thread calls while it waits for work (at most the given seconds;
        # None: until something comes): it reads the front end's requests and admits them itself, so that a request
        # reaching an idle executor starts at once, without waking a thread (a condition's wake-up took 130 us)
        self.feed: Callable[[float | None], None] | None = None
        self._heap: list[tuple[int, int, _Pending]] = []
        self._order = itertools.count()
        self._rows_queued = 0
        self._running = False
        self._stopping = False
        self._cond = threading.Condition()
        self._records: queue.SimpleQueue[BatchRecord | CompileOutcome | None] = queue.SimpleQueue()
        self._labels = {"model": served.name}
        self._executor = threading.Thread(target=self._serve_batches, name=f"executor-{served.name}", daemon=True)
        # A vanilla model has no controller to feed
        self._control = None if control is None else threading.Thread(
            target=self._control_loop, args=(control,), name=f"controller-{served.name}", daemon=True)

    @property
    def configuration(self) -> Configuration:
        return self._serving[0]

    @property
    def compiled(self) -> bool:
        """Whether the configuration in force runs compiled."""
        return self._serving[1] is not None

    def start(self) -> None:
        config = self.configuration
        if self._compiler is not None and not self._compiler.wait(config.sites, START_COMPILE_WAIT_S):
            log.warning("model %s: its first set did not compile within %.0f s; serving it eagerly meanwhile",
                        self.served.name, START_COMPILE_WAIT_S)
        if not self._ready(config):
            self._pending = config  # the control thread adopts it compiled once it is
        self._adopt(config)
        if self._compiler is not None and self.control is not None:
            self._preload(config.sites)
            self._load_shadow_set(config)  # preloaded now, if the compile was in time
        self._executor.start()
        if self._control is not None:
            self._control.start()

    def stop(self) -> None:
        """Answer everything accepted, then stop both threads."""
        self.request_stop()
        self._executor.join()
        if self._control is not None:
            self._records.put(None)
            self._control.join()
        if self._compiler is not None:
            self._compiler.close()
        if self._signals is not None:
            self._signals.close()

    # ---- admission (event loop thread) -------------------------------------------------------------------

    def submit(self, inputs: Mapping[str, np.ndarray], rows: int, needs_final: bool,
               deadline_ms: float | None = None, priority: int = 0,
               on_final: Callable[[Answer], None] | None = None) -> asyncio.Future:
        """Queue a request from the event loop; the future resolves with its answer. Raises `Shed` if refused."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self.admit(inputs, rows, needs_final, future_reply(loop, future), deadline_ms, priority, on_final)
        return future

    def admit(self, inputs: Mapping[str, np.ndarray], rows: int, needs_final: bool,
              reply: Callable[[Answer | BaseException], None], deadline_ms: float | None = None, priority: int = 0,
              on_final: Callable[[Answer], None] | None = None, arrival: float | None = None) -> None:
        """Queue a request from any thread; `reply` gets its answer once. Raises `Shed` if refused. `arrival`: when
        it reached the server (`time.monotonic()`, the same clock in every process), if before now."""
        now = time.monotonic()
        arrival = now if arrival is None else min(arrival, now)
        budget_ms = self.deadline_ms if deadline_ms is None else deadline_ms
        with self._cond:
            if self._stopping:
                raise Shed(503, "shutdown", "the server is shutting down")
            if self._rows_queued + rows > self.settings.max_queue:
                self._shed("queue_full")
                raise Shed(503, "queue_full", f"model {self.served.name}: queue full "
                           f"({self._rows_queued} inputs waiting, at most {self.settings.max_queue})", 1)
            if self._rows_queued or self._running:
                wait_ms = expected_wait_ms(self._rows_queued, self.batch_size.size, self.batch_time.ms,
                                           self._running)
            else:
                # Idle: the profiled time, not the running estimate, which learns only from batches that run
                # and, once one slow batch raised it past the deadline, would otherwise refuse forever.
                wait_ms = self.served.model.profile.full(rows)
            wait_ms += (now - arrival) * 1000.0  # already spent on the way here
            if budget_ms is not None and wait_ms > budget_ms:
                self._shed("deadline")
                raise Shed(429, "deadline", f"model {self.served.name}: expected answer in {wait_ms:.1f} ms, "
                           f"after the request's deadline of {budget_ms:.1f} ms",
                           max(1, math.ceil(wait_ms / 1000.0)))
            deadline = math.inf if budget_ms is None else arrival + budget_ms / 1000.0
            pending = _Pending(inputs, rows, arrival, deadline, needs_final, reply, on_final)
            heapq.heappush(self._heap, (-priority, next(self._order), pending))
            self._rows_queued += rows
            self.metrics.queued.labels(**self._labels).set(self._rows_queued)
            self._cond.notify()

    def _shed(self, reason: str) -> None:
        self.metrics.shed.labels(reason=reason, **self._labels).inc()

    # ---- batching and execution (executor thread) ----------------------------------------------------------

    def _serve_batches(self) -> None:
        # The executor is the only thread that runs the model; the event loop and the controller need a core too,
        # and torch's intra-op threads contending with them made a batch of one 1.5-3x slower on two cores.
        if self.settings.torch_threads is not None:
            torch.set_num_threads(self.settings.torch_threads)
        # Inference mode for the thread's life rather than per batch: the runner's operators skip autograd, and
        # the batch's path takes one step fewer
        with torch.inference_mode():
            self._serve_until_stopped()

    def _serve_until_stopped(self) -> None:
        while (batch := self._next_batch()) is not None:
            try:
                self._run(batch)
            except Exception as exc:  # a model failure must not strand the batch's requests
                log.exception("model %s failed on a batch of %d", self.served.name, len(batch))
                for pending in batch:
                    if not pending.settled:
                        pending.settle(ExecutionFailed(f"model {self.served.name} failed: {exc}"))
            finally:
                with self._cond:
                    self._running = False

    def _next_batch(self) -> list[_Pending] | None:
        """Wait for a batch: full at the current size, or the oldest input's delay spent, or shutting down."""
        with self._cond:
            if self.feed is not None:
                self.feed(0.0)  # what came while the last batch ran
            while True:
                if self._heap:
                    size = self.batch_size.size
                    oldest = min(p.arrival for _, _, p in self._heap)
                    wait = oldest + self.settings.max_delay_ms / 1000.0 - time.monotonic()
                    if self._rows_queued >= size or wait <= 0 or self._stopping:
                        break
                    self._wait_for_work(wait)
                elif self._stopping:
                    return None
                else:
                    self._wait_for_work(None)
            batch, rows, now = [], 0, time.monotonic()
            while self._heap and (not batch or rows + self._heap[0][2].rows <= size):
                pending = heapq.heappop(self._heap)[2]
                self._rows_queued -= pending.rows
                if pending.deadline < now:
                    self._shed("expired")
                    pending.settle(Shed(503, "expired", f"model {self.served.name}: the request's deadline "
                                        "passed while it waited in the queue"))
                    continue
                batch.append(pending)
                rows += pending.rows
            self._running = bool(batch)
            self.metrics.queued.labels(**self._labels).set(self._rows_queued)
        return batch

    def _wait_for_work(self, timeout: float | None) -> None:
        """Wait (holding the queue's lock, which the executor's own admissions take again) for requests, or the
        given time: the front end's, read here where a feed is set, else queued by another thread's `admit`."""
        if self.feed is not None:
            self.feed(timeout)
        else:
            self._cond.wait(timeout)

    def wait_stopped(self) -> None:
        """Wait until the executor has answered everything and ended (after `request_stop`)."""
        self._executor.join()

    def request_stop(self) -> None:
        """Refuse new requests; the executor answers those queued, then ends."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()

    def _run(self, batch: list[_Pending]) -> None:
        if not batch:
            return
        config, compiled = self._serving
        shadow = self._shadow_batch(config)
        if shadow is not None:
            config, compiled = shadow
        model = self.served.model
        feeds = stack_inputs(self.served.inputs, [p.inputs for p in batch])
        state = _BatchState(config, batch, self.batches, self.metrics.answer.labels(**self._labels))
        self.batches += 1
        stops = compiled is not None and compiled.stops
        started = time.monotonic()
        for pending in batch:
            self.metrics.queue.labels(**self._labels).observe(started - pending.arrival)
        try:
            if compiled is None:
                if self._mode == "stop" and config.sites and not self._told_eager:
                    self._told_eager = True
                    log.info("model %s: a set served eagerly (it does not compile) runs every input to the end, "
                             "as in release mode", self.served.name)
                logits = model.run_eager(feeds, config.sites, state.site_ramp if config.sites else None)
            else:
                # The releasing thread scores each column a ramp reports (one where some input may exit) and
                # releases what exits there while the model runs on; what it has not taken when the run ends, this
                # thread handles; the other columns are scored for the record once every answer is out
                outputs = model.ramp_outputs(compiled, state.n)
                columns = [state.column[site] for site in compiled.sites]
                signals = self._signals if config.sites else None  # a vanilla set has no ramp to report

                def ramp(j: int) -> None:
                    state.ramp(columns[j], *outputs.scores(j))

                if signals is not None:
                    signals.begin(ramp)
                thresholds = config.thresholds if config.sites == compiled.sites else \
                    tuple(config.thresholds[j] for j in columns)
                if stops:  # the feedback sample, drawn before the run whatever the scores, and the logits' rows
                    # (a shadow batch keeps every input: none stops, so each is observed)
                    state.sample = np.ones(state.n, dtype=bool) if shadow is not None else \
                        self._feedback.random(state.n) < self.feedback_share
                    state.wants_final = np.repeat([p.needs_final for p in batch], [p.rows for p in batch])
                    state.unstoppable = [columns[j] for j, fused in enumerate(compiled.fused) if not fused]
                    keep = state.sample | state.wants_final
                try:
                    if stops:
                        output, ran = model.run_stopping(compiled, feeds, outputs, thresholds,
                                                         -1 if signals is None else signals.write_fd, keep)
                    else:
                        logits = model.run_compiled(compiled, feeds, outputs, thresholds,
                                                    -1 if signals is None else signals.write_fd)
                finally:
                    left = b"" if signals is None else signals.end()
                for j in left:
                    ramp(j)
                if stops:  # a ramp that stopped inputs signalled: scored already, unless something went wrong
                    for j in np.unique(outputs.buffers.left[outputs.buffers.left >= 0]):
                        if not state.scored[columns[j]]:
                            ramp(int(j))
        except Exception:
            self._record_unverified(state, started)
            raise
        if stops:
            final, final_errors, logits = self._stopped(state, compiled, outputs.buffers.left, columns, output, ran)
        else:
            final, final_errors = top_label_and_error(logits)
        # A request still open is answered now with its batch's final answer: that answer is kept (the prediction
        # cache) before the response that carries it is sent, so a repeat sent once the response is back finds it.
        # A request released early at a ramp got the ramp's label; its final answer, known only now, is kept after
        # the open ones are answered (off their path): caches keep final answers alone, never a ramp's label,
        # which thresholds move and a cache would replay unchecked, so its repeat may come before it is kept
        released_early = [pending.settled for pending in batch]
        self._keep_finals(state, [not early for early in released_early], final, final_errors, logits, stops)
        state.finish(final, final_errors, logits)
        finished = time.monotonic()
        # The ramps no input exited at are scored for the record by the control thread, from a copy of their
        # logits: the buffer is this thread's next batch's
        unscored = [] if compiled is None else [(state.column[site], j) for j, site in enumerate(compiled.sites)
                                                if not state.scored[state.column[site]]]
        late = None if not unscored else outputs.buffers.logits[:, [j for _, j in unscored]].copy()
        self._keep_finals(state, released_early, final, final_errors, logits, stops)
        if self.settings.cache_updates and config.sites:  # after every answer is out: off the requests' path
            # In stop mode a cache ramp evaluated the rows still in the batch at its site, and learns from those
            # that ran to the end
            model.learn(final, {site: outputs.buffers.reached(j) for j, site in enumerate(compiled.sites)}
                        if stops else None)
        done = _Answered(state, final, [column for column, _ in unscored], late, started, finished,
                         min(p.arrival for p in batch))
        if stops:
            done.feedback_share = 1.0 if shadow is not None else self.feedback_share
            done.unscored_rows = [outputs.buffers.reached(j) for _, j in unscored]
        if self._control is not None:  # the books, off this thread: the next batch is waiting
            self._records.put(done)
        else:
            self._book(done)

    @staticmethod
    def _keep_finals(state: _BatchState, which: list[bool], final: np.ndarray, final_errors: np.ndarray,
                     logits: np.ndarray, stops: bool) -> None:
        """Hand the final answers of the batch's requests marked in `which` to their `on_final`, where they have one
        (in stop mode a request one of whose rows left the batch has none: it is skipped)."""
        now = time.monotonic()
        for index, pending in enumerate(state.batch):
            if not which[index] or pending.on_final is None:
                continue
            rows = slice(int(state.starts[index]), int(state.starts[index]) + pending.rows)
            if stops and np.any(final[rows] == NO_LABEL):  # a row left the batch: no final answer to keep
                continue
            pending.on_final(Answer(final[rows], (None,) * pending.rows, (None,) * pending.rows,
                                    1.0 - final_errors[rows], logits[rows], state.config.version, state.batch_id,
                                    now))

    def _shadow_batch(self, config: Configuration) -> tuple[Configuration, CompiledSet | None] | None:
        """Count the batch about to run under `config`; where it is a shadow batch whose set is loaded, what it runs
        instead (the shadowed configuration and that set). One whose set is not is served plainly, and counted."""
        if config.version != self._counted_version:
            self._counted_version, self._version_batches = config.version, 0
        index = self._version_batches
        self._version_batches += 1
        if not config.is_shadow_batch(index):
            return None
        shadow_set = self._shadow_set  # one read: the control thread may replace it
        if shadow_set is None or shadow_set[0] != config.shadow_sites:
            self.shadow_batches_skipped += 1
            self.metrics.shadow_batches.labels(outcome="skipped", **self._labels).inc()
            return None
        self.shadow_batches += 1
        self.metrics.shadow_batches.labels(outcome="served", **self._labels).inc()
        return config.shadowed(), shadow_set[1]

    @staticmethod
    def _stopped(state: _BatchState, compiled: CompiledSet, left: np.ndarray, columns: list[int], output: np.ndarray,
                 ran: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """A stop-mode run's final labels, error scores and logits for the whole batch from `output`, the rows
        `ran` that ran to the end: NO_LABEL, NaN and NaN for the others, whose exits (`left`, per row the set's
        column it left at) the state takes in its own columns."""
        n = state.n
        state.stopped(np.asarray([*columns, NO_EXIT])[left])  # -1 (ran to the end): the last entry
        logits = np.full((n, *output.shape[1:]) if len(ran) else (n, compiled.classes), np.nan, dtype=np.float32)
        final, final_errors = np.full(n, NO_LABEL), np.full(n, np.nan)
        if len(ran):
            logits[ran] = output
            final[ran], final_errors[ran] = top_label_and_error(output)
        return final, final_errors, logits

    def _record_unverified(self, state: _BatchState, started: float) -> None:
        """The model failed after some answers left at a ramp: the controller still hears of them, as answers
        that could not be checked (it counts them as disagreements)."""
        batch = state.batch
        rows = np.concatenate([np.arange(start, start + p.rows) for start, p in zip(state.starts, batch) if p.settled]
                              or [np.zeros(0, dtype=int)])
        self.count_answers("unverified", len(rows))  # before the controller can hear of them
        if self.control is None or not len(rows):
            return
        self._records.put(BatchRecord(state.config.version, state.config.sites, state.labels[rows],
                                      state.errors[rows], np.full(len(rows), NO_LABEL), state.exits[rows],
                                      (started - min(p.arrival for p in batch)) * 1000.0,
                                      (time.monotonic() - started) * 1000.0, unverified=True))

    def _book(self, done: _Answered) -> BatchRecord | None:
        """A batch's books once its answers are out (on the control thread where there is one): the ramps not
        scored yet, counts, metrics and the record for the controller."""
        state = done.state
        for k, column in enumerate(done.unscored):
            if done.unscored_rows is None:
                state.labels[:, column], state.errors[:, column] = top_label_and_error(done.late[:, k],
                                                                                       self.served.model.error_score)
                continue
            # Stop mode: the rows that left the batch before this ramp never reached it
            rows = done.unscored_rows[k]
            state.labels[:, column], state.errors[:, column] = NO_LABEL, np.nan
            if len(rows):
                state.labels[rows, column], state.errors[rows, column] = top_label_and_error(
                    done.late[rows, k], self.served.model.error_score)
        config, exits, n = state.config, state.exits, state.n
        compute_ms = (done.finished - done.started) * 1000.0
        queue_ms = (done.started - done.oldest_arrival) * 1000.0
        self.batch_size.observe(n, compute_ms)
        self.batch_time.observe(compute_ms * self.batch_size.size / n)
        self.batches_booked += 1
        self.inputs_served += n
        self.requests_served += len(state.batch)
        early = int((exits != NO_EXIT).sum())
        self.count_answers("early", early)
        self.count_answers("final", n - early)
        stopped = 0 if state.left is None else int((state.left != NO_EXIT).sum())
        self.stopped_rows += stopped
        self.recent_batches.append({"id": state.batch_id, "size": n, "config_version": config.version,
                                    "started": done.started, "finished": done.finished, "queue_ms": queue_ms,
                                    "compute_ms": compute_ms, "early": early, "stopped": stopped})
        m, labels_ = self.metrics, self._labels
        if stopped:
            m.stopped_rows.labels(**labels_).inc(stopped)
        m.compute.labels(**labels_).observe(compute_ms / 1000.0)
        m.batch_size.labels(**labels_).observe(n)
        m.batch_limit.labels(**labels_).set(self.batch_size.size)
        sites, counts = np.unique(exits, return_counts=True)
        for j, count in zip(sites, counts):
            site = "final" if j == NO_EXIT else config.sites[j]
            self.exits[site] = self.exits.get(site, 0) + int(count)
            m.exits.labels(site=site, **labels_).inc(int(count))
        if self.control is None:
            return None
        return BatchRecord(config.version, config.sites, state.labels, state.errors, done.final, exits, queue_ms,
                           compute_ms, feedback_share=done.feedback_share,
                           forced=None if state.wants_final is None else
                           state.wants_final | np.isin(exits, state.unstoppable))

    def count_answers(self, path: str, inputs: int) -> None:
        """Count answers given by `path` (early, final, cached, unverified), one per input; any thread."""
        if inputs:
            with self._answers_lock:
                self.answers[path] += inputs
            self.metrics.answers.labels(path=path, **self._labels).inc(inputs)

    def count_cached(self, labels: np.ndarray) -> None:
        """Answers the prediction cache gave (final labels): counted here and, through the control thread, by
        the controller, whose accuracy covers every answer released."""
        self.count_answers("cached", len(labels))
        if self.control is not None:
            config = self.configuration
            n = len(labels)
            self._records.put(BatchRecord(config.version, (), np.zeros((n, 0), dtype=np.int64), np.zeros((n, 0)),
                                          np.asarray(labels), np.full(n, NO_EXIT), cached=True))

    # ---- control (controller thread) -------------------------------------------------------------------------

    def _control_loop(self, control: ControlLink) -> None:
        while True:
            try:
                items = [self._records.get(timeout=CONTROL_POLL_S)]
            except queue.Empty:  # idle: a controller shared with other workers may have moved on without us
                new = control.refresh()
            else:
                # Whatever queues within a few milliseconds is learnt from at once: woken for every batch, under
                # load at batch 1, this thread took 14% of the process's time, most of it waiting for the GIL. But
                # an answer released wrongly is learnt from at once: every batch the gathering lets run with the
                # same thresholds can release more
                first = items[0]
                if not (isinstance(first, BatchRecord) and first.unverified
                        or isinstance(first, _Answered) and first.released_a_disagreement()):
                    time.sleep(CONTROL_GATHER_S)
                while True:
                    try:
                        items.append(self._records.get_nowait())
                    except queue.Empty:
                        break
                records = [self._book(item) if isinstance(item, _Answered) else item for item in items]
                records = [item for item in records if isinstance(item, BatchRecord)]
                new = None
                for record in merged(records):
                    new = control.observe(record) or new
                if records:
                    self.metrics.set_readings(self._labels, control.readings())
                if None in items:  # stopping: the executor has answered and recorded its last batch
                    return
            if new is not None:
                self._pending = new
            pending = self._pending
            if pending is not None and self._ready(pending):
                self._pending = None
                self._adopt(pending)
            self._load_shadow_set(self.configuration)

    def _compile_finished(self, outcome: CompileOutcome) -> None:
        """From the compile service's thread: count it and wake the control thread, which may adopt a pending
        configuration now."""
        self.metrics.compiles.labels(outcome=outcome.outcome, **self._labels).inc()
        self.metrics.compile_time.labels(**self._labels).observe(outcome.seconds)
        self._records.put(outcome)

    def _preload(self, active: tuple[str, ...]) -> None:
        """Compile the sets the controller's next decisions may ask for and load them before serving starts: a
        load holds the GIL for 10-25 ms on the zoo's CNNs (measured), which would stall the event loop if it came
        with a configuration change under load. Waits at most `preload_s`; later sets go on compiling in the
        background and load when they are needed."""
        model = self.served.model
        # The set of every site first: shadow batches run it, and a controller warming up asks for them at once
        upcoming = list(dict.fromkeys([tuple(model.site_names), *likely_next_sets(active, model.site_names)]))
        upcoming = upcoming[:COMPILED_SETS_KEPT - 1]
        for sites in upcoming:
            self._compiler.request(sites)
        deadline = time.monotonic() + self.settings.preload_s
        for sites in upcoming:
            if self._compiler.wait(sites, deadline - time.monotonic(), urgent=False):
                self._ready(Configuration(0, sites, (0.0,) * len(sites)))

    def _ready(self, config: Configuration, urgent: bool = True) -> bool:
        """Whether `config` can run now: its compiled set is loaded (the compile service's set on disk, loaded
        here, in the control thread), or it does not compile and runs eagerly. A set still compiling is
        asked for (urgently, unless told otherwise) and the configuration waits; the executor serves the one in
        force meanwhile."""
        model = self.served.model
        if not self.settings.torchscript or model.has_compiled(config.sites, self._mode):
            return True
        if self._compiler is None:  # a model not loaded from a bundle: no worker process can load it
            model.compile(config.sites, self.served.example, self._mode)
            return True
        if not self._compiler.ready(config.sites):
            self._compiler.request(config.sites, urgent=urgent)
            return False
        try:
            model.install(config.sites, self._compiler.load(config.sites), self._mode)
        except KeyError:  # a corrupt stage was removed and is compiling again
            return False
        self.metrics.compiles.labels(outcome="loaded", **self._labels).inc()
        return True

    def _load_shadow_set(self, config: Configuration) -> None:
        """Where `config` has shadow batches, load the set they run once it is ready (asked for, not urgently:
        the configuration is in force, only its shadow batches wait, served plainly meanwhile)."""
        if not config.shadow_every or (self._shadow_set is not None and self._shadow_set[0] == config.shadow_sites):
            return
        shadowed = config.shadowed()
        if self._ready(shadowed, urgent=False):
            self._shadow_set = (shadowed.sites, self.served.model.compiled_set(shadowed.sites, self._mode)
                                if self.settings.torchscript else None)

    def _adopt(self, config: Configuration) -> None:
        compiled = self.served.model.compiled_set(config.sites, self._mode) if self.settings.torchscript else None
        self._load_shadow_set(config)  # before the swap: the new configuration's first batch is a shadow batch
        self._serving = (config, compiled)  # the executor reads it at its next batch
        self.metrics.config_changes.labels(**self._labels).inc()
        self._publish(config)

    def _publish(self, config: Configuration) -> None:
        if self.on_configuration is not None:
            self.on_configuration(config)
        m = self.metrics
        m.config_version.labels(**self._labels).set(config.version)
        for site in self._published_sites:
            m.threshold.remove(self.served.name, site)
        self._published_sites = config.sites
        for site, threshold in zip(config.sites, config.thresholds):
            m.threshold.labels(site=site, **self._labels).set(threshold)

    # ---- status --------------------------------------------------------------------------------------------

    async def launch(self) -> None:
        self.start()

    async def shutdown(self) -> None:
        await asyncio.to_thread(self.stop)

    async def current_status(self, latest_decisions: int | None = None) -> dict:
        return {**self.status(latest_decisions), "executor": {"kind": "thread", "pid": os.getpid()}}

    async def exported_metrics(self) -> list[dict]:
        return []  # its metrics are the server's own

    def status(self, latest_decisions: int | None = None) -> dict:
        status = {
            "name": self.served.name,
            "version": self.served.version,
            "vanilla": self.control is None,
            "slo_ms": self.slo_ms,
            "max_batch": self.max_batch,
            "batch_limit": self.batch_size.size,
            "max_delay_ms": self.settings.max_delay_ms,
            "compiled": self.compiled,
            "exit_mode": self.exit_mode,
            "feedback_share": self.feedback_share,
            # whether the set in force takes exited inputs out of their batch (stop mode on a compiled torch set)
            "stopping": self._serving[1] is not None and self._serving[1].stops,
            "stopped_inputs": self.stopped_rows,
            "pending_configuration": None if self._pending is None else self._pending.to_json(),
            "deadline_ms": self.deadline_ms,
            "queued_inputs": self._rows_queued,
            "batches": self.batches,
            # batches that evaluated every site's ramp for the controller, and those served plainly instead
            "shadow_batches": self.shadow_batches,
            "shadow_batches_skipped": self.shadow_batches_skipped,
            "batches_booked": self.batches_booked,
            "requests": self.requests_served,
            "inputs": self.inputs_served,
            "answers": dict(self.answers),
            "exits": dict(self.exits),
            "mean_batch_size": self.inputs_served / self.batches_booked if self.batches_booked else None,
            "configuration": self.configuration.to_json(),
            "recent_batches": list(self.recent_batches),
        }
        if self.control is not None:
            status.update(self.control.status(latest_decisions))
        return status
