"""Deciders of a speculative race (seed 004): a request fans out to several models, and a decider picks the
answer from those that have arrived.

A decider is any callable `(arrived, expected, final) -> Decision | None`. It is asked after every arrival
(`final=False`; it may decide at once, as `first` does, or wait) and once more when every model has answered or
the timeout has passed (`final=True`; None then means no answer can be given, and the application answers with
its default output). Pure functions: the race's clock and tasks live in serving.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
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


BUILTIN_DECIDERS: dict[str, Decider] = {
    "first": first,
    "consensus": consensus,
    "best_confidence": best_confidence,
    "confidence_weighted": confidence_weighted,
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
