"""One served model's request queue and batcher: admission (the queue's bound, requests' deadlines), shedding, and
forming the next batch. Passive: it waits for nothing and runs nothing; the executor's loop (`worker.ModelWorker`)
asks it when a batch is due, lets requests in meanwhile through its inbox, and runs the batches it forms. Requests
wait in priority order, then in the order they came."""

from __future__ import annotations

import heapq
import itertools
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from rampserve.bundle_format.latency import LatencyProfile
from rampserve.serving.executor.batching import AdaptiveBatchSize, BatchTimeEstimate, expected_wait_ms
from rampserve.serving.shared.contract import Answer, ModelRequest, Shed
from rampserve.serving.shared.metrics import ServerMetrics
from rampserve.serving.shared.settings import ModelSettings


@dataclass(eq=False)
class Pending:
    """A request in the queue or in its batch, with where its answers go."""

    request: ModelRequest
    arrival: float  # the request's, or when the queue took it if that is earlier (two processes' clocks)
    deadline: float  # time.monotonic() past which it is shed unanswered
    # Called once, on the executor's or the releasing thread, with the request's answer or what failed it:
    # resolves an event loop's future (`future_reply`), or writes to the front end's channel (`executor`). The
    # request's `on_final` is called on the executor thread with its final answer (every row's final label and
    # the logits) once its batch has run to the end, however early its response left; when the response carries
    # the final answer, before `reply` gets it
    reply: Callable[[Answer | BaseException], None]
    settled: bool = False
    admitted: float = field(default_factory=time.monotonic)  # when the queue took it (`contract.Stamps`)
    rows: int = field(init=False)  # the request's, read at every batch's forming and answering

    def __post_init__(self) -> None:
        self.rows = self.request.rows

    def settle(self, result: Answer | BaseException) -> None:
        self.settled = True
        self.reply(result)


class RequestQueue:
    """Admits requests from any thread and forms the executor's batches: due when full at the current batch size,
    once the oldest input has waited `max_delay_ms`, or at once when stopping."""

    def __init__(self, name: str, settings: ModelSettings, profile: LatencyProfile, batch_size: AdaptiveBatchSize,
                 batch_time: BatchTimeEstimate, metrics: ServerMetrics) -> None:
        self.name, self.settings, self.profile = name, settings, profile
        self.batch_size, self.batch_time, self.metrics = batch_size, batch_time, metrics
        self.admissions = 0  # requests admitted so far: what an inbox waits to see change
        self._heap: list[tuple[int, int, Pending]] = []
        self._order = itertools.count()
        self._rows_queued = 0
        self._running = False
        self._stopping = False
        self._cond = threading.Condition()
        self._labels = {"model": name}
        self._queued = metrics.queued.labels(**self._labels)

    @property
    def rows_queued(self) -> int:
        return self._rows_queued

    def admit(self, request: ModelRequest, reply: Callable[[Answer | BaseException], None]) -> None:
        """Queue a request from any thread; `reply` gets its answer once (its `on_final` its final answer, see
        `Pending`). Raises `Shed` if refused."""
        now = time.monotonic()
        arrival, rows = min(request.arrival, now), request.rows
        budget_ms = self.settings.deadline_ms if request.deadline_ms is None else request.deadline_ms
        with self._cond:
            if self._stopping:
                raise Shed(503, "shutdown", "the server is shutting down")
            if self._rows_queued + rows > self.settings.max_queue:
                self._shed("queue_full")
                raise Shed(503, "queue_full", f"model {self.name}: queue full "
                           f"({self._rows_queued} inputs waiting, at most {self.settings.max_queue})", 1)
            if self._rows_queued or self._running:
                wait_ms = expected_wait_ms(self._rows_queued, self.batch_size.size, self.batch_time.ms,
                                           self._running)
            else:
                # Idle: the profiled time, not the running estimate, which learns only from batches that run
                # and, once one slow batch raised it past the deadline, would otherwise refuse forever.
                wait_ms = self.profile.full(rows)
            wait_ms += (now - arrival) * 1000.0  # already spent on the way here
            if budget_ms is not None and wait_ms > budget_ms:
                self._shed("deadline")
                raise Shed(429, "deadline", f"model {self.name}: expected answer in {wait_ms:.1f} ms, "
                           f"after the request's deadline of {budget_ms:.1f} ms",
                           max(1, math.ceil(wait_ms / 1000.0)))
            deadline = math.inf if budget_ms is None else arrival + budget_ms / 1000.0
            pending = Pending(request, arrival, deadline, reply)
            heapq.heappush(self._heap, (-request.priority, next(self._order), pending))
            self._rows_queued += rows
            self._queued.set(self._rows_queued)
            self.admissions += 1
            self._cond.notify()

    def _shed(self, reason: str) -> None:
        self.metrics.shed.labels(reason=reason, **self._labels).inc()

    def ready_in(self) -> float | None:
        """Seconds until a batch is due: 0 when one can be taken now (full at the current size, the oldest input's
        delay spent, or stopping with inputs queued); None while nothing is queued."""
        with self._cond:
            if not self._heap:
                return None
            if self._rows_queued >= self.batch_size.size or self._stopping:
                return 0.0
            oldest = min(p.arrival for _, _, p in self._heap)
            return max(0.0, oldest + self.settings.max_delay_ms / 1000.0 - time.monotonic())

    @property
    def drained(self) -> bool:
        """Stopping, and nothing left to answer."""
        return self._stopping and not self._heap

    def take_batch(self) -> list[Pending]:
        """The next batch, up to the current batch size; requests whose deadline passed while they waited are shed
        here (a batch of them alone is empty). The batch counts as running until `batch_done`."""
        with self._cond:
            size = self.batch_size.size
            batch, rows, now = [], 0, time.monotonic()
            while self._heap and (not batch or rows + self._heap[0][2].rows <= size):
                pending = heapq.heappop(self._heap)[2]
                self._rows_queued -= pending.rows
                if pending.deadline < now:
                    self._shed("expired")
                    pending.settle(Shed(503, "expired", f"model {self.name}: the request's deadline "
                                        "passed while it waited in the queue"))
                    continue
                batch.append(pending)
                rows += pending.rows
            self._running = bool(batch)
            self._queued.set(self._rows_queued)
        return batch

    def batch_done(self) -> None:
        with self._cond:
            self._running = False

    def wait_for_admission(self, seen: int, timeout: float | None) -> None:
        """Wait, at most `timeout` seconds (None: no limit), until a request after the first `seen` is admitted or
        the queue is stopping."""
        with self._cond:
            self._cond.wait_for(lambda: self.admissions != seen or self._stopping, timeout)

    def request_stop(self) -> None:
        """Refuse new requests; the executor answers those queued, then ends."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()


class Inbox(Protocol):
    """Where an executor's requests come in: `collect` admits those that came, waiting at most `timeout` seconds for
    one (None: until one comes or the queue stops; 0: those already there). In an executor process the executor
    thread reads the front end's socket itself (`core.Executor`), so that a request reaching an idle executor starts
    at once, without waking a thread (a condition's wake-up took 130 us); in the server's process requests are
    admitted by the event loop's thread (`LocalInbox`)."""

    def collect(self, timeout: float | None) -> None: ...


class LocalInbox:
    """Requests admitted by other threads of this process: collecting waits for the next admission."""

    def __init__(self, queue: RequestQueue) -> None:
        self.queue = queue
        self._seen = queue.admissions

    def collect(self, timeout: float | None) -> None:
        if timeout != 0:
            self.queue.wait_for_admission(self._seen, timeout)
        self._seen = self.queue.admissions
