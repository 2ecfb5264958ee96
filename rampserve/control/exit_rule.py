"""The exit rule, stated once: an input exits at a ramp where its error score is strictly below that ramp's
threshold, at the first active ramp (in model order) where it does. Error scores lie in [0, 1], so threshold 0
exits nothing: a ramp active only for the record.

The releasing test (`serving.executor.batch`), threshold tuning's evaluation (`control`) and the exit floors the
compiled ramps are given (`runtime.compiled`) all come from here. Free of torch: the controller reads it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

# "release": every input runs to the end, its answer released early; "stop": exited inputs leave the batch
EXIT_MODES = ("release", "stop")
NO_EXIT = -1  # the exit of an input that exits at no ramp

# A compiled ramp does not apply the rule itself: its operator tests confidence (1 - error score) > floor, on
# its own computation of the confidence from the same float32 logits the releasing thread scores. The floors
# below are set so that the operator's test brackets the rule despite the two computations' rounding.

# An exit floor above every confidence (they lie in [0, 1]): no input exits there
NEVER_STOP = 2.0
# Slack on "no input of this ramp can exit": the ramp operator and Python score the same float32 logits in
# double, so this only covers two double computations of the same numbers
EXIT_MARGIN = 1e-9
# The same for a ramp fused into an ONNX stage, whose confidence is computed in float32 (a few units of its
# rounding, 6e-8 each)
ONNX_EXIT_MARGIN = 1e-5
# How far above 1 - threshold a row's confidence must be for a stop-mode runner to take it out of the batch: the
# releasing thread's test (error score < threshold, in double from the same float32 logits) then certainly
# releases it. A row inside the margin is released but runs on, which costs only its compute
STOP_MARGIN = 1e-6


def exits(errors: np.ndarray | float, thresholds: np.ndarray | float) -> np.ndarray:
    """Whether each error score passes its threshold (elementwise, broadcast)."""
    return np.less(errors, thresholds)


def first_exits(errors: np.ndarray, thresholds: np.ndarray | Sequence[float]) -> np.ndarray:
    """Per input (row), the first ramp (column) where it exits, else NO_EXIT.

    `thresholds` may carry leading candidate axes: shape (..., r) against errors (n, r) gives (..., n).
    """
    passes = exits(errors, np.asarray(thresholds)[..., None, :])
    first = passes.argmax(axis=-1)
    return np.where(passes.any(axis=-1), first, NO_EXIT)


def exit_floor(threshold: float, offset: float) -> float:
    """The floor a ramp operator's confidence is tested against (confidence > floor) for `threshold`:
    1 - threshold + `offset`, and NEVER_STOP at threshold 0, where the rule exits nothing (an operator given a
    floor of 1 or more scores no row).

    Offset -EXIT_MARGIN (ONNX_EXIT_MARGIN for an ONNX tap): every input the rule exits clears the floor, so the
    operator's signal misses none (the releasing thread then applies the rule to the rows it scores). Offset
    +STOP_MARGIN: every input that clears the floor exits by the rule, so a stop-mode runner takes out of the
    batch only inputs that are certainly released."""
    return 1.0 - threshold + offset if threshold > 0 else NEVER_STOP
