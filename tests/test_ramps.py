"""Ramp kinds, error scores and independent training."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from rampserve.ramps.kinds import Ramp, spec_for
from rampserve.ramps.oracle import NO_EXIT, earliest_correct_exit
from rampserve.ramps.scores import top_label_and_error
from rampserve.ramps.train import Features, TrainConfig, train_ramps


def features(n: int = 300, seed: int = 0) -> tuple[Features, dict]:
    g = torch.Generator().manual_seed(seed)
    targets = torch.randint(0, 4, (n,), generator=g)
    by_site = {
        "a": torch.randn(n, 72, generator=g) + 3 * torch.nn.functional.one_hot(targets, 72).float(),
        "b": torch.randn(n, 6, 4, 4, generator=g),
        "c": torch.randn(n, 16, generator=g),
    }
    specs = {
        "a": spec_for("linear", (8, 5, 5), 4),
        "b": spec_for("deep", (6, 9, 9), 4),
        "c": spec_for("deep", (7, 16), 4),
    }
    return Features(by_site=by_site, targets=targets, seconds=0.0), specs


def test_specs_follow_the_activation_shape() -> None:
    assert spec_for("linear", (32, 7, 7), 10).reduce == "grid_mean"
    assert spec_for("linear", (32, 7, 7), 10).feature_shape == (32 * 9,)
    assert spec_for("linear", (12, 384), 2).reduce == "first_token"
    assert spec_for("deep", (32, 7, 7), 10).feature_shape == (32, 4, 4)
    with pytest.raises(ValueError, match="unknown ramp kind"):
        spec_for("huge", (3,), 2)


def test_ramp_maps_activation_to_output_width() -> None:
    for kind, shape in (("linear", (8, 5, 5)), ("deep", (8, 5, 5)), ("linear", (6, 10)), ("deep", (6, 10))):
        ramp = Ramp(spec_for(kind, shape, 3)).eval()
        assert ramp(torch.randn(2, *shape)).shape == (2, 3)


def test_training_one_ramp_alone_gives_the_same_weights_as_training_all() -> None:
    feats, specs = features()
    config = TrainConfig(seed=3, max_epochs=6, patience=2)
    together, _ = train_ramps(feats, specs, config, progress=False)
    for site in specs:
        alone, _ = train_ramps(feats, {site: specs[site]}, config, progress=False)
        for (name, a), (_, b) in zip(together[site].state_dict().items(), alone[site].state_dict().items()):
            assert torch.equal(a, b), f"{site}.{name} differs"


def test_training_learns_and_reports_validation_accuracy() -> None:
    feats, specs = features(n=600)
    _, report = train_ramps(feats, {"a": specs["a"]}, TrainConfig(max_epochs=30), progress=False)
    # Site "a" carries the label in its features: a linear ramp must find it; site noise alone would not.
    assert report.ramps["a"].val_accuracy > 0.8
    assert report.num_train + report.num_val == 600


def test_different_seeds_give_different_ramps() -> None:
    feats, specs = features()
    one, _ = train_ramps(feats, {"a": specs["a"]}, TrainConfig(seed=0, max_epochs=2), progress=False)
    two, _ = train_ramps(feats, {"a": specs["a"]}, TrainConfig(seed=1, max_epochs=2), progress=False)
    assert not torch.equal(one["a"].state_dict()["head.weight"], two["a"].state_dict()["head.weight"])


logit_rows = arrays(np.float64, st.tuples(st.integers(1, 20), st.integers(2, 10)),
                    elements=st.floats(-30, 30, allow_nan=False))


@settings(max_examples=100, deadline=None)
@given(logit_rows, st.sampled_from(["max_prob", "entropy"]))
def test_error_scores_are_in_unit_range_and_label_is_argmax(logits: np.ndarray, score: str) -> None:
    labels, errors = top_label_and_error(logits, score)
    assert np.all((errors >= 0) & (errors <= 1))
    assert np.array_equal(logits[np.arange(len(logits)), labels], logits.max(axis=1))


@settings(max_examples=100, deadline=None)
@given(logit_rows)
def test_max_prob_error_is_one_minus_the_largest_softmax_probability(logits: np.ndarray) -> None:
    shifted = np.exp(logits - logits.max(axis=1, keepdims=True))
    reference = 1.0 - (shifted / shifted.sum(axis=1, keepdims=True)).max(axis=1)
    np.testing.assert_allclose(top_label_and_error(logits)[1], reference, rtol=0, atol=1e-12)


def test_ramp_evaluate_scores_its_own_logits() -> None:
    ramp = Ramp(spec_for("linear", (8, 5, 5), 4)).eval()
    activation = torch.randn(3, 8, 5, 5)
    with torch.no_grad():
        expected = top_label_and_error(ramp(activation).numpy())
    labels, errors = ramp.evaluate(activation)
    np.testing.assert_array_equal(labels, expected[0])
    np.testing.assert_allclose(errors, expected[1])


@settings(max_examples=100, deadline=None)
@given(logit_rows)
def test_sharper_logits_never_raise_the_error_score(logits: np.ndarray) -> None:
    _, soft = top_label_and_error(logits)
    _, sharp = top_label_and_error(logits * 2.0)
    assert np.all(sharp <= soft + 1e-12)


def test_oracle_exits_at_the_first_agreeing_ramp() -> None:
    ramp_labels = np.array([[1, 2, 2], [0, 0, 1], [3, 3, 3]])
    final = np.array([2, 0, 1])
    assert earliest_correct_exit(ramp_labels, final).tolist() == [1, 0, NO_EXIT]


def test_linear_ramps_learn_the_same_whatever_the_scale_of_their_features() -> None:
    """Linear heads train on standardised features, folded into their weights afterwards."""
    feats, specs = features(n=600)
    linear = {"a": specs["a"]}
    config = TrainConfig(seed=1, max_epochs=10, patience=3)
    ramps, _ = train_ramps(feats, linear, config, progress=False)
    scaled = Features({"a": feats.by_site["a"] * 1000.0 + 500.0}, feats.targets, 0.0)
    scaled_ramps, _ = train_ramps(scaled, linear, config, progress=False)
    head, scaled_head = ramps["a"].head, scaled_ramps["a"].head
    with torch.no_grad():
        np.testing.assert_allclose(scaled_head(scaled.by_site["a"]).numpy(), head(feats.by_site["a"]).numpy(),
                                   rtol=1e-3, atol=1e-3)
