"""What the controller reads (batch records) and what it publishes (configurations)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

NO_EXIT = -1
NO_LABEL = -1  # a final label that is not known (the batch failed before its last layer)


def first_exits(errors: np.ndarray, thresholds: np.ndarray) -> np.ndarray:
    """Per input (row), the first active ramp (column) whose error score is below its threshold, else NO_EXIT.

    `thresholds` may carry leading candidate axes: shape (..., r) against errors (n, r) gives (..., n).
    """
    passes = errors < np.asarray(thresholds)[..., None, :]
    first = passes.argmax(axis=-1)
    return np.where(passes.any(axis=-1), first, NO_EXIT)


@dataclass(frozen=True)
class Configuration:
    """The active ramps (sites in model order) and their thresholds; swapped atomically by version."""

    version: int
    sites: tuple[str, ...]
    thresholds: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.sites) != len(self.thresholds):
            raise ValueError(f"{len(self.sites)} sites but {len(self.thresholds)} thresholds")

    def exits(self, errors: np.ndarray) -> np.ndarray:
        """Exit index per input for errors (n, active ramps)."""
        if not self.sites:
            return np.full(len(errors), NO_EXIT)
        return first_exits(errors, np.array(self.thresholds))

    def to_json(self) -> dict:
        return {"version": self.version, "sites": list(self.sites), "thresholds": list(self.thresholds)}


@dataclass(frozen=True)
class BatchRecord:
    """One served batch: every active ramp's top label and error score for every input (whatever exited),
    the original model's final label, where each input was released, and the batch's timings."""

    version: int  # configuration that served the batch
    sites: tuple[str, ...]  # its active ramps, model order
    labels: np.ndarray  # (n, r) int top label per input and active ramp
    errors: np.ndarray  # (n, r) error score per input and active ramp
    final: np.ndarray  # (n,) the original model's label
    exits: np.ndarray  # (n,) index into `sites` where the answer was released, or NO_EXIT
    queue_ms: float = 0.0  # oldest input's wait before the batch started
    compute_ms: float = 0.0  # batch start to the end of the last stage
    # Answers released before the batch failed: their final label is unknown (`final` holds NO_LABEL there), so
    # they count as disagreeing with the original model and teach the controller nothing else
    unverified: bool = False
    # Answers given from the prediction cache: final answers by construction (the cache keeps only those), so they
    # count as agreeing and teach nothing else; `final` holds their labels, `labels` and `errors` have no columns
    cached: bool = False

    def __post_init__(self) -> None:
        n, r = len(self.final), len(self.sites)
        if self.labels.shape != (n, r) or self.errors.shape != (n, r) or self.exits.shape != (n,):
            raise ValueError(f"record shapes labels {self.labels.shape}, errors {self.errors.shape}, "
                             f"exits {self.exits.shape} do not fit {n} inputs and {r} active ramps")

    @property
    def batch_size(self) -> int:
        return len(self.final)

    def released(self) -> np.ndarray:
        """The label each input was answered with."""
        if not self.sites:
            return self.final
        at_ramp = self.labels[np.arange(len(self.exits)), self.exits]  # NO_EXIT picks the last column, unused
        return np.where(self.exits == NO_EXIT, self.final, at_ramp)

    def correct(self) -> np.ndarray:
        if self.unverified:
            return np.zeros(len(self.final), dtype=bool)
        return self.released() == self.final
