"""The oracle exit policy: every input exits at the earliest ramp whose top label equals the final label,
and ramps cost nothing (DESIGN §2). It bounds what any exit policy can save."""

from __future__ import annotations

import numpy as np

from rampserve.control.exit_rule import NO_EXIT


def earliest_correct_exit(ramp_labels: np.ndarray, final_labels: np.ndarray) -> np.ndarray:
    """Per input, the index of the first site (column, in model order) that agrees with the final label,
    or NO_EXIT."""
    ramp_labels = np.asarray(ramp_labels)
    if ramp_labels.ndim != 2 or ramp_labels.shape[0] != len(final_labels):
        raise ValueError(f"ramp labels {ramp_labels.shape} do not match {len(final_labels)} final labels")
    agree = ramp_labels == np.asarray(final_labels)[:, None]
    first = agree.argmax(axis=1)
    return np.where(agree.any(axis=1), first, NO_EXIT)


def exit_latency(exits: np.ndarray, reach_ms: np.ndarray, full_ms: float) -> np.ndarray:
    """Latency of each input when it exits at site `exits[i]` (time to reach that site), or the whole model."""
    reach = np.asarray(reach_ms, dtype=np.float64)
    return np.where(exits == NO_EXIT, full_ms, reach[np.clip(exits, 0, None)] if len(reach) else full_ms)


def answerable_share(errors: np.ndarray, correct: np.ndarray, disagreement: float) -> float:
    """One ramp's own oracle: the largest share of inputs it can answer under a single threshold (those with the
    lowest error scores; a threshold never splits equal scores) with its wrong answers at most `disagreement` of all
    inputs (the others get the model's own answer). What the accuracy constraint would let that ramp alone take,
    tuned in hindsight."""
    errors, correct = np.asarray(errors, dtype=np.float64), np.asarray(correct, dtype=bool)
    if errors.shape != correct.shape or errors.ndim != 1:
        raise ValueError(f"errors {errors.shape} and correct {correct.shape} must be two vectors of one length")
    n = len(errors)
    if n == 0:
        return 0.0
    order = np.argsort(errors, kind="stable")
    ranked = errors[order]
    wrong = np.cumsum(~correct[order])
    cuts = np.append(ranked[1:] != ranked[:-1], True)  # after the last of equal scores
    ok = np.flatnonzero(cuts & (wrong <= disagreement * n))
    return float((ok[-1] + 1) / n) if len(ok) else 0.0
