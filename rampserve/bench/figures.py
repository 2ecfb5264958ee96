"""Figures every benchmark reports per system, whatever serves it (simulated queue or live server): how often
accuracy over a window of requests fell below the constraint, how a managed system's exits ran, and how often its
controller changed the ramp set against the thresholds alone."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from rampserve.control.controller import ControllerSettings
from rampserve.control.exit_rule import EXIT_MODES

ACCURACY_WINDOW = 1000  # requests per window of `windows_below_share`


def windows_below_share(correct: np.ndarray, min_accuracy: float, window: int = ACCURACY_WINDOW) -> float | None:
    """Share of consecutive, non-overlapping windows of `window` requests (in the order given: every request, in
    order) whose accuracy (share of `correct`) is below `min_accuracy` (1 − the accuracy constraint). A final
    partial window is left out, unless no window is full: then the one window is all the requests. None when
    there are no requests."""
    if window < 1:
        raise ValueError(f"window must be at least 1 request, got {window}")
    correct = np.asarray(correct, dtype=bool)
    n = len(correct)
    if n == 0:
        return None
    full = n // window
    windows = correct[:full * window].reshape(full, window) if full else correct[None, :]
    # counts, not float means: a window of exactly min_accuracy is not below it whatever the rounding
    needed = min_accuracy * windows.shape[1]
    below = windows.sum(axis=1) < needed - 1e-9 * max(1.0, needed)
    return float(below.mean())


def exit_mode_figures(exit_mode: str, feedback_share: float) -> dict:
    """`exit_mode` and `feedback_share` of a managed system: the share of exited rows that ran to the end (their
    final answers measure agreement). In release mode every row runs to the end, so its share is 1.0."""
    if exit_mode not in EXIT_MODES:
        raise ValueError(f"exit mode is one of {EXIT_MODES}, not {exit_mode!r}")
    return {"exit_mode": exit_mode, "feedback_share": 1.0 if exit_mode == "release" else float(feedback_share)}


def controller_exit_mode(settings: ControllerSettings) -> dict:
    """`exit_mode_figures` of a managed system's controller settings."""
    return exit_mode_figures(settings.exit_mode, settings.feedback_share)


def configuration_changes(site_sets: Sequence[Sequence[str]]) -> dict[str, int]:
    """How a controller's decisions changed its configuration, given each decision's active sites in order (the
    configuration in force before the first change first): `ramp_set_changes` counts decisions whose sites differ
    from the previous decision's, `threshold_changes` those that kept the sites (only thresholds moved)."""
    sets = [tuple(s) for s in site_sets]
    changed = sum(a != b for a, b in zip(sets, sets[1:]))
    return {"ramp_set_changes": changed, "threshold_changes": max(len(sets) - 1, 0) - changed}
