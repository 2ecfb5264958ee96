"""What the front end and a served bundle's executor agree on, free of torch: the front end imports this and never
the executor's modules, so that a server whose models run in executor processes never loads torch itself.

`Worker` is the executor as the front end sees it (`worker.ModelWorker` in this process, `process_worker.ProcessWorker`
for one in a process of its own), `ControlLink` where its records go, `ModelRequest` what it is asked (the one type a
request has from the data plane's decoding to the batch it joins, whatever the model), `Answer` what it gets (the one
type an answer has, whatever the model; `Exits` where a bundle answered it), `Shed`,
`ExecutionFailed` and `ExecutorLost` what it may get instead (`settings.ModelSettings` is how a model is served). Both
processes set the interpreter up alike (`GIL_SWITCH_INTERVAL_S`, `freeze_startup_objects`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np

from rampserve.control.records import BatchRecord, Configuration

if TYPE_CHECKING:
    from rampserve.serving.shared.models import ServedModel

# How long a thread holding the GIL runs before a waiting one may take it. Python's default (5 ms) would let the
# executor, between two of the model's operators, keep the thread that sends an answer released early from it
# for longer than the whole model takes; 0.2 ms bounds that wait at a tenth of a small model's batch.
GIL_SWITCH_INTERVAL_S = 0.0002


def freeze_startup_objects() -> None:
    """Move every object made while starting (models, compiled sets, the libraries' own) out of the garbage
    collector's reach: a full collection stops every thread, and over them it took 100-200 ms on resnet18-fmnist
    (the event loop's lag reached 205 ms, every request waiting meanwhile); over what serving makes later, it
    takes a few ms. Call it once a process that serves is built, before it serves."""
    gc.collect()
    gc.freeze()


class ControlLink(Protocol):
    """Where a worker's batch records go and its configurations come from."""

    # The controller can never change the configuration (`Controller.idle`): the worker sends it no records, so a
    # managed model with nothing to manage costs what vanilla costs (its control thread only idles)
    idle: bool

    def configuration(self) -> Configuration: ...

    def observe(self, record: BatchRecord) -> Configuration | None: ...

    def readings(self) -> dict[str, float]:
        """The controller's gauges (`Controller.readings`)."""

    def refresh(self) -> Configuration | None:
        """A configuration published since this worker last heard (by records of other workers), or None."""

    def status(self, latest_decisions: int | None = None) -> dict:
        """The controller's status (`Controller.status`) with its latest decisions (None: all)."""


class Worker(Protocol):
    """What the front end asks of a served bundle's executor, in this process (`worker.ModelWorker`) or in one of its
    own (`process_worker.ProcessWorker`). Everything but `launch` and `shutdown` is called on the event loop and
    returns at once."""

    served: ServedModel

    @property
    def available(self) -> bool:
        """Whether it serves now: False while an executor process restarts (the model is not ready meanwhile)."""

    async def launch(self) -> None:
        """Start serving (once the event loop runs)."""

    def submit(self, request: ModelRequest) -> asyncio.Future:
        """Queue a request; the future resolves with its `Answer`. Raises `Shed` if refused. The request's `on_final`
        gets its final answer once its batch has run to the end, however early the answer left."""

    def count_cached(self, labels: np.ndarray) -> None:
        """Answers the prediction cache gave, for the controller's books."""

    def yield_to(self, processes: tuple[int, ...]) -> None:
        """The server's background processes (under SCHED_IDLE: a training job), which the executor's polling for
        requests must leave a core to."""

    async def current_status(self, latest_decisions: int | None = None) -> dict:
        """The status, with the controller's latest decisions (None: all of them)."""

    async def exported_metrics(self) -> list[dict]:
        """Metric families kept outside the server's registry, as `executor.metric_families` gives them."""

    async def shutdown(self) -> None:
        """Answer everything accepted, then stop."""


@dataclass(frozen=True)
class ModelRequest:
    """A request as every model is asked it, whatever stands behind its name, and the one type a request has from
    the data plane's decoding to the batch it joins (`wire.request_frame` carries what an executor process needs of
    it): its decoded inputs, a row per input, and how to serve it."""

    inputs: Mapping[str, np.ndarray]
    needs_final: bool = False  # asked for the logits: answered at the end of its batch, never early
    deadline_ms: float | None = None  # from arrival; None: the model's own
    priority: int = 0  # higher is served first
    arrival: float = field(default_factory=time.monotonic)  # when it reached the server: one clock in every process
    parameters: Mapping[str, object] = field(default_factory=dict)  # the request's, as sent (an application's uid)
    # Called once with the request's final answer, on any thread: before its answer is given, or after a bundle
    # released a ramp's label (the batch runs on after it): what a prediction cache may keep
    on_final: Callable[[Answer], None] | None = None

    @property
    def rows(self) -> int:
        return next(iter(self.inputs.values())).shape[0]


class Shed(Exception):
    """A request refused (at admission) or dropped (its deadline passed in the queue)."""

    def __init__(self, status: int, reason: str, message: str, retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.status, self.reason, self.message, self.retry_after_s = status, reason, message, retry_after_s


class ExecutionFailed(Exception):
    """The model raised while running a batch; every request of the batch gets this."""


class ExecutorLost(Exception):
    """The executor process died holding the request; it was not answered (503)."""


@dataclass(frozen=True)
class Stamps:
    """When a request's answer passed each step in the executor, as `time.monotonic()`, one clock for every process
    of the machine (the front end's and a client's `time.perf_counter` read it too): its request admitted to the
    queue, its batch started, the model's run began (the run's buffers, exit floors and feedback sample set), its
    exit signalled (the column of the ramp it left at reached the batch, or the run ended), the answer released, and
    the answer read back by the front end (NaN for an executor in its process)."""

    admitted: float
    started: float
    ran: float
    signalled: float
    released: float
    received: float = math.nan

    def to_json(self) -> dict[str, float]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Exits:
    """Where a bundle answered each input of a request: the ramp (None: the final layer) and its error score, and
    the configuration and batch that answered."""

    sites: tuple[str | None, ...]
    error_scores: tuple[float | None, ...]
    config_version: int
    batch_id: int

    @property
    def early(self) -> bool:
        return all(site is not None for site in self.sites)


@dataclass(frozen=True)
class Answer:
    """A model's answer to a request, the one type every model gives whatever stands behind its name (a bundle's
    executor, in this process or its own, a callable, a remote model, an application), from the model to the
    transport's encoder and the prediction cache: a label and a confidence per input, and how it was reached."""

    labels: np.ndarray  # (rows,) int64
    # (rows,) in [0, 1]: 1 - error score of the ramp that answered, the final layer's top softmax probability, or
    # what the model said of its label
    confidences: np.ndarray
    logits: np.ndarray | None = None  # a bundle's, when the request asked for them
    exits: Exits | None = None  # a bundle's
    stamps: Stamps | None = None  # a bundle's: when its answer passed each step in the executor
    # An application's: its decision as its response reports it (whether its default answered, the models whose
    # answers made it, ...); None for a model
    decision: Mapping[str, object] | None = None

    @property
    def early(self) -> bool:
        return self.exits is not None and self.exits.early

    @property
    def outcome(self) -> str:
        """As rampserve_requests_total counts it: early or final for a model, answered or default for an
        application."""
        if self.decision is not None:
            return "default" if self.decision.get("default") else "answered"
        return "early" if self.early else "final"


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
