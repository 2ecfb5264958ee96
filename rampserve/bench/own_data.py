"""`bench sim --data PATH` and `bench live --data PATH`: the user's own inputs as the stream, in the file's order, so
that a user sees what exits would save on their own traffic before serving with them.

The file's first B rows train the ramps exactly as `rampserve prepare MODEL --data PATH --bootstrap B` trains them
(each distinct input once, the last tenth of them validating; `runtime.prepare.own_bootstrap`), and the replay is
every row after them: requests the ramps never learnt from, unless the traffic repeats an input (the report says how
many do). B is `--bootstrap` (8,000 by default, as for the benchmark streams, whose first 8,000 rows train the zoo's
ramps) but at most half the file's rows, so that a small file still leaves half to replay. Accuracy is agreement
with the model's own answer, as everywhere. The bundle is prepared once per model, file, bootstrap and preparing
settings, and kept in the artifact cache.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

from rampserve.bundle_format.manifest import BundleError, read_manifest
from rampserve.paths import bundles_dir, exclusive
from rampserve.runtime.bundle import load_bundle, save_bundle
from rampserve.runtime.prepare import (
    PrepareConfig,
    own_bootstrap,
    prepare,
    read_own_data,
    reread_own_data,
    torch_backend_of,
)
from rampserve.runtime.sources import ModelSource
from rampserve.runtime.user_data import DataError, DataOptions, UserData
from rampserve.workloads.streams import Stream, stream_of

BOOTSTRAP_SHARE = 0.5  # of the file's rows, at most, that a bench trains ramps on: the rest is replayed


@dataclass(frozen=True)
class OwnStream:
    bundle: Path  # the model prepared on the stream's bootstrap
    stream: Stream  # the file in its order; its evaluation part is the replay
    record: dict  # what the report says of the data: the file, its split, repeats in the replay

    @property
    def name(self) -> str:
        return self.record["name"]


def workload_label(data: Path) -> str:
    """What a report names a run on the user's file as its workload."""
    return f"data:{Path(data).name}"


@dataclass(frozen=True)
class OwnDataSettings:
    """What `bench sim` and `bench live` settings hold for the user's own inputs as the stream (`--data`) instead of
    their `workload`: the file, how it is read, and how the model is prepared on it (`own_stream`)."""

    data: Path | None = None
    data_options: DataOptions = field(default_factory=DataOptions)
    prepare: PrepareConfig = field(default_factory=PrepareConfig)

    @property
    def workload_label(self) -> str:
        """The report's name of the stream: the workload's, or the file's (`workload_label`)."""
        return self.workload if self.data is None else workload_label(self.data)  # each bench names a workload

    def own_stream(self, model: str, small: bool = False) -> OwnStream:
        return own_stream(model, self.data, self.data_options, self.prepare, small)


def bench_bootstrap(rows: int, limit: int) -> int:
    """How many of a file's first rows a bench trains ramps on: `limit`, at most BOOTSTRAP_SHARE of them."""
    return min(limit, int(rows * BOOTSTRAP_SHARE))


def own_stream(model: str, data: Path, options: DataOptions = DataOptions(), config: PrepareConfig = PrepareConfig(),
               small: bool = False) -> OwnStream:
    """The model `model` (any source) prepared on the first rows of `data` (`bench_bootstrap` of them), and the
    file as a stream whose evaluation part is every row after them."""
    source = ModelSource.parse(model, small=small)
    config = replace(config, data=Path(data), data_options=options, workload=None)
    read = read_own_data(source, config, torch_backend_of(source, None))
    config = replace(config, bootstrap_items=bench_bootstrap(len(read), config.bootstrap_items))
    try:
        own_bootstrap(read, config.bootstrap_items, config)
    except DataError as exc:
        raise DataError(f"{exc} (a bench learns from at most the first {BOOTSTRAP_SHARE:.0%} of the file's rows and "
                        "replays the rest)") from exc
    key = json.dumps({"source": source.to_json(), "data": read.sha256,
                      "config": asdict(replace(config, data=None))}, sort_keys=True, default=str)
    bundle = bundles_dir() / f"own-{hashlib.sha256(key.encode()).hexdigest()[:16]}"
    with exclusive(bundles_dir(), bundle.name):  # another process may be preparing it
        try:
            read_manifest(bundle)
        except BundleError:
            save_bundle(prepare(source, config), bundle)
    model_data = load_bundle(bundle).meta["data"]
    return OwnStream(bundle, data_stream(read, model_data["bootstrap_rows"]), replay_record(read, model_data))


def own_stream_of_bundle(bundle: Path, data: Path) -> OwnStream:
    """A bundle prepared with `--data` on `data`, and the file as a stream whose evaluation part is every row after
    the inputs it learnt from."""
    model = load_bundle(bundle)
    if not model.meta.get("data"):
        raise ValueError(f"{bundle} was prepared on a workload stream, not on a file of your inputs: prepare it with "
                         "--data, or give the model itself")
    read = reread_own_data(model, data)
    return OwnStream(Path(bundle), data_stream(read, model.meta["data"]["bootstrap_rows"]),
                     replay_record(read, model.meta["data"]))


def data_stream(data: UserData, bootstrap_rows: int) -> Stream:
    """The file's inputs in its order; the first `bootstrap_rows` are the bootstrap. Texts are told apart by their
    first occurrence, so the simulator runs each distinct one once, as for the benchmark streams."""
    if bootstrap_rows >= len(data):
        raise DataError(f"{data.path}: the ramps learnt from all {len(data)} of its rows; a bench replays the rows "
                        "after those: prepare on fewer (--bootstrap)")
    name = f"own-{data.sha256[:16]}"
    if data.kind == "text":
        texts = data.items
        return stream_of(name, data.kind, lambda _positions, ids: [texts[i] for i in ids], data.first_occurrences(),
                         bootstrap_rows)
    rows = data.items
    return stream_of(name, data.kind, lambda positions, _ids: rows[positions], np.arange(len(data)), bootstrap_rows)


def replay_record(data: UserData, prepared: dict) -> dict:
    """The report's account of the data: the file, the rows the ramps learnt from, the rows replayed, and how many
    of those repeat an input the ramps learnt from (real traffic repeats itself; their answers are no surprise)."""
    split = prepared["bootstrap_rows"]
    first = data.first_occurrences()
    seen = first[split:] < split
    return {"name": workload_label(data.path), **data.record(), "bootstrap_rows": split,
            "bootstrap_inputs": prepared["bootstrap_inputs"], "validation_inputs": prepared["validation_inputs"],
            "replayed_rows": len(data) - split, "replayed_seen_in_bootstrap": int(seen.sum())}
