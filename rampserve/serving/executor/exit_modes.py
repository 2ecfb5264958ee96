"""The two exit modes (`ControllerSettings.exit_mode`) as strategies for a compiled run of a batch.

`ReleaseStrategy`: every input runs to the end; its answer is released at the first confident ramp. `StopStrategy`:
an input released at a fused ramp also leaves the batch there (`runtime.compiled.StopSetRunner`) and is never computed
further, except for the feedback sample: inputs drawn uniformly per batch (each with probability `feedback_share`,
whatever its scores) and those whose request wants the logits, which run to the end so that their final answers
measure the exits' agreement. Its record then has no final label (NO_LABEL) for an input that left, and NO_LABEL
labels and NaN error scores at the ramps after the one it left at. Whichever runs, the releasing test is the exit
rule's (`BatchState.ramp`); the strategies differ in what the run computes and what the books learn from.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from rampserve.control.records import NO_EXIT, NO_LABEL
from rampserve.control.scores import top_label_and_error
from rampserve.serving.executor.batch import BatchState, RampSignals

if TYPE_CHECKING:
    from rampserve.runtime.compiled import CompiledSet
    from rampserve.runtime.prepared import PreparedModel, RampOutputs


@dataclass(frozen=True)
class Finals:
    """A batch's final answers, per input: label (NO_LABEL where it left the batch), error score and logits (NaN
    where it left)."""

    labels: np.ndarray
    errors: np.ndarray
    logits: np.ndarray

    @classmethod
    def of(cls, logits: np.ndarray) -> Finals:
        """The answers of a run in which every input ran to the end."""
        labels, errors = top_label_and_error(logits)
        return cls(labels, errors, logits)


class ExitStrategy(ABC):
    """What a compiled run does with the inputs released at its ramps."""

    def execute(self, model: PreparedModel, compiled: CompiledSet, state: BatchState, feeds: dict[str, np.ndarray],
                signals: RampSignals | None, shadow: bool) -> tuple[Finals, RampOutputs]:
        """Run the batch of `state` on `compiled`, releasing answers as its ramps report: the releasing thread
        (`signals`) scores each column a ramp reports (one where some input may exit) and releases what exits there
        while the model runs on; what it has not taken when the run ends, this thread handles. The other columns are
        left in the returned outputs, scored for the record once every answer is out. `shadow`: a shadow batch."""
        config = state.config
        outputs = model.ramp_outputs(compiled, state.n)
        columns = [state.column[site] for site in compiled.sites]
        signals = signals if config.sites else None  # a vanilla set has no ramp to report

        def ramp(j: int) -> None:
            state.ramp(columns[j], *outputs.scores(j))

        if signals is not None:
            signals.begin(ramp)
        thresholds = config.thresholds if config.sites == compiled.sites else \
            tuple(config.thresholds[j] for j in columns)
        try:
            finals = self._run(model, compiled, state, columns, feeds, outputs, thresholds,
                               -1 if signals is None else signals.write_fd, shadow)
        finally:
            left = b"" if signals is None else signals.end()
        for j in left:
            ramp(j)
        self._after_run(state, outputs, columns, ramp)
        return finals, outputs

    @abstractmethod
    def _run(self, model: PreparedModel, compiled: CompiledSet, state: BatchState, columns: list[int],
             feeds: dict[str, np.ndarray], outputs: RampOutputs, thresholds: tuple[float, ...], notify: int,
             shadow: bool) -> Finals:
        """Run the model (its ramps write their columns to the pipe `notify`); the batch's final answers."""

    @abstractmethod
    def _after_run(self, state: BatchState, outputs: RampOutputs, columns: list[int],
                   ramp: Callable[[int], None]) -> None:
        """Once every column the ramps reported has been handed to the batch."""

    @abstractmethod
    def reached(self, outputs: RampOutputs, column: int) -> np.ndarray:
        """The batch rows (increasing) that reached the set's `column`-th ramp, read once the run is over."""

    @abstractmethod
    def feedback_share(self, shadow: bool) -> float:
        """Each input's chance to be kept running to the end, for the record."""


class ReleaseStrategy(ExitStrategy):
    def _run(self, model: PreparedModel, compiled: CompiledSet, state: BatchState, columns: list[int],
             feeds: dict[str, np.ndarray], outputs: RampOutputs, thresholds: tuple[float, ...], notify: int,
             shadow: bool) -> Finals:
        state.run_begins()
        return Finals.of(model.run_compiled(compiled, feeds, outputs, thresholds, notify))

    def _after_run(self, state: BatchState, outputs: RampOutputs, columns: list[int],
                   ramp: Callable[[int], None]) -> None:
        return None  # no input left the batch: a column not reported exits none, and is scored for the record

    def reached(self, outputs: RampOutputs, column: int) -> np.ndarray:
        return np.arange(len(outputs.buffers.logits))

    def feedback_share(self, shadow: bool) -> float:
        return 1.0


class StopStrategy(ExitStrategy):
    def __init__(self, share: float, feedback: np.random.Generator | None = None) -> None:
        self.share = share
        self.feedback = np.random.default_rng() if feedback is None else feedback  # the sample: uniform

    def _run(self, model: PreparedModel, compiled: CompiledSet, state: BatchState, columns: list[int],
             feeds: dict[str, np.ndarray], outputs: RampOutputs, thresholds: tuple[float, ...], notify: int,
             shadow: bool) -> Finals:
        # The feedback sample, drawn before the run whatever the scores, and the logits' rows (a shadow batch keeps
        # every input: none stops, so each is observed)
        n = state.n
        state.sample = np.ones(n, dtype=bool) if shadow else self.feedback.random(n) < self.share
        state.wants_final = np.repeat([p.request.needs_final for p in state.batch], [p.rows for p in state.batch])
        state.unstoppable = [columns[j] for j, fused in enumerate(compiled.fused) if not fused]
        state.run_begins()
        output, ran = model.run_stopping(compiled, feeds, outputs, thresholds, notify,
                                         state.sample | state.wants_final)
        # The rows that did not run to the end have no final answer: NO_LABEL, NaN and NaN
        logits = np.full((n, *output.shape[1:]) if len(ran) else (n, compiled.classes), np.nan, dtype=np.float32)
        labels, errors = np.full(n, NO_LABEL), np.full(n, np.nan)
        if len(ran):
            logits[ran] = output
            labels[ran], errors[ran] = top_label_and_error(output)
        return Finals(labels, errors, logits)

    def _after_run(self, state: BatchState, outputs: RampOutputs, columns: list[int],
                   ramp: Callable[[int], None]) -> None:
        # A ramp that stopped inputs signalled: scored already, unless something went wrong
        left = outputs.buffers.left
        for j in np.unique(left[left >= 0]):
            if not state.scored[columns[j]]:
                ramp(int(j))
        # The state takes the exits in its own columns; -1 (ran to the end) picks the last entry
        state.stopped(np.asarray([*columns, NO_EXIT])[left])

    def reached(self, outputs: RampOutputs, column: int) -> np.ndarray:
        return outputs.buffers.reached(column)

    def feedback_share(self, shadow: bool) -> float:
        return 1.0 if shadow else self.share


RELEASE = ReleaseStrategy()  # holds nothing: one serves every worker
