"""Clipper's model selection policies (seed 003, §5): Exp3 picks one model per query, Exp4 weighs an ensemble.
Both learn from feedback, one query at a time. Pure functions over a small state that serialises to JSON, so a
store (memory, Redis) can keep it per context (application, user or session).

Exponential weights remember everything: a model that failed for a while sinks so far below the others that
the little it gains per query once it works again (its lead over them, often a fraction of a point of error)
would take tens of thousands of queries to lift it back. So both policies keep a floor of exploration (no
weight falls below `Forgetting.floor`, so Exp3 still asks a dropped model now and then) and let old evidence
fade by a change detector: each model's observed losses are followed by a fast and a slow moving average, and a
model whose recent losses lie far below its long-run ones while the policy holds it below an equal share has
recovered from a failure and starts again at an equal share, as a model linked anew does. Exp4 also mixes in a
little fixed share (`Forgetting.share`), the other mechanism `bench selection` measured; docs/selection.md says
why each policy has the defaults it has.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Weights are renormalised to sum to 1 after each update and never fall below a floor: exp(-eta * L / p) can
# underflow a model's weight to 0 within a few hundred updates, and a zero weight could never recover.
MIN_WEIGHT = 1e-6
# The default exploration floor: Exp3 asks a dropped model at least once in 500 queries, so after a failure
# ends the detector sees two of its answers within about a thousand queries; that costs at most 0.2% of the
# queries while a model is broken. Exp4 asks every model anyway; a vote of 0.002 decides nothing.
EXPLORATION_FLOOR = 0.002
# The detector's moving averages of a model's own observed losses (0 before any observation): the recent one
# over about its last two answers, the long-run one over about its last sixteen.
RECENT_RATE = 0.5
LONG_RUN_RATE = 1.0 / 16.0
# How far the recent average must fall below the long-run one. After a failure (every answer wrong) two right
# answers in a row bring the recent average to 0.25 and the long-run one to 0.88, a gap of 0.63. A model that is
# merely bad rarely gets there: its long-run average must first stray above about 0.8 (tests/test_selection.py
# checks that a model wrong half the time is never taken back in 20,000 queries).
RECOVERY_GAP = 0.6


@dataclass(frozen=True)
class Forgetting:
    """How a policy keeps exploring and lets old evidence fade. `floor`: no model's weight falls below it.
    `share`: fixed share (Herbster and Warmuth 1998), after each update this fraction of the total weight is
    spread equally over the models (0: off). `detect`: the change detector of the module's docstring."""

    floor: float = EXPLORATION_FLOOR
    share: float = 0.0
    detect: bool = True

    def __post_init__(self) -> None:
        if not MIN_WEIGHT <= self.floor < 1.0:
            raise ValueError(f"floor must lie in [{MIN_WEIGHT}, 1), got {self.floor}")
        if not 0.0 <= self.share < 1.0:
            raise ValueError(f"share must lie in [0, 1), got {self.share}")


# Exponential weights as Clipper describes them, with only the numerical floor: what `bench selection` compares
# against.
REMEMBER_ALL = Forgetting(floor=MIN_WEIGHT, share=0.0, detect=False)
# The defaults, chosen on `bench selection` (docs/selection.md). Exp3 answers with the one model it draws, so
# any weight fixed share hands to a poor or broken model is error; Exp4 votes, where a little weight on every
# model costs almost nothing and keeps it from leaning on one model so hard that its failure carries the vote.
EXP3_FORGETTING = Forgetting()
EXP4_FORGETTING = Forgetting(share=0.001)


@dataclass
class SelectionState:
    models: tuple[str, ...]
    weights: np.ndarray  # (models,) positive, summing to 1
    updates: int = 0
    # The change detector's moving averages of each model's observed losses (None: zeros, no observation yet).
    recent_loss: np.ndarray | None = None
    long_run_loss: np.ndarray | None = None

    def __post_init__(self) -> None:
        zeros = np.zeros(len(self.models))
        self.recent_loss = zeros if self.recent_loss is None else self.recent_loss
        self.long_run_loss = zeros if self.long_run_loss is None else self.long_run_loss

    @classmethod
    def uniform(cls, models: tuple[str, ...]) -> SelectionState:
        if not models:
            raise ValueError("a selection policy needs at least one model")
        return cls(tuple(models), np.full(len(models), 1.0 / len(models)))

    def probabilities(self) -> np.ndarray:
        return self.weights / self.weights.sum()

    def over(self, models: tuple[str, ...]) -> SelectionState:
        """The state over `models`: the ones kept keep their weights and detector averages, a model added starts
        at the mean weight of the kept ones with no observations, a model removed is dropped."""
        if tuple(models) == self.models:
            return self
        index = {name: i for i, name in enumerate(self.models)}
        kept = [index[m] for m in models if m in index]
        mean = float(self.weights[kept].mean()) if kept else 1.0
        weights = np.array([self.weights[index[m]] if m in index else mean for m in models])

        def carried(values: np.ndarray) -> np.ndarray:
            return np.array([values[index[m]] if m in index else 0.0 for m in models])

        return SelectionState(tuple(models), weights / weights.sum(), self.updates, carried(self.recent_loss),
                              carried(self.long_run_loss))

    def to_json(self) -> dict:
        return {"models": list(self.models), "weights": self.weights.tolist(), "updates": self.updates,
                "recent_loss": self.recent_loss.tolist(), "long_run_loss": self.long_run_loss.tolist()}

    @classmethod
    def from_json(cls, data: dict) -> SelectionState:
        """A stored state, checked; one written before the detector existed (no loss averages) starts them at 0."""
        models = len(data["models"])
        weights = np.asarray(data["weights"], dtype=np.float64)
        if weights.shape != (models,) or not np.all(weights > 0):
            raise ValueError("selection state: one positive weight per model is required")
        averages = {}
        for name in ("recent_loss", "long_run_loss"):
            values = np.asarray(data.get(name, np.zeros(models)), dtype=np.float64)
            if values.shape != (models,) or not np.all((values >= 0) & (values <= 1)):
                raise ValueError(f"selection state: {name} needs one value in [0, 1] per model")
            averages[name] = values
        return cls(tuple(data["models"]), weights, int(data.get("updates", 0)), **averages)


def _normalised(weights: np.ndarray, floor: float) -> np.ndarray:
    """Weights summing to 1 with none below `floor`. Floored weights sit exactly at the floor (the others give
    up that mass), so the floor is a fixed point: an update never moves a model it did not observe there."""
    if floor * len(weights) >= 1.0:
        raise ValueError(f"a floor of {floor} leaves nothing to learn over {len(weights)} models")
    weights = weights / weights.sum()
    low = weights < floor
    # Giving the floored models their mass can push another model under the floor: repeat until none is.
    while low.any():
        kept = weights[~low] * (1.0 - floor * low.sum()) / weights[~low].sum()
        if (kept >= floor).all():
            weights[~low] = kept
            weights[low] = floor
            break
        low[np.flatnonzero(~low)[kept < floor]] = True
    return weights


def _learn(state: SelectionState, losses: np.ndarray, estimates: np.ndarray, eta: float,
           forgetting: Forgetting) -> SelectionState:
    """s_i <- s_i * exp(-eta * estimate_i), then fixed share and the change detector over the observed `losses`
    (NaN: not observed), then the floor."""
    models = len(state.models)
    weights = state.weights * np.exp(-eta * estimates)
    weights /= weights.sum()
    if forgetting.share:
        weights = (1.0 - forgetting.share) * weights + forgetting.share / models
    seen = ~np.isnan(losses)
    # Unobserved models keep their averages: they move towards their own values.
    recent = state.recent_loss + RECENT_RATE * (np.where(seen, losses, state.recent_loss) - state.recent_loss)
    long_run = state.long_run_loss + LONG_RUN_RATE * (np.where(seen, losses, state.long_run_loss)
                                                      - state.long_run_loss)
    if forgetting.detect and (long_run - recent > RECOVERY_GAP).any():
        recovered = seen & (long_run - recent > RECOVERY_GAP) & (weights < 1.0 / models)
        if recovered.any():
            # An equal share each; the others keep their proportions in what is left.
            weights[~recovered] *= (1.0 - recovered.sum() / models) / weights[~recovered].sum()
            weights[recovered] = 1.0 / models
            long_run[recovered] = recent[recovered]  # its failure is forgotten along with its weight
    return SelectionState(state.models, _normalised(weights, forgetting.floor), state.updates + 1, recent, long_run)


def exp3_choose(state: SelectionState, uniform: float) -> int:
    """The model to ask, drawn with probability s_i / sum(s); `uniform` is a draw from [0, 1)."""
    return int(min(np.searchsorted(np.cumsum(state.probabilities()), uniform, side="right"), len(state.models) - 1))


def exp3_update(state: SelectionState, chosen: int, loss: float, eta: float,
                forgetting: Forgetting = EXP3_FORGETTING) -> SelectionState:
    """s_i <- s_i * exp(-eta * loss / p_i) for the chosen model only (the others were not observed)."""
    if not 0.0 <= loss <= 1.0:
        raise ValueError(f"loss must lie in [0, 1], got {loss}")
    losses = np.full(len(state.models), np.nan)
    losses[chosen] = loss
    estimates = np.zeros(len(state.models))
    estimates[chosen] = loss / state.probabilities()[chosen]
    return _learn(state, losses, estimates, eta, forgetting)


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


def exp4_update(state: SelectionState, losses: np.ndarray, eta: float,
                forgetting: Forgetting = EXP4_FORGETTING) -> SelectionState:
    """s_i <- s_i * exp(-eta * L_i) for every model whose loss is known (NaN: it did not answer)."""
    losses = np.asarray(losses, dtype=np.float64)
    known = ~np.isnan(losses)
    if np.any((losses[known] < 0) | (losses[known] > 1)):
        raise ValueError("losses must lie in [0, 1]")
    return _learn(state, losses, np.where(known, losses, 0.0), eta, forgetting)
