"""What the server serves: a prepared model with the tensor signature clients see, found by zoo name or bundle
directory. A bundle's is read from its manifest and signature alone, without torch: a front end whose models run in
executor processes never loads one; the model itself loads where it runs (`ServedModel.model`)."""

from __future__ import annotations

import functools
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from rampserve.runtime.latency import LatencyProfile
from rampserve.runtime.manifest import (
    EXAMPLE_FILE, MANIFEST, TEXT_TOKENIZER_FILE, BundleError, read_manifest, read_signature,
)
# Re-exported: the server names its answers (app) and other predictors' tensors (predictors) as served models do
from rampserve.runtime.signature import LABEL_OUTPUT as LABEL_OUTPUT
from rampserve.runtime.signature import LOGITS_OUTPUT as LOGITS_OUTPUT
from rampserve.runtime.signature import V2_DATATYPES as V2_DATATYPES
from rampserve.runtime.signature import ANY_SIZE, ModelSignature, TensorSignature
from rampserve.runtime.text import TEXT_INPUT, TextEncoder
from rampserve.serving.protocol import ProtocolError, TensorSpec

if TYPE_CHECKING:
    from rampserve.runtime.prepared import PreparedModel

VERSION = "1"


@dataclass(frozen=True)
class TextInput:
    """A text model's texts in place of its token inputs: one BYTES tensor `text` of UTF-8 strings, one per row
    (shape [n], or [n, 1]), each tokenized by the tokenizer its bundle was prepared with (`runtime.text`). The front
    end tokenizes a request as it reads it: the prediction cache, the queue, the executor and the controller's books
    then see the token inputs, the same whichever form the client sent."""

    encoder: TextEncoder
    token_names: tuple[str, ...]  # the model's token inputs, in the order the tokenizer gives them
    spec: TensorSpec = TensorSpec(TEXT_INPUT, "BYTES", (ANY_SIZE,), column=True)

    def token_inputs(self, texts: np.ndarray) -> dict[str, np.ndarray]:
        """The model's token inputs for a request's texts; ProtocolError for a text that is not UTF-8."""
        strings = []
        for row, text in enumerate(texts.ravel()):
            try:
                strings.append(text.decode("utf-8"))
            except UnicodeDecodeError as error:
                raise ProtocolError(f"input '{self.spec.name}': text {row} is not UTF-8 ({error.reason} at byte "
                                    f"{error.start})") from None
        return dict(zip(self.token_names, self.encoder(strings).values()))

    def metadata(self) -> dict:
        """Its tensor as the model's metadata lists it, among the inputs a request may give in place of the model's:
        content_type "str" says its bytes are text (MLServer's convention); max_tokens, where a text is cut."""
        return {**self.spec.to_json(), "parameters": {"content_type": "str", "max_tokens": self.encoder.max_length}}


@dataclass(frozen=True)
class ServedModel:
    name: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    backend: str  # "torch" or "onnx": what runs the model
    profile: LatencyProfile | None  # the bundle's latency profile, which sizes batches and the controller's costs
    bundle_dir: Path | None  # where the model loads from; None for a model built in memory
    # Longest variable dimension a request may bring (a text model's positions); None: all dims are fixed.
    max_variable_dim: int | None = None
    version: str = VERSION
    # Real inputs of the model's workload (two rows): the example its serving path is compiled with
    example: Mapping[str, np.ndarray] = field(default_factory=dict)
    given: PreparedModel | None = field(default=None, compare=False, repr=False)  # a model built in memory
    text: TextInput | None = field(default=None, compare=False, repr=False)  # a text model's texts

    @property
    def platform(self) -> str:
        return f"rampserve_{self.backend}"

    @functools.cached_property
    def model(self) -> PreparedModel:
        """The prepared model: the one given, or loaded from the bundle on first use (with torch), by whatever runs
        it in this process."""
        if self.given is not None:
            return self.given
        from rampserve.runtime.bundle import load_bundle

        return load_bundle(self.bundle_dir)

    def check_limits(self, inputs: Mapping[str, np.ndarray]) -> str | None:
        """What is wrong with inputs the protocol accepted but the model cannot take, or None."""
        if self.max_variable_dim is None:
            return None
        for spec in self.inputs:
            for axis, (want, got) in enumerate(zip(spec.shape, inputs[spec.name].shape)):
                if axis and want == -1 and got > self.max_variable_dim:
                    return (f"input '{spec.name}': dimension {axis} is {got}, the model takes at most "
                            f"{self.max_variable_dim}")
        return None


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
    """A bundle as a server serves it, from its manifest and signature: its model is loaded only where it runs. A
    bundle prepared before bundles carried their signature is loaded here, to derive it (see `served`)."""
    bundle_dir = Path(bundle_dir)
    # the executor checks the files it loads; the front end those it reads
    manifest = read_manifest(bundle_dir, digests=(EXAMPLE_FILE, TEXT_TOKENIZER_FILE))
    signature = read_signature(bundle_dir, manifest)
    if signature is None:
        from rampserve.runtime.bundle import load_bundle

        return served(name, load_bundle(bundle_dir), version)
    try:
        backend = manifest["backend"]
        profile = LatencyProfile.from_json(manifest["profile"]) if manifest.get("profile") else None
    except (KeyError, TypeError, ValueError) as exc:
        raise BundleError(f"{bundle_dir}/{MANIFEST} is incomplete: {exc!r}") from exc
    return _served(name, signature, backend, profile, bundle_dir, version)


def served(name: str, model: PreparedModel, version: str = VERSION) -> ServedModel:
    """The model behind the signature it carries (prepare gives a model one, its bundle keeps it)."""
    signature = model.signature
    if signature is None:
        # A bundle prepared before bundles carried their signature served wherever its workload was: it still does
        # there (deriving it as prepare does), and elsewhere the error says to prepare it again
        from rampserve.runtime.prepare import signature_from_workload

        signature = signature_from_workload(model)
    return _served(name, signature, model.backend.kind, model.profile, model.bundle_dir, version, model)


def _served(name: str, signature: ModelSignature, backend: str, profile: LatencyProfile | None,
            bundle_dir: Path | None, version: str, given: PreparedModel | None = None) -> ServedModel:
    inputs = _specs(signature.inputs)
    text = None if signature.text is None else TextInput(signature.text, tuple(spec.name for spec in inputs))
    return ServedModel(name, inputs, _specs(signature.outputs), backend, profile, bundle_dir,
                       signature.max_variable_dim, version, signature.example, given, text)


def _specs(tensors: tuple[TensorSignature, ...]) -> tuple[TensorSpec, ...]:
    return tuple(TensorSpec(t.name, t.datatype, t.shape) for t in tensors)


def stack_inputs(specs: tuple[TensorSpec, ...], requests: list[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """One batch from several requests' inputs; variable dimensions are zero-padded to the longest (a zero
    attention mask makes padding invisible to a transformer)."""
    if len(requests) == 1:  # the batch of one request alone: its inputs as they are
        return {spec.name: requests[0][spec.name] for spec in specs}
    batch = {}
    for spec in specs:
        arrays = [r[spec.name] for r in requests]
        width = np.max([a.shape for a in arrays], axis=0)
        padded = [a if a.shape[1:] == tuple(width[1:]) else
                  np.pad(a, [(0, 0), *((0, int(w) - d) for w, d in zip(width[1:], a.shape[1:]))])
                  for a in arrays]
        batch[spec.name] = padded[0] if len(padded) == 1 else np.concatenate(padded)
    return batch
