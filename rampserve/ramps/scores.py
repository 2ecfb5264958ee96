"""Error scores: how unsure a ramp is of its top label (lower is more confident)."""

from __future__ import annotations

import numpy as np

ERROR_SCORES = ("max_prob", "entropy")


def softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(axis=1, keepdims=True)
    exp = np.exp(shifted)
    return exp / exp.sum(axis=1, keepdims=True)


def top_label_and_error(logits: np.ndarray, score: str = "max_prob") -> tuple[np.ndarray, np.ndarray]:
    """Top label per row and its error score in [0, 1]: `1 - max softmax probability` (default) or the
    entropy normalised by log(classes). An input exits where its error score is below the ramp's threshold.

    Runs after every active ramp of every batch, so the default score takes the fewest array operations:
    1 - max softmax = 1 - 1 / sum(exp(logits - max)).
    """
    logits = np.asarray(logits, dtype=np.float64)
    labels = logits.argmax(axis=1)
    if score == "max_prob":
        top = logits[np.arange(len(labels)), labels]
        errors = 1.0 - 1.0 / np.exp(logits - top[:, None]).sum(axis=1)
    elif score == "entropy":
        probs = softmax(logits)
        plogp = np.where(probs > 0, probs * np.log(np.clip(probs, 1e-300, None)), 0.0)
        errors = -plogp.sum(axis=1) / np.log(probs.shape[1])
    else:
        raise ValueError(f"unknown error score {score!r}; known: {ERROR_SCORES}")
    return labels.astype(np.int64), np.clip(errors, 0.0, 1.0)
