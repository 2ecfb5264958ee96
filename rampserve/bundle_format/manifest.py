"""A bundle's manifest and signature, read without torch: what a server's front end needs to serve a bundle whose
model an executor process loads (`serving.shared.models.described_bundle`). The names of a bundle's files, and the
digests that every reader checks, are kept here; writing bundles and loading their models is `runtime.bundle`'s."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Collection
from pathlib import Path

import numpy as np
import safetensors.numpy

from rampserve.bundle_format.signature import ModelSignature

FORMAT = "rampserve-bundle"
# 2: linear ramp heads are a bare Linear; 3: and keep their center. The signature and example inputs came later
# without a new version: a reader of format 3 that predates them ignores them and loads the bundle as before
# (rampserve processes of both ages share the zoo's bundle cache), and this one loads bundles without them.
FORMAT_VERSION = 3
MANIFEST = "manifest.json"
RAMPS_FILE = "ramps.safetensors"
TORCH_WEIGHTS = "model.safetensors"
ONNX_FILE = "model.onnx"
EXAMPLE_FILE = "example.safetensors"
# A text model's tokenizer as its token inputs were made (`bundle_format.text`); an hf checkpoint's own
# tokenizer.json, which its bundle carries too, is the file as the user saved it
TEXT_TOKENIZER_FILE = "text-tokenizer.json"
# Every site's ramp's top label and error score, and the model's own label, on the inputs the ramps were validated on:
# a server's controller takes its first thresholds from them (`control.records.validation_record`). Bundles came
# without it before, without a new format version: a reader that predates it ignores it
VALIDATION_FILE = "validation.safetensors"
VALIDATION_ARRAYS = ("labels", "errors", "final")  # (inputs, sites) in the manifest's site order, twice; (inputs,)


class BundleError(ValueError):
    """A bundle that is missing, corrupt, or made for something this rampserve cannot load."""


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def read_manifest(bundle_dir: Path, digests: Collection[str] | None = None) -> dict:
    """The bundle's manifest, once every file it lists is there and the digests of those named in `digests` (None:
    all of them) match it."""
    path = Path(bundle_dir) / MANIFEST
    if not path.is_file():
        raise BundleError(f"{bundle_dir} is not a rampserve bundle: {MANIFEST} is missing")
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BundleError(f"{path} is corrupt: not valid JSON ({exc})") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise BundleError(f"{path} is not a rampserve bundle manifest (format {manifest.get('format')!r})"
                          if isinstance(manifest, dict) else f"{path} is not a rampserve bundle manifest")
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        raise BundleError(f"{bundle_dir} has bundle format {version}; this rampserve reads format "
                          f"{FORMAT_VERSION}: prepare the model again")
    for name, expected in manifest.get("files", {}).items():
        file = Path(bundle_dir) / name
        if not file.is_file():
            raise BundleError(f"{bundle_dir} is incomplete: {name} is missing")
        if (digests is None or name in digests) and file_digest(file) != expected:
            raise BundleError(f"{bundle_dir}/{name} is corrupt: its sha256 does not match the manifest")
    return manifest


def read_signature(bundle_dir: Path, manifest: dict) -> ModelSignature | None:
    """The bundle's signature with its example inputs (and a text model's tokenizer); None for a bundle prepared
    before bundles carried them."""
    if "signature" not in manifest:
        return None
    if EXAMPLE_FILE not in manifest["files"]:
        raise BundleError(f"{bundle_dir}/{MANIFEST} has a signature but lists no {EXAMPLE_FILE}")
    tokenizer = (bundle_dir / TEXT_TOKENIZER_FILE).read_text() if TEXT_TOKENIZER_FILE in manifest["files"] else None
    try:
        return ModelSignature.from_json(manifest["signature"], safetensors.numpy.load_file(bundle_dir / EXAMPLE_FILE),
                                        tokenizer)
    except (KeyError, TypeError, ValueError) as exc:
        raise BundleError(f"{bundle_dir}: its signature is incomplete or does not fit its example inputs: {exc!r}"
                          ) from exc


def read_validation(bundle_dir: Path, manifest: dict) -> dict[str, np.ndarray] | None:
    """The bundle's validation outputs (`VALIDATION_FILE`), or None for a bundle prepared before bundles kept them."""
    if VALIDATION_FILE not in manifest.get("files", {}):
        return None
    arrays = safetensors.numpy.load_file(Path(bundle_dir) / VALIDATION_FILE)
    sites, inputs = len(manifest["sites"]), len(arrays.get("final", ()))
    shapes = {"labels": (inputs, sites), "errors": (inputs, sites), "final": (inputs,)}
    if sorted(arrays) != sorted(VALIDATION_ARRAYS) or any(arrays[k].shape != shapes[k] for k in VALIDATION_ARRAYS):
        raise BundleError(f"{bundle_dir}/{VALIDATION_FILE} does not hold {shapes} for its {sites} sites: "
                          f"{ {k: v.shape for k, v in arrays.items()} }")
    return arrays


def answering_files(manifest: dict) -> dict[str, str]:
    """The digests of the files a bundle's answers come from (model, ramps, example inputs, tokenizers): every file
    its manifest lists but the validation outputs, which are such answers, kept (a bundle given them later answers
    as before)."""
    return {name: digest for name, digest in manifest.get("files", {}).items() if name != VALIDATION_FILE}


def bundle_digest(bundle_dir: Path) -> str:
    """What a bundle's compiled serving paths depend on: the sha256 of its model and ramp files and of the example
    inputs they are traced and checked with (a new profile or validation outputs leave them as they are), as its
    manifest records them (whatever loads those files checks them: hashing them again here cost a start 0.1-0.2 s)."""
    files = answering_files(read_manifest(bundle_dir, digests=()))
    return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()
