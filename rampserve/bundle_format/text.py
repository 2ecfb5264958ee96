"""A text model's tokenizer as its bundle was prepared with it, without torch: prepare encodes the workload's texts
with a `TextEncoder`, the bundle keeps it (its tokenizer as a file, its padding in the signature), and a server's
front end encodes the texts of a request to the model's token inputs with the same one before anything else sees the
request (`serving.shared.models.TextInput`).

Each text is tokenized alone, then the batch is padded here: the `tokenizers` library pads, even one text, on a
thread pool of its own (rayon), whose threads would wake on every request in the front end and compete with the
executor for these cores. Padding to the longest text on the right with the pad id is what its `encode_batch` does
with the padding the project's tokenizers enable, and gives the same ids (`test_text_input`)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

TEXT_INPUT = "text"  # the v2 input a text model takes its texts in, in place of its token inputs
TOKEN_INPUTS = ("input_ids", "attention_mask")  # what a `TextEncoder` gives, in order


@dataclass(frozen=True)
class TextEncoder:
    """Texts -> token ids and attention mask, int64 (N, L): each text tokenized (and truncated) by `tokenizer`, the
    rows right-padded with `pad_id` to the longest."""

    tokenizer: Tokenizer  # truncating, never padding
    pad_id: int

    def __post_init__(self) -> None:
        if self.tokenizer.padding is not None:
            raise ValueError("a TextEncoder pads the batch itself: give it a tokenizer without padding")

    @classmethod
    def from_file(cls, file: Path, pad_id: int, max_length: int) -> TextEncoder:
        """The tokenizer saved in `file` (a tokenizer.json), truncating to `max_length` tokens, whatever padding and
        truncation the file was saved with."""
        tokenizer = Tokenizer.from_file(str(file))
        tokenizer.no_padding()
        tokenizer.enable_truncation(max_length=max_length)
        return cls(tokenizer, pad_id)

    @property
    def max_length(self) -> int:
        return int(self.tokenizer.truncation["max_length"])

    def __call__(self, texts: Iterable[str]) -> dict[str, np.ndarray]:
        encoded = [self.tokenizer.encode(text).ids for text in texts]
        width = max(map(len, encoded), default=0)
        ids = np.full((len(encoded), width), self.pad_id, dtype=np.int64)
        mask = np.zeros((len(encoded), width), dtype=np.int64)
        for row, tokens in enumerate(encoded):
            ids[row, :len(tokens)] = tokens
            mask[row, :len(tokens)] = 1
        return dict(zip(TOKEN_INPUTS, (ids, mask)))

    def to_json(self) -> dict:
        """What a bundle's signature keeps of it besides the tokenizer's own file (`tokenizer.to_str()`)."""
        return {"pad_id": self.pad_id}

    @classmethod
    def from_json(cls, data: dict, tokenizer: str) -> TextEncoder:
        return cls(Tokenizer.from_str(tokenizer), int(data["pad_id"]))
