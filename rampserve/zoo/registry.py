"""The zoo: named models with their inputs, encoders and training recipes.

To add a model, write a factory `(small: bool) -> ZooEntry` and register it with `@register("name")` (or
`register("name")(factory)`); `small=True` must give a variant that trains in seconds, for tests.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from rampserve.bundle_format.text import TOKEN_INPUTS, TextEncoder
from rampserve.workloads.fashion_mnist import to_model_input
from rampserve.workloads.streams import fmnist_drift_lighting
from rampserve.zoo import cnn
from rampserve.zoo.efficientnet_lite import build_lite0_classifier
from rampserve.zoo.train import (
    Examples,
    Recipe,
    TrainConfig,
    artifact_name,
    fashion_mnist_examples,
    load_weights,
    rotten_tomatoes_examples,
    train_cached,
)

if TYPE_CHECKING:
    from rampserve.zoo.minilm import MiniLMClassifier

# Seed of every fresh architecture, so `build()` is the same model each call.
BUILD_SEED = 0
IMAGE_INPUTS = ("image",)
TEXT_INPUTS = TOKEN_INPUTS


@dataclass(frozen=True)
class RampItems:
    """In-domain inputs outside every stream (the model's own training inputs, perhaps as its workload would show
    them) on which ramps learn the model's answers beside the workload's bootstrap."""

    source: str  # where they come from, as bundles record it
    load: Callable[[int], list[str] | np.ndarray]  # the first n of them: texts, or uint8 images (n, 28, 28)


@dataclass(frozen=True)
class ZooEntry:
    name: str
    task: str  # "image" or "text"
    num_classes: int
    input_names: tuple[str, ...]  # the model's positional inputs, in order
    build: Callable[[], nn.Module]  # untrained architecture, deterministic
    encode: Callable[[Any], dict[str, np.ndarray]]  # raw items -> model feeds keyed by input name
    train: Callable[..., dict]  # trains unless cached; returns metrics {"test_accuracy": ..., "seconds": ...}
    token_reduce: str = "first_token"  # how a linear ramp reduces a (tokens, hidden) site (ramps.kinds.spec_for)
    ramp_items: RampItems | None = None  # in-domain inputs the ramps also learn on; none by default
    ramp_kind: str = "linear"  # the ramps `prepare` trains unless told (ramps.kinds.RAMP_KINDS)
    # Raised when what the entry's bundles hold changes (the inputs it takes, the graph before its first layer, the
    # ramps prepare gives it), so that its bundles prepared before are prepared again; its trained weights are kept
    revision: int = 0
    # A text model's tokenizer, loaded when called (`encode` is the same on texts): what its bundles carry, so that it
    # takes text as well as token ids (`bundle_format.text`)
    text_encoder: Callable[[], TextEncoder] | None = None


EntryFactory = Callable[[bool], ZooEntry]
_FACTORIES: dict[str, EntryFactory] = {}


def register(name: str) -> Callable[[EntryFactory], EntryFactory]:
    def decorator(factory: EntryFactory) -> EntryFactory:
        if name in _FACTORIES:
            raise ValueError(f"zoo model {name!r} is already registered")
        _FACTORIES[name] = factory
        return factory

    return decorator


def zoo_names() -> list[str]:
    return list(_FACTORIES)


def get_entry(name: str, small: bool = False) -> ZooEntry:
    try:
        factory = _FACTORIES[name]
    except KeyError:
        raise KeyError(f"unknown zoo model {name!r}; known: {', '.join(zoo_names())}") from None
    return factory(small)


def load_trained(name: str, small: bool = False) -> nn.Module:
    """The trained model in eval mode, training and caching it first if it is not cached yet."""
    entry = get_entry(name, small)
    entry.train()
    return load_weights(entry.build(), artifact_name(name, small))


def seeded(factory: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    """`factory` run under a fixed seed, without disturbing the caller's random state."""

    def build() -> nn.Module:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(BUILD_SEED)
            return factory()

    return build


def encode_images(pixels: np.ndarray) -> dict[str, np.ndarray]:
    """uint8 images (N, 28, 28) -> {"image": normalised float32 (N, 1, 28, 28)}."""
    return {"image": to_model_input(pixels)}


def raw_images(pixels: np.ndarray) -> dict[str, np.ndarray]:
    """uint8 images (N, H, W) -> {"image": the same uint8 (N, H, W)}: for models that normalise in their graph."""
    return {"image": np.ascontiguousarray(pixels, dtype=np.uint8)}


# Fashion-MNIST CNNs. Widths and epochs are set so all full trainings fit the 20-minute CPU budget (see
# the measured seconds in each metrics.json); small variants are width 4 on 2,000 images for one epoch.
CNN_SMALL_WIDTH = 4
CNN_SMALL_CONFIG = TrainConfig(epochs=1, batch_size=64, lr=4e-3, weight_decay=0.05, max_train=2000, max_test=1000)
# The fmnist-drift stream renders the test split, so the train split's images are in-domain inputs no stream
# shows; ramps learn on them under the stream's lighting (times spread over a day, noise of their own seed): on
# resnet18-fmnist, beside the bootstrap, 8,000 of them let the ramps at 7 of 8 sites answer more of the stream at
# 0.99 agreement than 8,000 untouched ones (after the stem 0.37 of it against 0.35; after layer 3.1, 0.70 against
# 0.66). A small variant's ramps take a few, enough to exercise the path without slowing tests.
FMNIST_RAMP_SOURCE = "Fashion-MNIST train split under fmnist-drift's lighting"
FMNIST_RAMP_SEED = 29
CNN_SMALL_RAMP_ITEMS = 256


def fmnist_ramp_items(config: TrainConfig, small: bool) -> RampItems:
    """The train split's images (in the order a model of `config` trained on them, then those it never saw where it
    trained on fewer) under fmnist-drift's lighting."""
    def lit_images(limit: int) -> np.ndarray:
        train = fashion_mnist_examples(replace(config, max_train=None))[0].head(CNN_SMALL_RAMP_ITEMS if small else None)
        return fmnist_drift_lighting(train.items, FMNIST_RAMP_SEED, limit)

    return RampItems(FMNIST_RAMP_SOURCE, lit_images)


def _entry(name: str, task: str, num_classes: int, build: Callable[[], nn.Module], recipe: Recipe,
           token_reduce: str = "first_token", ramp_items: RampItems | None = None, ramp_kind: str = "linear",
           revision: int = 0, text_encoder: Callable[[], TextEncoder] | None = None) -> ZooEntry:
    return ZooEntry(
        name=name,
        task=task,
        num_classes=num_classes,
        input_names=recipe.input_names,
        build=build,
        encode=recipe.encode,
        train=partial(train_cached, recipe),
        token_reduce=token_reduce,
        ramp_items=ramp_items,
        ramp_kind=ramp_kind,
        revision=revision,
        text_encoder=text_encoder,
    )


def _register_cnn(name: str, arch: Callable[[int], nn.Module], width: int, config: TrainConfig) -> None:
    def factory(small: bool) -> ZooEntry:
        build = seeded(partial(arch, CNN_SMALL_WIDTH if small else width))
        recipe = Recipe(
            artifact=artifact_name(name, small),
            init=build,
            encode=encode_images,
            input_names=IMAGE_INPUTS,
            data=fashion_mnist_examples,
            config=CNN_SMALL_CONFIG if small else config,
        )

        return _entry(name, "image", cnn.NUM_CLASSES, build, recipe, ramp_items=fmnist_ramp_items(recipe.config, small))

    register(name)(factory)


_register_cnn("resnet18-fmnist", cnn.resnet18, 16, TrainConfig(epochs=3, batch_size=128, lr=4e-3, weight_decay=0.05))
_register_cnn("resnet50-fmnist", cnn.resnet50, 8, TrainConfig(epochs=3, batch_size=128, lr=4e-3, weight_decay=0.05))
_register_cnn("vgg11-fmnist", cnn.vgg11, 16, TrainConfig(epochs=2, batch_size=128, lr=4e-3, weight_decay=0.05))
_register_cnn("vgg16-fmnist", cnn.vgg16, 16, TrainConfig(epochs=2, batch_size=128, lr=4e-3, weight_decay=0.05))


# The vision flagship: EfficientNet-Lite0 pretrained on ImageNet at its own 224 x 224, fine-tuned whole on
# Fashion-MNIST for one epoch. Its batch-1 time on ONNX Runtime here is milliseconds, where a ramp's fraction of a
# millisecond can pay; the 28 x 28 CNNs take a tenth of one. The stream is fmnist-drift's own (real images, drifting
# light and classes). A request carries the 28 x 28 grey image (784 bytes); the model scales it up to 224 x 224 in
# its first operators (efficientnet_lite.GreyAsPhoto), where a client sending the photo itself sent 600 KB, which
# took more of a served answer than the model did (7.9 ms one request at a time over HTTP, the model 3.3 ms). The
# small variant sees 64 x 64 images and 256 of them.
# Fine-tuned rather than a classifier on frozen ImageNet features, its middle layers learn the task, so ramps there
# agree with it far more often. Offline, on untouched images (4,000 to fine-tune on; both models 0.88 accurate on
# 2,000 held-out train images): at 1% disagreement a ramp with 64 hidden ReLUs on 3,000 images answered 0.74 / 0.82
# / 0.83 / 0.85 / 0.93 of the held-out images after blocks 3 / 5 / 7 / 9 / 11, against 0.62 / 0.65 / 0.67 / 0.72 /
# 0.78 on the frozen features. Fine-tuned as below, it scores 0.887 on the untouched test split (the classifier on
# frozen features 0.906). One epoch of 8,000 images takes 10-18 minutes on 2 cores (2-4 s a batch of 32)
LITE0_SIDE, LITE0_SMALL_SIDE = 224, 64
LITE0_CONFIG = TrainConfig(epochs=1, batch_size=32, lr=5e-4, weight_decay=0.01, warmup=0.1, max_train=8000,
                           max_test=2000)
LITE0_SMALL_CONFIG = TrainConfig(epochs=4, batch_size=32, lr=1e-3, weight_decay=0.01, warmup=0.1, max_train=256,
                                 max_test=256)
# Its training images are shown as fmnist-drift's camera shows the stream's (each at its own time of day, with
# sensor noise; a draw of their own, not the ramps'): fine-tuned on untouched images alone, the model's answers
# under the stream's light were ones its ramps could not foresee (bench sim: 50% of the stream released at 1%
# disagreement in hindsight, p50 1.00x vanilla)
LITE0_LIGHTING_SEED = 31


def lit_fashion_mnist_examples(config: TrainConfig) -> tuple[Examples, Examples]:
    """`fashion_mnist_examples` with the training images under fmnist-drift's lighting; the test split untouched."""
    train, test = fashion_mnist_examples(config)
    return Examples(fmnist_drift_lighting(train.items, LITE0_LIGHTING_SEED), train.labels), test


@register("lite0-fmnist")
def _lite0_fmnist(small: bool) -> ZooEntry:
    config = LITE0_SMALL_CONFIG if small else LITE0_CONFIG
    side = LITE0_SMALL_SIDE if small else LITE0_SIDE
    recipe = Recipe(
        artifact=artifact_name("lite0-fmnist", small),
        init=seeded(partial(build_lite0_classifier, cnn.NUM_CLASSES, True, side)),
        encode=raw_images,
        input_names=IMAGE_INPUTS,
        data=lit_fashion_mnist_examples,
        config=config,
    )
    # Its ramps have a hidden layer (ramps.kinds.MLP_HIDDEN) and learn on 16,000 images of the train split, 8,000 more
    # than the model trained on. At 1% disagreement with the model (a classifier on frozen features then) they
    # answered 0.40-0.81 of the stream after the stem and the 16 blocks (0.50-0.60 after blocks 3-9), against
    # 0.32-0.80 for linear ones trained alike and 0.30-0.61 for the linear ones on 8,000 before; the whole split
    # (52,000 more) added 0.01-0.05 after blocks 3-11
    return _entry("lite0-fmnist", "image", cnn.NUM_CLASSES,
                  seeded(partial(build_lite0_classifier, cnn.NUM_CLASSES, False, side)), recipe,
                  # 1: takes the grey image and makes the photo in its graph (it took the photo itself); 2: its
                  # ramps on the 112x112 maps pool a sample of them (ramps.pooling.SAMPLED_SIDE)
                  ramp_items=fmnist_ramp_items(config, small), ramp_kind="mlp", revision=2)


# MiniLM on Rotten Tomatoes. One epoch reached 0.823 test accuracy against 0.842 for two, at half the cost,
# which keeps all five full trainings well inside 20 minutes on 2 CPU cores. The small variant keeps the
# first two pretrained layers and sees 256 snippets.
MINILM_CONFIG = TrainConfig(epochs=1, batch_size=32, lr=5e-5, weight_decay=0.01, warmup=0.1)
MINILM_SMALL_CONFIG = TrainConfig(
    epochs=1, batch_size=32, lr=5e-5, weight_decay=0.01, warmup=0.1, max_train=256, max_test=256
)
MINILM_SMALL_LAYERS = 2
RT_RAMP_SOURCE = "Rotten Tomatoes training movies' snippets"


def rt_training_snippets(config: TrainConfig) -> RampItems:
    """The snippets a Rotten Tomatoes model trained on: movies no stream shows."""
    return RampItems(RT_RAMP_SOURCE, lambda limit: list(rotten_tomatoes_examples(config)[0].items[:limit]))


def _pretrained(build: Callable[[], MiniLMClassifier]) -> MiniLMClassifier:
    model = build()
    model.load_pretrained_encoder()
    # The embeddings are half the parameters (a 30k-word table): freezing them halves the optimizer's work
    # and keeps a few thousand snippets from dragging the pretrained vocabulary around.
    model.embeddings.requires_grad_(False)
    return model


# The text models' modules are imported by their entries alone: they import transformers (seconds), which building a
# CNN's architecture (an executor loading its bundle) must not wait for


@register("minilm-rt")
def _minilm_rt(small: bool) -> ZooEntry:
    from rampserve.zoo import minilm
    from rampserve.zoo.minilm import build_minilm, encode_texts

    build = seeded(partial(build_minilm, MINILM_SMALL_LAYERS if small else None))
    config = MINILM_SMALL_CONFIG if small else MINILM_CONFIG
    recipe = Recipe(
        artifact=artifact_name("minilm-rt", small),
        init=partial(_pretrained, build),
        encode=encode_texts,
        input_names=TEXT_INPUTS,
        data=rotten_tomatoes_examples,
        config=config,
    )
    # Ramps average each text's own tokens (its layers zero the padding): on rt-drift's evaluation part, the ramps
    # after layers 1-4 answered 0.51, 0.68, 0.89 and 0.96 of the stream with at most 1% of it wrong, against 0.32,
    # 0.42, 0.72 and 0.95 on the first token ([CLS], which only the model's last layers learn to summarise into)
    return _entry("minilm-rt", "text", minilm.NUM_CLASSES, build, recipe, token_reduce="token_mean_masked",
                  ramp_items=rt_training_snippets(config), text_encoder=minilm.text_encoder)


# MPNet-base (all-mpnet-base-v2) on Rotten Tomatoes: only the mean-pooling head trains, on the frozen encoder's
# features computed once (see zoo.mpnet). The small variant keeps the first two pretrained layers and sees 256
# snippets.
MPNET_CONFIG = TrainConfig(epochs=30, batch_size=32, lr=1e-3, weight_decay=0.01, warmup=0.1)
MPNET_SMALL_CONFIG = TrainConfig(epochs=3, batch_size=32, lr=1e-3, weight_decay=0.01, warmup=0.1, max_train=256,
                                 max_test=256)
MPNET_SMALL_LAYERS = 2


@register("mpnet-rt")
def _mpnet_rt(small: bool) -> ZooEntry:
    from rampserve.zoo import mpnet

    layers = MPNET_SMALL_LAYERS if small else None
    config = MPNET_SMALL_CONFIG if small else MPNET_CONFIG
    recipe = Recipe(
        artifact=artifact_name("mpnet-rt", small),
        init=seeded(partial(mpnet.build_mpnet, layers, pretrained=True)),
        encode=mpnet.encode_texts,
        input_names=TEXT_INPUTS,
        data=rotten_tomatoes_examples,
        config=config,
        trainable=lambda model: model.head.classifier,
    )
    # The bootstrap holds 853 distinct snippets: ramps after layer 11 of 12 agreed only 0.91 with the head on them.
    # The training movies' 7,686 snippets (never streamed) give the ramps nine times as many of the model's answers.
    return _entry("mpnet-rt", "text", mpnet.NUM_CLASSES, seeded(partial(mpnet.build_mpnet, layers)), recipe,
                  token_reduce="token_mean_masked", ramp_items=rt_training_snippets(config),
                  text_encoder=mpnet.text_encoder)
