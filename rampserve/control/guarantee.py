"""The accuracy guarantee: an upper confidence bound on the share of released answers that differ from the
original model's, which the chosen thresholds must keep within the constraint.

The bound is Clopper-Pearson's (exact binomial) over the inputs the history holds. In stop mode the history is a
stratified sample: inputs that did not exit ran to the end and are all there, inputs that exited are there only
when drawn for feedback (each with the same known probability, whatever its scores). The disagreement rate is then
the strata's rates weighted by their shares, and each stratum is bounded at its share of the error probability.

Thresholds are chosen by Learn-then-Test (`thresholds.certified_thresholds`): half the history chooses a path of
candidates, the other half tests it in order against this bound.

A stream is tested again and again, and a bound valid for one look is not valid for every look at once. The
controller spends its error probability over the certifications it publishes: the k-th is tested at
delta / (k (k + 1)), which sums to delta, so every published certification holds at once with probability at
least 1 - delta (a union bound; `look_delta`). What this does not cover: inputs unlike those in the history
(drift) are covered only once the history holds them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.stats import beta

FULLY_OBSERVED, SAMPLED = 0, 1  # strata: inputs that ran to the end; exited inputs drawn for feedback
STRATA = 2


def binomial_upper(wrong: np.ndarray, n: int, delta: float) -> np.ndarray:
    """Clopper-Pearson upper bound at confidence 1 - delta on a rate with `wrong` of `n` observed (1 when n = 0)."""
    wrong = np.asarray(wrong)
    if n == 0:
        return np.ones(wrong.shape)
    bound = beta.ppf(1.0 - delta, wrong + 1, np.maximum(n - wrong, 1))
    return np.where(wrong >= n, 1.0, bound)


def look_delta(delta: float, look: int) -> float:
    """Error probability spent on the `look`-th test (1-based): delta / (look (look + 1)), which sums to delta."""
    if look < 1:
        raise ValueError(f"looks count from 1, got {look}")
    return delta / (look * (look + 1))


def smallest_certifying(constraint: float, delta: float) -> int:
    """Fewest inputs with no disagreement whose bound is within the constraint: below it nothing can exit."""
    if constraint <= 0:
        return np.iinfo(np.int64).max
    return int(np.ceil(np.log(delta) / np.log1p(-constraint)))


@dataclass(frozen=True)
class RiskBound:
    """Whether a candidate's disagreements, counted per stratum, keep the bound within the constraint. `sizes` and
    `shares` are each stratum's inputs in the history and its share of the inputs they stand for."""

    constraint: float
    delta: float
    sizes: np.ndarray  # (STRATA,)
    shares: np.ndarray  # (STRATA,)
    _tables: tuple[np.ndarray, ...]  # per stratum, the bound for 0..size disagreements

    @classmethod
    def of(cls, strata: np.ndarray, weights: np.ndarray, constraint: float, delta: float) -> RiskBound:
        """For history rows in `strata` (FULLY_OBSERVED or SAMPLED), each standing for `weights` inputs."""
        sizes = np.bincount(strata, minlength=STRATA)
        mass = np.bincount(strata, weights=weights, minlength=STRATA)
        shares = mass / mass.sum() if mass.sum() else np.zeros(STRATA)
        # Each stratum that holds inputs gets an equal share of the error probability
        per_stratum = delta / max(int((sizes > 0).sum()), 1)
        tables = tuple(binomial_upper(np.arange(size + 1), int(size), per_stratum) for size in sizes)
        return cls(constraint, delta, sizes, shares, tables)

    def upper(self, wrong: np.ndarray) -> np.ndarray:
        """The bound for disagreement counts `wrong` (..., STRATA)."""
        wrong = np.asarray(wrong, dtype=np.int64)
        if not self.sizes.any():
            return np.ones(wrong.shape[:-1])
        return sum(self.shares[s] * self._tables[s][np.clip(wrong[..., s], 0, self.sizes[s])]
                   for s in range(STRATA) if self.sizes[s])

    def fits(self, wrong: np.ndarray) -> np.ndarray:
        return self.upper(wrong) <= self.constraint
