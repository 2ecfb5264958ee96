"""Fashion-MNIST from Debian's `dataset-fashion-mnist` package (idx files, gzip)."""

from __future__ import annotations

import gzip
from functools import lru_cache
from pathlib import Path
from typing import Literal

import numpy as np

FMNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
CLASSES = (
    "t-shirt", "trouser", "pullover", "dress", "coat",
    "sandal", "shirt", "sneaker", "bag", "ankle-boot",
)
# Mean and standard deviation of the training pixels scaled to [0, 1].
PIXEL_MEAN = 0.2860
PIXEL_STD = 0.3530

Split = Literal["train", "test"]
_FILE_PREFIX = {"train": "train", "test": "t10k"}


def _read_idx(path: Path, header_bytes: int) -> np.ndarray:
    if not path.exists():
        raise FileNotFoundError(
            f"{path} is missing: install Debian's dataset-fashion-mnist (the setup script does)"
        )
    with gzip.open(path, "rb") as f:
        return np.frombuffer(f.read(), dtype=np.uint8, offset=header_bytes)


@lru_cache(maxsize=2)
def load_fashion_mnist(split: Split = "train") -> tuple[np.ndarray, np.ndarray]:
    """Images as uint8 (N, 28, 28) and labels as int64 (N,)."""
    prefix = _FILE_PREFIX[split]
    images = _read_idx(FMNIST_DIR / f"{prefix}-images-idx3-ubyte.gz", 16).reshape(-1, 28, 28)
    labels = _read_idx(FMNIST_DIR / f"{prefix}-labels-idx1-ubyte.gz", 8).astype(np.int64)
    if len(images) != len(labels):
        raise ValueError(f"Fashion-MNIST {split}: {len(images)} images but {len(labels)} labels")
    images.setflags(write=False)
    labels.setflags(write=False)
    return images, labels


def to_model_input(pixels: np.ndarray) -> np.ndarray:
    """Pixels in [0, 255] (N, 28, 28), any dtype, to the normalised float32 (N, 1, 28, 28) the zoo expects."""
    scaled = np.asarray(pixels, dtype=np.float32) / 255.0
    return ((scaled - PIXEL_MEAN) / PIXEL_STD)[:, None, :, :]
