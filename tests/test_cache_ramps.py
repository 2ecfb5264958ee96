"""Cache ramps (Freeze Inference): building, lookup, the static threshold rule, online updates, bundles."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from rampserve.ramps.cache import (
    CacheRamp,
    CacheState,
    Index,
    build_cache,
    confident_label,
    kmeans_points,
    label_counts,
    static_threshold,
    update_points,
)
from rampserve.ramps.specs import CacheSpec, RampSpec
from rampserve.ramps.oracle import answerable_share
from rampserve.runtime.prepare import exit_share_at

CENTRES = np.array([[0.0, 0.0], [10.0, 0.0], [0.0, 10.0]], dtype=np.float32)


def hand_made_clusters(rng: np.random.Generator, per_cluster: int = 200) -> tuple[np.ndarray, np.ndarray, list]:
    """Three tight, far-apart clusters; cluster i's members carry label i except a known share carrying 3."""
    minority = [0.0, 0.1, 0.25]
    points, labels = [], []
    for i, centre in enumerate(CENTRES):
        points.append(centre + rng.normal(scale=0.3, size=(per_cluster, 2)))
        wrong = int(per_cluster * minority[i])
        labels.append(np.array([3] * wrong + [i] * (per_cluster - wrong)))
    return np.concatenate(points).astype(np.float32), np.concatenate(labels), minority


def test_centroids_carry_their_members_majority_label_and_its_fraction() -> None:
    points, labels, minority = hand_made_clusters(np.random.default_rng(0))
    centroids, counts = kmeans_points(points, labels, 3, 4, seed=0)
    assert counts.sum() == len(points)
    for i, centre in enumerate(CENTRES):
        row = int(np.argmin(np.linalg.norm(centroids - centre, axis=1)))
        assert np.linalg.norm(centroids[row] - centre) < 0.2
        assert int(counts[row].argmax()) == i
        assert counts[row].max() / counts[row].sum() == pytest.approx(1.0 - minority[i])


def test_label_counts_count_exactly() -> None:
    counts = label_counts(np.array([0, 0, 1, 2, 2, 2]), np.array([1, 1, 0, 2, 2, 0]), 3, 3)
    assert counts.tolist() == [[0, 2, 0], [1, 0, 0], [1, 0, 2]]


def _state(points: np.ndarray, counts: np.ndarray, scale: float = 1.0) -> CacheState:
    dim = points.shape[1]
    return CacheState(np.eye(dim, dtype=np.float32), np.zeros(dim, np.float32), points.astype(np.float32),
                      counts.astype(np.float32), np.zeros(len(points), np.float32), scale, relu=False)


def test_lookup_answers_the_nearest_centroids_label_with_the_papers_confidence() -> None:
    state = _state(CENTRES, np.array([[9, 1, 0], [0, 5, 5], [0, 0, 20]]))
    queries = np.array([[1.0, 0.0], [0.0, 8.0], [0.0, 0.0]], dtype=np.float32)
    labels, errors, _, nearest, distances = Index(state).lookup(queries, 1)
    assert nearest.tolist() == [0, 2, 0]
    assert labels.tolist() == [0, 2, 0]
    share = (np.array([9, 20, 9]) + 1) / (np.array([10, 20, 10]) + 3)  # smoothed majority fraction
    np.testing.assert_allclose(errors, distances / (distances + share), rtol=1e-6)
    assert errors[2] == 0.0  # on the centroid: as confident as can be


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), k=st.integers(1, 5))
def test_serving_path_equals_the_general_heuristic(seed: int, k: int) -> None:
    rng = np.random.default_rng(seed)
    state = _state(rng.normal(size=(12, 3)), rng.integers(0, 6, size=(12, 4)), scale=float(rng.uniform(0.5, 2)))
    queries = rng.normal(size=(7, 3)).astype(np.float32)
    index = Index(state)
    labels, errors, *_ = index.lookup(queries, k)
    distances, nearest = index.search(queries, k)
    expected_labels, expected_errors = confident_label(state.counts[nearest], distances, state.distance_scale)
    np.testing.assert_array_equal(labels, expected_labels)
    np.testing.assert_allclose(errors, expected_errors, rtol=1e-5, atol=1e-7)
    assert np.all((errors >= 0) & (errors <= 1))


@settings(max_examples=60, deadline=None)
@given(counts=arrays(np.float64, (3, 4), elements=st.floats(0, 50)),
       near=st.floats(0.01, 5), farther=st.floats(0.01, 5))
def test_closer_neighbours_never_make_an_answer_less_confident(counts, near, farther) -> None:
    distances = np.array([[near, near + 1, near + 2]])
    _, close_error = confident_label(counts[None], distances, 1.0)
    label, far_error = confident_label(counts[None], distances + farther, 1.0)
    assert close_error[0] <= far_error[0] + 1e-12


def test_knn_rule_prefers_agreeing_close_neighbours() -> None:
    one_hot = np.eye(3)[[0, 0, 1]][None]  # two neighbours say 0, one says 1
    labels, errors = confident_label(one_hot * 1e6, np.array([[1.0, 1.0, 1.0]]), 1.0)
    assert labels.tolist() == [0]
    _, closer = confident_label(one_hot * 1e6, np.array([[0.5, 0.5, 1.0]]), 1.0)
    assert closer[0] < errors[0]


@settings(max_examples=100, deadline=None)
@given(errors=arrays(np.float64, st.integers(1, 60), elements=st.floats(0, 1)),
       seed=st.integers(0, 1000))
def test_static_threshold_admits_no_wrong_validation_answer_and_is_the_highest_such(errors, seed) -> None:
    correct = np.random.default_rng(seed).random(len(errors)) < 0.7
    threshold = static_threshold(errors, correct)
    assert correct[errors < threshold].all()
    if not correct.all():
        assert not correct[errors <= threshold].all()  # any higher threshold lets a wrong answer out
    else:
        assert threshold == 1.0


def test_exit_share_at_agreement() -> None:
    errors = np.array([0.1, 0.2, 0.3, 0.4])
    assert exit_share_at(errors, np.array([True, True, False, True]), 0.99) == 0.5
    assert exit_share_at(errors, np.array([True, True, False, True]), 0.75) == 1.0
    assert exit_share_at(errors, np.array([False, True, True, True]), 0.99) == 0.0


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 6), st.booleans()), min_size=1, max_size=40),
       st.sampled_from([0.0, 0.01, 0.05, 0.2, 0.5]))
def test_a_ramps_own_oracle_is_the_best_single_threshold_within_the_disagreement(scored: list, disagreement: float
                                                                                 ) -> None:
    errors = np.array([e / 6 for e, _ in scored])  # few distinct scores: ties are common
    correct = np.array([c for _, c in scored])
    n = len(errors)
    # every threshold a ramp could have: exit where the error score is at most t (t below every score: none)
    feasible = [float((errors <= t).mean()) for t in (-1.0, *np.unique(errors))
                if (~correct & (errors <= t)).sum() <= disagreement * n]
    assert answerable_share(errors, correct, disagreement) == max(feasible)
    assert answerable_share(errors, correct, 1.0) == 1.0
    if correct.all():
        assert answerable_share(errors, correct, 0.0) == 1.0


def _ramp(points: int = 8, dim: int = 2, classes: int = 4) -> CacheRamp:
    spec = RampSpec("cache", "identity", (dim,), classes, CacheSpec(dim=dim, points=points, memory=32))
    rng = np.random.default_rng(1)
    features = rng.normal(size=(400, dim)).astype(np.float32)
    labels = (features[:, 0] > 0).astype(np.int64)
    return CacheRamp(spec, build_cache(features, labels, replace(spec.cache, reduction="pca"), classes, seed=0))


def test_memory_stays_bounded_under_continuous_updates() -> None:
    ramp = _ramp()
    before = ramp.memory_bytes()
    heaviest = float(ramp.counts.numpy().sum(axis=1).max())
    shapes = {name: tuple(b.shape) for name, b in ramp.named_buffers()}
    rng = np.random.default_rng(2)
    for step in range(300):
        # Ordinary inputs, and every tenth batch far away from everything seen (new regions re-seed centroids).
        scale = 50.0 if step % 10 == 0 else 1.0
        x = torch.from_numpy((rng.normal(size=(8, 2)) * scale).astype(np.float32))
        ramp.evaluate(x)
        assert ramp.learn(rng.integers(0, 4, size=8))
    assert ramp.memory_bytes() == before
    assert {name: tuple(b.shape) for name, b in ramp.named_buffers()} == shapes
    assert np.isfinite(ramp.points.numpy()).all() and (ramp.counts.numpy() >= 0).all()
    # Faded counts never outgrow the memory (32 observations) or what the cache was built with.
    assert ramp.counts.numpy().sum(axis=1).max() <= max(heaviest, 32.0) + 1e-3


def test_updates_follow_a_changed_labelling() -> None:
    ramp = _ramp()
    x = torch.tensor([[2.0, 0.0]] * 16)
    label_before, _ = ramp.evaluate(x)
    ramp.learn(np.full(16, 3))
    assert label_before[0] != 3
    for _ in range(20):  # the region's final answers are now 3: the cache comes to say so
        ramp.evaluate(x)
        ramp.learn(np.full(16, 3))
    labels, errors = ramp.evaluate(x)
    assert (labels == 3).all()


def test_a_far_input_reseeds_the_least_used_centroid() -> None:
    state = _state(CENTRES, np.array([[5, 0, 0], [0, 5, 0], [0, 0, 5]]))
    state.usage[:] = [3.0, 0.5, 2.0]
    far = np.array([[100.0, 100.0]], dtype=np.float32)
    update_points(state, far, np.array([2]), np.array([130.0]), np.array([0]), memory=16, move=True)
    np.testing.assert_array_equal(state.points[1], far[0])
    assert state.counts[1].tolist() == [1, 0, 0]


def test_learn_without_a_lookup_does_nothing() -> None:
    ramp = _ramp()
    before = ramp.points.clone()
    assert not ramp.learn(np.zeros(3, dtype=np.int64))
    assert torch.equal(ramp.points, before)


def test_cache_bundle_round_trips_and_keeps_the_models_output(cache_prepared, fmnist_feeds, tmp_path) -> None:
    from rampserve.runtime.bundle import load_bundle, save_bundle

    model = cache_prepared
    assert all(s.ramp.kind == "cache" for s in model.sites)
    assert set(model.meta["static_thresholds"]) == set(model.site_names)
    feeds = {model.backend.input_names[0]: fmnist_feeds}
    seen: dict[str, tuple] = {}
    logits = model.run(feeds, model.site_names, lambda site, labels, errors: seen.update({site: (labels, errors)}))
    np.testing.assert_array_equal(logits, model.run(feeds))  # the final stage is the original model's
    model.learn(logits.argmax(axis=1))  # a learned cache must round-trip too, not just a fresh one
    loaded = load_bundle(save_bundle(model, tmp_path / "cache-bundle"))
    assert [s.to_json() for s in loaded.sites] == [s.to_json() for s in model.sites]
    assert loaded.memory_bytes() == model.memory_bytes()
    for site in model.site_names:
        for name, buffer in model.ramps[site].named_buffers():
            assert torch.equal(buffer, dict(loaded.ramps[site].named_buffers())[name]), (site, name)
    again: dict[str, tuple] = {}
    model.run(feeds, model.site_names, lambda site, labels, errors: again.update({site: (labels, errors)}))
    loaded.run(feeds, loaded.site_names, lambda site, labels, errors: seen.update({site: (labels, errors)}))
    for site in model.site_names:
        np.testing.assert_array_equal(seen[site][0], again[site][0])
        np.testing.assert_allclose(seen[site][1], again[site][1], rtol=1e-6)


def test_mixed_preparation_keeps_one_ramp_of_either_kind_per_site(small_prepare_config) -> None:
    from rampserve.runtime.prepare import prepare
    from rampserve.runtime.sources import ModelSource

    config = replace(small_prepare_config, ramp_kind="mixed", cache=CacheSpec(points=16, dim=8))
    model = prepare(ModelSource("zoo", "resnet18-fmnist", small=True), config)
    kinds = {s.ramp.kind for s in model.sites}
    assert kinds <= {"linear", "cache"} and kinds
    assert set(model.profile.sites) == set(model.site_names)
    for site in model.sites:
        assert type(model.ramps[site.name]).__name__ == ("CacheRamp" if site.ramp.kind == "cache" else "Ramp")
