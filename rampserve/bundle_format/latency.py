"""A prepared model's latency profile as data: per batch size, the whole model, every segment between
consecutive sites and every ramp, measured on the serving machine (`runtime.profile`). The controller and
simulator read savings and overheads from it instead of timing anything themselves, so it imports no torch.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np


@dataclass(frozen=True)
class LatencyProfile:
    batch_sizes: tuple[int, ...]
    sites: tuple[str, ...]  # in model order
    full_ms: tuple[float, ...]  # whole model, per batch size
    segment_ms: dict[str, tuple[float, ...]]  # segment ending at each site, and "output" for the last one
    # Per batch size, what having the ramp at a site active costs an input that does not exit, which the
    # controller charges against its ramp budget: its share of the marginal time of the serving path with every
    # ramp against the path with none, measured paired (see `measure_profile`).
    ramp_ms: dict[str, tuple[float, ...]]
    # Where inputs come in any length (a text model's positions), each takes the time its length does: the whole
    # model at batch 1 on one input cut or repeated to each of `lengths` positions (`length_ms`), and per batch size
    # the positions of the batch its figures were measured on (padded to its longest input). Empty where every
    # input has one size, or for a profile measured before.
    lengths: tuple[int, ...] = ()
    length_ms: tuple[float, ...] = ()
    batch_lengths: tuple[int, ...] = ()

    def _column(self, batch_size: int) -> int:
        """The profiled batch size at or above `batch_size` (the largest when beyond)."""
        return min(bisect.bisect_left(self.batch_sizes, batch_size), len(self.batch_sizes) - 1)

    def full(self, batch_size: int) -> float:
        return self.full_ms[self._column(batch_size)]

    def ramp(self, site: str, batch_size: int) -> float:
        return self.ramp_ms[site][self._column(batch_size)]

    def reach(self, batch_size: int) -> np.ndarray:
        """Time from the start of the model to each site, in site order, scaled so that reaching the output
        costs the whole model's time (segments measured apart add up to a little more than one piece)."""
        col = self._column(batch_size)
        segments = np.array([self.segment_ms[s][col] for s in (*self.sites, "output")])
        scale = self.full_ms[col] / segments.sum() if segments.sum() > 0 else 1.0
        return np.cumsum(segments)[:-1] * scale

    def length_scale(self, batch_size: int, longest: int) -> float:
        """How much longer than the profiled figures of `batch_size` a batch whose longest input has `longest`
        positions takes (1 where the profile has no lengths)."""
        if not self.lengths:
            return 1.0
        profiled = self.batch_lengths[self._column(batch_size)]
        return float(np.interp(longest, self.lengths, self.length_ms) / np.interp(profiled, self.lengths,
                                                                                   self.length_ms))

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> LatencyProfile:
        return cls(
            batch_sizes=tuple(int(b) for b in data["batch_sizes"]),
            sites=tuple(data["sites"]),
            full_ms=tuple(float(v) for v in data["full_ms"]),
            segment_ms={k: tuple(float(x) for x in v) for k, v in data["segment_ms"].items()},
            ramp_ms={k: tuple(float(x) for x in v) for k, v in data["ramp_ms"].items()},
            lengths=tuple(int(n) for n in data.get("lengths", ())),
            length_ms=tuple(float(v) for v in data.get("length_ms", ())),
            batch_lengths=tuple(int(n) for n in data.get("batch_lengths", ())),
        )


def max_batch_for_slo(batch_sizes: Sequence[int], batch_ms: Sequence[float], slo_ms: float) -> int:
    """Clockwork's bound: the largest profiled batch size whose execution fits within the SLO (at least 1)."""
    fitting = [b for b, ms in zip(batch_sizes, batch_ms) if ms <= slo_ms]
    return max(fitting, default=1)


def serving_limits(profile: LatencyProfile, slo_ms: float | None = None, max_batch: int | None = None
                   ) -> tuple[float, int]:
    """The SLO a model is served under and its batch limit: each as given, else twice the profiled batch-1 latency
    and the largest profiled batch size that fits that SLO (`max_batch_for_slo`)."""
    slo = slo_ms or 2.0 * profile.full(1)
    return slo, max_batch or max_batch_for_slo(profile.batch_sizes, profile.full_ms, slo)
