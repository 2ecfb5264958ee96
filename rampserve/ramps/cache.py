"""Cache ramps (Freeze Inference): answer from stored intermediate activations of earlier inputs.

A cache ramp reduces a site's activation like a linear ramp (pooling), projects it to a few dimensions (a
learned one-hidden-layer projection, as in the paper, or PCA), and looks it up among stored points, each with
a distribution over labels: k-means centroids with their members' labels (the paper's k-means cache), or the
bootstrap inputs themselves with their own labels (the paper's k-NN cache). The answer is the label with the
highest confidence, share among the neighbours over distance, mapped to an error score in [0, 1] so that the
controller manages a cache ramp exactly like a linear one.

Every served input runs to the end, so its final label can keep the cache current: `update_points` moves the
nearest centroid towards the input and its label distribution towards the label, forgetting old observations
at a fixed rate, and re-seeds the least used centroid where an input lands far from every centroid. Memory
stays what it was when the cache was built.

Everything here except `CacheRamp` is a pure function over NumPy arrays.
"""

from __future__ import annotations

from dataclasses import dataclass

import faiss
import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from rampserve.ramps.pooling import POOLING_REDUCTIONS, PooledLinear
from rampserve.ramps.specs import CacheSpec
from rampserve.ramps.torch_reductions import as_array, reduce_activation

# Additive smoothing of every stored label distribution: a centroid seen once is not sure of anything.
LABEL_PRIOR = 1.0
# An input farther from its nearest centroid than this many times the cache's typical distance re-seeds the
# least used centroid: the region it lies in is not covered.
NOVELTY_DISTANCE = 2.0
# Lookups take microseconds: OpenMP workers would only spin beside the model's own threads.
faiss.omp_set_num_threads(1)
# Usage of each centroid fades by this factor per observed batch, so "least used" means "least used lately".
USAGE_DECAY = 0.999


@dataclass
class CacheState:
    """A cache's arrays. `weight`/`bias` map pooled features to the reduced space (standardisation folded in);
    row i of `points` is a stored point, row i of `counts` its (faded) label counts."""

    weight: np.ndarray  # (features, dim) float32
    bias: np.ndarray  # (dim,) float32
    points: np.ndarray  # (P, dim) float32
    counts: np.ndarray  # (P, classes) float32
    usage: np.ndarray  # (P,) float32, faded number of inputs answered from each point
    distance_scale: float  # median distance of a bootstrap input to its nearest point
    relu: bool  # the learned projection's hidden layer is a ReLU

    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.weight, self.bias, self.points, self.counts, self.usage))


# ---- building -----------------------------------------------------------------------------------------------

def fit_pca(features: np.ndarray, dim: int) -> tuple[np.ndarray, np.ndarray]:
    """(weight, bias) projecting standardised features onto their top `dim` principal components."""
    mean, scale, standardised = _standardise(features)
    _, _, vt = np.linalg.svd(standardised, full_matrices=False)
    components = vt[:dim].T  # (features, dim)
    return _fold(components, np.zeros(components.shape[1]), mean, scale)


def fit_learned_projection(features: np.ndarray, labels: np.ndarray, dim: int, num_classes: int, seed: int,
                           epochs: int = 30, batch_size: int = 128, lr: float = 3e-3) -> tuple[np.ndarray, np.ndarray]:
    """Freeze Inference's reduction: a hidden layer of `dim` ReLUs trained, with a classifier on top, to predict
    the model's labels; the hidden layer is the reduced space (inputs the model labels alike land close)."""
    mean, scale, standardised = _standardise(features)
    x = torch.from_numpy(standardised.astype(np.float32))
    y = torch.from_numpy(labels.astype(np.int64))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        hidden, classifier = nn.Linear(x.shape[1], dim), nn.Linear(dim, num_classes)
        optimizer = torch.optim.AdamW([*hidden.parameters(), *classifier.parameters()], lr=lr, weight_decay=1e-4)
        with torch.inference_mode(False), torch.enable_grad():
            for _ in range(epochs):
                for idx in torch.randperm(len(x)).split(batch_size):
                    loss = F.cross_entropy(classifier(F.relu(hidden(x[idx]))), y[idx])
                    optimizer.zero_grad(set_to_none=True)
                    loss.backward()
                    optimizer.step()
    weight = hidden.weight.detach().numpy().T.astype(np.float64)
    return _fold(weight, hidden.bias.detach().numpy().astype(np.float64), mean, scale)


def _standardise(features: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(mean, scale, standardised features): sites' activations differ in scale by orders of magnitude."""
    mean, scale = features.mean(axis=0), features.std(axis=0) + 1e-6
    return mean, scale, (features - mean) / scale


def _fold(weight: np.ndarray, bias: np.ndarray, mean: np.ndarray, scale: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """((x - mean) / scale) @ weight + bias == x @ (weight / scale) + (bias - (mean / scale) @ weight)."""
    folded = weight / scale[:, None]
    return folded.astype(np.float32), (bias - (mean / scale) @ weight).astype(np.float32)


def embed(features: np.ndarray, weight: np.ndarray, bias: np.ndarray, relu: bool) -> np.ndarray:
    out = features.astype(np.float32, copy=False) @ weight
    out += bias
    return np.maximum(out, 0.0, out=out) if relu else out


def kmeans_points(embedded: np.ndarray, labels: np.ndarray, k: int, num_classes: int, seed: int
                  ) -> tuple[np.ndarray, np.ndarray]:
    """k-means centroids (faiss) and the label counts of each centroid's members."""
    data = np.ascontiguousarray(embedded, dtype=np.float32)
    k = min(k, len(data))
    kmeans = faiss.Kmeans(data.shape[1], k, niter=25, seed=seed, verbose=False, min_points_per_centroid=1)
    kmeans.train(data)
    _, nearest = kmeans.index.search(data, 1)
    return kmeans.centroids.astype(np.float32), label_counts(nearest[:, 0], labels, k, num_classes)


def label_counts(assignment: np.ndarray, labels: np.ndarray, points: int, num_classes: int) -> np.ndarray:
    """(points, classes): how many inputs of each label are assigned to each point."""
    counts = np.zeros((points, num_classes), dtype=np.float32)
    np.add.at(counts, (assignment, labels), 1.0)
    return counts


def build_cache(features: np.ndarray, labels: np.ndarray, spec: CacheSpec, num_classes: int, seed: int) -> CacheState:
    """A cache from bootstrap features (pooled activations) and the original model's labels for them."""
    if spec.reduction == "learned":
        weight, bias = fit_learned_projection(features, labels, spec.dim, num_classes, seed)
    else:
        weight, bias = fit_pca(features, spec.dim)
    relu = spec.reduction == "learned"
    embedded = embed(features, weight, bias, relu)
    if spec.lookup == "kmeans":
        points, counts = kmeans_points(embedded, labels, spec.points, num_classes, seed)
    else:  # k-NN keeps (up to `points`) bootstrap inputs themselves, each with its own label
        keep = np.random.default_rng(seed).permutation(len(embedded))[:spec.points]
        points = np.ascontiguousarray(embedded[keep])
        counts = label_counts(np.arange(len(keep)), labels[keep], len(keep), num_classes)
    distances, _ = _nearest(_flat_index(points), embedded, 1)
    scale = float(np.median(distances[:, 0]))
    return CacheState(weight, bias, points, counts, np.zeros(len(points), dtype=np.float32),
                      scale if scale > 0 else 1.0, relu)


# ---- lookup -------------------------------------------------------------------------------------------------

class Index:
    """What a lookup needs from a cache state, built once per state (the cache changes only through `learn`): a
    faiss flat index over the points, and each point's majority label and its smoothed share."""

    def __init__(self, state: CacheState) -> None:
        self.state = state
        self.flat = _flat_index(state.points)
        probs = label_distribution(state.counts)
        self.label = probs.argmax(axis=1).astype(np.int64)
        self.share = probs.max(axis=1).astype(np.float64)

    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        return _nearest(self.flat, queries, k)

    def lookup(self, features: np.ndarray, neighbours: int
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(labels, error scores, embedded inputs, nearest point index, its distance) for pooled features."""
        state = self.state
        return self.lookup_embedded(embed(features, state.weight, state.bias, state.relu), neighbours)

    def lookup_embedded(self, embedded: np.ndarray, neighbours: int
                        ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        state = self.state
        distances, nearest = self.search(embedded, neighbours)
        if neighbours == 1:  # the same as confident_label, from per-point summaries: this is the serving path
            closest = nearest[:, 0]
            scaled = distances[:, 0] / state.distance_scale
            labels, errors = self.label[closest], scaled / (scaled + self.share[closest])
        else:
            labels, errors = confident_label(state.counts[nearest], distances, state.distance_scale)
        return labels, errors, embedded, nearest[:, 0], distances[:, 0]


def _flat_index(points: np.ndarray) -> faiss.IndexFlatL2:
    index = faiss.IndexFlatL2(points.shape[1])
    index.add(np.ascontiguousarray(points, dtype=np.float32))
    return index


def _nearest(index: faiss.IndexFlatL2, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(distances, indices) of the k nearest indexed points of each query: exact, Euclidean."""
    squared, nearest = index.search(np.ascontiguousarray(queries, dtype=np.float32), k)
    return np.sqrt(np.maximum(squared, 0.0)), nearest


def label_distribution(counts: np.ndarray) -> np.ndarray:
    """Rows of label counts as smoothed probabilities."""
    smoothed = counts + LABEL_PRIOR
    return smoothed / smoothed.sum(axis=-1, keepdims=True)


def confident_label(counts: np.ndarray, distances: np.ndarray, distance_scale: float) -> tuple[np.ndarray, np.ndarray]:
    """Freeze Inference's heuristic, as a label and an error score per input.

    `counts` (n, k, classes) are the label counts of each input's k nearest points and `distances` (n, k) their
    distances. A label's share is its mean probability over the neighbours, its distance the share-weighted
    mean distance of the neighbours, and its confidence share / (distance / distance_scale): agreeing and close
    neighbours give confidence. With one neighbour (a centroid) this is the paper's k-means rule, the majority
    fraction over the distance; with one-hot neighbours it is its k-NN rule. The error score is
    1 / (1 + confidence) = distance / (distance + share): in [0, 1], lower when more confident, like a ramp's."""
    probs = label_distribution(counts)  # (n, k, c)
    share = probs.mean(axis=1)  # (n, c)
    scaled = distances / distance_scale  # (n, k)
    mean_distance = (probs * scaled[:, :, None]).sum(axis=1) / probs.sum(axis=1)
    confidence = share / np.maximum(mean_distance, 1e-12)
    labels = confidence.argmax(axis=1)
    best = confidence[np.arange(len(labels)), labels]
    return labels.astype(np.int64), (1.0 / (1.0 + best)).astype(np.float64)


# ---- thresholds and online updates --------------------------------------------------------------------------

def static_threshold(errors: np.ndarray, correct: np.ndarray) -> float:
    """Freeze Inference's rule, in error scores: exit only below the lowest error score that gave a wrong answer
    on validation data (no validation input would have left wrongly). 1.0 (every input exits) when none was
    wrong."""
    wrong = errors[~correct]
    return float(wrong.min()) if len(wrong) else 1.0


def update_points(state: CacheState, embedded: np.ndarray, nearest: np.ndarray, distances: np.ndarray,
                  labels: np.ndarray, memory: float, move: bool) -> None:
    """Learn from served inputs (in place, memory unchanged): each input's nearest point's label counts fade by
    1 - 1/memory and gain its final label. With `move` (centroids), the point also moves towards the input by
    1/memory (at most; less while it has seen few inputs, as in online k-means), and an input farther than
    NOVELTY_DISTANCE typical distances from every point replaces the least used point, starting it with its
    own label alone. Without `move` (k-NN), such an input replaces the least used stored input."""
    state.usage *= USAGE_DECAY
    fade = 1.0 - 1.0 / memory
    for vector, point, distance, label in zip(embedded, nearest, distances, labels):
        if distance > NOVELTY_DISTANCE * state.distance_scale:
            point = int(np.argmin(state.usage))
            state.points[point] = vector
            state.counts[point] = 0.0
        elif move:
            rate = 1.0 / min(float(state.counts[point].sum()) + 1.0, memory)
            state.points[point] += rate * (vector - state.points[point])
        state.counts[point] *= fade
        state.counts[point, label] += 1.0
        state.usage[point] += 1.0


# ---- the ramp -----------------------------------------------------------------------------------------------

class CacheRamp(nn.Module):
    """A cache behind the ramp interface: `evaluate` answers from the cache; `learn` updates it with the final
    labels of the inputs it last evaluated. Its arrays are buffers, so bundles store them like any weights."""

    def __init__(self, spec, state: CacheState | None = None) -> None:
        super().__init__()
        self.spec = spec
        cache: CacheSpec = spec.cache
        points = cache.points
        if state is None:  # shapes only, for loading a bundle's buffers into
            state = CacheState(np.zeros((int(np.prod(spec.feature_shape)), cache.dim), np.float32),
                               np.zeros(cache.dim, np.float32), np.zeros((points, cache.dim), np.float32),
                               np.zeros((points, spec.num_classes), np.float32), np.zeros(points, np.float32),
                               1.0, cache.reduction == "learned")
        # The projection in nn.Linear's orientation (dim, features), so that pooling and projection run as one
        # `PooledLinear`, like a linear ramp's pooling and head.
        self.register_buffer("projection", torch.from_numpy(np.ascontiguousarray(state.weight.T)))
        for name in ("bias", "points", "counts", "usage"):
            self.register_buffer(name, torch.from_numpy(np.ascontiguousarray(getattr(state, name))))
        self.register_buffer("distance_scale", torch.tensor(state.distance_scale, dtype=torch.float64))
        # Mutable state of the serving path, in a plain object: nn.Module.__setattr__ costs ~7 us a call.
        self._serving = _ServingState()

    def _load_from_state_dict(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003 - torch's signature
        super()._load_from_state_dict(*args, **kwargs)
        self._serving.index = None

    def state(self) -> CacheState:
        """Views of the buffers: updates through it change the ramp."""
        return CacheState(self.projection.numpy().T, self.bias.numpy(), self.points.numpy(), self.counts.numpy(),
                          self.usage.numpy(), float(self.distance_scale), self.spec.cache.reduction == "learned")

    def index(self) -> Index:
        serving = self._serving
        if serving.index is None:
            serving.index = Index(self.state())
        return serving.index

    def from_features(self, features: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Top label and error score per input from pooled features (what training keeps)."""
        labels, errors, *_ = self.index().lookup(features, self.spec.cache.neighbours)
        return labels, errors

    def evaluate(self, activation: torch.Tensor | np.ndarray, score: str = "max_prob") -> tuple[np.ndarray, np.ndarray]:
        """Top label and error score per input (`score` is the models' softmax score: a cache has its own)."""
        serving = self._serving
        index = serving.index or self.index()
        if self.spec.reduce in POOLING_REDUCTIONS:
            projection, bias = self._buffers["projection"], self._buffers["bias"]  # without nn.Module.__getattr__
            key = (tuple(activation.shape[1:]), projection.data_ptr(), bias.data_ptr())
            serving.pooled = pooled = PooledLinear.current(
                serving.pooled, key, self.spec.reduce, lambda: {"weight": projection.numpy(), "bias": bias.numpy()})
            embedded = pooled(as_array(activation))
            if index.state.relu:
                np.maximum(embedded, 0.0, out=embedded)
        else:
            features = as_array(reduce_activation(torch.as_tensor(activation), self.spec.reduce)).reshape(
                len(activation), -1)
            embedded = embed(features, index.state.weight, index.state.bias, index.state.relu)
        labels, errors, embedded, nearest, distances = index.lookup_embedded(embedded, self.spec.cache.neighbours)
        serving.last = (embedded, nearest, distances)
        return labels, errors

    def learn(self, final_labels: np.ndarray) -> bool:
        """Update the cache with the final labels of the inputs `evaluate` last saw. False if it saw none. A
        negative label is unknown (the input left its batch at an exit before the final layer): that input
        teaches nothing."""
        serving = self._serving
        if serving.last is None:
            return False
        embedded, nearest, distances = serving.last
        serving.last = None
        if len(embedded) != len(final_labels):
            raise ValueError(f"{len(final_labels)} final labels for {len(embedded)} looked-up inputs")
        labels = np.asarray(final_labels, dtype=np.int64)
        known = labels >= 0
        if not known.all():
            embedded, nearest, distances, labels = embedded[known], nearest[known], distances[known], labels[known]
        cache = self.spec.cache
        update_points(self.state(), embedded, nearest, distances, labels, cache.memory, move=cache.lookup == "kmeans")
        serving.index = Index(self.state())  # here, after the batch's answers, rather than on the next one's path
        return True

    def memory_bytes(self) -> int:
        return self.state().nbytes()

    def num_parameters(self) -> int:
        return sum(b.numel() for b in self.buffers())


@dataclass
class _ServingState:
    index: Index | None = None  # rebuilt after every update
    pooled: PooledLinear | None = None  # pooling and projection as arrays, for the last activation shape
    last: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None  # embedded, nearest, distance: for `learn`
