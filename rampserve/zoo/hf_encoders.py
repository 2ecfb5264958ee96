"""Hugging Face BERT-family sequence classifiers laid out for the ramp analysis.

A checkpoint saved by `save_pretrained` (BERT, RoBERTa, MPNet or DistilBERT) becomes an `EncoderChain`:
`embeddings -> layers.0 -> ... -> layers.N-1 -> head`, each a leaf of the torch.fx trace, with the attention mask
(and MPNet's relative position bias, computed from the mask's shape alone) as side values. The chain's logits are
the original `AutoModelForSequenceClassification`'s.

Every encoder layer zeroes the hidden states at padded positions in its output. Real tokens never attend to padded
keys, so their results are unchanged, but a ramp that averages a site's activation over tokens then sees the same
sum whatever the padding.

Weights load from safetensors only; the tokenizer from the directory's tokenizer.json; nothing touches a hub.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig, AutoModel, AutoModelForSequenceClassification, PretrainedConfig, PreTrainedModel
from transformers.models.mpnet.modeling_mpnet import MPNetEncoder

from rampserve.bundle_format.text import TextEncoder

CONFIG_FILE = "config.json"
TOKENIZER_FILE = "tokenizer.json"
WEIGHTS_FILE = "model.safetensors"
# What a bundle carries to rebuild the chain and encode text without the original directory.
ARCHITECTURE_FILES = (CONFIG_FILE, TOKENIZER_FILE)
MAX_LENGTH = 64  # tokens per text at most, as the zoo's MiniLM (the rt workloads' snippets are short)
# Added to attention scores at padded keys; finite (not -inf) so a softmax never sees a row of -inf.
MASK_FILL = torch.finfo(torch.float32).min
# Plain matmul-softmax attention: deterministic, and what the layers' mask convention assumes.
ATTENTION_IMPLEMENTATION = "eager"


class HFModelError(ValueError):
    """A directory that is not a checkpoint of a supported sequence classifier."""


def additive_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, L) 1/0 mask -> (B, 1, 1, L) scores to add: 0 at real keys, MASK_FILL at padded ones.

    Built from `attention_mask` alone (a fixed dtype, not the hidden states') so it stays a side input."""
    return (1.0 - attention_mask[:, None, None, :].to(torch.float32)) * MASK_FILL


class TokenEmbeddings(nn.Module):
    """A family's embeddings behind a fixed `input_ids -> hidden` interface."""

    def __init__(self, embeddings: nn.Module) -> None:
        super().__init__()
        self.embeddings = embeddings
        # A padding index only keeps the padding's embedding from learning, and its forward is the same without
        # one; but F.embedding checks it against the table's size, which a TorchScript trace then reads as a
        # constant (and warns), so the serving path would be refused compilation.
        for table in embeddings.modules():
            if isinstance(table, nn.Embedding):
                table.padding_idx = None

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embeddings(input_ids)


class EncoderLayer(nn.Module):
    """One encoder layer behind a fixed `(hidden, additive_mask[, position_bias]) -> hidden` interface, whatever
    keyword arguments or return type a transformers release gives the family's layer. Padded positions of the
    output are zeroed (see the module's docstring)."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, hidden: torch.Tensor, additive_mask: torch.Tensor,
                position_bias: torch.Tensor | None = None) -> torch.Tensor:
        extra = () if position_bias is None else (position_bias,)
        out = self.layer(hidden, additive_mask, *extra)
        if isinstance(out, tuple):
            out = out[0]
        real = (additive_mask[:, 0, 0, :, None] == 0).to(out.dtype)
        return out * real


class RelativePositionBias(nn.Module):
    """MPNet's relative position bias, `attention_mask -> (B, heads, L, L)`: the encoder computes it once from
    the sequence length and passes it to every layer. Taking the mask (a side input) rather than the hidden
    states keeps it off the data path."""

    def __init__(self, relative_attention_bias: nn.Embedding) -> None:
        super().__init__()
        self.relative_attention_bias = relative_attention_bias

    def forward(self, attention_mask: torch.Tensor) -> torch.Tensor:
        batch, length = attention_mask.shape
        positions = torch.arange(length, dtype=torch.long, device=attention_mask.device)
        # transformers' MPNetEncoder buckets with its default 32 buckets whatever the config says; so do we
        buckets = MPNetEncoder.relative_position_bucket(positions[None, :] - positions[:, None])
        values = self.relative_attention_bias(buckets).permute(2, 0, 1).unsqueeze(0)
        return values.expand(batch, -1, length, length)


class CheckpointHead(nn.Module):
    """A checkpoint's own classification head, `(hidden, attention_mask) -> logits`."""

    def __init__(self, modules: dict[str, nn.Module], classify: Callable[[dict, torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.parts = nn.ModuleDict(modules)
        self._classify = classify

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self._classify(self.parts, hidden)


class EncoderChain(nn.Module):
    """`embeddings -> layers -> head(hidden, attention_mask)`, inputs `input_ids`, `attention_mask` (int64, (B, L)).

    `head` may be any module taking the last layer's hidden states (zero at padded positions) and the mask, e.g.
    a masked mean pooling classifier; its type is kept whole by the tracer like the other parts."""

    def __init__(self, embeddings: TokenEmbeddings, layers: Iterable[EncoderLayer], head: nn.Module,
                 position_bias: RelativePositionBias | None = None) -> None:
        super().__init__()
        self.embeddings = embeddings
        self.layers = nn.ModuleList(layers)
        self.position_bias = position_bias
        self.head = head
        self.rampserve_leaf_types = (TokenEmbeddings, EncoderLayer, RelativePositionBias, type(head))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.embeddings(input_ids)
        mask = additive_mask(attention_mask)
        if self.position_bias is None:
            for layer in self.layers:
                hidden = layer(hidden, mask)
        else:
            bias = self.position_bias(attention_mask)
            for layer in self.layers:
                hidden = layer(hidden, mask, bias)
        return self.head(hidden, attention_mask)


@dataclass(frozen=True)
class EncoderParts:
    embeddings: TokenEmbeddings
    layers: list[EncoderLayer]
    position_bias: RelativePositionBias | None = None

    def chain(self, head: nn.Module) -> EncoderChain:
        return EncoderChain(self.embeddings, self.layers, head, self.position_bias)


def _bert_head(parts: dict, hidden: torch.Tensor) -> torch.Tensor:
    # BertPooler (first token, dense, tanh), dropout, classifier
    return parts["classifier"](parts["dropout"](parts["pooler"](hidden)))


def _first_token_head(parts: dict, hidden: torch.Tensor) -> torch.Tensor:
    # RoBERTa's and MPNet's classification heads read the first token (<s>) themselves
    return parts["classifier"](hidden)


def _distilbert_head(parts: dict, hidden: torch.Tensor) -> torch.Tensor:
    pooled = torch.relu(parts["pre_classifier"](hidden[:, 0]))
    return parts["classifier"](parts["dropout"](pooled))


@dataclass(frozen=True)
class Family:
    """Where a family keeps its parts in transformers' modeling code."""

    model_type: str  # config.json's "model_type"
    base: str  # attribute of the sequence classifier holding the base model
    layers: Callable[[nn.Module], nn.ModuleList]  # base model -> its encoder layers
    head_parts: Callable[[nn.Module], dict[str, nn.Module]]  # sequence classifier -> its head's modules
    classify: Callable[[dict, torch.Tensor], torch.Tensor]
    position_bias: Callable[[nn.Module], nn.Embedding] | None = None


FAMILIES = {f.model_type: f for f in (
    Family("bert", "bert", lambda base: base.encoder.layer,
           lambda m: {"pooler": m.bert.pooler, "dropout": m.dropout, "classifier": m.classifier}, _bert_head),
    Family("roberta", "roberta", lambda base: base.encoder.layer,
           lambda m: {"classifier": m.classifier}, _first_token_head),
    Family("mpnet", "mpnet", lambda base: base.encoder.layer,
           lambda m: {"classifier": m.classifier}, _first_token_head,
           position_bias=lambda base: base.encoder.relative_attention_bias),
    Family("distilbert", "distilbert", lambda base: base.transformer.layer,
           lambda m: {"pre_classifier": m.pre_classifier, "dropout": m.dropout, "classifier": m.classifier},
           _distilbert_head),
)}


def supported() -> str:
    return ", ".join(FAMILIES)


def family_of(config: PretrainedConfig) -> Family:
    family = FAMILIES.get(config.model_type)
    if family is None:
        raise HFModelError(f"model_type {config.model_type!r} is not supported: rampserve lays out sequence "
                           f"classifiers of the families {supported()}")
    return family


def encoder_parts(base: PreTrainedModel) -> EncoderParts:
    """A family's base model (BertModel, RobertaModel, MPNetModel, DistilBertModel) as chain parts sharing its
    modules (and so its weights)."""
    family = family_of(base.config)
    bias = family.position_bias(base) if family.position_bias else None
    return EncoderParts(TokenEmbeddings(base.embeddings), [EncoderLayer(layer) for layer in family.layers(base)],
                        RelativePositionBias(bias) if bias is not None else None)


def build_encoder(config: PretrainedConfig, state: dict[str, torch.Tensor] | None = None) -> EncoderParts:
    """The encoder parts of a family's base model built from `config`, with the base model's weights `state`
    (keys as the base model names them, e.g. an MPNetModel checkpoint's) when given."""
    config._attn_implementation = ATTENTION_IMPLEMENTATION
    base = AutoModel.from_config(config, attn_implementation=ATTENTION_IMPLEMENTATION)
    if state is not None:
        missing, unexpected = base.load_state_dict(state, strict=False)
        # the pooler is not part of the encoder; a checkpoint may or may not carry it
        missing = [k for k in missing if not k.startswith("pooler.")]
        unexpected = [k for k in unexpected if not k.startswith("pooler.") and not k.endswith("position_ids")]
        if missing or unexpected:
            raise HFModelError(f"the weights do not fit a {config.model_type} encoder: missing {missing}, "
                               f"unexpected {unexpected}")
    return encoder_parts(base.eval())


def chain_of(model: PreTrainedModel) -> EncoderChain:
    """A sequence classifier as a chain sharing its modules, with the checkpoint's own head."""
    family = family_of(model.config)
    head = CheckpointHead(family.head_parts(model), family.classify)
    return encoder_parts(getattr(model, family.base)).chain(head).eval()


def packaged_config(config_type: type[PretrainedConfig], file: Path,
                    num_layers: int | None = None) -> PretrainedConfig:
    """A zoo encoder's config from its package's config.json, with this layout's attention, optionally cut to the
    first `num_layers` (the zoo's small variants)."""
    config = config_type.from_json_file(str(file))
    config._attn_implementation = ATTENTION_IMPLEMENTATION
    if num_layers is not None:
        config.num_hidden_layers = num_layers
    return config


def load_config(directory: Path) -> PretrainedConfig:
    """The classifier's config from `directory`/config.json, checked to be a supported sequence classifier."""
    directory = Path(directory)
    file = directory / CONFIG_FILE
    if not file.is_file():
        raise HFModelError(f"{directory} holds no {CONFIG_FILE}: give a directory written by save_pretrained")
    try:
        config = AutoConfig.from_pretrained(str(directory), local_files_only=True)
    except (ValueError, KeyError, OSError, json.JSONDecodeError) as exc:
        raise HFModelError(f"{file} is not a transformers config: {exc}") from exc
    family_of(config)
    architectures = config.architectures or []
    if architectures and not any(a.endswith("ForSequenceClassification") for a in architectures):
        raise HFModelError(f"{directory} holds a {', '.join(architectures)}, not a sequence classifier "
                           f"(…ForSequenceClassification of {supported()})")
    config._attn_implementation = ATTENTION_IMPLEMENTATION
    return config


def chain_from_config(directory: Path) -> EncoderChain:
    """The chain's architecture from `directory`/config.json, with fresh weights (load a state dict next)."""
    config = load_config(directory)
    return chain_of(AutoModelForSequenceClassification.from_config(config,
                                                                   attn_implementation=ATTENTION_IMPLEMENTATION))


def check_checkpoint(directory: Path) -> PretrainedConfig:
    """The config of the checkpoint in `directory`, after checking that it is a supported sequence classifier with
    safetensors weights and a tokenizer.json."""
    directory = Path(directory)
    config = load_config(directory)
    if not (directory / WEIGHTS_FILE).is_file() and not (directory / f"{WEIGHTS_FILE}.index.json").is_file():
        raise HFModelError(f"{directory} has no {WEIGHTS_FILE}: rampserve loads safetensors weights only "
                           "(save with save_pretrained, whose default is safetensors)")
    if not (directory / TOKENIZER_FILE).is_file():
        raise HFModelError(f"{directory} has no {TOKENIZER_FILE}: save the model's fast tokenizer with it "
                           "(tokenizer.save_pretrained(DIR))")
    return config


def from_pretrained_dir(directory: Path) -> EncoderChain:
    """The checkpoint in `directory` (safetensors weights, never a pickle) as a chain, in eval mode."""
    directory = Path(directory)
    check_checkpoint(directory)
    model, loading = AutoModelForSequenceClassification.from_pretrained(
        str(directory), local_files_only=True, use_safetensors=True, attn_implementation=ATTENTION_IMPLEMENTATION,
        output_loading_info=True)
    if loading["missing_keys"]:
        # transformers would start these from random weights; a served classifier must be the checkpoint's
        raise HFModelError(f"{directory}'s weights lack {sorted(loading['missing_keys'])}: is it a fine-tuned "
                           "sequence classifier?")
    return chain_of(model.eval())


@lru_cache(maxsize=8)
def _text_encoder(directory: Path, max_length: int, modified_ns: int) -> TextEncoder:
    """`modified_ns` (tokenizer.json's) keys the cache, so a bundle rewritten in place gets its new tokenizer."""
    file = directory / TOKENIZER_FILE
    pad_id = json.loads((directory / CONFIG_FILE).read_text()).get("pad_token_id")
    encoder = None if pad_id is None else TextEncoder.from_file(file, pad_id, max_length)
    if encoder is None or encoder.tokenizer.id_to_token(pad_id) is None:
        raise HFModelError(f"{directory}: config.json's pad_token_id {pad_id!r} is not in {TOKENIZER_FILE}")
    return encoder


def text_encoder(directory: Path, max_length: int = MAX_LENGTH) -> TextEncoder:
    """Texts -> `input_ids`, `attention_mask` with the tokenizer saved in `directory` (padding with its config's
    pad_token_id), padded to the batch's longest text, at most `max_length` tokens."""
    directory = Path(directory).resolve()
    file = directory / TOKENIZER_FILE
    if not file.is_file():
        raise HFModelError(f"{directory} has no {TOKENIZER_FILE} (a fast tokenizer saved with the model)")
    return _text_encoder(directory, max_length, file.stat().st_mtime_ns)
