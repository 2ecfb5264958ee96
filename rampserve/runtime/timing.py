"""Interleaved timing: on a shared, noisy machine only ratios measured side by side are trusted."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
from tqdm.auto import tqdm


def interleaved_samples(candidates: dict[str, Callable[[], object]], rounds: int, warmup: int = 5,
                        desc: str = "timing", block: int = 1, progress: bool = True, settle_s: float = 0.0
                        ) -> dict[str, np.ndarray]:
    """Milliseconds of each callable, (rounds, block) per callable: within a round every callable runs once, in
    an order that rotates from round to round so none always runs first. With `block` > 1 each runs `block`
    times in a row in its turn, after one untimed run, as a server runs the path in force batch after batch with
    its weights in cache (each compiled set holds its own copy of the model's). `settle_s`: a pause before each
    turn, for callables whose threads go on spinning after they return (torch's OpenMP pool, a bare ONNX Runtime
    session), which would otherwise slow whichever runs next."""
    names = list(candidates)
    for _ in range(warmup):
        for name in names:
            candidates[name]()
    samples = {name: np.zeros((rounds, block)) for name in names}
    for r in tqdm(range(rounds), desc=desc, unit="round", leave=False, disable=not progress):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            run = candidates[name]
            if settle_s:
                time.sleep(settle_s)
            if block > 1:
                run()
            for b in range(block):
                start = time.perf_counter()
                run()
                samples[name][r, b] = (time.perf_counter() - start) * 1000.0
    return samples


def interleaved_medians(candidates: dict[str, Callable[[], object]], rounds: int, warmup: int = 5,
                        desc: str = "timing", block: int = 1) -> dict[str, float]:
    """Median milliseconds of each callable over `interleaved_samples`."""
    samples = interleaved_samples(candidates, rounds, warmup, desc, block)
    return {name: float(np.median(values)) for name, values in samples.items()}


def paired_median(with_: np.ndarray, without: np.ndarray) -> tuple[float, float]:
    """The median of per-round differences between two paths timed in the same rounds ((rounds, block) arrays,
    each round's block summarised by its median), and its standard error (normal approximation of a median's)."""
    differences = np.median(with_, axis=1) - np.median(without, axis=1)
    return float(np.median(differences)), 1.2533 * float(np.std(differences)) / max(1.0, np.sqrt(len(differences)))


def paired_difference(with_: np.ndarray, without: np.ndarray) -> tuple[float, float, float]:
    """`paired_median`'s median and a 95% interval for it: a difference inside the spread of the machine is no
    difference."""
    median, error = paired_median(with_, without)
    return median, median - 1.96 * error, median + 1.96 * error
