"""The watch on whether a model's exits still pay (`control.relearning`): when the share of answers given early has
fallen far enough, for long enough, to train the ramps again."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from rampserve.control.relearning import ExitShareWatch, RelearnRule, drift_window, levels

RULE = RelearnRule(window=100, fall=0.5, windows=3, least_level=0.1)
shares = st.lists(st.floats(0.0, 1.0), min_size=0, max_size=40)


@given(st.floats(0.0, 1.0), st.integers(1, 60))
def test_a_steady_share_never_drifts(share, n):
    assert drift_window(np.full(n, share), RULE) is None


@given(st.floats(0.2, 1.0), st.integers(3, 20), st.floats(0.0, 0.49), st.integers(0, 10))
def test_a_fall_below_half_the_level_drifts_at_its_third_window(level, held, fallen, recovered):
    """Held for `held` windows, then below half for good: drift exactly at the third low window; a fall that lasts
    two windows, then recovers, never drifts."""
    lasting = np.r_[np.full(held, level), np.full(5, fallen * level)]
    assert drift_window(lasting, RULE) == held + 2
    brief = np.r_[np.full(held, level), np.full(2, fallen * level), np.full(recovered, level)]
    assert drift_window(brief, RULE) is None


@given(shares, st.floats(0.01, 100.0))
def test_the_drift_is_the_same_whatever_the_shares_scale(values, scale):
    """A fall is relative to the level held (with no least level to cross)."""
    rule = RelearnRule(window=100, fall=0.5, windows=3, least_level=0.0)
    assert drift_window(np.array(values) * scale, rule) == drift_window(np.array(values), rule)


@given(shares)
def test_exits_that_never_reached_the_least_level_never_drift(values):
    assert drift_window(np.array(values) * 0.099, RULE) is None


@given(shares)
def test_the_level_never_falls_and_is_a_mean_of_windows_seen(values):
    held = levels(np.array(values), RULE.windows)
    known = held[~np.isnan(held)]
    assert np.all(np.diff(known) >= 0)
    assert np.all(known <= max(values, default=0.0) + 1e-12)
    assert np.isnan(held[:RULE.windows - 1]).all()


@given(st.lists(st.booleans(), max_size=1500), st.lists(st.integers(1, 5), min_size=1, max_size=50))
def test_the_watch_reads_running_counts_as_the_windows_they_hold(early, reads_per_window):
    """Read at window boundaries (one read or several within a window), the watch's shares are the windows' own, and
    it says drifted exactly when `drift_window` over them does."""
    rule = RULE
    watch = ExitShareWatch(rule)
    early_array = np.array(early, dtype=bool)
    cumulative = np.r_[0, np.cumsum(early_array)]
    watch.observe(0, 0)
    said = False
    for w in range(len(early) // rule.window):
        parts = reads_per_window[w % len(reads_per_window)]
        for k in range(1, parts + 1):
            end = w * rule.window + (rule.window * k) // parts
            said = watch.observe(int(cumulative[end]), end)
    whole = len(early) // rule.window * rule.window
    expected = early_array[:whole].reshape(-1, rule.window).mean(axis=1) if whole else np.zeros(0)
    assert np.allclose(watch.shares, expected)
    assert said == (drift_window(expected, rule) is not None)


def test_counts_that_go_back_start_a_fresh_reading():
    """An executor restarted counts from 0: nothing it counted before is taken for a negative window."""
    watch = ExitShareWatch(RULE)
    watch.observe(0, 0)
    watch.observe(80, 100)
    watch.observe(5, 10)
    watch.observe(55, 110)
    assert watch.shares == [0.8, 0.5]


@pytest.mark.parametrize("bad", [dict(window=0), dict(windows=0), dict(fall=0.0), dict(fall=1.0)])
def test_a_rule_that_could_never_or_always_drift_is_refused(bad):
    with pytest.raises(ValueError):
        RelearnRule(**bad)
