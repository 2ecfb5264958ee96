"""What the controller reads (batch records) and what it publishes (configurations)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rampserve.control.exit_rule import NO_EXIT, first_exits

NO_LABEL = -1  # a final label that is not known (the batch failed before its last layer)


@dataclass(frozen=True)
class Configuration:
    """The active ramps (sites in model order) and their thresholds; swapped atomically by version."""

    version: int
    sites: tuple[str, ...]
    thresholds: tuple[float, ...]
    # Shadow batches: one batch in `shadow_every` (0: none) evaluates the ramp at every site of `shadow_sites`
    # (the model's sites, model order) and reports them all, the inactive ones at threshold 0 (they exit nothing),
    # so the controller can judge ramp sets it has not deployed on the same inputs as the one it has
    shadow_sites: tuple[str, ...] = ()
    shadow_every: int = 0

    def __post_init__(self) -> None:
        if len(self.sites) != len(self.thresholds):
            raise ValueError(f"{len(self.sites)} sites but {len(self.thresholds)} thresholds")
        if self.shadow_every < 0:
            raise ValueError(f"shadow_every must be >= 0, got {self.shadow_every}")
        if self.shadow_every and not set(self.sites) <= set(self.shadow_sites):
            raise ValueError(f"shadow sites {self.shadow_sites} do not hold the active sites {self.sites}")

    def shadowed(self) -> Configuration:
        """What a shadow batch serves: the same exits as this configuration, with every shadow site's ramp
        evaluated (the inactive ones at threshold 0)."""
        if not self.shadow_every:
            return self
        thresholds = dict(zip(self.sites, self.thresholds))
        return Configuration(self.version, self.shadow_sites,
                             tuple(thresholds.get(s, 0.0) for s in self.shadow_sites), self.shadow_sites,
                             self.shadow_every)

    def is_shadow_batch(self, batch_index: int) -> bool:
        """Whether the `batch_index`-th batch served under this configuration (from 0) is a shadow batch."""
        return bool(self.shadow_every) and batch_index % self.shadow_every == 0

    def exits(self, errors: np.ndarray) -> np.ndarray:
        """Exit index per input for errors (n, active ramps)."""
        if not self.sites:
            return np.full(len(errors), NO_EXIT)
        return first_exits(errors, np.array(self.thresholds))

    def to_json(self) -> dict:
        return {"version": self.version, "sites": list(self.sites), "thresholds": list(self.thresholds),
                "shadow_sites": list(self.shadow_sites), "shadow_every": self.shadow_every}

    @classmethod
    def from_json(cls, data: dict) -> Configuration:
        return cls(data["version"], tuple(data["sites"]), tuple(data["thresholds"]),
                   tuple(data.get("shadow_sites", ())), int(data.get("shadow_every", 0)))


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
    # (n,) the size of the batch each input was served in, where the record joins several batches (see `merged`)
    served_in: np.ndarray | None = None
    # Probability that an input which exited was kept running to the end (stop mode's feedback sample, drawn
    # whatever its scores; 1.0 in release mode). One that stopped has `final` NO_LABEL, and NO_LABEL labels and
    # NaN error scores at the ramps after its exit.
    feedback_share: float = 1.0
    # (n,) stop mode: inputs that ran to the end whatever the feedback draw (they exited at a ramp the server
    # cannot stop at, or their request asked for the final logits). Observed for sure, each stands for itself
    # alone, not for exits the draw left out. None: none.
    forced: np.ndarray | None = None

    def __post_init__(self) -> None:
        n, r = len(self.final), len(self.sites)
        if self.labels.shape != (n, r) or self.errors.shape != (n, r) or self.exits.shape != (n,):
            raise ValueError(f"record shapes labels {self.labels.shape}, errors {self.errors.shape}, "
                             f"exits {self.exits.shape} do not fit {n} inputs and {r} active ramps")

    @property
    def inputs(self) -> int:
        return len(self.final)

    def batch_sizes(self) -> np.ndarray:
        """(n,) the size of the batch each input was served in."""
        return np.full(self.inputs, self.inputs) if self.served_in is None else self.served_in

    def released(self) -> np.ndarray:
        """The label each input was answered with."""
        return self._released_by(self.labels, self.exits)

    def _released_by(self, labels: np.ndarray, exits: np.ndarray) -> np.ndarray:
        """The label each input gets where it exits at `exits` (indices into `labels`' columns, or NO_EXIT)."""
        if not labels.shape[1]:
            return self.final
        at_ramp = labels[np.arange(len(exits)), exits]  # NO_EXIT picks the last column, unused
        return np.where(exits == NO_EXIT, self.final, at_ramp)

    def correct(self) -> np.ndarray:
        if self.unverified:
            return np.zeros(len(self.final), dtype=bool)
        return self.released() == self.final

    def observed(self) -> np.ndarray:
        """(n,) inputs whose final label is known: all but those that stopped at their exit (and unverified ones)."""
        return self.final != NO_LABEL

    def sampled(self) -> np.ndarray:
        """(n,) inputs that exited and still ran to the end because the feedback sample drew them (every exit in
        release mode)."""
        sampled = (self.exits != NO_EXIT) & self.observed()
        return sampled if self.forced is None else sampled & ~self.forced

    def weights(self) -> np.ndarray:
        """(n,) how many inputs each one stands for: 1 / feedback share for a sampled input (it stands for the
        exits the draw left out), 1 for the others."""
        return np.where(self.sampled(), 1.0 / self.feedback_share, 1.0)

    def wrong_estimate(self) -> np.ndarray:
        """(n,) an unbiased estimate of whether each released answer differs from the original model's: a sampled
        input's disagreement counts its weight (the exits not sampled count 0); an unverified answer counts as a
        disagreement."""
        return self._wrong_estimate_of(self.released())

    def wrong_estimate_at(self, sites: tuple[str, ...], thresholds: np.ndarray) -> np.ndarray:
        """(n,) `wrong_estimate` of the answers that `sites` (among the record's) at `thresholds` would have
        released. Thresholds at least as high as those served exit every input the served ones did, at the same
        ramp or an earlier one, so each input that stopped there is stood for by the feedback sample as before."""
        columns = [self.sites.index(s) for s in sites]
        exits = first_exits(self.errors[:, columns], np.asarray(thresholds, dtype=float))
        return self._wrong_estimate_of(self._released_by(self.labels[:, columns], exits))

    def _wrong_estimate_of(self, released: np.ndarray) -> np.ndarray:
        if self.unverified:
            return np.ones(self.inputs)
        return np.where(self.observed(), (released != self.final) * self.weights(), 0.0)


class RecordJoiner:
    """Joins consecutive batches of one configuration and kind into one record, in order (each input keeps the size
    of the batch it was served in): what the controller learns is the same, at one call for many batches, where a
    server under load at batch 1 would otherwise build a record, and have the controller learn from it, for every
    request. Takes each batch's arrays, so that a batch costs its arrays' references until `joined`."""

    def __init__(self) -> None:
        self._records: list[BatchRecord] = []
        self._key: tuple | None = None
        self._parts: list[tuple] = []

    def add(self, version: int, sites: tuple[str, ...], labels: np.ndarray, errors: np.ndarray, final: np.ndarray,
            exits: np.ndarray, queue_ms: float = 0.0, compute_ms: float = 0.0, *, unverified: bool = False,
            cached: bool = False, served_in: np.ndarray | None = None, feedback_share: float = 1.0,
            forced: np.ndarray | None = None) -> None:
        """One batch's arrays, as `BatchRecord` holds them."""
        key = (version, sites, unverified, cached, feedback_share)
        if key != self._key:
            self._flush()
            self._key = key
        self._parts.append((labels, errors, final, exits, queue_ms, compute_ms, served_in, forced))

    def add_record(self, record: BatchRecord) -> None:
        self.add(record.version, record.sites, record.labels, record.errors, record.final, record.exits,
                 record.queue_ms, record.compute_ms, unverified=record.unverified, cached=record.cached,
                 served_in=record.served_in, feedback_share=record.feedback_share, forced=record.forced)

    def joined(self) -> list[BatchRecord]:
        """The records of every batch added since the last call, in order."""
        self._flush()
        records, self._records = self._records, []
        return records

    def _flush(self) -> None:
        if not self._parts:
            return
        version, sites, unverified, cached, feedback_share = self._key
        labels, errors, final, exits, queue_ms, compute_ms, served_in, forced = zip(*self._parts)
        if len(final) == 1:
            served, kept_to_end = served_in[0], forced[0]
        else:
            sizes = np.array([len(batch) for batch in final])
            served = np.repeat(sizes, sizes) if all(s is None for s in served_in) else np.concatenate(
                [np.full(n, n) if s is None else s for n, s in zip(sizes, served_in)])
            kept_to_end = None if all(f is None for f in forced) else np.concatenate(
                [np.zeros(n, dtype=bool) if f is None else f for n, f in zip(sizes, forced)])
        self._records.append(BatchRecord(version, sites, _joined(labels), _joined(errors), _joined(final),
                                         _joined(exits), max(queue_ms), sum(compute_ms), unverified, cached, served,
                                         feedback_share, kept_to_end))
        self._parts = []


def _joined(arrays: tuple[np.ndarray, ...]) -> np.ndarray:
    return arrays[0] if len(arrays) == 1 else np.concatenate(arrays)


def validation_record(sites: tuple[str, ...], validation: dict[str, np.ndarray] | None) -> BatchRecord | None:
    """A bundle's validation outputs (`PreparedModel.validation`: every one of `sites`' ramps' top labels and error
    scores, and the model's own labels) as the record of inputs no configuration served: every ramp evaluated, none
    exited, each in a batch of its own (as they were run). None where the bundle has none."""
    if validation is None:
        return None
    final = np.asarray(validation["final"])
    return BatchRecord(0, tuple(sites), np.asarray(validation["labels"]), np.asarray(validation["errors"]), final,
                       np.full(len(final), NO_EXIT), served_in=np.ones(len(final), dtype=np.int64))

