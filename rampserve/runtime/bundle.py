"""Prepared-model bundles on disk: a JSON manifest (with the model's v2 signature), the model's weights
(safetensors) or graph (ONNX), the ramps' weights, two example inputs (safetensors), a text model's tokenizer as it
made the token inputs, the ramps' and the model's answers on the inputs the ramps were validated on, and what
rebuilds the architecture without the model's source (a Hugging Face checkpoint's config.json and tokenizer.json).
Loading never unpickles anything, and checks every file's digest. Reading a bundle's manifest and signature alone
is `bundle_format.manifest`'s; loading an ONNX model whose ramps are linear or MLP ones imports no torch (its ramps
load as arrays, `ramps.arrays`)."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import numpy as np
import safetensors.numpy

from rampserve import __version__
from rampserve.bundle_format.latency import LatencyProfile
from rampserve.bundle_format.manifest import (
    EXAMPLE_FILE,
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    ONNX_FILE,
    RAMPS_FILE,
    TEXT_TOKENIZER_FILE,
    TORCH_WEIGHTS,
    VALIDATION_ARRAYS,
    VALIDATION_FILE,
    BundleError,
    file_digest,
    read_manifest,
    read_signature,
    read_validation,
)
from rampserve.bundle_format.signature import ModelSignature
from rampserve.ramps.arrays import RampArrays
from rampserve.ramps.specs import DENSE_KINDS, RampSpec
from rampserve.runtime.backends import OnnxBackend
from rampserve.runtime.compiled import write_atomically
from rampserve.runtime.engines import engine_of
from rampserve.runtime.prepared import PreparedModel, SiteInfo
from rampserve.runtime.sources import ModelSource, architecture_files, build_architecture


def save_bundle(model: PreparedModel, out_dir: Path) -> Path:
    """Write atomically: a half-written bundle never sits at `out_dir`."""
    if model.signature is None:
        raise ValueError("a bundle carries its model's signature and example inputs, and this model has none "
                         "(prepare gives a model one)")
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".bundle-", dir=out_dir.parent))
    try:
        backend = model.backend
        if isinstance(backend, OnnxBackend):
            shutil.copyfile(backend.path, tmp / ONNX_FILE)
            model_file = ONNX_FILE
        else:
            backend.save_weights(tmp / TORCH_WEIGHTS)
            model_file = TORCH_WEIGHTS
        ramp_state = {f"{site}/{k}": _array(v) for site, ramp in model.ramps.items()
                      for k, v in ramp.state_dict().items()}
        safetensors.numpy.save_file(ramp_state, tmp / RAMPS_FILE)
        signature_files = _signature_files(model.signature)
        if model.validation is not None:
            signature_files[VALIDATION_FILE] = _validation_bytes(model.validation)
        for name, data in signature_files.items():
            (tmp / name).write_bytes(data)
        carried = [] if "source" not in model.meta else architecture_files(ModelSource.from_json(model.meta["source"]))
        for file in carried:
            shutil.copyfile(file, tmp / file.name)
        manifest = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "rampserve_version": __version__,
            "backend": backend.kind,
            "input_names": backend.input_names,
            "signature": model.signature.to_json(),
            "sites": [s.to_json() for s in model.sites],
            "profile": model.profile.to_json() if model.profile else None,
            "error_score": model.error_score,
            "meta": model.meta,
            "files": {name: file_digest(tmp / name)
                      for name in (model_file, RAMPS_FILE, *signature_files, *(file.name for file in carried))},
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def write_profile(bundle_dir: Path, profile: LatencyProfile) -> None:
    """Replace a bundle's latency profile (the manifest is rewritten atomically; weights are untouched)."""
    manifest = read_manifest(bundle_dir)
    manifest["profile"] = profile.to_json()
    _rewrite_manifest(bundle_dir, manifest)


def _signature_files(signature: ModelSignature) -> dict[str, bytes]:
    """The files a bundle keeps its signature's example inputs and a text model's tokenizer in."""
    files = {EXAMPLE_FILE: safetensors.numpy.save(dict(signature.example))}
    if signature.text is not None:
        files[TEXT_TOKENIZER_FILE] = signature.text.tokenizer.to_str().encode()
    return files


def _validation_bytes(validation: dict[str, np.ndarray]) -> bytes:
    return safetensors.numpy.save({name: np.ascontiguousarray(validation[name]) for name in VALIDATION_ARRAYS})


def write_validation(bundle_dir: Path, validation: dict[str, np.ndarray]) -> None:
    """Give a bundle prepared before bundles kept their validation outputs those outputs (weights untouched; the
    file is written before the manifest that names it, each atomically, as `write_signature` does)."""
    bundle_dir = Path(bundle_dir)
    manifest = read_manifest(bundle_dir)
    write_atomically(bundle_dir / VALIDATION_FILE, _validation_bytes(validation))
    manifest["files"][VALIDATION_FILE] = file_digest(bundle_dir / VALIDATION_FILE)
    _rewrite_manifest(bundle_dir, manifest)


def write_signature(bundle_dir: Path, signature: ModelSignature) -> None:
    """Give a bundle prepared before bundles carried their signature (or a text model's tokenizer) one (weights
    untouched). The files it names are written before the manifest, each atomically, so a reader meanwhile sees the
    old bundle or the new one; writers racing to do the same write the same bytes."""
    bundle_dir = Path(bundle_dir)
    manifest = read_manifest(bundle_dir)
    for name, data in _signature_files(signature).items():
        write_atomically(bundle_dir / name, data)
        manifest["files"][name] = file_digest(bundle_dir / name)
    manifest["signature"] = signature.to_json()
    _rewrite_manifest(bundle_dir, manifest)


def _rewrite_manifest(bundle_dir: Path, manifest: dict) -> None:
    write_atomically(Path(bundle_dir) / MANIFEST, json.dumps(manifest, indent=2).encode())


def _array(value: object) -> np.ndarray:
    """A ramp's weight as an array: a torch module's tensor viewed as one (`RampArrays` hold arrays already)."""
    return np.ascontiguousarray(value.detach().numpy() if hasattr(value, "detach") else value)


def _load_ramp(spec: RampSpec, state: dict[str, np.ndarray], as_arrays: bool) -> object:
    """A ramp from its arrays in a bundle: as arrays where `as_arrays` and it is linear maps, else as a torch module
    (a torch model's ramps, which its compiled sets fuse; a deep head; a cache). Raises ValueError where they do not
    fit the spec."""
    if as_arrays and spec.kind in DENSE_KINDS:
        return RampArrays.from_state(spec, state)
    from rampserve.ramps.kinds import ramp_from_state  # torch: a ramp that runs as a torch module

    return ramp_from_state(spec, state)


def load_bundle(bundle_dir: Path) -> PreparedModel:
    bundle_dir = Path(bundle_dir)
    manifest = read_manifest(bundle_dir)
    try:
        sites = [SiteInfo.from_json(s) for s in manifest["sites"]]
        source = ModelSource.from_json(manifest["meta"]["source"])
        backend_kind = manifest["backend"]
    except (KeyError, TypeError, ValueError) as exc:
        raise BundleError(f"{bundle_dir}/{MANIFEST} is incomplete: {exc!r}") from exc
    # The manifest's sites, whatever policy chose them, as long as they are still cut values of the model.
    names = {s.name for s in sites}
    policy = lambda graph, candidates: [c for c in candidates if c.value in names]  # noqa: E731
    if backend_kind == "torch":
        from rampserve.runtime.torch_backend import TorchBackend  # torch: a torch model's bundle

        backend = TorchBackend.from_weights(build_architecture(source, bundle_dir), bundle_dir / TORCH_WEIGHTS,
                                            f"the architecture of {source.ref}", policy)
    elif backend_kind == "onnx":
        engine = engine_of(manifest["meta"], "onnx")
        backend = OnnxBackend(bundle_dir / ONNX_FILE, policy, engine.intra_op_threads, engine.spin_after_run)
    else:
        raise BundleError(f"{bundle_dir}: unknown backend {backend_kind!r} (known: torch, onnx)")
    found = {s.value for s in backend.sites}
    missing = [s.name for s in sites if s.name not in found]
    if missing:
        raise BundleError(f"{bundle_dir}: sites {missing} are not sites of the model it holds; "
                          "was it prepared with a different model or rampserve version?")
    ramps: dict = {}
    ramp_state = safetensors.numpy.load_file(bundle_dir / RAMPS_FILE)
    for site in sites:
        prefix = f"{site.name}/"
        state = {k[len(prefix):]: v for k, v in ramp_state.items() if k.startswith(prefix)}
        try:
            ramps[site.name] = _load_ramp(site.ramp, state, backend_kind == "onnx")
        except ValueError as exc:
            raise BundleError(f"{bundle_dir}: the ramp at {site.name} does not match its spec: {exc}") from exc
    profile = LatencyProfile.from_json(manifest["profile"]) if manifest.get("profile") else None
    return PreparedModel(backend=backend, sites=sites, ramps=ramps, profile=profile, meta=manifest["meta"],
                         error_score=manifest.get("error_score", "max_prob"),
                         signature=read_signature(bundle_dir, manifest),
                         validation=read_validation(bundle_dir, manifest), bundle_dir=bundle_dir)
