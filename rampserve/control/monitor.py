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
        self._recent.extend(float(w) for w in wrong)
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


class RampHistory:
    """The last `capacity` observed inputs served by one active set: per active ramp whether its top label was
    right and its error score, the batch size each input was served in, and its stratum and weight (an input
    that exited and ran on as stop mode's feedback sample stands for 1 / share inputs; see `guarantee`). Inputs
    that stopped at their exit are not here: they have no final label to judge against. A ring buffer, so
    observing a batch costs a copy of its rows and nothing else."""

    def __init__(self, sites: tuple[str, ...], capacity: int) -> None:
        self.sites = sites
        self.capacity = capacity
        r = len(sites)
        self._correct = np.zeros((capacity, r), dtype=bool)
        self._errors = np.zeros((capacity, r))
        self._batch = np.zeros(capacity, dtype=np.int64)
        self._strata = np.zeros(capacity, dtype=np.int64)
        self._weights = np.ones(capacity)
        self._next = 0
        self.size = 0

    def add(self, record: BatchRecord) -> None:
        observed = record.observed()
        if not observed.any():
            return
        weights = record.weights()[observed]  # above 1 only for stop mode's feedback sample
        correct = (record.labels == record.final[:, None])[observed][-self.capacity:]
        errors = record.errors[observed][-self.capacity:]
        rows = (self._next + np.arange(len(errors))) % self.capacity
        self._correct[rows] = correct
        self._errors[rows] = errors
        self._batch[rows] = record.batch_sizes()[observed][-len(rows):]
        self._strata[rows] = np.where(weights > 1.0, SAMPLED, FULLY_OBSERVED)[-len(rows):]
        self._weights[rows] = weights[-len(rows):]
        self._next = int((rows[-1] + 1) % self.capacity)
        self.size = min(self.capacity, self.size + len(rows))

    def for_sites(self, sites: tuple[str, ...]) -> RampHistory:
        """This history seen by another active set: kept ramps keep their columns, so tuning right after a
        change still sees the recent past; a new ramp has no outputs for past inputs, which count as never
        exiting there (an infinite error score) until it has its own."""
        moved = RampHistory(sites, self.capacity)
        old = {s: i for i, s in enumerate(self.sites)}
        moved._errors[:] = np.inf
        for column, site in enumerate(sites):
            if site in old:
                moved._correct[:, column] = self._correct[:, old[site]]
                moved._errors[:, column] = self._errors[:, old[site]]
        moved._batch[:] = self._batch
        moved._strata[:], moved._weights[:] = self._strata, self._weights
        moved._next, moved.size = self._next, self.size
        return moved

    def latest(self, count: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(correct, errors, batch sizes) of the newest `count` inputs (all kept by default), oldest first."""
        rows = self._rows(count)
        return self._correct[rows], self._errors[rows], self._batch[rows]

    def sample_design(self, count: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(strata, weights) of the newest `count` inputs, as `latest` orders them."""
        rows = self._rows(count)
        return self._strata[rows], self._weights[rows]

    def _rows(self, count: int | None) -> np.ndarray:
        count = self.size if count is None else min(count, self.size)
        return (self._next - count + np.arange(count)) % self.capacity
