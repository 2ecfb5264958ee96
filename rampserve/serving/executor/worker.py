"""One served model's executor in the process that runs it: its queue, and the parts that serve from it.

`ModelWorker` is what the front end (or an executor process, `core`) holds of a model it serves: requests go into
its `RequestQueue`; the executor thread (`BatchRunner`) runs each batch the queue forms with the configuration the
`ServingSets` have in force and keeps its `Books`; the `ControlThread` hands each batch's record to the model's
controller through a `ControlLink` (the controller in this process, or one that several replicas share) and passes
the configurations it chooses to the serving sets, which adopt each once its set is loaded (one reference swap,
read by the executor between batches, so a batch never mixes two configurations).
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Callable

import numpy as np

from rampserve.control.controller import Controller
from rampserve.control.records import NO_EXIT, BatchRecord, Configuration, validation_record
from rampserve.control.settings import STOP_MODE_BATCH_LIMIT
from rampserve.serving.executor.batch import Answered, RampSignals
from rampserve.serving.executor.batch_runner import BatchRunner
from rampserve.serving.executor.batching import AdaptiveBatchSize, BatchTimeEstimate
from rampserve.serving.executor.books import Books
from rampserve.serving.executor.compiling import CompileOutcome
from rampserve.serving.executor.control_thread import ControlThread
from rampserve.serving.executor.exit_modes import StopStrategy
from rampserve.serving.executor.loading import loaded
from rampserve.serving.executor.request_queue import Inbox, LocalInbox, RequestQueue
from rampserve.serving.executor.serving_sets import ServingSets
from rampserve.serving.shared.contract import ControlLink, ModelRequest, future_reply
from rampserve.serving.shared.metrics import ServerMetrics
from rampserve.serving.shared.models import ServedModel
from rampserve.serving.shared.settings import ModelSettings
from rampserve.threads import OsNamedThread

log = logging.getLogger("rampserve.serving")


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
        profile = model.profile
        if profile is None:
            raise ValueError(f"model {served.name} has no latency profile; run `rampserve profile` on its bundle")
        self.slo_ms, self.max_batch = settings.serving_limits(profile)
        controller_settings = settings.controller_for(profile)
        self.batch_size = AdaptiveBatchSize(self.max_batch, self.slo_ms,
                                            limit=1.0 if settings.adaptive_batching else float(self.max_batch))
        batch_time = BatchTimeEstimate(profile.full(self.max_batch))
        self.queue = RequestQueue(served.name, settings, profile, self.batch_size, batch_time, metrics)
        self.inbox = LocalInbox(self.queue) if inbox is None else inbox
        if control is None and not settings.vanilla:
            prior = validation_record(tuple(model.site_names), model.validation)
            control = LocalControl(Controller(profile, controller_settings, prior))
        self.control = control
        # The exit mode, and the one compiled sets are made in: stop mode needs compiled sets (a set that does not
        # stop, an ONNX set cut into stages, serves it as release mode; a vanilla model has no ramps)
        self.exit_mode, self.feedback_share = controller_settings.exit_mode, controller_settings.feedback_share
        mode = "stop" if (self.exit_mode == "stop" and control is not None and settings.torchscript) else "release"
        if self.exit_mode == "stop" and mode != "stop" and control is not None:
            log.info("model %s: exit mode 'stop' needs compiled sets; every input runs to the end, as in release mode",
                     served.name)
        elif settings.controller.exit_mode == "auto" and control is not None:
            log.info("model %s: exit mode %s (auto: stop where batches hold at most %d inputs and sets compile; "
                     "this model's hold %d%s)", served.name, self.exit_mode, STOP_MODE_BATCH_LIMIT, self.max_batch,
                     "" if settings.torchscript else ", and it is served eagerly")
        # A vanilla model has no controller to feed, nor does one whose controller can never change anything (its
        # control thread still adopts the first set once compiled, should that come late)
        self._feeds_controller = control is not None and not control.idle
        # before the sets: their compile service may report an outcome at once
        self.control_thread = None if control is None else ControlThread(
            served.name, control, metrics, model.error_score, self._advance)
        self.sets = ServingSets(served, settings, metrics, Configuration(0, (), ()) if control is None
                                else control.configuration(), mode, self._compile_finished, on_configuration)
        self.books = Books(served.name, metrics)
        # Compiled runs with ramps report where inputs may exit through a pipe, read by a releasing thread; the
        # ramp operators are loaded now, before serving, not with the first set that needs them
        signals = RampSignals(served.name) if (
            settings.torchscript and control is not None and model.backend.ramps_signal()) else None
        self.runner = BatchRunner(served, settings, metrics, self.sets, self.books, self.batch_size, batch_time,
                                  StopStrategy(self.feedback_share), signals,
                                  self._record if self._feeds_controller else None)
        self._executor = OsNamedThread(target=self.runner.serve, args=(self.queue, self.inbox),
                                       name=f"executor-{served.name}", daemon=True)

    @property
    def configuration(self) -> Configuration:
        return self.sets.configuration

    @property
    def compiled(self) -> bool:
        """Whether the configuration in force runs compiled."""
        return self.sets.compiled

    @property
    def background_threads(self) -> tuple[int, ...]:
        """The kernel's ids of its threads that run below the model's (the control thread), once started."""
        thread = self.control_thread
        return () if thread is None or thread.native_id is None else (thread.native_id,)

    def start(self) -> None:
        self.sets.start(managed=self.control is not None)
        self._executor.start()
        if self.control_thread is not None:
            self.control_thread.start()

    def stop(self) -> None:
        """Answer everything accepted, then stop both threads."""
        self.queue.request_stop()
        self._executor.join()
        if self.control_thread is not None:
            self.control_thread.stop()
        self.sets.close()
        if self.runner.signals is not None:
            self.runner.signals.close()

    def wait_stopped(self) -> None:
        """Wait until the executor has answered everything and ended (after `queue.request_stop`)."""
        self._executor.join()

    def submit(self, request: ModelRequest) -> asyncio.Future:
        """Queue a request from the event loop; the future resolves with its answer. Raises `Shed` if refused."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self.queue.admit(request, future_reply(loop, future))
        return future

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

    def _record(self, item: BatchRecord | Answered | CompileOutcome, urgent: bool = False) -> None:
        if self.control_thread is not None:
            self.control_thread.record(item, urgent)

    def _advance(self, chosen: Configuration | None) -> None:
        self.sets.advance(chosen)

    def _compile_finished(self, outcome: CompileOutcome) -> None:
        """A compile's outcome wakes the control thread, which may adopt a pending configuration now."""
        self._record(outcome)

    # ---- status --------------------------------------------------------------------------------------------

    async def launch(self) -> None:
        self.start()

    async def shutdown(self) -> None:
        await asyncio.to_thread(self.stop)

    async def current_status(self, latest_decisions: int | None = None) -> dict:
        controller = await asyncio.to_thread(self.controller_status, latest_decisions)  # off the event loop
        return {**self.serving_status(), **controller, "executor": {"kind": "thread", "pid": os.getpid()}}

    async def exported_metrics(self) -> list[dict]:
        return []  # its metrics are the server's own

    def status(self, latest_decisions: int | None = None) -> dict:
        """The model's status: how it serves (`serving_status`) and its controller's (`controller_status`)."""
        return {**self.serving_status(), **self.controller_status(latest_decisions)}

    def controller_status(self, latest_decisions: int | None = None) -> dict:
        """The controller's part of the status (the latest `latest_decisions` of its decisions; None: all), nothing
        when vanilla. It waits for the controller, which the control thread holds while it learns from a record:
        a search of minilm-rt's sets takes 0.3 s of a core, longer under SCHED_IDLE beside the model's threads. So
        never on the executor thread, which would stall every request meanwhile, nor on an event loop."""
        return {} if self.control is None else self.control.status(latest_decisions)

    def serving_status(self) -> dict:
        """How the model serves: its limits, its configuration and compiled sets, its queue and its books."""
        runner, pending = self.runner, self.sets.pending
        return {
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
            "stopping": self.sets.stopping,
            "pending_configuration": None if pending is None else pending.to_json(),
            "deadline_ms": self.settings.deadline_ms,
            "queued_inputs": self.queue.rows_queued,
            "batches": runner.batches,
            # batches that evaluated every site's ramp for the controller, and those served plainly instead
            "shadow_batches": runner.shadow_batches,
            "shadow_batches_skipped": runner.shadow_batches_skipped,
            "configuration": self.configuration.to_json(),
            **self.books.status(),
        }
