"""A prepared model: the user's model split at its sites, a ramp per site, and a latency profile."""

from __future__ import annotations

import functools
import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from rampserve.bundle_format.latency import LatencyProfile
from rampserve.bundle_format.manifest import bundle_digest
from rampserve.bundle_format.signature import ModelSignature
from rampserve.control.exit_rule import EXIT_MODES, ONNX_EXIT_MARGIN
from rampserve.control.scores import top_label_and_error
from rampserve.ramps.pooling import POOLING_REDUCTIONS
from rampserve.ramps.specs import RampSpec
from rampserve.runtime.backends import Backend
from rampserve.runtime.compiled import (
    CompiledSet,
    CorruptEntry,
    OnnxSetRunner,
    RampBuffers,
    compiled_dir,
    opened_entry,
    remove_compiled,
    write_entry,
)

if TYPE_CHECKING:
    from rampserve.ramps.arrays import RampArrays
    from rampserve.ramps.cache import CacheRamp
    from rampserve.ramps.kinds import Ramp
    from rampserve.runtime.onnx_signals import OnnxSignalledRunner

log = logging.getLogger("rampserve.runtime")

# Called after each active ramp with the site's name, every input's top label and error score.
RampCallback = Callable[[str, np.ndarray, np.ndarray], None]
# Compiled sets kept in memory per model. A set loaded from disk holds its own copy of the weights, so this
# bounds memory; the set a server is running is held by the server, whatever is evicted here.
COMPILED_SETS_KEPT = 16
# How far a fused ramp's error scores may be from the eager ramp's: the two sum the same products in another
# order in float32 (the pooling folded into the head), a few units of float32 rounding on logits of size ~10
FUSED_SCORE_TOLERANCE = 1e-5
# A stop-mode run's label for a row at a ramp it never reached (it left the batch before), and its final label
# where it did not run to the end (the controller's NO_LABEL)
UNREACHED = -1


@dataclass(frozen=True)
class SiteInfo:
    name: str  # the cut value in the model's graph
    index: int  # position in the graph's op order
    op_kind: str
    scope: str
    activation_shape: tuple[int, ...]  # per input
    ramp: RampSpec
    val_accuracy: float | None = None  # ramp's agreement with the original model on held-out bootstrap data

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "index": self.index,
            "op_kind": self.op_kind,
            "scope": self.scope,
            "activation_shape": list(self.activation_shape),
            "ramp": self.ramp.to_json(),
            "val_accuracy": self.val_accuracy,
        }

    @classmethod
    def from_json(cls, data: dict) -> SiteInfo:
        return cls(
            name=str(data["name"]),
            index=int(data["index"]),
            op_kind=str(data["op_kind"]),
            scope=str(data["scope"]),
            activation_shape=tuple(int(d) for d in data["activation_shape"]),
            ramp=RampSpec.from_json(data["ramp"]),
            val_accuracy=None if data.get("val_accuracy") is None else float(data["val_accuracy"]),
        )


@dataclass(frozen=True, eq=False)
class RampOutputs:
    """A compiled run's ramp outputs: column j (the set's j-th site) scored on demand, by any thread, once the run
    has passed that site (its column was written to the run's pipe) or ended."""

    model: PreparedModel
    compiled: CompiledSet
    buffers: RampBuffers

    def scores(self, column: int) -> tuple[np.ndarray, np.ndarray]:
        """Every input's top label and error score at the set's `column`-th ramp: a fused ramp's logits scored as
        the eager ramp's are, or a ramp in Python evaluated on its stashed activation. In stop mode, a row that
        left the batch at an earlier ramp never reached this one: its label is `UNREACHED` and its error NaN."""
        if self.compiled.stops:
            return self._reached_scores(column)
        if self.compiled.fused[column]:
            return top_label_and_error(self.buffers.logits[:, column], self.model.error_score)
        return self.model.evaluate_ramp(self.compiled.sites[column], self.buffers.stashes[column])

    def _reached_scores(self, column: int) -> tuple[np.ndarray, np.ndarray]:
        buffers = self.buffers
        rows = buffers.reached(column)
        labels, errors = np.full(len(buffers.left), UNREACHED, dtype=np.int64), np.full(len(buffers.left), np.nan)
        if self.compiled.fused[column]:
            if len(rows):
                labels[rows], errors[rows] = top_label_and_error(buffers.logits[rows, column], self.model.error_score)
        elif len(rows):  # the stash holds the rows that reached it, in order
            labels[rows], errors[rows] = self.model.evaluate_ramp(self.compiled.sites[column],
                                                                  buffers.stashes[column])
        return labels, errors


@dataclass
class PreparedModel:
    backend: Backend
    sites: list[SiteInfo]
    # A torch module per site (`ramps.kinds`), or for an ONNX model's linear and MLP ramps loaded from a bundle their
    # arrays (`ramps.arrays`): serving those imports no torch
    ramps: dict[str, Ramp | CacheRamp | RampArrays]
    profile: LatencyProfile | None = None
    meta: dict = field(default_factory=dict)  # source, encoder, training report, oracle statistics
    error_score: str = "max_prob"
    # The v2 tensor signature clients see and the example the serving path is compiled with (prepare derives it,
    # a bundle keeps it); None for a bundle prepared before bundles carried it
    signature: ModelSignature | None = None
    # On the inputs the ramps were validated on: every site's ramp's top label ("labels") and error score ("errors"),
    # (inputs, sites) in `site_names` order, and the model's own label ("final"); None for a bundle prepared before
    # bundles kept them (`bundle_format.manifest.VALIDATION_FILE`)
    validation: dict[str, np.ndarray] | None = None

    @property
    def site_names(self) -> list[str]:
        return [s.name for s in self.sites]

    bundle_dir: Path | None = None  # where the model was loaded from (what a compile worker process loads)
    # (exit mode, sites) -> compiled set
    _compiled: OrderedDict[tuple[str, tuple[str, ...]], CompiledSet | None] = field(
        default_factory=OrderedDict, init=False, repr=False)

    def evaluate_ramp(self, site: str, activation: object) -> tuple[np.ndarray, np.ndarray]:
        """Every input's top label and error score from the ramp at `site`, given the site's activation as the
        backend computes it: the eager path's ramp (the reference the fused ramps are tested against)."""
        return self.ramps[site].evaluate(activation, self.error_score)

    def run(self, feeds: dict[str, np.ndarray], active: Sequence[str] = (),
            on_ramp: RampCallback | None = None, compiled: bool | CompiledSet = False) -> np.ndarray:
        """Run the model, reporting every active ramp's top label and error score per input to `on_ramp`, in model
        order. Returns the original model's output (logits). `compiled`: run the compiled set made for these ramps
        (True: the one `compile` or `install` left, if any; or the set itself; its ramps are reported after the
        run), else the eager path (each ramp as its site is computed)."""
        if compiled is True:
            compiled = self.compiled_set(active)
        if not isinstance(compiled, CompiledSet):
            return self.run_eager(feeds, active, on_ramp)
        outputs = self.ramp_outputs(compiled, len(next(iter(feeds.values()))))
        with self.backend.inference_mode():
            if compiled.stops:  # no thresholds: no row stops, every row runs to the end
                output, _ = self.run_stopping(compiled, feeds, outputs)
            else:
                output = self.run_compiled(compiled, feeds, outputs)
        if on_ramp is not None:
            for column, site in enumerate(compiled.sites):
                on_ramp(site, *outputs.scores(column))
        return output

    def ramp_answers(self, feeds: dict[str, np.ndarray], compiled: bool | CompiledSet = False
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """One batch run with every site's ramp evaluated: each ramp's top label and error score per input,
        (inputs, sites) in `site_names` order, and the model's own label per input. `compiled` as for `run`."""
        sites = self.site_names
        column = {s: i for i, s in enumerate(sites)}
        inputs = len(next(iter(feeds.values())))
        labels = np.zeros((inputs, len(sites)), dtype=np.int64)
        errors = np.zeros((inputs, len(sites)), dtype=np.float32)

        def collect(site: str, top: np.ndarray, error: np.ndarray) -> None:
            labels[:, column[site]], errors[:, column[site]] = top, error

        final = np.asarray(self.run(feeds, sites, collect, compiled=compiled)).argmax(axis=1)
        return labels, errors, final

    def run_eager(self, feeds: dict[str, np.ndarray], active: Sequence[str], on_ramp: RampCallback | None
                  ) -> np.ndarray:
        """The reference path: the model's stages as the backend runs them, each active ramp evaluated in Python
        as its site is computed and reported to `on_ramp` at once (model order)."""
        with self.backend.inference_mode():

            def report(site: str, activation: object) -> None:
                labels, errors = self.evaluate_ramp(site, activation)
                if on_ramp is not None:
                    on_ramp(site, labels, errors)

            return self.backend.to_numpy(self.backend.run_hooked(feeds, active, report))

    @functools.cached_property
    def onnx_taps(self) -> dict:
        """Per site whose ramp fuses into ONNX stages, that ramp as a tap on the site's value."""
        from rampserve.ramps.onnx_fused import can_tap, ramp_tap

        opset = self.backend.split.opset
        return {s.name: ramp_tap(self.ramps[s.name], s.name, s.activation_shape, opset, self.error_score)
                for s in self.sites if can_tap(self.ramps[s.name])}

    def _signalled_runner(self, sites: tuple[str, ...], side: str | None) -> tuple[OnnxSignalledRunner, bytes] | None:
        """The ONNX model whole in one session whose ramps at `sites` signal (`runtime.onnx_signals`) and that
        session's graph, or None where ONNX Runtime refuses that graph (an operator that needs a weight the signal's
        zero was added to, say): the set is then cut into stages."""
        from rampserve.runtime.onnx_signals import SIGNAL_OP, OnnxSignalledRunner, libraries

        unpooled = [s for s in sites if self.ramps[s].spec.reduce not in POOLING_REDUCTIONS]
        try:
            session, graph = self.backend.split.signalled(sites, self._signalled_tap, SIGNAL_OP, libraries(),
                                                          keep_layout=unpooled)
        except Exception as exc:  # noqa: BLE001 - ONNX Runtime raises its own types for a graph it refuses
            log.warning("ONNX Runtime refused %s as one signalled session (%s); serving it in stages", sites, exc)
            return None
        return OnnxSignalledRunner(session, sites, side), graph

    @functools.cached_property
    def _stored_sets(self) -> tuple[Path, str] | None:
        """Where this bundle's compiled sets are kept and its digest (what their keys start from); None for a model
        not loaded from a bundle."""
        if self.bundle_dir is None:
            return None
        digest = bundle_digest(self.bundle_dir)
        return compiled_dir(self.bundle_dir, digest), digest

    def _signalled_key(self, sites: tuple[str, ...]) -> tuple[Path, str] | None:
        """Where a signalled set of `sites` is kept, if this model keeps its sets."""
        from rampserve.runtime.onnx_signals import signalled_key

        if self._stored_sets is None:
            return None
        directory, digest = self._stored_sets
        return directory, signalled_key(digest, sites, self.error_score, self.backend.intra_op_threads)

    def _stored_signalled(self, sites: tuple[str, ...], side: str | None) -> CompiledSet | None:
        """The signalled set of `sites` as kept on disk when it was built and checked (it is not checked again), or
        None where there is none. One that does not match its index is removed, to be built again."""
        from rampserve.runtime.onnx_signals import OnnxSignalledRunner, libraries

        where = self._signalled_key(sites)
        if where is None:
            return None
        try:
            with opened_entry(*where, ".onnx") as (index, graph):
                session = self.backend.split.signalled_session(graph, libraries())
        except FileNotFoundError:
            return None
        except CorruptEntry as exc:
            log.warning("%s; building that set again", exc)
            remove_compiled(*where)
            return None
        runner = OnnxSignalledRunner(session, sites, side)
        return CompiledSet(sites, runner, runner.tapped, int(index["classes"]), ONNX_EXIT_MARGIN, from_disk=True)

    def _stopping(self, compiled: CompiledSet, side: str | None) -> CompiledSet:
        """A signalled set (checked, or kept on disk once it was) as a stop-mode set: the same session."""
        from rampserve.runtime.onnx_signals import OnnxStoppingRunner

        runner = OnnxStoppingRunner(compiled.runner.runner, compiled.sites, side, self.error_score)
        return CompiledSet(compiled.sites, runner, runner.tapped, compiled.classes, ONNX_EXIT_MARGIN, mode="stop",
                           from_disk=compiled.from_disk)

    def _store_signalled(self, compiled: CompiledSet, graph: bytes) -> None:
        where = self._signalled_key(compiled.sites)
        if where is not None:
            write_entry(*where, ".onnx", graph, {"sites": list(compiled.sites), "classes": compiled.classes})

    def _signalled_tap(self, site: str, value) -> object:
        """The ramp at `site` as a tap on `value` (a `graph.onnx_graph.SiteValue`), in the value's layout."""
        from rampserve.ramps.onnx_fused import ramp_tap

        shape = next(s.activation_shape for s in self.sites if s.name == site)
        return ramp_tap(self.ramps[site], value.name, shape, self.backend.split.opset, self.error_score, value.block)

    def ramp_outputs(self, compiled: CompiledSet, rows: int) -> RampOutputs:
        """Where a compiled run of `rows` inputs on this thread leaves its ramps' outputs, to be scored by any
        thread (the run's buffers, reused by this thread's next run of that size)."""
        return RampOutputs(self, compiled, compiled.buffers(rows))

    def run_compiled(self, compiled: CompiledSet, feeds: dict[str, np.ndarray], outputs: RampOutputs,
                     thresholds: Sequence[float] | None = None, notify: int = -1) -> np.ndarray:
        """Run `compiled` straight through on `feeds`; returns the model's output. Its ramps leave their outputs in
        `outputs` (from `ramp_outputs` for this thread and batch size) and, given `thresholds` (per site, in the
        set's order), write their column to the pipe `notify` as soon as some input may exit there (one whose
        confidence clears 1 - threshold, less a margin for rounding); a ramp in Python writes its column always.
        Each Python step between compiled stages costs several times its cost in a loop (the stage before
        evicted the interpreter's working set), so nothing is done here that can be done once per set or per
        configuration. Run it under the backend's `inference_mode()`, as the executor does: a TorchScript runner's
        operators then skip autograd's dispatch."""
        arrays = compiled.arrays
        activation, side = self._runner_feeds(compiled, feeds)
        floors = compiled.floors(None if thresholds is None else tuple(thresholds))
        buffers = outputs.buffers
        return arrays.unwrap(compiled.run(activation, side, buffers.runner_logits, floors, notify, buffers.stashes))

    def run_stopping(self, compiled: CompiledSet, feeds: dict[str, np.ndarray], outputs: RampOutputs,
                     thresholds: Sequence[float] | None = None, notify: int = -1, keep: np.ndarray | None = None
                     ) -> tuple[np.ndarray, np.ndarray]:
        """Run a stop-mode set (`compiled.stops`) on `feeds`: as `run_compiled`, but a row whose confidence at a
        fused ramp clears 1 - threshold by `STOP_MARGIN` leaves the batch there, unless `keep` (bool per row)
        holds it; `outputs.buffers.left` then says at which column (-1: it did not leave). Returns the model's
        output for the rows that ran to the end and those rows (increasing)."""
        arrays = compiled.arrays
        activation, side = self._runner_feeds(compiled, feeds)
        key = None if thresholds is None else tuple(thresholds)
        buffers = outputs.buffers
        buffers.left.fill(-1)  # through the array: the tensor may be an inference-mode one, this not in that mode
        keeps = arrays.wrap(np.zeros(len(buffers.left), dtype=bool) if keep is None else
                            np.ascontiguousarray(keep, dtype=bool))
        output, rows = compiled.run(activation, side, buffers.runner_logits, compiled.floors(key),
                                    compiled.stop_floors(key), keeps, buffers.runner_left, notify, buffers.stashes)
        return arrays.unwrap(output), arrays.unwrap(rows)

    def _runner_feeds(self, compiled: CompiledSet, feeds: dict[str, np.ndarray]) -> tuple[object, object]:
        """The primary input and the one side input a set's runner takes, as it takes them."""
        primary, side_name = self._runner_names
        arrays = compiled.arrays
        side = arrays.no_side if side_name is None else arrays.wrap(np.ascontiguousarray(feeds[side_name]))
        return arrays.wrap(np.ascontiguousarray(feeds[primary])), side

    @functools.cached_property
    def _runner_names(self) -> tuple[str, str | None]:
        """The model's primary input and the one side input a set's runner takes (None for a model without one)."""
        primary, *side = self.backend.input_names
        return primary, side[0] if side else None

    @property
    def compiles_to_torchscript(self) -> bool:
        """Whether a set compiles to TorchScript (torch), slow enough (0.1-1 s, holding the GIL) to be compiled in a
        worker process and kept on disk; an ONNX model's set (its stages with the ramps in their sessions) is built
        in a few ms."""
        return self.backend.kind == "torch"

    def build_compiled(self, active: Sequence[str], example: dict[str, np.ndarray], mode: str = "release",
                       signals: bool = True) -> CompiledSet | None:
        """Compile the serving path for `active` with `example` as the example input: its stages traced, each
        stage that ends at an active site with that site's ramp fused in (the ramp operator, or a stash for a ramp
        that runs in Python), run by one scripted `SetRunner` (a `StopSetRunner` in the "stop" exit mode), frozen;
        on ONNX, its stages' sessions with each linear ramp in the session of the stage that ends at its site (an
        `OnnxSetRunner`, in either mode: it does not stop), or with `signals` where every active ramp fuses, the
        whole model in one session whose ramps signal as the run goes on (an `OnnxSignalledRunner`; in the "stop"
        mode an `OnnxStoppingRunner`, which ends a run whose every row has left). None where the model
        does not compile: a stage that does not trace faithfully (see `trace_stages`), a model with more than one
        side input, ramps where the ramp operators could not be built (or more than a pipe byte can number), or a
        runner whose output is not bit for bit the eager model's on the example, or whose fused ramps do not score
        the example as the eager ramps do (labels equal, error scores within `FUSED_SCORE_TOLERANCE`)."""
        if mode not in EXIT_MODES:
            raise ValueError(f"unknown exit mode {mode!r}; known: {EXIT_MODES}")
        primary, *side_names = self.backend.input_names
        if len(side_names) > 1 or len(active) > 255:
            return None
        sites = self.backend.ordered_cuts(active)
        classes = next((s.ramp.num_classes for s in self.sites), 0)
        if self.backend.kind == "onnx":
            side = side_names[0] if side_names else None
            whole = signals and sites and all(s in self.onnx_taps for s in sites)
            stored = self._stored_signalled(sites, side) if whole else None
            if stored is not None:
                return self._stopping(stored, side) if mode == "stop" else stored
            signalled = self._signalled_runner(sites, side) if whole else None
            if signalled is None:  # a staged set cannot stop: it serves stop mode as release mode
                stages = self.backend.split.build_tapped(sites, {s: self.onnx_taps[s] for s in sites
                                                                 if s in self.onnx_taps})
                runner = OnnxSetRunner(stages, side)
            else:
                runner = signalled[0]
            compiled = CompiledSet(sites, runner, runner.tapped, classes, ONNX_EXIT_MARGIN)
            if not self._faithful(compiled, example):
                return None
            if signalled is not None:
                self._store_signalled(compiled, signalled[1])
                if mode == "stop":
                    stopping = self._stopping(compiled, side)
                    return stopping if self._faithful(stopping, example) else compiled
            return compiled
        from rampserve.runtime.torchscript_sets import build_torchscript_set  # torch: a torch model's sets only

        compiled = build_torchscript_set(self, sites, example, mode, classes)
        return compiled if compiled is not None and self._faithful(compiled, example) else None

    def _faithful(self, compiled: CompiledSet, example: dict[str, np.ndarray]) -> bool:
        """Whether `compiled` gives the eager model's output bit for bit on `example` (the eager stages give the
        original model's) and each fused ramp the eager ramp's labels and error scores (to float rounding). A
        runner that runs an ONNX model whole is held to the whole model: its output, and the eager ramps on the
        sites' values as the whole graph computes them (ONNX Runtime fuses a whole transformer otherwise than its
        stages: minilm-rt's ramp scores after layer 1 differ by 5e-3 between the two, its output by 5e-7)."""
        fused: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        eager: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        output = self.run(example, compiled.sites, lambda site, *seen: fused.setdefault(site, seen), compiled)
        if getattr(compiled.runner, "runs_whole", False):
            reference = self.run(example, ())
            with self.backend.inference_mode():
                for site, value in self.backend.split.whole_values(example, compiled.sites).items():
                    eager[site] = self.evaluate_ramp(site, value)
        else:
            reference = self.run(example, compiled.sites, lambda site, *seen: eager.setdefault(site, seen))
        if not np.array_equal(output, reference):
            log.info("a compiled set of %s gives another output than the model; serving it eagerly", compiled.sites)
            return False
        for site, (labels, errors) in fused.items():
            if not (np.array_equal(labels, eager[site][0])
                    and np.allclose(errors, eager[site][1], rtol=0.0, atol=FUSED_SCORE_TOLERANCE)):
                log.warning("the fused ramp at %s scores the example otherwise than the eager ramp; serving the set "
                            "eagerly", site)
                return False
        if compiled.stops and any(compiled.fused) and len(reference) > 1:
            # Rows leaving: at threshold 1 every row but the first (kept) leaves at the first fused ramp; the first
            # runs on alone, as the stages run any batch size, to the model's output (to float rounding)
            keep = np.zeros(len(reference), dtype=bool)
            keep[0] = True
            with self.backend.inference_mode():
                alone, ran = self.run_stopping(compiled, example, self.ramp_outputs(compiled, len(reference)),
                                               [1.0] * len(compiled.sites), -1, keep)
            if not (np.array_equal(ran, [0]) and np.allclose(alone, reference[:1], rtol=1e-4, atol=1e-5)):
                log.warning("a stop-mode set of %s does not run on when inputs leave its batch; serving it eagerly",
                            compiled.sites)
                return False
        return True

    def compile(self, active: Sequence[str], example: dict[str, np.ndarray], mode: str = "release") -> bool:
        """Compile the serving path for these active ramps (in exit mode `mode`) in this process, unless done
        before; whether `run(..., compiled=True)` with them runs compiled. Servers compile in a worker process
        instead (`compile_service`) and `install` what it made."""
        key = self.backend.ordered_cuts(active)
        if not self.has_compiled(key, mode):
            self.install(key, self.build_compiled(key, example, mode), mode)
        return self.compiled_set(key, mode) is not None

    def install(self, active: Sequence[str], compiled: CompiledSet | None, mode: str = "release") -> None:
        """Keep `compiled` as the serving path for `active` in exit mode `mode` (None: it does not compile; serve
        it eagerly)."""
        key = self._compiled_key(active, mode)
        self._compiled[key] = compiled
        self._compiled.move_to_end(key)
        while len(self._compiled) > COMPILED_SETS_KEPT:
            self._compiled.popitem(last=False)

    def has_compiled(self, active: Sequence[str], mode: str = "release") -> bool:
        """Whether this set was compiled or refused (or needs no compiling): nothing is left to wait for."""
        return self._compiled_key(active, mode) in self._compiled

    def compiled_set(self, active: Sequence[str], mode: str = "release") -> CompiledSet | None:
        return self._compiled.get(self._compiled_key(active, mode))

    def compiled_sets(self) -> list[CompiledSet]:
        """The compiled sets held in memory (of every exit mode), least recently installed first."""
        return [compiled for compiled in self._compiled.values() if compiled is not None]

    def _compiled_key(self, active: Sequence[str], mode: str) -> tuple[str, tuple[str, ...]]:
        """A set's entry in memory: its exit mode and its sites in model order."""
        return mode, self.backend.ordered_cuts(active)

    def learn(self, final_labels: np.ndarray, reached: dict[str, np.ndarray] | None = None) -> list[str]:
        """Update the cache ramps that `run` last evaluated with the batch's final labels (online cache updates:
        the final answer of an input that ran to the end is known). In stop mode, `reached` gives per active site
        the batch rows its ramp evaluated (those still in the batch there), and a row that left the batch before
        its end has a negative final label (`UNREACHED`): it teaches nothing. Returns the sites updated."""
        updated = []
        for site, ramp in self.ramps.items():
            if ramp.spec.kind != "cache":
                continue
            labels = final_labels
            if reached is not None and site in reached:
                if not len(reached[site]):  # every input left before it: it evaluated nothing this batch
                    continue
                labels = final_labels[reached[site]]
            if ramp.learn(labels):
                updated.append(site)
        return updated

    def memory_bytes(self) -> dict[str, int]:
        """What each cache ramp holds in memory (bounded: online updates never grow it)."""
        return {site: ramp.memory_bytes() for site, ramp in self.ramps.items() if ramp.spec.kind == "cache"}
