"""Compiled serving paths: one active-ramp set as a single TorchScript module that runs its stages, with each
ramp fused into the stage that ends at its site, and hands control back to Python only where an input may exit.

Measured on resnet18-fmnist at batch 1 (1.2 ms), every Python step between two compiled stages costs several
times what it costs in a loop, because the stage before it has evicted the interpreter's working set: a stage
call, two `.numpy()` calls and the executor's threshold comparison came to about 0.1 ms per ramp (8% of the
model), where the ramp's own operators take about 0.012 ms. A `SetRunner` keeps that loop inside TorchScript:
after each fused ramp it compares the rows' confidences with the exit floor it was given, and returns to Python
only when some row clears it (an early release is due) or at a ramp that stays in Python (a cache ramp).

A compiled set is made once (in a compile worker process, see `serving.compiler`) and loaded by every server
that serves the same bundle with the same torch: an entry is keyed by the bundle's digest, the set, the error
score and the torch version, and its sha256 is checked before it is loaded. A corrupt entry is never loaded.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from rampserve.graph.torch_graph import torchscript_quietly

FORMAT = 3


class RunnerStage(nn.Module):
    """A stage, with the ramp at the site it ends at fused in (a `ScoredRamp`, or None), in the one signature a
    `SetRunner` calls: (activation, side input) -> (activation, each row's top label, its confidence = 1 - error
    score). `side` is the model's side input (an attention mask) or an empty tensor for models without one,
    passed on only to a stage that reads it. Without a fused ramp there are no labels and the confidence is above
    every exit floor, so that a runner returns to Python after this stage (both constants of the frozen graph:
    no operator runs for them)."""

    def __init__(self, stage: nn.Module, reads_side: bool, ramp: nn.Module | None) -> None:
        super().__init__()
        self.stage, self.reads_side, self.ramp = stage, reads_side, ramp
        self.register_buffer("no_labels", torch.zeros(0, dtype=torch.long))
        self.register_buffer("returns", torch.full((1,), 2.0))

    def forward(self, activation: torch.Tensor, side: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        out = self.stage(activation, side) if self.reads_side else self.stage(activation)
        if self.ramp is None:
            return out, self.no_labels, self.returns
        labels, confidences = self.ramp(out)
        return out, labels, confidences


class SetRunner(nn.Module):
    """Runs `RunnerStage`s from `start`; after each stage but the last it returns when a row's confidence exceeds
    `floors[i]` (always, for a stage with no fused ramp). Returns the number of stages run so far, the last activation (the
    model's output once every stage ran), and the labels and confidences of the sites passed in this call."""

    __constants__ = ["sites"]

    def __init__(self, stages: Sequence[nn.Module]) -> None:
        super().__init__()
        self.stages = nn.ModuleList(stages)
        self.sites = len(stages) - 1  # a constant: the loop is unrolled and `i < self.sites` folds away

    def forward(self, activation: torch.Tensor, side: torch.Tensor, floors: list[float], start: int
                ) -> tuple[int, torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
        labels: list[torch.Tensor] = []
        confidences: list[torch.Tensor] = []
        i = 0
        for stage in self.stages:
            if i >= start:
                activation, site_labels, site_confidences = stage(activation, side)
                if i < self.sites:
                    labels.append(site_labels)
                    confidences.append(site_confidences)
                    if bool((site_confidences > floors[i]).any()):
                        return i + 1, activation, labels, confidences
            i += 1
        return i, activation, labels, confidences


@dataclass(frozen=True, eq=False)
class CompiledSet:
    """The serving path for one set of active sites (in model order): a scripted `SetRunner`, and per site
    whether its ramp is fused into the runner (else Python evaluates it on the activation the runner returns)."""

    sites: tuple[str, ...]
    runner: torch.jit.ScriptModule
    fused: tuple[bool, ...]


class CorruptEntry(Exception):
    """An on-disk compiled set that does not match its recorded digest: recompile it, never load it."""


def set_key(bundle_digest: str, sites: Sequence[str], score: str) -> str:
    """The on-disk name of a compiled set: what it was compiled from, and the torch that compiled it."""
    what = {"format": FORMAT, "bundle": bundle_digest, "sites": list(sites), "score": score,
            "torch": torch.__version__}
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:32]


def _write_atomically(path: Path, data: bytes) -> None:
    """A reader sees the whole file or none; of two writers of the same entry, either one's file stands."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent)
    with os.fdopen(fd, "wb") as out:
        out.write(data)
    os.replace(tmp, path)


def save_compiled(directory: Path, key: str, compiled: CompiledSet | None, refusal: str = "") -> None:
    """`<key>.pt` (the TorchScript archive) and `<key>.json` (its sha256, sites and fused flags; or why the set
    does not compile); the archive is written first, so an index never names an archive that is not there."""
    if compiled is None:
        index: dict = {"format": FORMAT, "refused": refusal or "refused"}
    else:
        buffer = io.BytesIO()
        with torchscript_quietly():
            torch.jit.save(compiled.runner, buffer)
        data = buffer.getvalue()
        _write_atomically(directory / f"{key}.pt", data)
        index = {"format": FORMAT, "sha256": hashlib.sha256(data).hexdigest(), "sites": list(compiled.sites),
                 "fused": list(compiled.fused)}
    _write_atomically(directory / f"{key}.json", json.dumps(index).encode())


def has_compiled(directory: Path, key: str) -> bool:
    return (directory / f"{key}.json").exists()


def load_compiled(directory: Path, key: str) -> CompiledSet | str:
    """The compiled set stored as `key`, or why it was refused. Raises FileNotFoundError where there is none and
    CorruptEntry where the archive does not match its index (it is hashed from the bytes it is loaded from, so
    what was checked is what runs). TorchScript archives are read by torch's own loader, which builds TorchScript
    modules and tensors only, never Python objects."""
    index_path = directory / f"{key}.json"
    text = index_path.read_text()
    try:
        index = json.loads(text)
        if not isinstance(index, dict) or index.get("format") != FORMAT:
            raise CorruptEntry(f"{index_path}: not a compiled set of this rampserve")
        if "refused" in index:
            return str(index["refused"])
        data = (directory / f"{key}.pt").read_bytes()
        if hashlib.sha256(data).hexdigest() != index.get("sha256"):
            raise CorruptEntry(f"{directory}/{key}.pt: its sha256 does not match {index_path.name}")
        with torchscript_quietly():
            runner = torch.jit.load(io.BytesIO(data))
        return CompiledSet(tuple(index["sites"]), runner, tuple(bool(f) for f in index["fused"]))
    except CorruptEntry:
        raise
    except (OSError, ValueError, KeyError, TypeError, RuntimeError) as exc:
        raise CorruptEntry(f"{directory}/{key}: {exc}") from exc


def remove_compiled(directory: Path, key: str) -> None:
    for suffix in (".json", ".pt"):
        (directory / f"{key}{suffix}").unlink(missing_ok=True)
