"""Rolling risk control (Feldman, Ringel, Bates and Romano, "Achieving Risk Control in Online Learning Settings",
TMLR 2023): a scale on the certified thresholds that every released answer moves, so that the long-run share of
answers that differ from the original model's stays within a target (`ControllerSettings.risk_target`: the
constraint under the average promise, less under the others) whatever the stream does.

After each batch, scale <- min(1, scale + step * sum over its answers of (target - disagreement)), where an
answer's disagreement is its unbiased estimate (`BatchRecord.wrong_estimate`: 1 / feedback share for a sampled
exit in stop mode, 1 for an answer nobody could check). At scale <= 0 no input exits, so no answer disagrees and
the scale rises again: it never falls below -step * (most a batch can add), and summing the updates gives, over
any T answers, mean disagreement <= target + (1 + step * most) / (step * T). The bound needs no assumption on
the stream (drift included); what it cannot say is how any one window of answers fares.
"""

from __future__ import annotations

import numpy as np

# Published scales are multiples of this: the served thresholds change when the scale crosses one, not every batch
SCALE_STEP = 0.05


def rolled_scale(scale: float, disagreement: np.ndarray, target: float, step: float) -> float:
    """The scale after one batch of answers with these (estimated) disagreements."""
    return min(1.0, scale + step * float(np.sum(target - np.asarray(disagreement, dtype=float))))


def served_scale(scale: float) -> float:
    """The scale the thresholds are served at: the rolling one rounded down to a step, and none below 0."""
    return float(np.clip(np.floor(scale / SCALE_STEP + 1e-9) * SCALE_STEP, 0.0, 1.0))
