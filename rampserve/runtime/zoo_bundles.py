"""Prepared bundles of zoo models, built on first use and kept in the artifact cache."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

from rampserve.bundle_format.manifest import VALIDATION_FILE, BundleError, read_manifest, read_signature
from rampserve.paths import bundles_dir, exclusive
from rampserve.ramps.pooling import TOKEN_REDUCTIONS
from rampserve.runtime.bundle import load_bundle, save_bundle, write_signature, write_validation
from rampserve.runtime.engines import AUTO, CHOSEN_BY_TIMING, ONNX_SERVING, EngineChoice, choose_engine
from rampserve.runtime.prepare import (
    PrepareConfig,
    model_encoder,
    prepare,
    ramp_data,
    ramp_kind,
    signature_from_workload,
    token_reduction,
    validation_outputs,
    zoo_revision,
)
from rampserve.runtime.sources import ModelSource


def zoo_bundle(model: str, small: bool = False, config: PrepareConfig = PrepareConfig(), variant: str = "") -> Path:
    """The bundle of zoo model `model` prepared with `config` (kept under the name `model[-small][-variant]`),
    preparing it (and training the model, if needed) when missing, broken, made from another revision of the zoo
    entry, made with other ramps, with ramps trained on other data, or on an engine other than the one `config`
    names or served otherwise on ONNX Runtime (a bundle from before bundles recorded these counts as such), and
    giving it its signature (a text model's, its tokenizer) and its validation outputs when it was prepared before
    bundles carried them."""
    bundle = bundles_dir() / (model + ("-small" if small else "") + (f"-{variant}" if variant else ""))
    source = ModelSource.parse(model, small=small)
    with exclusive(bundles_dir(), bundle.name):  # another process may be preparing it
        try:
            manifest = read_manifest(bundle)
            if manifest["meta"].get("zoo_revision", 0) != zoo_revision(source):
                raise BundleError(f"{bundle} was prepared from another revision of {model}")
            if _other_ramps(manifest, source, config):
                raise BundleError(f"{bundle} was prepared with other ramps")
            if manifest["meta"].get("ramp_data") != ramp_data(source, config).record():
                raise BundleError(f"{bundle} has ramps trained on other data")
            engine = manifest["meta"].get("engine", {})
            if config.engine not in (AUTO, engine.get("engine")) or engine.get("onnxruntime_serving") != ONNX_SERVING:
                raise BundleError(f"{bundle} was prepared for another engine, served otherwise on ONNX Runtime, or "
                                  "before the engine was chosen")
            if config.engine == AUTO and _chosen_otherwise(EngineChoice.from_json(engine)):
                raise BundleError(f"{bundle} serves on an engine that its own timings no longer choose")
        except BundleError:
            save_bundle(prepare(source, config), bundle)
            return bundle
        # Upgraded in place rather than prepared again: the cache is shared by every rampserve on the machine, and a
        # bundle that older ones serve from must not be replaced under them (they read the upgraded one as before)
        if "signature" not in manifest:
            write_signature(bundle, signature_from_workload(load_bundle(bundle)))
        elif manifest["meta"].get("task") == "text" and "text" not in manifest["signature"]:
            signature = replace(read_signature(bundle, manifest), text=model_encoder(source, "text"))
            write_signature(bundle, signature)
        if VALIDATION_FILE not in manifest["files"]:
            write_validation(bundle, validation_outputs(load_bundle(bundle), source, config))
        return bundle


def _chosen_otherwise(choice: EngineChoice) -> bool:
    """Whether a timed choice differs from what `choose_engine` makes of its table today (the rule changed)."""
    return choice.chosen_by == CHOSEN_BY_TIMING and bool(choice.timings) and \
        choice.engine != choose_engine(choice.timings)


def _other_ramps(manifest: dict, source: ModelSource, config: PrepareConfig) -> bool:
    """Whether the bundle's ramps differ from those `config` asks for: their kind, a cache's spec, an MLP's width, or
    how they reduce a text encoder's tokens."""
    ramps = [site["ramp"] for site in manifest["sites"]]
    return (manifest["meta"]["ramp_kind"] != ramp_kind(source, config)
            or any(r["cache"] != config.cache.to_json() for r in ramps if r.get("cache"))
            or any(r["hidden"] != config.ramp_hidden for r in ramps if r.get("hidden"))
            or any(r["reduce"] != token_reduction(source) for r in ramps if r["reduce"] in TOKEN_REDUCTIONS))


def main(argv: list[str]) -> None:
    """`python -m rampserve.runtime.zoo_bundles MODEL`: print the directory of the zoo model's bundle, prepared if
    needed (a server finds its zoo models' bundles this way, `serving.shared.models.zoo_bundle_dir`)."""
    try:
        print(zoo_bundle(argv[0]))
    except ValueError as exc:  # not a zoo model: say so without a traceback
        raise SystemExit(f"rampserve: {exc}") from None


if __name__ == "__main__":
    main(sys.argv[1:])
