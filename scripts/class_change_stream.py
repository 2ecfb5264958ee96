"""Write a stream of Fashion-MNIST images that changes abruptly: the first ROWS images from classes 0-4 (tops,
trousers, dresses, coats), every one after from classes 5-9 (sandals, shirts, sneakers, bags, boots), each part a
shuffle of the training split's images of its classes (or of the first POOL of them), cycled where it asks for more. A `.npy` of uint8
(N, 28, 28) images, the inputs of a model taking raw pixels, for `rampserve bench live --from-cold --data FILE
--change-at ROWS`: ramps trained on the first part's classes stop paying on the second's.

    python scripts/class_change_stream.py OUT.npy ROWS TOTAL [POOL]
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from rampserve.workloads.fashion_mnist import load_fashion_mnist


def main(out: Path, rows: int, total: int, pool_size: int | None = None, seed: int = 0) -> None:
    images, labels = load_fashion_mnist("train")
    rng = np.random.default_rng(seed)
    parts = []
    for classes, length in ((labels < 5, rows), (labels >= 5, total - rows)):
        pool = rng.permutation(np.flatnonzero(classes))[:pool_size]
        parts.append(images[pool[np.arange(length) % len(pool)]])
    np.save(out, np.concatenate(parts).astype(np.uint8))
    print(f"wrote {total} images to {out}: classes 0-4 up to row {rows}, then classes 5-9")


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]) if len(sys.argv) > 4 else None)
