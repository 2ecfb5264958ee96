"""A torch model's compiled sets: one active-ramp set as a single TorchScript module that runs its stages, with
each ramp fused into the stage that ends at its site, straight through from the input to the output.

Every Python step between two compiled stages costs several times what it costs in a loop, because the stage
before it has evicted the interpreter's working set: on resnet18-fmnist at batch 1 a stage call, two `.numpy()`
calls and the executor's threshold comparison came to about 0.1 ms per ramp (8% of the model). And a runner that
returns to Python where an input might exit needs control flow around every stage, which cost more than the
ramps themselves (10 us at batch 1 and 45-60 us at batch 16 on resnet18-fmnist, with ramps that did nothing).
So a `SetRunner` never stops: each fused ramp (one `rampserve::ramp_exit` call, see `ramps.fused`) writes its
logits into the batch's ramp buffer and, where some row's confidence clears the exit floor it was given, writes
its column to a pipe; a releasing thread reads it, scores the column and releases those rows while the model
runs on (`serving.executor.batch`). A ramp that runs in Python is stashed (its activation copied) for that thread.

In the "stop" exit mode a set's runner is a `StopSetRunner` instead: the rows a fused ramp exits leave the batch
there (`rampserve::ramp_stop`), the others run on, and it returns the final output of the rows that ran to the
end with their batch rows. Rows the executor keeps (its feedback sample, requests that want the logits) never
stop. It is compiled and kept apart from the release-mode set of the same ramps (the mode is part of its key).

A compiled set is made once (in a compile worker process, see `serving.executor.compiler`) and loaded by every server
that serves the same bundle with the same torch and ramp operator: an entry is keyed by the bundle's digest, the
set, the error score, the torch version and the operator's build, and its sha256 is checked before it is
loaded. A corrupt entry is never loaded.
"""

from __future__ import annotations

import hashlib
import io
import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from rampserve.control.exit_rule import EXIT_MODES
from rampserve.graph.torch_graph import TRACE_GUARD, torchscript_quietly
from rampserve.ramps import kernel
from rampserve.ramps.fused import FusedRamp, fused_ramp
from rampserve.runtime.compiled import FORMAT, CompiledSet, CorruptEntry, RunnerArrays, read_entry, write_atomically, \
    write_entry

if TYPE_CHECKING:
    from rampserve.runtime.prepared import PreparedModel

# A TorchScript runner takes tensors over the buffers' memory; a ramp in Python is stashed into a tensor the
# ramp operator resizes
TENSORS = RunnerArrays(wrap=torch.from_numpy, unwrap=torch.Tensor.numpy, stash=lambda: torch.zeros(0),
                       no_side=torch.zeros(0))


class RunnerStage(nn.Module):
    """A traced stage, with the ramp at the site it ends at fused in (a `FusedRamp` or `StashedRamp`; None for the
    last stage), in the one signature a `SetRunner` calls: (activation, side input, ramp buffer, exit floor,
    notify pipe, stashes) -> activation. `side` is the model's side input (an attention mask) or an empty tensor
    for models without one, passed on only to a stage that reads it (a constant of the frozen graph)."""

    __constants__ = ["reads_side"]  # the stage is called one way only: the other is never compiled

    def __init__(self, stage: nn.Module, reads_side: bool, ramp: nn.Module | None) -> None:
        super().__init__()
        self.stage, self.reads_side, self.ramp = stage, reads_side, ramp

    def forward(self, activation: torch.Tensor, side: torch.Tensor, out: torch.Tensor, floor: float, notify: int,
                stashes: list[torch.Tensor]) -> torch.Tensor:
        if self.reads_side:
            activation = self.stage(activation, side)
        else:
            activation = self.stage(activation)
        if self.ramp is not None:
            self.ramp(activation, out, floor, notify, stashes)
        return activation

    def stop(self, activation: torch.Tensor, side: torch.Tensor, rows: torch.Tensor, out: torch.Tensor,
             floor: float, stop_floor: float, keep: torch.Tensor, left: torch.Tensor, notify: int,
             stashes: list[torch.Tensor], side_rows: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The stage for a `StopSetRunner`: the stage, then its ramp, which may take rows out of the batch; returns
        the activation, side input and batch rows of the rows that go on (the side input is selected with them
        where it has a row per input, `side_rows`)."""
        if self.reads_side:
            activation = self.stage(activation, side)
        else:
            activation = self.stage(activation)
        if self.ramp is not None:
            going = self.ramp.stop(activation, out, rows, keep, left, floor, stop_floor, notify, stashes)
            if going is not None and going.size(0) < activation.size(0):
                activation = activation.index_select(0, going)
                rows = rows.index_select(0, going)
                if side_rows:
                    side = side.index_select(0, going)
        return activation, side, rows


class SetRunner(nn.Module):
    """Runs `RunnerStage`s in order, stage i's ramp with exit floor `floors[i]` (one more floor than sites, for the
    last stage); returns the model's output. The ramps wrote their logits into `out` (or stashed their
    activations into `stashes`) and their columns to `notify` where some input may exit (< 0: nobody listens)."""

    def __init__(self, stages: Sequence[nn.Module]) -> None:
        super().__init__()
        self.stages = nn.ModuleList(stages)

    def forward(self, activation: torch.Tensor, side: torch.Tensor, out: torch.Tensor, floors: list[float],
                notify: int, stashes: list[torch.Tensor]) -> torch.Tensor:
        i = 0
        for stage in self.stages:
            activation = stage(activation, side, out, floors[i], notify, stashes)
            i += 1
        return activation


class StopSetRunner(nn.Module):
    """Runs `RunnerStage`s in order as a `SetRunner` does, but the rows a fused ramp exits leave the batch there:
    stage i's ramp takes out the rows whose confidence exceeds `stop_floors[i]` and that `keep` (bool, per batch
    row) does not hold, recording the ramp's column for them in `left` (int64, per batch row, -1 for a row that
    does not leave); later stages run on the others only, and none runs once no row is left. Returns the last
    stage's output for the rows that ran to the end and their batch rows (int64, increasing). A stashed ramp
    never stops a row (its stash holds the rows running there)."""

    def __init__(self, stages: Sequence[nn.Module]) -> None:
        super().__init__()
        self.stages = nn.ModuleList(stages)

    def forward(self, activation: torch.Tensor, side: torch.Tensor, out: torch.Tensor, floors: list[float],
                stop_floors: list[float], keep: torch.Tensor, left: torch.Tensor, notify: int,
                stashes: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        rows = torch.arange(activation.size(0))
        side_rows = side.dim() > 0 and side.size(0) == activation.size(0)
        i = 0
        for stage in self.stages:
            if rows.size(0) > 0:
                activation, side, rows = stage.stop(activation, side, rows, out, floors[i], stop_floors[i], keep,
                                                    left, notify, stashes, side_rows)
            i += 1
        return activation, rows


def build_torchscript_set(model: PreparedModel, sites: tuple[str, ...], example: dict[str, np.ndarray], mode: str,
                          classes: int) -> CompiledSet | None:
    """`model`'s set of `sites` (in model order) traced with `example`: its stages traced, each stage that ends at an
    active site with that site's ramp fused in (the ramp operator, or a stash for a ramp that runs in Python), run
    by one scripted `SetRunner` (a `StopSetRunner` in the "stop" exit mode), frozen. None where a stage does not
    trace faithfully (see `trace_stages`) or the ramp operators could not be built; the caller checks the set
    against the eager model."""
    if sites and not kernel.available():
        return None
    shapes = {s.name: s.activation_shape for s in model.sites}
    backend = model.backend
    native = backend.native_feeds(example)
    with TRACE_GUARD.running():  # torch.jit.trace runs the model; fx's tracer must not patch it meanwhile
        traced = backend.split.traced(backend.split.build(sites), native)
        if traced is None:
            return None
        ramps = [fused_ramp(model.ramps[site], model.error_score, shapes[site], j) for j, site in enumerate(sites)]
        stages = [RunnerStage(stage.module, bool(stage.side_names), ramp) for stage, ramp in zip(traced, [*ramps, None])]
        with torchscript_quietly():
            runner = torch.jit.script(StopSetRunner(stages) if mode == "stop" else SetRunner(stages))
            # Frozen, the runner is one graph with its weights as constants: it loads in half the time, and without
            # the numeric optimizations it computes what its stages do (checked by the caller)
            runner = torch.jit.freeze(runner.eval(), optimize_numerics=False)
    return CompiledSet(sites, runner, tuple(isinstance(ramp, FusedRamp) for ramp in ramps), classes, mode=mode,
                       arrays=TENSORS)


def set_key(bundle_digest: str, sites: Sequence[str], score: str, mode: str = "release") -> str:
    """The on-disk name of a compiled set: what it was compiled from (its exit mode too), and the torch that
    compiled it."""
    what = {"format": FORMAT, "bundle": bundle_digest, "sites": list(sites), "score": score, "exit_mode": mode,
            "torch": torch.__version__, "ramp_operator": kernel.build_id() if kernel.available() else None}
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:32]


def save_compiled(directory: Path, key: str, compiled: CompiledSet | None, refusal: str = "") -> None:
    """`<key>.pt` (the TorchScript archive) and `<key>.json` (its index: sites, fused flags; or why the set does not
    compile)."""
    if compiled is None:
        write_atomically(directory / f"{key}.json", json.dumps({"format": FORMAT, "refused": refusal or "refused"})
                         .encode())
        return
    buffer = io.BytesIO()
    with torchscript_quietly():
        torch.jit.save(compiled.runner, buffer)
    write_entry(directory, key, ".pt", buffer.getvalue(), {
        "sites": list(compiled.sites), "fused": list(compiled.fused), "classes": compiled.classes,
        "exit_mode": compiled.mode})


def load_compiled(directory: Path, key: str) -> CompiledSet | str:
    """The compiled set stored as `key`, or why it was refused. Raises FileNotFoundError where there is none and
    CorruptEntry where the archive does not match its index (`read_entry`). TorchScript archives are read by torch's
    own loader, which builds TorchScript modules and tensors only, never Python objects."""
    index, data = read_entry(directory, key, ".pt")
    if data is None:
        return str(index["refused"])
    try:
        kernel.available()  # a fused ramp calls the ramp operator: it must be registered before the archive loads
        with torchscript_quietly():
            runner = torch.jit.load(io.BytesIO(data))
        mode = str(index.get("exit_mode", "release"))
        if mode not in EXIT_MODES:
            raise CorruptEntry(f"{directory}/{key}.json: unknown exit mode {mode!r}")
        return CompiledSet(tuple(index["sites"]), runner, tuple(bool(f) for f in index["fused"]),
                           int(index["classes"]), mode=mode, from_disk=True, arrays=TENSORS)
    except CorruptEntry:
        raise
    except (ValueError, KeyError, TypeError, RuntimeError) as exc:
        raise CorruptEntry(f"{directory}/{key}: {exc}") from exc
