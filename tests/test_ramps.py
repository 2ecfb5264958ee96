"""Ramp kinds, error scores and independent training."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays
from torch import nn

from rampserve.control.scores import top_label_and_error
from rampserve.ramps.kinds import Ramp
from rampserve.ramps.specs import RampSpec, spec_for
from rampserve.ramps.oracle import NO_EXIT, earliest_correct_exit
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
    mlp = spec_for("mlp", (32, 7, 7), 10, hidden=24)
    assert (mlp.reduce, mlp.feature_shape, mlp.hidden) == ("grid_mean", (32 * 9,), 24)
    assert spec_for("mlp", (12, 384), 2, token_reduce="token_mean_masked").reduce == "token_mean_masked"
    with pytest.raises(ValueError, match="unknown ramp kind"):
        spec_for("huge", (3,), 2)


def test_a_spec_round_trips_and_only_an_mlp_records_its_width() -> None:
    for kind in ("linear", "mlp", "deep", "cache"):
        spec = spec_for(kind, (8, 5, 5), 4)
        assert RampSpec.from_json(spec.to_json()) == spec
        assert ("hidden" in spec.to_json()) == (kind == "mlp")


def test_ramp_maps_activation_to_output_width() -> None:
    for kind in ("linear", "mlp", "deep"):
        for shape in ((8, 5, 5), (6, 10)):
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
@given(logit_rows, st.sampled_from([np.float64, np.float32]))
def test_max_prob_error_is_one_minus_the_largest_softmax_probability(logits: np.ndarray, dtype: type) -> None:
    logits = logits.astype(dtype)
    wide = logits.astype(np.float64)
    probs = np.exp(wide) / np.exp(wide).sum(axis=1, keepdims=True)  # the textbook softmax: |logits| <= 30
    labels, errors = top_label_and_error(logits)
    assert labels.dtype == np.int64 and errors.dtype == np.float64
    np.testing.assert_array_equal(labels, wide.argmax(axis=1))
    np.testing.assert_allclose(errors, 1.0 - probs.max(axis=1), rtol=0, atol=1e-12)


def _ramp(kind: str, shape: tuple[int, ...], classes: int, seed: int) -> Ramp:
    torch.manual_seed(seed)
    ramp = Ramp(spec_for(kind, shape, classes)).eval()
    with torch.no_grad():  # trained heads are far from their initialisation's scale
        for p in ramp.parameters():
            p.mul_(4.0)
    return ramp


def _assert_scores_its_own_logits(ramp: Ramp, activation: torch.Tensor) -> None:
    with torch.no_grad():
        logits = ramp(activation).numpy()
    labels, errors = ramp.evaluate(activation)
    expected_labels, expected_errors = top_label_and_error(logits)
    ranked = np.sort(logits, axis=1)
    clear = ranked[:, -1] - ranked[:, -2] > 1e-4  # a near tie may go either way under float rounding
    np.testing.assert_array_equal(labels[clear], expected_labels[clear])
    np.testing.assert_allclose(errors, expected_errors, rtol=0, atol=1e-5)


@pytest.mark.parametrize(("kind", "shape"), [
    ("linear", (8, 5, 5)), ("linear", (16, 2, 2)), ("linear", (32, 7, 7)), ("linear", (12, 16)), ("deep", (8, 9, 9)),
    ("mlp", (8, 5, 5)), ("mlp", (12, 16)),
])
@pytest.mark.parametrize("batch", [1, 16])
def test_ramp_evaluate_scores_its_own_logits(kind: str, shape: tuple[int, ...], batch: int) -> None:
    ramp = _ramp(kind, shape, 10, seed=batch)
    for _ in range(2):  # the second call reuses what the first prepared
        _assert_scores_its_own_logits(ramp, torch.randn(batch, *shape))


@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_ramp_evaluate_follows_its_weights_and_shapes(kind: str) -> None:
    ramp = _ramp(kind, (8, 6, 6), 4, seed=0)
    with torch.inference_mode():  # as the serving path calls it
        _assert_scores_its_own_logits(ramp, torch.randn(5, 8, 6, 6))
    ramp.load_state_dict(_ramp(kind, (8, 6, 6), 4, seed=1).state_dict())
    _assert_scores_its_own_logits(ramp, torch.randn(5, 8, 6, 6))
    first, last = ramp.dense_layers()[0], ramp.dense_layers()[-1]
    with torch.no_grad():
        last.bias.add_(3.0)
    _assert_scores_its_own_logits(ramp, torch.randn(5, 8, 6, 6))
    first.weight = nn.Parameter(torch.randn(first.out_features, 8 * 9) * 4.0)
    _assert_scores_its_own_logits(ramp, torch.randn(5, 8, 6, 6))
    last.weight = nn.Parameter(torch.randn(4, last.in_features) * 4.0)
    _assert_scores_its_own_logits(ramp, torch.randn(5, 8, 6, 6))
    ramp.head.double()  # new storage, in another dtype
    _assert_scores_its_own_logits(ramp, torch.randn(5, 8, 6, 6, dtype=torch.float64))
    _assert_scores_its_own_logits(ramp, torch.randn(5, 8, 9, 9, dtype=torch.float64))  # a larger map


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


@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_dense_ramps_learn_the_same_whatever_the_scale_of_their_features(kind: str) -> None:
    """Linear and MLP heads train on standardised features: the scale is folded into their (first) weights
    afterwards and the mean kept as their center."""
    feats, _ = features(n=600)
    linear = {"a": spec_for(kind, (8, 5, 5), 4)}
    config = TrainConfig(seed=1, max_epochs=10, patience=3)
    ramps, _ = train_ramps(feats, linear, config, progress=False)
    scaled = Features({"a": feats.by_site["a"] * 1000.0 + 500.0}, feats.targets, 0.0)
    scaled_ramps, _ = train_ramps(scaled, linear, config, progress=False)
    ramp, scaled_ramp = ramps["a"], scaled_ramps["a"]
    with torch.no_grad():
        np.testing.assert_allclose(scaled_ramp.head_logits(scaled.by_site["a"]).numpy(),
                                   ramp.head_logits(feats.by_site["a"]).numpy(), rtol=1e-3, atol=1e-3)


def test_distilled_ramps_learn_the_models_confidence_not_only_its_labels() -> None:
    """Given the original model's logits, a ramp learns its softened answers: on held-out inputs its probabilities
    are closer to the model's than those of a ramp taught the top labels only, at the same agreement."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3000, 72, generator=g)
    teacher_logits = x @ (0.4 * torch.randn(4, 72, generator=g)).T  # a model that is often unsure
    train, held_out = slice(0, 2000), slice(2000, None)
    features = Features({"a": x[train]}, teacher_logits[train].argmax(1), 0.0, teacher=teacher_logits[train])
    specs = {"a": spec_for("linear", (8, 3, 3), 4)}
    distilled = train_ramps(features, specs, TrainConfig(seed=0, max_epochs=40), progress=False)[0]["a"]
    labels_only = train_ramps(features, specs, TrainConfig(seed=0, max_epochs=40, distill_temperature=0.0),
                              progress=False)[0]["a"]
    target = torch.softmax(teacher_logits[held_out], 1)

    def divergence(ramp) -> float:
        with torch.no_grad():
            return float(torch.nn.functional.kl_div(torch.log_softmax(ramp.head_logits(x[held_out]), 1), target,
                                                    reduction="batchmean"))

    def agreement(ramp) -> float:
        with torch.no_grad():
            return float((ramp.head_logits(x[held_out]).argmax(1) == target.argmax(1)).float().mean())

    assert divergence(distilled) < 0.5 * divergence(labels_only)
    assert agreement(distilled) >= agreement(labels_only) - 0.02 and agreement(distilled) > 0.8
