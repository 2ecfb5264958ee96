"""Where a served model comes from: a zoo name, a `module:factory` that builds a torch module, an ONNX file, or
`hf:DIR`, a Hugging Face sequence classifier saved by `save_pretrained`."""

from __future__ import annotations

import importlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn

    from rampserve.zoo.registry import ZooEntry


HF_PREFIX = "hf:"


@dataclass(frozen=True)
class ModelSource:
    kind: str  # "zoo", "factory", "onnx" or "hf"
    ref: str  # zoo name, "package.module:function", path of the .onnx file, or the checkpoint's directory
    small: bool = False  # the zoo's tiny variant, for tests

    @classmethod
    def parse(cls, text: str, small: bool = False) -> ModelSource:
        if text.startswith(HF_PREFIX):
            from rampserve.zoo.hf_encoders import check_checkpoint

            directory = Path(text.removeprefix(HF_PREFIX)).expanduser()
            if not directory.is_dir():
                raise ValueError(f"{text}: {directory} is not a directory (give hf:DIR, a directory written by "
                                 "save_pretrained)")
            check_checkpoint(directory)
            return cls("hf", str(directory.resolve()))
        if text.endswith(".onnx"):
            if not Path(text).is_file():
                raise ValueError(f"ONNX file {text} does not exist")
            return cls("onnx", str(Path(text).resolve()))
        if ":" in text:
            return cls("factory", text)
        from rampserve.zoo.registry import zoo_names

        if text not in zoo_names():
            raise ValueError(f"unknown model {text!r}: give a zoo name ({', '.join(zoo_names())}), "
                             "a path ending in .onnx, module:factory, or hf:DIR")
        return cls("zoo", text, small)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> ModelSource:
        return cls(kind=str(data["kind"]), ref=str(data["ref"]), small=bool(data.get("small", False)))


def import_object(ref: str):
    """The object named by "package.module:attribute" (a model factory, a site policy)."""
    module_name, _, attr = ref.partition(":")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ValueError(f"cannot import {ref!r}: {exc}") from exc


def zoo_entry(source: ModelSource | None) -> ZooEntry | None:
    """The zoo entry of a zoo model's source; None for any other model. The registry is imported here, not at the
    top: it imports the zoo's architectures, which a model from outside the zoo never needs."""
    if source is None or source.kind != "zoo":
        return None
    from rampserve.zoo.registry import get_entry

    return get_entry(source.ref, small=source.small)


def build_architecture(source: ModelSource, bundle_dir: Path) -> nn.Module:
    """The model's architecture, to receive weights from the bundle at `bundle_dir`."""
    if source.kind == "hf":
        from rampserve.zoo.hf_encoders import chain_from_config

        return chain_from_config(bundle_dir)
    entry = zoo_entry(source)
    if entry is not None:
        return entry.build()
    if source.kind == "factory":
        return import_object(source.ref)()
    raise ValueError(f"a {source.kind} source has no torch architecture")


def load_trained(source: ModelSource) -> nn.Module:
    """The user's model with its own weights (zoo models are trained and cached on first use)."""
    if source.kind == "zoo":
        from rampserve.zoo.registry import load_trained as load_zoo

        return load_zoo(source.ref, small=source.small)
    if source.kind == "hf":
        from rampserve.zoo.hf_encoders import from_pretrained_dir

        return from_pretrained_dir(Path(source.ref))
    if source.kind == "factory":
        from torch import nn  # a torch source's: reading where an ONNX model comes from needs no torch

        module = import_object(source.ref)()
        if not isinstance(module, nn.Module):
            raise ValueError(f"{source.ref} returned {type(module).__name__}, not a torch.nn.Module")
        return module.eval()
    raise ValueError(f"a {source.kind} source is not a torch module")


def onnx_file(source: ModelSource, exported: Path) -> Path:
    """The model from `source` as one ONNX file, to serve before it is prepared: an ONNX source's own file, or a
    Hugging Face checkpoint exported to `exported` (once: a file already there is the export). A torch factory's
    inputs (names aside) are not known until data shows them, so it cannot be served unprepared."""
    if source.kind == "onnx":
        return Path(source.ref)
    if source.kind != "hf":
        raise ValueError(f"{source.ref}: a {source.kind} model cannot be served before it is prepared (its inputs' "
                         "types and shapes are unknown until data shows them): prepare it with `rampserve prepare "
                         "--data`, then serve the bundle")
    if exported.is_file():
        return exported
    import torch

    from rampserve.graph.onnx_graph import export_onnx
    from rampserve.zoo.hf_encoders import text_encoder

    example = text_encoder(Path(source.ref))(["an example", "a longer example, to give the export two lengths"])
    partial = exported.with_name(exported.name + ".partial")
    export_onnx(load_trained(source), tuple(torch.from_numpy(array) for array in example.values()), list(example),
                partial)
    return partial.replace(exported)


def architecture_files(source: ModelSource) -> list[Path]:
    """Files a bundle carries to rebuild the architecture (and encode inputs) without the source: an hf
    checkpoint's config and tokenizer, so the bundle keeps working when the checkpoint's directory moves."""
    if source.kind == "hf":
        from rampserve.zoo.hf_encoders import ARCHITECTURE_FILES

        return [Path(source.ref) / name for name in ARCHITECTURE_FILES]
    return []
