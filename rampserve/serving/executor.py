"""A served bundle's executor process: `python -m rampserve.serving.executor SOCKET_FD ARENA_FD`, started by the
front end's `process_worker.ProcessWorker`.

It runs the model's `ModelWorker` as a standalone server would: its queue and batching policy, the batch execution
with early release, the releasing thread, the controller and the compile worker. Requests come from the front end's
socket, their inputs from the shared memory it wrote them into; each answer goes back as one frame, sent from
whichever thread has it. It stops when the front end says so, or is gone, once it has answered what it accepted.
"""

from __future__ import annotations

import itertools
import logging
import os
import select
import signal
import socket
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future
from functools import partial
from pathlib import Path

import numpy as np
from prometheus_client import CollectorRegistry

from rampserve.control.records import BatchRecord, Configuration
from rampserve.serving import wire
from rampserve.serving.contract import GIL_SWITCH_INTERVAL_S, Answer, ModelSettings, Shed, freeze_startup_objects
from rampserve.serving.metrics import ServerMetrics
from rampserve.serving.models import read_served
from rampserve.serving.worker import ModelWorker

log = logging.getLogger("rampserve.serving")

# Longest an executor's control thread waits for a controller the front end holds; past it, the record is lost to
# the controller and the executor serves on with the configuration it has (as a replica that loses its controller)
CONTROL_CALL_TIMEOUT_S = 30.0


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


class Executor:
    """The executor process: a `ModelWorker` whose executor thread reads the front end's frames itself whenever it
    waits for work (`RequestQueue.feed`), and answers through the socket from whichever thread has the answer."""

    def __init__(self, sock: socket.socket, reader: wire.FrameReader, hello: dict, arena_fd: int) -> None:
        self._sock, self._reader, self._sending = sock, reader, threading.Lock()
        self._calls: dict[int, Future] = {}  # the front end's answers awaited, by call
        self._call_ids = itertools.count()
        self._calls_lock = threading.Lock()
        self.arena = wire.SlotArena(arena_fd, hello["slot_bytes"], hello["slots"])
        model = read_served(Path(hello["bundle"]), hello["name"], hello["version"])
        self.metrics = ServerMetrics()
        relayed = hello["relayed_control"]
        control = None if relayed is None else RelayedControl(self, Configuration.from_json(relayed))
        self.worker = ModelWorker(model, ModelSettings.from_json(hello["settings"]), self.metrics, control)
        self.worker.on_configuration = lambda config: self.send(wire.frame(wire.CONFIGURATION, config.to_json()))
        self.worker.queue.feed = self._read

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
        freeze_startup_objects()
        self.send(wire.frame(wire.READY, {"pid": os.getpid()}))
        self.worker.wait_stopped()
        self.worker.stop()  # the control thread's last records, the compile worker

    def _read(self, timeout: float | None) -> None:
        """Whatever the front end sent, waiting at most `timeout` seconds for it (on the executor thread)."""
        if not select.select([self._sock], [], [], timeout)[0]:
            return
        data = self._sock.recv(1 << 20)
        if not data:  # the front end is gone: answer what was accepted, then end
            self._quit()
            return
        for kind, header, body in self._reader.feed(data):
            self._handle(kind, header, body)

    def _handle(self, kind: int, header: dict, body: memoryview) -> None:
        if kind == wire.REQUEST:
            self._admit(header, body)
        elif kind == wire.CACHED:
            self.worker.count_cached(np.frombuffer(body, np.int64).copy())
        elif kind == wire.STATUS:
            self.send(wire.frame(wire.REPLY, {"i": header["i"], "r": self.worker.status(header.get("decisions"))}))
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

    def _quit(self) -> None:
        with self._calls_lock:  # the front end answers no more: the control thread must not wait for it
            for future in self._calls.values():
                if not future.done():
                    future.set_exception(ConnectionError("the front end is gone"))
        self.worker.queue.request_stop()

    def _admit(self, header: dict, body: memoryview) -> None:
        request, slot = header["i"], header["slot"]
        inputs = (wire.unpack(body, header["layout"]) if slot is None
                  else wire.unpack(self.arena.view, header["layout"], self.arena.offset(slot)))
        try:
            self.worker.queue.admit(inputs, header["rows"], header["final"], partial(self._reply, request),
                                    header["deadline"], header["priority"],
                                    partial(self._final, request) if header["keep"] else None, header["arrival"])
        except Shed as exc:
            self.send(wire.refused_frame(request, exc))

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
    hello = None
    while hello is None and (data := sock.recv(1 << 20)):
        hello = next(iter(reader.feed(data)), None)  # nothing else comes before the executor is ready
    if hello is None or hello[0] != wire.HELLO:
        raise SystemExit("rampserve executor: the front end sent no HELLO")
    Executor(sock, reader, hello[1], arena_fd).serve()


if __name__ == "__main__":
    main(sys.argv[1:])
