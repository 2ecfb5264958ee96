"""One served model's executor (a thread) in the process that runs it, and the thread that feeds its controller.

The executor takes each batch its `RequestQueue` forms and runs it through the prepared model with the
configuration's active ramps; after each ramp it decides exits with that configuration and answers those requests
at once, while the batch runs on to the final layer (a compiled set runs under its exit mode's strategy,
`exit_modes`; the eager path, a set that does not compile or does not stop (an ONNX set cut into stages), or no ramp
operator, serve stop mode as release mode). The batch's record then goes to the control thread, which hands it to
the model's controller through a `ControlLink` (the controller in this process, or one that several replicas share)
and may get a new configuration back; the executor picks it up between batches (one reference swap, so a batch
never mixes two configurations).

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
import logging
import os
import queue
import threading
import time
from collections.abc import Callable

import numpy as np
import torch

from rampserve.control.controller import Controller
from rampserve.control.records import (
    NO_EXIT,
    NO_LABEL,
    BatchRecord,
    Configuration,
    RecordJoiner,
    validation_record,
)
from rampserve.control.scores import top_label_and_error
from rampserve.control.settings import STOP_MODE_BATCH_LIMIT
from rampserve.ramps import kernel
from rampserve.runtime.compiled import CompiledSet
from rampserve.runtime.prepared import COMPILED_SETS_KEPT
from rampserve.serving.executor.batch import Answered, BatchState, RampSignals
from rampserve.serving.executor.batching import AdaptiveBatchSize, BatchTimeEstimate, stack_inputs
from rampserve.serving.executor.books import Books
from rampserve.serving.executor.compiler import CompileOutcome, CompileService, likely_next_sets
from rampserve.serving.executor.exit_modes import RELEASE, Finals, StopStrategy
from rampserve.serving.executor.loading import loaded
from rampserve.serving.executor.request_queue import Inbox, LocalInbox, Pending, RequestQueue
from rampserve.serving.shared.contract import (
    Answer,
    ControlLink,
    ExecutionFailed,
    ModelRequest,
    Stamps,
    future_reply,
)
from rampserve.serving.shared.metrics import ServerMetrics
from rampserve.serving.shared.models import ServedModel
from rampserve.serving.shared.settings import ModelSettings
from rampserve.threads import OsNamedThread

log = logging.getLogger("rampserve.serving")

CONTROL_POLL_S = 1.0  # how often an idle worker asks its controller for a configuration published meanwhile
# How long the control thread lets records gather once one has come: each wake costs the process more than the
# records it learns from (resnet18-fmnist at 110 rps, batch 1: the thread's CPU per answer was 0.54 ms gathering 5 ms,
# 0.20 ms gathering 50, 0.11 ms gathering 200). A released answer that disagrees is learnt from at once.
CONTROL_GATHER_S = 0.2
# The control thread searches ramp sets and loads them (a minilm-rt set: 0.3 s of a core) while the model runs on
# every core: ONNX Runtime's threads wait for each other between operators, so a core taken from one slows the whole
# run several times, and at minilm-rt's first search under load the queue grew to 0.4 s. At this niceness the
# model's threads take the cores first and the controller works in the time between batches. Under the executor
# policies whose ONNX Runtime pool threads are SCHED_IDLE ("idle-pools", the default, and "idle") the control thread
# is SCHED_IDLE too, where niceness counts for nothing: at niceness 10 its searches and set loads took the pool
# threads' cores, and minilm-rt's p99 reached 11x vanilla's in replays where a search fell (DESIGN, the executor
# yields).
CONTROL_NICENESS = 10
# How long a starting server waits for its first configuration's set to compile (in the worker process) before
# it serves that set eagerly
START_COMPILE_WAIT_S = 300.0


class LocalControl:
    """The model's controller in this process, fed by one worker."""

    def __init__(self, controller: Controller) -> None:
        self.controller = controller
        self.idle = controller.idle
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


class ModelWorker:
    available = True  # serving from its launch to its shutdown (the `Worker` contract)

    def __init__(self, served: ServedModel, settings: ModelSettings, metrics: ServerMetrics,
                 control: ControlLink | None = None, inbox: Inbox | None = None,
                 on_configuration: Callable[[Configuration], None] | None = None) -> None:
        """`control`: the model's controller (default: one of its own in this process; none when vanilla); `inbox`:
        where its requests come in (default: its queue's admissions from other threads of this process);
        `on_configuration`: told of every configuration the executor adopts (an executor process tells its front
        end)."""
        self.served = served = loaded(served)
        self.model = model = served.prepared
        self.settings = settings
        self.metrics = metrics
        self._series = metrics.model_series(served.name)
        profile = model.profile
        if profile is None:
            raise ValueError(f"model {served.name} has no latency profile; run `rampserve profile` on its bundle")
        self.slo_ms, self.max_batch = settings.serving_limits(profile)
        controller_settings = settings.controller_for(profile)
        self.batch_size = AdaptiveBatchSize(self.max_batch, self.slo_ms,
                                            limit=1.0 if settings.adaptive_batching else float(self.max_batch))
        self.batch_time = BatchTimeEstimate(profile.full(self.max_batch))
        self.queue = RequestQueue(served.name, settings, profile, self.batch_size, self.batch_time, metrics)
        self.inbox = LocalInbox(self.queue) if inbox is None else inbox
        if control is None and not settings.vanilla:
            prior = validation_record(tuple(model.site_names), model.validation)
            control = LocalControl(Controller(profile, controller_settings, prior))
        self.control = control
        # The configuration in force and the compiled set it runs (None: eager), swapped as one reference
        initial = Configuration(0, (), ()) if control is None else control.configuration()
        self._serving: tuple[Configuration, CompiledSet | None] = (initial, None)
        # A configuration the controller chose whose set is still compiling; the executor keeps the one in force
        self._pending: Configuration | None = None
        # The exit mode, and the one compiled sets are made in: stop mode needs compiled sets (a set that does not
        # stop, an ONNX set cut into stages, serves it as release mode; a vanilla model has no ramps)
        self.exit_mode, self.feedback_share = controller_settings.exit_mode, controller_settings.feedback_share
        self._mode = "stop" if (self.exit_mode == "stop" and control is not None and settings.torchscript) \
            else "release"
        if self.exit_mode == "stop" and self._mode != "stop" and control is not None:
            log.info("model %s: exit mode 'stop' needs compiled sets; every input runs to the end, as in release mode",
                     served.name)
        elif settings.controller.exit_mode == "auto" and control is not None:
            log.info("model %s: exit mode %s (auto: stop where batches hold at most %d inputs and sets compile; "
                     "this model's hold %d%s)", served.name, self.exit_mode, STOP_MODE_BATCH_LIMIT, self.max_batch,
                     "" if settings.torchscript else ", and it is served eagerly")
        self._told_eager = False  # whether stop mode on the eager path was logged
        self._stop = StopStrategy(self.feedback_share)  # what a compiled set that stops runs with
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
        self.books = Books(served.name, metrics)
        self._published_sites: tuple[str, ...] = ()
        self.on_configuration = on_configuration
        self._records: queue.SimpleQueue[BatchRecord | Answered | CompileOutcome | None] = queue.SimpleQueue()
        # Set with a record the controller must learn from at once (an answer released wrongly, answers nobody can
        # check, the last record): the control thread stops gathering
        self._urgent = threading.Event()
        self._labels = {"model": served.name}
        self._executor = OsNamedThread(target=self._serve_batches, name=f"executor-{served.name}", daemon=True)
        # A vanilla model has no controller to feed, nor does one whose controller can never change anything (its
        # control thread still adopts the first set once compiled, should that come late)
        self._feeds_controller = control is not None and not control.idle
        self._control = None if control is None else OsNamedThread(
            target=self._control_loop, args=(control,), name=f"controller-{served.name}", daemon=True,
            niceness=CONTROL_NICENESS, below_pools=True)

    @property
    def configuration(self) -> Configuration:
        return self._serving[0]

    @property
    def background_threads(self) -> tuple[int, ...]:
        """The kernel's ids of its threads that run below the model's (the control thread), once started."""
        return () if self._control is None or self._control.native_id is None else (self._control.native_id,)

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
            self._preload(config)
            self._load_shadow_set(config)  # preloaded now, if the compile was in time
        self._executor.start()
        if self._control is not None:
            self._control.start()

    def stop(self) -> None:
        """Answer everything accepted, then stop both threads."""
        self.queue.request_stop()
        self._executor.join()
        if self._control is not None:
            self._record(None, urgent=True)
            self._control.join()
        if self._compiler is not None:
            self._compiler.close()
        if self._signals is not None:
            self._signals.close()

    def wait_stopped(self) -> None:
        """Wait until the executor has answered everything and ended (after `queue.request_stop`)."""
        self._executor.join()

    def submit(self, request: ModelRequest, on_final: Callable[[Answer], None] | None = None) -> asyncio.Future:
        """Queue a request from the event loop; the future resolves with its answer. Raises `Shed` if refused."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self.queue.admit(request, future_reply(loop, future), on_final)
        return future

    # ---- execution (executor thread) -----------------------------------------------------------------------

    def _serve_batches(self) -> None:
        # The executor is the only thread that runs the model; the event loop and the controller need a core too,
        # and torch's intra-op threads contending with them made a batch of one 1.5-3x slower on two cores.
        if self.settings.torch_threads:  # 0: torch's own default
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
                self.queue.batch_done()

    def _next_batch(self) -> list[Pending] | None:
        """The next batch to run, letting requests in until one is due; None once stopped with nothing queued."""
        self.inbox.collect(0.0)  # what came while the last batch ran
        while (due := self.queue.ready_in()) != 0.0:
            if self.queue.drained:
                return None
            self.inbox.collect(due)
        return self.queue.take_batch()

    def _run(self, batch: list[Pending]) -> None:
        if not batch:
            return
        config, compiled = self._serving
        shadow = self._shadow_batch(config)
        if shadow is not None:
            config, compiled = shadow
        model = self.model
        feeds = stack_inputs(self.served.inputs, [p.request.inputs for p in batch])
        state = BatchState(config, batch, self.batches, self._series.answer)
        self.batches += 1
        strategy = self._stop if compiled is not None and compiled.stops else RELEASE
        started = state.started
        for pending in batch:
            self._series.queue.observe(started - pending.arrival)
        try:
            if compiled is None:
                if self._mode == "stop" and config.sites and not self._told_eager:
                    self._told_eager = True
                    log.info("model %s: a set served eagerly (it does not compile) runs every input to the end, "
                             "as in release mode", self.served.name)
                finals = Finals.of(model.run_eager(feeds, config.sites, state.site_ramp if config.sites else None))
            else:
                finals, outputs = strategy.execute(model, compiled, state, feeds, self._signals, shadow is not None)
        except Exception:
            self._record_unverified(state, started)
            raise
        state.run_ended()
        # A request still open is answered now with its batch's final answer: that answer is kept (the prediction
        # cache) before the response that carries it is sent, so a repeat sent once the response is back finds it.
        # A request released early at a ramp got the ramp's label; its final answer, known only now, is kept after
        # the open ones are answered (off their path): caches keep final answers alone, never a ramp's label,
        # which thresholds move and a cache would replay unchecked, so its repeat may come before it is kept
        released_early = [pending.settled for pending in batch]
        self._keep_finals(state, [not early for early in released_early], finals)
        state.finish(finals.labels, finals.errors, finals.logits)
        finished = time.monotonic()
        # The ramps no input exited at are scored for the record by the control thread, from a copy of their
        # logits: the buffer is this thread's next batch's
        unscored = [] if compiled is None else [(state.column[site], j) for j, site in enumerate(compiled.sites)
                                                if not state.scored[state.column[site]]]
        late = None if not unscored else outputs.buffers.logits[:, [j for _, j in unscored]].copy()
        self._keep_finals(state, released_early, finals)
        if self.settings.cache_updates and config.sites:  # after every answer is out: off the requests' path
            # A cache ramp evaluated the rows still in the batch at its site (in stop mode, not every row), and
            # learns from those that ran to the end
            model.learn(finals.labels, None if compiled is None else
                        {site: strategy.reached(outputs, j) for j, site in enumerate(compiled.sites)})
        done = Answered(state, finals.labels, [column for column, _ in unscored],
                        [strategy.reached(outputs, j) for _, j in unscored], late, started, finished,
                        min(p.arrival for p in batch), strategy.feedback_share(shadow is not None))
        self._count(done)
        if self._feeds_controller:  # the controller's record, off this thread: the next batch is waiting
            self._record(done, urgent=done.released_a_disagreement())

    @staticmethod
    def _keep_finals(state: BatchState, which: list[bool], finals: Finals) -> None:
        """Hand the final answers of the batch's requests marked in `which` to their `on_final`, where they have one
        (a request one of whose rows left the batch, in stop mode, has none: it is skipped)."""
        now = time.monotonic()
        for index, pending in enumerate(state.batch):
            if not which[index] or pending.on_final is None:
                continue
            rows = slice(int(state.starts[index]), int(state.starts[index]) + pending.rows)
            if np.any(finals.labels[rows] == NO_LABEL):
                continue
            pending.on_final(Answer(finals.labels[rows], (None,) * pending.rows, (None,) * pending.rows,
                                    1.0 - finals.errors[rows], finals.logits[rows], state.config.version,
                                    state.batch_id, Stamps(pending.admitted, state.started, state.signalled, now)))

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

    def _record_unverified(self, state: BatchState, started: float) -> None:
        """The model failed after some answers left at a ramp: the controller still hears of them, as answers
        that could not be checked (it counts them as disagreements)."""
        batch = state.batch
        rows = np.concatenate([np.arange(start, start + p.rows) for start, p in zip(state.starts, batch) if p.settled]
                              or [np.zeros(0, dtype=int)])
        self.books.count_answers("unverified", len(rows))  # before the controller can hear of them
        if not self._feeds_controller or not len(rows):
            return
        self._record(BatchRecord(state.config.version, state.config.sites, state.labels[rows], state.errors[rows],
                                 np.full(len(rows), NO_LABEL), state.exits[rows],
                                 (started - min(p.arrival for p in batch)) * 1000.0,
                                 (time.monotonic() - started) * 1000.0, unverified=True), urgent=True)

    def _count(self, done: Answered) -> None:
        """A batch's books, metrics and batch-size feedback once its answers are out, on the executor thread: what
        status and /metrics read is whole as soon as the answers are (the controller's record waits for its
        thread, which gathers)."""
        n, compute_ms = done.state.n, done.compute_ms
        self.batch_size.observe(n, compute_ms)
        self.batch_time.observe(compute_ms * self.batch_size.size / n)
        self.books.book(done)
        series = self._series
        series.compute.observe(compute_ms / 1000.0)
        series.batch_size.observe(n)
        series.batch_limit.set(self.batch_size.size)

    def _controller_records(self, items: list) -> list[BatchRecord]:
        """The controller's records of what the executor thread queued (counted batches, and the records it made of
        cached and unverified answers), on the control thread: the ramps no input exited at are scored first, and
        consecutive batches of one configuration and kind are joined into one record."""
        joiner = RecordJoiner()
        for item in items:
            if isinstance(item, BatchRecord):
                joiner.add_record(item)
            elif isinstance(item, Answered):
                self._score_late(item)
                state = item.state
                joiner.add(state.config.version, state.config.sites, state.labels, state.errors, item.final,
                           state.exits, item.queue_ms, item.compute_ms, feedback_share=item.feedback_share,
                           forced=None if state.wants_final is None else
                           state.wants_final | np.isin(state.exits, state.unstoppable))
        return joiner.joined()

    def _score_late(self, done: Answered) -> None:
        """The top label and error score of the ramps no input exited at, from the copy of their logits."""
        state = done.state
        for k, column in enumerate(done.unscored):
            # The rows that left the batch before this ramp (stop mode) never reached it
            rows = done.unscored_rows[k]
            state.labels[:, column], state.errors[:, column] = NO_LABEL, np.nan
            if len(rows):
                state.labels[rows, column], state.errors[rows, column] = top_label_and_error(
                    done.late[rows, k], self.model.error_score)

    def yield_to(self, processes: tuple[int, ...]) -> None:
        """Nothing to do: this executor thread waits for requests in the kernel, it does not poll."""

    def count_cached(self, labels: np.ndarray) -> None:
        """Answers the prediction cache gave (final labels): counted here and, through the control thread, by
        the controller, whose accuracy covers every answer released."""
        self.books.count_answers("cached", len(labels))
        if self._feeds_controller:
            config = self.configuration
            n = len(labels)
            self._record(BatchRecord(config.version, (), np.zeros((n, 0), dtype=np.int64), np.zeros((n, 0)),
                                     np.asarray(labels), np.full(n, NO_EXIT), cached=True))

    # ---- control (controller thread) -------------------------------------------------------------------------

    def _control_loop(self, control: ControlLink) -> None:
        while True:
            try:
                items = [self._records.get(timeout=CONTROL_POLL_S)]
            except queue.Empty:  # idle: a controller shared with other workers may have moved on without us
                new = control.refresh()
            else:
                # Whatever queues while gathering is learnt from at once, unless an urgent record cuts it short:
                # every batch that runs meanwhile with the same thresholds can release another wrong answer
                self._urgent.wait(CONTROL_GATHER_S)
                self._urgent.clear()
                while True:
                    try:
                        items.append(self._records.get_nowait())
                    except queue.Empty:
                        break
                records = self._controller_records(items)
                new = None
                for record in records:
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

    def _record(self, item: BatchRecord | Answered | CompileOutcome | None, urgent: bool = False) -> None:
        self._records.put(item)
        if urgent:
            self._urgent.set()

    def _compile_finished(self, outcome: CompileOutcome) -> None:
        """From the compile service's thread: count it and wake the control thread, which may adopt a pending
        configuration now."""
        self.metrics.compiles.labels(outcome=outcome.outcome, **self._labels).inc()
        self.metrics.compile_time.labels(**self._labels).observe(outcome.seconds)
        self._record(outcome)

    def _preload(self, config: Configuration) -> None:
        """Compile the sets the controller's next decisions may ask for and load them before serving starts: a
        load holds the GIL for 10-25 ms on the zoo's CNNs (measured), which would stall the event loop if it came
        with a configuration change under load. Waits at most `preload_s`; later sets go on compiling in the
        background and load when they are needed. A controller that searches no set (no shadow sites) asks for
        none but the one in force."""
        if not config.shadow_every:
            return
        # The set of every shadow site first: shadow batches run it, and a controller warming up asks for them at once
        shadow = config.shadow_sites
        upcoming = list(dict.fromkeys([shadow, *likely_next_sets(config.sites, shadow)]))[:COMPILED_SETS_KEPT - 1]
        if not self.settings.compile_ahead:  # the sets on disk load now, the others compile once asked for
            upcoming = [sites for sites in upcoming if self._compiler.ready(sites)]
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
        model = self.model
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
            self._shadow_set = (shadowed.sites, self.model.compiled_set(shadowed.sites, self._mode)
                                if self.settings.torchscript else None)

    def _adopt(self, config: Configuration) -> None:
        compiled = self.model.compiled_set(config.sites, self._mode) if self.settings.torchscript else None
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
            # managed, but its controller can never change anything: it hears of no batch (see its first decision)
            "controller_idle": self.control is not None and not self._feeds_controller,
            "slo_ms": self.slo_ms,
            "max_batch": self.max_batch,
            "batch_limit": self.batch_size.size,
            "max_delay_ms": self.settings.max_delay_ms,
            "compiled": self.compiled,
            "exit_mode": self.exit_mode,
            "feedback_share": self.feedback_share,
            # whether the set in force takes exited inputs out of their batch (a compiled set in stop mode)
            "stopping": self._serving[1] is not None and self._serving[1].stops,
            "pending_configuration": None if self._pending is None else self._pending.to_json(),
            "deadline_ms": self.settings.deadline_ms,
            "queued_inputs": self.queue.rows_queued,
            "batches": self.batches,
            # batches that evaluated every site's ramp for the controller, and those served plainly instead
            "shadow_batches": self.shadow_batches,
            "shadow_batches_skipped": self.shadow_batches_skipped,
            "configuration": self.configuration.to_json(),
            **self.books.status(),
        }
        if self.control is not None:
            status.update(self.control.status(latest_decisions))
        return status
