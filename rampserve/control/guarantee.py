"""The accuracy guarantee: an upper confidence bound on the share of released answers that differ from the
original model's, which the chosen thresholds must keep within the constraint.

The bound is Clopper-Pearson's (exact binomial) over the inputs the history holds. In stop mode the history is a
stratified sample: inputs that did not exit ran to the end and are all there, inputs that exited are there only
when drawn for feedback (each with the same known probability, whatever its scores). The disagreement rate is then
the strata's rates weighted by their shares, and each stratum is bounded at its share of the error probability.

Thresholds are chosen by Learn-then-Test (`thresholds.certified_thresholds`): a third of the history chooses a
path of candidates, the rest tests it in order against this bound.

A stream is tested again and again. Each certification is Learn-then-Test at the full error probability delta on
the history it is made from, and the controller makes one only on a trigger (a new ramp set, a search round every
few thousand inputs, or the monitor's alarm), never every batch: a union bound over looks (delta / (k (k + 1)) at
the k-th) left a stream's 600th look one disagreement in 2,048 and spent two thirds of the accuracy budget.
Between certifications, `DisagreementMonitor` watches the answers the deployed thresholds actually release with
an anytime-valid test (a mixture of betting martingales, Ville's inequality): however often it is looked at, it
raises a false alarm with probability at most delta over the whole life of one certification. What this does not
cover: inputs unlike those in the history (drift) are covered only once the history holds them; rolling risk
control (`risk`) bounds the long-run disagreement whatever the stream does.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
# The beta distribution's quantile from scipy.special, not scipy.stats.beta.ppf (the same function, the same values):
# scipy.stats takes 0.7-0.9 s to import, much of an executor process's start
from scipy.special import betaincinv

FULLY_OBSERVED, SAMPLED = 0, 1  # strata: inputs that ran to the end; exited inputs drawn for feedback
STRATA = 2


def binomial_upper(wrong: np.ndarray, n: int, delta: float) -> np.ndarray:
    """Clopper-Pearson upper bound at confidence 1 - delta on a rate with `wrong` of `n` observed (1 when n = 0)."""
    wrong = np.asarray(wrong)
    if n == 0:
        return np.ones(wrong.shape)
    bound = betaincinv(wrong + 1, np.maximum(n - wrong, 1), 1.0 - delta)
    return np.where(wrong >= n, 1.0, bound)


@functools.cache  # read once per batch by rolling risk control (the windowed promise's risk target)
def windowed_rate(constraint: float, window: int, windows_below: float) -> float:
    """The highest rate of disagreement at which answers that disagree independently break the constraint in at
    most `windows_below` of windows of `window` answers: more than floor(window * constraint) disagreements in a
    window of Binomial(window, rate) has probability I_rate(k + 1, window - k), the regularized incomplete beta
    function, solved for the rate (1,000 answers at 1%, 5% of windows: 0.0062)."""
    allowed = int(np.floor(window * constraint + 1e-9))
    if allowed >= window:
        return 1.0
    return float(betaincinv(allowed + 1, window - allowed, windows_below))


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


# Alternatives the monitor bets on: disagreement rates this many times the constraint
MONITOR_RATIOS = (1.25, 1.5, 2.0, 3.0, 5.0)


class DisagreementMonitor:
    """An anytime-valid test of "the released answers disagree with the original model on at most `constraint` of
    inputs" (in expectation, answer by answer) against the estimates of disagreement served answers carry
    (`BatchRecord.wrong_estimate`: 0/1, or 1 / feedback share for stop mode's sample: any values >= 0).

    For each alternative rate q = ratio * constraint it holds the wealth of a bettor who stakes
    lambda = (ratio - 1) / (1 - constraint) on each answer: W <- W (1 + lambda (x - constraint)). While the mean of
    x stays within the constraint each W is a non-negative supermartingale (E[1 + lambda (x - c)] <= 1), and so is
    their average; by Ville's inequality the average ever reaches 1 / delta with probability at most delta, however
    many looks are taken. For 0/1 answers each W is exactly the likelihood ratio of rate q against the constraint."""

    def __init__(self, constraint: float, delta: float) -> None:
        self.constraint = constraint
        self.delta = delta
        ratios = np.array([r for r in MONITOR_RATIOS if r * constraint < 1.0])
        self._stakes = (ratios - 1.0) / (1.0 - constraint) if constraint > 0 else np.zeros(0)
        self._log_wealth = np.zeros(len(self._stakes))
        self.answers = 0

    def add(self, disagreement: np.ndarray) -> None:
        x = np.asarray(disagreement, dtype=np.float64)
        self.answers += len(x)
        if len(self._stakes) and len(x):
            self._log_wealth += np.log1p(self._stakes[:, None] * (x[None, :] - self.constraint)).sum(axis=1)

    def log_evidence(self) -> float:
        """log of the bettors' average wealth (0 at the start)."""
        if not len(self._stakes):
            return 0.0
        top = self._log_wealth.max()
        return float(top + np.log(np.exp(self._log_wealth - top).mean()))

    @property
    def alarm(self) -> bool:
        """Whether the evidence that disagreement exceeds the constraint has reached 1 / delta."""
        return self.log_evidence() >= np.log(1.0 / self.delta)

    def reset(self) -> None:
        """Start a new test (the thresholds it watched were replaced)."""
        self._log_wealth[:] = 0.0
        self.answers = 0


class ChangeDetector:
    """Page's CUSUM of the log-likelihood ratio of disagreement at `ratio` times the constraint against the
    constraint: the evidence that the answers since the likeliest change point disagree at the higher rate, and
    where that point is. A companion of `DisagreementMonitor`, which says that the constraint is broken and by
    what test; this says whether the stream changed (a rate many times the constraint, begun at `start`) or
    drifted past it slowly. Its statistic is not a test with a false alarm rate: the controller reads it only
    when the monitor's test has alarmed."""

    def __init__(self, constraint: float, ratio: float) -> None:
        self.constraint = constraint
        self._stake = (ratio - 1.0) / (1.0 - constraint) if 0 < ratio * constraint < 1.0 else 0.0
        self.statistic = 0.0  # log-likelihood ratio of the answers since `start`
        self.start = 0  # sequence number of the first answer after the likeliest change point

    def add(self, disagreement: np.ndarray, first: int) -> None:
        """Answers' disagreement estimates, numbered from `first` (any values >= 0, as the monitor takes)."""
        x = np.asarray(disagreement, dtype=np.float64)
        if not len(x) or not self._stake:
            return
        prefix = np.cumsum(np.log1p(self._stake * (x - self.constraint)))
        # S_t = prefix_t - the least of (-S before the batch, prefix_1 .. prefix_t): the change point is after the
        # answer where that least value was last reached
        lows = np.concatenate([[-self.statistic], prefix])
        low = len(lows) - 1 - int(np.argmin(lows[::-1]))
        if low:
            self.start = first + low
        self.statistic = float(prefix[-1] - lows[low])

    def reset(self, start: int) -> None:
        self.statistic = 0.0
        self.start = start
