"""mpnet-rt: all-mpnet-base-v2 assembled from its wheels, its small variant trained and prepared with ramps that
pool over an input's own tokens."""

from __future__ import annotations

import io
import zipfile
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from rampserve.paths import home
from rampserve.zoo import get_entry, load_trained
from rampserve.zoo import mpnet_weights
from rampserve.zoo.mpnet import build_mpnet, load_config
from rampserve.zoo.train import artifact_dir


@pytest.fixture
def fresh_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty artifact cache, sharing the assembled weights of the real one (assembling them takes seconds)."""
    weights = home() / "weights"
    mpnet_weights.model_dir()
    monkeypatch.setenv("RAMPSERVE_HOME", str(tmp_path))
    (tmp_path / "weights").symlink_to(weights)
    return tmp_path


def test_the_assembled_checkpoint_is_mpnet_base() -> None:
    folder = mpnet_weights.model_dir()
    assert all((folder / name).is_file() for name in mpnet_weights.NEEDED_FILES)
    config = load_config()
    assert (config.num_hidden_layers, config.hidden_size, config.model_type) == (12, 768, "mpnet")


def test_assembly_refuses_pieces_that_are_not_the_published_weights(tmp_path: Path) -> None:
    archive = io.BytesIO()
    with zipfile.ZipFile(archive, "w") as bundle:
        for name in mpnet_weights.NEEDED_FILES:
            bundle.writestr(f"{mpnet_weights.ARCHIVE_FOLDER}/{name}", f"not {name}")
    data = archive.getvalue()
    pieces = []
    for i, start in enumerate(range(0, len(data), len(data) // 3 + 1)):
        pieces.append(tmp_path / f"{mpnet_weights.ARCHIVE_FOLDER}.zip.{i + 1:03d}")
        pieces[-1].write_bytes(data[start:start + len(data) // 3 + 1])
    target = tmp_path / "cache" / mpnet_weights.ARCHIVE_FOLDER
    target.parent.mkdir()
    with pytest.raises(ValueError, match="SHA-256"):
        mpnet_weights._assemble(pieces, target)
    assert not target.exists() and list(target.parent.iterdir()) == []


def test_mpnet_small_trains_its_head_only(fresh_home: Path) -> None:
    entry = get_entry("mpnet-rt", small=True)
    assert entry.input_names == ("input_ids", "attention_mask") and entry.token_reduce == "token_mean_masked"
    metrics = entry.train()
    assert metrics["num_train"] == 256 and 0.0 <= metrics["test_accuracy"] <= 1.0
    trained = load_trained("mpnet-rt", small=True).state_dict()
    published = build_mpnet(2, pretrained=True).state_dict()  # the encoder the recipe starts from
    changed = {k for k in trained if not torch.equal(trained[k], published[k])}
    assert changed == {"head.classifier.weight", "head.classifier.bias"}
    assert (artifact_dir("mpnet-rt-small") / "model.safetensors").is_file()


def test_mpnet_small_prepares_with_padding_invariant_ramps_and_stages_exactly(small_prepare_config) -> None:
    from rampserve.runtime.prepare import prepare
    from rampserve.runtime.sources import ModelSource
    from rampserve.workloads.streams import get_stream

    config = replace(small_prepare_config, bootstrap_items=200, profile_batch_sizes=(1, 2), profile_repeats=1)
    model = prepare(ModelSource("zoo", "mpnet-rt", small=True), config)
    assert model.site_names == ["layers_0"]  # two layers: one site between them
    assert all(s.ramp.reduce == "token_mean_masked" and s.activation_shape[-1] == 768 for s in model.sites)
    stream = get_stream("rt-drift")
    texts = stream.items(stream.evaluation.start, stream.evaluation.start + 6)
    entry = get_entry("mpnet-rt", small=True)
    feeds = dict(zip(model.backend.input_names, entry.encode(texts).values()))
    reference = model.backend.module(*(torch.from_numpy(feeds[n]) for n in model.backend.input_names))
    seen: dict[tuple, np.ndarray] = {}
    for active in ([], model.site_names):
        assert np.array_equal(model.run(feeds, active=active), reference.detach().numpy())
        assert model.compile(active, {n: np.concatenate([feeds[n][:2]] * 2, axis=1) for n in feeds})
        assert np.array_equal(model.run(feeds, active=active, compiled=True), reference.detach().numpy())
    # A text's ramp answers the same alone as padded in a batch with longer ones
    for row in range(len(texts)):
        alone = entry.encode(texts[row:row + 1])
        for fed, how in ((alone, "alone"), ({n: feeds[n][row:row + 1] for n in feeds}, "padded")):
            model.run(dict(zip(model.backend.input_names, fed.values())), model.site_names,
                      lambda site, top, error, key=(row, how): seen.__setitem__(key, error))
        np.testing.assert_allclose(seen[(row, "alone")], seen[(row, "padded")], rtol=1e-4, atol=1e-5)

