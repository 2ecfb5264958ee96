"""One batch as the executor thread runs it: its state (the ramps' outputs, where each input exits, the answers
released), the releasing thread that hands it ramp columns while a compiled run goes on, and what its books are kept
from once its answers are out. Free of torch: the model runs elsewhere (`worker.ModelWorker`, `exit_modes`)."""

from __future__ import annotations

import logging
import os
import selectors
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from rampserve.control import exit_rule
from rampserve.control.records import NO_EXIT, NO_LABEL, Configuration
from rampserve.runtime.column_handlers import hand_columns_to
from rampserve.serving.executor.request_queue import Pending
from rampserve.serving.shared.contract import Answer, Exits, Stamps
from rampserve.threads import OsNamedThread

log = logging.getLogger("rampserve.serving")


class BatchState:
    """One batch's ramp outputs, exits and answers. `ramp` runs on the executor (eager path, and the record's
    pass after the run) or on the releasing thread while the model runs (compiled path), never on both at once
    (`RampSignals` holds its lock around the releasing thread's calls, and `end` waits for them)."""

    def __init__(self, config: Configuration, batch: list[Pending], batch_id: int, answer_time: object) -> None:
        self.config, self.batch, self.batch_id, self.answer_time = config, batch, batch_id, answer_time
        self.started = time.monotonic()
        self.ran = self.started  # when the model's run began (`run_begins`)
        self.signalled = self.started  # when the latest ramp column (or the run's end) reached the batch
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
        self.signalled = time.monotonic()
        self.labels[:, j], self.errors[:, j] = ramp_labels, ramp_errors
        self.scored[j] = True
        leaving = (self.exits == NO_EXIT) & exit_rule.exits(ramp_errors, self.thresholds[j]) & self._open_rows()
        if not leaving.any():
            return
        self.exits[leaving] = j
        decided = np.logical_and.reduceat(self.exits != NO_EXIT, self.starts)
        for index, pending in enumerate(self.batch):
            if decided[index] and not pending.settled and not pending.request.needs_final:
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
            if decided[index] and not pending.settled and not pending.request.needs_final:
                self._answer(pending, int(self.starts[index]), None, None, None)
        return count

    def _open_rows(self) -> np.ndarray:
        """Inputs of requests not answered yet (a request answered with the final layer's labels keeps them)."""
        return np.repeat([not p.settled for p in self.batch], [p.rows for p in self.batch])

    def run_begins(self) -> None:
        """The model's run begins now: what came before was the batch's own setting up."""
        self.ran = time.monotonic()

    def run_ended(self) -> None:
        """The model's run is over: what is released from here on was signalled now."""
        self.signalled = time.monotonic()

    def finish(self, final: np.ndarray, final_errors: np.ndarray, logits: np.ndarray) -> None:
        """Answer every request still open with the final layer's answers (in stop mode, an input that left the
        batch has none, NO_LABEL: it keeps the answer it left with)."""
        for index, pending in enumerate(self.batch):
            if not pending.settled:
                self._answer(pending, int(self.starts[index]), final, final_errors, logits)

    def _answer(self, pending: Pending, start: int, final: np.ndarray | None, final_errors: np.ndarray | None,
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
            labels=released, confidences=1.0 - released_errors,
            logits=None if logits is None or not pending.request.needs_final else logits[rows],
            exits=Exits(tuple(None if j == NO_EXIT else config.sites[j] for j in at),
                        tuple(None if j == NO_EXIT else float(self.errors[i, j]) for i, j in zip(rows, at)),
                        config.version, self.batch_id),
            stamps=Stamps(pending.admitted, self.started, self.ran, self.signalled, now)))
        self.answer_time.observe(now - pending.arrival)


@dataclass(eq=False)
class Answered:
    """A batch whose answers are out, for its books: the ramps not scored during the run (their columns, and a
    copy of their logits), the final labels and the batch's times."""

    state: BatchState
    final: np.ndarray
    unscored: list[int]
    # Per unscored column, the inputs that reached that ramp: all of them, but in stop mode those that left the batch
    # before it
    unscored_rows: list[np.ndarray]
    late: np.ndarray | None
    started: float
    finished: float
    oldest_arrival: float
    feedback_share: float  # each input's chance to be kept running to the end (1 but in stop mode)

    @property
    def queue_ms(self) -> float:
        """How long its oldest input waited before the batch started."""
        return (self.started - self.oldest_arrival) * 1000.0

    @property
    def compute_ms(self) -> float:
        return (self.finished - self.started) * 1000.0

    def released_a_disagreement(self) -> bool:
        """Whether some input left at a ramp with another answer than the final layer's (where that is known: in
        stop mode an input that left the batch has none)."""
        exits = self.state.exits
        early = exits != NO_EXIT
        if not early.any():  # a loaded server's usual batch: spared the rest
            return False
        rows = np.flatnonzero(early & (self.final != NO_LABEL))
        return bool(np.any(self.state.labels[rows, exits[rows]] != self.final[rows]))


class RampSignals:
    """The pipe a compiled run's ramps write their column to where some input may exit (see `ramps.fused`), and
    the releasing thread that reads it and hands each column to the batch in progress, so that early answers
    leave while the model runs on, from the other core. A ramp that calls Python on the run's thread (ONNX
    Runtime's) hands its column to the batch there instead (`runtime.column_handlers`, registered by `begin`).
    Columns are read only under the lock, and `end` takes what is left before the next batch begins, so that no
    column reaches a batch it does not belong to."""

    def __init__(self, name: str) -> None:
        self._read_fd, self.write_fd = os.pipe()
        os.set_blocking(self._read_fd, False)
        self._lock = threading.Lock()
        self._on_column: Callable[[int], None] | None = None
        self._closed = False
        self._thread = OsNamedThread(target=self._listen, name=f"releaser-{name}", daemon=True)
        self._thread.start()

    def begin(self, on_column: Callable[[int], None]) -> None:
        """A run begins: its columns go to `on_column`, on the run's own thread where the ramp calls Python (ONNX
        Runtime's), else on the releasing thread."""
        hand_columns_to(self.write_fd, on_column)
        with self._lock:
            self._on_column = on_column

    def end(self) -> bytes:
        """The run is over: wait for the column being handled; returns the columns signalled but not taken, which
        the caller handles itself, so that what a batch answers never depends on this thread's timing."""
        hand_columns_to(self.write_fd, None)
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
