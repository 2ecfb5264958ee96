"""bench selection: the failure injection, the replay of Exp3 and Exp4 with feedback under each forgetting
mechanism, seed by seed, and the figures and bars reported. Synthetic models only: the bench's real models are not
needed here."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rampserve.bench.selection import (
    DROPPED_WEIGHT,
    FORGETTING,
    SKLEARN_MODELS,
    PolicyRun,
    SelectionSettings,
    bars,
    build_report,
    exp3_rate,
    exp4_rate,
    first_at_least,
    first_within,
    inject_failure,
    model_predictions,
    replay,
    replay_exp3,
    replay_exp4,
    replay_seeds,
    selection_tables,
    sklearn_estimator,
    spread,
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
                             series_window=100, **{"seeds": (0, 1, 2), **overrides})


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


def test_the_bandits_drop_the_failing_best_model_and_only_the_forgetting_ones_take_it_back():
    # Three passes over 3,000 "images": each model's errors are fixed per image, as the real models' are.
    predictions, labels = noisy_models([0.05, 0.08, 0.08, 0.09, 0.16], 3000, seed=0)
    s = small_settings(queries=9000, start=2000, end=5000, window=1000, regain_within=2000)
    report = build_report(names(5), replay_seeds(predictions, labels, s), s)
    assert report["failing_models"] == ["m0"]
    for seed in report["seeds"]:
        assert seed["models"]["m0"]["error_during"] == 1.0 and seed["best_static"]["model"] != "m0"
        for mechanism in FORGETTING:
            for bandit in ("exp3", "exp4"):
                p = seed["forgetting"][mechanism][bandit]
                assert p["failing_weight_during"] < p["failing_weight_before"] / 3
                if "share" not in mechanism:  # fixed share keeps giving Exp3's failing model more than 0.01
                    assert p["dropped_after"] is not None and p["dropped_after"] <= 1500
    met = report["bars"]
    for bandit in ("exp3", "exp4"):
        assert all(met[mechanism][bandit]["regained_after"]["met"] for mechanism in FORGETTING if mechanism != "none")
        assert not met["none"][bandit]["regained_after"]["met"]
        assert report["summary"]["forgetting"]["none"][bandit]["regained_after"]["median"] is None
        detect = report["summary"]["forgetting"]["detect"][bandit]
        assert detect["failing_weight_after"]["median"] > detect["failing_weight_before"]["median"] / 2


def test_first_at_least_counts_from_the_start():
    values = np.array([0.5, 0.1, 0.2, 0.4, 0.3])
    assert first_at_least(values, 1, 0.35) == 2 and first_at_least(values, 0, 0.5) == 0
    assert first_at_least(values, 1, 0.6) is None


def test_spread_counts_a_seed_that_never_got_there_as_the_slowest():
    assert spread([3, 1, 2]) == {"median": 2.0, "min": 1, "max": 3}
    assert spread([3, None, 1]) == {"median": 3.0, "min": 1, "max": None}
    assert spread([None, None, 1]) == {"median": None, "min": 1, "max": None}


def test_bars_are_medians_of_per_seed_margins():
    def seed(during: float, static: float, regained: int | None, before: float, after: float) -> dict:
        run = {"error_during": during, "regained_after": regained, "error_before": before, "error_after": after}
        return {"best_static": {"error_during": static}, "forgetting": {"detect": {"exp3": run, "exp4": run}}}

    s = SelectionSettings(regain_within=100)
    # Medians: during - static (-0.01, +0.02, -0.005) -> -0.005; regained (50, None, 150) -> 150;
    # after - before (0, +0.01, -0.02) -> 0.
    seeds = [seed(0.09, 0.10, 50, 0.1, 0.1), seed(0.12, 0.10, None, 0.1, 0.11), seed(0.095, 0.10, 150, 0.1, 0.08)]
    found = bars(seeds, "detect", s)["exp3"]
    assert found["during_minus_best_static"]["median"] == pytest.approx(-0.005)
    assert found["during_minus_best_static"]["met"]
    assert found["regained_after"]["median"] == 150 and not found["regained_after"]["met"]
    assert found["after_minus_before"]["median"] == pytest.approx(0.0) and found["after_minus_before"]["met"]


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


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 10_000), errors=st.lists(st.floats(0.0, 0.6), min_size=2, max_size=5))
def test_reported_figures_equal_recomputation_from_the_recorded_answers(seed, errors):
    predictions, labels = noisy_models(errors, 400, seed)
    s = SelectionSettings(queries=400, failure_start=100, failure_end=250, recovery_window=50, series_window=60,
                          seeds=(seed,))
    result = replay(predictions, labels, CLASSES, s, seed)
    report = build_report(names(len(errors)), [result], s)
    assert result.exp3_eta == exp3_rate(len(errors), 400) and result.exp4_eta == exp4_rate(len(errors), 400)

    def figures(wrong: np.ndarray) -> dict:
        limit = wrong[50:100].mean() + s.recovery_margin
        return {"error": wrong.mean(), "error_before": wrong[:100].mean(), "error_during": wrong[100:250].mean(),
                "error_after": wrong[250:].mean(), "recovered_after": direct_first_within(wrong, 250, 400, 50, limit)}

    def bandit(run: PolicyRun) -> dict:
        weight = run.probabilities[:, result.failing]
        before = weight[50:100].mean()
        dropped = next((t for t in range(150) if weight[100 + t] < DROPPED_WEIGHT), None)
        regained = next((t for t in range(150) if weight[250 + t] >= before / 2), None)
        return {**figures(run.answers != labels), "dropped_after": dropped, "failing_weight_before": before,
                "failing_weight_during": weight[100:250].mean(), "regained_after": regained}

    def check(reported: dict, expected: dict) -> None:
        for key, value in expected.items():
            assert reported[key] == pytest.approx(value), key

    (reported,) = report["seeds"]
    for mechanism, runs in result.runs.items():
        for name, run in runs.items():
            check(reported["forgetting"][mechanism][name], bandit(run))
            median = report["summary"]["forgetting"][mechanism][name]["error_during"]
            assert median["median"] == median["min"] == median["max"] == reported["forgetting"][mechanism][name][
                "error_during"]
    wrong = result.predictions != labels
    for i, name in enumerate(names(len(errors))):
        check(reported["models"][name], figures(wrong[i]))
    during = wrong[:, 100:250].mean(axis=1)
    assert reported["best_over_failure"]["error_during"] == pytest.approx(during.min())
    assert reported["best_static"]["error"] == pytest.approx(wrong.mean(axis=1).min())
    # The series' buckets (60 queries, the last one 40) weigh back to the overall error.
    sizes = np.diff(np.append(report["series"]["starts"], 400))
    exp4 = report["series"]["error"]["detect"]["exp4"]["median"]
    assert np.dot(exp4, sizes) / 400 == pytest.approx(reported["forgetting"]["detect"]["exp4"]["error"])


def test_stream_order_passes_are_different_permutations_and_seeded():
    order = stream_order(100, 250, seed=4)
    assert len(order) == 250
    assert sorted(order[:100]) == list(range(100)) and sorted(order[100:200]) == list(range(100))
    assert not np.array_equal(order[:100], order[100:200])
    assert np.array_equal(order, stream_order(100, 250, seed=4))
    assert not np.array_equal(order, stream_order(100, 250, seed=5))


@pytest.mark.parametrize("overrides", [dict(failure_start=2000, failure_end=2000), dict(recovery_window=1500),
                                       dict(failure_end=3000), dict(seeds=()), dict(seeds=(1, 1)),
                                       dict(forgetting=("detect", "forget")), dict(forgetting=()),
                                       dict(sklearn=("svm-pixels",)), dict(cnns=(), sklearn=("logreg-pixels",)),
                                       dict(regain_share=0.0)])
def test_settings_reject_windows_that_cannot_be_measured(overrides):
    with pytest.raises(ValueError):
        SelectionSettings(**{**dict(queries=3000, failure_start=1000, failure_end=2000, recovery_window=200),
                             **overrides})


def test_replay_rejects_a_stream_of_the_wrong_length():
    predictions, labels = noisy_models([0.1, 0.2], 2999, seed=0)
    with pytest.raises(ValueError):
        replay(predictions, labels, CLASSES, small_settings(), seed=0)


def test_every_scikit_learn_model_builds_with_its_parameters():
    for name, (estimator, parameters) in SKLEARN_MODELS.items():
        model = sklearn_estimator(name)
        assert type(model).__name__ == estimator.rsplit(".", 1)[1]
        assert {key: model.get_params()[key] for key in parameters} == parameters


def test_the_tables_and_the_plots_show_every_policy_and_seed(tmp_path):
    from rampserve.bench.selection_plots import write_plots

    predictions, labels = noisy_models([0.1, 0.2, 0.3], 1500, seed=5)
    s = small_settings(seeds=(0, 1))
    report = build_report(names(3), replay_seeds(predictions, labels, s), s)
    summary, per_seed, met = selection_tables(report)
    mechanisms = len(FORGETTING)
    assert summary.row_count == mechanisms * 2 + 2 and per_seed.row_count == 2 * mechanisms * 2
    assert met.row_count == mechanisms * 2
    paths = write_plots(report, tmp_path)
    assert [p.name for p in paths] == [f"selection_{m}_seeds2.png" for m in FORGETTING]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in paths)


def test_saved_predictions_are_reused_in_the_settings_order_and_checked(tmp_path):
    saved = tmp_path / "predictions.npz"
    rng = np.random.default_rng(0)
    stored = {name: rng.integers(0, CLASSES, 7) for name in ("cnn-a", "logreg-pixels", "knn-pixels")}
    np.savez(saved, **stored)
    s = SelectionSettings(cnns=("cnn-a",), sklearn=("knn-pixels", "logreg-pixels"))
    messages = []
    rows = model_predictions(s, np.zeros((7, 28, 28), dtype=np.uint8), saved, messages.append)
    assert np.array_equal(rows, np.stack([stored["cnn-a"], stored["knn-pixels"], stored["logreg-pixels"]]))
    assert "reusing" in messages[0] and len(messages) == 1  # nothing was run or trained
    with np.load(saved, allow_pickle=False) as again:
        assert sorted(again.files) == sorted(stored)
    with pytest.raises(ValueError, match="7 images"):
        model_predictions(s, np.zeros((9, 28, 28), dtype=np.uint8), saved, messages.append)
