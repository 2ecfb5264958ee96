"""Clipper's model selection policies (seed 003, §5): Exp3 picks one model per query, Exp4 weighs an ensemble.
Both learn from feedback, one query at a time. Pure functions over a small state that serialises to JSON, so a
store (memory, Redis) can keep it per context (application, user or session).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Weights are renormalised to sum to 1 after each update: exp(-eta * L / p) can underflow a model's weight to
# 0 within a few hundred updates, and a zero weight could never recover once that model improves.
MIN_WEIGHT = 1e-6


@dataclass
class SelectionState:
    models: tuple[str, ...]
    weights: np.ndarray  # (models,) positive, summing to 1
    updates: int = 0

    @classmethod
    def uniform(cls, models: tuple[str, ...]) -> SelectionState:
        if not models:
            raise ValueError("a selection policy needs at least one model")
        return cls(tuple(models), np.full(len(models), 1.0 / len(models)))

    def probabilities(self) -> np.ndarray:
        return self.weights / self.weights.sum()

    def to_json(self) -> dict:
        return {"models": list(self.models), "weights": self.weights.tolist(), "updates": self.updates}

    @classmethod
    def from_json(cls, data: dict) -> SelectionState:
        weights = np.asarray(data["weights"], dtype=np.float64)
        if len(weights) != len(data["models"]) or not np.all(weights > 0):
            raise ValueError("selection state: one positive weight per model is required")
        return cls(tuple(data["models"]), weights, int(data.get("updates", 0)))


def _normalised(weights: np.ndarray) -> np.ndarray:
    """Weights summing to 1 with none below MIN_WEIGHT. Floored weights sit exactly at the floor (the others
    give up that mass), so the floor is a fixed point: an update never moves a model it did not observe."""
    weights = weights / weights.sum()
    low = weights < MIN_WEIGHT
    if low.any():
        weights[~low] *= (1.0 - MIN_WEIGHT * low.sum()) / weights[~low].sum()
        weights[low] = MIN_WEIGHT
    return weights


def exp3_choose(state: SelectionState, uniform: float) -> int:
    """The model to ask, drawn with probability s_i / sum(s); `uniform` is a draw from [0, 1)."""
    return int(min(np.searchsorted(np.cumsum(state.probabilities()), uniform, side="right"), len(state.models) - 1))


def exp3_update(state: SelectionState, chosen: int, loss: float, eta: float) -> SelectionState:
    """s_i <- s_i * exp(-eta * loss / p_i) for the chosen model only (the others were not observed)."""
    if not 0.0 <= loss <= 1.0:
        raise ValueError(f"loss must lie in [0, 1], got {loss}")
    weights = state.weights.copy()
    weights[chosen] *= np.exp(-eta * loss / state.probabilities()[chosen])
    return SelectionState(state.models, _normalised(weights), state.updates + 1)


def exp4_votes(state: SelectionState, predictions: np.ndarray, num_classes: int) -> np.ndarray:
    """Each label's vote: the share of the total weight held by the models that predict it, from the labels of
    the models that answered (-1: no answer yet, as at a deadline), so missing models lower every vote."""
    predictions = np.asarray(predictions, dtype=np.int64)
    answered = predictions >= 0
    if not answered.any():
        raise ValueError("no model has answered")
    return np.bincount(predictions[answered], weights=state.probabilities()[answered], minlength=num_classes)


def exp4_combine(state: SelectionState, predictions: np.ndarray, num_classes: int) -> tuple[int, float]:
    """The ensemble's label and confidence: the label with the largest vote (`exp4_votes`), and that vote."""
    votes = exp4_votes(state, predictions, num_classes)
    label = int(votes.argmax())
    return label, float(votes[label])


def exp4_update(state: SelectionState, losses: np.ndarray, eta: float) -> SelectionState:
    """s_i <- s_i * exp(-eta * L_i) for every model whose loss is known (NaN: it did not answer)."""
    losses = np.asarray(losses, dtype=np.float64)
    known = ~np.isnan(losses)
    if np.any((losses[known] < 0) | (losses[known] > 1)):
        raise ValueError("losses must lie in [0, 1]")
    weights = state.weights.copy()
    weights[known] *= np.exp(-eta * losses[known])
    return SelectionState(state.models, _normalised(weights), state.updates + 1)
