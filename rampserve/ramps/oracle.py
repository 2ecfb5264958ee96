"""The oracle exit policy: every input exits at the earliest ramp whose top label equals the final label,
and ramps cost nothing (DESIGN §2). It bounds what any exit policy can save."""

from __future__ import annotations

import numpy as np

from rampserve.ramps.exit_rule import NO_EXIT


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
