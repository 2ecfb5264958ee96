"""The exit modes' strategies release what the exit rule says, on generated batches: in release mode a request is
answered at its ramps when every input of it exits there by the rule (`control.exit_rule.first_exits`) and does not
want the logits, else with the final layer's answers; stop mode answers the same, except that an input that left the
batch keeps the answer it left with. A scripted model stands in for the compiled run and applies the ramp operators'
contract (`exit_rule.exit_floor`), which `test_exit_rule` checks against the operators themselves."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays
from test_exit_rule import batches, scored

from rampserve.control.exit_rule import EXIT_MARGIN, STOP_MARGIN, exit_floor, first_exits
from rampserve.control.records import NO_EXIT, Configuration
from rampserve.control.scores import top_label_and_error
from rampserve.runtime.compiled import RampBuffers
from rampserve.runtime.prepared import RampOutputs
from rampserve.serving.executor.batch import BatchState
from rampserve.serving.executor.exit_modes import RELEASE, StopStrategy
from rampserve.serving.executor.request_queue import Pending
from rampserve.serving.shared.contract import Answer, ModelRequest


@dataclass
class ScriptedSignals:
    """The releasing thread's pipe, read only once the run is over: every column a ramp reported comes back from
    `end`, in the order reported, for the executor thread to hand to the batch."""

    write_fd: int = 0  # not -1: the ramps report
    columns: list[int] = field(default_factory=list)

    def begin(self, on_column: object) -> None:
        self.columns.clear()

    def end(self) -> bytes:
        return bytes(self.columns)


@dataclass
class ScriptedModel:
    """A compiled run whose ramps' logits (rows, ramps, classes) and final logits are given. It keeps the operators'
    contract: a fused ramp reports its column where a row still in the batch clears its floor less EXIT_MARGIN (a
    ramp in Python always does), and in stop mode a row not kept leaves at the first fused ramp where it clears its
    floor plus STOP_MARGIN."""

    ramp_logits: np.ndarray
    final_logits: np.ndarray
    error_score: str
    signals: ScriptedSignals

    def ramp_outputs(self, compiled: SimpleNamespace, rows: int) -> RampOutputs:
        ramps = len(compiled.sites)
        buffers = RampBuffers(None, np.zeros_like(self.ramp_logits), [np.zeros(0, dtype=int)] * ramps, None,
                              np.full(rows, -1))
        return RampOutputs(self, compiled, buffers)

    def evaluate_ramp(self, site: str, stash: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """A ramp in Python, on the rows its stash holds."""
        return top_label_and_error(self.ramp_logits[stash, int(site[1:])], self.error_score)

    def run_compiled(self, compiled: SimpleNamespace, feeds: dict, outputs: RampOutputs,
                     thresholds: tuple[float, ...], notify: int) -> np.ndarray:
        self._run(compiled, outputs, thresholds, None)
        return self.final_logits

    def run_stopping(self, compiled: SimpleNamespace, feeds: dict, outputs: RampOutputs,
                     thresholds: tuple[float, ...], notify: int, keep: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        self._run(compiled, outputs, thresholds, keep)
        ran = np.flatnonzero(outputs.buffers.left < 0)
        return self.final_logits[ran], ran

    def _run(self, compiled: SimpleNamespace, outputs: RampOutputs, thresholds: tuple[float, ...],
             keep: np.ndarray | None) -> None:
        buffers = outputs.buffers
        for j, fused in enumerate(compiled.fused):
            rows = np.flatnonzero(buffers.left < 0)
            buffers.logits[rows, j] = self.ramp_logits[rows, j]
            buffers.stashes[j] = rows
            confidence = 1.0 - top_label_and_error(self.ramp_logits[rows, j], self.error_score)[1]
            if not fused or np.any(confidence > exit_floor(thresholds[j], -EXIT_MARGIN)):
                self.signals.columns.append(j)
            if keep is not None and fused:
                buffers.left[rows[(confidence > exit_floor(thresholds[j], STOP_MARGIN)) & ~keep[rows]]] = j


@st.composite
def served_batches(draw: st.DrawFn) -> tuple:
    """A batch's ramp logits, error score and thresholds (`test_exit_rule.batches`), its final logits, which ramps
    are fused (the others run in Python and never stop an input), and its requests: inputs each, and whether each
    wants the logits."""
    logits, score, thresholds = draw(batches())
    rows, ramps, classes = logits.shape
    final = draw(arrays(np.float32, (rows, classes), elements=st.floats(-8, 8, width=32)))
    fused = tuple(draw(st.lists(st.booleans(), min_size=ramps, max_size=ramps)))
    cuts = sorted(draw(st.sets(st.integers(1, rows - 1), max_size=rows - 1))) if rows > 1 else []
    sizes = np.diff([0, *cuts, rows]).tolist()
    wants = draw(st.lists(st.booleans(), min_size=len(sizes), max_size=len(sizes)))
    return logits, score, thresholds, final, fused, list(zip(sizes, wants))


def serve(strategy, batch: tuple, stops: bool, shadow: bool) -> tuple[list[Answer], BatchState]:
    """The batch through `strategy` as the executor runs a compiled set; every request's one answer."""
    logits, score, thresholds, final, fused, requests = batch
    rows, ramps, classes = logits.shape
    sites = tuple(f"s{j}" for j in range(ramps))
    signals = ScriptedSignals()
    model = ScriptedModel(logits, final, score, signals)
    compiled = SimpleNamespace(sites=sites, fused=fused, stops=stops, classes=classes)
    answers: dict[int, list[Answer]] = {i: [] for i in range(len(requests))}
    pending = [Pending(ModelRequest({"x": np.zeros((size, 1))}, wants), 0.0, np.inf, answers[i].append)
               for i, (size, wants) in enumerate(requests)]
    state = BatchState(Configuration(1, sites, thresholds), pending, 0, SimpleNamespace(observe=lambda _: None))
    finals, _ = strategy.execute(model, compiled, state, {}, signals, shadow)
    state.finish(finals.labels, finals.errors, finals.logits)
    assert all(len(given) == 1 for given in answers.values()), "a request was answered other than once"
    return [given[0] for given in answers.values()], state


@settings(max_examples=300, deadline=None)
@given(served_batches(), st.sampled_from([0.0, 0.5, 1.0]), st.integers(0, 2**32 - 1), st.booleans())
def test_release_and_stop_release_what_the_exit_rule_says(batch: tuple, share: float, seed: int,
                                                          shadow: bool) -> None:
    logits, score, thresholds, final, fused, requests = batch
    labels, errors = scored(logits, score)
    first = first_exits(errors, thresholds)
    final_labels = final.argmax(axis=1)
    released, _ = serve(RELEASE, batch, stops=False, shadow=shadow)
    stopped, state = serve(StopStrategy(share, np.random.default_rng(seed)), batch, stops=True, shadow=shadow)
    left = state.left
    kept = state.sample | state.wants_final
    # An input leaves only where the rule certainly releases it, at a fused ramp, and never one kept to the end
    # (a shadow batch keeps every input)
    assert not np.any((left != NO_EXIT) & kept) and (not shadow or np.all(left == NO_EXIT))
    assert np.all((left == NO_EXIT) | ((first != NO_EXIT) & (first <= left)))
    assert all(fused[j] for j in left[left != NO_EXIT])
    start = 0
    for (size, wants), release, stop in zip(requests, released, stopped):
        rows = np.arange(start, start + size)
        start += size
        at_ramps = not wants and bool(np.all(first[rows] != NO_EXIT))
        if at_ramps:
            expected = [(int(labels[r, first[r]]), f"s{first[r]}") for r in rows]
        else:
            expected = [(int(final_labels[r]), None) for r in rows]
        assert list(zip(release.labels.tolist(), release.exits.sites)) == expected
        # Stop mode: the same, but an input that left the batch keeps the answer it left with
        if not at_ramps:
            expected = [(int(labels[r, first[r]]), f"s{first[r]}") if left[r] != NO_EXIT else expected[k]
                        for k, r in enumerate(rows)]
        assert list(zip(stop.labels.tolist(), stop.exits.sites)) == expected
        if not np.any(left[rows] != NO_EXIT):  # nothing of it left: both modes give it the same answer
            assert release.labels.tolist() == stop.labels.tolist() and release.exits.sites == stop.exits.sites
