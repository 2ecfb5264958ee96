"""Interleaved timing: on a shared, noisy machine only ratios measured side by side are trusted."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
from tqdm.auto import tqdm


def interleaved_medians(candidates: dict[str, Callable[[], object]], rounds: int, warmup: int = 5,
                        desc: str = "timing", block: int = 1) -> dict[str, float]:
    """Median milliseconds of each callable over `rounds` rounds; within a round every callable runs once, in an
    order that rotates from round to round so none always runs first. With `block` > 1 each runs `block` times in
    a row in its turn, after one untimed run, as a server runs the path in force batch after batch with its
    weights in cache (each compiled set holds its own copy of the model's)."""
    names = list(candidates)
    for _ in range(warmup):
        for name in names:
            candidates[name]()
    samples: dict[str, list[float]] = {name: [] for name in names}
    for r in tqdm(range(rounds), desc=desc, unit="round", leave=False):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            run = candidates[name]
            if block > 1:
                run()
            for _ in range(block):
                start = time.perf_counter()
                run()
                samples[name].append((time.perf_counter() - start) * 1000.0)
    return {name: float(np.median(values)) for name, values in samples.items()}
