"""What the server serves: a prepared model as both sides of the server know it, the tensors clients see and what
sizes its batches. A bundle's is read from its manifest and signature alone, without torch: a front end never loads
a model; the model itself loads where it runs (`serving.executor.loading`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from rampserve.bundle_format.latency import LatencyProfile
from rampserve.bundle_format.manifest import (
    EXAMPLE_FILE,
    MANIFEST,
    TEXT_TOKENIZER_FILE,
    BundleError,
    read_manifest,
    read_signature,
)
from rampserve.bundle_format.signature import ANY_SIZE, ModelSignature, TensorSignature

# Re-exported: the server names its answers (app) and other predictors' tensors (predictors) as served models do
from rampserve.bundle_format.signature import LABEL_OUTPUT as LABEL_OUTPUT
from rampserve.bundle_format.signature import LOGITS_OUTPUT as LOGITS_OUTPUT
from rampserve.bundle_format.signature import V2_DATATYPES as V2_DATATYPES
from rampserve.bundle_format.text import TEXT_INPUT, TextEncoder
from rampserve.serving.shared.protocol import ProtocolError, TensorSpec

if TYPE_CHECKING:
    from rampserve.runtime.prepared import PreparedModel

VERSION = "1"


@dataclass(frozen=True)
class TextInput:
    """A text model's texts in place of its token inputs: one BYTES tensor `text` of UTF-8 strings, one per row
    (shape [n], or [n, 1]), each tokenized by the tokenizer its bundle was prepared with (`bundle_format.text`).
    The front end tokenizes a request as it reads it: the prediction cache, the queue, the executor and the
    controller's books then see the token inputs, the same whichever form the client sent."""

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
    # The model itself, where it is loaded (an executor, or a model built in memory); None in a front end
    prepared: PreparedModel | None = field(default=None, compare=False, repr=False)
    text: TextInput | None = field(default=None, compare=False, repr=False)  # a text model's texts

    @property
    def platform(self) -> str:
        return f"rampserve_{self.backend}"

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


def _specs(tensors: tuple[TensorSignature, ...]) -> tuple[TensorSpec, ...]:
    return tuple(TensorSpec(t.name, t.datatype, t.shape) for t in tensors)


def described_bundle(bundle_dir: Path, name: str, version: str = VERSION) -> ServedModel | None:
    """A bundle as a server serves it, from its manifest and signature, without loading its model; None for a bundle
    prepared before bundles carried their signature (which only loading can derive: `loading.read_served`)."""
    bundle_dir = Path(bundle_dir)
    # the executor checks the files it loads; the front end those it reads
    manifest = read_manifest(bundle_dir, digests=(EXAMPLE_FILE, TEXT_TOKENIZER_FILE))
    signature = read_signature(bundle_dir, manifest)
    if signature is None:
        return None
    try:
        backend = manifest["backend"]
        profile = LatencyProfile.from_json(manifest["profile"]) if manifest.get("profile") else None
    except (KeyError, TypeError, ValueError) as exc:
        raise BundleError(f"{bundle_dir}/{MANIFEST} is incomplete: {exc!r}") from exc
    return served_model(name, signature, backend, profile, bundle_dir, version)


def served_model(name: str, signature: ModelSignature, backend: str, profile: LatencyProfile | None,
                 bundle_dir: Path | None, version: str, prepared: PreparedModel | None = None) -> ServedModel:
    inputs = _specs(signature.inputs)
    text = None if signature.text is None else TextInput(signature.text, tuple(spec.name for spec in inputs))
    return ServedModel(name, inputs, _specs(signature.outputs), backend, profile, bundle_dir,
                       signature.max_variable_dim, version, signature.example, prepared, text)
