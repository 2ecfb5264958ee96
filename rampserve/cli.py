"""The `rampserve` command."""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable, Iterable
from dataclasses import replace
from inspect import Parameter, signature
from pathlib import Path
from types import NoneType
from typing import Annotated, Optional, get_args

import typer
from rich.console import Console
from rich.table import Table

from rampserve.bench.load import DEFAULT_LOAD
from rampserve.control.relearning import RelearnRule
from rampserve.serving.shared.settings import DEFAULT_RECORD, ENV_PREFIX, ModelOptions, ServeOptions

app = typer.Typer(help="rampserve: serve models with managed early exits.", no_args_is_help=True)
bench_app = typer.Typer(help="Benchmarks: print a table and write JSON.", no_args_is_help=True)
zoo_app = typer.Typer(help="The bundled model zoo.", no_args_is_help=True)
app.add_typer(bench_app, name="bench")
app.add_typer(zoo_app, name="zoo")
# Piped output (CI logs, `| tee`) gets a width that fits the tables instead of rich's default of 80.
console = Console(width=None if sys.stdout.isatty() else 132)

DEFAULT_MODEL = "resnet18-fmnist"
# The demo serves the zoo model where exits pay on a CPU and that a fresh machine prepares in minutes: on ONNX Runtime
# resnet18-fmnist takes 0.2 ms and no ramp fits the budget, lite0-fmnist's ramps on frozen ImageNet features do not
# move its median (docs/journal, issue 30)
DEMO_MODEL = "minilm-rt"
LOAD_HELP = ("the replay's rate as a share of vanilla's measured closed-loop saturation: what `bench sim` calls load "
             "(--rate overrides)")


def field_options(names: Iterable[str], env: bool = False) -> dict[str, object]:
    """An option per named field of ServeOptions: its flag, type, description and default (the command gets None where
    the flag is not given); with `env`, the help names the environment variable it is also read from."""
    options: dict[str, object] = {}
    for name in names:
        field = ServeOptions.model_fields[name]
        kind = next((arg for arg in get_args(field.annotation) if arg is not NoneType), field.annotation)
        shown = f" (env {ENV_PREFIX}{name.upper()})" if env else ""
        options[name] = Annotated[Optional[kind], typer.Option(
            help=f"{field.description}{shown}", show_default=False if field.default is None else str(field.default))]
    return options


# Controller settings that `serve`, `bench sim` and `bench live` take alike (`controller_options`); None (not
# given): the controller's own
CONTROLLER_OPTIONS = field_options(("objective", "guarantee", "promise_window", "windows_below", "risk_target_share",
                                    "confidence", "search_every", "history", "shadow_share", "prime"))
# Everything `serve` takes but its models and applications, the server's before the models': each read from
# RAMPSERVE_<NAME> unless its flag is given
SERVE_OPTIONS = field_options(sorted(ServeOptions.model_fields, key=lambda name: name in ModelOptions.model_fields),
                              env=True)


def with_options(declared: dict[str, object], into: str) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Give a command the `declared` options (name: annotation); it gets those given, by name, in its `into`
    argument."""

    def decorate(command: Callable[..., None]) -> Callable[..., None]:
        own_signature = signature(command, eval_str=True)
        own = [p for name, p in own_signature.parameters.items() if name != into]
        added = [Parameter(name, Parameter.KEYWORD_ONLY, default=None, annotation=annotation)
                 for name, annotation in declared.items()]

        @functools.wraps(command)
        def with_flags(**kwargs: object) -> None:
            given = {name: kwargs.pop(name) for name in declared}
            command(**kwargs, **{into: {name: value for name, value in given.items() if value is not None}})

        with_flags.__signature__ = own_signature.replace(parameters=own + added)  # what typer reads the options from
        with_flags.__annotations__ = {p.name: p.annotation for p in own + added}
        return with_flags

    return decorate


# Gives a command the CONTROLLER_OPTIONS; it gets those given, as ControllerSettings fields, in `controller_flags`
controller_options = with_options(CONTROLLER_OPTIONS, "controller_flags")


def _write_json(data: dict, path: Path | None, **dumps: object) -> None:
    from rampserve.bench.results import write_result

    write_result(data, path, **dumps)
    if path is not None:
        console.print(f"wrote {path}")


def new_result_path(path: Path | None) -> Path | None:
    """Refuse, before a benchmark runs, to write its result over a kept one."""
    if path is not None and path.exists():
        raise typer.BadParameter(f"{path} exists: a result is never written over; give this run's JSON a name of its "
                                 "own")
    return path


JsonOut = Annotated[Optional[Path], typer.Option(
    "--json", help="write the results here (a new file: a kept result is never written over)",
    callback=new_result_path)]


# How `--data` is read, for `prepare`, `bench sim` and `bench live` alike (`data_options`); each command gets those
# given in `data_flags`
DATA_OPTIONS: dict[str, object] = {
    "data_field": Annotated[Optional[str], typer.Option(help="--data texts: the JSONL field or CSV column (default: "
                                                             "text)")],
    "image_size": Annotated[Optional[str], typer.Option(help="--data images: HxW to resize to (default: the model's "
                                                             "preprocessor_config.json, else its input's shape)")],
    "image_mean": Annotated[Optional[str], typer.Option(help="--data images: per-channel mean of pixels in [0, 1], "
                                                             "e.g. 0.485,0.456,0.406 (default: 0)")],
    "image_std": Annotated[Optional[str], typer.Option(help="--data images: per-channel std (default: 1)")],
    "image_layout": Annotated[Optional[str], typer.Option(help="--data images: nchw or nhwc (default: as the input's "
                                                               "shape says, else nchw)")],
    "image_channels": Annotated[Optional[int], typer.Option(help="--data images: 1 (grey) or 3 (RGB) (default: as the "
                                                                 "input's shape says, else 3)")],
}
data_options_flags = with_options(DATA_OPTIONS, "data_flags")


@app.command()
@data_options_flags
def prepare(
    model: Annotated[str, typer.Argument(
        help="zoo name, a .onnx file, module:factory for a torch module, or hf:DIR for a Hugging Face sequence "
             "classifier saved by save_pretrained (BERT, RoBERTa, MPNet, DistilBERT)")],
    out: Annotated[Path, typer.Option(help="bundle directory to write")],
    data: Annotated[Optional[Path], typer.Option(
        help="your model's own inputs, unlabeled: .npy, .npz, .safetensors, texts (.txt, .jsonl, .csv), a JSONL log "
             "of v2 infer requests, or a folder of PNG/JPEG images (docs/own-data.md)")] = None,
    workload: Annotated[Optional[str], typer.Option(
        help="a benchmark stream whose bootstrap part trains the ramps (fmnist-drift, rt-drift) instead of --data")]
    = None,
    ramp_kind: Annotated[Optional[str], typer.Option(
        help="linear, mlp (a hidden layer), deep, cache (Freeze Inference), or mixed (per site, a cache or the zoo "
             "entry's linear or MLP ramp); default: the zoo model's own (mlp for lite0-fmnist), else linear")] = None,
    ramp_hidden: Annotated[Optional[int], typer.Option(help="mlp ramps: width of the hidden layer (default 64)")] \
    = None,
    cache_reduction: Annotated[str, typer.Option(help="cache ramps: learned (default) or pca")] = "learned",
    cache_dim: Annotated[int, typer.Option(help="cache ramps: dimensions of the reduced space")] = 32,
    cache_lookup: Annotated[str, typer.Option(help="cache ramps: kmeans (default) or knn")] = "kmeans",
    cache_points: Annotated[int, typer.Option(help="cache ramps: centroids (kmeans) or stored inputs (knn)")] = 128,
    cache_neighbours: Annotated[int, typer.Option(help="cache ramps: neighbours looked up (knn)")] = 1,
    bootstrap: Annotated[int, typer.Option(help="bootstrap inputs to train ramps on, at most (--data: the file's "
                                                "first rows, each distinct input once)")] = 8000,
    in_domain: Annotated[int, typer.Option(
        help="a zoo model's own in-domain inputs (never streamed) to train ramps on besides, at most")] = 16000,
    profile_budget: Annotated[Optional[float], typer.Option(
        help="seconds the latency profile may spend per batch size on more rounds (default 5)")] = None,
    site_policy: Annotated[Optional[str], typer.Option(
        help="module:function choosing sites among the cut values, (dataflow, candidates) -> candidates")] = None,
    engine: Annotated[str, typer.Option(
        help="auto (time every engine the model runs on here, serve on the fastest at batch 1), onnxruntime, "
             "onnxruntime-1thread or torch")] = "auto",
    small: Annotated[bool, typer.Option(help="the zoo's tiny test variant")] = False,
    *,
    data_flags: dict[str, object],
) -> None:
    """Find the model's sites, train a ramp at each (on your own inputs, --data, or a benchmark stream), profile it,
    and write a bundle: whole, or not at all."""
    from rampserve.ramps.specs import CacheSpec
    from rampserve.runtime.bundle import save_bundle
    from rampserve.runtime.prepare import PrepareConfig
    from rampserve.runtime.prepare import prepare as run_prepare
    from rampserve.runtime.sources import ModelSource, import_object

    try:
        source = ModelSource.parse(model, small=small)
        if source.kind != "zoo" and (data is None) == (workload is None):
            raise ValueError(f"{model} is your own model: give the inputs its ramps learn from, either your own "
                             "(--data FILE) or a benchmark stream (--workload)")
        policy = import_object(site_policy) if site_policy else None
        cache = CacheSpec(reduction=cache_reduction, dim=cache_dim, lookup=cache_lookup, points=cache_points,
                          neighbours=cache_neighbours)
        given = {key: value for key, value in (("profile_budget_s", profile_budget), ("ramp_hidden", ramp_hidden))
                 if value is not None}
        options = data_options(**data_flags)
        prepared = run_prepare(source, PrepareConfig(workload=workload, data=data, data_options=options,
                                                     ramp_kind=ramp_kind, bootstrap_items=bootstrap,
                                                     in_domain_items=in_domain, cache=cache, engine=engine, **given),
                               policy)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    save_bundle(prepared, out)
    print_engines(prepared.meta["engine"])
    own = prepared.meta.get("data")
    console.print(f"prepared {model} on {prepared.meta['engine']['engine']}: {len(prepared.sites)} sites, "
                  f"bundle at {out}" + ("" if own is None else
                                        f"; ramps learnt from the {own['bootstrap_inputs']} distinct inputs of the "
                                        f"first {own['bootstrap_rows']} of {own['rows']} rows of {own['path']}, the "
                                        f"last {own['validation_inputs']} of them held back to validate"))


def data_options(data_field: str | None = None, image_size: str | None = None, image_mean: str | None = None,
                 image_std: str | None = None, image_layout: str | None = None, image_channels: int | None = None):
    """`--data`'s options as `DataOptions`."""
    from rampserve.runtime.user_data import DataOptions, ImageOptions

    def numbers(text: str | None, what: str) -> tuple[float, ...] | None:
        try:
            return None if text is None else tuple(float(v) for v in text.split(","))
        except ValueError:
            raise ValueError(f"{what} {text!r}: give numbers separated by commas, e.g. 0.5,0.5,0.5") from None

    size = numbers(image_size and image_size.lower().replace("x", ","), "--image-size")
    if size is not None and (len(size) not in (1, 2) or any(v < 1 or v != int(v) for v in size)):
        raise ValueError(f"--image-size {image_size!r}: give HxW (e.g. 224x224) or one size for both")
    return DataOptions(text_field=data_field, image=ImageOptions(
        size=None if size is None else (int(size[0]), int(size[-1])), mean=numbers(image_mean, "--image-mean"),
        std=numbers(image_std, "--image-std"), layout=image_layout and image_layout.lower(), channels=image_channels))


def inspect_bundle(bundle: Path) -> dict:
    from rampserve.bundle_format.manifest import read_manifest

    manifest = read_manifest(bundle)
    profile = manifest["profile"]
    sizes = profile["batch_sizes"] if profile else []

    def at(series: list[float], batch: int) -> float | None:
        return series[sizes.index(batch)] if batch in sizes else None

    sites = []
    for site in manifest["sites"]:
        name = site["name"]
        ramp = site["ramp"]
        sites.append({
            "name": name,
            "scope": site["scope"],
            "op_kind": site["op_kind"],
            "activation_shape": site["activation_shape"],
            "ramp_kind": ramp["kind"],
            "ramp_reduce": ramp["reduce"],
            "ramp_parameters": _ramp_parameters(ramp),
            "val_accuracy": site["val_accuracy"],
            "stage_ms": {str(b): at(profile["segment_ms"][name], b) for b in (1, 16)} if profile else None,
            "ramp_ms": {str(b): at(profile["ramp_ms"][name], b) for b in (1, 16)} if profile else None,
        })
    meta = manifest["meta"]
    return {
        "bundle": str(bundle),
        "source": meta["source"],
        "backend": manifest["backend"],
        "workload": meta["workload"],
        "data": meta.get("data"),  # the user's own inputs it was prepared on (`prepare --data`)
        "sites": sites,
        "final_stage_ms": {str(b): at(profile["segment_ms"]["output"], b) for b in (1, 16)} if profile else None,
        "whole_model_ms": {str(b): at(profile["full_ms"], b) for b in (1, 16)} if profile else None,
        "oracle_val": meta["oracle_val"],
        "training": {k: meta["training"][k] for k in ("num_train", "num_val", "collect_seconds", "train_seconds")},
        "ramp_data": meta.get("ramp_data"),  # absent from bundles prepared before it was recorded
        "engine": meta.get("engine"),  # absent from bundles prepared before the engine was chosen
    }


def _ramp_parameters(ramp: dict) -> int:
    from rampserve.ramps.kinds import make_ramp
    from rampserve.ramps.specs import RampSpec

    return make_ramp(RampSpec.from_json(ramp)).num_parameters()


def _fmt(value: float | None, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def print_engines(record: dict,
                  title: str = "engines: the model without ramps, median ms (interquartile range), interleaved rounds"
                  ) -> None:
    """The engines a model was timed on and the one it serves on (see `runtime.engines`)."""
    from rampserve.runtime.engines import CHOSEN_BY_USER, EngineChoice

    choice = EngineChoice.from_json(record)
    for engine, why in choice.unavailable:
        console.print(f"[yellow]{engine} could not run the model: {why}[/yellow]")
    if not choice.timings:
        why = "named by --engine" if choice.chosen_by == CHOSEN_BY_USER else "the only one it runs on"
        console.print(f"engine: {choice.engine} ({why}, not timed)")
        return
    sizes = sorted({t.batch_size for t in choice.timings})
    table = Table(title=title)
    table.add_column("engine")
    for b in sizes:
        table.add_column(f"batch {b}", justify="right")
        table.add_column(f"x {choice.engine}", justify="right")
    for row in choice.rows():
        cells = []
        for b in sizes:
            low, high = row[f"b{b}_iqr_ms"]
            cells += [f"{row[f'b{b}_ms']:.3f} ({low:.3f}-{high:.3f})", _fmt(row[f"b{b}_x_chosen"], ".2f")]
        table.add_row(row["engine"] + (" (serves)" if row["chosen"] else ""), *cells)
    console.print(table)


def print_inspection(report: dict) -> None:
    table = Table(title=f"{report['source']['ref']} ({report['backend']}): sites and ramps")
    for col in ("site", "ramp", "params", "val acc", "stage ms b1", "ramp ms b1", "stage ms b16",
                "ramp ms b16", "oracle exits"):
        table.add_column(col, justify="left" if col in ("site", "ramp") else "right")
    counts = report["oracle_val"]["exit_counts"]
    for s in report["sites"]:
        table.add_row(s["name"], f"{s['ramp_kind']}/{s['ramp_reduce']}", str(s["ramp_parameters"]),
                      _fmt(s["val_accuracy"]), _fmt(s["stage_ms"]["1"]), _fmt(s["ramp_ms"]["1"]),
                      _fmt(s["stage_ms"]["16"]), _fmt(s["ramp_ms"]["16"]), str(counts[s["name"]]))
    table.add_row("(final stage)", "", "", "", _fmt(report["final_stage_ms"]["1"]), "",
                  _fmt(report["final_stage_ms"]["16"]), "", str(counts["none"]))
    console.print(table)
    oracle = report["oracle_val"]
    console.print(
        f"whole model: {_fmt(report['whole_model_ms']['1'])} ms at batch 1, "
        f"{_fmt(report['whole_model_ms']['16'])} ms at batch 16. "
        f"Oracle on {oracle['inputs']} validation inputs: mean latency savings {oracle['mean_savings']:.1%}, "
        f"median {oracle['median_savings']:.1%} (batch 1)."
    )
    if own := report["data"]:
        console.print(f"Ramps trained on the {own['bootstrap_inputs']} distinct inputs of rows 1-"
                      f"{own['bootstrap_rows']} of {own['rows']} of {own['path']} ({own['format']}); the last "
                      f"{own['validation_inputs']} of them validated.")
    elif data := report["ramp_data"]:
        extra = data["in_domain"]
        console.print(f"Ramps trained on {data['bootstrap']['items']} bootstrap inputs of {data['bootstrap']['workload']}"
                      + (f" and {extra['items']} from the {extra['source']}." if extra["items"] else "."))
    if report["engine"]:
        print_engines(report["engine"])


@app.command()
def inspect(
    bundle: Annotated[Path, typer.Argument(help="a bundle written by `rampserve prepare`")],
    as_json: Annotated[bool, typer.Option("--json", help="print JSON instead of a table")] = False,
) -> None:
    """Sites, ramps, their accuracy against the original model, latencies, and the oracle's exits."""
    from rampserve.bundle_format.manifest import BundleError

    try:
        report = inspect_bundle(bundle)
    except BundleError as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(code=2) from exc
    if as_json:
        print(json.dumps(report, indent=2))
    else:
        print_inspection(report)


@app.command()
def profile(
    bundle: Annotated[Path, typer.Argument(help="a bundle written by `rampserve prepare`")],
    repeats: Annotated[int, typer.Option(help="paired rounds per batch size at least, more as the time budget "
                                              "allows (medians are kept)")] = 3,
) -> None:
    """Measure a bundle's latency profile again on this machine, at the batch sizes it was profiled at (run it
    on a quiet machine: the controller and the simulator take every ramp's cost from it)."""
    from rampserve.bundle_format.manifest import BundleError
    from rampserve.runtime.bundle import load_bundle, write_profile
    from rampserve.runtime.prepare import PrepareConfig, reprofile
    from rampserve.runtime.profile import DEFAULT_BATCH_SIZES

    try:
        model = load_bundle(bundle)
    except BundleError as exc:
        raise typer.BadParameter(str(exc)) from exc
    batch_sizes = model.profile.batch_sizes if model.profile else DEFAULT_BATCH_SIZES
    measured = reprofile(model, PrepareConfig(profile_batch_sizes=batch_sizes, profile_repeats=repeats))
    write_profile(bundle, measured)
    console.print(f"profiled {bundle}: whole model {measured.full(1):.3f} ms at batch 1, "
                  f"ramps {min(measured.ramp_ms[s][0] for s in measured.sites):.3f}-"
                  f"{max(measured.ramp_ms[s][0] for s in measured.sites):.3f} ms")


@app.command()
@with_options(SERVE_OPTIONS, "flags")
def serve(
    models: Annotated[Optional[list[str]], typer.Argument(
        help="zoo model names or bundle directories; or a model not prepared yet (an .onnx file, hf:DIR, or a folder "
             "holding model.onnx): served at once, vanilla, while it records its first requests, trains ramps on "
             "them in the background and adopts them")] = None,
    apps: Annotated[Optional[list[Path]], typer.Option("--app", help="JSON file of an application (or a list)")]
    = None,
    record: Annotated[int, typer.Option(help="a model not prepared yet: distinct requests it records before its "
                                             "ramps are trained on them")] = DEFAULT_RECORD,
    no_record: Annotated[bool, typer.Option("--no-record", help="a model not prepared yet: serve it vanilla and "
                                                                "record nothing")] = False,
    prepare_arg: Annotated[Optional[list[str]], typer.Option(
        help="a model not prepared yet: an option for the `rampserve prepare` that trains its ramps (repeatable, "
             "e.g. --prepare-arg=--ramp-kind --prepare-arg=mlp)")] = None,
    no_relearn: Annotated[bool, typer.Option(
        "--no-relearn", help="a model not prepared yet: keep its first ramps, never train them again when its "
                             "exits stop paying")] = False,
    relearn_window: Annotated[int, typer.Option(
        help="a model not prepared yet: answers per window of the early-answer share that tells when its exits "
             "stopped paying (below half the level held, three windows running)")] = RelearnRule.window,
    *,
    flags: dict[str, object],
) -> None:
    """Serve models and applications over HTTP (Open Inference Protocol v2, Clipper's application API) and gRPC
    (KServe v2) with managed early exits. Every option is also read from the environment variable RAMPSERVE_<NAME>
    (RAMPSERVE_GRPC_PORT for --grpc-port); a flag given wins. A model of the --repository may set its own with a
    model-settings.json beside its files."""
    from rampserve.serving.learning import LearningSettings
    from rampserve.serving.server import serve as run_server

    try:
        learning = LearningSettings(record=record, recording=not no_record, prepare_args=tuple(prepare_arg or ()),
                                    relearn=None if no_relearn else RelearnRule(window=relearn_window))
        options = ServeOptions.read(flags)
        model_settings, settings = options.model_settings(), options.server_settings()
        specs = [spec for path in apps or () for spec in read_applications(path)]
        on_ray = options.ray_options()
        if on_ray.ray:
            from rampserve.serving.ray.serve import RayDeployment, serve_on_ray

            scaling = None if on_ray.autoscaling is None else json.loads(on_ray.autoscaling)
            serve_on_ray(models or [], model_settings, settings, specs,
                         RayDeployment(replicas=on_ray.replicas, autoscaling=scaling))
            return
        run_server(models or [], model_settings, settings, specs, learning)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc


def read_applications(path: Path) -> list:
    from rampserve.serving.frontend.apps.applications import ApplicationSpec

    try:
        data = json.loads(path.read_text())
        return [ApplicationSpec.from_json(item) for item in (data if isinstance(data, list) else [data])]
    except (OSError, ValueError, TypeError) as exc:
        raise ValueError(f"application file {path}: {exc}") from None


@app.command()
def demo(
    model: Annotated[str, typer.Option(help="zoo model to prepare")] = DEMO_MODEL,
    small: Annotated[bool, typer.Option(help="the zoo's tiny variant (quick; no live replay)")] = False,
    duration: Annotated[float, typer.Option(help="seconds of drifting stream replayed against each server")] = 40.0,
    warmup_requests: Annotated[int, typer.Option(help="requests sent to each server before the measured replay: "
                                                      "the controller's first ramp-set search comes after its "
                                                      "first 1,024 inputs")] = 1200,
    load: Annotated[float, typer.Option(help=LOAD_HELP)] = DEFAULT_LOAD,
    rounds: Annotated[int, typer.Option(help="replays of the stream against each system, alternating which goes "
                                             "first: the rounds' spread says which difference is more than noise")] = 2,
    ramp_budget: Annotated[float, typer.Option(help="what ramps may add to a non-exiting input, as a share of "
                                                     "the model's latency (the controller's default)")] = 0.02,
    json_out: Annotated[Optional[Path], typer.Option(
        "--json", help="write the replay's report here (`bench live`'s; a new file)", callback=new_result_path)] = None,
) -> None:
    """Prepare the demo's model (minilm-rt; training what is missing), show what its ramps could save, then serve it
    for real, vanilla and with early exits, replay a short drifting stream against both and print the outcome."""
    from rampserve.bench.live import LiveSettings, live_table, run_live
    from rampserve.runtime.prepare import default_workload
    from rampserve.runtime.sources import ModelSource
    from rampserve.runtime.zoo_bundles import zoo_bundle

    try:  # before the model is prepared: refused settings should not wait for it
        settings = LiveSettings(model=model, workload=default_workload(ModelSource.parse(model, small=small)),
                                loads=(load,), duration_s=duration, saturation_s=6.0, warmup_requests=warmup_requests,
                                sequential_requests=200, inprocess_rounds=200, replay_rounds=rounds,
                                server_args=("--ramp-budget", str(ramp_budget)))
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    console.print(f"the prepared {model}: the bundle in the cache, or prepared now (training what is missing, "
                  "timing the engines, training its ramps)")
    bundle = zoo_bundle(model, small=small)
    inspection = inspect_bundle(bundle)
    print_inspection(inspection)
    if small:
        return
    engine = inspection["engine"]["engine"]
    console.print(f"serving {model} over HTTP on {engine}, the fastest engine here (vanilla is the model on it "
                  f"without ramps), then with early exits (ramp budget {ramp_budget:.0%}), and replaying "
                  f"{duration:g} s of the drifting stream ({settings.workload}) against each at load {load:g} (that "
                  f"share of vanilla's measured saturation) after {warmup_requests:,} warm-up requests, {rounds} "
                  "round(s) alternating which system goes first")
    report = run_live(settings, None, None)
    (entry,) = report["loads"]
    console.print(live_table(report, entry))
    console.print(demo_verdict(entry))
    _write_json(report, json_out)
    console.print(f"To look inside: `rampserve serve {model} --ramp-budget {ramp_budget}`, then "
                  "http://127.0.0.1:8000/metrics (Prometheus) and http://127.0.0.1:8000/status (configuration and "
                  "controller decisions); `rampserve bench live --json OUT --plots DIR` for the full benchmark.")


def demo_verdict(entry: dict, accuracy_constraint: float = 0.01) -> str:
    """What the demo's replay rounds showed (`bench live`'s entry for its load), in words that follow from their
    numbers: whether early exits saved latency at the median, claimed only where the cut is larger than the rounds'
    spread, whether the tail got worse, at what accuracy (and whether it kept the constraint the server was
    given), and why not where they did not."""
    from rampserve.bench.live import paired_cell

    vanilla, served = entry["systems"]["vanilla"], entry["systems"]["rampserve"]  # the median round's
    versus = entry["versus_vanilla"]
    p50, p99 = versus["p50_ms"], versus["p99_ms"]
    rounds = [r for r in p50["ratio_rounds"] if r is not None]
    spread = max(rounds) - min(rounds)

    lines = [f"rampserve answered {served['exit_share']:.0%} of requests at a ramp, agreeing with the original model "
             f"on {versus['accuracy']:.2%} of answers in its worst round (worst 1k: "
             f"{served['worst_window_accuracy']:.2%} in the median round).",
             f"Over {len(rounds)} round(s), alternating which system went first (median, min-max of the rounds): "
             f"p50 {paired_cell(p50, 'x')} vanilla's, p99 {paired_cell(p99, 'x')}; in the median round p50 "
             f"{served['p50_ms']:.2f} against {vanilla['p50_ms']:.2f} ms, throughput {served['throughput_rps']:.0f} against "
             f"{vanilla['throughput_rps']:.0f} rps."]
    cut = 1.0 - p50["ratio"]
    if served["exit_share"] == 0:
        lines.append("No answer left at a ramp in this run (no ramp fit the budget, or none was confident enough), "
                     "so early exits saved nothing here; the difference from vanilla is the managed server's own "
                     "cost and this machine's noise.")
    elif cut <= 0:
        lines.append("Exits happened, but did not lower the median in this run.")
    elif len(rounds) < 2:
        lines.append(f"The median was {cut:.0%} lower in one round, which shows no spread to judge a cut against: "
                     "run more rounds (--rounds) before trusting it.")
    elif cut > spread:
        lines.append(f"Early exits cut the median by {cut:.0%}, more than the rounds' spread ({spread:.2f}).")
    else:
        lines.append(f"The median was {cut:.0%} lower, within the rounds' spread ({spread:.2f}): this run claims "
                     "no cut.")
    if p99["ratio"] > 1.0:
        lines.append(f"The tail was worse: p99 {p99['ratio']:.2f}x vanilla's.")
    if versus["accuracy"] < 1.0 - accuracy_constraint:
        lines.append(f"Agreement fell below the {1.0 - accuracy_constraint:.0%} that the accuracy constraint asks for "
                     "in this run.")
    return "\n".join(lines)


@bench_app.command("staging")
def bench_staging(
    json_out: JsonOut = None,
    model: Annotated[str, typer.Option(help="zoo model")] = DEFAULT_MODEL,
    rounds: Annotated[int, typer.Option(help="interleaved rounds per case")] = 200,
    batch_size: Annotated[Optional[list[int]], typer.Option(
        help="a batch size to measure at (repeat it for several; default 1 and 16)")] = None,
    small: Annotated[bool, typer.Option(help="the zoo's tiny variant")] = False,
) -> None:
    """The engines timed side by side, staged execution (no active ramp) against the whole model on torch and
    ONNX, and what active ramps cost on the engine the bundle serves on (the other backend for reference)."""
    from rampserve.bench.staging import run_staging_bench

    sizes = {"batch_sizes": tuple(batch_size)} if batch_size else {}
    result = run_staging_bench(model, rounds=rounds, small=small, **sizes)
    print_engines(result["engines"])
    console.print(f"{model} serves on {result['served_engine']} (chosen by {result['engines']['chosen_by']} at "
                  f"prepare); the fastest in this run at batch 1: {result['fastest_now_at_batch_1']}")
    if result["as_users_run_it"]:
        print_engines(result["as_users_run_it"], "the served engine beside ONNX Runtime as a bare session runs the "
                                                 "model (its defaults), median ms, interleaved rounds")
    table = Table(title=f"staged / whole-model time, {model} (medians of interleaved runs)")
    for col in ("backend", "batch", "cuts", "whole ms", "staged ms", "ratio"):
        table.add_column(col, justify="right")
    for case in result["cases"] + result["all_sites_cases"]:
        table.add_row(case["backend"], str(case["batch_size"]), case["cuts"], f"{case['whole_ms']:.3f}",
                      f"{case['staged_ms']:.3f}", f"{case['ratio']:.3f}")
    console.print(table)
    ramps = Table(title=f"active ramps on the serving path, {model}: marginal share of the model's time per ramp")
    for col in ("backend", "path", "batch", "ramps", "none ms", "with ramps ms", "share per ramp", "95% interval"):
        ramps.add_column(col, justify="right")
    for case in result["ramp_cases"]:
        ramps.add_row(case["backend"] + (" (serves)" if case["served"] else ""), case["path"], str(case["batch_size"]),
                      str(case["active"]), f"{case['none_ms']:.3f}", f"{case['ramps_ms']:.3f}",
                      f"{case['marginal_share']:.4f}",
                      "{:.4f} to {:.4f}".format(*case["marginal_share_ci95"]))
    console.print(ramps)
    _write_json(result, json_out)


def _sim_table(report: dict) -> Table:
    table = Table(title=f"{report['model']} on {report['workload']}, {report['trace']} trace, "
                        f"{report['rate_rps']:.0f} rps, SLO {report['slo_ms']:.2f} ms, max batch {report['max_batch']}")
    columns = ("system", "accuracy", "worst 1k", "1k below", "p25 ms", "p50 ms", "p95 ms", "p99 ms", "p50 saved",
               "rps", "saturation rps", "exits", "oracle share")
    for col in columns:
        table.add_column(col, justify="right")
    for name, s in report["systems"].items():
        table.add_row(name, f"{s['accuracy']:.4f}", f"{s['worst_window_accuracy']:.3f}",
                      _fmt(s.get("windows_below_share"), ".1%"), f"{s['p25_ms']:.3f}", f"{s['p50_ms']:.3f}",
                      f"{s['p95_ms']:.3f}", f"{s['p99_ms']:.3f}", f"{s['p50_savings']:+.1%}",
                      f"{s['throughput_rps']:.0f}", _fmt(s.get("saturation_rps"), ".0f"), f"{s['exit_share']:.1%}",
                      _fmt(s.get("oracle_share"), ".2f"))
    return table


# `bench sim --seeds`: each SEED_FIGURES figure's column heading and format, narrow enough for 132 columns
SEED_COLUMNS = {"accuracy": ("accuracy", ".4f"), "windows_below_share": ("1k below", ".1%"),
                "p50_ratio": ("p50 ×van", ".2f"), "p99_ratio": ("p99 ×van", ".2f"), "exit_share": ("exits", ".1%"),
                "oracle_share": ("oracle", ".2f"), "saturation_ratio": ("sat ×van", ".2f"),
                "ramp_set_changes": ("set chg", "g"), "threshold_changes": ("thr chg", "g")}
SEED_COLUMNS_NOTE = ("oracle: share of the oracle's p50 saving; set chg, thr chg: configurations that changed the "
                     "ramp set, and thresholds alone")


def _seeds_table(title: str, rows: list[tuple[str, list[str]]]) -> Table:
    table = Table(title=title, caption=SEED_COLUMNS_NOTE)
    table.add_column("system")
    for heading, _ in SEED_COLUMNS.values():
        table.add_column(heading, justify="right")
    for name, cells in rows:
        table.add_row(name, *cells)
    return table


def _seed_table(report: dict) -> Table:
    """One seed's run, compactly: `seed_figures`."""
    from rampserve.bench.sim import seed_figures

    return _seeds_table(
        f"seed {report['seed']}: {report['model']} on {report['workload']}, {report['trace']} trace, "
        f"{report['rate_rps']:.0f} rps",
        [(name, [_fmt(figures[figure], spec) for figure, (_, spec) in SEED_COLUMNS.items()])
         for name, figures in seed_figures(report).items()])


def _seeds_summary_table(summary: dict, seeds: int) -> Table:
    """`seed_summary`: in each cell the median over the seeds, and below it the worst seed's value."""
    def cell(figure: dict | None, spec: str) -> str:
        return "-" if figure is None else f"{figure['median']:{spec}}\n{figure['worst']:{spec}}"

    return _seeds_table(
        f"over {seeds} seeds: each system's median, and below it the worst seed's value",
        [(f"{name}\n  worst", [cell(figures[figure], spec) for figure, (_, spec) in SEED_COLUMNS.items()])
         for name, figures in summary.items()])


def _print_sim_run(report: dict) -> None:
    """One seed's run in full: the systems, what the controller did, saturation and the risk step sweep."""
    console.print(_sim_table(report))
    rampserve = report["systems"]["rampserve"]
    measured = report["wall"]["decisions"]["rampserve"]
    console.print(f"rampserve: {rampserve['ramp_set_changes']} ramp-set changes and {rampserve['threshold_changes']} "
                  f"threshold-only changes; threshold tuning {measured['tune_ms_mean']:.2f} ms mean (measured) over "
                  f"{rampserve['tunings']} runs, ramp adjustment {measured['adjust_ms_mean']:.2f} ms mean over "
                  f"{rampserve['adjustments']}, {rampserve['mean_active_ramps']:.2f} active ramps on average; "
                  f"exit mode {rampserve['exit_mode']}, feedback share {rampserve['feedback_share']:.2f}")
    hindsight = report["systems"]["static_hindsight"]
    console.print(f"static hindsight: the best of {hindsight['ramp_sets_tuned']} ramp sets tuned "
                  f"({hindsight['ramp_set_search']} search)")
    half = report["at_half_vanilla_saturation"]
    if half is not None:
        console.print(f"saturation: rampserve {report['saturation_ratio']:.2f}x vanilla's; at half of vanilla's "
                      f"({half['rate_rps']:.0f} rps) rampserve's p50 is {half['p50_ratio']:.2f}x vanilla's, p99 "
                      f"{half['p99_ratio']:.2f}x, accuracy {half['systems']['rampserve']['accuracy']:.4f}")
    if report["risk_step_sweep"]:
        sweep = Table(title="rolling risk control's step")
        for col in ("step", "accuracy", "worst 1k", "1k windows below", "p50 saved", "tunings"):
            sweep.add_column(col, justify="right")
        for step, s in report["risk_step_sweep"].items():
            sweep.add_row(step, f"{s['accuracy']:.4f}", f"{s['worst_window_accuracy']:.3f}",
                          f"{s['windows_below_share']:.1%}", f"{s['p50_savings']:+.1%}", str(s["tunings"]))
        console.print(sweep)


MODEL_OR_OWN_HELP = "zoo model; with --data, any: a .onnx file, hf:DIR or module:factory too"
OWN_DATA_HELP = ("your own inputs as the stream instead of --workload (formats as `prepare --data`): the model is "
                 "prepared on its first --bootstrap rows (at most half), the rows after them are replayed")
BOOTSTRAP_HELP = "--data: the file's first rows the ramps learn from, at most (and at most half the file's)"


@bench_app.command("sim")
@controller_options
@data_options_flags
def bench_sim(
    model: Annotated[str, typer.Option(help=MODEL_OR_OWN_HELP)] = DEFAULT_MODEL,
    workload: Annotated[str, typer.Option(help="stream: fmnist-drift or rt-drift")] = "fmnist-drift",
    data: Annotated[Optional[Path], typer.Option(help=OWN_DATA_HELP)] = None,
    bootstrap: Annotated[int, typer.Option(help=BOOTSTRAP_HELP)] = 8000,
    trace: Annotated[str, typer.Option(help="arrivals: poisson, bursty or maf")] = "maf",
    rate: Annotated[Optional[float], typer.Option(help="mean requests per second (default: 20% load at batch 1)")]
    = None,
    slo_ms: Annotated[Optional[float], typer.Option(help="SLO bounding the batch size (default 2x batch-1 latency)")]
    = None,
    accuracy_constraint: Annotated[float, typer.Option(help="allowed share of answers that differ")] = 0.01,
    ramp_budget: Annotated[float, typer.Option(help="what ramps may add to a non-exiting input")] = 0.02,
    risk_step: Annotated[float, typer.Option(help="how far one disagreement scales the thresholds down")] = 0.05,
    length: Annotated[int, typer.Option(help="stream items, bootstrap included")] = 120_000,
    exit_mode: Annotated[str, typer.Option(help="release: exited inputs run on to the end; stop: they leave; auto: "
                                                "stop where the SLO allows batches of at most 2, as a server does")]
    = "auto",
    feedback_share: Annotated[float, typer.Option(help="stop mode: share of inputs kept running to the end")] = 0.1,
    seeds: Annotated[int, typer.Option(help="run everything for seeds 0 to N - 1 (each its own stream order and "
                                            "trace) and sum each system up over them")] = 1,
    saturation: Annotated[bool, typer.Option(
        "--saturation/--no-saturation", help="search each system's saturation, then run vanilla and rampserve at half "
                                             "of vanilla's (about 2 minutes a seed on resnet18-fmnist)")] = True,
    risk_sweep: Annotated[Optional[bool], typer.Option(
        "--risk-sweep/--no-risk-sweep", help="rerun rampserve at other rolling risk control steps (default: with one "
                                             "seed only)")] = None,
    json_out: JsonOut = None,
    plots: Annotated[Optional[Path], typer.Option(help="write plots into this directory (a folder per seed with "
                                                       "several)")] = None,
    small: Annotated[bool, typer.Option(help="the zoo's tiny variant")] = False,
    decisions: Annotated[bool, typer.Option(help="keep the controller's every decision in the JSON (a raw log: "
                                                 "most of a long run's bytes)")] = False,
    *,
    controller_flags: dict[str, object],
    data_flags: dict[str, object],
) -> None:
    """Replay a drifting stream (or your own inputs, --data) through the trace simulator: vanilla, oracle, static
    baselines and rampserve; then each one's saturation, and vanilla and rampserve at half of vanilla's."""
    from rampserve.bench.sim import SimSettings, kept_report, run_seeds
    from rampserve.control.controller import ControllerSettings
    from rampserve.runtime.prepare import PrepareConfig

    single = seeds == 1
    try:
        settings = SimSettings(model=model, workload=workload, trace=trace, rate_rps=rate, slo_ms=slo_ms,
                               length=length, small=small, controller=ControllerSettings(
                                   accuracy_constraint=accuracy_constraint, ramp_budget=ramp_budget,
                                   risk_step=risk_step, exit_mode=exit_mode, feedback_share=feedback_share,
                                   **controller_flags),
                               saturation=saturation, data=data, data_options=data_options(**data_flags),
                               prepare=PrepareConfig(bootstrap_items=bootstrap))
        if not (single if risk_sweep is None else risk_sweep):
            settings = replace(settings, risk_step_sweep=())
        result = run_seeds(settings, seeds, progress=lambda stage: console.print(f"[dim]simulating {stage}[/dim]"))
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    if single:
        _print_sim_run(result.results[0].report)
        _write_json(kept_report(result.results[0].report, decisions), json_out)
    else:
        for seed_result in result.results:
            console.print(_seed_table(seed_result.report))
        console.print(_seeds_summary_table(result.summary, seeds))
        _write_json(kept_report(result.report(), decisions), json_out)
    if plots is not None:
        from rampserve.bench.sim_plots import write_plots

        for seed_result in result.results:
            for path in write_plots(seed_result, plots if single else plots / f"seed-{seed_result.report['seed']}"):
                console.print(f"wrote {path}")


@bench_app.command("reductions")
def bench_reductions(
    model: Annotated[str, typer.Option(help="zoo text model")] = "mpnet-rt",
    workload: Annotated[str, typer.Option(help="text stream")] = "rt-drift",
    json_out: JsonOut = None,
    small: Annotated[bool, typer.Option(help="the zoo's tiny variant")] = False,
) -> None:
    """Linear ramps reducing each site by the first token or by the mean over the input's own tokens, trained as
    prepare trains them: agreement with the model on the evaluation stream, and the share each can answer at 99%."""
    from rampserve.bench.reductions import ReductionSettings, run_reductions

    try:
        report = run_reductions(ReductionSettings(model=model, workload=workload, small=small))
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    table = Table(title=f"{model} on {workload}: ramp reductions ({report['evaluation_inputs']} distinct evaluation "
                        f"inputs, weighted by visits)")
    table.add_column("site")
    for how in report["reductions"]:
        table.add_column(f"{how} agreement", justify="right")
        table.add_column(f"{how} exits at 99%", justify="right")
    for i, site in enumerate(report["sites"]):
        cells = [f"{rows[i][key]:.3f}" for rows in report["reductions"].values()
                 for key in ("agreement", "exit_share_at_99")]
        table.add_row(site, *cells)
    console.print(table)
    _write_json(report, json_out)


@bench_app.command("freeze")
def bench_freeze(
    models: Annotated[str, typer.Option(help="zoo models, comma-separated")] = "resnet18-fmnist,resnet50-fmnist",
    workload: Annotated[str, typer.Option(help="stream")] = "fmnist-drift",
    requests: Annotated[int, typer.Option(help="evaluation requests replayed per system")] = 30_000,
    accuracy_constraint: Annotated[float, typer.Option(help="allowed share of answers that differ")] = 0.01,
    exit_mode: Annotated[Optional[str], typer.Option(help="managed systems' exit mode: release, stop or auto "
                                                          "(default: the controller's, auto)")] = None,
    feedback_share: Annotated[Optional[float], typer.Option(help="stop mode: share of exited inputs that run to the "
                                                                 "end (default: the controller's)")] = None,
    json_out: JsonOut = None,
    plots: Annotated[Optional[Path], typer.Option(help="write plots into this directory")] = None,
    small: Annotated[bool, typer.Option(help="the zoo's tiny variants")] = False,
    model: Annotated[Optional[str], typer.Option(help="instead of --models: one zoo model's caches, mixed caches and "
                                                      "ramps, and ramps alone, managed, against vanilla over seeds "
                                                      "(simulated on its own stream), and per site what a cache "
                                                      "costs and answers")] = None,
    seeds: Annotated[int, typer.Option(help="with --model: seeds 0 to N - 1")] = 3,
    length: Annotated[int, typer.Option(help="with --model: stream items per seed, bootstrap included")] = 120_000,
    mixed_bundle: Annotated[bool, typer.Option(help="with --model: also prepare and serve a mixed bundle (per site "
                                                    "a cache or the model's own ramp)")] = True,
) -> None:
    """Freeze Inference's caches as exits: memory, lookup cost, static vs managed thresholds, online updates."""
    from rampserve.bench.freeze import FreezeSettings, run_freeze
    from rampserve.control.controller import ControllerSettings

    # only what was given: the controller's exit-mode fields are its own
    modes = {k: v for k, v in (("exit_mode", exit_mode), ("feedback_share", feedback_share)) if v is not None}
    try:
        controller = ControllerSettings(accuracy_constraint=accuracy_constraint, **modes)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    if model is not None:
        from rampserve.bench.freeze import ExitKindsSettings, exit_kinds_tables, run_exit_kinds

        if seeds < 1:
            raise typer.BadParameter(f"--seeds must be at least 1, got {seeds}")
        kinds = run_exit_kinds(ExitKindsSettings(model=model, seeds=seeds, length=length, controller=controller,
                                                 mixed_bundle=mixed_bundle, small=small),
                               progress=lambda stage: console.print(f"[dim]{stage}[/dim]"))
        for table in exit_kinds_tables(kinds):
            console.print(table)
        _write_json(kinds, json_out)
        if plots is not None:
            from rampserve.bench.freeze_plots import write_exit_kinds_plots

            console.print(f"wrote {write_exit_kinds_plots(kinds, plots)}")
        return
    settings = FreezeSettings(models=tuple(m.strip() for m in models.split(",") if m.strip()), workload=workload,
                              requests=requests, small=small, controller=controller)
    report, runs = run_freeze(settings, progress=lambda stage: console.print(f"[dim]{stage}[/dim]"))
    for name, result in report["models"].items():
        table = Table(title=f"{name} on {workload}: cache ramps at {len(result['sites'])} sites, "
                            f"{result['requests']} requests, SLO {result['slo_ms']:.2f} ms")
        for col in ("system", "accuracy", "1k <target", "exit share", "mean exit depth", "memory KiB", "p50 ms",
                    "saturation rps", "exit mode"):
            table.add_column(col, justify="right")
        for system, s in result["systems"].items():
            mode = f"{s['exit_mode']} {s['feedback_share']:.2f}" if "exit_mode" in s else "-"
            table.add_row(system, f"{s['accuracy']:.4f}", f"{s['windows_below_share']:.1%}", f"{s['exit_share']:.1%}",
                          f"{s['mean_exit_depth']:.3f}", f"{s['memory_bytes'] / 1024:.0f}", f"{s['p50_ms']:.2f}",
                          f"{s['saturation_rps']:.0f}", mode)
        console.print(table)
        costs = Table(title=f"{name}: memory and lookup cost per site")
        for col in ("site", "k-NN raw MiB", "k-NN reduced KiB", "k-means KiB", "k-means / raw", "lookup/skipped b1",
                    "lookup/skipped b16"):
            costs.add_column(col, justify="right")
        share = {(r["site"], r["batch_size"]): r["lookup_share_of_skipped"] for r in result["lookup_cost"]}
        for row in result["memory"]:
            costs.add_row(row["site"], f"{row['knn_raw_bytes'] / 2**20:.1f}", f"{row['knn_reduced_bytes'] / 1024:.0f}",
                          f"{row['kmeans_bytes'] / 1024:.0f}", f"{row['kmeans_share_of_knn_raw']:.3%}",
                          f"{share[(row['site'], 1)]:.1%}", f"{share[(row['site'], 16)]:.1%}")
        console.print(costs)
        for system, rec in result["shift_recovery"].items():
            console.print(f"{system}: exit share back within 10% after {rec['recovered']} of {len(rec['shifts'])} "
                          f"shifts (median {rec['median_recovered_after']} requests)")
    repeats = report["repeated_requests"]
    console.print(f"repeated requests (Zipf {repeats['zipf_exponent']}, {repeats['requests']} requests over "
                  f"{repeats['distinct']} inputs): " + ", ".join(
                      f"{k} answers {repeats[k]['answered_before_final']:.1%} early at accuracy {repeats[k]['accuracy']:.4f}"
                      for k in ("exact", "intermediate", "both")))
    _write_json(report, json_out)
    if plots is not None:
        from rampserve.bench.freeze_plots import write_plots

        for path in write_plots(report, runs, plots):
            console.print(f"wrote {path}")


@bench_app.command("live")
@controller_options
@data_options_flags
def bench_live(
    model: Annotated[str, typer.Option(help=MODEL_OR_OWN_HELP)] = DEFAULT_MODEL,
    workload: Annotated[str, typer.Option(help="stream: fmnist-drift or rt-drift")] = "fmnist-drift",
    data: Annotated[Optional[Path], typer.Option(help=OWN_DATA_HELP)] = None,
    bootstrap: Annotated[int, typer.Option(help=BOOTSTRAP_HELP)] = 8000,
    trace: Annotated[str, typer.Option(help="arrivals: poisson, bursty or maf")] = "maf",
    load: Annotated[Optional[float], typer.Option(help=f"{LOAD_HELP} [default: {DEFAULT_LOAD:g}]")] = None,
    loads: Annotated[Optional[str], typer.Option(help="several loads, as 0.1,0.2,0.3,0.5: one vanilla saturation "
                                                      "probe, then a replay per load for each system")] = None,
    rate: Annotated[Optional[float], typer.Option(help="mean requests per second, instead of the load's")] = None,
    duration: Annotated[Optional[float], typer.Option(
        help="measured seconds per system and load [default: 60; from cold: 900, from the server's start]")] = None,
    from_cold: Annotated[bool, typer.Option(
        "--from-cold", help="start from the bare model (an .onnx file or hf:DIR, with --data): one server serves it "
                            "unprepared, records, trains and adopts ramps while the file is replayed from its first row; "
                            "time to the first exit and to managed mode, latency by phase, against vanilla while the "
                            "training job runs")] = False,
    record: Annotated[int, typer.Option(help="from cold: the server's --record")] = DEFAULT_RECORD,
    change_at: Annotated[Optional[int], typer.Option(
        help="from cold: the row of --data where the stream changes; reports the exits before it against after the "
             "ramps were trained again")] = None,
    pause_job_every: Annotated[Optional[float], typer.Option(
        help="from cold: stop the training job and let it go on in turns of this many seconds, to time requests "
             "with and without it on the same server, interleaved (the job takes twice as long)")] = None,
    ramp_budget: Annotated[float, typer.Option(help="what ramps may add to a non-exiting input")] = 0.02,
    accuracy_constraint: Annotated[float, typer.Option(help="the managed server's allowed share of answers that "
                                                            "differ")] = 0.01,
    exit_mode: Annotated[Optional[str], typer.Option(help="the managed server's exit mode: release (every input "
                                                          "runs to the end), stop, or auto (the server's default: "
                                                          "stop where batches hold at most 2 inputs)")]
    = None,
    feedback_share: Annotated[Optional[float], typer.Option(help="stop mode: share of exited inputs that run to the "
                                                                 "end (default: the server's)")] = None,
    saturation_s: Annotated[float, typer.Option(help="seconds of each closed-loop saturation probe")] = 10.0,
    saturation_rounds: Annotated[int, typer.Option(help="saturation probes per server (the median counts)")] = 3,
    warmup_requests: Annotated[int, typer.Option(help="requests sent before each measured replay")] = 300,
    server_arg: Annotated[Optional[list[str]], typer.Option(help="more `rampserve serve` options for both servers")]
    = None,
    transport: Annotated[str, typer.Option(help="what the client speaks: http (binary tensors) or grpc")] = "http",
    client: Annotated[str, typer.Option(help="who sends over HTTP: lean (one thread, blocking sockets: the least "
                                             "client CPU beside the servers) or aiohttp")] = "lean",
    rounds: Annotated[int, typer.Option(help="replays of each load per system, alternating which goes first "
                                             "(ratios are paired within rounds; the median is judged)")] = 3,
    slices: Annotated[int, typer.Option(help="slices a round's measured requests go in, the systems taking turns "
                                             "after both warm-ups (1: each system's replay whole, one after the "
                                             "other)")] = 4,
    seed: Annotated[int, typer.Option(help="the draw of the stream's order and the arrivals: every round replays the "
                                           "same requests, so a run measures one draw; another seed, another")] = 0,
    sim_json: Annotated[Optional[Path], typer.Option(help="a `bench sim --json` report of this model, workload and "
                                                          "trace at one of the loads: its p50 saving goes beside "
                                                          "the live one")] = None,
    json_out: JsonOut = None,
    plots: Annotated[Optional[Path], typer.Option(help="write plots into this directory (a folder per load, and "
                                                       "latency against load)")] = None,
    simulated_seeds: Annotated[Optional[int], typer.Option(help="start no server: simulate the replays of N seeds "
                                                                "from --seed at --rate, warm-up included, with the "
                                                                "managed server's controller")] = None,
    *,
    controller_flags: dict[str, object],
    data_flags: dict[str, object],
) -> None:
    """Real servers, real HTTP (or gRPC): vanilla and rampserve on the same model, stream (or your own inputs,
    --data) and open-loop trace, at each load."""
    from rampserve.bench.live import (
        LiveSettings,
        live_table,
        load_table,
        parse_loads,
        read_simulator_saving,
        run_live,
        simulate_replays,
        simulated_replays_table,
        versus_table,
        worst_tail_round,
    )
    from rampserve.bench.stages import stages_table, tail_table
    from rampserve.runtime.prepare import PrepareConfig

    if from_cold:
        _bench_from_cold(model, data, data_options(**data_flags), record, load, rate, trace, duration, json_out,
                         ("--ramp-budget", str(ramp_budget), "--accuracy-constraint", str(accuracy_constraint),
                          *(server_arg or ())), pause_job_every, change_at)
        return
    try:
        if load is not None and loads is not None:
            raise ValueError("give --load or --loads, not both")
        stated = parse_loads(loads) if loads is not None else (DEFAULT_LOAD if load is None else load,)
        settings = LiveSettings(model=model, workload=workload, trace=trace, loads=stated, rate_rps=rate,
                                duration_s=60.0 if duration is None else duration,
                                accuracy_constraint=accuracy_constraint, exit_mode=exit_mode,
                                feedback_share=feedback_share, controller=controller_flags, saturation_s=saturation_s,
                                saturation_rounds=saturation_rounds, warmup_requests=warmup_requests,
                                server_args=("--ramp-budget", str(ramp_budget), *(server_arg or ())),
                                transport=transport, client=client, replay_rounds=rounds, replay_slices=slices,
                                seed=seed, data=data, data_options=data_options(**data_flags),
                                prepare=PrepareConfig(bootstrap_items=bootstrap))
        simulator = None if sim_json is None else read_simulator_saving(sim_json, settings)
        if simulated_seeds is not None:
            console.print(simulated_replays_table(simulate_replays(settings, simulated_seeds, json_out)))
            return
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    report = run_live(settings, json_out, plots, simulator=simulator)
    if report.get("low_load_stages"):
        console.print(stages_table({"vanilla": {"stages": report["low_load_stages"]}},
                                   "where the time went, one request at a time: median (mean) ms"))
    for entry in report["loads"]:
        console.print(live_table(report, entry))
        console.print(versus_table(entry))
        if any(summary.get("stages") for summary in entry["systems"].values()):
            console.print(stages_table(entry["systems"], f"where a request's time went at load {entry['load']:g}, "
                                                         f"round {entry['median_round'] + 1}: median (mean) ms"))
            worst = worst_tail_round(entry)
            console.print(tail_table(entry["rounds"][worst], f"where the slowest 1% went at load {entry['load']:g}, "
                                                             f"round {worst + 1} (rampserve's worst p99 against "
                                                             "vanilla's): mean ms"))
    console.print(load_table(report))


def _bench_from_cold(model: str, data: Path | None, options: object, record: int, load: float | None,
                     rate: float | None, trace: str, duration: float | None, json_out: Path | None,
                     server_args: tuple[str, ...], pause_job_every: float | None, change_at: int | None) -> None:
    """`bench live --from-cold` (`bench.cold`)."""
    from rampserve.bench.cold import ColdSettings, cold_table, run_cold

    try:
        if data is None:
            raise ValueError("--from-cold replays your own inputs: give them with --data")
        settings = ColdSettings(model=model, data=data, data_options=options, record=record,
                                load=DEFAULT_LOAD if load is None else load, rate_rps=rate, trace=trace,
                                server_args=server_args, pause_job_every_s=pause_job_every, change_at=change_at,
                                **({} if duration is None else {"duration_s": duration}))
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    report = run_cold(settings, json_out)
    console.print(cold_table(report))
    console.print("goals: " + ", ".join(f"{goal} {'met' if met else 'missed'}" for goal, met in report["goals"].items()),
                  markup=False)


@bench_app.command("executor")
def bench_executor(
    model: Annotated[str, typer.Option(help="zoo model")] = DEFAULT_MODEL,
    rounds: Annotated[int, typer.Option(help="interleaved rounds (thread and process each start afresh)")] = 5,
    max_batch: Annotated[int, typer.Option(help="largest batch of both servers")] = 8,
    clients: Annotated[int, typer.Option(help="closed-loop clients")] = 8,
    json_out: JsonOut = None,
) -> None:
    """The executor in the server's process or in one of its own: overhead, throughput and batch size, over HTTP
    (binary tensors, JSON) and over gRPC; and the bare HTTP cores a front end could run on."""
    from rampserve.bench.executor import ExecutorBenchSettings, executor_table, http_cores_table, run_executor_bench

    try:
        settings = ExecutorBenchSettings(model=model, rounds=rounds, max_batch=max_batch, clients=clients)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    report = run_executor_bench(settings, json_out)
    console.print(executor_table(report))
    console.print(http_cores_table(report))


@bench_app.command("startup")
def bench_startup(
    models: Annotated[Optional[list[str]], typer.Option("--model", help="zoo model (repeat for several; default "
                                                                        "resnet18-fmnist), e.g. mpnet-rt")] = None,
    rounds: Annotated[int, typer.Option(help="starts per model, interleaved across models")] = 5,
    vanilla: Annotated[bool, typer.Option(help="serve the original model: no controller, no sets to compile")] = False,
    restart: Annotated[bool, typer.Option(help="also kill the executor (SIGKILL), idle and under load, and time it "
                                               "until the model is ready again, phase by phase")] = False,
    restart_clients: Annotated[int, typer.Option(help="closed-loop clients of the load a restart comes under")] = 8,
    json_out: JsonOut = None,
) -> None:
    """A server's start: the front end's resident memory and its time to ready, with the executor's memory; with
    --restart, an executor's restart after a kill."""
    from rampserve.bench.startup import StartupBenchSettings, restart_table, run_startup_bench, startup_table

    try:
        settings = StartupBenchSettings(models=tuple(models or (DEFAULT_MODEL,)), rounds=rounds, vanilla=vanilla,
                                        restart=restart, restart_clients=restart_clients)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    report = run_startup_bench(settings, json_out)
    console.print(startup_table(report))
    if restart:
        console.print(restart_table(report))


@bench_app.command("dashboard")
def bench_dashboard(
    model: Annotated[str, typer.Option(help="zoo model")] = DEFAULT_MODEL,
    models: Annotated[int, typer.Option(help="copies of the model served, all sampled (the load goes to the first)")]
    = 1,
    rounds: Annotated[int, typer.Option(help="interleaved rounds (each server starts afresh)")] = 5,
    clients: Annotated[int, typer.Option(help="closed-loop clients")] = 8,
    poll_s: Annotated[float, typer.Option(help="the viewer's polling interval (the page's: 1 s; less magnifies "
                                               "what polling costs)")] = 1.0,
    json_out: JsonOut = None,
) -> None:
    """What /dashboard costs serving: the server without it, and with it and a viewer polling once a second."""
    from rampserve.bench.dashboard import DashboardBenchSettings, dashboard_table, run_dashboard_bench

    try:
        settings = DashboardBenchSettings(model=model, models=models, rounds=rounds, clients=clients, poll_s=poll_s)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    console.print(dashboard_table(run_dashboard_bench(settings, json_out)))


@bench_app.command("peers")
def bench_peers(
    model: Annotated[str, typer.Option(help="zoo model")] = DEFAULT_MODEL,
    workload: Annotated[str, typer.Option(help="stream: fmnist-drift or rt-drift")] = "fmnist-drift",
    trace: Annotated[str, typer.Option(help="arrivals: poisson, bursty or maf")] = "maf",
    load: Annotated[float, typer.Option(help=f"{LOAD_HELP}, probed before the rounds")] = DEFAULT_LOAD,
    rate: Annotated[Optional[float], typer.Option(help="mean requests per second, instead of the load's (no "
                                                       "probe)")] = None,
    duration: Annotated[float, typer.Option(help="measured seconds of each system's replay, each round")] = 10.0,
    rounds: Annotated[int, typer.Option(help="interleaved rounds; each round starts one system further along")] = 5,
    sweep_s: Annotated[float, typer.Option(help="seconds of each closed-loop level of the sweep, each round")] = 5.0,
    sweep_settle_s: Annotated[float, typer.Option(help="first seconds of each level, not counted")] = 1.0,
    sweep_clients: Annotated[Optional[list[int]], typer.Option(help="a level of the sweep (repeatable; default "
                                                                    "1, 2, 4, 8, 16)")] = None,
    saturation_s: Annotated[float, typer.Option(help="seconds of the probe that sets the rate")] = 10.0,
    slo_ms: Annotated[Optional[float], typer.Option(help="SLO of every system (default: twice the profiled batch-1 "
                                                         "latency); saturation keeps p99 within it")] = None,
    max_batch: Annotated[Optional[int], typer.Option(help="max batch of every system (default: the largest "
                                                          "profiled batch within the SLO)")] = None,
    max_delay_ms: Annotated[float, typer.Option(help="max batching wait of every system")] = 0.0,
    ramp_budget: Annotated[float, typer.Option(help="what ramps may add to a non-exiting input")] = 0.02,
    warmup_requests: Annotated[int, typer.Option(help="requests every system gets before its measured replay, each "
                                                      "round (rampserve's controller learns from them)")] = 300,
    system: Annotated[Optional[list[str]], typer.Option(help="a system to run (repeatable; default all: "
                                                             "rampserve_vanilla, rampserve, mlserver, ray_serve, "
                                                             "triton, kserve, litserve)")] = None,
    transport: Annotated[str, typer.Option(help="http (binary tensors, or JSON to the JSON-only peers) or grpc "
                                                "(to every system that serves it; Ray Serve and LitServe stay on "
                                                "HTTP)")]
    = "http",
    json_out: JsonOut = None,
    plots: Annotated[Optional[Path], typer.Option(help="write plots into this directory")] = None,
) -> None:
    """rampserve vanilla, rampserve, MLServer, Ray Serve, Triton, KServe and LitServe on the same model (on the
    bundle's engine: its ONNX file on ONNX Runtime where it serves on it) and client, in interleaved rounds: each a
    replay and a concurrency sweep per system; medians and min–max over rounds."""
    from rampserve.bench.live import LiveSettings
    from rampserve.bench.peers import SWEEP_CLIENTS, SYSTEMS, PeerSettings, peers_notes, peers_table, run_peers

    try:
        live = LiveSettings(model=model, workload=workload, trace=trace, loads=(load,), rate_rps=rate,
                            duration_s=duration, saturation_s=saturation_s, saturation_rounds=1, slo_ms=slo_ms,
                            max_batch=max_batch, max_delay_ms=max_delay_ms, warmup_requests=warmup_requests,
                            server_args=("--ramp-budget", str(ramp_budget)))
        settings = PeerSettings(live=live, systems=tuple(system or SYSTEMS), rounds=rounds,
                                sweep_clients=tuple(sweep_clients or SWEEP_CLIENTS), sweep_s=sweep_s,
                                sweep_settle_s=sweep_settle_s, transport=transport)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    report = run_peers(settings, json_out, plots)
    console.print(peers_table(report))
    for note in peers_notes(report):
        console.print(note, markup=False)
    console.print("goals (medians over rounds): " + ", ".join(f"{k} {v}" for k, v in report["goals"].items()),
                  markup=False)


@bench_app.command("tuning")
def bench_tuning(
    model: Annotated[str, typer.Option(help="zoo model")] = DEFAULT_MODEL,
    workload: Annotated[str, typer.Option(help="stream whose real ramp outputs are tuned on")] = "fmnist-drift",
    windows: Annotated[int, typer.Option(help="windows of recent inputs per case")] = 20,
    grid_step: Annotated[float, typer.Option(help="grid search resolution")] = 0.1,
    json_out: JsonOut = None,
    small: Annotated[bool, typer.Option(help="the zoo's tiny variant")] = False,
) -> None:
    """Greedy threshold tuning against exhaustive grid search: time and savings on real ramp records."""
    from rampserve.bench.tuning import run_tuning_bench

    result = run_tuning_bench(model, workload, windows=windows, grid_step=grid_step, small=small)
    table = Table(title=f"threshold tuning on {model} / {workload}, target accuracy {result['target_accuracy']}")
    for col in ("ramps", "greedy ms mean", "greedy ms max", "grid ms mean", "savings vs grid (mean)",
                "(worst window)", "accuracy greedy/grid"):
        table.add_column(col, justify="right")
    for case in result["cases"]:
        table.add_row(str(case["ramps"]), f"{case['greedy_ms_mean']:.2f}", f"{case['greedy_ms_max']:.2f}",
                      f"{case['grid_ms_mean']:.1f}", f"{case['savings_share_of_grid_mean']:.1%}",
                      f"{case['savings_share_of_grid_min']:.1%}",
                      f"{case['greedy_accuracy_mean']:.4f}/{case['grid_accuracy_mean']:.4f}")
    console.print(table)
    _write_json(result, json_out)


def _names(listed: str) -> tuple[str, ...]:
    """Comma-separated names; 'none' for none."""
    names = tuple(name.strip() for name in listed.split(",") if name.strip())
    return () if names == ("none",) else names


@bench_app.command("selection")
def bench_selection(
    queries: Annotated[int, typer.Option(help="queries: the Fashion-MNIST test images in seeded orders")] = 20_000,
    failure_start: Annotated[int, typer.Option(help="first query the best model fails on")] = 5_000,
    failure_end: Annotated[int, typer.Option(help="first query it works again on")] = 10_000,
    exp3_eta: Annotated[Optional[float], typer.Option(help="Exp3's rate (default sqrt(2 ln K / (K T)))")] = None,
    exp4_eta: Annotated[Optional[float], typer.Option(help="Exp4's rate (default sqrt(8 ln K / T))")] = None,
    seeds: Annotated[int, typer.Option(help="runs of the experiment, seeds 0..N-1 (medians and ranges reported)")] = 5,
    cnns: Annotated[str, typer.Option(help="zoo CNNs, comma-separated ('none': no CNN)")]
    = "resnet18-fmnist,resnet50-fmnist,vgg11-fmnist,vgg16-fmnist",
    sklearn: Annotated[str, typer.Option(help="scikit-learn models trained at bench time, comma-separated: "
                                              "logreg-pixels, mlp-pixels, forest-pixels, extra-trees-pixels, "
                                              "knn-pixels ('none': no such model)")] = "logreg-pixels",
    forgetting: Annotated[str, typer.Option(help="how old evidence fades, comma-separated: detect, share, none, "
                                                 "detect+share")] = "detect,share,none,detect+share",
    predictions: Annotated[Optional[Path], typer.Option(help="an .npz of the models' test-set labels: reused for "
                                                            "the models it holds, written with all of them")] = None,
    json_out: JsonOut = None,
    plots: Annotated[Optional[Path], typer.Option(help="write plots into this directory")] = None,
) -> None:
    """Clipper's model selection: Exp3 and Exp4 over four zoo CNNs and a scikit-learn model, the best failing."""
    from rampserve.bench.selection import SelectionSettings, run_selection, selection_tables

    try:
        settings = SelectionSettings(queries=queries, failure_start=failure_start, failure_end=failure_end,
                                     exp3_eta=exp3_eta, exp4_eta=exp4_eta, seeds=tuple(range(seeds)),
                                     cnns=_names(cnns), sklearn=_names(sklearn), forgetting=_names(forgetting))
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    report = run_selection(settings, progress=lambda stage: console.print(f"[dim]{stage}[/dim]"),
                           saved_predictions=predictions)
    for table in selection_tables(report):
        console.print(table)
    _write_json(report, json_out)
    if plots is not None:
        from rampserve.bench.selection_plots import write_plots

        for path in write_plots(report, plots):
            console.print(f"wrote {path}")


@bench_app.command("race")
def bench_race(
    models: Annotated[str, typer.Option(help="zoo models or bundle directories, comma-separated")]
    = "vgg11-fmnist,resnet18-fmnist,resnet50-fmnist",
    remote: Annotated[str, typer.Option(help="the model served by a second rampserve and reached over v2 "
                                             "('none': all local)")] = "resnet50-fmnist",
    timeout_ms: Annotated[Optional[list[str]], typer.Option(
        help="the race's timeout T, repeatable; 'auto': the slowest model's mean latency in a calibration race "
             "(default: auto and 50)")] = None,
    deciders: Annotated[str, typer.Option(help="comma-separated: first, consensus, best_confidence, "
                                               "confidence_weighted, learned or module:function")]
    = "first,consensus,best_confidence,confidence_weighted,learned",
    queries: Annotated[int, typer.Option(help="Fashion-MNIST test images, each sent to every configuration")] = 1000,
    calibration_queries: Annotated[int, typer.Option(help="other test images for the calibration race")] = 200,
    feedback_queries: Annotated[int, typer.Option(help="other test images sent to the learning races alone, each "
                                                       "followed by its true label, before the measured run")] = 500,
    failing: Annotated[str, typer.Option(help="the model unloaded for the failure run after the measured one: "
                                              "'best' (the most accurate alone), a model name, or 'none'")] = "best",
    failure_queries: Annotated[int, typer.Option(help="other test images for the failure run")] = 500,
    seeds: Annotated[int, typer.Option(help="runs, with seeds seed, seed + 1, ...: each its own images, order and "
                                            "servers; more than one writes every run and their spread")] = 1,
    rate: Annotated[float, typer.Option(help="requests per second of the one client, all configurations")] = 40.0,
    tolerance_ms: Annotated[float, typer.Option(help="checked: p99 answer time <= T + this")] = 5.0,
    vanilla: Annotated[bool, typer.Option(help="serve the models without early exits")] = False,
    seed: Annotated[int, typer.Option(help="which test images, and the order of configurations")] = 0,
    json_out: JsonOut = None,
) -> None:
    """Speculative serving's race, live: three models (one remote), each decider at each timeout T, and each
    model alone, on the same Fashion-MNIST queries; accuracy, answer times and p99 <= T + tolerance."""
    from rampserve.bench.race import (
        RaceSettings,
        comparison_lines,
        model_table,
        race_table,
        run_race,
        seeds_summary,
        seeds_table,
    )

    try:
        timeouts = tuple(None if t.strip().lower() == "auto" else float(t) for t in (timeout_ms or ["auto", "50"]))
        settings = RaceSettings(models=tuple(m.strip() for m in models.split(",") if m.strip()),
                                remote=None if remote.lower() == "none" else remote, vanilla=vanilla,
                                deciders=tuple(d.strip() for d in deciders.split(",") if d.strip()),
                                timeouts_ms=timeouts, queries=queries, calibration_queries=calibration_queries,
                                feedback_queries=feedback_queries,
                                failing=None if failing.lower() == "none" else failing,
                                failure_queries=failure_queries, rate_rps=rate, tolerance_ms=tolerance_ms, seed=seed)
        if seeds < 1:
            raise ValueError(f"seeds must be at least 1, got {seeds}")
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    reports = []
    for run_seed in range(seed, seed + seeds):
        report = run_race(replace(settings, seed=run_seed),
                          note=lambda stage: console.print(f"[dim]{stage}[/dim]"))
        console.print(race_table(report))
        console.print(model_table(report))
        if report["failure"] is not None:
            console.print(race_table(report, failure=True))
        for line in comparison_lines(report):
            console.print(line)
        reports.append(report)
    if seeds == 1:
        _write_json(reports[0], json_out)
        return
    summary = seeds_summary(reports)
    console.print(seeds_table(summary))
    # every answer of every run: compact, or it would be several times larger
    _write_json({"summary": summary, "runs": reports}, json_out, indent=None, separators=(",", ":"))


@bench_app.command("headlines")
def bench_headlines(
    write: Annotated[bool, typer.Option(help="render the tables afresh in place")] = False,
    root: Annotated[Path, typer.Option(help="the checkout whose pages hold the tables")] = Path("."),
) -> None:
    """The docs' tables of results (the README's headlines, docs/control.md's promises, docs/freeze.md's and
    docs/selection.md's figures), every figure read from the kept JSON of the run it quotes
    (rampserve/bench/headlines.py lists the tables); without --write, print them and say whether each page holds its
    table."""
    from rampserve.bench.headlines import RESULTS, SECTIONS

    for section in SECTIONS:
        path = root / section.page
        page, rendered = path.read_text(), section.render(root / RESULTS)
        if write:
            path.write_text(section.within(page, rendered))
            console.print(f"rendered the {section.name} table of {path}")
            continue
        console.print(rendered, markup=False, highlight=False, soft_wrap=True)
        held = section.within(page, rendered) == page
        console.print(f"{path} {'holds this table' if held else 'differs: run with --write'}")


@zoo_app.command("train")
def zoo_train(
    names: Annotated[Optional[list[str]], typer.Argument(help="zoo models (default: all)")] = None,
    small: Annotated[bool, typer.Option(help="the tiny test variants")] = False,
) -> None:
    """Train zoo models that are not cached yet."""
    from rampserve.zoo.train import train_zoo

    console.print_json(json.dumps(train_zoo(names or None, small=small)))


if __name__ == "__main__":
    app()
