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
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np
from rich.table import Table

from rampserve.control.selection import SelectionState, exp3_choose, exp3_update, exp4_combine, exp4_update
from rampserve.workloads.fashion_mnist import CLASSES, load_fashion_mnist

CNNS = ("resnet18-fmnist", "resnet50-fmnist", "vgg11-fmnist", "vgg16-fmnist")
SKLEARN_MODEL = "logreg-pixels"
# Logistic regression's regularisation: C=0.1 converges within lbfgs' iteration limit on the 60,000 training
# images (C=1 does not in 300 iterations) at the same test accuracy (0.846 against 0.844).
SKLEARN_C = 0.1
SKLEARN_MAX_ITER = 1000
FAILURE_MODE = "uniformly random wrong label"
QUERY_COUNTS = ("dropped_after", "recovered_after")
# A policy has dropped the failing model once it gives it less than this probability: Exp3 then sends it fewer
# than one query in a hundred, and Exp4's vote can follow it only where the others are split.
DROPPED_WEIGHT = 0.01


@dataclass(frozen=True)
class SelectionSettings:
    cnns: tuple[str, ...] = CNNS
    queries: int = 20_000
    failure_start: int = 5_000
    failure_end: int = 10_000
    exp3_eta: float | None = None  # None: Exp3's rate for this horizon and number of models (`exp3_rate`)
    exp4_eta: float | None = None  # None: Hedge's rate for this horizon and number of models (`exp4_rate`)
    exp3_seeds: tuple[int, ...] = (0, 1, 2, 3, 4)  # Exp3 draws at random: its figures are medians over seeds
    seed: int = 0  # the stream's order and the failing model's wrong labels
    series_window: int = 250  # queries per point of the error-over-time series
    # A policy has recovered once the error over the next `recovery_window` queries after the failure is within
    # `recovery_margin` of its error over the `recovery_window` queries before the failure. 1,000 queries
    # measure an error near 0.09 to a standard error of 0.009, so a 0.02 margin is about two of them.
    recovery_window: int = 1000
    recovery_margin: float = 0.02
    batch_size: int = 500  # CNN inference

    def __post_init__(self) -> None:
        if not 0 < self.recovery_window <= self.failure_start < self.failure_end < self.queries:
            raise ValueError("need 0 < recovery_window <= failure_start < failure_end < queries, got "
                             f"{self.recovery_window}, {self.failure_start}, {self.failure_end}, {self.queries}")
        if not self.exp3_seeds:
            raise ValueError("Exp3 needs at least one seed")
        if self.series_window <= 0:
            raise ValueError("series_window must be positive")


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


def replay_exp3(predictions: np.ndarray, labels: np.ndarray, eta: float, seed: int) -> PolicyRun:
    models, queries = predictions.shape
    state = SelectionState.uniform(tuple(map(str, range(models))))
    draws = np.random.default_rng(seed).random(queries)
    answers = np.empty(queries, dtype=np.int64)
    probabilities = np.empty((queries, models))
    for t in range(queries):
        probabilities[t] = state.probabilities()
        chosen = exp3_choose(state, draws[t])
        answers[t] = predictions[chosen, t]
        state = exp3_update(state, chosen, float(answers[t] != labels[t]), eta)
    return PolicyRun(answers, probabilities)


def replay_exp4(predictions: np.ndarray, labels: np.ndarray, num_classes: int, eta: float) -> PolicyRun:
    models, queries = predictions.shape
    state = SelectionState.uniform(tuple(map(str, range(models))))
    answers = np.empty(queries, dtype=np.int64)
    probabilities = np.empty((queries, models))
    for t in range(queries):
        probabilities[t] = state.probabilities()
        answers[t], _ = exp4_combine(state, predictions[:, t], num_classes)
        state = exp4_update(state, (predictions[:, t] != labels[t]).astype(np.float64), eta)
    return PolicyRun(answers, probabilities)


@dataclass
class Replay:
    predictions: np.ndarray  # (models, queries) with the failure injected
    labels: np.ndarray  # (queries,)
    clean_error: np.ndarray  # (models,) each model's error on the stream without the failure
    failing: int  # the model that fails
    exp3_eta: float
    exp4_eta: float
    exp3: list[PolicyRun]  # one per seed of `SelectionSettings.exp3_seeds`
    exp4: PolicyRun


def replay(predictions: np.ndarray, labels: np.ndarray, num_classes: int, settings: SelectionSettings) -> Replay:
    """Fail the best model, then replay the stream through Exp3 (once per seed) and Exp4."""
    if predictions.shape[1] != len(labels) or len(labels) != settings.queries:
        raise ValueError(f"predictions {predictions.shape} and labels {labels.shape} do not match "
                         f"{settings.queries} queries")
    models = len(predictions)
    clean_error = (predictions != labels).mean(axis=1)
    failing = int(clean_error.argmin())
    failed = inject_failure(predictions, labels, failing, settings.failure_start, settings.failure_end,
                            num_classes, settings.seed)
    exp3_eta = exp3_rate(models, settings.queries) if settings.exp3_eta is None else settings.exp3_eta
    exp4_eta = exp4_rate(models, settings.queries) if settings.exp4_eta is None else settings.exp4_eta
    return Replay(failed, labels, clean_error, failing, exp3_eta, exp4_eta,
                  [replay_exp3(failed, labels, exp3_eta, seed) for seed in settings.exp3_seeds],
                  replay_exp4(failed, labels, num_classes, exp4_eta))


def first_within(wrong: np.ndarray, start: int, stop: int, window: int, limit: float) -> int | None:
    """Queries from `start` until the error over the next `window` queries, all before `stop`, is at most
    `limit`; None if it never is."""
    counts = np.cumsum(np.concatenate([[0], wrong[start:stop].astype(np.int64)]))
    rates = (counts[window:] - counts[:-window]) / window
    hits = np.flatnonzero(rates <= limit)
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
    """Error figures; how many queries into the failure the policy drops the failing model; and that model's
    mean probability (Exp3: its expected share of queries; Exp4: its share of the vote) before, during and after
    the failure: after it, whether the policy forgives the model once it works again."""
    start, end = settings.failure_start, settings.failure_end
    weight = run.probabilities[:, failing]
    dropped = np.flatnonzero(weight[start:end] < DROPPED_WEIGHT)
    return {**error_figures(run.answers != labels, settings),
            "dropped_after": int(dropped[0]) if len(dropped) else None,
            "failing_weight_before": float(weight[:start].mean()),
            "failing_weight_during": float(weight[start:end].mean()),
            "failing_weight_after": float(weight[end:].mean())}


def _median_figures(runs: list[dict]) -> dict:
    """Per figure, the median over runs; a run that never dropped or recovered counts as the slowest."""
    median = {}
    for key in runs[0]:
        value = float(np.median([math.inf if run[key] is None else run[key] for run in runs]))
        median[key] = None if math.isinf(value) else int(value) if key in QUERY_COUNTS else value
    return median


def bucket_means(values: np.ndarray, window: int) -> np.ndarray:
    """Means over consecutive buckets of `window` values (the last one may be shorter)."""
    starts = np.arange(0, len(values), window)
    return np.add.reduceat(values.astype(np.float64), starts) / np.diff(np.append(starts, len(values)))


def build_report(models: dict[str, str], result: Replay, settings: SelectionSettings) -> dict:
    """`models` maps each row of the predictions, in order, to its framework."""
    names = tuple(models)
    labels, failing, window = result.labels, result.failing, settings.series_window
    wrong = result.predictions != labels
    hindsight = int(wrong.mean(axis=1).argmin())
    exp3_runs = [bandit_figures(run, labels, failing, settings) for run in result.exp3]
    policies = {
        "exp3": {**_median_figures(exp3_runs), "seeds": exp3_runs},
        "exp4": bandit_figures(result.exp4, labels, failing, settings),
        "best_in_hindsight": {**error_figures(wrong[hindsight], settings), "model": names[hindsight]},
        **{name: error_figures(wrong[i], settings) for i, name in enumerate(names)},
    }
    exp3_errors = np.stack([bucket_means(run.answers != labels, window) for run in result.exp3])
    exp3_weights = np.stack([bucket_means(run.probabilities[:, failing], window) for run in result.exp3])
    return {
        "settings": {**asdict(settings), "exp3_eta": result.exp3_eta, "exp4_eta": result.exp4_eta},
        "eta_rule": {"exp3": "sqrt(2 ln K / (K T))", "exp4": "sqrt(8 ln K / T)"},
        "models": {name: {"framework": framework, "stream_error": float(result.clean_error[i])}
                   for i, (name, framework) in enumerate(models.items())},
        "failing_model": names[failing],
        "failure_mode": FAILURE_MODE,
        "policies": policies,
        "series": {
            "window": window,
            "starts": list(range(0, settings.queries, window)),
            # Exp3's per-bucket figures are medians over its seeds, as in the table.
            "error": {"exp3": np.median(exp3_errors, axis=0).tolist(),
                      "exp4": bucket_means(result.exp4.answers != labels, window).tolist(),
                      **{name: bucket_means(wrong[i], window).tolist() for i, name in enumerate(names)}},
            "failing_weight": {"exp3": np.median(exp3_weights, axis=0).tolist(),
                               "exp4": bucket_means(result.exp4.probabilities[:, failing], window).tolist()},
        },
    }


# ---- the real models ----------------------------------------------------------------------------------------
# torch, the zoo (which imports transformers) and scikit-learn are imported where they are used, so the pure
# replay above stays quick to import for tests.

def cnn_predictions(name: str, images: np.ndarray, batch_size: int) -> np.ndarray:
    """The zoo model's top label for each uint8 image (N, 28, 28)."""
    import torch
    from tqdm.auto import tqdm

    from rampserve.zoo.registry import get_entry, load_trained

    entry, model = get_entry(name), load_trained(name)
    labels = np.empty(len(images), dtype=np.int64)
    with torch.no_grad(), tqdm(total=len(images), desc=name, unit="image") as bar:
        for first in range(0, len(images), batch_size):
            feeds = entry.encode(images[first:first + batch_size])
            logits = model(*(torch.from_numpy(feeds[key]) for key in entry.input_names))
            labels[first:first + len(logits)] = logits.argmax(dim=1).numpy()
            bar.update(len(logits))
    return labels


def sklearn_predictions(images: np.ndarray) -> np.ndarray:
    """A logistic regression on pixels scaled to [0, 1], trained on the Fashion-MNIST training set."""
    from sklearn.linear_model import LogisticRegression

    train_images, train_labels = load_fashion_mnist("train")
    model = LogisticRegression(C=SKLEARN_C, max_iter=SKLEARN_MAX_ITER)
    model.fit(train_images.reshape(len(train_images), -1) / 255.0, train_labels)
    return model.predict(images.reshape(len(images), -1) / 255.0).astype(np.int64)


def run_selection(settings: SelectionSettings, progress: Callable[[str], None] = lambda _: None) -> dict:
    images, labels = load_fashion_mnist("test")
    progress(f"predicting the {len(images)} Fashion-MNIST test images with {', '.join(settings.cnns)}")
    rows = [cnn_predictions(name, images, settings.batch_size) for name in settings.cnns]
    progress("training a scikit-learn logistic regression on the 60,000 training images")
    rows.append(sklearn_predictions(images))
    models = {**{name: "pytorch" for name in settings.cnns}, SKLEARN_MODEL: "scikit-learn"}
    order = stream_order(len(images), settings.queries, settings.seed)
    progress(f"replaying {settings.queries} queries through Exp3 ({len(settings.exp3_seeds)} seeds) and Exp4")
    result = replay(np.stack(rows)[:, order], labels[order], len(CLASSES), settings)
    return {**build_report(models, result, settings),
            "sklearn_model": {"estimator": "LogisticRegression", "C": SKLEARN_C, "max_iter": SKLEARN_MAX_ITER,
                              "inputs": "pixels / 255"}}


def _after(value: int | None) -> str:
    return "never" if value is None else str(value)


def selection_table(report: dict) -> Table:
    s = report["settings"]
    table = Table(title=f"model selection over {s['queries']} Fashion-MNIST test queries: {report['failing_model']} "
                        f"fails on [{s['failure_start']}, {s['failure_end']}) ({report['failure_mode']})",
                  caption=f"dropped after: queries from the failure's start until the policy gives the failing model "
                          f"a probability under {DROPPED_WEIGHT}. Recovered after: queries from the failure's end "
                          f"until the error over the next {s['recovery_window']} is within {s['recovery_margin']} "
                          f"of the error over the {s['recovery_window']} before the failure. Failing weight: the "
                          "failing model's mean probability before / during / after the failure.")
    for col in ("policy", "error", "before", "during", "after", "dropped failing after", "recovered after",
                "failing weight"):
        table.add_column(col, justify="left" if col == "policy" else "right")
    policies = report["policies"]
    labels = {
        "exp3": f"Exp3 (eta {s['exp3_eta']:.4f}, median of {len(s['exp3_seeds'])} seeds)",
        "exp4": f"Exp4 (eta {s['exp4_eta']:.4f})",
        "best_in_hindsight": f"best single in hindsight ({policies['best_in_hindsight']['model']})",
        **{name: f"{name} ({m['framework']}{', fails' if name == report['failing_model'] else ''})"
           for name, m in report["models"].items()},
    }
    for key, label in labels.items():
        p = policies[key]
        dropped, weight = "", ""  # bandits only
        if "dropped_after" in p:
            dropped = _after(p["dropped_after"])
            weight = " / ".join(f"{p['failing_weight_' + part]:.2g}" for part in ("before", "during", "after"))
        table.add_row(label, f"{p['error']:.4f}", f"{p['error_before']:.4f}", f"{p['error_during']:.4f}",
                      f"{p['error_after']:.4f}", dropped, _after(p["recovered_after"]), weight)
    return table
