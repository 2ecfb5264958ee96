"""Every site's ramp output for every input of a stream, computed once and cached on disk.

The trace simulator replays real ramp outputs: each input's top label and error score at each site, and the
original model's final label. Inference happens here only, so replaying 100k requests under many policies
costs no model time.
"""

from __future__ import annotations

import hashlib
import io
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from rampserve.bundle_format.manifest import answering_files, read_manifest
from rampserve.paths import home
from rampserve.runtime.compiled import write_atomically
from rampserve.runtime.prepare import feeds_for, prepared_encoder
from rampserve.runtime.prepared import PreparedModel
from rampserve.workloads.streams import Stream

# Inputs per run. A set whose ramps run in Python (cache ramps) is served as one ONNX Runtime session per stage,
# each keeping activations of the batch's size: lite0-fmnist's caches took 5.5 GB at 64 and were killed for memory
# at 256 (21 GB). On these CPUs a batch of 64 runs as fast per input as one of 256.
BATCH = 64


@dataclass(frozen=True)
class RampOutputs:
    sites: tuple[str, ...]  # every site of the model, in model order
    labels: np.ndarray  # (n, sites) top label of each site's ramp
    errors: np.ndarray  # (n, sites) its error score
    final: np.ndarray  # (n,) the original model's label

    def columns(self, sites: tuple[str, ...]) -> list[int]:
        index = {s: i for i, s in enumerate(self.sites)}
        return [index[s] for s in sites]

    def subset(self, rows: np.ndarray) -> RampOutputs:
        return RampOutputs(self.sites, self.labels[rows], self.errors[rows], self.final[rows])


def _compute(model: PreparedModel, stream: Stream, start: int, stop: int, learn_batch: int | None = None
             ) -> RampOutputs:
    sites = tuple(model.site_names)
    encoder = prepared_encoder(model, stream.task)
    # Text streams revisit the same sentences: run each distinct base row once (unless caches learn as they go,
    # when every visit counts).
    if stream.task == "text" and learn_batch is None:
        base = stream.base_ids(start, stop)
        distinct, first, inverse = np.unique(base, return_index=True, return_inverse=True)
        # in order of length, so that a batch pads little (a 12-layer encoder spends most of its time on padding
        # in batches of texts in stream order)
        by_length = np.argsort([len(stream.items(p, p + 1)[0]) for p in start + first], kind="stable")
        positions, inverse = start + first[by_length], np.argsort(by_length)[inverse]
    else:
        positions, inverse = np.arange(start, stop), None
    labels = np.zeros((len(positions), len(sites)), dtype=np.int64)
    errors = np.zeros((len(positions), len(sites)), dtype=np.float32)
    final = np.zeros(len(positions), dtype=np.int64)
    batch = learn_batch or BATCH
    # On ONNX Runtime the set of every site as it is served (the model whole, its ramps inside): faster than a
    # session per site, and it keeps one session's memory instead of each stage's at this batch size
    compiled = model.build_compiled(sites, feeds_for(model.backend, encoder, _items_at(stream, positions[:2]))) \
        if model.backend.kind == "onnx" and learn_batch is None else None
    for a in tqdm(range(0, len(positions), batch), desc=f"ramp outputs on {stream.name}", unit="batch"):
        chunk = positions[a:a + batch]
        rows = slice(a, a + len(chunk))
        feeds = feeds_for(model.backend, encoder, _items_at(stream, chunk))
        labels[rows], errors[rows], final[rows] = model.ramp_answers(feeds, compiled or False)
        if learn_batch is not None:
            model.learn(final[rows])
    if inverse is not None:
        labels, errors, final = labels[inverse], errors[inverse], final[inverse]
    return RampOutputs(sites, labels, errors, final)


def _items_at(stream: Stream, positions: np.ndarray) -> list | np.ndarray:
    return [stream.items(int(p), int(p) + 1)[0] for p in positions] if stream.task == "text" else \
        _contiguous_items(stream, positions)


def _contiguous_items(stream: Stream, positions: np.ndarray) -> np.ndarray:
    return stream.items(int(positions[0]), int(positions[-1]) + 1)


def ramp_outputs(model: PreparedModel, bundle_dir: Path, stream: Stream, start: int, stop: int,
                 learn_batch: int | None = None) -> RampOutputs:
    """Cached by the bundle's files (their hashes; `answering_files`) and error score, the stream and the range:
    re-profiling a bundle, or giving it its validation outputs, changes its manifest but not what its ramps answer.
    With `learn_batch`, inputs run in batches of that size, in stream order, and the cache ramps learn from each
    batch's final labels (online updates; the model's ramps change as it goes, so load the bundle afresh for each
    such call)."""
    manifest = read_manifest(bundle_dir)
    key = json.dumps({"files": answering_files(manifest), "error_score": manifest["error_score"]}
                     | ({"learn_batch": learn_batch} if learn_batch else {}), sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    path = home() / "sim" / f"{digest}-{stream.name}-{stream.length}-{stream.seed}-{start}-{stop}.npz"
    if path.is_file():
        with np.load(path) as data:
            return RampOutputs(tuple(str(s) for s in data["sites"]), data["labels"], data["errors"], data["final"])
    outputs = _compute(model, stream, start, stop, learn_batch)
    packed = io.BytesIO()
    np.savez(packed, sites=np.array(outputs.sites), labels=outputs.labels, errors=outputs.errors, final=outputs.final)
    write_atomically(path, packed.getvalue())  # another process may be writing the same outputs
    return outputs
