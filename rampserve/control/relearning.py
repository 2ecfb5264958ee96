"""When a model's ramps stop paying: the share of its answers given at a ramp, in windows of answers, against the
level it held once managed. Thresholds already follow the stream (the controller retunes them); a fall that lasts
says the ramps themselves no longer fit the traffic, which only training them again on recent inputs can mend.

A window's share is the answers given early over all answers the executor gave (early or final; the prediction
cache's answers are left out: they cost nothing either way). The level is the highest mean over `windows`
consecutive windows so far, a level the model held rather than one lucky window; the stream has drifted once
`windows` consecutive windows each fall below `fall` times that level. A level under `least_level` never counts:
ramps that never paid have nothing to recover.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class RelearnRule:
    window: int = 1000  # answers per window
    fall: float = 0.5  # drifted below this fraction of the level...
    windows: int = 3  # ...for this many consecutive windows (also the span the level is averaged over)
    least_level: float = 0.1

    def __post_init__(self) -> None:
        if self.window < 1 or self.windows < 1:
            raise ValueError(f"a relearning window needs at least 1 answer and 1 window, got {self.window} and "
                             f"{self.windows}")
        if not 0.0 < self.fall < 1.0:
            raise ValueError(f"the relearning fall must lie in (0, 1), got {self.fall}")


def levels(shares: np.ndarray, windows: int) -> np.ndarray:
    """The level held after each window: the running maximum of the mean over `windows` consecutive windows (NaN
    until `windows` windows have passed)."""
    shares = np.asarray(shares, dtype=float)
    held = np.full(len(shares), np.nan)
    if len(shares) >= windows:
        means = np.convolve(shares, np.ones(windows) / windows, mode="valid")
        held[windows - 1:] = np.maximum.accumulate(means)
    return held


def drift_window(shares: np.ndarray, rule: RelearnRule) -> int | None:
    """The first window at which the stream has drifted (its index in `shares`), or None."""
    shares = np.asarray(shares, dtype=float)
    held = levels(shares, rule.windows)
    run = 0
    for i, share in enumerate(shares):
        # The level as it stood before this run of low windows began: low windows never lift it
        level = held[i - run - 1] if i - run - 1 >= 0 else np.nan
        if not np.isnan(level) and level >= rule.least_level and share < rule.fall * level:
            run += 1
            if run >= rule.windows:
                return i
        else:
            run = 0
    return None


class ExitShareWatch:
    """`drift_window` over an executor's running counts of early and final answers, read from time to time (its
    status): whole windows are cut from what was counted since the last read. Counts that go back (an executor
    restarted, counting from 0) start a fresh reading from there."""

    def __init__(self, rule: RelearnRule) -> None:
        self.rule = rule
        self.shares: list[float] = []
        self._last: tuple[int, int] | None = None
        self._early = self._answers = 0  # counted since the last whole window

    def observe(self, early: int, answers: int) -> bool:
        """Read the running counts; whether the stream has drifted."""
        if self._last is None or answers < self._last[1] or early < self._last[0]:
            self._last = (early, answers)
            return False
        new_early, new_answers = early - self._last[0], answers - self._last[1]
        self._last = (early, answers)
        self._early += new_early
        self._answers += new_answers
        # A read spanning several windows spreads its share over them: the counts say no more
        while self._answers >= self.rule.window:
            share = self._early / self._answers
            self.shares.append(share)
            self._early -= round(share * self.rule.window)
            self._answers -= self.rule.window
        return drift_window(np.array(self.shares), self.rule) is not None

    @property
    def level(self) -> float | None:
        """The level held so far (None before `windows` windows)."""
        held = levels(np.array(self.shares), self.rule.windows)
        return None if len(held) == 0 or np.isnan(held[-1]) else float(held[-1])
