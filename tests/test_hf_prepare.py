"""Your own Hugging Face model: `rampserve prepare hf:DIR` on checkpoints written by `save_pretrained` from small
random-weight sequence classifiers built here, the layout adapters against transformers' own models, and the
prepared bundle served over v2 on loopback."""

from __future__ import annotations

import json
import shutil
from functools import cache
from pathlib import Path

import numpy as np
import pytest
import torch
import tritonclient.http as triton
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file
from transformers import (
    AutoModelForSequenceClassification,
    BertConfig,
    BertModel,
    DistilBertConfig,
    GPT2Config,
    MPNetConfig,
    PreTrainedModel,
    RobertaConfig,
)
from typer.testing import CliRunner

from rampserve.cli import app
from rampserve.runtime.torch_backend import TorchBackend, site_activations
from rampserve.runtime.prepare import model_encoder, prepared_encoder
from rampserve.runtime.sources import ModelSource
from rampserve.serving.executor.loading import load_served, loaded
from rampserve.serving.server import ServerSettings, build_state, running_server
from rampserve.serving.shared.settings import ModelSettings
from rampserve.zoo import hf_encoders
from rampserve.zoo.minilm import model_dir as minilm_dir

LAYERS = 3
SMALL = dict(hidden_size=32, num_hidden_layers=LAYERS, num_attention_heads=4, intermediate_size=64,
             max_position_embeddings=80)
CONFIGS = {
    "bert": lambda: BertConfig(vocab_size=120, **SMALL),
    "roberta": lambda: RobertaConfig(vocab_size=120, pad_token_id=1, **SMALL),
    "mpnet": lambda: MPNetConfig(vocab_size=120, **SMALL),
    "distilbert": lambda: DistilBertConfig(vocab_size=120, dim=32, n_layers=LAYERS, n_heads=4, hidden_dim=64,
                                           max_position_embeddings=80),
}
TEXTS = ["a triumph.", "not good at all, sadly, and far too long for what it has to say", "fine"]


def random_classifier(family: str, num_labels: int = 3, **overrides) -> PreTrainedModel:
    torch.manual_seed(0)
    config = CONFIGS[family]()
    config.num_labels = num_labels
    for key, value in overrides.items():
        setattr(config, key, value)
    return AutoModelForSequenceClassification.from_config(config, attn_implementation="eager").eval()


@cache
def saved_pair(family: str, directory: Path) -> tuple[PreTrainedModel, hf_encoders.EncoderChain]:
    """The transformers model and the chain loaded back from its save_pretrained directory (with a tokenizer.json,
    which loading asks for; these tests feed token ids directly)."""
    model = random_classifier(family)
    model.save_pretrained(directory / family)
    shutil.copyfile(minilm_dir() / hf_encoders.TOKENIZER_FILE, directory / family / hf_encoders.TOKENIZER_FILE)
    return model, hf_encoders.from_pretrained_dir(directory / family)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("checkpoints")


def padded_batch(lengths: list[int], width: int, pad_id: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.from_numpy(np.random.default_rng(seed).integers(3, 120, (len(lengths), width)))
    mask = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).to(torch.int64)
    return ids.masked_fill(mask == 0, pad_id), mask


@settings(max_examples=12, deadline=None)
@given(family=st.sampled_from(sorted(CONFIGS)), data=st.data())
def test_the_chain_gives_the_checkpoints_logits_for_any_batch_and_padding(checkpoints, family, data) -> None:
    model, chain = saved_pair(family, checkpoints)
    width = data.draw(st.integers(1, 12), label="width")
    lengths = data.draw(st.lists(st.integers(1, width), min_size=1, max_size=4), label="lengths")
    ids, mask = padded_batch(lengths, width, model.config.pad_token_id, data.draw(st.integers(0, 2**16)))
    with torch.inference_mode():
        expected = model(input_ids=ids, attention_mask=mask).logits
        got = chain(ids, mask)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_sites_lie_between_encoder_layers_and_ignore_padding(checkpoints, family) -> None:
    """The same analysis as the zoo's finds a site after every layer but the last (MPNet's position bias, made
    from the mask, is a side value); each site's activation is zero at padded positions, so its sum over tokens
    does not change with more padding."""
    _, chain = saved_pair(family, checkpoints)
    backend = TorchBackend(chain)
    assert [s.value for s in backend.sites] == [f"layers_{i}" for i in range(LAYERS - 1)]
    ids, mask = padded_batch([5, 2], 5, chain.embeddings.embeddings.word_embeddings.padding_idx or 0, seed=1)
    wider_ids = torch.cat([ids, torch.full((2, 4), int(ids[1, -1]))], dim=1)
    wider_mask = torch.cat([mask, torch.zeros(2, 4, dtype=torch.int64)], dim=1)
    sites = [s.value for s in backend.sites]
    (narrow, logits), = site_activations(backend, [{"input_ids": ids.numpy(), "attention_mask": mask.numpy()}],
                                                 sites)
    (wide, wider_logits), = site_activations(backend, [{"input_ids": wider_ids.numpy(),
                                                       "attention_mask": wider_mask.numpy()}], sites)
    for site in sites:
        assert not np.asarray(wide[site])[:, 5:].any() and not np.asarray(narrow[site])[1, 2:].any()
        np.testing.assert_allclose(np.asarray(wide[site]).sum(axis=1), np.asarray(narrow[site]).sum(axis=1),
                                   rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(wider_logits), np.asarray(logits), rtol=1e-5, atol=1e-6)


def test_a_custom_head_gets_the_last_layer_and_the_mask(checkpoints) -> None:
    """What mpnet-rt builds: the encoder parts of a base model from its config and weights, with a masked mean
    pooling head instead of a checkpoint's."""
    model, _ = saved_pair("mpnet", checkpoints)

    class MeanPoolingClassifier(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.out = torch.nn.Linear(model.config.hidden_size, 2)

        def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            # the layers zeroed padded positions: a plain sum is the masked sum
            return self.out(hidden.sum(dim=1) / attention_mask.sum(dim=1, keepdim=True))

    head = MeanPoolingClassifier()
    chain = hf_encoders.build_encoder(model.config, model.mpnet.state_dict()).chain(head)
    ids, mask = padded_batch([6, 3], 6, 1, seed=2)
    with torch.inference_mode():
        hidden = model.mpnet(input_ids=ids, attention_mask=mask).last_hidden_state
        expected = head.out((hidden * mask[..., None]).sum(dim=1) / mask.sum(dim=1, keepdim=True))
        torch.testing.assert_close(chain(ids, mask), expected, rtol=1e-5, atol=1e-6)
    assert [s.value for s in TorchBackend(chain).sites] == [f"layers_{i}" for i in range(LAYERS - 1)]


def save_bert_with_minilm_tokenizer(directory: Path) -> PreTrainedModel:
    """A small random BERT over MiniLM's (bert-base-uncased) vocabulary, with its tokenizer, so the Rotten
    Tomatoes texts encode."""
    vocab = json.loads((minilm_dir() / hf_encoders.TOKENIZER_FILE).read_text())["model"]["vocab"]
    model = random_classifier("bert", num_labels=2, vocab_size=len(vocab))
    model.save_pretrained(directory)
    shutil.copyfile(minilm_dir() / hf_encoders.TOKENIZER_FILE, directory / hf_encoders.TOKENIZER_FILE)
    return model


def test_prepare_hf_dir_writes_a_self_contained_bundle_that_serves_over_v2(tmp_path) -> None:
    checkpoint, bundle = tmp_path / "my-bert", tmp_path / "bundle"
    model = save_bert_with_minilm_tokenizer(checkpoint)
    encoded = hf_encoders.text_encoder(checkpoint)(TEXTS)
    result = CliRunner().invoke(app, ["prepare", f"hf:{checkpoint}", "--workload", "rt-drift", "--out", str(bundle),
                                      "--bootstrap", "300", "--profile-budget", "0.05", "--engine", "torch"])
    assert result.exit_code == 0, result.output
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert [s["name"] for s in manifest["sites"]] == [f"layers_{i}" for i in range(LAYERS - 1)]
    assert manifest["meta"]["source"] == {"kind": "hf", "ref": str(checkpoint.resolve()), "small": False}
    shutil.rmtree(checkpoint)  # the bundle carries what it needs

    served = loaded(load_served(str(bundle)))
    assert [i.name for i in served.inputs] == ["input_ids", "attention_mask"]
    # the benches and `rampserve profile` encode the workload's texts with the tokenizer the bundle carries
    carried = prepared_encoder(served.prepared, "text")(TEXTS)
    assert all(np.array_equal(carried[k], encoded[k]) for k in encoded)
    with torch.inference_mode():
        expected = model(**{k: torch.from_numpy(v) for k, v in encoded.items()}).logits.numpy()
    state = build_state([served], ModelSettings(), ServerSettings(port=0, grpc=False))
    with running_server(state, ServerSettings(port=0, grpc=False)) as url:
        client = triton.InferenceServerClient(url.removeprefix("http://"))
        inputs = []
        for name, array in encoded.items():
            tensor = triton.InferInput(name, list(array.shape), "INT64")
            tensor.set_data_from_numpy(array, binary_data=True)
            inputs.append(tensor)
        answer = client.infer(bundle.name, inputs, outputs=[triton.InferRequestedOutput("logits"),
                                                           triton.InferRequestedOutput("label")])
    np.testing.assert_allclose(answer.as_numpy("logits"), expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(answer.as_numpy("label"), expected.argmax(axis=1))


def test_a_directory_that_is_not_a_supported_classifier_says_what_it_found(tmp_path) -> None:
    with pytest.raises(ValueError, match="not a directory"):
        ModelSource.parse(f"hf:{tmp_path / 'nowhere'}")
    with pytest.raises(ValueError, match="holds no config.json"):
        ModelSource.parse(f"hf:{tmp_path}")

    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    GPT2Config(n_layer=1, n_embd=8, n_head=2).save_pretrained(gpt2)
    with pytest.raises(ValueError, match="model_type 'gpt2' is not supported.*bert, roberta, mpnet, distilbert"):
        ModelSource.parse(f"hf:{gpt2}")

    encoder_only = tmp_path / "bert-model"
    torch.manual_seed(0)
    BertModel(CONFIGS["bert"]()).save_pretrained(encoder_only)
    with pytest.raises(ValueError, match="holds a BertModel, not a sequence classifier"):
        ModelSource.parse(f"hf:{encoder_only}")

    no_tokenizer = tmp_path / "no-tokenizer"
    random_classifier("bert").save_pretrained(no_tokenizer)
    with pytest.raises(ValueError, match="has no tokenizer.json"):
        ModelSource.parse(f"hf:{no_tokenizer}")

    headless = tmp_path / "headless"
    random_classifier("bert").save_pretrained(headless)
    shutil.copyfile(minilm_dir() / hf_encoders.TOKENIZER_FILE, headless / hf_encoders.TOKENIZER_FILE)
    weights = load_file(headless / hf_encoders.WEIGHTS_FILE)
    save_file({k: v for k, v in weights.items() if not k.startswith("classifier.")},
              headless / hf_encoders.WEIGHTS_FILE, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"weights lack \['classifier.bias', 'classifier.weight'\]"):
        hf_encoders.from_pretrained_dir(headless)

    with pytest.raises(ValueError, match="text classifier: give it a text workload"):
        model_encoder(ModelSource("hf", str(no_tokenizer)), "image")

    result = CliRunner().invoke(app, ["prepare", f"hf:{gpt2}", "--out", str(tmp_path / "b")])
    assert result.exit_code != 0 and "not supported" in result.output
