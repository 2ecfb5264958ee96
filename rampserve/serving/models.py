"""What the server serves: a prepared model with the tensor signature clients see, found by zoo name or
bundle directory."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from rampserve.runtime.bundle import load_bundle
from rampserve.runtime.prepared import PreparedModel
# Re-exported: the server names its answers (app) and other predictors' tensors (predictors) as served models do
from rampserve.runtime.signature import LABEL_OUTPUT as LABEL_OUTPUT
from rampserve.runtime.signature import LOGITS_OUTPUT as LOGITS_OUTPUT
from rampserve.runtime.signature import V2_DATATYPES as V2_DATATYPES
from rampserve.runtime.signature import TensorSignature
from rampserve.serving.protocol import TensorSpec

VERSION = "1"


@dataclass(frozen=True)
class ServedModel:
    name: str
    model: PreparedModel
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    # Longest variable dimension a request may bring (a text model's positions); None: all dims are fixed.
    max_variable_dim: int | None = None
    version: str = VERSION
    # Real inputs of the model's workload (two rows): the example its serving path is compiled with
    example: Mapping[str, np.ndarray] = field(default_factory=dict)

    @property
    def platform(self) -> str:
        return f"rampserve_{self.model.backend.kind}"

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
        model, name = load_bundle(path), path.name
    else:
        # Imported here: only preparing reads workloads, so serving a bundle need not import their streams
        from rampserve.runtime.zoo_bundles import zoo_bundle

        model, name = load_bundle(zoo_bundle(ref)), ref
    return served(name, model)


def served(name: str, model: PreparedModel) -> ServedModel:
    """The model behind the signature it carries (prepare gives a model one, its bundle keeps it)."""
    signature = model.signature
    if signature is None:
        # A bundle prepared before bundles carried their signature served wherever its workload was: it still does
        # there (deriving it as prepare does), and elsewhere the error says to prepare it again
        from rampserve.runtime.prepare import signature_from_workload

        signature = signature_from_workload(model)
    return ServedModel(name, model, _specs(signature.inputs), _specs(signature.outputs), signature.max_variable_dim,
                       example=signature.example)


def _specs(tensors: tuple[TensorSignature, ...]) -> tuple[TensorSpec, ...]:
    return tuple(TensorSpec(t.name, t.datatype, t.shape) for t in tensors)


def stack_inputs(specs: tuple[TensorSpec, ...], requests: list[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """One batch from several requests' inputs; variable dimensions are zero-padded to the longest (a zero
    attention mask makes padding invisible to a transformer)."""
    batch = {}
    for spec in specs:
        arrays = [r[spec.name] for r in requests]
        width = np.max([a.shape for a in arrays], axis=0)
        padded = [a if a.shape[1:] == tuple(width[1:]) else
                  np.pad(a, [(0, 0), *((0, int(w) - d) for w, d in zip(width[1:], a.shape[1:]))])
                  for a in arrays]
        batch[spec.name] = padded[0] if len(padded) == 1 else np.concatenate(padded)
    return batch
