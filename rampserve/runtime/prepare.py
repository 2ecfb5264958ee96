"""Preparing a model: find its sites, train a ramp at each on bootstrap data, and profile it."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from rampserve.bundle_format.latency import LatencyProfile
from rampserve.bundle_format.manifest import BundleError
from rampserve.bundle_format.signature import ModelSignature
from rampserve.bundle_format.text import TextEncoder
from rampserve.graph.sites import SitePolicy
from rampserve.ramps.cache import static_threshold
from rampserve.ramps.oracle import NO_EXIT, earliest_correct_exit, exit_latency
from rampserve.ramps.specs import DENSE_KINDS, MLP_HIDDEN, CacheSpec, spec_for
from rampserve.ramps.train import (
    Features,
    TrainConfig,
    TrainReport,
    build_cache_ramps,
    collect_features,
    split_indices,
    train_ramps,
)
from rampserve.runtime.backends import Backend
from rampserve.runtime.engines import AUTO, ENGINE_BUDGET_S, EngineChoice, check_engine, serving_backend
from rampserve.runtime.prepared import PreparedModel, SiteInfo
from rampserve.runtime.profile import DEFAULT_BATCH_SIZES, PROFILE_BUDGET_S, measure_profile
from rampserve.runtime.sources import ModelSource, load_trained, zoo_entry
from rampserve.runtime.torch_backend import TorchBackend, site_activations
from rampserve.runtime.user_data import (
    TENSORS,
    DataError,
    DataOptions,
    ExpectedInput,
    ModelInputs,
    Preprocessing,
    UserData,
    example_inputs,
    onnx_inputs,
    read_user_data,
    rows_encoder,
)
from rampserve.workloads.streams import get_stream

Encoder = Callable[[object], dict[str, np.ndarray]]
EXAMPLE_ROWS = 2  # rows of the example a serving path is compiled with: a batch, as served
# The fewest of the user's own inputs that the held-back tail (`TrainConfig.val_fraction`, the last tenth) may hold:
# it stops each ramp's training at its best validation loss and sets the static thresholds, and with fewer than 50
# inputs one input moves the agreement it sees by more than 2 points. So prepare wants 500 distinct inputs at least.
# Not more: rt-drift's whole bootstrap part (its first 12,000 rows, what a server would record of that traffic) holds
# 853 distinct texts, and the minilm-rt ramps learnt from those alone are measured in docs/own-data.md.
MIN_VALIDATION_INPUTS = 50


@dataclass(frozen=True)
class PrepareConfig:
    workload: str | None = None  # stream whose bootstrap part trains the ramps; default from the zoo entry
    # The user's own inputs (`runtime.user_data`) instead of a workload: the file's first `bootstrap_items` rows
    # train the ramps (each distinct input once, in the file's order), and the last `train.val_fraction` of those
    # inputs validates them
    data: Path | None = None
    data_options: DataOptions = field(default_factory=DataOptions)
    # "linear", "mlp", "deep", "cache", or "mixed" (per site, a linear or a cache ramp); None: the zoo entry's
    # (`ZooEntry.ramp_kind`), else linear
    ramp_kind: str | None = None
    ramp_hidden: int = MLP_HIDDEN  # width of an MLP ramp's hidden layer
    cache: CacheSpec = field(default_factory=CacheSpec)  # what cache ramps store
    bootstrap_items: int = 8000  # at most this many bootstrap inputs (distinct ones, for text)
    # At most this many of a zoo model's own in-domain inputs (`ZooEntry.ramp_items`: inputs no stream shows) that
    # the ramps learn on after the bootstrap; 0 trains them on the bootstrap alone. On resnet18-fmnist 16,000 let
    # the ramps at 6 of 8 sites answer a little more of the stream at 0.99 agreement than 8,000 (0.94 of it against
    # 0.92 after layer 4.0), at the cost of 8,000 more forward passes; the text models have 7,686 in all
    in_domain_items: int = 16000
    batch_size: int = 64
    error_score: str = "max_prob"
    profile_batch_sizes: tuple[int, ...] = DEFAULT_BATCH_SIZES
    # Paired rounds per batch size, at least; small batches get as many more as `profile_budget_s` allows. A
    # round runs the model 10 times, so on a large model at batch 64 the floor is what takes the time
    profile_repeats: int = 3
    profile_budget_s: float = PROFILE_BUDGET_S  # time per batch size the profile may take for more rounds
    train: TrainConfig = field(default_factory=TrainConfig)
    # The engine the model is prepared and served on: "auto" times every engine it runs on here and takes the
    # fastest at batch 1 (see `runtime.engines`), or one of `ENGINES` by name
    engine: str = AUTO
    engine_budget_s: float = ENGINE_BUDGET_S  # time per batch size that timing the engines may take
    progress: bool = True


def encoder_for(task: str) -> Encoder:
    if task == "image":
        from rampserve.workloads.fashion_mnist import to_model_input

        return lambda pixels: {"image": to_model_input(pixels)}
    if task == "text":
        from rampserve.zoo.minilm import text_encoder

        return text_encoder()
    raise ValueError(f"no input encoder for task {task!r} (known: image, text)")


def model_encoder(source: ModelSource | None, task: str, files_dir: Path | None = None) -> Encoder:
    """How a workload's items of `task` become the inputs of the model from `source`: an hf checkpoint's texts go
    through its own tokenizer (the one in `files_dir`, a bundle carrying it, else the checkpoint's directory), a
    zoo model's through its entry's encoder (a text model's tokenizer, the image size it takes), anything else
    through the task's encoder."""
    if task == TENSORS:  # the user's own tensors: the model's inputs already
        return rows_encoder
    if source is not None and source.kind == "hf":
        if task != "text":
            raise ValueError(f"{source.ref} is a text classifier: give it a text workload (e.g. rt-drift), "
                             f"not a {task} one")
        from rampserve.zoo.hf_encoders import text_encoder

        return text_encoder(files_dir or Path(source.ref))
    entry = zoo_entry(source)
    if entry is not None:
        if entry.task != task:
            raise ValueError(f"{source.ref} takes {entry.task} inputs: give it a {entry.task} workload, not a "
                             f"{task} one")
        return entry.encode if entry.text_encoder is None else entry.text_encoder()
    return encoder_for(task)


def _source_and_files(model: PreparedModel) -> tuple[ModelSource | None, Path | None]:
    source = ModelSource.from_json(model.meta["source"]) if "source" in model.meta else None
    return source, model.bundle_dir


def prepared_encoder(model: PreparedModel, task: str) -> Encoder:
    """`model_encoder` for a prepared model, with the files its bundle carries when it was loaded from one."""
    source, files_dir = _source_and_files(model)
    return model_encoder(source, task, files_dir)


def default_workload(source: ModelSource) -> str:
    if source.kind == "hf":
        return "rt-drift"  # a sequence classifier of text; the Rotten Tomatoes stream is the text workload here
    entry = zoo_entry(source)
    if entry is not None:
        return "rt-drift" if entry.task == "text" else "fmnist-drift"
    raise ValueError(f"a {source.kind} model needs a workload to train its ramps on (e.g. fmnist-drift)")


def ramp_kind(source: ModelSource, config: PrepareConfig) -> str:
    """The kind of ramps `prepare` trains for the model from `source`: the config's, else its zoo entry's, else
    linear (Apparate's)."""
    if config.ramp_kind is not None:
        return config.ramp_kind
    entry = zoo_entry(source)
    return "linear" if entry is None else entry.ramp_kind


def mixed_dense_kind(source: ModelSource) -> str:
    """The ramps a "mixed" preparation sets beside caches: the zoo entry's kind where it is linear or MLP (an MLP
    on lite0-fmnist, whose linear ramps answer less), else linear."""
    entry = zoo_entry(source)
    return entry.ramp_kind if entry is not None and entry.ramp_kind in DENSE_KINDS else "linear"


def token_reduction(source: ModelSource) -> str:
    """How linear ramps reduce a (tokens, hidden) site of the model: its zoo entry's choice, else the first token
    (a model whose layers do not zero padded positions would see the padding in a mean over tokens)."""
    entry = zoo_entry(source)
    return "first_token" if entry is None else entry.token_reduce


def zoo_revision(source: ModelSource) -> int:
    """The zoo entry's revision of what it serves (`ZooEntry.revision`); 0 for a model from outside the zoo."""
    entry = zoo_entry(source)
    return 0 if entry is None else entry.revision


def in_domain_inputs(source: ModelSource, bootstrap: list | np.ndarray, limit: int
                     ) -> tuple[list | np.ndarray, str | None]:
    """The zoo entry's own in-domain inputs (`ZooEntry.ramp_items`) that the ramps learn on besides the bootstrap:
    its first `limit`, less texts the bootstrap holds too (an entry's images come from a split no stream draws
    on), and where they come from (None when the model has none)."""
    entry = zoo_entry(source)
    extra = None if entry is None or limit <= 0 else entry.ramp_items
    if extra is None:
        return bootstrap[:0], None
    items = extra.load(limit)
    if isinstance(bootstrap, list):
        seen = set(bootstrap)
        items = [text for text in dict.fromkeys(items) if text not in seen]
    return items, extra.source


def torch_backend_of(source: ModelSource, policy: SitePolicy | None) -> TorchBackend | None:
    """The model from `source` as a torch module split at its sites; None for an ONNX file."""
    return None if source.kind == "onnx" else TorchBackend(load_trained(source), policy)


def make_backend(source: ModelSource, policy: SitePolicy | None, config: PrepareConfig,
                 bootstrap: BootstrapInputs, torch_backend: TorchBackend | None = None) -> tuple[Backend, EngineChoice]:
    """The model from `source` (its torch split `torch_backend` when already made) on the engine `config` names, or
    on the fastest here (see `serving_backend`)."""
    check_engine(config.engine, source.kind)
    torch_backend = torch_backend or torch_backend_of(source, policy)
    return serving_backend(torch_backend, Path(source.ref) if source.kind == "onnx" else None, policy,
                           config.engine, lambda backend: sample_feeds(backend, bootstrap),
                           budget_s=config.engine_budget_s, progress=config.progress)


def feeds_for(backend: Backend, encoder: Encoder, items: object) -> dict[str, np.ndarray]:
    """Encoded inputs named after the model's own inputs (matched by position)."""
    arrays = list(encoder(items).values())
    if len(arrays) != len(backend.input_names):
        raise ValueError(f"the workload gives {len(arrays)} inputs but the model takes {backend.input_names}")
    return dict(zip(backend.input_names, arrays))


@dataclass(frozen=True)
class BootstrapInputs:
    task: str
    encoder: Encoder
    items: list | np.ndarray


def bootstrap_inputs(workload: str, limit: int, source: ModelSource | None = None,
                     files_dir: Path | None = None) -> BootstrapInputs:
    """The first `limit` bootstrap items of a workload stream, with the encoder its task needs (for the model from
    `source`, see `model_encoder`)."""
    stream = get_stream(workload)
    start = stream.bootstrap.start
    stop = min(stream.bootstrap.stop, start + limit)
    items = stream.items(start, stop)
    if isinstance(items, list):  # repeated texts add nothing but weight: keep each once
        items = list(dict.fromkeys(items))
    return BootstrapInputs(stream.task, model_encoder(source, stream.task, files_dir), items)


@dataclass(frozen=True)
class RampData:
    """What the ramps learn the model's answers on: the workload's bootstrap, then the model's in-domain inputs; or
    the user's own inputs (`user_data`), with nothing after them."""

    workload: str | None  # None: the user's own inputs
    bootstrap: BootstrapInputs
    in_domain: list | np.ndarray
    in_domain_source: str | None
    data: dict | None = None  # the user's file and the part of it the ramps learn on (`own_data_record`)

    @property
    def items(self) -> list | np.ndarray:
        if not len(self.in_domain):
            return self.bootstrap.items
        if isinstance(self.bootstrap.items, list):
            return [*self.bootstrap.items, *self.in_domain]
        return np.concatenate([self.bootstrap.items, self.in_domain])

    def record(self) -> dict:
        """What a bundle's meta keeps of it (`meta["ramp_data"]`): counts and sources, which the zoo's bundle cache
        compares."""
        return {"bootstrap": {"workload": self.workload, "items": len(self.bootstrap.items),
                              **({"data": self.data} if self.data else {})},
                "in_domain": {"source": self.in_domain_source, "items": len(self.in_domain)}}


def ramp_data(source: ModelSource, config: PrepareConfig, torch_backend: TorchBackend | None = None) -> RampData:
    """What `prepare` trains the ramps of the model from `source` (split as `torch_backend`, where made already) on
    under `config`: the user's own inputs where it names them, else a workload stream's bootstrap."""
    if config.data is not None:
        if config.workload is not None:
            raise ValueError("give the ramps' inputs once: your own (--data) or a workload stream (--workload)")
        return own_ramp_data(source, config, torch_backend or torch_backend_of(source, None))
    workload = config.workload or default_workload(source)
    bootstrap = bootstrap_inputs(workload, config.bootstrap_items, source)
    return RampData(workload, bootstrap, *in_domain_inputs(source, bootstrap.items, config.in_domain_items))


def text_encoder_of(inputs: BootstrapInputs) -> TextEncoder | None:
    """The tokenizer that encodes the inputs' texts, which the model's bundle keeps (None: not a text model's)."""
    return inputs.encoder if isinstance(inputs.encoder, TextEncoder) else None


# --- the user's own inputs --------------------------------------------------------------------------------------

EXAMPLE_TEXTS = ["a", "a few more words"]  # what a text model's inputs are learnt from: its tokenizer's output


def model_task(source: ModelSource) -> str | None:
    """The task of the model from `source`: text for hf:DIR (it has a tokenizer), a zoo entry's own, else None (a
    model from outside the zoo takes whatever its file or module says)."""
    entry = zoo_entry(source)
    return "text" if source.kind == "hf" else None if entry is None else entry.task


def model_inputs(source: ModelSource, torch_backend: TorchBackend | None) -> ModelInputs:
    """What the model from `source` takes, for reading a user's data against it: an ONNX file's declared inputs; a
    text model's, as its tokenizer makes them (any length), with the tokenizer; a zoo image model's, as its
    encoder makes its workload's; a torch module's names alone (a module declares no datatypes or shapes)."""
    if torch_backend is None:
        path = Path(source.ref)
        return ModelInputs(onnx_inputs(path), model_dir=path.parent)
    task = model_task(source)
    model_dir = Path(source.ref) if source.kind == "hf" else None
    if task == "text":
        encoder = model_encoder(source, "text")

        def tokenizer(texts: list[str]) -> dict[str, np.ndarray]:
            return feeds_for(torch_backend, encoder, texts)

        return ModelInputs(example_inputs(tokenizer(EXAMPLE_TEXTS), variable=True), tokenizer, model_dir)
    if task is not None:
        example = sample_feeds(torch_backend, bootstrap_inputs(default_workload(source), EXAMPLE_ROWS, source))
        return ModelInputs(example_inputs(example(EXAMPLE_ROWS), variable=False))
    return ModelInputs(tuple(ExpectedInput(name, None, None) for name in torch_backend.input_names))


def min_own_inputs(config: PrepareConfig) -> int:
    """The fewest distinct inputs of the user's own that prepare trains ramps on (MIN_VALIDATION_INPUTS)."""
    return math.ceil(MIN_VALIDATION_INPUTS / config.train.val_fraction)


def own_bootstrap(data: UserData, rows: int, config: PrepareConfig) -> np.ndarray:
    """The positions in the file of the inputs ramps learn from: each distinct input of its first `rows` rows once,
    in the file's order; refused when they are fewer than `min_own_inputs`."""
    rows = min(rows, len(data))
    distinct = data.distinct_positions()
    positions = distinct[distinct < rows]
    needed = min_own_inputs(config)
    if len(positions) < needed:
        span = f"its {rows} rows" if rows == len(data) else f"its first {rows} rows (--bootstrap)"
        raise DataError(f"{data.path}: ramps need at least {needed} distinct inputs to learn from, and {span} hold "
                        f"{len(positions)}: the last {config.train.val_fraction:.0%} of them are held back to validate "
                        f"the ramps, and with fewer than {MIN_VALIDATION_INPUTS} one input would move what validation "
                        f"sees by more than {100 / MIN_VALIDATION_INPUTS:g} points")
    return positions


def own_data_record(data: UserData, positions: np.ndarray, rows: int, config: PrepareConfig) -> dict:
    """What a bundle keeps of the user's data: the file, and the rows the ramps learnt from (a bench replays those
    after them)."""
    validation = max(1, int(round(len(positions) * config.train.val_fraction)))
    return data.record() | {"bootstrap_rows": min(rows, len(data)), "bootstrap_inputs": len(positions),
                            "validation_inputs": validation}


def read_own_data(source: ModelSource, config: PrepareConfig, torch_backend: TorchBackend | None) -> UserData:
    """The user's data file named by `config`, read against the model from `source`. A torch module declares no
    input datatypes or shapes, so it is run on the data's first rows here: a refusal names the data."""
    inputs = model_inputs(source, torch_backend)
    data = read_user_data(config.data, inputs, config.data_options)
    if torch_backend is not None and any(i.datatype is None for i in inputs.inputs):
        rows = data.take(np.arange(min(EXAMPLE_ROWS, len(data))))
        try:
            with torch.inference_mode():
                torch_backend.split.full(torch_backend.native_feeds(rows_encoder(rows)))
        except Exception as exc:  # whatever the module raises on inputs it cannot take
            given = ", ".join(f"'{n}' {a.dtype} {list(a.shape)}" for n, a in rows_encoder(rows).items())
            raise DataError(f"{config.data}: the model refused the file's first rows ({given}): {exc}") from exc
    return data


def own_ramp_data(source: ModelSource, config: PrepareConfig, torch_backend: TorchBackend | None) -> RampData:
    data = read_own_data(source, config, torch_backend)
    positions = own_bootstrap(data, config.bootstrap_items, config)
    task = model_task(source) or ("image" if data.format == "images" else TENSORS)
    encoder = model_encoder(source, "text") if data.kind == "text" else rows_encoder
    bootstrap = BootstrapInputs(task, encoder, data.take(positions))
    return RampData(None, bootstrap, bootstrap.items[:0], None,
                    own_data_record(data, positions, config.bootstrap_items, config))


def sample_feeds(backend: Backend, inputs: BootstrapInputs) -> Callable[[int], dict[str, np.ndarray]]:
    """Real inputs of any batch size for profiling, cycling through the bootstrap items."""
    items = inputs.items

    def feeds(batch_size: int) -> dict[str, np.ndarray]:
        chosen = list(itertools.islice(itertools.cycle(range(len(items))), batch_size))
        return feeds_for(backend, inputs.encoder, [items[i] for i in chosen] if isinstance(items, list)
                         else items[chosen])

    return feeds


def signature_from_workload(model: PreparedModel) -> ModelSignature:
    """The signature of a model from a bundle prepared before bundles carried one, derived as prepare derives it,
    from its workload's first bootstrap inputs."""
    workload = model.meta.get("workload")
    if workload is None:
        raise ValueError("the model has no signature, nor a workload to derive one from: give the PreparedModel "
                         "one (ModelSignature.of_example on two of its inputs)")
    try:
        bootstrap = bootstrap_inputs(workload, EXAMPLE_ROWS, *_source_and_files(model))
    except FileNotFoundError as exc:
        raise BundleError(f"{model.bundle_dir or 'the model'} was prepared before bundles carried their signature and example "
                          f"inputs, and its workload {workload!r} is not on this machine to derive them from "
                          f"({exc}): prepare the model again with this rampserve") from exc
    example = sample_feeds(model.backend, bootstrap)(EXAMPLE_ROWS)
    return ModelSignature.of_example(example, int(model.meta["num_classes"]), bootstrap.task,
                                     text_encoder_of(bootstrap))


def prepared_inputs(model: PreparedModel) -> ModelInputs:
    """What a prepared model takes, as its signature says, with its tokenizer where it has one (a text model's
    bundle carries it), for reading data against it."""
    if model.signature is None:
        raise ValueError("the model has no signature to read data against: prepare it again with this rampserve")
    inputs = tuple(ExpectedInput(t.name, t.datatype, t.shape) for t in model.signature.inputs)
    if model.meta.get("task") != "text":
        return ModelInputs(inputs)
    encoder = prepared_encoder(model, "text")
    return ModelInputs(inputs, lambda texts: feeds_for(model.backend, encoder, texts))


def reread_own_data(model: PreparedModel, path: Path | None = None) -> UserData:
    """The data file a model was prepared on (at `path`, or where it was then), read as it was then (an image
    folder with the same preprocessing); refused if it changed since."""
    record = model.meta["data"]
    path = Path(path or record["path"])
    options = DataOptions(preprocessing=Preprocessing.from_json(record["preprocessing"])) \
        if record.get("preprocessing") else DataOptions()
    data = read_user_data(path, prepared_inputs(model), options)
    if data.sha256 != record["sha256"]:
        raise DataError(f"{path} is not the data the model was prepared on ({record['path']}, sha256 "
                        f"{record['sha256'][:12]}…): it has changed since")
    return data


def reprofile(model: PreparedModel, config: PrepareConfig = PrepareConfig()) -> LatencyProfile:
    """Measure a prepared model's latency profile again, on this machine, with its workload's inputs (or the
    user's own it was prepared on)."""
    if model.meta.get("data"):
        data = reread_own_data(model)
        items = data.take(own_bootstrap(data, model.meta["data"]["bootstrap_rows"], config))
        inputs = BootstrapInputs(model.meta["task"], prepared_encoder(model, data.kind), items)
    else:
        inputs = bootstrap_inputs(model.meta["workload"], config.bootstrap_items, *_source_and_files(model))
    return measure_profile(model, sample_feeds(model.backend, inputs), config.profile_batch_sizes,
                           config.profile_repeats, progress=config.progress, budget_s=config.profile_budget_s)


def _batches(items, size: int) -> Iterator:
    for start in range(0, len(items), size):
        yield items[start:start + size]


def oracle_summary(ramp_labels: np.ndarray, final: np.ndarray, sites: list[str],
                   profile: LatencyProfile) -> dict:
    """Exit distribution and latency savings at batch size 1 if every input left at its earliest correct ramp."""
    exits = earliest_correct_exit(ramp_labels, final)
    full = profile.full(1)
    latency = exit_latency(exits, profile.reach(1), full)
    counts = {site: int((exits == i).sum()) for i, site in enumerate(sites)}
    counts["none"] = int((exits == NO_EXIT).sum())
    return {
        "inputs": int(len(final)),
        "exit_counts": counts,
        "mean_savings": float(1.0 - latency.mean() / full),
        "median_savings": float(1.0 - np.median(latency) / full),
    }


# Agreement with the original model that `exit_share_at` asks of the exits a ramp takes.
MIXED_AGREEMENT = 0.99


def exit_share_at(errors: np.ndarray, correct: np.ndarray, agreement: float = MIXED_AGREEMENT) -> float:
    """The largest share of inputs a ramp can answer, most confident first, with at least `agreement` of its
    answers equal to the original model's."""
    order = np.argsort(errors, kind="stable")
    hits = np.cumsum(correct[order]) / np.arange(1, len(order) + 1)
    ok = np.flatnonzero(hits >= agreement)
    return float((ok[-1] + 1) / len(order)) if len(ok) else 0.0


def train_site_ramps(kind: str, features: Features, specs_of: Callable[[str], dict], config: PrepareConfig,
                     dense: str = "linear") -> tuple[dict, TrainReport, dict[str, np.ndarray]]:
    """Ramps of `kind` at every site, the training report, and each ramp's (labels, errors) on validation
    inputs. "mixed" builds both a `dense` ramp (linear or MLP) and a cache ramp at every site and keeps, per site,
    the one that answers more validation inputs at MIXED_AGREEMENT: the controller then chooses among sites by
    utility."""
    if kind == "mixed":
        linear = train_site_ramps(dense, features, specs_of, config)
        cache = train_site_ramps("cache", features, specs_of, config)
        targets = features.targets.numpy()
        val = np.array(linear[1].val_indices)
        ramps, results, outputs = {}, {}, {}
        for site in linear[0]:
            shares = [exit_share_at(c[2][site][1], c[2][site][0] == targets[val]) for c in (linear, cache)]
            chosen = cache if shares[1] > shares[0] else linear
            ramps[site], results[site], outputs[site] = chosen[0][site], chosen[1].ramps[site], chosen[2][site]
        report = linear[1]
        report.ramps, report.train_seconds = results, linear[1].train_seconds + cache[1].train_seconds
        return ramps, report, outputs
    specs = specs_of(kind)
    build = build_cache_ramps if kind == "cache" else train_ramps
    ramps, report = build(features, specs, config.train, progress=config.progress)
    val = np.array(report.val_indices)
    outputs = {site: ramp.from_features(features.by_site[site].numpy()[val]) for site, ramp in ramps.items()}
    return ramps, report, outputs


def validation_outputs(model: PreparedModel, source: ModelSource, config: PrepareConfig) -> dict[str, np.ndarray]:
    """`PreparedModel.validation` made again for a model prepared from `source` with `config` before bundles kept it:
    the same split of the same ramp data, its validation part run through the model with every site's ramp
    evaluated (the eager path, the reference the served ramps are tested against)."""
    data = ramp_data(source, config)
    recorded = model.meta.get("training", {}).get("config", {})  # the split as it was made
    train = replace(config.train, **{k: recorded[k] for k in ("seed", "val_fraction", "validation") if k in recorded})
    if data.data is not None:
        train = replace(train, validation="tail")
    items = data.items
    _, val = split_indices(len(items), train)
    chosen = [items[i] for i in val] if isinstance(items, list) else items[val]
    batches = [model.ramp_answers(feeds_for(model.backend, data.bootstrap.encoder, chunk))
               for chunk in _batches(chosen, config.batch_size)]
    labels, errors, final = (np.concatenate(part) for part in zip(*batches))
    return {"labels": labels, "errors": errors, "final": final}


def prepare(source: ModelSource, config: PrepareConfig = PrepareConfig(),
            policy: SitePolicy | None = None) -> PreparedModel:
    torch_backend = torch_backend_of(source, policy)
    data = ramp_data(source, config, torch_backend)
    if data.data is not None:  # the user's inputs in their order: ramps are validated on the latest of them
        config = replace(config, train=replace(config.train, validation="tail"))
    bootstrap = data.bootstrap
    backend, engine = make_backend(source, policy, config, bootstrap, torch_backend)
    if not backend.sites:
        raise ValueError(f"{source.ref} has no sites where a ramp could go")
    encoder, items = bootstrap.encoder, data.items
    sample = sample_feeds(backend, bootstrap)(EXAMPLE_ROWS)

    token_reduce, kind = token_reduction(source), ramp_kind(source, config)
    site_names = [s.value for s in backend.sites]
    probe_acts, probe_logits = next(site_activations(backend, [sample], site_names))
    num_classes = int(probe_logits.shape[1])

    def specs_of(kind: str) -> dict:
        return {name: spec_for(kind, tuple(act.shape[1:]), num_classes, token_reduce, cache=config.cache,
                               hidden=config.ramp_hidden) for name, act in probe_acts.items()}

    # Every kind reduces a site's activation the same way except the deep CNN head, which keeps a grid.
    features = collect_features(
        tqdm(site_activations(
            backend, (feeds_for(backend, encoder, chunk) for chunk in _batches(items, config.batch_size)), site_names),
            total=-(-len(items) // config.batch_size), desc="running the model for ramp features", unit="batch",
            disable=not config.progress),
        specs_of("deep" if kind == "deep" else "linear"),
    )
    ramps, report, val_outputs = train_site_ramps(kind, features, specs_of, config, mixed_dense_kind(source))
    sites = [
        SiteInfo(s.value, s.index, s.kind, s.scope, tuple(probe_acts[s.value].shape[1:]), ramps[s.value].spec,
                 report.ramps[s.value].val_accuracy)
        for s in backend.sites
    ]
    model = PreparedModel(backend=backend, sites=sites, ramps=ramps, error_score=config.error_score,
                          signature=ModelSignature.of_example(sample, num_classes, bootstrap.task,
                                                              text_encoder_of(bootstrap)))

    model.profile = measure_profile(model, sample_feeds(backend, bootstrap), config.profile_batch_sizes,
                                    config.profile_repeats, progress=config.progress,
                                    budget_s=config.profile_budget_s)
    val_targets = features.targets.numpy()[report.val_indices]
    ramp_labels = np.stack([val_outputs[s][0] for s in model.site_names], axis=1)
    model.validation = {"labels": ramp_labels, "final": val_targets,
                        "errors": np.stack([val_outputs[s][1] for s in model.site_names], axis=1)}
    model.meta = {
        "source": source.to_json(),
        "zoo_revision": zoo_revision(source),
        "workload": data.workload,
        **({"data": data.data} if data.data else {}),
        "task": bootstrap.task,
        "num_classes": num_classes,
        "ramp_kind": kind,
        "ramp_data": data.record(),
        "engine": engine.to_json(),
        "training": {**report.to_json(), "config": asdict(config.train)},
        "oracle_val": oracle_summary(ramp_labels, val_targets, model.site_names, model.profile),
        # Freeze Inference's thresholds: per ramp, exit only below the lowest error score it got wrong on
        # validation data. A baseline; serving starts from the controller's thresholds.
        "static_thresholds": {s: static_threshold(val_outputs[s][1], val_outputs[s][0] == val_targets)
                              for s in model.site_names},
    }
    return model
