"""Deciders of a speculative race (seed 004): a request fans out to several models, and a decider picks the
answer from those that have arrived.

A decider is any callable `(arrived, expected, final) -> Decision | None`. It is asked after every arrival
(`final=False`; it may decide at once, as `first` does, or wait) and once more when every model has answered or
the timeout has passed (`final=True`; None then means no answer can be given, and the application answers with
its default output). Pure functions: the race's clock and tasks live in serving.

`learned` also takes what feedback has shown of each model (`Trust`, a small JSON-serialisable record that the
application keeps in its state store and changes with `learn` on every feedback): it weighs each answer by how
often that model's answers at that confidence have been right.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial

import numpy as np


@dataclass(frozen=True)
class Candidate:
    """One model's answer, in order of arrival."""

    model: str
    label: int
    confidence: float  # in [0, 1]
    latency_ms: float


@dataclass(frozen=True)
class Decision:
    label: int
    confidence: float
    models: tuple[str, ...]  # the models whose answers carried the decision


Decider = Callable[[Sequence[Candidate], int, bool], "Decision | None"]


def first(arrived: Sequence[Candidate], expected: int, final: bool) -> Decision | None:
    """The first answer to arrive: the fastest model decides."""
    if not arrived:
        return None
    winner = arrived[0]
    return Decision(winner.label, winner.confidence, (winner.model,))


def _votes(arrived: Sequence[Candidate], weights: np.ndarray) -> tuple[int, float]:
    labels = np.array([c.label for c in arrived])
    totals = np.bincount(labels, weights=weights)
    totals[np.bincount(labels) == 0] = -np.inf  # a label no model gave never wins, even over zero confidence
    label = int(totals.argmax())  # ties go to the smallest label, deterministically
    return label, float(totals[label])


def _backers(arrived: Sequence[Candidate], label: int) -> tuple[str, ...]:
    return tuple(c.model for c in arrived if c.label == label)


def consensus(arrived: Sequence[Candidate], expected: int, final: bool, quorum: int | None = None) -> Decision | None:
    """The label `quorum` models agree on (default: a majority of the models asked), as soon as they do. When
    the race ends without a quorum there is no consensus, and no answer. Confidence is the agreeing share of
    the models asked."""
    need = expected // 2 + 1 if quorum is None else quorum
    if not arrived:
        return None
    label, votes = _votes(arrived, np.ones(len(arrived)))
    if votes >= need:
        return Decision(label, votes / expected, _backers(arrived, label))
    return None


def best_confidence(arrived: Sequence[Candidate], expected: int, final: bool,
                    enough: float | None = None) -> Decision | None:
    """The most confident answer once all have arrived or time is up; at once if one reaches `enough`."""
    if not arrived:
        return None
    best = max(arrived, key=lambda c: c.confidence)
    if final or (enough is not None and best.confidence >= enough):
        return Decision(best.label, best.confidence, (best.model,))
    return None


def confidence_weighted(arrived: Sequence[Candidate], expected: int, final: bool) -> Decision | None:
    """Each label scores the summed confidence of the models that gave it, once all have arrived or time is
    up; the confidence is that score over the models asked, so missing models lower it."""
    if not arrived or not final:
        return None
    label, score = _votes(arrived, np.array([c.confidence for c in arrived]))
    return Decision(label, score / expected, _backers(arrived, label))


# --- the learned decider -----------------------------------------------------------------------------------------

# Upper edges of the confidence buckets in which the learned decider counts each model's right and wrong answers.
# A softmax's top probability crowds near 1, where the models are right most often, so the buckets are finer there.
CONFIDENCE_EDGES = (0.5, 0.7, 0.8, 0.9, 0.95, 0.98, 0.99, 0.995, 0.999)
# Before any feedback every answer is taken to be right this often. Above 1/2, so that every answer's weight is
# positive and the vote is a plain majority.
PRIOR_ACCURACY = 0.75
# Pseudo-answers behind each estimate: a (model, bucket) count leans on the bucket's count over all models, that
# one on the count over all answers, that one on PRIOR_ACCURACY, until it holds several times this many answers.
SHRINK = 4.0
# Feedback after which an answer counts e^-1 of a fresh one: a model whose answers turn bad loses its trust within
# a few hundred queries, where counts that never fade would take as long as the model has been good.
TRUST_HORIZON = 2000.0


@dataclass(frozen=True)
class Trust:
    """What feedback has shown of each model's answers, by confidence bucket (`CONFIDENCE_EDGES`): how many were
    scored and how many were right, both faded by 1 - 1/TRUST_HORIZON per feedback."""

    models: tuple[str, ...]
    scored: np.ndarray  # (models, buckets)
    right: np.ndarray  # (models, buckets), <= scored
    classes: int = 2  # 1 + the largest label seen in feedback: how many labels a wrong answer may spread over
    updates: int = 0

    @classmethod
    def fresh(cls, models: Sequence[str]) -> Trust:
        shape = (len(models), len(CONFIDENCE_EDGES) + 1)
        return cls(tuple(models), np.zeros(shape), np.zeros(shape))

    def over(self, models: Sequence[str]) -> Trust:
        """The same counts over `models`: a model not seen before starts with none, one no longer listed is
        dropped."""
        if tuple(models) == self.models:
            return self
        fresh = Trust.fresh(models)
        index = {m: i for i, m in enumerate(self.models)}
        for row, model in enumerate(fresh.models):
            if model in index:
                fresh.scored[row] = self.scored[index[model]]
                fresh.right[row] = self.right[index[model]]
        return Trust(fresh.models, fresh.scored, fresh.right, self.classes, self.updates)

    def accuracies(self) -> tuple[np.ndarray, np.ndarray]:
        """(per model and bucket, per bucket over all models): how often an answer is right, each count shrunk
        toward the one above it (all answers, then a bucket's over all models, then one model's in that bucket),
        so a sparse bucket leans on its pool and, before any feedback, every answer is worth the same."""
        overall = (self.right.sum() + SHRINK * PRIOR_ACCURACY) / (self.scored.sum() + SHRINK)
        pooled = (self.right.sum(axis=0) + SHRINK * overall) / (self.scored.sum(axis=0) + SHRINK)
        return (self.right + SHRINK * pooled) / (self.scored + SHRINK), pooled

    def weights(self) -> tuple[np.ndarray, np.ndarray]:
        """Each answer's vote for its label, as `accuracies`: its log-likelihood ratio when a right answer names
        the true label and a wrong one any of the other `classes - 1` alike (naive Bayes over the models)."""
        return tuple(np.log(p / (1.0 - p)) + np.log(self.classes - 1) for p in self.accuracies())

    def to_json(self) -> dict:
        return {"models": list(self.models), "scored": self.scored.tolist(), "right": self.right.tolist(),
                "classes": self.classes, "updates": self.updates}

    @classmethod
    def from_json(cls, data: dict) -> Trust:
        models = tuple(data["models"])
        problem = f"trust: {len(CONFIDENCE_EDGES) + 1} buckets per model, 0 <= right <= scored"
        try:
            shape = (len(models), len(CONFIDENCE_EDGES) + 1)
            scored = np.asarray(data["scored"], dtype=np.float64).reshape(shape)
            right = np.asarray(data["right"], dtype=np.float64).reshape(shape)
        except ValueError:
            raise ValueError(problem) from None
        if not np.all((right >= 0) & (right <= scored)):
            raise ValueError(problem)
        return cls(models, scored, right, int(data["classes"]), int(data["updates"]))


def confidence_bucket(confidence: float) -> int:
    return int(np.searchsorted(CONFIDENCE_EDGES, confidence, side="right"))


def learn(trust: Trust, answers: Mapping[str, tuple[int, float]], label: int) -> Trust:
    """Trust after the feedback that `label` was the true one, given each model's (label, confidence) on that
    query. Models the trust did not know are added; models with no answer only fade."""
    trust = trust.over(tuple(dict.fromkeys((*trust.models, *answers))))
    keep = 1.0 - 1.0 / TRUST_HORIZON
    scored, right = trust.scored * keep, trust.right * keep
    for model, (given, confidence) in answers.items():
        cell = trust.models.index(model), confidence_bucket(confidence)
        scored[cell] += 1.0
        right[cell] += given == label
    classes = max(trust.classes, label + 1, *(given + 1 for given, _ in answers.values()))
    return Trust(trust.models, scored, right, classes, trust.updates + 1)


def learned(arrived: Sequence[Candidate], expected: int, final: bool, trust: Trust | None = None) -> Decision | None:
    """A vote in which each answer weighs what feedback has shown of its model at its confidence (`Trust.weights`);
    with no feedback yet, a plain majority. Ties go to the label whose backers are the more confident in sum,
    then to the one given first. Models that have not answered are left out, as naive Bayes leaves out what it
    did not see, so a late or failed model costs the race its evidence and nothing else. It decides before the
    end once the models still out could not change the winner, whatever they answer; its confidence is the
    winner's posterior under the same model."""
    if not arrived:
        return None
    trust = Trust.fresh(()) if trust is None else trust
    own, pooled = trust.weights()
    index = {m: i for i, m in enumerate(trust.models)}
    weights = np.array([own[index[c.model]] if c.model in index else pooled for c in arrived])
    weights = weights[np.arange(len(arrived)), [confidence_bucket(c.confidence) for c in arrived]]
    labels = np.array([c.label for c in arrived])
    given = list(dict.fromkeys(labels.tolist()))  # in order of first arrival
    scores = np.array([weights[labels == label].sum() for label in given])
    backing = np.array([sum(c.confidence for c in arrived if c.label == label) for label in given])
    order = sorted(range(len(given)), key=lambda k: (-scores[k], -backing[k], k))
    winner = order[0]
    outstanding = expected - len(arrived)
    if not final and outstanding > 0:
        answered = {c.model for c in arrived}
        largest = sorted((np.abs(own[i]).max() for m, i in index.items() if m not in answered), reverse=True)
        largest += [np.abs(pooled).max()] * max(0, outstanding - len(largest))
        runner_up = max(scores[order[1]] if len(order) > 1 else 0.0, 0.0)  # one still out may name a new label
        if scores[winner] - runner_up <= sum(largest[:outstanding]):
            return None
    classes = max(trust.classes, int(labels.max()) + 1)
    evidence = np.logaddexp.reduce(scores)
    if classes > len(given):  # the labels no model gave each keep their prior share
        evidence = np.logaddexp(evidence, np.log(classes - len(given)))
    label = given[winner]
    return Decision(label, float(np.exp(scores[winner] - evidence)), _backers(arrived, label))


BUILTIN_DECIDERS: dict[str, Decider] = {
    "first": first,
    "consensus": consensus,
    "best_confidence": best_confidence,
    "confidence_weighted": confidence_weighted,
    "learned": learned,
}


def make_decider(name: str, quorum: int | None = None, enough: float | None = None) -> Decider:
    """A built-in decider by name, or a user's as `package.module:function`."""
    if name == "consensus":
        return partial(consensus, quorum=quorum)
    if name == "best_confidence":
        return partial(best_confidence, enough=enough)
    if name in BUILTIN_DECIDERS:
        return BUILTIN_DECIDERS[name]
    module_name, _, attribute = name.partition(":")
    if not module_name or not attribute:
        raise ValueError(f"unknown decider {name!r}: use one of {sorted(BUILTIN_DECIDERS)} or 'module:function'")
    try:
        decider = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"decider {name!r} cannot be loaded: {exc}") from None
    if not callable(decider):
        raise ValueError(f"decider {name!r} is not callable")
    return decider
