"""The tensor signature a prepared model is served with, in Open Inference Protocol v2 terms but as plain data:
prepare derives it from real inputs of the model's workload, a bundle carries it (so serving needs no dataset),
and serving turns it into its protocol's tensor specs."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from rampserve.bundle_format.text import TOKEN_INPUTS, TextEncoder

V2_DATATYPES = {np.dtype(np.float32): "FP32", np.dtype(np.float64): "FP64", np.dtype(np.float16): "FP16",
                np.dtype(np.int64): "INT64", np.dtype(np.int32): "INT32", np.dtype(np.uint8): "UINT8",
                np.dtype(np.bool_): "BOOL"}
# Output tensors: the released label always; the original model's logits only when asked for, since they
# exist only once the input has run to the end (asking for them gives up early release for that request).
LABEL_OUTPUT = "label"
LOGITS_OUTPUT = "logits"
TEXT_MAX_POSITIONS = 512  # BERT-style encoders have this many position embeddings
ANY_SIZE = -1  # a dimension of any size in a v2 shape


@dataclass(frozen=True)
class TensorSignature:
    name: str
    datatype: str  # v2 datatype name
    shape: tuple[int, ...]  # full shape including the leading batch dimension; ANY_SIZE: any size

    def to_json(self) -> dict:
        return {"name": self.name, "datatype": self.datatype, "shape": list(self.shape)}

    @classmethod
    def from_json(cls, data: dict) -> TensorSignature:
        return cls(str(data["name"]), str(data["datatype"]), tuple(int(d) for d in data["shape"]))


@dataclass(frozen=True)
class ModelSignature:
    inputs: tuple[TensorSignature, ...]
    outputs: tuple[TensorSignature, ...]
    # Longest variable dimension a request may bring (a text model's positions); None: all dims are fixed.
    max_variable_dim: int | None
    # Real inputs of the model's workload (two rows), named as the model's inputs: the example its serving path is
    # compiled with. Arrays do not compare as values, so equal signatures are those with equal tensors.
    example: Mapping[str, np.ndarray] = field(compare=False)
    # A text model's tokenizer, as it made the token inputs: the model also takes its texts in their place
    text: TextEncoder | None = field(default=None, compare=False)

    @classmethod
    def of_example(cls, example: Mapping[str, np.ndarray], num_classes: int, task: str,
                   text: TextEncoder | None = None) -> ModelSignature:
        """The signature of a model whose inputs look like `example` (the input names are the model's, its
        workload's encoder decided their datatypes and shapes) and whose output has `num_classes` logits; `text`, the
        tokenizer that encoded a text model's inputs."""
        variable = task == "text"  # token sequences: any length, padded when batched
        inputs = tuple(
            TensorSignature(name, V2_DATATYPES[array.dtype],
                            (ANY_SIZE, *(ANY_SIZE if variable else d for d in array.shape[1:])))
            for name, array in example.items())
        outputs = (TensorSignature(LABEL_OUTPUT, "INT64", (ANY_SIZE,)),
                   TensorSignature(LOGITS_OUTPUT, "FP32", (ANY_SIZE, num_classes)))
        if text is not None and len(inputs) != len(TOKEN_INPUTS):
            raise ValueError(f"the model takes {[t.name for t in inputs]}, a tokenizer gives {list(TOKEN_INPUTS)}")
        return cls(inputs, outputs, TEXT_MAX_POSITIONS if variable else None, dict(example), text)

    def to_json(self) -> dict:
        """Everything but the example, which a bundle keeps as tensors, and a text model's tokenizer, which it keeps
        as a file (its padding here)."""
        text = {} if self.text is None else {"text": self.text.to_json()}
        return {"inputs": [t.to_json() for t in self.inputs], "outputs": [t.to_json() for t in self.outputs],
                "max_variable_dim": self.max_variable_dim, **text}

    @classmethod
    def from_json(cls, data: dict, example: Mapping[str, np.ndarray], tokenizer: str | None = None) -> ModelSignature:
        """`example`'s tensors in any order (a safetensors file keeps no order): they take the signature's;
        `tokenizer`, a text model's tokenizer file as text."""
        inputs = tuple(TensorSignature.from_json(t) for t in data["inputs"])
        names = [t.name for t in inputs]
        if sorted(names) != sorted(example):
            raise ValueError(f"the example inputs {sorted(example)} are not the signature's {names}")
        max_dim = data["max_variable_dim"]
        if "text" in data and tokenizer is None:
            raise ValueError("the signature takes text but its tokenizer is missing")
        text = None if "text" not in data else TextEncoder.from_json(data["text"], tokenizer)
        return cls(inputs, tuple(TensorSignature.from_json(t) for t in data["outputs"]),
                   None if max_dim is None else int(max_dim), {name: example[name] for name in names}, text)
