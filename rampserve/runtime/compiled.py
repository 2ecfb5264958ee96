"""Compiled serving paths: one active-ramp set as a single TorchScript module that runs its stages, with each
ramp fused into the stage that ends at its site, straight through from the input to the output.

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

An ONNX model's set is an `OnnxSetRunner` with the same signature: its stages' sessions, each linear ramp inside
the session of the stage that ends at its site, built in the serving process; or, where every ramp of the set
fuses, the whole model in one session whose ramps signal (`runtime.onnx_signals`), whose graph, optimized for this
machine, is kept on disk beside the torch sets once built (0.1-1.7 s on the zoo's models, the check against the
model included) and loaded with ONNX Runtime's optimizations off.

A compiled set is made once (in a compile worker process, see `serving.executor.compiler`) and loaded by every server
that serves the same bundle with the same torch and ramp operator: an entry is keyed by the bundle's digest, the
set, the error score, the torch version and the operator's build, and its sha256 is checked before it is
loaded. A corrupt entry is never loaded.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import tempfile
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import numpy as np
import torch
from torch import nn

from rampserve.control.exit_rule import EXIT_MARGIN, EXIT_MODES, NEVER_STOP, STOP_MARGIN, exit_floor
from rampserve.graph.torch_graph import torchscript_quietly
from rampserve.paths import home
from rampserve.ramps import kernel

if TYPE_CHECKING:
    from rampserve.runtime.onnx_signals import OnnxSignalledRunner

FORMAT = 5


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


class OnnxSetRunner:
    """One active-ramp set of an ONNX model, called as a `SetRunner` is: its stages' sessions in turn, each that
    ends at an active site computing that site's ramp as extra outputs (`ramps.onnx_fused`). After each, the
    ramp's logits go into `out` and, where the batch's highest confidence clears the exit floor, its column to
    `notify`; a ramp that runs in Python has the activation stashed and its column written always. Python runs
    between the sessions (ONNX Runtime cannot hand a value out in the middle of one), but it only copies the
    logits and compares one number: scoring waits for the releasing thread, or for the answers to be out."""

    def __init__(self, stages: Sequence, side_name: str | None) -> None:
        self.stages, self.side_name = list(stages), side_name
        self.tapped = tuple(bool(stage.tap_outputs) for stage in self.stages[:-1])  # per site: its ramp is fused

    def forward(self, activation: torch.Tensor, side: torch.Tensor, out: torch.Tensor, floors: list[float],
                notify: int, stashes: list[torch.Tensor]) -> torch.Tensor:
        value = activation.numpy()
        sides = {} if self.side_name is None else {self.side_name: side.numpy()}
        logits = out.numpy()
        for column, (stage, tapped) in enumerate(zip(self.stages, self.tapped)):
            if tapped:
                value, logits[:, column], confidence = stage.tapped(value, sides)
                if notify >= 0 and confidence > floors[column]:
                    os.write(notify, bytes((column,)))
            else:
                value = stage(value, sides)
                stashes[column] = torch.from_numpy(value)  # a fresh array of the session's: nothing overwrites it
                if notify >= 0:
                    os.write(notify, bytes((column,)))
        return torch.from_numpy(self.stages[-1](value, sides))


@dataclass(frozen=True, eq=False)
class RampBuffers:
    """Where a compiled run's ramps leave their outputs: the ramps' logits, (rows, sites, classes), as a tensor
    and an array over the same memory, and per site the stash a ramp in Python gets its activation in (a tensor
    the stash resizes; empty for a fused ramp's site)."""

    logits_tensor: torch.Tensor
    logits: np.ndarray
    stashes: list[torch.Tensor]
    # Stop mode: per batch row, the column of the ramp it left the batch at, or -1 (a tensor and an array over the
    # same memory; the runner writes it, the releasing thread reads it)
    left_tensor: Optional[torch.Tensor] = None
    left: Optional[np.ndarray] = None

    def reached(self, column: int) -> np.ndarray:
        """Stop mode: the batch rows that reached the set's `column`-th ramp (in order: a stash holds these), read
        once the run has passed it (rows leave only at later ramps meanwhile)."""
        left = self.left
        return np.flatnonzero((left < 0) | (left >= column))


@dataclass(frozen=True, eq=False)
class CompiledSet:
    """The serving path for one set of active sites (in model order): a scripted `SetRunner` (or an
    `OnnxSetRunner`), per site whether its ramp is fused into the runner (else it is stashed for Python to
    evaluate), and the width of the ramps' logits.

    It also keeps what a batch would otherwise build again on the serving path: the runner's script method
    (called directly, it skips `nn.Module.__call__`, and with it fx's patch of that while a model is traced),
    the exit floors for the thresholds in force, and the ramp buffers per thread and batch size, reused from
    batch to batch (a fresh buffer made each batch 10 us slower at batch 1: measured)."""

    sites: tuple[str, ...]
    runner: torch.jit.ScriptModule | OnnxSetRunner | OnnxSignalledRunner
    fused: tuple[bool, ...]
    classes: int
    exit_margin: float = EXIT_MARGIN  # how far below 1 - threshold a ramp's confidence still signals
    mode: str = "release"  # "stop": a `StopSetRunner`, whose exited rows leave the batch
    from_disk: bool = False  # loaded from the on-disk cache (made before, by a compile worker or an earlier build)
    run: Callable = field(init=False, repr=False)
    _floors: list = field(default_factory=lambda: [(None, [])], init=False, repr=False)  # [(key, floors)]
    _stop_floors: list = field(default_factory=lambda: [(None, [])], init=False, repr=False)
    _buffers: dict = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "run", self.runner.forward)

    def floors(self, thresholds: tuple[float, ...] | None) -> list[float]:
        """The runner's exit floor per site for `thresholds` (in `sites`' order; None: no input exits anywhere),
        and one for the last stage: below the confidence of every input the exit rule releases, by the margin
        that covers the rounding of two computations of the confidence from the same logits (`exit_floor`)."""
        return self._floors_for(self._floors, thresholds, -self.exit_margin)

    def _floors_for(self, cache: list, thresholds: tuple[float, ...] | None, offset: float) -> list[float]:
        """`exit_floor` with `offset` per site (never for no thresholds) and never for the last stage, kept in
        `cache` for the thresholds last asked for."""
        cached_key, floors = cache[0]  # one item, read and replaced whole: threads may share a set
        if cached_key != thresholds or not floors:
            if thresholds is None:
                floors = [NEVER_STOP] * (len(self.sites) + 1)
            else:
                floors = [exit_floor(t, offset) for t in thresholds] + [NEVER_STOP]
            cache[0] = (thresholds, floors)
        return floors

    @property
    def stops(self) -> bool:
        """Whether the runner takes exited rows out of the batch (a `StopSetRunner`)."""
        return self.mode == "stop"

    def stop_floors(self, thresholds: tuple[float, ...] | None) -> list[float]:
        """A `StopSetRunner`'s stop floor per site for `thresholds` (and one for the last stage): a row leaves where
        its confidence exceeds 1 - threshold by `STOP_MARGIN`, so that the error-score test certainly releases it
        (`floors` is below it: every ramp that stops a row also signals)."""
        return self._floors_for(self._stop_floors, thresholds, STOP_MARGIN)

    def buffers(self, rows: int) -> RampBuffers:
        """The ramp buffers for a batch of `rows` on this thread. Their contents last until this thread's next
        batch of that size on this set."""
        key = (threading.get_ident(), rows)
        found = self._buffers.get(key)
        if found is None:
            logits = torch.empty((rows, len(self.sites), self.classes)) if self.sites else torch.zeros(0)
            left = torch.full((rows,), -1, dtype=torch.int64) if self.stops else None
            found = self._buffers[key] = RampBuffers(logits, logits.numpy(), [torch.zeros(0) for _ in self.sites],
                                                     left, None if left is None else left.numpy())
        return found


class CorruptEntry(Exception):
    """An on-disk compiled set that does not match its recorded digest: recompile it, never load it."""


def set_key(bundle_digest: str, sites: Sequence[str], score: str, mode: str = "release") -> str:
    """The on-disk name of a compiled set: what it was compiled from (its exit mode too), and the torch that
    compiled it."""
    what = {"format": FORMAT, "bundle": bundle_digest, "sites": list(sites), "score": score, "exit_mode": mode,
            "torch": torch.__version__, "ramp_operator": kernel.build_id() if kernel.available() else None}
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:32]


def compiled_dir(bundle_dir: Path, digest: str) -> Path:
    """Where a bundle's compiled sets are kept: next to the bundle; under rampserve's home where the bundle's directory
    cannot be written."""
    beside = bundle_dir / "compiled"
    try:
        beside.mkdir(exist_ok=True)
        if os.access(beside, os.W_OK):
            return beside
    except OSError:
        pass
    elsewhere = home() / "compiled" / digest
    elsewhere.mkdir(parents=True, exist_ok=True)
    return elsewhere


def write_atomically(path: Path, data: bytes) -> None:
    """A reader sees the whole file or none; of two writers of the same entry, either one's file stands."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent)
    with os.fdopen(fd, "wb") as out:
        out.write(data)
    os.replace(tmp, path)


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


def write_entry(directory: Path, key: str, suffix: str, data: bytes, index: dict) -> None:
    """A compiled set on disk: `<key><suffix>` (its data), then `<key>.json` (`index` with the data's sha256), so
    that an index never names data that is not there."""
    write_atomically(directory / f"{key}{suffix}", data)
    index = {"format": FORMAT, "sha256": hashlib.sha256(data).hexdigest(), **index}
    write_atomically(directory / f"{key}.json", json.dumps(index).encode())


def _read_index(directory: Path, key: str) -> dict:
    index_path = directory / f"{key}.json"
    text = index_path.read_text()
    try:
        index = json.loads(text)
    except ValueError as exc:
        raise CorruptEntry(f"{directory}/{key}: {exc}") from exc
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise CorruptEntry(f"{index_path}: not a compiled set of this rampserve")
    return index


def _check_digest(directory: Path, key: str, suffix: str, index: dict, digest: str) -> None:
    if digest != index.get("sha256"):
        raise CorruptEntry(f"{directory}/{key}{suffix}: its sha256 does not match {key}.json")


def read_entry(directory: Path, key: str, suffix: str) -> tuple[dict, bytes | None]:
    """A compiled set's index and data (None where the index says why the set does not compile). Raises
    FileNotFoundError where there is no index and CorruptEntry where the data does not match it (it is hashed from
    the bytes returned, so what was checked is what loads)."""
    index = _read_index(directory, key)
    if "refused" in index:
        return index, None
    try:
        data = (directory / f"{key}{suffix}").read_bytes()
    except OSError as exc:
        raise CorruptEntry(f"{directory}/{key}: {exc}") from exc
    _check_digest(directory, key, suffix, index, hashlib.sha256(data).hexdigest())
    return index, data


@contextlib.contextmanager
def opened_entry(directory: Path, key: str, suffix: str) -> Iterator[tuple[dict, str | None]]:
    """As `read_entry`, for a loader that reads a file itself: the data as a path, `/proc/self/fd/N`, naming the very
    file whose sha256 was checked (held open until the context ends, so that a set written again under its name
    meanwhile is not what loads). Why not bytes: ONNX Runtime parses a graph handed as bytes holding the GIL
    (minilm-rt's 91 MB: 33 ms in which the executor's thread cannot take it), one it reads from a file without it;
    hashing from the file releases the GIL too."""
    index = _read_index(directory, key)
    if "refused" in index:
        yield index, None
        return
    try:
        data = open(directory / f"{key}{suffix}", "rb")  # noqa: SIM115 - open while the caller loads from it
    except OSError as exc:
        raise CorruptEntry(f"{directory}/{key}: {exc}") from exc
    with data:
        _check_digest(directory, key, suffix, index, hashlib.file_digest(data, "sha256").hexdigest())
        yield index, f"/proc/self/fd/{data.fileno()}"


def has_compiled(directory: Path, key: str) -> bool:
    return (directory / f"{key}.json").exists()


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
                           int(index["classes"]), mode=mode, from_disk=True)
    except CorruptEntry:
        raise
    except (ValueError, KeyError, TypeError, RuntimeError) as exc:
        raise CorruptEntry(f"{directory}/{key}: {exc}") from exc


def remove_compiled(directory: Path, key: str) -> None:
    for suffix in (".json", ".pt", ".onnx"):
        (directory / f"{key}{suffix}").unlink(missing_ok=True)
