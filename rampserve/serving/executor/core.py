"""A served bundle's executor process: `python -m rampserve.serving.executor SOCKET_FD ARENA_FD`, started by the
front end's `process_worker.ProcessWorker`.

It runs the model's `ModelWorker` as a standalone server would: its queue and batching policy, the batch execution
with early release, the releasing thread, the controller and the compile worker. Requests come from the front end's
socket, their inputs from the shared memory it wrote them into; each answer goes back as one frame, sent from
whichever thread has it. It stops when the front end says so, or is gone, once it has answered what it accepted.

Its start is logged phase by phase (`StartLog`): the interpreter started, the imports (torch, ONNX Runtime, the
controller) done, the bundle loaded, the compiled sets loaded, ready; a restart's at WARNING, since the model is
unavailable until the last of them.
"""

from __future__ import annotations

import importlib
import itertools
import logging
import math
import os
import queue
import select
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from prometheus_client import CollectorRegistry

from rampserve.control.records import BatchRecord, Configuration
from rampserve.serving.executor.loading import loaded, read_served
from rampserve.serving.shared import wire
from rampserve.serving.shared.contract import GIL_SWITCH_INTERVAL_S, Answer, Shed, freeze_startup_objects
from rampserve.serving.shared.metrics import ServerMetrics
from rampserve.serving.shared.models import ServedModel
from rampserve.serving.shared.settings import ModelSettings
from rampserve.threads import (
    OsNamedThread,
    RunnableWatch,
    idle_native_threads,
    idle_pools_while_alone,
    schedule_as_idle,
    thread_ids,
)

if TYPE_CHECKING:
    from rampserve.serving.executor.worker import ModelWorker

log = logging.getLogger("rampserve.serving")

# Longest an executor's control thread waits for a controller the front end holds; past it, the record is lost to
# the controller and the executor serves on with the configuration it has (as a replica that loses its controller)
CONTROL_CALL_TIMEOUT_S = 30.0
# How long a poll rests in select at a time while a SCHED_IDLE thread waits for a core (`wait_readable`): a frame
# wakes it sooner
POLL_REST_S = 0.001

# What serving a bundle imports, by its backend (torch, ONNX Runtime and its Python operators, the controller):
# imported by `main` after the interpreter's start and before the bundle loads, so that the start's log tells the
# three apart (this module imports none of them at its top)
MODEL_MODULES = {"torch": ("rampserve.serving.executor.worker", "rampserve.runtime.bundle"),
                 "onnx": ("rampserve.serving.executor.worker", "rampserve.runtime.bundle",
                          "rampserve.runtime.onnx_signals")}


class StartLog:
    """An executor's start, phase by phase: each is logged as it ends with its time since the front end started the
    process (`time.monotonic` is one clock across processes), at WARNING on a restart (the model is unavailable
    until it is ready: an operator sees where that time went) and at INFO on a first start. `report` is what READY
    carries to the front end, which shows it in the model's status."""

    def __init__(self, model: str, spawned: float, restart: bool, policy: str) -> None:
        self.model, self.spawned, self.policy = model, spawned, policy
        self.what, self.level = ("restart", logging.WARNING) if restart else ("start", logging.INFO)
        self.phases: list[tuple[str, float]] = []  # (phase, seconds since the spawn at its end)
        self.sets: dict[str, int] = {}

    def phase(self, name: str, detail: str = "") -> None:
        at = time.monotonic() - self.spawned
        took = at - (self.phases[-1][1] if self.phases else 0.0)
        self.phases.append((name, at))
        log.log(self.level, "model %s: executor %s: %s at %.2f s (+%.2f s)%s", self.model, self.what, name, at, took,
                f"; {detail}" if detail else "")

    def report(self) -> dict:
        return {"phases": dict(self.phases), "sets": self.sets, "policy": self.policy}


def wait_readable(sock: socket.socket, timeout: float | None, poll_until: float,
                  others_waiting: Callable[[], bool] = lambda: False) -> str | None:
    """How `sock` became readable within `timeout` seconds (None: no limit): "ready" if it was already, "polled" if
    it became so while the monotonic clock was before `poll_until` (looked at again and again, the core yielded to
    any other runnable thread between looks), "rested" if it did so while the poll rested in select (as it does
    while `others_waiting()` says a SCHED_IDLE thread of the server wants a core), else "slept" (in select once the
    window ended); None if it did not."""
    if select.select([sock], [], [], 0)[0]:
        return "ready"
    if timeout == 0:  # a look between batches, once per batch: no second look
        return None
    now = time.monotonic()
    deadline = None if timeout is None else now + timeout
    stop_polling = poll_until if deadline is None else min(poll_until, deadline)
    while now < stop_polling:
        if others_waiting():
            # sched_yield hands the core to threads of the normal policy alone: a poll that goes on while requests
            # keep coming would keep a SCHED_IDLE thread (the controller, the training job) off it for good. In
            # select the core is theirs, and a frame takes it back at once (this thread's wake preempts them)
            if select.select([sock], [], [], min(POLL_REST_S, stop_polling - now))[0]:
                return "rested"
        else:
            os.sched_yield()
            if select.select([sock], [], [], 0)[0]:
                return "polled"
        now = time.monotonic()
    remaining = None if deadline is None else max(0.0, deadline - now)
    return "slept" if select.select([sock], [], [], remaining)[0] else None


def metric_families(registry: CollectorRegistry, model: str) -> list[dict]:
    """The registry's samples of one model, as data (the front end merges them into its own /metrics)."""
    families = []
    for family in registry.collect():
        samples = [(s.name, s.labels, s.value) for s in family.samples
                   if s.labels.get("model") == model and not s.name.endswith("_created")]
        if samples:
            families.append({"name": family.name, "help": family.documentation, "type": family.type,
                             "samples": samples})
    return families


class StatusReplies:
    """Answers the front end's status questions off the executor thread: the executor thread takes the serving part
    (whole with the answers it has sent) and this thread adds the controller's, which waits for the controller
    (`ModelWorker.controller_status`). Answered on the executor thread, a status question that met a search stopped
    every request until the search ended: the dashboard asks once a second, and minilm-rt's replays had p99 rounds
    of 117-189 ms against vanilla's 32-41."""

    def __init__(self, worker: ModelWorker, send: Callable[[bytes], None]) -> None:
        self._worker, self._send = worker, send
        self._asked: queue.SimpleQueue[tuple[int, dict, int | None] | None] = queue.SimpleQueue()
        self._thread = OsNamedThread(target=self._answer, name="status", daemon=True)
        self._thread.start()

    def ask(self, call: int, latest_decisions: int | None) -> None:
        """On the executor thread."""
        self._asked.put((call, self._worker.serving_status(), latest_decisions))

    def close(self) -> None:
        self._asked.put(None)
        self._thread.join()

    def _answer(self) -> None:
        while (asked := self._asked.get()) is not None:
            call, serving, latest_decisions = asked
            status = serving | self._worker.controller_status(latest_decisions)
            self._send(wire.frame(wire.REPLY, {"i": call, "r": status}))


class Executor:
    """The executor process: a `ModelWorker` whose executor thread reads the front end's frames itself whenever it
    waits for work (the executor is its `Inbox`), and answers through the socket from whichever thread has the
    answer."""

    def __init__(self, sock: socket.socket, reader: wire.FrameReader, hello: dict, arena_fd: int, model: ServedModel,
                 start: StartLog) -> None:
        """`model` is loaded already (`main` times it)."""
        from rampserve.serving.executor.worker import ModelWorker  # imported by `main`, which times the imports

        self._sock, self._reader, self._sending = sock, reader, threading.Lock()
        self._last_request = -math.inf  # no request yet: no poll window open
        self._calls: dict[int, Future] = {}  # the front end's answers awaited, by call
        self._call_ids = itertools.count()
        self._calls_lock = threading.Lock()
        self.arena = wire.SlotArena(arena_fd, hello["slot_bytes"], hello["slots"])
        self.start = start
        self.metrics = ServerMetrics()
        relayed = hello["relayed_control"]
        control = None if relayed is None else RelayedControl(self, Configuration.from_json(relayed))
        self.worker = ModelWorker(model, ModelSettings.from_json(hello["settings"]), self.metrics, control,
                                  inbox=self, on_configuration=self._tell_configuration)
        self._status = StatusReplies(self.worker, self.send)
        self._poll_s = self.worker.settings.idle_poll_ms / 1000.0
        self._idle_work = RunnableWatch()  # the server's SCHED_IDLE threads, which polling must not starve
        self._background: list[tuple[int, int]] = []  # those of the front end's background processes
        self._found = {how: self.metrics.executor_frames_found.labels(model=model.name, how=how)
                       for how in ("ready", "polled", "rested", "slept")}

    def send(self, data: bytes) -> None:
        with self._sending:  # the executor, releasing and control threads all answer
            self._sock.sendall(data)

    def call(self, make_frame: Callable[[int], bytes]) -> dict:
        """Ask the front end (from the control thread) and wait for its answer."""
        future: Future = Future()
        with self._calls_lock:
            call = next(self._call_ids)
            self._calls[call] = future
        self.send(make_frame(call))
        try:
            return future.result(CONTROL_CALL_TIMEOUT_S)
        finally:
            with self._calls_lock:
                self._calls.pop(call, None)

    def serve(self) -> None:
        self.worker.start()
        self._idle_work.watch((os.getpid(), thread) for thread in self.worker.background_threads)
        self.start.phase("sets loaded", self._sets_loaded())
        freeze_startup_objects()
        self.start.phase("ready")
        self.send(wire.frame(wire.READY, {"pid": os.getpid(), "start": self.start.report()}))
        self.worker.wait_stopped()
        self.worker.stop()  # the control thread's last records, the compile worker
        self._status.close()
        self._idle_work.close()

    def _sets_loaded(self) -> str:
        """The compiled sets held once started, how many were loaded from disk (compiled before, by this process's
        compile worker or an earlier one's) and how many the compile worker compiled meanwhile."""
        held = self.worker.model.compiled_sets()
        compiled = self.metrics.registry.get_sample_value(
            "rampserve_compiles_total", {"model": self.worker.served.name, "outcome": "compiled"}) or 0
        sets = self.start.sets = {"held": len(held), "from_disk": sum(s.from_disk for s in held),
                                  "compiled": int(compiled)}
        return (f"{sets['from_disk']} of {sets['held']} compiled sets from disk, {sets['compiled']} compiled by the "
                "compile worker first")

    def _tell_configuration(self, config: Configuration) -> None:
        self.send(wire.frame(wire.CONFIGURATION, config.to_json()))

    def collect(self, timeout: float | None) -> None:
        """Whatever the front end sent, waiting at most `timeout` seconds for it (on the executor thread), polling
        for it within `idle_poll_ms` of the last request (`ModelSettings.idle_poll_ms` says why). Only requests
        (and answers from the prediction cache) open that window: the dashboard's sampler asks for metrics and
        status once a second, and each of its frames opened 50 ms of polling, 5% of a core for an idle server."""
        how = wait_readable(self._sock, timeout, self._last_request + self._poll_s, self._idle_work.any_runnable)
        if how is None:
            return
        self._found[how].inc()
        data = self._sock.recv(1 << 20)
        if not data:  # the front end is gone: answer what was accepted, then end
            self._quit()
            return
        traffic = False
        for kind, header, body in self._reader.feed(data):
            traffic = traffic or kind in (wire.REQUEST, wire.CACHED)
            self._handle(kind, header, body)
        if traffic:
            self._last_request = time.monotonic()

    def _handle(self, kind: int, header: dict, body: memoryview) -> None:
        if kind == wire.REQUEST:
            self._admit(header, body)
        elif kind == wire.CACHED:
            self.worker.count_cached(np.frombuffer(body, np.int64).copy())
        elif kind == wire.STATUS:
            self._status.ask(header["i"], header.get("decisions"))
        elif kind == wire.METRICS:
            families = metric_families(self.metrics.registry, self.worker.served.name)
            self.send(wire.frame(wire.REPLY, {"i": header["i"], "r": families}))
        elif kind == wire.CONTROL_REPLY:
            with self._calls_lock:
                future = self._calls.get(header["i"])
            if future is not None:
                future.set_result(header)
        elif kind == wire.QUIT:
            self._quit()
        elif kind == wire.BACKGROUND:
            self._idle_work.forget(self._background)
            self._background = [(pid, pid) for pid in header["pids"]]  # a process's main thread does its work
            self._idle_work.watch(self._background)
            idle_pools_while_alone(not self._background)

    def _quit(self) -> None:
        with self._calls_lock:  # the front end answers no more: the control thread must not wait for it
            for future in self._calls.values():
                if not future.done():
                    future.set_exception(ConnectionError("the front end is gone"))
        self.worker.queue.request_stop()

    def _admit(self, header: dict, body: memoryview) -> None:
        request_id, slot = header["i"], header["slot"]
        inputs = (wire.unpack(body, header["layout"]) if slot is None
                  else wire.unpack(self.arena.view, header["layout"], self.arena.offset(slot)))
        try:
            self.worker.queue.admit(wire.read_request(header, inputs, partial(self._final, request_id)),
                                    partial(self._reply, request_id))
        except Shed as exc:
            self.send(wire.refused_frame(request_id, exc))

    def _reply(self, request: int, result: Answer | BaseException) -> None:
        if isinstance(result, Answer):
            self.send(wire.answer_frame(wire.ANSWER, request, result))
        else:
            self.send(wire.refused_frame(request, result))

    def _final(self, request: int, answer: Answer) -> None:
        self.send(wire.answer_frame(wire.FINAL, request, answer))


class RelayedControl:
    """An executor process's `ControlLink` to a controller the front end holds (a Ray actor that every replica of
    the model shares): the control thread's records and questions go through the front end. Its status is the
    front end's to add (the executor answers status questions on the thread that reads these answers)."""

    idle = False  # the controller may change the configuration (it lives elsewhere: it is not asked)

    def __init__(self, executor: Executor, start: Configuration) -> None:
        self._executor, self._current = executor, start
        self._readings = {"window_accuracy": 1.0, "disagreement_upper": 0.0, "risk_scale": 1.0}

    def configuration(self) -> Configuration:
        return self._current

    def observe(self, record: BatchRecord) -> Configuration | None:
        return self._ask(partial(wire.record_frame, record=record))

    def refresh(self) -> Configuration | None:
        return self._ask(lambda call: wire.frame(wire.REFRESH, {"i": call}))

    def _ask(self, make_frame: Callable[[int], bytes]) -> Configuration | None:
        try:
            answer = self._executor.call(make_frame)
        except (ConnectionError, TimeoutError) as exc:
            log.warning("the model's controller did not answer (%s); serving on with configuration %d", exc,
                        self._current.version)
            return None
        if "error" in answer:
            return None
        self._readings = answer["readings"]
        if answer["configuration"] is None:
            return None
        self._current = Configuration.from_json(answer["configuration"])
        return self._current

    def readings(self) -> dict[str, float]:
        return self._readings

    def status(self, latest_decisions: int | None = None) -> dict:
        return {}


def scheduled(policy: str) -> str:
    """Schedule this process's threads by `ModelSettings.executor_policy` (before the model's imports: the threads
    started after, the model's pools among them, inherit it); the policy in effect ("normal" where Linux's SCHED_IDLE
    is not to be had)."""
    if policy == "idle":  # the threads there already too (numpy's BLAS pool, started by its import)
        return policy if all([schedule_as_idle(thread) for thread in thread_ids() or {0}]) else "normal"
    if policy == "idle-pools" and idle_native_threads():
        return policy
    return "normal"


def main(argv: list[str]) -> None:
    """`python -m rampserve.serving.executor SOCKET_FD ARENA_FD`, started by a `ProcessWorker`."""
    sock_fd, arena_fd = int(argv[0]), int(argv[1])
    # The front end decides when this process stops (it drains it on its own SIGINT or SIGTERM)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.set_inheritable(sock_fd, False)  # the compile worker must not hold the socket open after this process dies
    os.set_inheritable(arena_fd, False)
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    logging.basicConfig(level=logging.WARNING, format="rampserve executor %(process)d: %(message)s")
    sock = socket.socket(fileno=sock_fd)
    reader = wire.FrameReader()
    first = None
    while first is None and (data := sock.recv(1 << 20)):
        first = next(iter(reader.feed(data)), None)  # nothing else comes before the executor is ready
    if first is None or first[0] != wire.HELLO:
        raise SystemExit("rampserve executor: the front end sent no HELLO")
    hello = first[1]
    start = StartLog(hello["name"], hello["spawned"], hello["restart"], scheduled(hello["settings"]["executor_policy"]))
    start.phase("process started", f"scheduling policy {start.policy}")
    model = read_served(Path(hello["bundle"]), hello["name"], hello["version"])
    for module in MODEL_MODULES[model.backend]:
        importlib.import_module(module)
    start.phase("imports done")
    model = loaded(model)  # timed apart from the sets
    start.phase("bundle loaded")
    Executor(sock, reader, hello, arena_fd, model, start).serve()


