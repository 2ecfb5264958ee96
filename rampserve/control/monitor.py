"""The monitor: accuracy of released answers (sliding window and cumulative) and a bounded buffer of the
deployed active set's recent ramp outputs, which tuning and ramp adjustment evaluate."""

from __future__ import annotations

from collections import deque

import numpy as np

from rampserve.control.guarantee import FULLY_OBSERVED, SAMPLED
from rampserve.control.records import BatchRecord


class AccuracyWindow:
    """Share of the last `size` released answers that equal the original model's, plus totals. Answers come as
    estimates of their disagreement (`BatchRecord.wrong_estimate`): 0 or 1 where every answer is checked, and in
    stop mode 1 / feedback share for a sampled disagreement, so that the shares stay unbiased."""

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"accuracy window must hold at least one answer, got {size}")
        self._recent: deque[float] = deque(maxlen=size)
        self.served = 0
        self.correct = 0.0

    def add(self, wrong: np.ndarray) -> None:
        """Count answers by their estimated disagreement (`BatchRecord.wrong_estimate`; or a bool array: whether
        each one is wrong)."""
        self._recent.extend(np.asarray(wrong, dtype=float).tolist())
        self.served += len(wrong)
        self.correct += len(wrong) - float(np.sum(wrong))

    def clear(self) -> None:
        """Forget the window (not the totals): a new configuration is judged on its own answers."""
        self._recent.clear()

    def checkpoint(self) -> dict:
        """The window and the totals as plain data, for a successor controller to start from."""
        return {"recent": list(self._recent), "served": self.served, "correct": self.correct}

    def catch_up(self, checkpoint: dict, since: dict) -> None:
        """Add what `checkpoint` counted beyond `since` (an earlier checkpoint of the same controller, already
        counted here), and take its window where it is ahead."""
        self.served += checkpoint["served"] - since["served"]
        self.correct += checkpoint["correct"] - since["correct"]
        if checkpoint["served"] > since["served"]:
            self._recent.clear()
            self._recent.extend(float(w) for w in checkpoint["recent"])

    @property
    def full(self) -> bool:
        return len(self._recent) == self._recent.maxlen

    @property
    def accuracy(self) -> float:
        return 1.0 - sum(self._recent) / len(self._recent) if self._recent else 1.0

    @property
    def cumulative(self) -> float:
        return self.correct / self.served if self.served else 1.0


class ExitHistory:
    """The last `capacity` observed inputs, with a column for every site of the model: whether that site's ramp's
    top label was right and its error score, where the ramp ran for the input (a shadow batch runs them all; other
    batches only the active ones), the batch size it was served in, its stratum and weight (an input that exited and
    ran on as stop mode's feedback sample stands for 1 / share inputs; see `guarantee`) and its sequence number.
    Inputs that stopped at their exit are not here: they have no final label to judge against. A ring buffer, so
    observing a batch costs a copy of its rows and nothing else."""

    def __init__(self, sites: tuple[str, ...], capacity: int) -> None:
        self.sites = sites
        self.capacity = capacity
        self.column = {s: i for i, s in enumerate(sites)}
        width = len(sites)
        self._correct = np.zeros((capacity, width), dtype=bool)
        self._errors = np.full((capacity, width), np.inf)
        self._seen = np.zeros((capacity, width), dtype=bool)
        self._batch = np.zeros(capacity, dtype=np.int64)
        self._strata = np.zeros(capacity, dtype=np.int64)
        self._weights = np.ones(capacity)
        self._sequence = np.zeros(capacity, dtype=np.int64)
        self._wait = np.zeros(capacity)  # the oldest input's wait in the batch each input was served in
        self._next = 0
        self.size = 0

    def add(self, record: BatchRecord, first: int, wait_serves: bool = True) -> None:
        """The record's observed inputs, numbered from `first` in the record's order. `wait_serves`: whether the
        batch's queue wait is one the serving configuration would see (not where every batch ran every ramp);
        a wait that does not is held as unknown (NaN)."""
        observed = record.observed()
        if not observed.any():
            return
        weights = record.weights()[observed][-self.capacity:]
        columns = [self.column[s] for s in record.sites]
        rows = (self._next + np.arange(len(weights))) % self.capacity
        self._seen[rows] = False
        self._seen[np.ix_(rows, columns)] = True
        self._errors[rows] = np.inf
        self._errors[np.ix_(rows, columns)] = record.errors[observed][-len(rows):]
        self._correct[rows] = False
        self._correct[np.ix_(rows, columns)] = (record.labels == record.final[:, None])[observed][-len(rows):]
        self._batch[rows] = record.batch_sizes()[observed][-len(rows):]
        self._strata[rows] = np.where(weights > 1.0, SAMPLED, FULLY_OBSERVED)
        self._weights[rows] = weights
        self._sequence[rows] = (first + np.flatnonzero(observed))[-len(rows):]
        self._wait[rows] = record.queue_ms if wait_serves else np.nan
        self._next = int((rows[-1] + 1) % self.capacity)
        self.size = min(self.capacity, self.size + len(rows))

    def rows(self, sites: tuple[str, ...], before: int | None = None, since: int = 0) -> np.ndarray:
        """Ring positions, oldest first, of the inputs every one of `sites` saw (numbered from `since` and below
        `before`)."""
        rows = (self._next - self.size + np.arange(self.size)) % self.capacity
        seen = self._seen[rows][:, [self.column[s] for s in sites]].all(axis=1)
        if before is not None:
            seen &= self._sequence[rows] < before
        if since:
            seen &= self._sequence[rows] >= since
        return rows[seen]

    def oldest(self) -> int | None:
        """Sequence number of the oldest input held."""
        return int(self._sequence[(self._next - self.size) % self.capacity]) if self.size else None

    def columns(self, rows: np.ndarray, sites: tuple[str, ...]) -> tuple[np.ndarray, np.ndarray]:
        """(correct, errors) of `rows` at `sites`."""
        columns = [self.column[s] for s in sites]
        return self._correct[rows][:, columns], self._errors[rows][:, columns]

    def waits(self, rows: np.ndarray) -> np.ndarray:
        """(n,) ms each of `rows` waited in the queue (its batch's oldest input's wait; NaN: not a serving wait)."""
        return self._wait[rows]

    def design(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(batch sizes, strata, weights, sequence numbers) of `rows`."""
        return self._batch[rows], self._strata[rows], self._weights[rows], self._sequence[rows]
