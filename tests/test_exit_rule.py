"""One exit rule: the worker's release test, threshold tuning's evaluation and the compiled ramps' exit floors
all agree with `control.exit_rule`, on error scores scored from float32 logits as the serving path scores them;
and the controller's package imports no torch."""

from __future__ import annotations

import functools
import math
import pkgutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import onnxruntime as ort
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

import rampserve.control
from rampserve.control.exit_rule import (
    EXIT_MARGIN,
    NEVER_STOP,
    NO_EXIT,
    ONNX_EXIT_MARGIN,
    STOP_MARGIN,
    exit_floor,
    exits,
    first_exits,
)
from rampserve.control.records import Configuration
from rampserve.control.scores import ERROR_SCORES, top_label_and_error
from rampserve.control.thresholds import ExitData, evaluate
from rampserve.ramps import kernel
from rampserve.ramps.fused import fused_ramp
from rampserve.ramps.kinds import Ramp
from rampserve.ramps.specs import RampSpec
from rampserve.ramps.onnx_fused import ramp_tap
from rampserve.runtime.compiled import CompiledSet
from rampserve.serving.executor.batch import BatchState
from rampserve.serving.executor.request_queue import Pending
from rampserve.serving.shared.contract import ModelRequest
from taps import tap_session

REPO = Path(__file__).resolve().parent.parent
# Where a threshold is put relative to an observed error score: at it, a rounding away, around the margins
NUDGES = (0.0, 1e-15, -1e-15, 1e-12, -1e-12, EXIT_MARGIN, -EXIT_MARGIN, 2 * EXIT_MARGIN, STOP_MARGIN, -STOP_MARGIN,
          1.5 * STOP_MARGIN, ONNX_EXIT_MARGIN, -ONNX_EXIT_MARGIN, 2 * ONNX_EXIT_MARGIN)


@st.composite
def batches(draw: st.DrawFn) -> tuple[np.ndarray, str, tuple[float, ...]]:
    """A batch's ramp buffer (rows, ramps, classes) of float32 logits, an error score, and a threshold per ramp
    in [0, 1]: 0, anywhere, or next to one row's error score at that ramp (where roundings decide)."""
    rows, ramps, classes = draw(st.integers(1, 6)), draw(st.integers(1, 3)), draw(st.integers(2, 12))
    spread = np.float32(draw(st.sampled_from([1.0, 8.0, 40.0])))  # 40: confidences within float rounding of 1
    logits = draw(arrays(np.float32, (rows, ramps, classes), elements=st.floats(-1, 1, width=32))) * spread
    score = draw(st.sampled_from(ERROR_SCORES))
    thresholds = []
    for j in range(ramps):
        errors = top_label_and_error(logits[:, j], score)[1]
        kind = draw(st.sampled_from(["zero", "anywhere", "near"]))
        if kind == "zero":
            thresholds.append(0.0)
        elif kind == "anywhere":
            thresholds.append(draw(st.floats(0.0, 1.0)))
        else:
            near = float(errors[draw(st.integers(0, rows - 1))])
            if draw(st.booleans()):
                near += draw(st.sampled_from(NUDGES))
            else:  # a few units of its last place
                near = float(np.nextafter(near, np.inf if draw(st.booleans()) else -np.inf))
            thresholds.append(min(max(near, 0.0), 1.0))
    return logits, score, tuple(thresholds)


def scored(logits: np.ndarray, score: str) -> tuple[np.ndarray, np.ndarray]:
    """Labels and error scores (rows, ramps) of a ramp buffer, column by column, as the releasing thread scores
    them."""
    columns = [top_label_and_error(logits[:, j], score) for j in range(logits.shape[1])]
    return np.stack([c[0] for c in columns], axis=1), np.stack([c[1] for c in columns], axis=1)


def operator_confidence(logits: np.ndarray, score: str) -> float:
    """`confidence` of kernels/ramp_exit.cpp, step for step: in double from the float32 logits, summed in order."""
    values = [float(v) for v in logits]
    top = max(values)
    total = 0.0
    for v in values:
        total += math.exp(v - top)
    if score == "max_prob":
        return 1.0 / total
    log_total, entropy = math.log(total), 0.0
    for v in values:
        log_p = v - top - log_total
        entropy -= math.exp(log_p) * log_p
    return 1.0 - min(max(entropy / math.log(len(values)), 0.0), 1.0)


def operator_clears(confidence: float, floor: float) -> bool:
    """The operator's test of one row (`any_clears`, `ramp_stop`): a floor of 1 or more scores nothing."""
    return floor < 1.0 and confidence > floor


def compiled_set(ramps: int, classes: int, margin: float = EXIT_MARGIN) -> CompiledSet:
    """A compiled set for its floors alone: they do not depend on the runner."""
    return CompiledSet(tuple(f"s{j}" for j in range(ramps)), SimpleNamespace(forward=None), (True,) * ramps,
                       classes, margin)


def worker_exits(labels: np.ndarray, errors: np.ndarray, thresholds: tuple[float, ...]) -> np.ndarray:
    """Where the worker releases each input, its ramps' outputs handed over in model order."""
    rows, ramps = errors.shape
    config = Configuration(1, tuple(f"s{j}" for j in range(ramps)), thresholds)
    # wants the logits: released at the end of its batch, so nothing is answered here, only decided
    pending = Pending(ModelRequest({"x": np.zeros((rows, 1))}, True), 0.0, math.inf, lambda result: None)
    state = BatchState(config, [pending], 0, None)
    for j in range(ramps):
        state.ramp(j, labels[:, j], errors[:, j])
    return state.exits


def evaluated_exits(errors: np.ndarray, thresholds: tuple[float, ...]) -> np.ndarray:
    """Where `thresholds.evaluate` has each input exit: alone in its data, with ramp j saving j ms (the final
    layer as many as there are ramps) and every ramp wrong, its saved time is its exit."""
    rows, ramps = errors.shape
    data = ExitData(np.zeros((rows, ramps), dtype=bool), errors, np.tile(np.arange(ramps + 1.0), (rows, 1)))
    found = []
    for i in range(rows):
        accuracy, saved = evaluate(data.rows(np.arange(rows) == i), np.array(thresholds))
        assert (accuracy == 1.0) == (saved == ramps)
        found.append(NO_EXIT if saved == ramps else int(saved))
    return np.array(found)


def test_the_rule_is_strict_and_exits_nothing_at_threshold_zero() -> None:
    assert not exits(0.25, 0.25) and exits(0.25, 0.2500001) and not exits(0.0, 0.0)
    np.testing.assert_array_equal(first_exits(np.array([[0.3, 0.1], [0.2, 0.2]]), np.array([0.2, 0.2])),
                                  [1, NO_EXIT])
    assert exit_floor(0.0, -EXIT_MARGIN) == exit_floor(0.0, STOP_MARGIN) == NEVER_STOP
    assert exit_floor(0.25, -EXIT_MARGIN) == 0.75 - EXIT_MARGIN


@settings(max_examples=300, deadline=None)
@given(batches())
def test_release_tuning_and_floors_follow_the_one_rule(batch: tuple[np.ndarray, str, tuple[float, ...]]) -> None:
    logits, score, thresholds = batch
    rows, ramps, classes = logits.shape
    labels, errors = scored(logits, score)
    rule = exits(errors, np.array(thresholds))
    first = first_exits(errors, thresholds)
    np.testing.assert_array_equal(first, [int(np.argmax(r)) if r.any() else NO_EXIT for r in rule])
    np.testing.assert_array_equal(worker_exits(labels, errors, thresholds), first)
    np.testing.assert_array_equal(evaluated_exits(errors, thresholds), first)
    compiled = compiled_set(ramps, classes)
    floors, stop_floors = compiled.floors(thresholds), compiled.stop_floors(thresholds)
    assert floors[-1] == stop_floors[-1] == NEVER_STOP and compiled.floors(None) == [NEVER_STOP] * (ramps + 1)
    for i in range(rows):
        for j in range(ramps):
            confidence = operator_confidence(logits[i, j], score)
            # The operator signals every input the rule releases (the releasing thread then applies the rule)
            if rule[i, j]:
                assert operator_clears(confidence, floors[j]), (errors[i, j], thresholds[j], confidence)
            if thresholds[j] == 0:
                assert floors[j] >= 1.0 and stop_floors[j] >= 1.0
            # and a stop-mode runner takes out of the batch only inputs the rule releases
            if operator_clears(confidence, stop_floors[j]):
                assert rule[i, j], (errors[i, j], thresholds[j], confidence)


@functools.cache
def identity_ramp(classes: int) -> Ramp:
    """A linear ramp whose logits are its features, to the bit: the operators then score the logits drawn."""
    ramp = Ramp(RampSpec("linear", "identity", (classes,), classes)).eval()
    with torch.no_grad():
        ramp.head.weight.copy_(torch.eye(classes))
        ramp.head.bias.zero_()
    return ramp


@pytest.mark.skipif(not kernel.available(), reason="the ramp operators did not build on this machine")
@settings(max_examples=150, deadline=None)
@given(batches())
def test_the_ramp_operators_signal_and_stop_by_the_rule(batch: tuple[np.ndarray, str, tuple[float, ...]]) -> None:
    logits, score, thresholds = batch
    rows, ramps, classes = logits.shape
    compiled = compiled_set(ramps, classes)
    floors, stop_floors = compiled.floors(thresholds), compiled.stop_floors(thresholds)
    out = torch.zeros(rows, ramps, classes)
    for j in range(ramps):
        fused = fused_ramp(identity_ramp(classes), score, (classes,), j)
        activation = torch.from_numpy(np.ascontiguousarray(logits[:, j]))
        signals = [fused(activation[i:i + 1], out[i:i + 1], floors[j], -1, []) for i in range(rows)]
        left = torch.full((rows,), -1, dtype=torch.int64)
        fused.stop(activation, out, torch.arange(rows), torch.zeros(rows, dtype=torch.bool), left, floors[j],
                   stop_floors[j], -1, [])
        # The releasing thread scores the buffer the operator wrote: the logits drawn, to the bit
        np.testing.assert_array_equal(out[:, j].numpy(), logits[:, j])
        errors = top_label_and_error(out[:, j].numpy(), score)[1]
        rule = exits(errors, thresholds[j])
        for i in range(rows):
            if rule[i]:
                assert signals[i], (errors[i], thresholds[j])
            if left[i] == j:
                assert rule[i], (errors[i], thresholds[j])
            if thresholds[j] == 0:
                assert not signals[i] and left[i] == -1


@functools.cache
def identity_tap_session(classes: int, score: str) -> ort.InferenceSession:
    return tap_session(ramp_tap(identity_ramp(classes), "x", (classes,), 17, score), "x", ["batch", classes], 17)


@settings(max_examples=150, deadline=None)
@given(batches())
def test_an_onnx_tap_signals_every_input_the_rule_releases(batch: tuple[np.ndarray, str, tuple[float, ...]]) -> None:
    logits, score, thresholds = batch
    rows, ramps, classes = logits.shape
    floors = compiled_set(ramps, classes, ONNX_EXIT_MARGIN).floors(thresholds)
    session = identity_tap_session(classes, score)
    for j in range(ramps):
        for i in range(rows):
            row_logits, confidence = session.run(None, {"x": logits[i:i + 1, j]})
            np.testing.assert_array_equal(row_logits, logits[i:i + 1, j])
            error = top_label_and_error(row_logits, score)[1][0]
            # As `OnnxSetRunner` tests it: the session's float32 confidence against the floor
            signals = confidence > floors[j]
            if exits(error, thresholds[j]):
                assert signals, (error, thresholds[j], confidence)
            if thresholds[j] == 0:
                assert not signals


def test_the_controller_imports_no_torch() -> None:
    """Every module of `rampserve.control`, and the torch-free modules it reads, imported in a fresh process."""
    modules = ["rampserve.control", *(f"rampserve.control.{m.name}" for m in pkgutil.iter_modules(
        rampserve.control.__path__)), "rampserve.control.exit_rule", "rampserve.bundle_format.latency"]
    code = ("import importlib, sys\n"
            "for name in sys.argv[1:]:\n"
            "    importlib.import_module(name)\n"
            "    if 'torch' in sys.modules:\n"
            "        sys.exit(f'{name} imports torch')\n")
    done = subprocess.run([sys.executable, "-c", code, *modules], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert len(modules) > 10  # the package's modules were found
