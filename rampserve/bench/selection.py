"""`rampserve bench selection`: Clipper's model-selection experiment (seed 003, §5 and its figure of Exp3 and
Exp4 under model failure): five models answer a stream of queries, the best of them fails badly between
queries 5,000 and 10,000, and the bandit policies learn from each query's true label which models to trust.

The models are real and so is the data: the four Fashion-MNIST CNNs of the zoo (PyTorch) and a logistic
regression on the pixels (scikit-learn, trained on the Fashion-MNIST training set at bench time, in memory
only). Queries are the 10,000 test images, never seen in training, in whole seeded permutations back to back
(two for 20,000 queries). Every model predicts every test image once; the stream then indexes those answers.

The failure: the model with the lowest error on the stream answers, for queries [failure_start, failure_end),
a label drawn uniformly from the nine wrong ones. Always wrong is the worst a model can do under 0/1 loss, so
the bandits pay the most for every query they still send it; drawn at random rather than one constant label,
its answers look like a broken model's garbage and never form a block of votes an ensemble could mistake for
agreement. Failing the best model is Clipper's choice too: it is the model the policies have learned to lean
on, so its failure costs them the most.

Each policy answers each query, then receives the true label (Clipper's feedback loop) and updates with the
0/1 loss: Exp3 draws one model and learns about it alone, Exp4 asks all five, answers with their weighted
vote and learns about every one. The learning rates are the textbook ones for a horizon of T queries and K
models, fixed before looking at any result (see `exp3_rate` and `exp4_rate`).

Clipper's figure shows the error falling again once the model recovers, which needs a policy that takes the
model back. Each policy runs with each way of letting old evidence fade (`FORGETTING`: the change detector,
fixed share, and neither), on the same streams, and the experiment runs once per seed; the report gives every
figure per seed and as the median with its range, and the issue's bars for each mechanism.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from rich.markup import escape
from rich.table import Table
from tqdm.auto import tqdm

from rampserve.control.selection import (
    MIN_WEIGHT,
    REMEMBER_ALL,
    Forgetting,
    SelectionState,
    exp3_choose,
    exp3_update,
    exp4_combine,
    exp4_update,
)
from rampserve.workloads.fashion_mnist import CLASSES, load_fashion_mnist

if TYPE_CHECKING:
    from sklearn.base import BaseEstimator

CNNS = ("resnet18-fmnist", "resnet50-fmnist", "vgg11-fmnist", "vgg16-fmnist")
# scikit-learn models on the pixels scaled to [0, 1], trained on the 60,000 training images at bench time (in
# memory only), as estimator name and parameters. Logistic regression is the fifth model of the default
# experiment: C=0.1 converges within lbfgs' iteration limit (C=1 does not in 300 iterations) at the same test
# accuracy (0.846 against 0.844). The others give an experiment of five models that trains in minutes on two
# cores, where the zoo CNNs take hours on a busy machine.
SKLEARN_MODELS = {
    "logreg-pixels": ("linear_model.LogisticRegression", {"C": 0.1, "max_iter": 1000}),
    "mlp-pixels": ("neural_network.MLPClassifier", {"hidden_layer_sizes": (256,), "early_stopping": True,
                                                    "random_state": 0}),
    "forest-pixels": ("ensemble.RandomForestClassifier", {"n_estimators": 100, "random_state": 0}),
    "extra-trees-pixels": ("ensemble.ExtraTreesClassifier", {"n_estimators": 100, "random_state": 0}),
    "knn-pixels": ("neighbors.KNeighborsClassifier", {"n_neighbors": 5}),
}
SKLEARN_DEFAULT = ("logreg-pixels",)
FAILURE_MODE = "uniformly random wrong label"
BANDITS = ("exp3", "exp4")
QUERY_COUNTS = ("dropped_after", "recovered_after", "regained_after")
# A policy has dropped the failing model once it gives it less than this probability: Exp3 then sends it fewer
# than one query in a hundred, and Exp4's vote can follow it only where the others are split.
DROPPED_WEIGHT = 0.01
# Fixed share over about a thousand queries: from the bottom, a model gets back half an equal share in
# ln 2 / 0.001, about 700 queries, well within the 2,000 the issue asks for.
SHARE = 0.001
# How each policy lets old evidence fade (`control.selection`): the change detector (the default), fixed share
# (the floor is then what the share gives back), and neither (Clipper's exponential weights, the bench's former
# behaviour).
FORGETTING = {
    "detect": Forgetting(),
    "share": Forgetting(floor=MIN_WEIGHT, share=SHARE, detect=False),
    "none": REMEMBER_ALL,
    "detect+share": Forgetting(share=SHARE),
}


@dataclass(frozen=True)
class SelectionSettings:
    cnns: tuple[str, ...] = CNNS
    sklearn: tuple[str, ...] = SKLEARN_DEFAULT  # keys of SKLEARN_MODELS
    queries: int = 20_000
    failure_start: int = 5_000
    failure_end: int = 10_000
    exp3_eta: float | None = None  # None: Exp3's rate for this horizon and number of models (`exp3_rate`)
    exp4_eta: float | None = None  # None: Hedge's rate for this horizon and number of models (`exp4_rate`)
    forgetting: tuple[str, ...] = tuple(FORGETTING)  # the mechanisms compared, keys of FORGETTING
    # One run of the experiment per seed: the seed orders the stream, draws the failing model's wrong labels and
    # Exp3's choices (each from a generator of its own), so figures are reported per seed and as medians.
    seeds: tuple[int, ...] = (0, 1, 2, 3, 4)
    series_window: int = 250  # queries per point of the error-over-time series
    # A policy has recovered once the error over the next `recovery_window` queries after the failure is within
    # `recovery_margin` of its error over the `recovery_window` queries before the failure. 1,000 queries
    # measure an error near 0.09 to a standard error of 0.009, so a 0.02 margin is about two of them.
    recovery_window: int = 1000
    recovery_margin: float = 0.02
    # The failed model has regained its weight once a policy gives it `regain_share` of its mean weight over the
    # `recovery_window` queries before the failure; the bar is within `regain_within` queries of the failure's end.
    regain_share: float = 0.5
    regain_within: int = 2000
    batch_size: int = 500  # CNN inference

    def __post_init__(self) -> None:
        if not 0 < self.recovery_window <= self.failure_start < self.failure_end < self.queries:
            raise ValueError("need 0 < recovery_window <= failure_start < failure_end < queries, got "
                             f"{self.recovery_window}, {self.failure_start}, {self.failure_end}, {self.queries}")
        if unknown := [name for name in self.sklearn if name not in SKLEARN_MODELS]:
            raise ValueError(f"unknown scikit-learn models {unknown}; known: {list(SKLEARN_MODELS)}")
        if len(self.cnns) + len(self.sklearn) < 2 or len(set(self.cnns + self.sklearn)) != len(self.cnns + self.sklearn):
            raise ValueError("selection needs at least two different models")
        if not self.seeds or len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"need at least one seed and no seed twice, got {self.seeds}")
        if not self.forgetting or any(name not in FORGETTING for name in self.forgetting):
            raise ValueError(f"forgetting must name some of {list(FORGETTING)}, got {list(self.forgetting)}")
        if self.series_window <= 0:
            raise ValueError("series_window must be positive")
        if not 0 < self.regain_share <= 1:
            raise ValueError(f"regain_share must lie in (0, 1], got {self.regain_share}")


def exp3_rate(models: int, queries: int) -> float:
    """sqrt(2 ln K / (K T)): the fixed rate that bounds Exp3's regret over T rounds by sqrt(2 T K ln K)
    (Bubeck and Cesa-Bianchi 2012, Theorem 3.1)."""
    return math.sqrt(2 * math.log(models) / (models * queries))


def exp4_rate(models: int, queries: int) -> float:
    """sqrt(8 ln K / T): the rate that bounds the regret of exponential weights with full information over T
    rounds by sqrt(T ln K / 2) (Cesa-Bianchi and Lugosi 2006, Theorem 2.2). Exp4 here sees every model's loss
    on every query, which is that setting."""
    return math.sqrt(8 * math.log(models) / queries)


def stream_order(images: int, queries: int, seed: int) -> np.ndarray:
    """Image indices in query order: seeded permutations back to back, so each pass asks every image once."""
    rng = np.random.default_rng(seed)
    return np.concatenate([rng.permutation(images) for _ in range(-(-queries // images))])[:queries]


def inject_failure(predictions: np.ndarray, labels: np.ndarray, model: int, start: int, end: int,
                   num_classes: int, seed: int) -> np.ndarray:
    """A copy of `predictions` (models, queries) in which `model` answers queries [start, end) with a label
    drawn uniformly from the wrong ones."""
    failed = predictions.copy()
    offsets = np.random.default_rng(seed).integers(1, num_classes, size=end - start)
    failed[model, start:end] = (labels[start:end] + offsets) % num_classes
    return failed


@dataclass
class PolicyRun:
    answers: np.ndarray  # (queries,) the label the policy answered
    probabilities: np.ndarray  # (queries, models) the policy's model probabilities when it answered


def replay_exp3(predictions: np.ndarray, labels: np.ndarray, eta: float, seed: int,
                forgetting: Forgetting = REMEMBER_ALL) -> PolicyRun:
    models, queries = predictions.shape
    state = SelectionState.uniform(tuple(map(str, range(models))))
    draws = np.random.default_rng(seed).random(queries)
    answers = np.empty(queries, dtype=np.int64)
    probabilities = np.empty((queries, models))
    for t in range(queries):
        probabilities[t] = state.probabilities()
        chosen = exp3_choose(state, draws[t])
        answers[t] = predictions[chosen, t]
        state = exp3_update(state, chosen, float(answers[t] != labels[t]), eta, forgetting)
    return PolicyRun(answers, probabilities)


def replay_exp4(predictions: np.ndarray, labels: np.ndarray, num_classes: int, eta: float,
                forgetting: Forgetting = REMEMBER_ALL) -> PolicyRun:
    models, queries = predictions.shape
    state = SelectionState.uniform(tuple(map(str, range(models))))
    answers = np.empty(queries, dtype=np.int64)
    probabilities = np.empty((queries, models))
    for t in range(queries):
        probabilities[t] = state.probabilities()
        answers[t], _ = exp4_combine(state, predictions[:, t], num_classes)
        state = exp4_update(state, (predictions[:, t] != labels[t]).astype(np.float64), eta, forgetting)
    return PolicyRun(answers, probabilities)


@dataclass
class Replay:
    seed: int
    predictions: np.ndarray  # (models, queries) with the failure injected
    labels: np.ndarray  # (queries,)
    clean_error: np.ndarray  # (models,) each model's error on the stream without the failure
    failing: int  # the model that fails
    exp3_eta: float
    exp4_eta: float
    runs: dict[str, dict[str, PolicyRun]]  # forgetting mechanism -> bandit -> its run


def replay(predictions: np.ndarray, labels: np.ndarray, num_classes: int, settings: SelectionSettings,
           seed: int) -> Replay:
    """One seed of the experiment on a stream already in that seed's order: fail the best model, then replay
    the stream through Exp3 and Exp4 with each forgetting mechanism of `settings`."""
    if predictions.shape[1] != len(labels) or len(labels) != settings.queries:
        raise ValueError(f"predictions {predictions.shape} and labels {labels.shape} do not match "
                         f"{settings.queries} queries")
    models = len(predictions)
    clean_error = (predictions != labels).mean(axis=1)
    failing = int(clean_error.argmin())
    failed = inject_failure(predictions, labels, failing, settings.failure_start, settings.failure_end,
                            num_classes, seed)
    exp3_eta = exp3_rate(models, settings.queries) if settings.exp3_eta is None else settings.exp3_eta
    exp4_eta = exp4_rate(models, settings.queries) if settings.exp4_eta is None else settings.exp4_eta
    runs = {name: {"exp3": replay_exp3(failed, labels, exp3_eta, seed, FORGETTING[name]),
                   "exp4": replay_exp4(failed, labels, num_classes, exp4_eta, FORGETTING[name])}
            for name in settings.forgetting}
    return Replay(seed, failed, labels, clean_error, failing, exp3_eta, exp4_eta, runs)


def first_within(wrong: np.ndarray, start: int, stop: int, window: int, limit: float) -> int | None:
    """Queries from `start` until the error over the next `window` queries, all before `stop`, is at most
    `limit`; None if it never is."""
    counts = np.cumsum(np.concatenate([[0], wrong[start:stop].astype(np.int64)]))
    rates = (counts[window:] - counts[:-window]) / window
    hits = np.flatnonzero(rates <= limit)
    return int(hits[0]) if len(hits) else None


def first_at_least(values: np.ndarray, start: int, limit: float) -> int | None:
    """Queries from `start` until `values` first reaches `limit`; None if it never does."""
    hits = np.flatnonzero(values[start:] >= limit)
    return int(hits[0]) if len(hits) else None


def error_figures(wrong: np.ndarray, settings: SelectionSettings) -> dict:
    start, end, window = settings.failure_start, settings.failure_end, settings.recovery_window
    reference = float(wrong[start - window:start].mean())
    limit = reference + settings.recovery_margin
    return {
        "error": float(wrong.mean()),
        "error_before": float(wrong[:start].mean()),
        "error_during": float(wrong[start:end].mean()),
        "error_after": float(wrong[end:].mean()),
        "reference_error": reference,
        "recovered_after": first_within(wrong, end, len(wrong), window, limit),
    }


def bandit_figures(run: PolicyRun, labels: np.ndarray, failing: int, settings: SelectionSettings) -> dict:
    """Error figures; how many queries into the failure the policy drops the failing model; that model's mean
    probability (Exp3: its expected share of queries; Exp4: its share of the vote) over the `recovery_window`
    queries before the failure, during it and after it; and how many queries after the failure the policy gives
    it `regain_share` of its weight before: whether, and how soon, the policy takes it back once it works again."""
    start, end = settings.failure_start, settings.failure_end
    weight = run.probabilities[:, failing]
    dropped = np.flatnonzero(weight[start:end] < DROPPED_WEIGHT)
    before = float(weight[start - settings.recovery_window:start].mean())
    return {**error_figures(run.answers != labels, settings),
            "dropped_after": int(dropped[0]) if len(dropped) else None,
            "failing_weight_before": before,
            "failing_weight_during": float(weight[start:end].mean()),
            "failing_weight_after": float(weight[end:].mean()),
            "regained_after": first_at_least(weight, end, settings.regain_share * before)}


def spread(values: list[float | int | None]) -> dict:
    """Median, least and greatest over seeds; a seed that never dropped, recovered or regained (None) counts as
    the slowest, and a median that falls on one is None."""
    finite = [math.inf if value is None else value for value in values]
    median, low, high = float(np.median(finite)), min(finite), max(finite)
    return {key: None if math.isinf(value) else value for key, value in
            (("median", median), ("min", low), ("max", high))}


def bucket_means(values: np.ndarray, window: int) -> np.ndarray:
    """Means over consecutive buckets of `window` values (the last one may be shorter)."""
    starts = np.arange(0, len(values), window)
    return np.add.reduceat(values.astype(np.float64), starts) / np.diff(np.append(starts, len(values)))


def _series(per_seed: list[np.ndarray]) -> dict:
    stacked = np.stack(per_seed)
    return {"median": np.median(stacked, axis=0).tolist(), "min": stacked.min(axis=0).tolist(),
            "max": stacked.max(axis=0).tolist()}


def seed_report(names: tuple[str, ...], result: Replay, settings: SelectionSettings) -> dict:
    """One seed's figures: every model's error figures, the best static model in hindsight (the lowest error over
    the whole stream, the failure included) and the best one over the failure, and each bandit's figures under
    each forgetting mechanism."""
    labels, failing = result.labels, result.failing
    wrong = result.predictions != labels
    hindsight = int(wrong.mean(axis=1).argmin())
    during = wrong[:, settings.failure_start:settings.failure_end].mean(axis=1)
    return {
        "seed": result.seed,
        "failing_model": names[failing],
        "best_static": {**error_figures(wrong[hindsight], settings), "model": names[hindsight]},
        "best_over_failure": {"model": names[int(during.argmin())], "error_during": float(during.min())},
        "models": {name: error_figures(wrong[i], settings) for i, name in enumerate(names)},
        "forgetting": {mechanism: {bandit: bandit_figures(run, labels, failing, settings)
                                   for bandit, run in runs.items()}
                       for mechanism, runs in result.runs.items()},
    }


def bars(seeds: list[dict], mechanism: str, settings: SelectionSettings) -> dict:
    """The issue's bars for one mechanism, each as the median over seeds of a per-seed margin with its spread:
    below the best static model over the failure (margin < 0), the failed model's weight regained within
    `regain_within` queries, and error after the failure no worse than before it (margin <= 0)."""
    found = {}
    for bandit in BANDITS:
        runs = [seed["forgetting"][mechanism][bandit] for seed in seeds]
        below = spread([run["error_during"] - seed["best_static"]["error_during"] for run, seed in zip(runs, seeds)])
        regained = spread([run["regained_after"] for run in runs])
        no_worse = spread([run["error_after"] - run["error_before"] for run in runs])
        found[bandit] = {
            "during_minus_best_static": {**below, "met": below["median"] < 0},
            "regained_after": {**regained, "met": regained["median"] is not None
                               and regained["median"] <= settings.regain_within},
            "after_minus_before": {**no_worse, "met": no_worse["median"] <= 0},
        }
    return found


def build_report(models: dict[str, str], results: list[Replay], settings: SelectionSettings) -> dict:
    """`models` maps each row of the predictions, in order, to its framework; `results` holds one replay per
    seed of `settings`."""
    names = tuple(models)
    window = settings.series_window
    seeds = [seed_report(names, result, settings) for result in results]
    # The failing model's weight is each seed's own failing model's (the same model wherever the stream covers
    # the test set equally often, as with the default 20,000 queries).
    series = {
        "window": window,
        "starts": list(range(0, settings.queries, window)),
        "model_error": {name: _series([bucket_means(r.predictions[i] != r.labels, window) for r in results])
                        for i, name in enumerate(names)},
        "error": {mechanism: {bandit: _series([bucket_means(r.runs[mechanism][bandit].answers != r.labels, window)
                                               for r in results]) for bandit in BANDITS}
                  for mechanism in settings.forgetting},
        "failing_weight": {mechanism: {bandit: _series([bucket_means(r.runs[mechanism][bandit].probabilities[:, r.failing],
                                                                     window) for r in results]) for bandit in BANDITS}
                           for mechanism in settings.forgetting},
    }
    figure_names = tuple(seeds[0]["forgetting"][settings.forgetting[0]]["exp3"])
    summary = {
        "best_static": {key: spread([seed["best_static"][key] for seed in seeds])
                        for key in seeds[0]["best_static"] if key != "model"},
        "best_over_failure": {"error_during": spread([seed["best_over_failure"]["error_during"] for seed in seeds])},
        "forgetting": {mechanism: {bandit: {key: spread([seed["forgetting"][mechanism][bandit][key] for seed in seeds])
                                            for key in figure_names} for bandit in BANDITS}
                       for mechanism in settings.forgetting},
    }
    first = results[0]
    return {
        "settings": {**asdict(settings), "exp3_eta": first.exp3_eta, "exp4_eta": first.exp4_eta},
        "eta_rule": {"exp3": "sqrt(2 ln K / (K T))", "exp4": "sqrt(8 ln K / T)"},
        "forgetting_mechanisms": {name: asdict(FORGETTING[name]) for name in settings.forgetting},
        "models": {name: {"framework": framework, "stream_error": float(first.clean_error[i])}
                   for i, (name, framework) in enumerate(models.items())},
        "failing_models": sorted({seed["failing_model"] for seed in seeds}),
        "failure_mode": FAILURE_MODE,
        "summary": summary,
        "bars": {mechanism: bars(seeds, mechanism, settings) for mechanism in settings.forgetting},
        "seeds": seeds,
        "series": series,
    }


# ---- the real models ----------------------------------------------------------------------------------------
# torch, the zoo (which imports transformers) and scikit-learn are imported where they are used, so the pure
# replay above stays quick to import for tests.

def cnn_logits(name: str, images: np.ndarray, batch_size: int) -> np.ndarray:
    """The zoo model's logits (N, classes) for each uint8 image (N, 28, 28)."""
    import torch

    from rampserve.zoo.registry import get_entry, load_trained

    entry, model = get_entry(name), load_trained(name)
    batches = []
    with torch.no_grad(), tqdm(total=len(images), desc=name, unit="image") as bar:
        for first in range(0, len(images), batch_size):
            feeds = entry.encode(images[first:first + batch_size])
            batches.append(model(*(torch.from_numpy(feeds[key]) for key in entry.input_names)).numpy())
            bar.update(len(batches[-1]))
    return np.concatenate(batches)


def cnn_predictions(name: str, images: np.ndarray, batch_size: int) -> np.ndarray:
    """The zoo model's top label for each uint8 image (N, 28, 28)."""
    return cnn_logits(name, images, batch_size).argmax(axis=1).astype(np.int64)


def sklearn_estimator(name: str) -> BaseEstimator:
    """The untrained estimator of SKLEARN_MODELS named `name`."""
    estimator, parameters = SKLEARN_MODELS[name]
    module, kind = estimator.rsplit(".", 1)
    return getattr(importlib.import_module(f"sklearn.{module}"), kind)(**parameters)


def sklearn_predictions(name: str, images: np.ndarray) -> np.ndarray:
    """A scikit-learn model of SKLEARN_MODELS on pixels scaled to [0, 1], trained on the Fashion-MNIST training
    set."""
    model = sklearn_estimator(name)
    train_images, train_labels = load_fashion_mnist("train")
    model.fit(train_images.reshape(len(train_images), -1) / 255.0, train_labels)
    return model.predict(images.reshape(len(images), -1) / 255.0).astype(np.int64)


def replay_seeds(predictions: np.ndarray, labels: np.ndarray, settings: SelectionSettings) -> list[Replay]:
    """The experiment once per seed: `predictions` (models, images) and `labels` (images) in test-set order."""
    results = []
    for seed in tqdm(settings.seeds, desc="seeds", unit="seed"):
        order = stream_order(len(labels), settings.queries, seed)
        results.append(replay(predictions[:, order], labels[order], len(CLASSES), settings, seed))
    return results


def model_predictions(settings: SelectionSettings, images: np.ndarray, saved: Path | None,
                      progress: Callable[[str], None]) -> np.ndarray:
    """Each model's label for each test image (models, images), in the order CNNs then scikit-learn models. With
    `saved` (.npz, one array per model), the models found there are not run again, and the file is rewritten
    with all of them: predictions are plain integer arrays, so a rerun of the replay costs seconds, not the
    minutes of training."""
    known: dict[str, np.ndarray] = {}
    if saved is not None and saved.exists():
        with np.load(saved, allow_pickle=False) as stored:
            known = {name: stored[name] for name in stored.files}
        progress(f"reusing the predictions of {', '.join(sorted(known))} from {saved}")
    for name in settings.cnns:
        if name not in known:
            progress(f"predicting the {len(images)} Fashion-MNIST test images with {name}")
            known[name] = cnn_predictions(name, images, settings.batch_size)
    for name in settings.sklearn:
        if name not in known:
            progress(f"training {name} ({SKLEARN_MODELS[name][0]}) on the 60,000 training images")
            known[name] = sklearn_predictions(name, images)
    if saved is not None:
        np.savez(saved, **known)
    rows = np.stack([known[name] for name in settings.cnns + settings.sklearn])
    if rows.shape[1] != len(images):
        raise ValueError(f"{saved} holds predictions for {rows.shape[1]} images, not the {len(images)} test images")
    return rows


def run_selection(settings: SelectionSettings, progress: Callable[[str], None] = lambda _: None,
                  saved_predictions: Path | None = None) -> dict:
    images, labels = load_fashion_mnist("test")
    predictions = model_predictions(settings, images, saved_predictions, progress)
    models = {**{name: "pytorch" for name in settings.cnns}, **{name: "scikit-learn" for name in settings.sklearn}}
    progress(f"replaying {settings.queries} queries through Exp3 and Exp4 with {', '.join(settings.forgetting)} "
             f"forgetting, {len(settings.seeds)} seeds")
    return {**build_report(models, replay_seeds(predictions, labels, settings), settings),
            "sklearn_models": {name: {"estimator": SKLEARN_MODELS[name][0], **SKLEARN_MODELS[name][1],
                                      "inputs": "pixels / 255"} for name in settings.sklearn}}


# ---- tables -------------------------------------------------------------------------------------------------

def _count(value: int | float | None) -> str:
    return "never" if value is None else f"{value:.0f}"


def _with_spread(figure: dict, form: Callable[[float | None], str]) -> str:
    return escape(f"{form(figure['median'])} [{form(figure['min'])}, {form(figure['max'])}]")


def _error(value: float | None) -> str:
    return f"{value:.4f}"


def _policy_label(report: dict, mechanism: str, bandit: str) -> str:
    eta = report["settings"][f"{bandit}_eta"]
    return f"{bandit.capitalize()} (eta {eta:.4f}), {mechanism}"


def summary_table(report: dict) -> Table:
    s, summary = report["settings"], report["summary"]
    table = Table(title=escape(f"model selection over {s['queries']} Fashion-MNIST test queries: "
                               f"{', '.join(report['failing_models'])} fails on [{s['failure_start']}, "
                               f"{s['failure_end']}) ({report['failure_mode']}); median [min, max] over seeds "
                               f"{list(s['seeds'])}"),
                  caption=f"dropped: queries from the failure's start until the policy gives the failing model a "
                          f"probability under {DROPPED_WEIGHT}. Regained: queries from the failure's end until it "
                          f"gives it {s['regain_share']:g} of its mean weight over the {s['recovery_window']} queries "
                          "before the failure. Failing weight: that model's mean probability before (those "
                          f"{s['recovery_window']} queries) / during / after the failure (medians).")
    for col in ("policy", "before", "during the failure", "after", "dropped", "regained", "failing weight"):
        table.add_column(col, justify="left" if col == "policy" else "right")
    for mechanism, bandits in summary["forgetting"].items():
        for bandit, p in bandits.items():
            weight = " / ".join(f"{p['failing_weight_' + part]['median']:.2g}" for part in ("before", "during", "after"))
            table.add_row(_policy_label(report, mechanism, bandit), _with_spread(p["error_before"], _error),
                          _with_spread(p["error_during"], _error), _with_spread(p["error_after"], _error),
                          _with_spread(p["dropped_after"], _count), _with_spread(p["regained_after"], _count), weight)
    best = summary["best_static"]
    table.add_row("best static model in hindsight", _with_spread(best["error_before"], _error),
                  _with_spread(best["error_during"], _error), _with_spread(best["error_after"], _error), "", "", "")
    table.add_row("best model over the failure", "", _with_spread(summary["best_over_failure"]["error_during"], _error),
                  "", "", "", "")
    return table


def seeds_table(report: dict) -> Table:
    table = Table(title="per seed: error over the failure against the best static model's, queries until the failed "
                        "model regains its weight, error after the failure against before it")
    for col in ("seed", "policy", "during", "best static (model)", "regained", "before", "after"):
        table.add_column(col, justify="left" if col in ("policy", "best static (model)") else "right")
    for seed in report["seeds"]:
        best = seed["best_static"]
        for mechanism, bandits in seed["forgetting"].items():
            for bandit, p in bandits.items():
                table.add_row(str(seed["seed"]), _policy_label(report, mechanism, bandit), _error(p["error_during"]),
                              f"{best['error_during']:.4f} ({best['model']})", _count(p["regained_after"]),
                              _error(p["error_before"]), _error(p["error_after"]))
    return table


def bars_table(report: dict) -> Table:
    s = report["settings"]
    table = Table(title=escape("the issue's bars, median [min, max] over seeds"),
                  caption=f"below static: error over the failure minus the best static model's (< 0). Regained: "
                          f"within {s['regain_within']} queries. No worse: error over queries {s['failure_end']}-"
                          f"{s['queries']} minus over 0-{s['failure_start']} (<= 0).")
    for col in ("policy", "below static", "met", "regained", "met", "no worse", "met"):
        table.add_column(col, justify="left" if col == "policy" else "right")
    signed = "{:+.4f}".format
    for mechanism, bandits in report["bars"].items():
        for bandit, b in bandits.items():
            cells = []
            for key, form in (("during_minus_best_static", signed), ("regained_after", _count),
                              ("after_minus_before", signed)):
                cells += [_with_spread(b[key], form), "yes" if b[key]["met"] else "no"]
            table.add_row(_policy_label(report, mechanism, bandit), *cells)
    return table


def selection_tables(report: dict) -> list[Table]:
    return [summary_table(report), seeds_table(report), bars_table(report)]
