"""Batching decisions, as pure state machines the worker thread drives: how large the next batch may be
(Clipper's AIMD against the SLO) and whether a new request can still meet its deadline (admission); and one batch's
tensors from its requests' (`stack_inputs`)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from rampserve.serving.shared.protocol import TensorSpec


@dataclass
class AdaptiveBatchSize:
    """Clipper's additive-increase, multiplicative-decrease batch size: grow by `step` while batches finish
    within the SLO, shrink by `backoff` when one misses it. Never above `max_batch` nor below 1."""

    max_batch: int
    slo_ms: float
    limit: float = 1.0
    step: float = 1.0
    backoff: float = 0.9  # Clipper backs off by 10%

    @property
    def size(self) -> int:
        return max(1, min(self.max_batch, math.floor(self.limit)))

    def observe(self, batch_size: int, compute_ms: float) -> None:
        if compute_ms > self.slo_ms:
            # Back off from the size that missed, not from a limit the queue never filled.
            self.limit = max(1.0, min(self.limit, float(batch_size)) * self.backoff)
        elif batch_size >= self.size:
            # Only a full batch shows that the limit fits; a small one says nothing about a larger one.
            self.limit = min(float(self.max_batch), self.limit + self.step)


@dataclass
class BatchTimeEstimate:
    """Running estimate of a full batch's compute time (exponentially weighted), for admission."""

    ms: float
    weight: float = 0.1

    def observe(self, compute_ms: float) -> None:
        self.ms += self.weight * (compute_ms - self.ms)


def expected_wait_ms(rows_queued: int, batch_size: int, batch_ms: float, running: bool) -> float:
    """When a request joining the queue now would be answered at the latest: the batch running now, the
    batches queued ahead of it, then its own."""
    batches_ahead = math.ceil(rows_queued / max(1, batch_size)) + int(running)
    return (batches_ahead + 1) * batch_ms


def stack_inputs(specs: tuple[TensorSpec, ...], requests: list[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """One batch from several requests' inputs; variable dimensions are zero-padded to the longest (a zero
    attention mask makes padding invisible to a transformer)."""
    if len(requests) == 1:  # the batch of one request alone: its inputs as they are
        return {spec.name: requests[0][spec.name] for spec in specs}
    batch = {}
    for spec in specs:
        arrays = [r[spec.name] for r in requests]
        width = np.max([a.shape for a in arrays], axis=0)
        padded = [a if a.shape[1:] == tuple(width[1:]) else
                  np.pad(a, [(0, 0), *((0, int(w) - d) for w, d in zip(width[1:], a.shape[1:]))])
                  for a in arrays]
        batch[spec.name] = padded[0] if len(padded) == 1 else np.concatenate(padded)
    return batch
