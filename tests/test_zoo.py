"""The model zoo: fx-traceable architectures, deterministic cached training, the MiniLM classifier."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.fx
from safetensors.torch import load_file
from torch import nn

from rampserve.ramps.torch_reductions import reduce_activation
from rampserve.workloads.fashion_mnist import load_fashion_mnist
from rampserve.workloads.rotten_tomatoes import load_rotten_tomatoes, rt_movie_split
from rampserve.zoo import get_entry, load_trained, train_zoo, zoo_names
from rampserve.zoo import train as train_module
from rampserve.zoo.cnn import resnet18, resnet50, vgg11, vgg16
from rampserve.zoo.registry import LITE0_SMALL_CONFIG, lit_fashion_mnist_examples
from rampserve.zoo.hf_encoders import additive_mask
from rampserve.zoo.minilm import MiniLMClassifier, build_minilm, encode_texts
from rampserve.zoo.train import METRICS_FILE, WEIGHTS_FILE, artifact_dir, fashion_mnist_examples

CNNS = {"resnet18": resnet18, "resnet50": resnet50, "vgg11": vgg11, "vgg16": vgg16}


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("RAMPSERVE_HOME", str(tmp_path))
    return tmp_path


class LeafTracer(torch.fx.Tracer):
    """What the graph analysis does: keep a model's `rampserve_leaf_types` whole."""

    def __init__(self, leaf_types: tuple[type[nn.Module], ...]) -> None:
        super().__init__()
        self.leaf_types = leaf_types

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return isinstance(m, self.leaf_types) or super().is_leaf_module(m, module_qualified_name)


@pytest.mark.parametrize("arch", sorted(CNNS))
def test_cnn_traces_to_an_identical_module(arch: str) -> None:
    torch.manual_seed(0)
    model = CNNS[arch](8).eval()
    x = torch.randn(3, 1, 28, 28)
    traced = torch.fx.symbolic_trace(model)
    with torch.no_grad():
        expected = model(x)
        assert expected.shape == (3, 10)
        assert torch.equal(traced(x), expected)
    # Every conv and linear layer survives as its own call, under its torchvision-style path.
    called = {node.target for node in traced.graph.nodes if node.op == "call_module"}
    weighted = {name for name, m in model.named_modules() if isinstance(m, (nn.Conv2d, nn.Linear))}
    assert weighted <= called


def test_resnet_layout() -> None:
    model = resnet18(16)
    assert [len(getattr(model, f"layer{i}")) for i in range(1, 5)] == [2, 2, 2, 2]
    assert [len(getattr(resnet50(8), f"layer{i}")) for i in range(1, 5)] == [3, 4, 6, 3]
    assert isinstance(model.avgpool, nn.AdaptiveAvgPool2d) and model.fc.out_features == 10
    assert sum(isinstance(m, nn.Conv2d) and m.kernel_size == (3, 3) for m in vgg16(16).features) == 13
    assert sum(isinstance(m, nn.Conv2d) for m in vgg11(16).features) == 8


def test_registry_lists_the_zoo() -> None:
    assert {"resnet18-fmnist", "resnet50-fmnist", "vgg11-fmnist", "vgg16-fmnist", "minilm-rt"} <= set(zoo_names())
    with pytest.raises(KeyError, match="unknown zoo model"):
        get_entry("no-such-model")


def test_build_is_deterministic() -> None:
    entry = get_entry("vgg11-fmnist", small=True)
    first, second = entry.build().state_dict(), entry.build().state_dict()
    assert all(torch.equal(first[k], second[k]) for k in first)


def test_image_encode_feeds_the_model() -> None:
    entry = get_entry("resnet18-fmnist", small=True)
    images, _ = load_fashion_mnist("test")
    feeds = entry.encode(images[:5])
    assert list(feeds) == list(entry.input_names) == ["image"]
    assert feeds["image"].dtype == np.float32 and feeds["image"].shape == (5, 1, 28, 28)
    with torch.no_grad():
        logits = entry.build().eval()(torch.from_numpy(feeds["image"]))
    assert logits.shape == (5, entry.num_classes)


def test_training_is_deterministic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    weights = []
    for run in ("a", "b"):
        monkeypatch.setenv("RAMPSERVE_HOME", str(tmp_path / run))
        metrics = get_entry("vgg11-fmnist", small=True).train()
        weights.append(load_file(artifact_dir("vgg11-fmnist-small") / WEIGHTS_FILE))
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    # Training moved the weights and beat chance (10 classes) even at this size.
    untrained = get_entry("vgg11-fmnist", small=True).build().state_dict()
    assert not torch.equal(weights[0]["classifier.3.weight"], untrained["classifier.3.weight"])
    assert metrics["test_accuracy"] > 0.3


def test_cache_is_reused_and_complete(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = load_trained("resnet18-fmnist", small=True)
    folder = home / "zoo" / "resnet18-fmnist-small"
    assert sorted(p.name for p in folder.iterdir()) == sorted([WEIGHTS_FILE, METRICS_FILE])
    assert not [p for p in (home / "zoo").iterdir() if p.name.startswith(".resnet18") and p.is_dir()]
    assert not model.training
    stamp = (folder / METRICS_FILE).stat().st_mtime_ns

    def no_training(recipe: object) -> None:
        raise AssertionError("a cached model was trained again")

    monkeypatch.setattr(train_module, "fit", no_training)
    again = load_trained("resnet18-fmnist", small=True)
    assert train_zoo(["resnet18-fmnist"], small=True)["resnet18-fmnist"]["test_accuracy"] > 0.1
    assert (folder / METRICS_FILE).stat().st_mtime_ns == stamp
    x = torch.from_numpy(get_entry("resnet18-fmnist").encode(load_fashion_mnist("test")[0][:4])["image"])
    with torch.no_grad():
        assert torch.equal(model(x), again(x))


def test_artifact_from_another_recipe_is_trained_again(home: Path) -> None:
    import json

    load_trained("resnet18-fmnist", small=True)
    metrics_path = home / "zoo" / "resnet18-fmnist-small" / METRICS_FILE
    metrics = json.loads(metrics_path.read_text())
    metrics["hyperparameters"]["epochs"] += 1  # as if the recipe had changed since this artifact was made
    metrics_path.write_text(json.dumps(metrics))
    retrained = train_zoo(["resnet18-fmnist"], small=True)["resnet18-fmnist"]
    assert retrained["hyperparameters"] == json.loads(metrics_path.read_text())["hyperparameters"]
    assert retrained["hyperparameters"]["epochs"] == metrics["hyperparameters"]["epochs"] - 1
    assert retrained["data"] == "fashion_mnist_examples"
    # the same hyper-parameters on other data: trained again too
    metrics = json.loads(metrics_path.read_text())
    metrics_path.write_text(json.dumps(metrics | {"data": "lit_fashion_mnist_examples"}))
    assert train_zoo(["resnet18-fmnist"], small=True)["resnet18-fmnist"]["data"] == "fashion_mnist_examples"
    assert json.loads(metrics_path.read_text())["data"] == "fashion_mnist_examples"


def test_interrupted_training_leaves_no_artifact(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_save = train_module.save_file

    def crash(tensors: dict, path: Path) -> None:
        real_save(tensors, path)
        raise KeyboardInterrupt

    monkeypatch.setattr(train_module, "save_file", crash)
    with pytest.raises(KeyboardInterrupt):
        get_entry("vgg11-fmnist", small=True).train()
    assert [p.name for p in (home / "zoo").iterdir() if not p.name.endswith(".lock")] == []


def test_rt_movie_split_partitions_by_movie() -> None:
    corpus = load_rotten_tomatoes()
    split = rt_movie_split(seed=0)
    rows = np.concatenate(list(split.values()))
    assert np.array_equal(np.sort(rows), np.arange(len(corpus)))
    movies = {part: {corpus.movies[i] for i in idx} for part, idx in split.items()}
    assert not movies["train"] & movies["test"] and not movies["train"] & movies["stream"]
    assert not movies["test"] & movies["stream"]
    total = sum(len(m) for m in movies.values())
    assert abs(len(movies["train"]) / total - 0.6) < 0.01 and abs(len(movies["test"]) / total - 0.1) < 0.01
    assert all(np.array_equal(split[k], rt_movie_split(seed=0)[k]) for k in split)
    assert not np.array_equal(split["test"], rt_movie_split(seed=1)["test"])


def test_encode_texts_pads_to_the_longest() -> None:
    feeds = encode_texts(["fine.", "a long, winding and ultimately rewarding film about nothing much"])
    ids, mask = feeds["input_ids"], feeds["attention_mask"]
    assert ids.dtype == mask.dtype == np.int64 and ids.shape == mask.shape
    assert mask[1].all() and ids.shape[1] == mask[1].sum()  # the longer text sets the width, unpadded
    assert mask[0].sum() == 4 and not mask[0, 4:].any() and not ids[0, 4:].any()  # [CLS] fine . [SEP] + pads
    assert encode_texts(["word " * 200], max_length=16)["input_ids"].shape == (1, 16)


def test_minilm_traces_with_leaf_modules() -> None:
    model = build_minilm(num_layers=2)
    model.load_pretrained_encoder()
    model.eval()
    tracer = LeafTracer(MiniLMClassifier.rampserve_leaf_types)
    traced = torch.fx.GraphModule(model, tracer.trace(model))
    calls = [node.target for node in traced.graph.nodes if node.op == "call_module"]
    assert calls == ["embeddings", "layers.0", "layers.1", "head"]
    feeds = {k: torch.from_numpy(v) for k, v in encode_texts(["a triumph.", "not good at all, sadly"]).items()}
    with torch.no_grad():
        expected = model(**feeds)
        assert expected.shape == (2, 2)
        torch.testing.assert_close(traced(**feeds), expected)
        # Padding is masked out: a text scores the same alone as next to a longer one.
        alone = {k: torch.from_numpy(v) for k, v in encode_texts(["a triumph."]).items()}
        torch.testing.assert_close(model(**alone)[0], expected[0], atol=1e-5, rtol=1e-4)
        # and every layer zeroes its padded positions, so a ramp's mean over the text's own tokens is the same too
        padded, single = model.embeddings(feeds["input_ids"]), model.embeddings(alone["input_ids"])
        real = feeds["attention_mask"].bool()
        for layer in model.layers:
            padded = layer(padded, additive_mask(feeds["attention_mask"]))
            single = layer(single, additive_mask(alone["attention_mask"]))
            assert not real.all() and torch.equal(padded[~real], torch.zeros_like(padded[~real]))
            torch.testing.assert_close(reduce_activation(padded, "token_mean_masked")[0],
                                       reduce_activation(single, "token_mean_masked")[0], atol=1e-5, rtol=1e-4)
    assert get_entry("minilm-rt").token_reduce == "token_mean_masked"


def test_minilm_small_trains_and_loads(home: Path) -> None:
    entry = get_entry("minilm-rt", small=True)
    assert entry.input_names == ("input_ids", "attention_mask") and entry.task == "text"
    metrics = entry.train()
    assert metrics["num_train"] == 256 and 0.0 <= metrics["test_accuracy"] <= 1.0
    model = load_trained("minilm-rt", small=True)
    feeds = entry.encode(["a triumph.", "a mess."])
    with torch.no_grad():
        logits = model(*(torch.from_numpy(feeds[n]) for n in entry.input_names))
    assert logits.shape == (2, 2) and torch.isfinite(logits).all()


def test_the_vision_flagship_fine_tunes_the_pretrained_lite0() -> None:
    """lite0-fmnist: it takes Fashion-MNIST's grey images and makes of them photos as Lite0 takes them (RGB, scaled
    up, about [-1, 1]) in its own first operators; training starts from the ImageNet-pretrained weights and moves
    them (the whole model learns, not only a classifier) without forgetting where it started, with a 10-way
    classifier that beats chance."""
    from rampserve.runtime.prepare import model_encoder
    from rampserve.runtime.sources import ModelSource
    from rampserve.zoo.efficientnet_lite import build_efficientnet_lite0

    entry = get_entry("lite0-fmnist", small=True)
    metrics = entry.train()  # first: what follows loads the model it trained, not one trained again
    images, _ = load_fashion_mnist("test")
    feeds = entry.encode(images[:3])
    np.testing.assert_array_equal(feeds["image"], images[:3])  # a request carries the 784-byte image
    photos = load_trained("lite0-fmnist", small=True)._input_step(torch.from_numpy(feeds["image"].copy()))
    assert photos.dtype == torch.float32 and photos.shape == (3, 3, 64, 64)
    assert -1.0 <= photos.min() and photos.max() <= 1.0
    assert torch.equal(photos[:, 0], photos[:, 2])  # grey in every channel
    assert not torch.equal(photos[0], photos[1])
    # prepare and the benches encode a zoo model's images with its entry's encoder, not the 28 x 28 CNNs'
    encoded = model_encoder(ModelSource("zoo", "lite0-fmnist", small=True), "image")(images[:3])
    assert np.array_equal(encoded["image"], feeds["image"])
    with pytest.raises(ValueError, match="takes image inputs"):
        model_encoder(ModelSource("zoo", "lite0-fmnist", small=True), "text")
    trained, pretrained = load_trained("lite0-fmnist", small=True).state_dict(), build_efficientnet_lite0().state_dict()
    assert trained.keys() == pretrained.keys()
    body = [k for k in trained if not k.startswith("_fc.") and trained[k].is_floating_point()]
    assert all(torch.isfinite(trained[k]).all() for k in body)
    moved = [k for k in body if not torch.equal(trained[k], pretrained[k])]
    assert "_conv_stem.weight" in moved and "_blocks.8._depthwise_conv.weight" in moved
    # fine-tuned, not trained afresh: each convolution stays nearer its pretrained weights than to none at all
    convolutions = [k for k in moved if k.endswith("conv.weight") or k == "_conv_stem.weight"]
    assert convolutions and all(torch.linalg.norm(trained[k] - pretrained[k]) < torch.linalg.norm(pretrained[k])
                                for k in convolutions)
    assert trained["_fc.weight"].shape == (10, 1280) and metrics["test_accuracy"] > 0.3
    # it trains on the train split as the stream's camera shows it; it is scored on the untouched test split
    assert metrics["data"] == "lit_fashion_mnist_examples"
    lit, untouched = lit_fashion_mnist_examples(LITE0_SMALL_CONFIG), fashion_mnist_examples(LITE0_SMALL_CONFIG)
    np.testing.assert_array_equal(lit[0].labels, untouched[0].labels)
    assert lit[0].items.shape == untouched[0].items.shape and not np.array_equal(lit[0].items, untouched[0].items)
    np.testing.assert_array_equal(lit[1].items, untouched[1].items)
