"""A prepared model: the user's model split at its sites, a ramp per site, and a latency profile."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from rampserve.graph.torch_graph import TRACE_GUARD, ModuleStage, torchscript_quietly, trace_stages
from rampserve.ramps.cache import CacheRamp
from rampserve.ramps.fused import scored_ramp
from rampserve.ramps.kinds import Ramp, RampSpec
from rampserve.runtime.backends import Backend
from rampserve.runtime.compiled import CompiledSet, RunnerStage, SetRunner
from rampserve.runtime.profile import LatencyProfile

# Called after each active ramp with the site's name, every input's top label and error score.
RampCallback = Callable[[str, np.ndarray, np.ndarray], None]
# Fused ramps a compiled run passed without returning to Python: (site, labels, confidences)
LateReports = list[tuple[str, torch.Tensor, torch.Tensor]]
# Compiled sets kept in memory per model. A set loaded from disk holds its own copy of the weights, so this
# bounds memory; the set a server is running is held by the server, whatever is evicted here.
COMPILED_SETS_KEPT = 16
# Slack on "no input of this ramp can exit" (see `PreparedModel.run_serving`): well above float32's rounding near 1
EXIT_MARGIN = 1e-6
# Exit floors for a `SetRunner`: confidences lie in [0, 1], so it stops at every ramp or at none
ALWAYS_STOP, NEVER_STOP = -1.0, 2.0
RUNNER_SIDE = "side"  # the name a runner's stages take the model's side input under while they are traced
NO_SIDE_INPUT = torch.zeros(0)


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


@dataclass
class PreparedModel:
    backend: Backend
    sites: list[SiteInfo]
    ramps: dict[str, Ramp | CacheRamp]
    profile: LatencyProfile | None = None
    meta: dict = field(default_factory=dict)  # source, encoder, training report, oracle statistics
    error_score: str = "max_prob"

    @property
    def site_names(self) -> list[str]:
        return [s.name for s in self.sites]

    bundle_dir: Path | None = None  # where the model was loaded from (what a compile worker process loads)
    _compiled: OrderedDict[tuple[str, ...], CompiledSet | None] = field(default_factory=OrderedDict, init=False,
                                                                       repr=False)

    def evaluate_ramp(self, site: str, activation: object) -> tuple[np.ndarray, np.ndarray]:
        """Every input's top label and error score from the ramp at `site`, given the site's activation as the
        backend computes it: the eager path's ramp (the reference the fused ramps are tested against)."""
        return self.ramps[site].evaluate(self.backend.to_tensor(activation), self.error_score)

    def run(self, feeds: dict[str, np.ndarray], active: Sequence[str] = (),
            on_ramp: RampCallback | None = None, compiled: bool | CompiledSet = False,
            thresholds: Sequence[float] | None = None) -> np.ndarray:
        """Run the model, evaluating the active ramps as their sites are computed and reporting every input's
        top label and error score to `on_ramp`. Returns the original model's output (logits). `compiled`: run
        the compiled set made for these ramps (True: the one `compile` or `install` left, if any; or the set
        itself), else the eager path. `thresholds`: see `run_serving`."""
        logits, late = self.run_serving(feeds, active, on_ramp, compiled, thresholds)
        self.report_late(late, on_ramp)
        return logits

    def run_serving(self, feeds: dict[str, np.ndarray], active: Sequence[str] = (),
                    on_ramp: RampCallback | None = None, compiled: bool | CompiledSet = False,
                    thresholds: Sequence[float] | None = None) -> tuple[np.ndarray, LateReports]:
        """`run` as the executor runs it. Given `thresholds` (per active site, in `active`'s order), a compiled
        set returns to Python only after a fused ramp where some input may exit (one whose confidence clears
        1 - threshold, less a margin for rounding) and at ramps that stay in Python; `on_ramp` hears of those at
        once. The other fused ramps, where no input can exit, are returned unreported with the logits: their
        labels and scores only feed the batch's record, so the executor releases the final answers first and
        reports them after (`report_late`). Each Python step between compiled stages costs several times its
        cost in a loop (the stage before evicted the interpreter's working set), so this keeps them off the
        path of inputs that do not exit."""
        if compiled is True:
            compiled = self.compiled_set(active)
        with TRACE_GUARD.running(), torch.inference_mode():
            if isinstance(compiled, CompiledSet):
                floors = None if thresholds is None else dict(zip(active, thresholds))
                return self._run_compiled(compiled, feeds, on_ramp, floors)

            def report(site: str, activation: object) -> None:
                labels, errors = self.evaluate_ramp(site, activation)
                if on_ramp is not None:
                    on_ramp(site, labels, errors)

            return self.backend.to_tensor(self.backend.run_hooked(feeds, active, report)).numpy(), []

    @staticmethod
    def report_late(late: LateReports, on_ramp: RampCallback | None) -> None:
        """Report the ramps `run_serving` returned unreported, in model order."""
        if on_ramp is not None:
            for site, labels, confidences in late:
                on_ramp(site, labels.numpy(), 1.0 - confidences.numpy())

    def _run_compiled(self, compiled: CompiledSet, feeds: dict[str, np.ndarray], on_ramp: RampCallback | None,
                      thresholds: dict[str, float] | None) -> tuple[np.ndarray, LateReports]:
        activation, side = self._runner_inputs(feeds)
        if on_ramp is None:
            floors = [NEVER_STOP] * len(compiled.sites)
        elif thresholds is None:
            floors = [ALWAYS_STOP] * len(compiled.sites)
        else:  # an input exits where 1 - confidence < threshold (never at threshold 0); the margin covers
            # the float32 rounding of 1 - confidence
            floors = [1.0 - thresholds[site] - EXIT_MARGIN if thresholds[site] > 0 else NEVER_STOP
                      for site in compiled.sites]
        late: LateReports = []
        start = 0
        while True:
            reached, activation, labels, confidences = compiled.runner(activation, side, floors, start)
            passed = list(zip(compiled.sites[start:reached], labels, confidences))
            if reached > len(compiled.sites):  # the runner ran to the output
                late += passed
                return activation.numpy(), late
            late += passed[:-1]  # sites it passed without stopping: no input can exit there
            site = compiled.sites[reached - 1]
            if on_ramp is not None:
                if compiled.fused[reached - 1]:
                    on_ramp(site, labels[-1].numpy(), 1.0 - confidences[-1].numpy())
                else:
                    on_ramp(site, *self.evaluate_ramp(site, activation))
            start = reached

    def _runner_inputs(self, feeds: dict[str, np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
        """The primary input and the one side input a `SetRunner` takes (empty for a model without one)."""
        primary, side = self.backend.split_feeds(feeds)
        return primary, next(iter(side.values())) if side else NO_SIDE_INPUT

    @property
    def compiles(self) -> bool:
        """Whether this model's serving path is compiled per set of active ramps (torch; ONNX Runtime sessions
        already run outside the interpreter)."""
        return self.backend.kind == "torch"

    def build_compiled(self, active: Sequence[str], example: dict[str, np.ndarray]) -> CompiledSet | None:
        """Compile the serving path for `active` with `example` as the example input: its stages traced, each
        stage that ends at an active site with that site's ramp fused in (unless the ramp stays in Python), run
        by one scripted `SetRunner`, frozen. None where the model does not compile: a stage that does not trace
        faithfully (see `trace_stages`), a model with more than one side input, or a frozen runner whose output
        is not bit for bit the eager model's on the example."""
        primary, *side_names = self.backend.input_names
        if not self.compiles or len(side_names) > 1:
            return None
        sites = self.backend.ordered_cuts(active)
        shapes = {s.name: s.activation_shape for s in self.sites}
        native = self.backend.native_feeds(example)
        side = {RUNNER_SIDE: native[side_names[0]] if side_names else NO_SIDE_INPUT}
        runner_stages, fused = [], []
        for i, stage in enumerate(self.backend.split.build(sites)):
            ramp = scored_ramp(self.ramps[sites[i]], self.error_score, shapes[sites[i]]) \
                if i < len(sites) else None
            runner_stages.append(ModuleStage(RunnerStage(stage.module, bool(stage.side_names), ramp), (RUNNER_SIDE,)))
            fused.append(ramp is not None)
        with TRACE_GUARD.running():  # torch.jit.trace runs the model; fx's tracer must not patch it meanwhile
            traced = trace_stages(runner_stages, native[primary], side)
            if traced is None:
                return None
            with torchscript_quietly():
                runner = torch.jit.script(SetRunner([stage.module for stage in traced]))
                # Frozen, the runner is one graph with its weights as constants: it loads in half the time, and
                # without the numeric optimizations it computes what its stages do (checked below)
                runner = torch.jit.freeze(runner.eval(), optimize_numerics=False)
            compiled = CompiledSet(sites, runner, tuple(fused[:len(sites)]))
            with torch.inference_mode():
                faithful = np.array_equal(self._run_compiled(compiled, example, None, None)[0],
                                          self.backend.to_tensor(self.backend.split.full(native)).numpy())
        return compiled if faithful else None

    def compile(self, active: Sequence[str], example: dict[str, np.ndarray]) -> bool:
        """Compile the serving path for these active ramps in this process, unless done before; whether
        `run(..., compiled=True)` with them runs compiled. Servers compile in a worker process instead
        (`compile_service`) and `install` what it made."""
        key = self.backend.ordered_cuts(active)
        if not self.has_compiled(key):
            self.install(key, self.build_compiled(key, example))
        return self.compiled_set(key) is not None

    def install(self, active: Sequence[str], compiled: CompiledSet | None) -> None:
        """Keep `compiled` as the serving path for `active` (None: it does not compile; serve it eagerly)."""
        key = self.backend.ordered_cuts(active)
        self._compiled[key] = compiled
        self._compiled.move_to_end(key)
        while len(self._compiled) > COMPILED_SETS_KEPT:
            self._compiled.popitem(last=False)

    def has_compiled(self, active: Sequence[str]) -> bool:
        """Whether this set was compiled or refused (or needs no compiling): nothing is left to wait for."""
        return not self.compiles or self.backend.ordered_cuts(active) in self._compiled

    def compiled_set(self, active: Sequence[str]) -> CompiledSet | None:
        return self._compiled.get(self.backend.ordered_cuts(active))

    def learn(self, final_labels: np.ndarray) -> list[str]:
        """Update the cache ramps that `run` last evaluated with the batch's final labels (online cache updates:
        every input ran to the end, so its final answer is known). Returns the sites updated."""
        return [site for site, ramp in self.ramps.items() if isinstance(ramp, CacheRamp) and ramp.learn(final_labels)]

    def memory_bytes(self) -> dict[str, int]:
        """What each cache ramp holds in memory (bounded: online updates never grow it)."""
        return {site: ramp.memory_bytes() for site, ramp in self.ramps.items() if isinstance(ramp, CacheRamp)}
