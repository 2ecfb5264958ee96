"""What a ramp is, as a bundle's manifest records it: its kind, the reduction of the site's activation it reads,
its features and classes (and a cache ramp's store): plain data, read without torch by whatever serves a bundle."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from rampserve.ramps.pooling import DEEP_CNN_GRID, LINEAR_CNN_GRID, grid_reduction

CACHE_REDUCTIONS = ("learned", "pca")
CACHE_LOOKUPS = ("kmeans", "knn")

@dataclass(frozen=True)
class CacheSpec:
    reduction: str = "learned"  # "learned" (the paper's one-hidden-layer projection) or "pca"
    dim: int = 32  # dimensions of the reduced space
    lookup: str = "kmeans"  # "kmeans" (centroids with majority labels) or "knn" (stored inputs)
    points: int = 128  # centroids (kmeans) or stored inputs (knn): the memory bound
    neighbours: int = 1  # looked up per input: 1 for centroids; the paper's k for k-NN
    memory: float = 256.0  # observations a stored label distribution and centroid position average over

    def __post_init__(self) -> None:
        if self.reduction not in CACHE_REDUCTIONS:
            raise ValueError(f"unknown cache reduction {self.reduction!r}; known: {CACHE_REDUCTIONS}")
        if self.lookup not in CACHE_LOOKUPS:
            raise ValueError(f"unknown cache lookup {self.lookup!r}; known: {CACHE_LOOKUPS}")
        if not 1 <= self.neighbours <= self.points:
            raise ValueError(f"neighbours must lie in [1, points={self.points}], got {self.neighbours}")
        if self.dim < 1 or self.memory < 1:
            raise ValueError("dim and memory must be at least 1")

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> CacheSpec:
        return cls(reduction=str(data["reduction"]), dim=int(data["dim"]), lookup=str(data["lookup"]),
                   points=int(data["points"]), neighbours=int(data["neighbours"]), memory=float(data["memory"]))


@dataclass(frozen=True)
class RampSpec:
    kind: str  # "linear" (Apparate's default), "mlp" (one hidden layer), "deep" or "cache" (Freeze Inference)
    reduce: str  # "spatial_mean", "grid_mean", "sampled_grid_mean", "spatial_grid", "first_token", "token_mean",
    # "token_mean_masked", "identity"
    feature_shape: tuple[int, ...]  # per-sample shape after `reduce`
    num_classes: int
    cache: CacheSpec | None = None  # for kind "cache"
    hidden: int | None = None  # for kind "mlp": the hidden layer's width

    def to_json(self) -> dict:
        # Left out where unused, so that a bundle of another kind reads as it did before these fields
        return {key: value for key, value in asdict(self).items() if key not in ("cache", "hidden") or value}

    @classmethod
    def from_json(cls, data: dict) -> RampSpec:
        return cls(
            kind=str(data["kind"]),
            reduce=str(data["reduce"]),
            feature_shape=tuple(int(d) for d in data["feature_shape"]),
            num_classes=int(data["num_classes"]),
            cache=CacheSpec.from_json(data["cache"]) if data.get("cache") else None,
            hidden=int(data["hidden"]) if data.get("hidden") else None,
        )


RAMP_KINDS = ("linear", "mlp", "deep", "cache")
# Kinds whose head is linear maps on the reduced features (an MLP's with a ReLU between): they learn on standardised
# features, keep the mean as their `center`, and fuse into the serving path's ONNX sessions
DENSE_KINDS = ("linear", "mlp")
# Width of an MLP ramp's hidden layer. On lite0-fmnist 64, 128 and 256 let the ramps after blocks 3-11 answer the
# same share of the stream within noise (0.49-0.68 at 1% disagreement), 0.03-0.07 more than a linear head; the
# first layer's weights (features x width) are most of what the ramp reads per run, so the narrowest was kept
MLP_HIDDEN = 64


def spec_for(kind: str, activation_shape: tuple[int, ...], num_classes: int, token_reduce: str = "first_token",
             cache: CacheSpec | None = None, hidden: int = MLP_HIDDEN) -> RampSpec:
    """The ramp of `kind` for a site whose per-sample activation has `activation_shape`. A cache ramp pools like
    a linear one and stores what `cache` (default: CacheSpec()) says; an MLP ramp reduces like a linear one and has
    a hidden layer `hidden` wide."""
    if kind not in RAMP_KINDS:
        raise ValueError(f"unknown ramp kind {kind!r}; known: {RAMP_KINDS}")
    cache = (cache or CacheSpec()) if kind == "cache" else None
    extra = {"cache": cache, "hidden": hidden if kind == "mlp" else None}
    rank = len(activation_shape)
    if rank == 3:  # (C, H, W) feature map
        channels = activation_shape[0]
        if kind == "deep":
            return RampSpec(kind, "spatial_grid", (channels, DEEP_CNN_GRID, DEEP_CNN_GRID), num_classes)
        return RampSpec(kind, grid_reduction(activation_shape), (channels * LINEAR_CNN_GRID**2,), num_classes,
                        **extra)
    if rank == 2:  # (tokens, hidden)
        return RampSpec(kind, token_reduce, (activation_shape[1],), num_classes, **extra)
    return RampSpec(kind, "identity", (numel(activation_shape),), num_classes, **extra)


def numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


