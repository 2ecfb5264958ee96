"""Training ramps against the frozen model (Apparate §3.1, §4).

The model runs once over the bootstrap data; each site's activation is reduced (the ramp's parameter-free
first step) and kept. Every head is then fit to the original model's own labels from those features, with
exiting disabled, so a ramp never depends on which other ramps exist. Each ramp draws all its randomness
(initialisation, shuffling, dropout) from a seed derived from the run's seed and its site name alone:
training one ramp by itself gives the same weights as training it among all the others.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F
from tqdm.auto import tqdm

from rampserve.ramps.cache import CacheRamp, build_cache
from rampserve.ramps.kinds import Ramp
from rampserve.ramps.specs import DENSE_KINDS, RampSpec
from rampserve.ramps.torch_reductions import reduce_activation

# Standardising divides each feature by its spread, but never by less than this share of the features' mean
# spread: a feature that barely varies (a ReLU channel that is rarely on) carries no signal to learn, and scaled
# up by its own tiny spread it became weights of 5e4 on resnet18-fmnist's last site, where float32 rounding of the
# pooling's 1/3 weights alone moved a logit by 2e-3.
MIN_SCALE_SHARE = 1e-2


@dataclass(frozen=True)
class TrainConfig:
    seed: int = 0
    val_fraction: float = 0.1
    # Which inputs validate: "random" (a seeded draw: a stream's bootstrap), or "tail" (the last ones: a user's own
    # inputs in their order, so ramps are judged on traffic that came after what they learnt from, as when served)
    validation: str = "random"
    batch_size: int = 128
    lr: float = 1e-2  # the first learning rate
    weight_decay: float = 1e-4
    max_epochs: int = 100
    # The learning rate is cut by `decay_factor` after `decay_patience` epochs without a better validation loss, and
    # a ramp stops after `patience`. Held at 1e-2 and stopped after 6 such epochs of the labels' cross-entropy, a head
    # on standardised features stopped on noise: at 1% disagreement the ramp after lite0-fmnist's block 9 answered
    # 0.49 of the stream; at a fixed 1e-3 0.55, but 540 inputs then reached 0.82 agreement where 1e-2 reached 0.88;
    # with this schedule 0.54, and 0.88 on the 540
    decay_patience: int = 3
    decay_factor: float = 0.3
    patience: int = 10
    # Ramps learn the original model's softened answers (knowledge distillation at this temperature) where its
    # logits are known, and the validation loss is that objective's; 0: its top labels only. On resnet18-fmnist's
    # drifting stream distillation let a ramp answer 8-12 points more of the inputs at the same agreement after
    # layers 2-4 (0.38 -> 0.47 of inputs at 0.5% disagreement after layer 2, 0.81 -> 0.87 after layer 4), and the
    # ramps agreed more overall; on lite0-fmnist MLP ramps on hard labels answered up to 0.03 less at 1% disagreement.
    distill_temperature: float = 3.0


@dataclass(frozen=True)
class RampResult:
    site: str
    epochs: int
    best_epoch: int
    val_accuracy: float  # agreement with the original model's label on held-out bootstrap data
    val_loss: float | None  # None for caches, which have no loss


@dataclass
class TrainReport:
    ramps: dict[str, RampResult]
    num_train: int
    num_val: int
    collect_seconds: float
    train_seconds: float
    val_indices: list[int] = field(repr=False)

    def to_json(self) -> dict:
        data = asdict(self)
        data.pop("val_indices")
        return data


@dataclass
class Features:
    """Reduced activations per site, the original model's labels (and logits), and the inputs' order."""

    by_site: dict[str, torch.Tensor]
    targets: torch.Tensor  # the original model's top label per input
    seconds: float
    teacher: torch.Tensor | None = None  # the original model's logits per input, where known


def collect_features(batches: Iterable[tuple[dict[str, torch.Tensor], torch.Tensor]],
                     specs: dict[str, RampSpec]) -> Features:
    """Reduce and keep every site's activation from (activations by site, final logits) batches."""
    start = time.perf_counter()
    parts: dict[str, list[torch.Tensor]] = {site: [] for site in specs}
    teacher: list[torch.Tensor] = []
    with torch.no_grad():
        for activations, logits in batches:
            for site, spec in specs.items():
                parts[site].append(reduce_activation(activations[site], spec.reduce).float().contiguous())
            teacher.append(logits.float())
    if not teacher:
        raise ValueError("no bootstrap data: ramps need at least one batch to train on")
    logits = torch.cat(teacher)
    return Features(
        by_site={site: torch.cat(chunks) for site, chunks in parts.items()},
        targets=logits.argmax(dim=1),
        seconds=time.perf_counter() - start,
        teacher=logits,
    )


def ramp_seed(seed: int, site: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(site.encode())) % (2**31 - 1)


def split_indices(n: int, config: TrainConfig) -> tuple[np.ndarray, np.ndarray]:
    """(training, validation) indices of `n` inputs: a `val_fraction` validates, drawn or the last (`validation`)."""
    n_val = max(1, int(round(n * config.val_fraction)))
    if n - n_val < 1:
        raise ValueError(f"{n} bootstrap inputs are too few to split into training and validation")
    if config.validation == "tail":
        return np.arange(n - n_val), np.arange(n - n_val, n)
    if config.validation != "random":
        raise ValueError(f"validation {config.validation!r}: give random or tail")
    order = np.random.default_rng(config.seed).permutation(n)
    return np.sort(order[n_val:]), np.sort(order[:n_val])


class _RampTrainer:
    """One ramp's optimiser, early stopping and best weights."""

    def __init__(self, site: str, spec: RampSpec, config: TrainConfig, x_train: torch.Tensor) -> None:
        self.site = site
        # A linear or MLP head learns on standardised features (activations of different sites differ in scale by
        # orders of magnitude, which slows a shared learning rate to a crawl); the scaling is folded into its
        # (first) weights afterwards and the mean kept as the ramp's center (see `Ramp`).
        self.standardize = spec.kind in DENSE_KINDS
        self.mean = x_train.mean(dim=0) if self.standardize else torch.zeros(())
        spread = x_train.std(dim=0)
        self.scale = spread.clamp_min(max(float(spread.mean()) * MIN_SCALE_SHARE, 1e-6)) if self.standardize \
            else torch.ones(())
        self.config = config
        self.seed = ramp_seed(config.seed, site)
        torch.manual_seed(self.seed)
        self.ramp = Ramp(spec)
        self.optimizer = torch.optim.AdamW(self.ramp.parameters(), lr=config.lr, weight_decay=config.weight_decay)
        self.best_loss = float("inf")
        self.best_state = {k: v.clone() for k, v in self.ramp.state_dict().items()}
        self.best_epoch = 0
        self.best_accuracy = 0.0
        self.epochs = 0
        self.last_cut = 0  # the epoch after which the learning rate was last cut

    @property
    def done(self) -> bool:
        return self.epochs >= self.config.max_epochs or self.epochs - self.best_epoch >= self.config.patience

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor, teacher: torch.Tensor | None) -> torch.Tensor:
        """The teacher's logits softened (where given and the config distils), else the labels."""
        temperature = self.config.distill_temperature
        if teacher is None or temperature <= 0:
            return F.cross_entropy(logits, labels)
        return F.kl_div(F.log_softmax(logits / temperature, dim=1), F.softmax(teacher / temperature, dim=1),
                        reduction="batchmean") * temperature ** 2

    def epoch(self, train: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None],
              val: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]) -> None:
        """One pass over the training inputs (features, labels, teacher logits or None), then the loss on the
        validation ones decides the best epoch; the learning rate is cut first where it has not improved lately."""
        (x_train, y_train, teacher), (x_val, y_val, teacher_val) = train, val
        x_train, x_val = (x_train - self.mean) / self.scale, (x_val - self.mean) / self.scale
        if self.epochs - max(self.best_epoch, self.last_cut) >= self.config.decay_patience:
            for group in self.optimizer.param_groups:
                group["lr"] *= self.config.decay_factor
            self.last_cut = self.epochs
        # Re-seeding per (ramp, epoch) keeps this ramp's randomness independent of the other ramps' training.
        torch.manual_seed(self.seed + 7919 * (self.epochs + 1))
        head = self.ramp.head
        head.train()
        order = torch.randperm(len(x_train))
        for start in range(0, len(order), self.config.batch_size):
            idx = order[start:start + self.config.batch_size]
            loss = self._loss(head(x_train[idx]), y_train[idx], None if teacher is None else teacher[idx])
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.optimizer.step()
        self.epochs += 1
        head.eval()
        with torch.no_grad():
            logits = head(x_val)
            val_loss = float(self._loss(logits, y_val, teacher_val))
            accuracy = float((logits.argmax(dim=1) == y_val).float().mean())
        if val_loss < self.best_loss:
            self.best_loss, self.best_epoch, self.best_accuracy = val_loss, self.epochs, accuracy
            self.best_state = {k: v.clone() for k, v in self.ramp.state_dict().items()}

    def result(self) -> tuple[Ramp, RampResult]:
        self.ramp.load_state_dict(self.best_state)
        self.ramp.eval()
        if self.standardize:
            with torch.no_grad():  # W((x - mean) / scale) + b == (W / scale)(x - mean) + b
                self.ramp.dense_layers()[0].weight.div_(self.scale)
                self.ramp.center.copy_(self.mean)
        return self.ramp, RampResult(self.site, self.epochs, self.best_epoch, self.best_accuracy, self.best_loss)


def train_ramps(features: Features, specs: dict[str, RampSpec], config: TrainConfig = TrainConfig(),
                progress: bool = True) -> tuple[dict[str, nn.Module], TrainReport]:
    """Train every ramp in `specs` at once (one pass over epochs, each ramp stepping on its own)."""
    start = time.perf_counter()
    train_idx, val_idx = split_indices(len(features.targets), config)
    t_idx, v_idx = torch.from_numpy(train_idx), torch.from_numpy(val_idx)
    y_train, y_val = features.targets[t_idx], features.targets[v_idx]
    teacher = (None, None) if features.teacher is None else (features.teacher[t_idx], features.teacher[v_idx])
    split = {site: (x[t_idx], x[v_idx]) for site, x in features.by_site.items() if site in specs}
    trainers = [_RampTrainer(site, spec, config, split[site][0]) for site, spec in specs.items()]
    with tqdm(total=config.max_epochs, desc="training ramps", unit="epoch", disable=not progress) as bar:
        while not all(t.done for t in trainers):
            for trainer in trainers:
                if not trainer.done:
                    x_train, x_val = split[trainer.site]
                    trainer.epoch((x_train, y_train, teacher[0]), (x_val, y_val, teacher[1]))
            bar.update(1)
            bar.set_postfix(active=sum(not t.done for t in trainers))
    ramps: dict[str, nn.Module] = {}
    results: dict[str, RampResult] = {}
    for trainer in trainers:
        ramps[trainer.site], results[trainer.site] = trainer.result()
    report = TrainReport(
        ramps=results,
        num_train=len(train_idx),
        num_val=len(val_idx),
        collect_seconds=features.seconds,
        train_seconds=time.perf_counter() - start,
        val_indices=val_idx.tolist(),
    )
    return ramps, report


def build_cache_ramps(features: Features, specs: dict[str, RampSpec], config: TrainConfig = TrainConfig(),
                      progress: bool = True) -> tuple[dict[str, nn.Module], TrainReport]:
    """Build every cache ramp in `specs` from the training part of the bootstrap features (the same split as
    `train_ramps`), and measure its agreement with the original model on the validation part."""
    start = time.perf_counter()
    train_idx, val_idx = split_indices(len(features.targets), config)
    targets = features.targets.numpy()
    ramps: dict[str, nn.Module] = {}
    results: dict[str, RampResult] = {}
    for site, spec in tqdm(specs.items(), desc="building caches", unit="site", disable=not progress):
        x = features.by_site[site].reshape(len(targets), -1).numpy()
        state = build_cache(x[train_idx], targets[train_idx], spec.cache, spec.num_classes, ramp_seed(config.seed, site))
        ramp = CacheRamp(spec, state)
        labels, _ = ramp.from_features(x[val_idx])
        ramps[site] = ramp
        results[site] = RampResult(site, 1, 1, float((labels == targets[val_idx]).mean()), None)
    return ramps, TrainReport(ramps=results, num_train=len(train_idx), num_val=len(val_idx),
                              collect_seconds=features.seconds, train_seconds=time.perf_counter() - start,
                              val_indices=val_idx.tolist())
