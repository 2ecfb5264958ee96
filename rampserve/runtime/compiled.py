"""Compiled serving paths: one active-ramp set run straight through from the input to the output, each ramp fused
into the model's run. What is common to the two backends' sets lives here (the set and its buffers, the on-disk
store of sets, and an ONNX model's set cut into stages), free of torch; a torch model's TorchScript sets are
`runtime.torchscript_sets`'.

An ONNX model's set is an `OnnxSetRunner` with the same signature: its stages' sessions, each linear ramp inside
the session of the stage that ends at its site, built in the serving process; or, where every ramp of the set
fuses, the whole model in one session whose ramps signal (`runtime.onnx_signals`), whose graph, optimized for this
machine, is kept on disk beside the torch sets once built (0.1-1.7 s on the zoo's models, the check against the
model included) and loaded with ONNX Runtime's optimizations off.

Sets are kept on disk beside their bundle: an entry is its data and an index naming the data's sha256, checked
before it is loaded. A corrupt entry is never loaded.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np

from rampserve.control.exit_rule import EXIT_MARGIN, NEVER_STOP, STOP_MARGIN, exit_floor
from rampserve.paths import home

FORMAT = 5


@dataclass(frozen=True)
class RunnerArrays:
    """How a set's runner takes arrays and gives them back: NumPy's own (an ONNX set), or torch tensors over the
    same memory (a TorchScript set, `runtime.torchscript_sets.TENSORS`)."""

    wrap: Callable[[np.ndarray], Any]  # an array as the runner takes it, sharing its memory
    unwrap: Callable[[Any], np.ndarray]  # what the runner gives back, as an array
    stash: Callable[[], Any]  # where a ramp that runs in Python is handed its activation (the runner fills it)
    no_side: Any  # the side input of a model without one


ARRAYS = RunnerArrays(wrap=lambda array: array, unwrap=lambda array: array, stash=lambda: None, no_side=None)


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

    def forward(self, activation: np.ndarray, side: np.ndarray | None, logits: np.ndarray, floors: list[float],
                notify: int, stashes: list[np.ndarray | None]) -> np.ndarray:
        value = activation
        sides = {} if self.side_name is None else {self.side_name: side}
        for column, (stage, tapped) in enumerate(zip(self.stages, self.tapped)):
            if tapped:
                value, logits[:, column], confidence = stage.tapped(value, sides)
                if notify >= 0 and confidence > floors[column]:
                    os.write(notify, bytes((column,)))
            else:
                value = stage(value, sides)
                stashes[column] = value  # a fresh array of the session's: nothing overwrites it
                if notify >= 0:
                    os.write(notify, bytes((column,)))
        return self.stages[-1](value, sides)


@dataclass(frozen=True, eq=False)
class RampBuffers:
    """Where a compiled run's ramps leave their outputs: the ramps' logits, (rows, sites, classes), as the runner
    takes them and as an array over the same memory, and per site the stash a ramp in Python gets its activation in
    (`RunnerArrays.stash`; unused for a fused ramp's site)."""

    runner_logits: Any
    logits: np.ndarray
    stashes: list
    # Stop mode: per batch row, the column of the ramp it left the batch at, or -1 (as the runner takes it and an
    # array over the same memory; the runner writes it, the releasing thread reads it)
    runner_left: Any = None
    left: Optional[np.ndarray] = None

    def reached(self, column: int) -> np.ndarray:
        """Stop mode: the batch rows that reached the set's `column`-th ramp (in order: a stash holds these), read
        once the run has passed it (rows leave only at later ramps meanwhile)."""
        left = self.left
        return np.flatnonzero((left < 0) | (left >= column))


@dataclass(frozen=True, eq=False)
class CompiledSet:
    """The serving path for one set of active sites (in model order): a scripted `SetRunner` (or an ONNX runner),
    per site whether its ramp is fused into the runner (else it is stashed for Python to evaluate), the width of the
    ramps' logits, and how the runner takes arrays.

    It also keeps what a batch would otherwise build again on the serving path: the runner's script method
    (called directly, it skips `nn.Module.__call__`, and with it fx's patch of that while a model is traced),
    the exit floors for the thresholds in force, and the ramp buffers per thread and batch size, reused from
    batch to batch (a fresh buffer made each batch 10 us slower at batch 1: measured)."""

    sites: tuple[str, ...]
    runner: Any  # a scripted `SetRunner` or `StopSetRunner`, an `OnnxSetRunner` or a signalled ONNX runner
    fused: tuple[bool, ...]
    classes: int
    exit_margin: float = EXIT_MARGIN  # how far below 1 - threshold a ramp's confidence still signals
    mode: str = "release"  # "stop": its runner's exited rows leave the batch
    from_disk: bool = False  # loaded from the on-disk cache (made before, by a compile worker or an earlier build)
    arrays: RunnerArrays = ARRAYS
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
        """Whether the runner takes exited rows out of the batch (a `StopSetRunner`, an ONNX stopping runner)."""
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
            wrap = self.arrays.wrap
            logits = np.empty((rows, len(self.sites), self.classes), np.float32) if self.sites else \
                np.zeros(0, np.float32)
            left = np.full(rows, -1, np.int64) if self.stops else None
            found = self._buffers[key] = RampBuffers(wrap(logits), logits, [self.arrays.stash() for _ in self.sites],
                                                     None if left is None else wrap(left), left)
        return found


class CorruptEntry(Exception):
    """An on-disk compiled set that does not match its recorded digest: recompile it, never load it."""


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


def remove_compiled(directory: Path, key: str) -> None:
    for suffix in (".json", ".pt", ".onnx"):
        (directory / f"{key}{suffix}").unlink(missing_ok=True)
