"""A bundle carries its model's v2 signature and two example inputs, so serving it needs no dataset; bundles prepared
before that still load."""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy

from rampserve.bundle_format.manifest import EXAMPLE_FILE, BundleError, read_manifest
from rampserve.bundle_format.signature import ModelSignature, TensorSignature
from rampserve.runtime.bundle import load_bundle, save_bundle
from rampserve.serving.executor.loading import load_served, served
from rampserve.serving.shared.protocol import TensorSpec
from rampserve.workloads.fashion_mnist import to_model_input
from rampserve.workloads.streams import get_stream

FMNIST_SIGNATURE = {
    "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 1, 28, 28]}],
    "outputs": [{"name": "label", "datatype": "INT64", "shape": [-1]},
                {"name": "logits", "datatype": "FP32", "shape": [-1, 10]}],
    "max_variable_dim": None,
}


@pytest.fixture(scope="module")
def bootstrap_rows() -> np.ndarray:
    """The workload's first two bootstrap inputs, read from the stream itself."""
    stream = get_stream("fmnist-drift")
    return to_model_input(stream.items(stream.bootstrap.start, stream.bootstrap.start + 2))


def _without_signature(bundle: Path, into: Path) -> Path:
    """A copy of `bundle` as rampserve wrote it before bundles carried their signature."""
    old = Path(shutil.copytree(bundle, into))
    manifest = json.loads((old / "manifest.json").read_text())
    del manifest["signature"], manifest["files"][EXAMPLE_FILE]
    (old / EXAMPLE_FILE).unlink()
    (old / "manifest.json").write_text(json.dumps(manifest))
    return old


@pytest.fixture
def no_datasets(monkeypatch) -> None:
    """This machine has no datasets: reading any workload stream raises as a missing dataset file does."""
    import rampserve.runtime.prepare
    import rampserve.workloads.streams

    def missing(*args, **kwargs):
        raise FileNotFoundError("no datasets on this machine")

    for module in (rampserve.runtime.prepare, rampserve.workloads.streams):
        monkeypatch.setattr(module, "get_stream", missing)
    monkeypatch.setattr(rampserve.workloads.streams.Stream, "items", missing)


def test_a_prepared_bundle_carries_its_signature_and_real_example_inputs(resnet_prepared, resnet_bundle,
                                                                           bootstrap_rows) -> None:
    manifest = read_manifest(resnet_bundle)
    assert manifest["signature"] == FMNIST_SIGNATURE
    example_file = resnet_bundle / EXAMPLE_FILE
    assert manifest["files"][EXAMPLE_FILE] == hashlib.sha256(example_file.read_bytes()).hexdigest()
    example = safetensors.numpy.load_file(example_file)
    assert list(example) == ["x"]
    np.testing.assert_array_equal(example["x"], bootstrap_rows)
    loaded = load_bundle(resnet_bundle).signature
    assert loaded == resnet_prepared.signature
    np.testing.assert_array_equal(loaded.example["x"], resnet_prepared.signature.example["x"])


def test_serving_a_bundle_never_reads_the_workload(resnet_bundle, bootstrap_rows, tmp_path, no_datasets) -> None:
    model = load_served(str(resnet_bundle))
    assert model.inputs == (TensorSpec("x", "FP32", (-1, 1, 28, 28)),)
    assert model.outputs == (TensorSpec("label", "INT64", (-1,)), TensorSpec("logits", "FP32", (-1, 10)))
    assert model.max_variable_dim is None
    np.testing.assert_array_equal(model.example["x"], bootstrap_rows)
    # The same without the signature in the bundle reads the workload: it fails, saying what to do
    with pytest.raises(BundleError, match="prepared before bundles carried their signature.*prepare the model again"):
        load_served(str(_without_signature(resnet_bundle, tmp_path / "old")))


def test_a_bundle_from_before_signatures_serves_where_its_workload_is(resnet_prepared, resnet_bundle,
                                                                      tmp_path) -> None:
    old = load_served(str(_without_signature(resnet_bundle, tmp_path / "old")))
    new = load_served(str(resnet_bundle))
    assert (old.inputs, old.outputs, old.max_variable_dim) == (new.inputs, new.outputs, new.max_variable_dim)
    np.testing.assert_array_equal(old.example["x"], new.example["x"])


def test_the_zoo_upgrades_a_cached_bundle_from_before_signatures_in_place(resnet_bundle, bootstrap_rows,
                                                                          small_prepare_config, tmp_path,
                                                                          monkeypatch) -> None:
    import rampserve.runtime.zoo_bundles as zoo_bundles

    monkeypatch.setenv("RAMPSERVE_HOME", str(tmp_path))
    cached = _without_signature(resnet_bundle, tmp_path / "bundles" / "resnet18-fmnist-small")
    before = read_manifest(cached)

    def no_prepare(*args, **kwargs):
        raise AssertionError("the cached bundle was prepared again")

    monkeypatch.setattr(zoo_bundles, "prepare", no_prepare)
    assert zoo_bundles.zoo_bundle("resnet18-fmnist", small=True, config=small_prepare_config) == cached
    after = read_manifest(cached)  # checks every file's digest, the new example's too
    assert after["signature"] == FMNIST_SIGNATURE
    assert {k: v for k, v in after["files"].items() if k != EXAMPLE_FILE} == before["files"]
    assert {k: v for k, v in after.items() if k not in ("signature", "files")} == \
        {k: v for k, v in before.items() if k != "files"}
    np.testing.assert_array_equal(load_bundle(cached).signature.example["x"], bootstrap_rows)


def test_a_model_without_a_signature_is_not_bundled_or_served_without_a_workload(resnet_prepared, bootstrap_rows,
                                                                                tmp_path) -> None:
    unsigned = replace(resnet_prepared, signature=None, meta={})
    with pytest.raises(ValueError, match="has none"):
        save_bundle(unsigned, tmp_path / "bundle")
    assert not (tmp_path / "bundle").exists()
    with pytest.raises(ValueError, match="give the PreparedModel one"):
        served("m", unsigned)
    given = ModelSignature.of_example({"x": bootstrap_rows}, 10, "image")
    assert served("m", replace(unsigned, signature=given)).inputs == (TensorSpec("x", "FP32", (-1, 1, 28, 28)),)


def test_a_text_signature_has_variable_positions_and_round_trips_in_input_order() -> None:
    example = {"input_ids": np.ones((2, 7), np.int64), "attention_mask": np.ones((2, 7), np.int64)}
    signature = ModelSignature.of_example(example, 2, "text")
    assert signature.inputs == (TensorSignature("input_ids", "INT64", (-1, -1)),
                                TensorSignature("attention_mask", "INT64", (-1, -1)))
    assert signature.outputs[1] == TensorSignature("logits", "FP32", (-1, 2))
    assert signature.max_variable_dim == 512
    # A safetensors file keeps no order: the signature's order is the model's
    loaded = ModelSignature.from_json(json.loads(json.dumps(signature.to_json())), dict(reversed(example.items())))
    assert loaded == signature and list(loaded.example) == ["input_ids", "attention_mask"]
    with pytest.raises(ValueError, match="not the signature's"):
        ModelSignature.from_json(signature.to_json(), {"input_ids": example["input_ids"]})
