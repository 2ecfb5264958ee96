"""What the front end and a served bundle's executor agree on, free of torch: the front end imports this and never
the executor's modules, so that a server whose models run in executor processes never loads torch itself.

`Worker` is the executor as the front end sees it (`worker.ModelWorker` in this process, `process_worker.ProcessWorker`
for one in a process of its own), `ControlLink` where its records go, `Answer` what a request gets, `Shed`,
`ExecutionFailed` and `ExecutorLost` what it may get instead; `ModelSettings` how a model is served. Both processes
set the interpreter up alike (`GIL_SWITCH_INTERVAL_S`, `freeze_startup_objects`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np

from rampserve.bundle_format.latency import serving_limits
from rampserve.control.records import BatchRecord, Configuration
from rampserve.control.settings import ControllerSettings

if TYPE_CHECKING:
    from rampserve.bundle_format.latency import LatencyProfile
    from rampserve.serving.shared.models import ServedModel

EXECUTORS = ("process", "thread")
EXECUTOR_POLICIES = ("normal", "idle-pools", "idle")
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
    # Whether those sets are compiled ahead, before the controller asks for them. A restarted executor process's are
    # not: it loads the ones on disk and serves, and its compile worker starts once a set not on disk is asked for
    compile_ahead: bool = True
    # Where a bundle's executor runs: "process", a process of its own (`serving.executor`), so that the front end's
    # parsing and writing never holds the GIL the model's Python parts need; or "thread", in the server's process
    # (a model built in memory, with no bundle on disk to load, always runs there)
    executor: str = "process"
    # How long an executor process polls for the front end's next frame after its last, before it sleeps in the
    # kernel. A sleeping core wakes late, and to a colder model: on this 2-core VM, minilm-rt served one request at
    # a time took 0.7-1.6 ms longer after 20-50 ms idle when the executor slept than when it polled, and polling
    # cut a request's overhead by 0.13-0.37 ms (one wake-up fewer; DESIGN, the executor process). The price is the
    # CPU of a core within the window of any frame, given to any other runnable thread first (and to the server's
    # SCHED_IDLE work: see `executor.wait_readable`) (0: never poll).
    idle_poll_ms: float = 50.0
    # The Linux scheduling policy of an executor process's threads. An answer a ramp releases mid-run goes out
    # through the front end while ONNX Runtime's threads run on every core, and under the normal policy the front end
    # waits for one's slice to end: 1.9-3.5 ms on this 2-core VM (minilm-rt, one request at a time after 30-100 ms
    # idle), 0.2-0.6 ms when those threads are SCHED_IDLE, which any other thread that wakes preempts at once (DESIGN,
    # the executor yields). "idle-pools": ONNX Runtime's pool threads alone, so that the thread that runs the batch
    # keeps its core; "idle": every thread of the process (the compile worker too); "normal": none. "idle" sent
    # released answers out sooner still but cost a fifth of the saturation throughput of both vanilla and managed
    # servers with a bench's clients on the same cores, which "idle-pools" did not (docs/journal, bench live).
    executor_policy: str = "idle-pools"
    controller: ControllerSettings = field(default_factory=ControllerSettings)

    def __post_init__(self) -> None:
        if self.executor not in EXECUTORS:
            raise ValueError(f"executor must be one of {EXECUTORS}, got {self.executor!r}")
        if self.executor_policy not in EXECUTOR_POLICIES:
            raise ValueError(f"executor_policy must be one of {EXECUTOR_POLICIES}, got {self.executor_policy!r}")
        if self.idle_poll_ms < 0:
            raise ValueError(f"idle_poll_ms must be 0 or more, got {self.idle_poll_ms}")

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    def serving_limits(self, profile: LatencyProfile) -> tuple[float, int]:
        """The SLO and batch limit of a model with this latency profile (`latency.serving_limits`)."""
        return serving_limits(profile, self.slo_ms, self.max_batch)

    def controller_for(self, profile: LatencyProfile) -> ControllerSettings:
        """The controller's settings for a model with this latency profile, its exit mode resolved (a vanilla model
        has no ramp to stop at: every input runs to the end)."""
        return self.controller.resolved(self.serving_limits(profile)[1], self.torchscript and not self.vanilla)

    @classmethod
    def from_json(cls, data: dict) -> ModelSettings:
        controller = dict(data["controller"])
        if controller["initial"] is not None:
            controller["initial"] = tuple(controller["initial"])
        return cls(**{**data, "controller": ControllerSettings(**controller)})


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

    def submit(self, inputs: Mapping[str, np.ndarray], rows: int, needs_final: bool,
               deadline_ms: float | None = None, priority: int = 0,
               on_final: Callable[[Answer], None] | None = None) -> asyncio.Future:
        """Queue a request; the future resolves with its `Answer`. Raises `Shed` if refused."""

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
    queue, its batch started, its exit signalled (the column of the ramp it left at reached the batch, or the run
    ended), the answer released, and the answer read back by the front end (NaN for an executor in its process)."""

    admitted: float
    started: float
    signalled: float
    released: float
    received: float = math.nan

    def to_json(self) -> dict[str, float]:
        return dataclasses.asdict(self)


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
    stamps: Stamps

    @property
    def early(self) -> bool:
        return all(site is not None for site in self.exit_sites)


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
