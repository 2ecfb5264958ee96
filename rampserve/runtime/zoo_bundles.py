"""Prepared bundles of zoo models, built on first use and kept in the artifact cache."""

from __future__ import annotations

from pathlib import Path

from rampserve.paths import bundles_dir
from rampserve.runtime.bundle import BundleError, read_manifest, save_bundle
from rampserve.runtime.prepare import prepare
from rampserve.runtime.sources import ModelSource


def zoo_bundle(model: str, small: bool = False) -> Path:
    """The bundle of zoo model `model`, preparing it (and training the model, if needed) when missing or stale."""
    bundle = bundles_dir() / (model + ("-small" if small else ""))
    try:
        read_manifest(bundle)
    except BundleError:
        save_bundle(prepare(ModelSource.parse(model, small=small)), bundle)
    return bundle
