"""Compiling a served model's active-ramp sets off the serving process's interpreter.

Tracing a set to TorchScript runs the model eagerly several times and holds the GIL for most of it (0.1-0.4 s
on the zoo's CNNs, about 1 s on MiniLM), which stalls the event loop and the executor of the process that does
it. A `CompileService` hands that work to a worker process of its own (spawned, at a lower CPU priority), which
loads the same bundle, traces the set with its ramps fused in and writes its stages next to the bundle (see
`runtime.compiled`). The serving process only loads finished stages from disk, after checking their digests.
A restart, or a second server of the same bundle, finds them there and compiles nothing.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import multiprocessing
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np

from rampserve.bundle_format.manifest import bundle_digest
from rampserve.runtime.compiled import CompiledSet, CorruptEntry, compiled_dir, has_compiled, remove_compiled
from rampserve.runtime.prepared import PreparedModel
from rampserve.runtime.torchscript_sets import load_compiled, save_compiled, set_key
from rampserve.serving.executor.compiling import CompileOutcome
from rampserve.threads import OsNamedThread

log = logging.getLogger("rampserve.serving")

WORKER_NICENESS = 10  # compiling is background work: the serving process's threads come first for the CPU
URGENT, AHEAD = 0, 1  # a configuration waiting to be adopted, then sets compiled ahead of need


class CompileService:
    """Compiles one bundle's active-ramp sets in a worker process, one at a time, urgent ones first, and loads
    finished ones. `on_outcome` is called (on the service's listener thread) as each request finishes. Every set
    is compiled in exit mode `mode` ("release", or "stop": see `runtime.compiled.StopSetRunner`)."""

    def __init__(self, model: PreparedModel, example: Mapping[str, np.ndarray],
                 on_outcome: Callable[[CompileOutcome], None] | None = None, mode: str = "release") -> None:
        if model.bundle_dir is None:
            raise ValueError("a compile service needs a model loaded from a bundle directory")
        self.model = model
        self.mode = mode
        self.example = {name: np.ascontiguousarray(value) for name, value in example.items()}
        self.digest = bundle_digest(model.bundle_dir)
        self.directory = compiled_dir(model.bundle_dir, self.digest)
        self.on_outcome = on_outcome
        self._cond = threading.Condition()
        self._queue: list[tuple[int, int, tuple[str, ...], float]] = []  # (priority, order, sites, asked at)
        self._queued: dict[tuple[str, ...], int] = {}  # sites -> priority, while queued
        self._busy: tuple[tuple[str, ...], float] | None = None  # the set the worker is compiling, since when
        self._failed: dict[tuple[str, ...], str] = {}  # sets whose compile raised, with why (not kept on disk)
        self._order = itertools.count()
        self._process: multiprocessing.process.BaseProcess | None = None
        self._conn = None
        self._closed = False

    # ---- what is ready (any thread) ------------------------------------------------------------------------------

    def _key(self, sites: Sequence[str]) -> tuple[tuple[str, ...], str]:
        ordered = self.model.backend.ordered_cuts(sites)
        return ordered, set_key(self.digest, ordered, self.model.error_score, self.mode)

    def ready(self, sites: Sequence[str]) -> bool:
        """Whether `sites` can be loaded now: it is compiled (or refused) on disk, or its compile failed."""
        ordered, key = self._key(sites)
        return ordered in self._failed or has_compiled(self.directory, key)

    def load(self, sites: Sequence[str]) -> CompiledSet | None:
        """The compiled set for `sites` from disk, or None where it does not compile (refused, failed). A corrupt
        entry is deleted and the set asked for again; this raises KeyError where the set is not ready."""
        ordered, key = self._key(sites)
        if ordered in self._failed:
            return None
        try:
            compiled = load_compiled(self.directory, key)
        except FileNotFoundError:
            raise KeyError(f"set {ordered} is not compiled yet") from None
        except CorruptEntry as exc:
            log.warning("%s; compiling it again", exc)
            remove_compiled(self.directory, key)
            self.request(ordered, urgent=True)
            raise KeyError(f"set {ordered} was corrupt on disk; it is being compiled again") from exc
        return None if isinstance(compiled, str) else compiled

    # ---- asking (any thread) ---------------------------------------------------------------------------------------

    def request(self, sites: Sequence[str], urgent: bool = False) -> None:
        """Have `sites` compiled unless it is ready or already asked for (an urgent ask moves it ahead)."""
        ordered = self.model.backend.ordered_cuts(sites)
        priority = URGENT if urgent else AHEAD
        with self._cond:
            if self._closed or (self._busy is not None and self._busy[0] == ordered) or self.ready(ordered):
                return
            if self._queued.get(ordered, AHEAD + 1) <= priority:
                return
            self._queued[ordered] = priority  # an earlier, less urgent entry is skipped when it comes up
            heapq.heappush(self._queue, (priority, next(self._order), ordered, time.monotonic()))
            self._pump()

    def wait(self, sites: Sequence[str], timeout_s: float, urgent: bool = True) -> bool:
        """Ask for `sites` (urgently, unless told otherwise) and wait until it is ready; whether it became ready
        in time."""
        self.request(sites, urgent=urgent)
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while not self.ready(sites):
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._closed:
                    return False
                self._cond.wait(min(remaining, 0.5))
        return True

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._queue.clear()
            self._queued.clear()
            conn, process = self._conn, self._process
            self._cond.notify_all()
        if conn is not None:
            try:
                conn.send(None)
            except OSError:
                pass
        if process is not None:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
                process.join()

    # ---- the worker process ------------------------------------------------------------------------------------

    def _pump(self) -> None:
        """Send the most urgent queued set to the worker if it is idle (holding the condition)."""
        while self._busy is None and self._queue:
            priority, _, sites, asked = heapq.heappop(self._queue)
            if self._queued.get(sites) != priority:
                continue  # superseded by a more urgent ask, or already handled
            del self._queued[sites]
            if self.ready(sites):
                continue
            if self._process is None or not self._process.is_alive():
                self._start_worker()
            self._busy = (sites, asked)
            self._conn.send(sites)

    def _start_worker(self) -> None:
        context = multiprocessing.get_context("spawn")  # never fork a process that has loaded torch
        parent, child = context.Pipe()
        self._process = context.Process(
            target=compile_worker,
            args=(str(self.model.bundle_dir), self.example, str(self.directory), child, self.mode),
            name=f"rampserve-compile-{self.model.bundle_dir.name}", daemon=True)
        self._process.start()
        child.close()
        self._conn = parent
        OsNamedThread(target=self._listen, args=(parent,), name="compile-listener", daemon=True).start()

    def _listen(self, conn) -> None:
        while True:
            try:
                outcome, sites, reason = conn.recv()
            except (EOFError, OSError):  # the worker exited or died: whatever it was compiling failed
                with self._cond:
                    busy, self._busy, self._process = self._busy, None, None
                    if busy is not None and not self._closed:
                        self._finish(busy, "failed", "the compile worker process exited")
                    if not self._closed:
                        self._pump()
                return
            with self._cond:
                busy, self._busy = self._busy, None
                self._finish((tuple(sites), busy[1] if busy else time.monotonic()), outcome, reason)
                self._pump()

    def _finish(self, busy: tuple[tuple[str, ...], float], outcome: str, reason: str) -> None:
        sites, asked = busy
        if outcome == "failed":
            self._failed[sites] = reason
            log.warning("compiling %s failed (%s); that set is served eagerly", sites, reason)
        self._cond.notify_all()
        if self.on_outcome is not None:
            self.on_outcome(CompileOutcome(sites, outcome, time.monotonic() - asked, reason))


def compile_worker(bundle_dir: str, example: dict[str, np.ndarray], directory: str, conn,
                   mode: str = "release") -> None:
    """The worker process: load the bundle once, then compile each set it is sent (in exit mode `mode`) and store
    its stages."""
    import torch

    from rampserve.runtime.bundle import load_bundle

    os.nice(WORKER_NICENESS)
    torch.set_num_threads(1)
    model = load_bundle(Path(bundle_dir))
    digest, out = bundle_digest(Path(bundle_dir)), Path(directory)
    while (sites := _next_request(conn)) is not None:
        try:
            compiled = model.build_compiled(sites, example, mode)
            ordered = model.backend.ordered_cuts(sites)
            save_compiled(out, set_key(digest, ordered, model.error_score, mode), compiled,
                          "a stage does not trace faithfully to TorchScript")
            conn.send(("compiled" if compiled is not None else "refused", ordered, ""))
        except Exception as exc:  # the parent serves the set eagerly; the worker goes on with the next one
            conn.send(("failed", tuple(sites), repr(exc)))


def _next_request(conn) -> list[str] | None:
    """The next set to compile, or None once the serving process says stop or is gone (killed: its end of the pipe
    closed; a traceback would only add to its log's account of the death)."""
    try:
        return conn.recv()
    except EOFError:
        return None
