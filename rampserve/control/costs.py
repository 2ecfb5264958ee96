"""Latency arithmetic of a configuration, from the model's measured profile (no timing happens here)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from rampserve.bundle_format.latency import LatencyProfile


@dataclass(frozen=True)
class BatchTimes:
    """One batch of a given size under a set of active ramps."""

    release_ms: np.ndarray  # (r,) offset from batch start at which an input exiting at each active ramp is answered
    duration_ms: float  # the whole batch: the model plus every active ramp
    vanilla_ms: float  # the model alone
    ramp_ms: np.ndarray  # (r,) what each active ramp adds to the batch
    rest_ms: np.ndarray  # (r,) one input's share of the model after each active ramp's site

    def saved_ms(self, stop: bool = False) -> np.ndarray:
        """Against vanilla: per exit at each active ramp, then (last entry) for an input that does not exit. With
        `stop`, an exit also saves the compute its input would have taken after the ramp (stop mode)."""
        saved = self.vanilla_ms - np.append(self.release_ms, self.duration_ms)
        if stop:
            saved[:-1] += self.rest_ms
        return saved


class CostModel:
    """Release offsets and batch durations for any active set and batch size, memoised: the controller and
    the simulator ask for the same few combinations many thousand times. With `stop` (stop mode), an exit's
    savings count the compute its input no longer takes."""

    def __init__(self, profile: LatencyProfile, stop: bool = False) -> None:
        self.profile = profile
        self.stop = stop
        self.sites = profile.sites
        self.position = {s: i for i, s in enumerate(profile.sites)}
        self._times: dict[tuple[tuple[str, ...], int], BatchTimes] = {}

    def times(self, active: Sequence[str], batch_size: int) -> BatchTimes:
        key = (tuple(active), int(batch_size))
        if key not in self._times:
            reach = self.profile.reach(batch_size)
            ramp = np.array([self.profile.ramp(s, batch_size) for s in key[0]], dtype=np.float64)
            release = reach[[self.position[s] for s in key[0]]] + np.cumsum(ramp)
            vanilla = self.profile.full(batch_size)
            rest = (vanilla - reach[[self.position[s] for s in key[0]]]) / batch_size
            self._times[key] = BatchTimes(release, vanilla + float(ramp.sum()), vanilla, ramp, rest)
        return self._times[key]

    def stopping_batch(self, active: Sequence[str], running: np.ndarray) -> tuple[np.ndarray, float]:
        """A stop-mode batch: `running` (r + 1,) inputs run each segment (up to each active site, then to the
        output; inputs that exited at a ramp leave before the next segment). Returns each ramp's release offset
        and the batch's duration, each segment and ramp charged at the rows it runs."""
        ends = [self.position[s] for s in active]
        elapsed, release = 0.0, np.zeros(len(active))
        for k, rows in enumerate(np.asarray(running, dtype=np.int64)):
            if rows:
                reach = self.profile.reach(int(rows))
                start = reach[ends[k - 1]] if k else 0.0
                end = reach[ends[k]] if k < len(ends) else self.profile.full(int(rows))
                elapsed += end - start + (self.profile.ramp(active[k], int(rows)) if k < len(ends) else 0.0)
            if k < len(ends):
                release[k] = elapsed
        return release, elapsed

    def saved_ms(self, active: Sequence[str], batch_sizes: np.ndarray) -> np.ndarray:
        """(n, r + 1): per input (served in a batch of `batch_sizes[i]`) the time saved against vanilla when it
        exits at each active ramp, and in the last column when it does not exit (minus the ramps' cost)."""
        sizes, inverse = np.unique(np.asarray(batch_sizes, dtype=np.int64), return_inverse=True)
        table = np.stack([self.times(active, int(b)).saved_ms(self.stop) for b in sizes]) if len(sizes) else \
            np.zeros((0, len(active) + 1))
        return table[inverse]

    def overhead_fraction(self, active: Sequence[str], batch_size: int) -> float:
        """What the active ramps add to an input that never exits, as a share of the vanilla model."""
        times = self.times(active, batch_size)
        return float(times.ramp_ms.sum() / times.vanilla_ms)
