"""What a ramp is charged: the ramps' marginal time on the serving path where it stands out of the noise; where it
does not, the most the measurement allows, never more than their own time."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from rampserve.runtime.profile import at_length, in_place_factor


@settings(max_examples=60, deadline=None)
@given(st.floats(0.01, 2.0), st.floats(0.05, 5.0), st.integers(0, 2**31 - 1))
def test_ramps_are_charged_their_marginal_time_on_the_serving_path_above_or_below_their_own(
        marginal: float, own: float, seed: int) -> None:
    rng = np.random.default_rng(seed)
    without = 5.0 + rng.normal(0.0, 0.001, (40, 4))
    with_ramps = without + marginal + rng.normal(0.0, 0.001, (40, 4))
    assert abs(in_place_factor(with_ramps, without, own) * own - marginal) < 0.01


@settings(max_examples=60, deadline=None)
@given(st.floats(0.001, 1.0), st.lists(st.floats(0.0, 2.0), min_size=5, max_size=40), st.floats(-0.99, 0.99))
def test_ramps_lost_in_the_noise_are_charged_the_most_the_noise_allows_up_to_their_own_time(
        own: float, spreads: list[float], share: float) -> None:
    # Rounds that differ by +s and -s (a millisecond of noise on a 60 ms run), shifted by a marginal time within
    # twice the standard error of their median: nothing stands out, so no factor is fitted to it
    spread = np.array(spreads)
    differences = np.concatenate([spread, -spread])
    error = 1.2533 * float(np.std(differences)) / np.sqrt(len(differences))
    differences += share * 2 * error
    without = np.full((len(differences), 4), 60.0)
    charged = in_place_factor(without + differences[:, None], without, own) * own
    assert charged <= own + 1e-12
    assert abs(charged - min(own, max(share * 2 * error, 0.0) + 2 * error)) < 1e-9


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 40), st.integers(1, 130), st.integers(0, 2**31 - 1))
def test_an_input_timed_at_a_length_is_its_own_positions_cut_or_repeated(positions: int, length: int, seed: int
                                                                        ) -> None:
    rng = np.random.default_rng(seed)
    feeds = {"input_ids": rng.integers(0, 30000, (1, positions)), "attention_mask": np.ones((1, positions), int)}
    at = at_length(feeds, length)
    for name, array in feeds.items():
        assert at[name].shape == (1, length) and at[name].dtype == array.dtype
        kept = min(length, positions)
        assert np.array_equal(at[name][:, :kept], array[:, :kept])
        assert np.array_equal(at[name][:, positions:], at[name][:, :length - positions]) or length <= positions
