"""Shared fixtures: a private artifact cache and small prepared models, built once per session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Tests never touch the user's cache. The test cache persists between runs in the checkout (training is
# deterministic, so a cached tiny model is the one the test would train); CI starts from a clean clone.
TEST_HOME = Path(__file__).resolve().parent.parent / ".test-home"
os.environ["RAMPSERVE_HOME"] = str(TEST_HOME)
os.environ["HF_HUB_OFFLINE"] = "1"


@pytest.fixture(scope="session")
def small_prepare_config():
    from rampserve.ramps.train import TrainConfig
    from rampserve.runtime.prepare import PrepareConfig

    return PrepareConfig(bootstrap_items=1200, profile_batch_sizes=(1, 2, 4, 16), profile_repeats=2,
                         train=TrainConfig(max_epochs=8, patience=2), progress=False)


@pytest.fixture(scope="session")
def resnet_prepared(small_prepare_config):
    from rampserve.runtime.prepare import prepare
    from rampserve.runtime.sources import ModelSource

    return prepare(ModelSource("zoo", "resnet18-fmnist", small=True), small_prepare_config)


@pytest.fixture(scope="session")
def resnet_bundle(resnet_prepared, tmp_path_factory) -> Path:
    from rampserve.runtime.bundle import save_bundle

    return save_bundle(resnet_prepared, tmp_path_factory.mktemp("bundles") / "resnet18-small")


@pytest.fixture(scope="session")
def cache_prepared(small_prepare_config):
    """The small ResNet with a (small) k-means cache ramp at every site."""
    from dataclasses import replace

    from rampserve.ramps.cache import CacheSpec
    from rampserve.runtime.prepare import prepare
    from rampserve.runtime.sources import ModelSource

    config = replace(small_prepare_config, ramp_kind="cache", cache=CacheSpec(points=16, dim=8))
    return prepare(ModelSource("zoo", "resnet18-fmnist", small=True), config)


@pytest.fixture(scope="session")
def cache_bundle(cache_prepared, tmp_path_factory) -> Path:
    from rampserve.runtime.bundle import save_bundle

    return save_bundle(cache_prepared, tmp_path_factory.mktemp("bundles") / "resnet18-small-cache")


@pytest.fixture(scope="session")
def fmnist_feeds():
    """Real drifting Fashion-MNIST inputs from the evaluation part of the stream."""
    from rampserve.workloads.fashion_mnist import to_model_input
    from rampserve.workloads.streams import get_stream

    stream = get_stream("fmnist-drift")
    start = stream.evaluation.start
    return to_model_input(stream.items(start, start + 16))
