"""bench selection: the failure injection, the replay of Exp3 and Exp4 with feedback, and the figures reported.
Synthetic models only: the bench's real models are not needed here."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rampserve.bench.selection import (
    DROPPED_WEIGHT,
    PolicyRun,
    SelectionSettings,
    build_report,
    exp3_rate,
    exp4_rate,
    first_within,
    inject_failure,
    replay,
    replay_exp3,
    replay_exp4,
    selection_table,
    stream_order,
)

CLASSES = 10


def noisy_models(errors: list[float], queries: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Labels, and models that answer each query wrongly (a uniformly drawn wrong label) with their error rate,
    independently of each other."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, CLASSES, queries)
    wrong = (labels + rng.integers(1, CLASSES, (len(errors), queries))) % CLASSES
    predictions = np.where(rng.random((len(errors), queries)) < np.array(errors)[:, None], wrong, labels)
    return predictions, labels


def names(models: int) -> dict[str, str]:
    return {f"m{i}": "synthetic" for i in range(models)}


def small_settings(queries: int = 3000, start: int = 1000, end: int = 2000, window: int = 200,
                   **overrides) -> SelectionSettings:
    return SelectionSettings(queries=queries, failure_start=start, failure_end=end, recovery_window=window,
                             series_window=100, exp3_seeds=(0, 1, 2), **overrides)


@settings(max_examples=60, deadline=None)
@given(data=st.data(), queries=st.integers(2, 200), models=st.integers(1, 6), seed=st.integers(0, 2**32 - 1))
def test_the_failure_applies_only_to_its_model_inside_its_window_and_is_always_wrong(data, queries, models, seed):
    rng = np.random.default_rng(seed)
    predictions = rng.integers(0, CLASSES, (models, queries))
    labels = rng.integers(0, CLASSES, queries)
    model = data.draw(st.integers(0, models - 1))
    start = data.draw(st.integers(0, queries - 1))
    end = data.draw(st.integers(start + 1, queries))
    failed = inject_failure(predictions, labels, model, start, end, CLASSES, seed)
    untouched = np.ones_like(predictions, dtype=bool)
    untouched[model, start:end] = False
    assert np.array_equal(failed[untouched], predictions[untouched])
    inside = failed[model, start:end]
    assert np.all(inside != labels[start:end]) and np.all((inside >= 0) & (inside < CLASSES))


def test_exp4_with_one_perfect_model_among_guessing_ones_approaches_its_error():
    queries = 3000
    rng = np.random.default_rng(0)
    labels = rng.integers(0, CLASSES, queries)
    predictions = np.vstack([labels, rng.integers(0, CLASSES, (4, queries))])
    run = replay_exp4(predictions, labels, CLASSES, exp4_rate(5, queries))
    wrong = run.answers != labels
    assert wrong[queries // 2:].mean() <= 0.002
    assert wrong.mean() <= 0.02
    assert run.probabilities[-1, 0] > 0.99


def test_exp3_with_one_perfect_model_among_guessing_ones_learns_to_ask_it():
    queries = 3000
    rng = np.random.default_rng(1)
    labels = rng.integers(0, CLASSES, queries)
    predictions = np.vstack([rng.integers(0, CLASSES, (4, queries)), labels])
    run = replay_exp3(predictions, labels, exp3_rate(5, queries), seed=0)
    assert (run.answers != labels)[queries // 2:].mean() <= 0.05
    assert run.probabilities[-1, 4] > 0.95


def test_the_bandits_drop_the_failing_best_model_and_stay_close_to_the_best_single_model():
    predictions, labels = noisy_models([0.08, 0.09, 0.09, 0.10, 0.16], 12_000, seed=0)
    s = small_settings(queries=12_000, start=3000, end=6000, window=1000)
    report = build_report(names(5), replay(predictions, labels, CLASSES, s), s)
    policies = report["policies"]
    assert report["failing_model"] == "m0" and policies["m0"]["error_during"] == 1.0
    hindsight = policies["best_in_hindsight"]
    assert hindsight["model"] != "m0"
    for bandit in ("exp3", "exp4"):
        p = policies[bandit]
        assert p["error"] <= hindsight["error"] + 0.015
        assert p["dropped_after"] is not None and p["dropped_after"] <= 1000
        assert p["failing_weight_during"] < p["failing_weight_before"] / 10
        assert p["error_after"] <= hindsight["error_after"] + 0.015


def test_with_a_fast_rate_the_bandits_take_the_failed_model_back_once_it_works_again():
    predictions, labels = noisy_models([0.05, 0.15, 0.15, 0.20, 0.30], 6000, seed=0)
    s = small_settings(queries=6000, start=2000, end=3000, window=500, exp3_eta=0.05, exp4_eta=0.2)
    result = replay(predictions, labels, CLASSES, s)
    policies = build_report(names(5), result, s)["policies"]
    for bandit in ("exp3", "exp4"):
        assert policies[bandit]["dropped_after"] is not None
        assert policies[bandit]["recovered_after"] is not None
    assert result.exp4.probabilities[-1, 0] > 0.5
    assert np.median([run.probabilities[-1, 0] for run in result.exp3]) > 0.5


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), eta=st.floats(0.001, 1.0))
def test_exp3_is_deterministic_for_a_seed(seed, eta):
    predictions, labels = noisy_models([0.1, 0.2, 0.5], 300, seed=seed % 1000)
    first, again = (replay_exp3(predictions, labels, eta, seed) for _ in range(2))
    assert np.array_equal(first.answers, again.answers)
    assert np.array_equal(first.probabilities, again.probabilities)


def test_exp3_seeds_draw_differently():
    predictions, labels = noisy_models([0.1, 0.2, 0.5], 500, seed=3)
    answers = [replay_exp3(predictions, labels, 0.05, seed).answers for seed in (0, 1)]
    assert not np.array_equal(*answers)


def direct_first_within(wrong: np.ndarray, start: int, stop: int, window: int, limit: float) -> int | None:
    for k in range(stop - start - window + 1):
        if wrong[start + k:start + k + window].mean() <= limit:
            return k
    return None


@settings(max_examples=100, deadline=None)
@given(wrong=st.lists(st.booleans(), min_size=1, max_size=80), data=st.data())
def test_first_within_matches_a_direct_scan(wrong, data):
    wrong = np.array(wrong)
    start = data.draw(st.integers(0, len(wrong) - 1))
    stop = data.draw(st.integers(start + 1, len(wrong)))
    window = data.draw(st.integers(1, stop - start))
    limit = data.draw(st.sampled_from([0.0, 0.25, 0.5, 1 / 3, 1.0]))
    assert first_within(wrong, start, stop, window, limit) == direct_first_within(wrong, start, stop, window, limit)


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10_000), errors=st.lists(st.floats(0.0, 0.6), min_size=2, max_size=5))
def test_reported_figures_equal_recomputation_from_the_recorded_answers(seed, errors):
    predictions, labels = noisy_models(errors, 400, seed)
    s = SelectionSettings(queries=400, failure_start=100, failure_end=250, recovery_window=50, series_window=60,
                          exp3_seeds=(0, 1, 2))
    result = replay(predictions, labels, CLASSES, s)
    report = build_report(names(len(errors)), result, s)
    assert result.exp3_eta == exp3_rate(len(errors), 400) and result.exp4_eta == exp4_rate(len(errors), 400)

    def figures(wrong: np.ndarray) -> dict:
        limit = wrong[50:100].mean() + s.recovery_margin
        return {"error": wrong.mean(), "error_before": wrong[:100].mean(), "error_during": wrong[100:250].mean(),
                "error_after": wrong[250:].mean(), "recovered_after": direct_first_within(wrong, 250, 400, 50, limit)}

    def bandit(run: PolicyRun) -> dict:
        weight = run.probabilities[:, result.failing]
        dropped = next((t for t in range(150) if weight[100 + t] < DROPPED_WEIGHT), None)
        return {**figures(run.answers != labels), "dropped_after": dropped, "failing_weight_during": weight[100:250].mean()}

    def check(reported: dict, expected: dict) -> None:
        for key, value in expected.items():
            assert reported[key] == pytest.approx(value), key

    check(report["policies"]["exp4"], bandit(result.exp4))
    for reported, run in zip(report["policies"]["exp3"]["seeds"], result.exp3):
        check(reported, bandit(run))
    exp3_errors = [run["error"] for run in report["policies"]["exp3"]["seeds"]]
    assert report["policies"]["exp3"]["error"] == pytest.approx(np.median(exp3_errors))
    wrong = result.predictions != labels
    for i, name in enumerate(names(len(errors))):
        check(report["policies"][name], figures(wrong[i]))
    # The series' buckets (60 queries, the last one 40) weigh back to the overall error.
    sizes = np.diff(np.append(report["series"]["starts"], 400))
    assert np.dot(report["series"]["error"]["exp4"], sizes) / 400 == pytest.approx(report["policies"]["exp4"]["error"])


def test_stream_order_passes_are_different_permutations_and_seeded():
    order = stream_order(100, 250, seed=4)
    assert len(order) == 250
    assert sorted(order[:100]) == list(range(100)) and sorted(order[100:200]) == list(range(100))
    assert not np.array_equal(order[:100], order[100:200])
    assert np.array_equal(order, stream_order(100, 250, seed=4))
    assert not np.array_equal(order, stream_order(100, 250, seed=5))


@pytest.mark.parametrize("overrides", [dict(failure_start=2000, failure_end=2000), dict(recovery_window=1500),
                                       dict(failure_end=3000), dict(exp3_seeds=())])
def test_settings_reject_windows_that_cannot_be_measured(overrides):
    with pytest.raises(ValueError):
        SelectionSettings(**{**dict(queries=3000, failure_start=1000, failure_end=2000, recovery_window=200),
                             **overrides})


def test_replay_rejects_a_stream_of_the_wrong_length():
    predictions, labels = noisy_models([0.1, 0.2], 2999, seed=0)
    with pytest.raises(ValueError):
        replay(predictions, labels, CLASSES, small_settings())


def test_the_table_and_the_plot_show_every_policy(tmp_path):
    from rampserve.bench.selection_plots import write_plots

    predictions, labels = noisy_models([0.1, 0.2, 0.3], 3000, seed=5)
    s = small_settings()
    report = build_report(names(3), replay(predictions, labels, CLASSES, s), s)
    assert selection_table(report).row_count == 2 + 1 + 3
    (path,) = write_plots(report, tmp_path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
