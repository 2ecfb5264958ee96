"""What ramps learn on: the workload's bootstrap, then the zoo model's own in-domain inputs, which no stream shows;
bundles record it, and the zoo's bundle cache prepares a bundle again when it differs."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from rampserve.bundle_format.manifest import read_manifest
from rampserve.runtime.engines import AUTO, CHOSEN_BY_TIMING, EngineChoice, EngineTiming, choose_engine
from rampserve.runtime.prepare import PrepareConfig, ramp_data
from rampserve.runtime.sources import ModelSource
from rampserve.workloads.fashion_mnist import load_fashion_mnist
from rampserve.workloads.streams import get_stream
from rampserve.zoo import get_entry

FMNIST_CNNS = ("resnet18-fmnist", "resnet50-fmnist", "vgg11-fmnist", "vgg16-fmnist")


@pytest.fixture(scope="module")
def streamed_images() -> set[bytes]:
    """Every Fashion-MNIST image fmnist-drift renders (before lighting and noise), checked to be its base images."""
    stream = get_stream("fmnist-drift")
    test_images, _ = load_fashion_mnist("test")
    # At midday (position 0) a rendered input is its base image plus noise of std 2: the stream draws on these
    rendered = stream.items(0, 16).astype(np.float32)
    assert np.abs(rendered - test_images[stream.base_ids(0, 16)]).mean() < 5
    return {image.tobytes() for image in test_images[np.unique(stream.base_ids(0, stream.length))]}


def _unit_rows(images: np.ndarray) -> np.ndarray:
    """Each image as a centred unit vector: dot products are correlations, blind to contrast and black level."""
    rows = images.reshape(len(images), -1).astype(np.float32)
    rows -= rows.mean(axis=1, keepdims=True)
    return rows / np.linalg.norm(rows, axis=1, keepdims=True)


@pytest.mark.parametrize("name", [*FMNIST_CNNS, "lite0-fmnist"])
def test_fmnist_ramps_learn_on_train_split_images_the_stream_never_shows(name: str, streamed_images) -> None:
    """lite0-fmnist trained on 8,000 of the train split: its ramps learn on more of it all the same."""
    data = ramp_data(ModelSource("zoo", name), PrepareConfig())
    assert data.record() == {"bootstrap": {"workload": "fmnist-drift", "items": 8000},
                             "in_domain": {"source": "Fashion-MNIST train split under fmnist-drift's lighting",
                                           "items": 16000}}
    # The bootstrap first, whole, then the in-domain images
    np.testing.assert_array_equal(data.items, np.concatenate([data.bootstrap.items, data.in_domain]))
    # Every in-domain image (a sample of them) is a train-split image under lighting and noise: it is closer to
    # one of those than to any image the stream shows
    train_images = load_fashion_mnist("train")[0]
    assert not {image.tobytes() for image in train_images} & streamed_images
    shown = np.frombuffer(b"".join(streamed_images), np.uint8).reshape(-1, 28, 28)
    sample = _unit_rows(data.in_domain[::80])
    to_train = (sample @ _unit_rows(train_images).T).max(axis=1)
    assert (to_train > (sample @ _unit_rows(shown).T).max(axis=1)).all()


def test_in_domain_images_are_the_entrys_first_and_can_be_left_out() -> None:
    source = ModelSource("zoo", "resnet18-fmnist", small=True)
    load = get_entry("resnet18-fmnist", small=True).ramp_items.load
    data = ramp_data(source, PrepareConfig(bootstrap_items=300, in_domain_items=100))
    np.testing.assert_array_equal(data.in_domain, load(256)[:100])
    assert len(data.items) == 400
    none = ramp_data(source, PrepareConfig(bootstrap_items=300, in_domain_items=0))
    assert none.record()["in_domain"] == {"source": None, "items": 0}
    np.testing.assert_array_equal(none.items, none.bootstrap.items)


@pytest.mark.parametrize("name", ["minilm-rt", "mpnet-rt"])
def test_text_ramps_learn_on_the_training_movies_snippets_never_on_streamed_ones(name: str) -> None:
    stream = get_stream("rt-drift")
    data = ramp_data(ModelSource("zoo", name, small=True), PrepareConfig(in_domain_items=100))
    bootstrap = list(dict.fromkeys(stream.items(stream.bootstrap.start, stream.bootstrap.stop)))
    assert data.items[:len(bootstrap)] == bootstrap
    assert len(data.in_domain) == 100 and len(set(data.items)) == len(data.items)
    assert not set(stream.items(stream.evaluation.start, stream.evaluation.stop)) & set(data.in_domain)
    # No snippet is taken twice, however many are asked for: the small variants trained on 256
    assert len(ramp_data(ModelSource("zoo", name, small=True), PrepareConfig()).in_domain) == 256


def test_a_model_outside_the_zoo_learns_on_the_bootstrap_alone(tmp_path: Path) -> None:
    data = ramp_data(ModelSource("onnx", str(tmp_path / "m.onnx")), PrepareConfig(workload="fmnist-drift",
                                                                                  bootstrap_items=50))
    assert data.record() == {"bootstrap": {"workload": "fmnist-drift", "items": 50},
                             "in_domain": {"source": None, "items": 0}}


def test_the_zoo_prepares_a_cached_bundle_again_when_its_ramps_learned_on_other_data(
        resnet_prepared, resnet_bundle, small_prepare_config, tmp_path, monkeypatch) -> None:
    import rampserve.runtime.zoo_bundles as zoo_bundles

    # The bundle records what its ramps learned on, and they learned on that
    recorded = resnet_prepared.meta["ramp_data"]
    assert recorded == {"bootstrap": {"workload": "fmnist-drift", "items": 1200},
                        "in_domain": {"source": "Fashion-MNIST train split under fmnist-drift's lighting",
                                      "items": 256}}
    training = resnet_prepared.meta["training"]
    assert training["num_train"] + training["num_val"] == 1200 + 256

    monkeypatch.setenv("RAMPSERVE_HOME", str(tmp_path))
    cached = Path(shutil.copytree(resnet_bundle, tmp_path / "bundles" / "resnet18-fmnist-small"))
    prepared: list[PrepareConfig] = []

    def spy(source: ModelSource, config: PrepareConfig):
        prepared.append(config)
        return resnet_prepared

    monkeypatch.setattr(zoo_bundles, "prepare", spy)
    assert zoo_bundles.zoo_bundle("resnet18-fmnist", small=True, config=small_prepare_config) == cached
    assert prepared == []
    for other in (replace(small_prepare_config, in_domain_items=100),
                  replace(small_prepare_config, bootstrap_items=600)):
        assert zoo_bundles.zoo_bundle("resnet18-fmnist", small=True, config=other) == cached
        assert prepared[-1] == other
    # A bundle from before bundles recorded their ramps' data is prepared again too
    manifest = json.loads((cached / "manifest.json").read_text())
    del manifest["meta"]["ramp_data"]
    (cached / "manifest.json").write_text(json.dumps(manifest))
    assert "ramp_data" not in read_manifest(cached)["meta"]
    zoo_bundles.zoo_bundle("resnet18-fmnist", small=True, config=small_prepare_config)
    assert prepared == [replace(small_prepare_config, in_domain_items=100),
                        replace(small_prepare_config, bootstrap_items=600), small_prepare_config]
    assert read_manifest(cached)["meta"]["ramp_data"] == recorded


def test_the_zoo_prepares_a_cached_bundle_again_when_its_ramps_are_of_another_kind(
        resnet_prepared, resnet_bundle, small_prepare_config, tmp_path, monkeypatch) -> None:
    """Another ramp kind than the config's (or the zoo entry's, where the config names none), an MLP of another
    width, or a token reduction the entry does not take: the cached bundle is prepared again."""
    import rampserve.runtime.zoo_bundles as zoo_bundles

    monkeypatch.setenv("RAMPSERVE_HOME", str(tmp_path))
    cached = Path(shutil.copytree(resnet_bundle, tmp_path / "bundles" / "resnet18-fmnist-small"))
    prepared: list[PrepareConfig] = []
    monkeypatch.setattr(zoo_bundles, "prepare", lambda source, config: prepared.append(config) or resnet_prepared)

    def cached_with(**ramp: object) -> None:
        """The cached bundle's manifest with every site's ramp spec updated (and its kind recorded)."""
        manifest = read_manifest(cached)
        for site in manifest["sites"]:
            site["ramp"].update(ramp)
        manifest["meta"]["ramp_kind"] = manifest["sites"][0]["ramp"]["kind"]
        (cached / "manifest.json").write_text(json.dumps(manifest))

    assert get_entry("resnet18-fmnist", small=True).ramp_kind == "linear" and small_prepare_config.ramp_kind is None
    zoo_bundles.zoo_bundle("resnet18-fmnist", small=True, config=small_prepare_config)
    assert prepared == []
    mlp = replace(small_prepare_config, ramp_kind="mlp", ramp_hidden=12)
    zoo_bundles.zoo_bundle("resnet18-fmnist", small=True, config=mlp)
    assert prepared == [mlp]
    cached_with(kind="mlp", hidden=12)
    zoo_bundles.zoo_bundle("resnet18-fmnist", small=True, config=mlp)
    assert prepared == [mlp]
    cached_with(kind="mlp", hidden=12)
    zoo_bundles.zoo_bundle("resnet18-fmnist", small=True, config=replace(mlp, ramp_hidden=16))
    assert prepared[-1].ramp_hidden == 16
    cached_with(reduce="token_mean_masked")  # a text model's reduction the entry (first token) does not take
    zoo_bundles.zoo_bundle("resnet18-fmnist", small=True, config=small_prepare_config)
    assert prepared[-1] == small_prepare_config and len(prepared) == 3


def test_the_zoo_prepares_a_cached_bundle_again_when_its_engine_table_now_chooses_another(
        resnet_prepared, resnet_bundle, small_prepare_config, tmp_path, monkeypatch) -> None:
    """A bundle timed on every engine whose recorded choice the rule of `choose_engine` no longer makes (the rule
    changed since) is prepared again; one it still makes, or one whose engine the user named, is kept."""
    import rampserve.runtime.zoo_bundles as zoo_bundles

    monkeypatch.setenv("RAMPSERVE_HOME", str(tmp_path))
    cached = Path(shutil.copytree(resnet_bundle, tmp_path / "bundles" / "resnet18-fmnist-small"))
    prepared: list[PrepareConfig] = []
    monkeypatch.setattr(zoo_bundles, "prepare", lambda source, config: prepared.append(config) or resnet_prepared)
    timed = replace(small_prepare_config, engine=AUTO)
    # Two threads and one within the spread: the rule takes the one on fewer cores
    table = [EngineTiming("torch", 1, 0.8, 0.7, 1.0), EngineTiming("onnxruntime", 1, 0.2, 0.15, 0.3),
             EngineTiming("onnxruntime-1thread", 1, 0.25, 0.2, 0.35)]

    def cached_choosing(engine: str) -> None:
        manifest = read_manifest(cached)
        manifest["meta"]["engine"] = EngineChoice(engine, CHOSEN_BY_TIMING, tuple(table)).to_json()
        (cached / "manifest.json").write_text(json.dumps(manifest))

    rule = choose_engine(table)
    cached_choosing(rule)
    zoo_bundles.zoo_bundle("resnet18-fmnist", small=True, config=timed)
    assert prepared == []
    other = next(t.engine for t in table if t.engine != rule and t.engine != "torch")
    cached_choosing(other)
    zoo_bundles.zoo_bundle("resnet18-fmnist", small=True, config=timed)
    assert prepared == [timed]
    cached_choosing(other)  # the engine named by the user is kept whatever the table says
    zoo_bundles.zoo_bundle("resnet18-fmnist", small=True, config=replace(small_prepare_config, engine=other))
    assert prepared == [timed]


def test_the_zoo_prepares_a_cached_bundle_again_when_its_entry_serves_otherwise_now(
        resnet_prepared, resnet_bundle, small_prepare_config, tmp_path, monkeypatch) -> None:
    """A bundle records the revision of its zoo entry (what the model takes, the graph before its first layer, its
    ramps); when the entry's revision is raised, its cached bundles are prepared again, and a bundle from before
    bundles recorded one counts as revision 0."""
    import rampserve.runtime.zoo_bundles as zoo_bundles

    monkeypatch.setenv("RAMPSERVE_HOME", str(tmp_path))
    cached = Path(shutil.copytree(resnet_bundle, tmp_path / "bundles" / "resnet18-fmnist-small"))
    prepared: list[PrepareConfig] = []
    monkeypatch.setattr(zoo_bundles, "prepare", lambda source, config: prepared.append(config) or resnet_prepared)
    assert read_manifest(cached)["meta"]["zoo_revision"] == get_entry("resnet18-fmnist", small=True).revision == 0
    manifest = read_manifest(cached)
    del manifest["meta"]["zoo_revision"]
    (cached / "manifest.json").write_text(json.dumps(manifest))
    zoo_bundles.zoo_bundle("resnet18-fmnist", small=True, config=small_prepare_config)
    assert prepared == []
    monkeypatch.setattr(zoo_bundles, "zoo_revision", lambda source: 1)
    zoo_bundles.zoo_bundle("resnet18-fmnist", small=True, config=small_prepare_config)
    assert prepared == [small_prepare_config]
    # the flagship's bundles from before it took grey images (revision 1) are among those prepared again
    assert get_entry("lite0-fmnist", small=True).revision >= 1
