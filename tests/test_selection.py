"""Clipper's Exp3 and Exp4 selection policies (pure)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rampserve.control.selection import (
    SelectionState,
    exp3_choose,
    exp3_update,
    exp4_combine,
    exp4_update,
)

MODELS = ("a", "b", "c", "d", "e")


@settings(max_examples=100, deadline=None)
@given(steps=st.lists(st.tuples(st.integers(0, 4), st.floats(0, 1)), max_size=300), eta=st.floats(0.01, 2))
def test_exp3_keeps_a_distribution_and_a_loss_lowers_only_the_chosen_model(steps, eta) -> None:
    state = SelectionState.uniform(MODELS)
    for chosen, loss in steps:
        before = state.probabilities()
        state = exp3_update(state, chosen, loss, eta)
        after = state.probabilities()
        assert after.sum() == pytest.approx(1.0) and (after > 0).all()
        assert after[chosen] <= before[chosen] + 1e-12
        others = np.arange(len(MODELS)) != chosen
        if loss > 0 and before[others].sum() > 0:
            assert np.all(after[others] >= before[others] - 1e-12)


def test_exp3_choice_follows_the_probabilities() -> None:
    state = SelectionState(MODELS, np.array([0.5, 0.25, 0.125, 0.0625, 0.0625]))
    draws = (np.arange(1600) + 0.5) / 1600
    counts = np.bincount([exp3_choose(state, u) for u in draws], minlength=5)
    assert counts.tolist() == [800, 400, 200, 100, 100]


def test_exp3_learns_to_avoid_a_failing_model_and_forgives_it() -> None:
    rng = np.random.default_rng(0)
    error = np.array([0.1, 0.15, 0.2, 0.9, 0.25])  # model d fails badly
    state = SelectionState.uniform(MODELS)
    for _ in range(3000):
        chosen = exp3_choose(state, rng.random())
        state = exp3_update(state, chosen, float(rng.random() < error[chosen]), eta=0.05)
    assert state.probabilities()[3] < 0.02
    error[3] = 0.0  # d recovers and becomes the best
    for _ in range(6000):
        chosen = exp3_choose(state, rng.random())
        state = exp3_update(state, chosen, float(rng.random() < error[chosen]), eta=0.05)
    assert int(state.probabilities().argmax()) == 3


def test_exp4_combines_by_weight_and_missing_answers_lower_confidence() -> None:
    state = SelectionState(MODELS, np.array([0.4, 0.3, 0.1, 0.1, 0.1]))
    assert exp4_combine(state, np.array([1, 2, 2, 2, 1]), 3) == (1, pytest.approx(0.5))
    assert exp4_combine(state, np.array([2, 2, 2, 2, 2]), 3) == (2, pytest.approx(1.0))
    label, confidence = exp4_combine(state, np.array([2, 2, -1, -1, -1]), 3)
    assert label == 2 and confidence == pytest.approx(0.7)
    with pytest.raises(ValueError, match="no model"):
        exp4_combine(state, np.full(5, -1), 3)


@settings(max_examples=100, deadline=None)
@given(losses=st.lists(st.floats(0, 1), min_size=5, max_size=5), eta=st.floats(0.01, 2))
def test_exp4_never_moves_weight_towards_a_worse_model(losses, eta) -> None:
    state = SelectionState.uniform(MODELS)
    updated = exp4_update(state, np.array(losses), eta).probabilities()
    for i in range(5):
        for j in range(5):
            if losses[i] < losses[j]:
                assert updated[i] >= updated[j]


def test_exp4_ignores_models_that_did_not_answer() -> None:
    state = SelectionState.uniform(MODELS)
    updated = exp4_update(state, np.array([0.0, np.nan, 1.0, np.nan, 0.0]), eta=1.0).probabilities()
    assert updated[1] == pytest.approx(updated[3]) and updated[1] > updated[2]


def test_state_round_trips_through_json_and_rejects_bad_weights() -> None:
    state = exp3_update(SelectionState.uniform(MODELS), 2, 1.0, 0.5)
    again = SelectionState.from_json(state.to_json())
    assert again.models == state.models and again.updates == 1
    np.testing.assert_array_equal(again.weights, state.weights)
    with pytest.raises(ValueError):
        SelectionState.from_json({"models": ["a", "b"], "weights": [1.0, 0.0]})
    with pytest.raises(ValueError):
        exp3_update(state, 0, 1.5, 0.1)
