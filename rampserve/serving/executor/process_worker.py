"""The front end's handle on a bundle served by an executor process of its own (`serving.executor`).

The front end (the HTTP server's process) parses requests, writes their input tensors into shared memory
(`wire.SlotArena`) and sends a small header down a Unix socket; the executor process (`python -m
rampserve.serving.executor`, started fresh, never forked from the front end) runs the model's `ModelWorker` as a
standalone server would. Each answer (early or final) comes back as one frame, read on the front end's event loop
itself, so a released answer costs the front end no thread hop. The two processes share no interpreter: the front
end's parsing and writing never take the GIL from the model's Python parts, and on two cores each has one. Nothing
here imports torch: only the executor process loads the model.

Faults: when the executor process dies (killed, out of memory, a crash in native code), the front end sees its
socket close at once and fails every request the process held with a 503 that says why; it starts a new one at once
with the last configuration the old one adopted, which loads the sets on disk and compiles nothing before it serves
(its compile worker starts once a set not on disk is asked for), and refuses requests with 503 (Retry-After), the
model not ready, until it is ready. A process that dies soon after it became ready, again, is restarted after a
pause that grows (a crash loop). On shutdown the front end asks the process to answer everything it accepted and
waits for it to exit. The shared memory is an anonymous memory file: nothing of it outlives the processes, however
they end.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from functools import partial

import numpy as np

from rampserve.control.records import Configuration
from rampserve.serving.shared import wire
from rampserve.serving.shared.contract import Answer, ControlLink, ExecutorLost, ModelRequest, Shed, Worker
from rampserve.serving.shared.metrics import ServerMetrics
from rampserve.serving.shared.models import ServedModel
from rampserve.serving.shared.settings import ModelSettings

log = logging.getLogger("rampserve.serving")

# Slots of shared memory for requests' inputs: 64 KiB holds 20 Fashion-MNIST images or 4 text inputs of 512
# tokens; a request that fits no free slot sends its tensors in its frame instead. Pages are used only once
# written, so the 16 MiB cost what the busiest moment touched.
SLOT_BYTES = 64 << 10
SLOTS = 256
CONTROL_TIMEOUT_S = 5.0  # longest wait for an executor's status or metrics
# A process that dies this soon after it became ready, the second time in a row or more, is restarted after a
# growing pause (a crash loop); the first time, at once
QUICK_DEATH_S = 10.0
MAX_RESTART_PAUSE_S = 30.0


def make_worker(served: ServedModel, settings: ModelSettings, metrics: ServerMetrics,
                control: ControlLink | None = None) -> Worker:
    """The executor for a served model: a process of its own where settings ask for it and the model can be loaded
    from its bundle there (with its controller, unless `control` links it to one this process holds); else a
    thread in this process, which loads the model (and torch) here."""
    if settings.executor == "process" and served.bundle_dir is not None:
        return ProcessWorker(served, settings, metrics, control)
    from rampserve.serving.executor.worker import ModelWorker

    return ModelWorker(served, settings, metrics, control)


@dataclass(eq=False)
class _InFlight:
    future: asyncio.Future
    slot: int | None
    on_final: Callable[[Answer], None] | None  # None once called: a request's final answer comes once
    answered: bool = False  # its ANSWER came (its FINAL, when it has one, may come before or after)


class _Channel(asyncio.Protocol):
    """The front end's end of one executor process's socket, read on the event loop."""

    def __init__(self, worker: ProcessWorker, process: subprocess.Popen, ready: asyncio.Future) -> None:
        self.worker, self.process, self.ready = worker, process, ready
        self.reader = wire.FrameReader()
        self.transport: asyncio.Transport | None = None
        self.closed = asyncio.get_running_loop().create_future()
        self.ready_at = 0.0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        for kind, header, body in self.reader.feed(data):
            self.worker._on_frame(self, kind, header, body)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed.set_result(None)
        self.worker._lost(self)


def _ended(code: int | None) -> str:
    """How a process ended, from its exit status (None: not known yet, it is not reaped)."""
    return "ended" if code is None else f"was killed by signal {-code}" if code < 0 else f"exited with {code}"


class ProcessWorker:
    """The front end's handle on a model served by an executor process: the same interface as a `ModelWorker`."""

    def __init__(self, served: ServedModel, settings: ModelSettings, metrics: ServerMetrics,
                 control: ControlLink | None = None) -> None:
        """`control`: a controller this process holds for the model (on Ray Serve, the actor its replicas share),
        which the executor process's control thread reaches through this one; None: the executor has its own."""
        self.served, self.settings, self.metrics = served, settings, metrics
        self._control = control
        # Its calls block (a Ray actor's answers): they run on a thread, one at a time, in the order records came
        self._control_calls = None if control is None else ThreadPoolExecutor(1, f"control-{served.name}")
        self.restarts = 0
        self._arena: wire.SlotArena | None = None
        self._channel: _Channel | None = None  # None while (re)starting or stopped
        self._in_flight: dict[int, _InFlight] = {}
        self._replies: dict[int, asyncio.Future] = {}
        self._ids = itertools.count()
        self._configuration: Configuration | None = None  # the last one the executor adopted
        self._stopping = False
        self._restarting: asyncio.Task | None = None
        self._quick_deaths = 0
        self._lost_at = 0.0  # when the last executor process was lost
        # The last start's phases (seconds since its spawn) and sets, as its executor reported them; on a restart,
        # how long the model was unavailable
        self.last_start: dict = {}
        self._labels = {"model": served.name}
        self._background: tuple[int, ...] = ()  # processes its executors' polling must leave a core to

    @property
    def pid(self) -> int | None:
        return None if self._channel is None else self._channel.process.pid

    @property
    def available(self) -> bool:
        return self._channel is not None

    async def launch(self) -> None:
        self._arena = wire.SlotArena.create(self.served.name, SLOT_BYTES, SLOTS)
        self._channel = await self._spawn(restart=False)

    async def _spawn(self, restart: bool) -> _Channel:
        """Start an executor process and wait until it serves (its first set compiled and loaded)."""
        loop = asyncio.get_running_loop()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        command = [sys.executable, "-m", "rampserve.serving.executor", str(theirs.fileno()), str(self._arena.fd)]
        spawned = time.monotonic()
        # A session of its own: a terminal's Ctrl-C reaches the front end alone, which then drains the executor
        process = subprocess.Popen(command, pass_fds=(theirs.fileno(), self._arena.fd), start_new_session=True)
        theirs.close()
        ready = loop.create_future()
        transport, channel = await loop.create_unix_connection(lambda: _Channel(self, process, ready), sock=ours)
        # A restart serves as soon as the sets on disk are loaded: none is compiled ahead (the first start waits
        # `preload_s` for those), so its compile worker starts only once a set not on disk is asked for
        settings, relayed = (replace(self.settings, compile_ahead=False) if restart else self.settings), None
        if self._control is not None:  # the controller outlives its executors: it says where they start
            relayed = self._control.configuration().to_json()
        elif self._configuration is not None:  # a restart: carry on with the configuration the last one had
            last = self._configuration
            settings = replace(settings, controller=replace(
                settings.controller, initial=last.sites, start_thresholds=dict(zip(last.sites, last.thresholds))))
        transport.write(wire.frame(wire.HELLO, {
            "bundle": str(self.served.bundle_dir), "name": self.served.name, "version": self.served.version,
            "settings": settings.to_json(), "relayed_control": relayed, "spawned": spawned, "restart": restart,
            "slot_bytes": self._arena.slot_bytes, "slots": self._arena.slots}))
        if self._background:
            transport.write(wire.frame(wire.BACKGROUND, {"pids": self._background}))
        header = await ready
        channel.ready_at = time.monotonic()
        self.last_start = header["start"]
        return channel

    # ---- requests (event loop) ---------------------------------------------------------------------------------

    def submit(self, request: ModelRequest) -> asyncio.Future:
        channel = self._channel
        if channel is None:
            reason = "shutdown" if self._stopping else "restarting"
            self.metrics.shed.labels(reason=reason, **self._labels).inc()
            raise Shed(503, reason, f"model {self.served.name}: " + (
                "the server is shutting down" if self._stopping else "its executor process is restarting"), 1)
        layout, size = wire.layout_of(request.inputs)
        slot = self._arena.take() if size <= self._arena.slot_bytes else None
        body = bytearray()
        if slot is not None:
            start = self._arena.offset(slot)
            wire.pack_into(self._arena.view[start:start + size], request.inputs, layout)
        else:
            body = bytearray(size)
            wire.pack_into(memoryview(body), request.inputs, layout)
        request_id = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        self._in_flight[request_id] = _InFlight(future, slot, request.on_final)
        channel.transport.write(wire.request_frame(request_id, request, layout, slot, body))
        return future

    def yield_to(self, processes: tuple[int, ...]) -> None:
        self._background = processes
        if self._channel is not None:
            self._channel.transport.write(wire.frame(wire.BACKGROUND, {"pids": processes}))

    def count_cached(self, labels: np.ndarray) -> None:
        if self._channel is not None:
            self._channel.transport.write(wire.frame(wire.CACHED, {}, np.asarray(labels, dtype=np.int64).tobytes()))

    def _on_frame(self, channel: _Channel, kind: int, header: dict, body: memoryview) -> None:
        if kind == wire.ANSWER:
            waiting = self._in_flight.get(header["i"])
            if waiting is None:
                return
            self._release_slot(waiting)
            waiting.answered = True
            if waiting.on_final is None:  # no final answer to keep, or it came first
                del self._in_flight[header["i"]]
            if not waiting.future.done():
                waiting.future.set_result(wire.read_answer(header, body))
        elif kind == wire.FINAL:
            # Before the ANSWER when that carries the final answer (the executor keeps it first, so the cache holds
            # it before the response leaves); after it when a ramp released the answer early
            waiting = self._in_flight.get(header["i"])
            if waiting is not None and waiting.on_final is not None:
                on_final, waiting.on_final = waiting.on_final, None
                if waiting.answered:
                    del self._in_flight[header["i"]]
                on_final(wire.read_answer(header, body))
        elif kind == wire.REFUSED:
            waiting = self._in_flight.pop(header["i"], None)
            if waiting is not None:
                self._release_slot(waiting)
                if not waiting.future.done():
                    waiting.future.set_exception(wire.read_refusal(header))
        elif kind == wire.REPLY:
            future = self._replies.pop(header["i"], None)
            if future is not None and not future.done():
                future.set_result(header["r"])
        elif kind in (wire.OBSERVE, wire.REFRESH) and self._control is not None:
            call = (partial(self._control.observe, wire.read_record(header, body)) if kind == wire.OBSERVE
                    else self._control.refresh)
            asked = asyncio.get_running_loop().run_in_executor(self._control_calls, self._ask_control, call)
            asked.add_done_callback(partial(self._control_answered, channel, header["i"]))
        elif kind == wire.CONFIGURATION:
            self._configuration = Configuration.from_json(header)
        elif kind == wire.READY and not channel.ready.done():
            channel.ready.set_result(header)

    def _ask_control(self, call: Callable[[], Configuration | None]) -> dict:
        new = call()
        return {"configuration": None if new is None else new.to_json(), "readings": self._control.readings()}

    def _control_answered(self, channel: _Channel, request: int, asked: asyncio.Future) -> None:
        if channel is not self._channel:
            return  # that executor is gone
        if asked.exception() is not None:
            log.error("model %s: its controller failed: %s", self.served.name, asked.exception())
            answer = {"i": request, "error": str(asked.exception())}
        else:
            answer = {"i": request, **asked.result()}
        channel.transport.write(wire.frame(wire.CONTROL_REPLY, answer))

    def _release_slot(self, waiting: _InFlight) -> None:
        if waiting.slot is not None:
            self._arena.give(waiting.slot)
            waiting.slot = None

    def _lost(self, channel: _Channel) -> None:
        """The executor's socket closed: it exited (asked to, or died). Everything it held fails now."""
        how = _ended(channel.process.poll())
        if not channel.ready.done():
            channel.ready.set_exception(RuntimeError(f"model {self.served.name}: its executor process {how} "
                                                     "before it was ready"))
        self._channel = None
        lost = ExecutorLost(f"model {self.served.name}: its executor process {how} while it held this request; "
                            "it is being restarted")
        for waiting in self._in_flight.values():
            if not waiting.future.done():
                waiting.future.set_exception(lost)
        self._in_flight.clear()
        for future in self._replies.values():
            if not future.done():
                future.set_exception(lost)
        self._replies.clear()
        self._arena.free_all()  # nobody reads any slot now
        if self._stopping or not channel.ready_at:
            return
        self.restarts += 1
        self.metrics.executor_restarts.labels(**self._labels).inc()
        self._lost_at = time.monotonic()
        self._quick_deaths = self._quick_deaths + 1 if self._lost_at - channel.ready_at < QUICK_DEATH_S else 0
        self._restarting = asyncio.get_running_loop().create_task(self._restart(channel.process))

    async def _restart(self, dead: subprocess.Popen) -> None:
        await asyncio.to_thread(dead.wait)  # reap it: how it ended is known only then
        log.error("model %s: its executor process (pid %d) %s; restarting it", self.served.name, dead.pid,
                  _ended(dead.returncode))
        while not self._stopping:
            if self._quick_deaths > 1:
                await asyncio.sleep(min(MAX_RESTART_PAUSE_S, 0.5 * 2 ** (self._quick_deaths - 1)))
            try:
                channel = await self._spawn(restart=True)
            except Exception:
                log.exception("model %s: its executor process failed to start again", self.served.name)
                self._quick_deaths += 1
                continue
            self.last_start["unavailable_s"] = channel.ready_at - self._lost_at
            self._channel = channel
            log.warning("model %s: its new executor process (pid %d) serves, %.2f s after the last one was lost",
                        self.served.name, channel.process.pid, self.last_start["unavailable_s"])
            return

    # ---- status and metrics -------------------------------------------------------------------------------------

    async def _ask(self, kind: int, **question: object) -> object:
        channel = self._channel
        if channel is None:
            raise ExecutorLost(f"model {self.served.name}: its executor process is restarting")
        request = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        self._replies[request] = future
        channel.transport.write(wire.frame(kind, {"i": request, **question}))
        try:
            return await asyncio.wait_for(future, CONTROL_TIMEOUT_S)
        finally:
            self._replies.pop(request, None)

    async def current_status(self, latest_decisions: int | None = None) -> dict:
        executor = {"kind": "process", "pid": self.pid, "restarts": self.restarts, "in_flight": len(self._in_flight),
                    "available": self.available, "last_start": self.last_start,
                    "idle_poll_ms": self.settings.idle_poll_ms, "policy": self.last_start.get("policy"),
                    "yields_to": self._background}
        try:
            status = await self._ask(wire.STATUS, decisions=latest_decisions)
        except (ExecutorLost, TimeoutError) as exc:
            return {"name": self.served.name, "version": self.served.version, "executor": executor,
                    "unavailable": str(exc) or "no answer"}
        if self._control is not None:  # the controller's part, which the executor cannot ask for
            status.update(await asyncio.to_thread(self._control.status, latest_decisions))
        return {**status, "executor": executor}

    async def exported_metrics(self) -> list[dict]:
        try:
            return await self._ask(wire.METRICS)
        except (ExecutorLost, TimeoutError):
            return []

    # ---- shutdown -----------------------------------------------------------------------------------------------

    async def shutdown(self) -> None:
        """Let the executor answer everything it accepted, then wait for it to exit."""
        self._stopping = True
        if self._restarting is not None:
            self._restarting.cancel()
        channel = self._channel
        if channel is not None:
            channel.transport.write(wire.frame(wire.QUIT, {}))
            await channel.closed
            await asyncio.to_thread(channel.process.wait)
        self._channel = None
        if self._arena is not None:
            self._arena.close()
            self._arena = None
        if self._control_calls is not None:
            self._control_calls.shutdown()

