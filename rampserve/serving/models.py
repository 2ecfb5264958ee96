"""What the server serves: a prepared model with the tensor signature clients see, found by zoo name or
bundle directory."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from rampserve.runtime.bundle import load_bundle
from rampserve.runtime.prepare import bootstrap_inputs, sample_feeds
from rampserve.runtime.prepared import PreparedModel
from rampserve.runtime.zoo_bundles import zoo_bundle
from rampserve.serving.protocol import TensorSpec

VERSION = "1"
# Output tensors: the released label always; the original model's logits only when asked for, since they
# exist only once the input has run to the end (asking for them gives up early release for that request).
LABEL_OUTPUT = "label"
LOGITS_OUTPUT = "logits"
V2_DATATYPES = {np.dtype(np.float32): "FP32", np.dtype(np.float64): "FP64", np.dtype(np.float16): "FP16",
                np.dtype(np.int64): "INT64", np.dtype(np.int32): "INT32", np.dtype(np.uint8): "UINT8",
                np.dtype(np.bool_): "BOOL"}
TEXT_MAX_POSITIONS = 512  # BERT-style encoders have this many position embeddings


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
        model, name = load_bundle(zoo_bundle(ref)), ref
    return served(name, model)


def served(name: str, model: PreparedModel) -> ServedModel:
    """Derive the signature from real inputs of the model's workload: a bundle records the model's input
    names, and its workload's encoder decides their datatypes and shapes."""
    sample = sample_feeds(model.backend, bootstrap_inputs(model.meta["workload"], 2))(2)
    variable = model.meta.get("task") == "text"  # token sequences: any length, padded when batched
    inputs = tuple(
        TensorSpec(name=n, datatype=V2_DATATYPES[a.dtype],
                   shape=(-1, *(-1 if variable else d for d in a.shape[1:])))
        for n, a in sample.items())
    num_classes = int(model.meta["num_classes"])
    outputs = (TensorSpec(LABEL_OUTPUT, "INT64", (-1,)), TensorSpec(LOGITS_OUTPUT, "FP32", (-1, num_classes)))
    return ServedModel(name, model, inputs, outputs, TEXT_MAX_POSITIONS if variable else None, example=sample)


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
