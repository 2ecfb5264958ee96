"""Finding a served model and loading the model itself where it runs: a bundle directory or a zoo model's bundle,
described from its manifest (`shared.models.described_bundle`), and loaded (with torch or ONNX Runtime) by what
runs it. The front end never imports this: the server hands it what it found. The server's own process finds models
here without loading one, so torch is imported only by the calls that load (a test holds the server to it)."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from rampserve.serving.shared.models import VERSION, ServedModel, described_bundle, served_model

if TYPE_CHECKING:
    from rampserve.runtime.prepared import PreparedModel


def load_served(ref: str) -> ServedModel:
    """A bundle directory, or a zoo model's bundle (prepared on first use)."""
    path = Path(ref)
    if path.is_dir():
        return read_served(path, path.name)
    return read_served(zoo_bundle_dir(ref), ref)


def zoo_bundle_dir(name: str) -> Path:
    """The bundle of zoo model `name`, found (or prepared) by a process of its own: checking the zoo's cache reads
    the model's workload, and preparing trains it, with torch, none of which a server should keep."""
    found = subprocess.run([sys.executable, "-m", "rampserve.runtime.zoo_bundles", name], stdout=subprocess.PIPE,
                           text=True)
    if found.returncode:
        raise ValueError(f"{name} is not a bundle directory, and no zoo model's bundle could be found or prepared "
                         "for it (the error above says why)")
    return Path(found.stdout.strip().splitlines()[-1])


def read_served(bundle_dir: Path, name: str, version: str = VERSION) -> ServedModel:
    """A bundle as a server serves it, its model loaded only where it runs; a bundle prepared before bundles
    carried their signature is loaded here, to derive it (see `served`)."""
    described = described_bundle(bundle_dir, name, version)
    if described is None:
        from rampserve.runtime.bundle import load_bundle

        return served(name, load_bundle(Path(bundle_dir)), version)
    return described


def served(name: str, model: PreparedModel, version: str = VERSION) -> ServedModel:
    """The model behind the signature it carries (prepare gives a model one, its bundle keeps it)."""
    signature = model.signature
    if signature is None:
        # A bundle prepared before bundles carried their signature served wherever its workload was: it still does
        # there (deriving it as prepare does), and elsewhere the error says to prepare it again
        from rampserve.runtime.prepare import signature_from_workload  # reads workloads, which serving need not

        signature = signature_from_workload(model)
    return served_model(name, signature, model.backend.kind, model.profile, model.bundle_dir, version, model)


def loaded(served: ServedModel) -> ServedModel:
    """The served model with the model itself, loaded from its bundle unless it already holds it."""
    if served.prepared is not None:
        return served
    from rampserve.runtime.bundle import load_bundle

    return replace(served, prepared=load_bundle(served.bundle_dir))
