"""A served model's books: the answers its executor gave, by the path they took, and its batches, counted once a
batch's answers are out, on the thread that ran it (so that what /status and /metrics read is whole as soon as the
answers are). The controller's records are another matter: the worker's control thread makes them."""

from __future__ import annotations

import threading
from collections import deque

import numpy as np

from rampserve.control.records import NO_EXIT
from rampserve.serving.executor.batch import Answered
from rampserve.serving.shared.metrics import ServerMetrics

ANSWER_PATHS = ("early", "final", "cached", "unverified")
RECENT_BATCHES = 64  # batch summaries kept for the status endpoint


class Books:
    def __init__(self, model: str, metrics: ServerMetrics) -> None:
        self.metrics = metrics
        self._labels = {"model": model}
        self.batches_booked = 0
        self.inputs_served = 0
        self.requests_served = 0
        self.stopped_rows = 0  # inputs that left their batch at the ramp they exited (stop mode)
        # Answers given, one per input, by the path they took (early, final, cached, unverified); any thread counts
        self.answers = dict.fromkeys(ANSWER_PATHS, 0)
        self._answers_lock = threading.Lock()
        self.exits: dict[str, int] = {}  # inputs of booked batches by the site that answered ("final": the last layer)
        self.recent_batches: deque[dict] = deque(maxlen=RECENT_BATCHES)

    def count_answers(self, path: str, inputs: int) -> None:
        """Count answers given by `path` (early, final, cached, unverified), one per input; any thread."""
        if inputs:
            with self._answers_lock:
                self.answers[path] += inputs
            self.metrics.answers.labels(path=path, **self._labels).inc(inputs)

    def book(self, done: Answered) -> None:
        """A batch whose answers are out: its answers by path and by exit site, and its summary."""
        state = done.state
        config, exits, n = state.config, state.exits, state.n
        self.batches_booked += 1
        self.inputs_served += n
        self.requests_served += len(state.batch)
        early = int((exits != NO_EXIT).sum())
        self.count_answers("early", early)
        self.count_answers("final", n - early)
        stopped = 0 if state.left is None else int((state.left != NO_EXIT).sum())
        self.stopped_rows += stopped
        if stopped:
            self.metrics.stopped_rows.labels(**self._labels).inc(stopped)
        self.recent_batches.append({"id": state.batch_id, "size": n, "config_version": config.version,
                                    "started": done.started, "finished": done.finished, "queue_ms": done.queue_ms,
                                    "compute_ms": done.compute_ms, "early": early, "stopped": stopped})
        by_site = [("final", n - early)]
        if early:  # most batches of a loaded server exit nowhere: spared a pass over their exits
            by_site += [(config.sites[j], int(count)) for j, count in zip(*np.unique(exits[exits != NO_EXIT],
                                                                                   return_counts=True))]
        for site, count in by_site:
            if count:
                self.exits[site] = self.exits.get(site, 0) + count
                self.metrics.exits.labels(site=site, **self._labels).inc(count)

    def status(self) -> dict:
        """The books as /status reports them."""
        return {"stopped_inputs": self.stopped_rows, "batches_booked": self.batches_booked,
                "requests": self.requests_served, "inputs": self.inputs_served, "answers": dict(self.answers),
                "exits": dict(self.exits),
                "mean_batch_size": self.inputs_served / self.batches_booked if self.batches_booked else None,
                "recent_batches": list(self.recent_batches)}
