"""Ordered workload streams whose input distribution drifts over time.

Early exits only pay off, and ramps only need re-tuning, when the inputs change, so evaluation
replays ordered streams rather than shuffled test sets. Every stream opens with a bootstrap part
(by default the first 10%) on which ramps are trained. Bootstrap items are drawn from base rows
that never occur in the evaluation part, so ramps are never scored on inputs they were fitted on.

A stream precomputes only index arrays (base row and phase per position); raw inputs are rendered
on demand per slice, so `items(a, b)` costs O(b - a) and no stream is ever materialised.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from rampserve.workloads.fashion_mnist import load_fashion_mnist
from rampserve.workloads.rotten_tomatoes import load_rotten_tomatoes, rt_movie_split

DEFAULT_LENGTH = 120_000
BOOTSTRAP_FRACTION = 0.1
# Share of each stratum of base rows (Fashion-MNIST class, or movie sentiment side) reserved for
# bootstrap; the rest feeds the evaluation part.
BOOTSTRAP_POOL_FRACTION = 0.2

# fmnist-drift: a camera that sees different scenes (phases favouring a few classes) under a
# day/night cycle. Midday renders the dataset image almost untouched; midnight lowers contrast,
# lifts the black level (auto-gain) and amplifies sensor noise, yet keeps garments recognisable.
FMNIST_PHASE_LENGTH = 3_000
FMNIST_FAVOURED_CLASSES = 3
FMNIST_FAVOURED_SHARE = 0.8
DAY_LENGTH = 24_000
MIDDAY_CONTRAST, MIDNIGHT_CONTRAST = 1.0, 0.5
MIDDAY_BLACK_LEVEL, MIDNIGHT_BLACK_LEVEL = 0.0, 20.0
MIDDAY_NOISE_STD, MIDNIGHT_NOISE_STD = 2.0, 25.0

# Renders the raw inputs of the given stream positions, whose base rows are given.
Render = Callable[[np.ndarray, np.ndarray], np.ndarray | list[str]]


@dataclass(frozen=True)
class _Layout:
    """What a builder precomputes: per-position index arrays plus how to render them."""

    base_ids: np.ndarray  # int64 (length,), row of the underlying dataset
    phases: np.ndarray  # int64 (length,), non-decreasing
    base_labels: np.ndarray  # int64 labels of all dataset rows
    render: Render


@dataclass(frozen=True)
class Stream:
    name: str
    task: str  # "image" | "text"
    seed: int
    length: int  # total items, bootstrap included
    bootstrap_length: int  # the first items, reserved for training ramps
    # Fully determined by the fields above, hence left out of equality and repr.
    _layout: _Layout = field(repr=False, compare=False)

    def __post_init__(self) -> None:
        for array in (self._layout.base_ids, self._layout.phases):
            if array.shape != (self.length,):
                raise ValueError(f"stream {self.name!r}: index array of shape {array.shape}, expected ({self.length},)")
            array.setflags(write=False)

    def _span(self, start: int, stop: int) -> slice:
        if not 0 <= start <= stop <= self.length:
            raise IndexError(f"slice [{start}, {stop}) outside stream {self.name!r} of length {self.length}")
        return slice(start, stop)

    def items(self, start: int, stop: int) -> np.ndarray | list[str]:
        """Raw inputs: uint8 (n, 28, 28) images, or a list of n strings."""
        return self._layout.render(np.arange(start, stop), self.base_ids(start, stop))

    def labels(self, start: int, stop: int) -> np.ndarray:
        return self._layout.base_labels[self.base_ids(start, stop)]

    def base_ids(self, start: int, stop: int) -> np.ndarray:
        return self._layout.base_ids[self._span(start, stop)]

    def phase(self, start: int, stop: int) -> np.ndarray:
        return self._layout.phases[self._span(start, stop)]

    @property
    def bootstrap(self) -> range:
        return range(0, self.bootstrap_length)

    @property
    def evaluation(self) -> range:
        return range(self.bootstrap_length, self.length)


def _group_shuffle(groups: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Indices into `groups`, sorted by group and in random order within each group."""
    order = rng.permutation(len(groups))
    return order[np.argsort(groups[order], kind="stable")]


def _split_pool(groups: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Disjoint (bootstrap, evaluation) indices into `groups`, stratified so every group feeds both."""
    order = _group_shuffle(groups, rng)
    counts = np.bincount(groups)
    rank_in_group = np.arange(len(order)) - np.repeat(np.cumsum(counts) - counts, counts)
    to_bootstrap = rank_in_group < np.ceil(BOOTSTRAP_POOL_FRACTION * counts)[groups[order]]
    return np.sort(order[to_bootstrap]), np.sort(order[~to_bootstrap])


def _sample_of_class(classes: np.ndarray, pool: np.ndarray, labels: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """For each wanted class, a uniformly random row of `pool` with that label (with replacement)."""
    by_class = pool[np.argsort(labels[pool], kind="stable")]
    counts = np.bincount(labels[pool], minlength=int(labels.max()) + 1)
    starts = np.cumsum(counts) - counts
    return by_class[starts[classes] + (rng.random(len(classes)) * counts[classes]).astype(np.int64)]


def _lighting(positions: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(contrast, black level, noise std) per position: a smooth cycle, midday at position 0."""
    darkness = (1.0 - np.cos(2.0 * np.pi * positions / DAY_LENGTH)) / 2.0
    def blend(midday: float, midnight: float) -> np.ndarray:
        return (midday + (midnight - midday) * darkness).astype(np.float32)
    return (
        blend(MIDDAY_CONTRAST, MIDNIGHT_CONTRAST),
        blend(MIDDAY_BLACK_LEVEL, MIDNIGHT_BLACK_LEVEL),
        blend(MIDDAY_NOISE_STD, MIDNIGHT_NOISE_STD),
    )


def _render_fmnist(images: np.ndarray, seed: int, positions: np.ndarray, base_ids: np.ndarray,
                   noise_keys: np.ndarray | None = None) -> np.ndarray:
    """`images[base_ids]` under the lighting of their stream positions, with sensor noise drawn per noise key
    (default: the position)."""
    contrast, black_level, noise_std = (value[:, None, None] for value in _lighting(positions))
    noise = np.empty((len(positions), *images.shape[1:]), dtype=np.float32)
    for row, key in enumerate(positions if noise_keys is None else noise_keys):
        # A child seed per key keeps every slice independent of what else is rendered.
        rng = np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(int(key),)))
        rng.standard_normal(dtype=np.float32, out=noise[row])
    pixels = images[base_ids] * contrast + black_level + noise * noise_std
    return np.clip(np.rint(pixels), 0, 255).astype(np.uint8)


def fmnist_drift_lighting(images: np.ndarray, seed: int, limit: int | None = None) -> np.ndarray:
    """The first `limit` of `images` (uint8 (N, 28, 28), from outside the stream) as fmnist-drift's camera shows
    them: image i at its own time of day, the N times spread evenly over one day in an order drawn from `seed` (so
    the first few span the day too), with sensor noise of its own drawn from `seed` and i."""
    rows = np.arange(len(images))[:limit]
    times = np.random.default_rng(seed).permutation(len(images))[rows] * DAY_LENGTH // len(images)
    return _render_fmnist(images, seed, times, rows, noise_keys=rows)


def _fmnist_drift(length: int, bootstrap_length: int, seed: int) -> _Layout:
    # The test split: the zoo's models were trained on the train split.
    images, labels = load_fashion_mnist("test")
    n_classes = int(labels.max()) + 1
    rng = np.random.default_rng(seed)
    bootstrap_pool, evaluation_pool = _split_pool(labels, rng)

    phases = np.arange(length, dtype=np.int64) // FMNIST_PHASE_LENGTH
    n_phases = int(phases[-1]) + 1
    favoured = np.argsort(rng.random((n_phases, n_classes)), axis=1)[:, :FMNIST_FAVOURED_CLASSES]
    # Every class keeps some mass in every phase, so each phase still exercises the whole model.
    class_share = np.full((n_phases, n_classes), (1 - FMNIST_FAVOURED_SHARE) / (n_classes - FMNIST_FAVOURED_CLASSES))
    np.put_along_axis(class_share, favoured, FMNIST_FAVOURED_SHARE / FMNIST_FAVOURED_CLASSES, axis=1)
    cumulative = np.cumsum(class_share, axis=1)[phases]
    classes = np.minimum((rng.random(length)[:, None] >= cumulative).sum(axis=1), n_classes - 1)

    base_ids = np.concatenate([
        _sample_of_class(classes[:bootstrap_length], bootstrap_pool, labels, rng),
        _sample_of_class(classes[bootstrap_length:], evaluation_pool, labels, rng),
    ])
    return _Layout(
        base_ids=base_ids,
        phases=phases,
        base_labels=labels,
        render=lambda positions, ids: _render_fmnist(images, seed, positions, ids),
    )


def _movie_visits(
    sides: tuple[np.ndarray, np.ndarray],
    snippets: list[np.ndarray],
    n_items: int,
    first_phase: int,
    rng: np.random.Generator,
) -> tuple[np.ndarray, np.ndarray]:
    """(base ids, phases) of `n_items` items: each phase visits every movie of one sentiment side once,
    in a fresh random order, sides alternating; a visit plays all snippets of the movie back to back."""
    ids, phases = [], []
    phase, total = first_phase, 0
    while total < n_items:
        visit = np.concatenate([snippets[movie] for movie in rng.permutation(sides[phase % 2])])
        ids.append(visit)
        phases.append(np.full(len(visit), phase, dtype=np.int64))
        total += len(visit)
        phase += 1
    return np.concatenate(ids)[:n_items], np.concatenate(phases)[:n_items]


def _rt_drift(length: int, bootstrap_length: int, seed: int) -> _Layout:
    corpus = load_rotten_tomatoes()
    # Default split seed on purpose: it must match the split the text model was fine-tuned on.
    rows = rt_movie_split()["stream"]
    _, movie_of_row = np.unique(np.asarray(corpus.movies)[rows], return_inverse=True)
    n_movies = int(movie_of_row.max()) + 1
    fresh_share = np.bincount(movie_of_row, weights=corpus.labels[rows]) / np.bincount(movie_of_row)
    # Side 1: the more positive half of the movies by share of fresh reviews; side 0: the rest.
    side = np.zeros(n_movies, dtype=np.int64)
    side[np.argsort(fresh_share, kind="stable")[n_movies // 2:]] = 1

    rng = np.random.default_rng(seed)
    by_movie = _group_shuffle(movie_of_row, rng)
    snippets = np.split(rows[by_movie], np.cumsum(np.bincount(movie_of_row))[:-1])
    bootstrap_movies, evaluation_movies = _split_pool(side, rng)

    def sides(movies: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return movies[side[movies] == 0], movies[side[movies] == 1]

    bootstrap_ids, bootstrap_phases = _movie_visits(sides(bootstrap_movies), snippets, bootstrap_length, 0, rng)
    evaluation_ids, evaluation_phases = _movie_visits(
        sides(evaluation_movies), snippets, length - bootstrap_length, int(bootstrap_phases[-1]) + 1, rng
    )
    texts = corpus.texts
    return _Layout(
        base_ids=np.concatenate([bootstrap_ids, evaluation_ids]),
        phases=np.concatenate([bootstrap_phases, evaluation_phases]),
        base_labels=corpus.labels,
        render=lambda positions, ids: [texts[i] for i in ids],
    )


Builder = Callable[[int, int, int], _Layout]  # (length, bootstrap_length, seed) -> layout
_REGISTRY: dict[str, tuple[str, Builder]] = {
    "fmnist-drift": ("image", _fmnist_drift),
    "rt-drift": ("text", _rt_drift),
}


def stream_names() -> list[str]:
    return sorted(_REGISTRY)


def stream_of(name: str, task: str, render: Render, base_ids: np.ndarray, bootstrap_length: int) -> Stream:
    """A stream of given items in their own order, one phase and no labels (a user's own inputs: `bench.own_data`):
    `render(positions, base_ids)` gives the items; equal base ids must render equal items."""
    length = len(base_ids)
    if not 0 < bootstrap_length < length:
        raise ValueError(f"need 0 < bootstrap_length < length, got bootstrap_length={bootstrap_length}, length={length}")
    layout = _Layout(np.asarray(base_ids, dtype=np.int64), np.zeros(length, dtype=np.int64),
                     np.full(length, -1, dtype=np.int64), render)
    return Stream(name, task, 0, length, bootstrap_length, layout)


def get_stream(name: str, length: int = DEFAULT_LENGTH, seed: int = 0, bootstrap_length: int | None = None) -> Stream:
    """The named stream; `bootstrap_length` defaults to 10% of `length`."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown stream {name!r}; known streams: {', '.join(stream_names())}")
    if bootstrap_length is None:
        bootstrap_length = int(length * BOOTSTRAP_FRACTION)
    if not 0 < bootstrap_length < length:
        raise ValueError(f"need 0 < bootstrap_length < length, got bootstrap_length={bootstrap_length}, length={length}")
    task, build = _REGISTRY[name]
    return Stream(name, task, seed, length, bootstrap_length, build(length, bootstrap_length, seed))
