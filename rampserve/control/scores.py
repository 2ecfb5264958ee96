"""Error scores: how unsure a ramp is of its top label (lower is more confident)."""

from __future__ import annotations

import numpy as np

ERROR_SCORES = ("max_prob", "entropy")
_max, _sum = np.maximum.reduce, np.add.reduce


def softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(axis=1, keepdims=True)
    exp = np.exp(shifted)
    return exp / exp.sum(axis=1, keepdims=True)


def top_label_and_error(logits: np.ndarray, score: str = "max_prob") -> tuple[np.ndarray, np.ndarray]:
    """Top label per row and its error score in [0, 1]: `1 - max softmax probability` (default) or the
    entropy normalised by log(classes). An input exits where its error score is below the ramp's threshold.

    Runs after every active ramp of every batch, so the default score takes the fewest array operations
    (about 7 µs for a (1, 10) batch, where a full softmax takes 25 µs): 1 - max softmax probability
    = 1 - 1 / sum(exp(logits - max)). The sum includes exp(0) = 1, so that error lies in [0, 1) unclipped.
    """
    logits = np.asarray(logits, dtype=np.float64)
    labels = logits.argmax(axis=1).astype(np.int64, copy=False)
    if score == "max_prob":
        # The ufuncs' own reductions skip the Python wrappers behind ndarray.max and ndarray.sum.
        exp = np.exp(logits - _max(logits, axis=1, keepdims=True))
        return labels, 1.0 - 1.0 / _sum(exp, axis=1)
    if score == "entropy":
        probs = softmax(logits)
        plogp = np.where(probs > 0, probs * np.log(np.clip(probs, 1e-300, None)), 0.0)
        return labels, np.clip(-plogp.sum(axis=1) / np.log(probs.shape[1]), 0.0, 1.0)
    raise ValueError(f"unknown error score {score!r}; known: {ERROR_SCORES}")
