"""Bundles: round trip, and clear errors for corrupt or incompatible ones."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import safetensors.torch
import torch
from typer.testing import CliRunner

from rampserve.bundle_format.manifest import VALIDATION_ARRAYS, BundleError, read_manifest
from rampserve.cli import app
from rampserve.runtime.bundle import load_bundle, write_validation
from rampserve.runtime.prepare import validation_outputs
from rampserve.runtime.sources import ModelSource


def test_round_trip_keeps_sites_ramps_profile_and_outputs(resnet_prepared, resnet_bundle, fmnist_feeds) -> None:
    loaded = load_bundle(resnet_bundle)
    assert loaded.site_names == resnet_prepared.site_names
    assert loaded.sites == resnet_prepared.sites
    assert loaded.profile == resnet_prepared.profile
    for site in loaded.site_names:
        for (k, a), (_, b) in zip(loaded.ramps[site].state_dict().items(),
                                  resnet_prepared.ramps[site].state_dict().items()):
            assert torch.equal(a, b), f"{site}.{k}"
    feeds = {loaded.backend.input_names[0]: fmnist_feeds}
    seen: dict[str, list] = {"before": [], "after": []}
    before = resnet_prepared.run(feeds, loaded.site_names, lambda s, l, e: seen["before"].append((s, l, e)))
    after = loaded.run(feeds, loaded.site_names, lambda s, l, e: seen["after"].append((s, l, e)))
    assert np.array_equal(before, after)
    for (s1, l1, e1), (s2, l2, e2) in zip(seen["before"], seen["after"], strict=True):
        assert s1 == s2 and np.array_equal(l1, l2) and np.array_equal(e1, e2)


@pytest.fixture
def bundle_copy(resnet_bundle, tmp_path) -> Path:
    return Path(shutil.copytree(resnet_bundle, tmp_path / "copy"))


def test_a_bundle_keeps_the_answers_on_its_validation_inputs_as_its_served_ramps_give_them(
        resnet_prepared, resnet_bundle, small_prepare_config) -> None:
    """What a server's controller is primed with: every site's ramp's label and error score and the model's own
    label on the inputs the ramps were validated on. Made again from the loaded bundle (as a bundle prepared before
    bundles kept them is given them), on the eager serving path, they are the ones training's features gave."""
    loaded = load_bundle(resnet_bundle)
    kept = loaded.validation
    inputs, sites = len(kept["final"]), len(loaded.site_names)
    assert inputs == loaded.meta["oracle_val"]["inputs"] > 0
    assert kept["labels"].shape == kept["errors"].shape == (inputs, sites)
    for name in VALIDATION_ARRAYS:
        assert np.array_equal(kept[name], resnet_prepared.validation[name])
    again = validation_outputs(loaded, ModelSource("zoo", "resnet18-fmnist", small=True), small_prepare_config)
    assert np.array_equal(again["final"], kept["final"]) and np.array_equal(again["labels"], kept["labels"])
    np.testing.assert_allclose(again["errors"], kept["errors"], atol=1e-4)


def test_validation_outputs_that_do_not_fit_the_sites_are_refused(bundle_copy) -> None:
    validation = load_bundle(bundle_copy).validation
    write_validation(bundle_copy, {**validation, "errors": validation["errors"][:, :-1]})
    with pytest.raises(BundleError, match="validation.safetensors does not hold"):
        load_bundle(bundle_copy)


def test_missing_manifest(bundle_copy) -> None:
    (bundle_copy / "manifest.json").unlink()
    with pytest.raises(BundleError, match="manifest.json is missing"):
        load_bundle(bundle_copy)


def test_manifest_that_is_not_json(bundle_copy) -> None:
    (bundle_copy / "manifest.json").write_text("{not json")
    with pytest.raises(BundleError, match="not valid JSON"):
        load_bundle(bundle_copy)


def test_newer_format_version(bundle_copy) -> None:
    manifest = json.loads((bundle_copy / "manifest.json").read_text())
    manifest["format_version"] = 99
    (bundle_copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match="format 99"):
        load_bundle(bundle_copy)


def test_flipped_byte_in_weights(bundle_copy) -> None:
    path = bundle_copy / "ramps.safetensors"
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(BundleError, match="ramps.safetensors is corrupt"):
        load_bundle(bundle_copy)


def test_missing_weights_file(bundle_copy) -> None:
    (bundle_copy / "model.safetensors").unlink()
    with pytest.raises(BundleError, match="model.safetensors is missing"):
        load_bundle(bundle_copy)


def test_weights_of_another_architecture(bundle_copy) -> None:
    """Same format, consistent digests, but weights that do not fit the declared model."""
    from rampserve.bundle_format.manifest import file_digest

    path = bundle_copy / "model.safetensors"
    state = safetensors.torch.load_file(path)
    first = next(iter(state))
    state[first] = torch.zeros(3, 3)
    safetensors.torch.save_file(state, path)
    manifest = json.loads((bundle_copy / "manifest.json").read_text())
    manifest["files"]["model.safetensors"] = file_digest(path)
    (bundle_copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match="does not fit"):
        load_bundle(bundle_copy)


def test_sites_that_the_model_does_not_have(bundle_copy) -> None:
    manifest = json.loads((bundle_copy / "manifest.json").read_text())
    manifest["sites"][0]["name"] = "no_such_node"
    (bundle_copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match="not sites of the model"):
        load_bundle(bundle_copy)


def test_cli_inspect_json(resnet_bundle) -> None:
    result = CliRunner().invoke(app, ["inspect", str(resnet_bundle), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    manifest = read_manifest(resnet_bundle)
    assert [s["name"] for s in report["sites"]] == [s["name"] for s in manifest["sites"]]
    for site in report["sites"]:
        assert 0.0 <= site["val_accuracy"] <= 1.0
        assert site["stage_ms"]["1"] > 0 and site["ramp_ms"]["16"] > 0
    counts = report["oracle_val"]["exit_counts"]
    assert sum(counts.values()) == report["oracle_val"]["inputs"] == report["training"]["num_val"]


def test_cli_inspect_reports_a_broken_bundle(bundle_copy) -> None:
    (bundle_copy / "manifest.json").write_text("[]")
    result = CliRunner().invoke(app, ["inspect", str(bundle_copy)])
    assert result.exit_code == 2
    assert "not a rampserve bundle" in result.output


def test_cli_profile_measures_again_and_rewrites_only_the_profile(bundle_copy) -> None:
    before = read_manifest(bundle_copy)
    result = CliRunner().invoke(app, ["profile", str(bundle_copy), "--repeats", "1"])
    assert result.exit_code == 0, result.output
    after = read_manifest(bundle_copy)  # checks every file's digest against the rewritten manifest
    assert {k: v for k, v in after.items() if k != "profile"} == {k: v for k, v in before.items() if k != "profile"}
    assert after["profile"] != before["profile"]
    profile = load_bundle(bundle_copy).profile
    assert list(profile.sites) == [s["name"] for s in before["sites"]]
    assert list(profile.batch_sizes) == before["profile"]["batch_sizes"]
    assert all(len(ms) == len(profile.batch_sizes) and min(ms) > 0 for ms in profile.ramp_ms.values())


def test_onnx_model_prepares_runs_staged_and_round_trips(onnx_prepared, fmnist_feeds, tmp_path) -> None:
    """An ONNX file is a first-class source: its stages run on ONNX Runtime and match the whole graph."""
    from rampserve.runtime.bundle import save_bundle
    from rampserve.zoo.registry import load_trained

    module = load_trained("resnet18-fmnist", small=True)
    model = onnx_prepared
    assert model.backend.kind == "onnx" and len(model.sites) >= 4
    feeds = {"image": fmnist_feeds}
    whole = model.backend.split.full(feeds)
    staged = model.run(feeds, active=model.site_names)
    np.testing.assert_allclose(staged, whole, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(whole, module(torch.from_numpy(fmnist_feeds)).detach().numpy(), rtol=1e-4, atol=1e-4)
    loaded = load_bundle(save_bundle(model, tmp_path / "bundle"))
    assert loaded.backend.kind == "onnx" and loaded.site_names == model.site_names
    np.testing.assert_array_equal(loaded.run(feeds, active=loaded.site_names), staged)


def test_cli_prepares_a_user_factory_with_a_site_policy(tmp_path) -> None:
    from rampserve.graph.sites import cut_values
    from rampserve.graph.torch_graph import TorchSplitModel

    out = tmp_path / "bundle"
    result = CliRunner().invoke(app, [
        "prepare", "model_factories:tiny_resnet", "--workload", "fmnist-drift", "--bootstrap", "300",
        "--site-policy", "model_factories:every_other_cut", "--engine", "torch", "--profile-budget", "0.05",
        "--out", str(out)])
    assert result.exit_code == 0, result.output
    expected = [c.value for c in cut_values(TorchSplitModel(resnet_factory()).dataflow)][::2]
    assert [s["name"] for s in read_manifest(out)["sites"]] == expected
    assert load_bundle(out).site_names == expected


def resnet_factory():
    from model_factories import tiny_resnet

    return tiny_resnet()


def test_cli_prepare_rejects_an_unknown_model(tmp_path) -> None:
    result = CliRunner().invoke(app, ["prepare", "no-such-model", "--out", str(tmp_path / "x")])
    assert result.exit_code != 0 and "unknown model" in result.output
