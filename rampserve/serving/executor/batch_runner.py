"""The executor thread: takes each batch its queue forms and runs it with the configuration in force.

After each ramp it decides exits with that configuration and answers those requests at once, while the batch runs
on to the final layer (a compiled set runs under its exit mode's strategy, `exit_modes`; the eager path, a set that
does not compile or does not stop (an ONNX set cut into stages), or no ramp operator, serve stop mode as release
mode). The batch's books are kept on this thread, and its record goes to the control thread, off the next batch's
path.

Shadow batches (`Configuration.shadow_every`): the runner counts the batches it serves under each configuration
version, and serves each shadow batch among them with `Configuration.shadowed()`: the ramp at every shadow site
runs, the inactive ones at threshold 0, so the answers released are the configuration's own and the record tells
the controller what every ramp said on the same inputs. In stop mode a shadow batch keeps every input to the end,
so each is observed, standing for itself alone. Until the serving sets have loaded the set of every shadow site,
shadow batches are served plainly and counted as skipped.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np

from rampserve.control.records import NO_LABEL, BatchRecord, Configuration
from rampserve.runtime.compiled import CompiledSet
from rampserve.serving.executor.batch import Answered, BatchState, RampSignals
from rampserve.serving.executor.batching import AdaptiveBatchSize, BatchTimeEstimate, stack_inputs
from rampserve.serving.executor.books import Books
from rampserve.serving.executor.exit_modes import RELEASE, Finals, StopStrategy
from rampserve.serving.executor.request_queue import Inbox, Pending, RequestQueue
from rampserve.serving.executor.serving_sets import ServingSets
from rampserve.serving.shared.contract import Answer, ExecutionFailed, Exits, Stamps
from rampserve.serving.shared.metrics import ServerMetrics
from rampserve.serving.shared.models import ServedModel
from rampserve.serving.shared.settings import ModelSettings

log = logging.getLogger("rampserve.serving")

# Where a batch's record goes (None: the controller hears of no batch), and whether it must be learnt from at once
RecordSink = Callable[[BatchRecord | Answered, bool], None]


class BatchRunner:
    """Runs batches of one served model with what `sets` has in force, counts them in `books` and the batch-size
    feedback, and hands each one's record to `record`."""

    def __init__(self, served: ServedModel, settings: ModelSettings, metrics: ServerMetrics, sets: ServingSets,
                 books: Books, batch_size: AdaptiveBatchSize, batch_time: BatchTimeEstimate,
                 stop_strategy: StopStrategy, signals: RampSignals | None, record: RecordSink | None) -> None:
        self.served, self.model, self.settings, self.metrics = served, served.prepared, settings, metrics
        self.sets, self.books, self.batch_size, self.batch_time = sets, books, batch_size, batch_time
        self.stop_strategy = stop_strategy  # what a compiled set that stops runs with
        # Compiled runs with ramps report where inputs may exit through a pipe, read by a releasing thread
        self.signals = signals
        self._record = record
        self._series = metrics.model_series(served.name)
        self._labels = {"model": served.name}
        self.batches = 0  # run (each one's id is the count before it)
        # The version whose batches the runner is counting, and how many it has run, for its shadow batches
        self._counted_version: int | None = None
        self._version_batches = 0
        self.shadow_batches = 0
        self.shadow_batches_skipped = 0  # its set was not loaded yet: served plainly
        self._told_eager = False  # whether stop mode on the eager path was logged

    def serve(self, queue: RequestQueue, inbox: Inbox) -> None:
        """Run batches until `queue` is stopped and drained (the executor thread's life)."""
        with self.model.backend.serving(self.settings.torch_threads):
            while (batch := self._next_batch(queue, inbox)) is not None:
                try:
                    self.run(batch)
                except Exception as exc:  # a model failure must not strand the batch's requests
                    log.exception("model %s failed on a batch of %d", self.served.name, len(batch))
                    for pending in batch:
                        if not pending.settled:
                            pending.settle(ExecutionFailed(f"model {self.served.name} failed: {exc}"))
                finally:
                    queue.batch_done()

    @staticmethod
    def _next_batch(queue: RequestQueue, inbox: Inbox) -> list[Pending] | None:
        """The next batch to run, letting requests in until one is due; None once stopped with nothing queued."""
        inbox.collect(0.0)  # what came while the last batch ran
        while (due := queue.ready_in()) != 0.0:
            if queue.drained:
                return None
            inbox.collect(due)
        return queue.take_batch()

    def run(self, batch: list[Pending]) -> None:
        if not batch:
            return
        config, compiled = self.sets.in_force
        shadow = self._shadow_batch(config)
        if shadow is not None:
            config, compiled = shadow
        model = self.model
        feeds = stack_inputs(self.served.inputs, [p.request.inputs for p in batch])
        state = BatchState(config, batch, self.batches, self._series.answer)
        self.batches += 1
        strategy = self.stop_strategy if compiled is not None and compiled.stops else RELEASE
        started = state.started
        for pending in batch:
            self._series.queue.observe(started - pending.arrival)
        try:
            if compiled is None:
                if self.sets.mode == "stop" and config.sites and not self._told_eager:
                    self._told_eager = True
                    log.info("model %s: a set served eagerly (it does not compile) runs every input to the end, "
                             "as in release mode", self.served.name)
                state.run_begins()
                finals = Finals.of(model.run_eager(feeds, config.sites, state.site_ramp if config.sites else None))
            else:
                finals, outputs = strategy.execute(model, compiled, state, feeds, self.signals, shadow is not None)
        except Exception:
            self._record_unverified(state, started)
            raise
        state.run_ended()
        # A request still open is answered now with its batch's final answer: that answer is kept (the prediction
        # cache) before the response that carries it is sent, so a repeat sent once the response is back finds it.
        # A request released early at a ramp got the ramp's label; its final answer, known only now, is kept after
        # the open ones are answered (off their path): caches keep final answers alone, never a ramp's label,
        # which thresholds move and a cache would replay unchecked, so its repeat may come before it is kept
        released_early = [pending.settled for pending in batch]
        self._keep_finals(state, [not early for early in released_early], finals)
        state.finish(finals.labels, finals.errors, finals.logits)
        finished = time.monotonic()
        # The ramps no input exited at are scored for the record by the control thread, from a copy of their
        # logits: the buffer is this thread's next batch's
        unscored = [] if compiled is None else [(state.column[site], j) for j, site in enumerate(compiled.sites)
                                                if not state.scored[state.column[site]]]
        late = None if not unscored else outputs.buffers.logits[:, [j for _, j in unscored]].copy()
        self._keep_finals(state, released_early, finals)
        if self.settings.cache_updates and config.sites:  # after every answer is out: off the requests' path
            # A cache ramp evaluated the rows still in the batch at its site (in stop mode, not every row), and
            # learns from those that ran to the end
            model.learn(finals.labels, None if compiled is None else
                        {site: strategy.reached(outputs, j) for j, site in enumerate(compiled.sites)})
        done = Answered(state, finals.labels, [column for column, _ in unscored],
                        [strategy.reached(outputs, j) for _, j in unscored], late, started, finished,
                        min(p.arrival for p in batch), strategy.feedback_share(shadow is not None))
        self._count(done)
        if self._record is not None:  # the controller's record, off this thread: the next batch is waiting
            self._record(done, done.released_a_disagreement())

    @staticmethod
    def _keep_finals(state: BatchState, which: list[bool], finals: Finals) -> None:
        """Hand the final answers of the batch's requests marked in `which` to their `on_final`, where they have one
        (a request one of whose rows left the batch, in stop mode, has none: it is skipped)."""
        now = time.monotonic()
        for index, pending in enumerate(state.batch):
            on_final = pending.request.on_final
            if not which[index] or on_final is None:
                continue
            rows = slice(int(state.starts[index]), int(state.starts[index]) + pending.rows)
            if np.any(finals.labels[rows] == NO_LABEL):
                continue
            on_final(Answer(finals.labels[rows], 1.0 - finals.errors[rows], finals.logits[rows],
                            Exits((None,) * pending.rows, (None,) * pending.rows, state.config.version, state.batch_id),
                            Stamps(pending.admitted, state.started, state.ran, state.signalled, now)))

    def _shadow_batch(self, config: Configuration) -> tuple[Configuration, CompiledSet | None] | None:
        """Count the batch about to run under `config`; where it is a shadow batch whose set is loaded, what it runs
        instead (the shadowed configuration and that set). One whose set is not is served plainly, and counted."""
        if config.version != self._counted_version:
            self._counted_version, self._version_batches = config.version, 0
        index = self._version_batches
        self._version_batches += 1
        if not config.is_shadow_batch(index):
            return None
        shadow_set = self.sets.shadow_set  # one read: the control thread may replace it
        if shadow_set is None or shadow_set[0] != config.shadow_sites:
            self.shadow_batches_skipped += 1
            self.metrics.shadow_batches.labels(outcome="skipped", **self._labels).inc()
            return None
        self.shadow_batches += 1
        self.metrics.shadow_batches.labels(outcome="served", **self._labels).inc()
        return config.shadowed(), shadow_set[1]

    def _record_unverified(self, state: BatchState, started: float) -> None:
        """The model failed after some answers left at a ramp: the controller still hears of them, as answers
        that could not be checked (it counts them as disagreements)."""
        batch = state.batch
        rows = np.concatenate([np.arange(start, start + p.rows) for start, p in zip(state.starts, batch) if p.settled]
                              or [np.zeros(0, dtype=int)])
        self.books.count_answers("unverified", len(rows))  # before the controller can hear of them
        if self._record is None or not len(rows):
            return
        self._record(BatchRecord(state.config.version, state.config.sites, state.labels[rows], state.errors[rows],
                                 np.full(len(rows), NO_LABEL), state.exits[rows],
                                 (started - min(p.arrival for p in batch)) * 1000.0,
                                 (time.monotonic() - started) * 1000.0, unverified=True), True)

    def _count(self, done: Answered) -> None:
        """A batch's books, metrics and batch-size feedback once its answers are out: what status and /metrics read
        is whole as soon as the answers are (the controller's record waits for its thread, which gathers)."""
        n, compute_ms = done.state.n, done.compute_ms
        self.batch_size.observe(n, compute_ms)
        self.batch_time.observe(compute_ms * self.batch_size.size / n)
        self.books.book(done)
        series = self._series
        series.compute.observe(compute_ms / 1000.0)
        series.batch_size.observe(n)
        series.batch_limit.set(self.batch_size.size)
