"""Deterministic training of zoo models and the on-disk cache of the results.

An artifact is `zoo_dir()/<name>[-small]/` holding `model.safetensors` and `metrics.json`. It is written into
a temporary folder and renamed into place, so an interrupted run leaves no half artifact, and a present
artifact is never retrained. One training loop (`fit`) serves every model: a model takes its feeds
positionally in `input_names` order and returns logits.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from tqdm import tqdm

from rampserve.paths import exclusive, zoo_dir
from rampserve.workloads.fashion_mnist import load_fashion_mnist
from rampserve.workloads.rotten_tomatoes import load_rotten_tomatoes, rt_movie_split

WEIGHTS_FILE = "model.safetensors"
METRICS_FILE = "metrics.json"
EVAL_BATCH_SIZE = 256
FEATURE_BATCH_SIZE = 32  # inputs of the frozen part of a model computed at once (see `part_inputs`)
# Text batches are drawn from windows of this many batches sorted by length, so each batch pads little.
LENGTH_BUCKET_BATCHES = 50


@dataclass(frozen=True)
class TrainConfig:
    """Hyper-parameters of one training run (all of them end up in metrics.json)."""

    epochs: int
    batch_size: int
    lr: float  # peak learning rate of the one-cycle schedule
    weight_decay: float
    warmup: float = 0.25  # fraction of the steps spent rising to `lr`
    seed: int = 0
    max_train: int | None = None  # use only the first examples of the (shuffled) training set
    max_test: int | None = None


@dataclass(frozen=True)
class Examples:
    """Raw items (what a zoo entry's `encode` takes) with their labels."""

    items: np.ndarray  # uint8 images (N, 28, 28), or an object array of N strings
    labels: np.ndarray  # int64 (N,)
    lengths: np.ndarray | None = None  # per-item size; when given, batches group items of similar size

    def __len__(self) -> int:
        return len(self.labels)

    def head(self, limit: int | None) -> Examples:
        if limit is None:
            return self
        lengths = None if self.lengths is None else self.lengths[:limit]
        return Examples(self.items[:limit], self.labels[:limit], lengths)


@dataclass(frozen=True)
class Recipe:
    """How to produce one artifact: the starting model, its inputs, its data and its hyper-parameters."""

    artifact: str  # folder name under zoo_dir()
    init: Callable[[], nn.Module]  # the model training starts from (fresh or pretrained)
    encode: Callable[[Any], dict[str, np.ndarray]]
    input_names: tuple[str, ...]
    data: Callable[[TrainConfig], tuple[Examples, Examples]]  # (train, test)
    config: TrainConfig
    # The only part that trains, where the rest stays frozen (None: the whole model trains). Its input, computed
    # by the frozen rest, is the same every epoch: it is computed once per example (see `fit_part`).
    trainable: Callable[[nn.Module], nn.Module] | None = None


def fashion_mnist_examples(config: TrainConfig) -> tuple[Examples, Examples]:
    """The Fashion-MNIST train split (shuffled by the seed, then cut to max_train) and the test split."""
    images, labels = load_fashion_mnist("train")
    order = np.random.default_rng(config.seed).permutation(len(labels))
    train = Examples(images[order], labels[order]).head(config.max_train)
    test_images, test_labels = load_fashion_mnist("test")
    return train, Examples(test_images, test_labels).head(config.max_test)


def rotten_tomatoes_examples(config: TrainConfig) -> tuple[Examples, Examples]:
    """Rotten Tomatoes by movie: the "train" movies to fit, the "test" movies to score ("stream" is untouched)."""
    corpus = load_rotten_tomatoes()
    texts = np.asarray(corpus.texts, dtype=object)
    lengths = np.array([len(text) for text in corpus.texts])
    split = rt_movie_split(seed=config.seed)
    train_rows = np.random.default_rng(config.seed).permutation(split["train"])
    train = Examples(texts[train_rows], corpus.labels[train_rows], lengths[train_rows]).head(config.max_train)
    test_rows = split["test"]
    test = Examples(texts[test_rows], corpus.labels[test_rows], lengths[test_rows]).head(config.max_test)
    return train, test


def epoch_batches(examples: Examples, batch_size: int, rng: np.random.Generator) -> list[np.ndarray]:
    """One epoch's batches of indices, in an order fixed by `rng`.

    With lengths, a shuffled epoch is cut into windows that are sorted by length before batching, and the
    batches are shuffled again: batches stay random but hold items of similar length, so padding is cheap.
    """
    order = rng.permutation(len(examples))
    if examples.lengths is not None:
        window = batch_size * LENGTH_BUCKET_BATCHES
        windows = np.split(order, range(window, len(order), window))
        order = np.concatenate([w[np.argsort(examples.lengths[w], kind="stable")] for w in windows])
    batches = np.split(order, range(batch_size, len(order), batch_size))
    return [batches[i] for i in rng.permutation(len(batches))]


def _feeds(recipe: Recipe, items: np.ndarray) -> list[torch.Tensor]:
    encoded = recipe.encode(items)
    return [torch.from_numpy(encoded[name]) for name in recipe.input_names]


def evaluate(model: nn.Module, recipe: Recipe, examples: Examples) -> float:
    """Top-1 accuracy, in eval mode and without gradients."""
    model.eval()
    correct = 0
    with torch.no_grad():
        for start in range(0, len(examples), EVAL_BATCH_SIZE):
            rows = slice(start, start + EVAL_BATCH_SIZE)
            logits = model(*_feeds(recipe, examples.items[rows]))
            correct += int((logits.argmax(dim=1).numpy() == examples.labels[rows]).sum())
    return correct / len(examples)


@contextmanager
def deterministic(seed: int) -> Iterator[None]:
    """Seed torch and insist on deterministic kernels for the duration, restoring the previous setting."""
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(seed)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous)


def part_inputs(model: nn.Module, part: nn.Module, recipe: Recipe, examples: Examples) -> torch.Tensor:
    """What `part` of `model` receives (its one positional input) for each example, in order, with the model in
    eval mode and without gradients. Examples run in order of size, so that a batch pads little."""
    model.eval()
    order = np.argsort(examples.lengths, kind="stable") if examples.lengths is not None else np.arange(len(examples))
    seen: list[torch.Tensor] = []
    hook = part.register_forward_pre_hook(lambda _, args: seen.append(args[0].detach()))
    try:
        with torch.no_grad():
            for start in tqdm(range(0, len(order), FEATURE_BATCH_SIZE), desc=f"{recipe.artifact}: frozen features",
                              unit="batch"):
                model(*_feeds(recipe, examples.items[order[start:start + FEATURE_BATCH_SIZE]]))
    finally:
        hook.remove()
    inputs = torch.empty_like(torch.cat(seen))
    inputs[torch.from_numpy(order)] = torch.cat(seen)
    return inputs


def fit(recipe: Recipe) -> tuple[nn.Module, dict[str, Any]]:
    """Train `recipe.init()` (or only its `recipe.trainable` part) with AdamW on a one-cycle schedule; returns the
    model (eval mode) and metrics."""
    config = recipe.config
    started = time.perf_counter()
    train, test = recipe.data(config)
    with deterministic(config.seed):
        model = recipe.init()
        part = recipe.trainable(model) if recipe.trainable else model
        inputs = None if recipe.trainable is None else part_inputs(model, part, recipe, train)
        parameters = [p for p in part.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(parameters, lr=config.lr, weight_decay=config.weight_decay)
        steps_per_epoch = -(-len(train) // config.batch_size)
        schedule = torch.optim.lr_scheduler.OneCycleLR(
            optimizer, max_lr=config.lr, total_steps=config.epochs * steps_per_epoch, pct_start=config.warmup
        )
        rng = np.random.default_rng(config.seed)
        with tqdm(total=config.epochs * steps_per_epoch, desc=recipe.artifact, unit="step") as progress:
            for _ in range(config.epochs):
                part.train()
                for batch in epoch_batches(train, config.batch_size, rng):
                    logits = model(*_feeds(recipe, train.items[batch])) if inputs is None else part(inputs[batch])
                    loss = nn.functional.cross_entropy(logits, torch.from_numpy(train.labels[batch]))
                    optimizer.zero_grad(set_to_none=True)
                    loss.backward()
                    optimizer.step()
                    schedule.step()
                    progress.update()
                    progress.set_postfix(loss=f"{loss.item():.3f}", refresh=False)
        accuracy = evaluate(model, recipe, test)
    metrics = {
        "model": recipe.artifact,
        "test_accuracy": accuracy,
        "seconds": round(time.perf_counter() - started, 1),
        "seed": config.seed,
        "hyperparameters": asdict(config),
        "data": recipe.data.__name__,
        "num_train": len(train),
        "num_test": len(test),
        "parameters": sum(p.numel() for p in model.parameters()),
        "torch_threads": torch.get_num_threads(),
        "torch_version": torch.__version__,
    }
    return model, metrics


def artifact_dir(artifact: str) -> Path:
    return zoo_dir() / artifact


def artifact_name(name: str, small: bool) -> str:
    return f"{name}-small" if small else name


def read_metrics(artifact: str) -> dict[str, Any] | None:
    """The metrics of a complete artifact, or None when it has not been trained."""
    folder = artifact_dir(artifact)
    if not (folder / WEIGHTS_FILE).is_file() or not (folder / METRICS_FILE).is_file():
        return None
    return json.loads((folder / METRICS_FILE).read_text())


def _trained_with(metrics: dict[str, Any] | None, recipe: Recipe) -> bool:
    """Whether an artifact's metrics say it was trained as `recipe` trains: its hyper-parameters and its data (an
    artifact from before they named it is trained again)."""
    return metrics is not None and metrics.get("hyperparameters") == asdict(recipe.config) and \
        metrics.get("data") == recipe.data.__name__


def train_cached(recipe: Recipe) -> dict[str, Any]:
    """The artifact's metrics, training and saving it first unless the cache holds it, trained with this
    recipe's hyper-parameters and data (an artifact from a different recipe is stale and is trained again)."""
    metrics = read_metrics(recipe.artifact)
    if _trained_with(metrics, recipe):
        return metrics
    with exclusive(zoo_dir(), recipe.artifact):  # another process may be training it
        metrics = read_metrics(recipe.artifact)  # another process may have finished while we waited
        if _trained_with(metrics, recipe):
            return metrics
        model, metrics = fit(recipe)
        staging = Path(tempfile.mkdtemp(prefix=f".{recipe.artifact}.", dir=zoo_dir()))
        try:
            save_file({k: v.detach().contiguous() for k, v in model.state_dict().items()}, staging / WEIGHTS_FILE)
            (staging / METRICS_FILE).write_text(json.dumps(metrics, indent=2) + "\n")
            # mkdtemp makes the folder owner-only; the cache is meant to be read by anyone on the machine.
            staging.chmod(0o755)
            (staging / WEIGHTS_FILE).chmod(0o644)
            final = artifact_dir(recipe.artifact)
            if final.exists():  # a leftover without both files, or a stale artifact from another recipe
                shutil.rmtree(final)
            os.rename(staging, final)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    return metrics


def load_weights(model: nn.Module, artifact: str) -> nn.Module:
    """Load the artifact's safetensors into `model` (strictly) and put it in eval mode."""
    model.load_state_dict(load_file(artifact_dir(artifact) / WEIGHTS_FILE))
    return model.eval()


def train_zoo(names: list[str] | None = None, small: bool = False) -> dict[str, dict]:
    """Train every named zoo model (all of them by default) that is not cached yet; metrics by name."""
    # Imported here because the registry builds its entries from this module's recipes.
    from rampserve.zoo.registry import get_entry, zoo_names

    return {name: get_entry(name, small).train() for name in (names or zoo_names())}
