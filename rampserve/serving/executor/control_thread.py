"""The thread that feeds a served model's controller, apart from the executor's.

The executor thread queues what the controller learns from (each batch it answered, answers from the prediction
cache, answers that could not be checked) and goes on to its next batch; this thread gathers them for a while,
makes the controller's records of them (scoring the ramps no input exited at), hands them to the controller through
its `ControlLink`, and passes whatever configuration comes back to the serving sets, which adopt it once its set is
loaded. It runs below the model's threads (`CONTROL_NICENESS`), in the time between batches.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

import numpy as np

from rampserve.control.records import NO_LABEL, BatchRecord, Configuration, RecordJoiner
from rampserve.control.scores import top_label_and_error
from rampserve.serving.executor.batch import Answered
from rampserve.serving.executor.compiling import CompileOutcome
from rampserve.serving.shared.contract import ControlLink
from rampserve.serving.shared.metrics import ServerMetrics
from rampserve.threads import OsNamedThread

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

Queued = BatchRecord | Answered | CompileOutcome | None  # None: the executor has stopped


class ControlThread:
    """Feeds `control` what the executor queues (`record`); `advance` is told, after each round, of the
    configuration the controller chose (None: none new), and adopts what it can. `error_score` names the model's
    ramps' error score, which scores the ramps no input exited at."""

    def __init__(self, model: str, control: ControlLink, metrics: ServerMetrics, error_score: str,
                 advance: Callable[[Configuration | None], None]) -> None:
        self.control, self.metrics, self.error_score, self._advance = control, metrics, error_score, advance
        self._labels = {"model": model}
        self.queued: queue.SimpleQueue[Queued] = queue.SimpleQueue()
        # Set with a record the controller must learn from at once (an answer released wrongly, answers nobody can
        # check, the last record): the thread stops gathering
        self._urgent = threading.Event()
        self._thread = OsNamedThread(target=self._loop, name=f"controller-{model}", daemon=True,
                                     niceness=CONTROL_NICENESS, below_pools=True)

    @property
    def native_id(self) -> int | None:
        return self._thread.native_id

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Learn from what is queued, then end (once the executor has queued its last record)."""
        self.record(None, urgent=True)
        self._thread.join()

    def record(self, item: Queued, urgent: bool = False) -> None:
        self.queued.put(item)
        if urgent:
            self._urgent.set()

    def controller_records(self, items: list[Queued]) -> list[BatchRecord]:
        """The controller's records of what the executor thread queued (counted batches, and the records it made of
        cached and unverified answers): the ramps no input exited at are scored first, and consecutive batches of
        one configuration and kind are joined into one record."""
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
                    done.late[rows, k], self.error_score)

    def _loop(self) -> None:
        control = self.control
        while True:
            try:
                items = [self.queued.get(timeout=CONTROL_POLL_S)]
            except queue.Empty:  # idle: a controller shared with other workers may have moved on without us
                chosen = control.refresh()
            else:
                # Whatever queues while gathering is learnt from at once, unless an urgent record cuts it short:
                # every batch that runs meanwhile with the same thresholds can release another wrong answer
                self._urgent.wait(CONTROL_GATHER_S)
                self._urgent.clear()
                while True:
                    try:
                        items.append(self.queued.get_nowait())
                    except queue.Empty:
                        break
                records = self.controller_records(items)
                chosen = None
                for record in records:
                    chosen = control.observe(record) or chosen
                if records:
                    self.metrics.set_readings(self._labels, control.readings())
                if None in items:  # stopping: the executor has answered and recorded its last batch
                    return
            self._advance(chosen)
