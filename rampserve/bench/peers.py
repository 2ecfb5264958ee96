"""`rampserve bench peers`: rampserve vanilla, rampserve with early exits, MLServer, Ray Serve, Triton, KServe and
LitServe serving the same model at the same max batch and wait, measured as perf_analyzer measures: in interleaved
rounds.

Every system runs the model on the engine the bundle serves on (`peers_engine`): a bundle served on ONNX Runtime is
run from its own ONNX file by every peer, on ONNX Runtime at the bundle's engine's threads with the idle spin
rampserve bounds; a bundle served on torch is traced to TorchScript, run with one intra-op thread as rampserve's
executor runs it. Each peer batches as it offers to: MLServer's adaptive batching, Ray Serve's `@serve.batch`,
Triton's dynamic batcher (through PyTriton, `triton/`: tritonserver hands each batch to the model in a Python process)
and LitServe's batching (`litserve/`); KServe's model server (`kserve/`) has no batcher of its own and runs each
request alone. Ray Serve's replica runs in rampserve's venv (`peers_ray`); the others run in venvs of their own, made
on first use from the pinned requirements files beside their code: MLServer's fastapi/starlette pins clash with
rampserve's, Triton's Python backend links Debian's own libpython3.11, and KServe and LitServe bring their own
servers' pins.

A round starts each system in turn, in an order rotated from round to round (so each system meets every phase of a
noisy machine, not one); each replays the same stream slice open loop at the same rate (after the same warm-up) and
then runs a concurrency sweep: closed loops of 1, 2, 4, 8 and 16 clients. Its saturation in that round is the most
it answered per second at a level whose p99 stayed within the SLO. Each system's figures are medians over rounds,
with their min and max; the goals compare medians. Requests carry Triton's binary tensors to the systems that read
them (rampserve, Triton, KServe) and plain v2 JSON to the rest (`transport`): LitServe has no v2 protocol, so its API
reads the v2 JSON body at LitServe's own route and answers the labels as v2 JSON does. With `transport="grpc"`,
KServe v2 over gRPC to every system that serves it (rampserve, Triton, MLServer, KServe; the Ray Serve peer has HTTP
only: Ray Serve's proxy speaks gRPC only to servicers registered with it, which this peer, a plain HTTP deployment,
has none of; LitServe serves HTTP only). The rate is `bench live`'s: the stated load (`bench sim`'s, default 0.2) of
rampserve vanilla's closed-loop saturation, probed before the rounds, unless given (the report's `load` is then
None). A system that cannot be installed or started keeps its key, with `error` saying why.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
from rich.table import Table
from tqdm.auto import tqdm

from rampserve.bench.harness import (
    ServerProcess,
    closed_loop_throughput,
    encode_items,
    fmt,
    free_port,
    measure_saturation,
    percentiles,
    rampserve_serve,
    ratio,
    require_answers,
    run_loadgen,
    v2_inputs,
)
from rampserve.bench.live import LiveSettings, plan_live, replay_schedule, score_run
from rampserve.bench.loadgen import Job, LoadResult
from rampserve.bench.peers_engine import PeerModel
from rampserve.bench.ramp_outputs import ramp_outputs
from rampserve.bench.results import write_result
from rampserve.graph.onnx_graph import ONNX_SPIN_US
from rampserve.runtime.backends import OnnxBackend
from rampserve.runtime.engines import engine_of
from rampserve.runtime.prepared import PreparedModel

BASELINE = "rampserve_vanilla"
EXITS = "rampserve"
PEERS = ("mlserver", "ray_serve", "triton", "kserve", "litserve")
SYSTEMS = (BASELINE, EXITS, *PEERS)
BINARY, JSON, GRPC = "binary", "json", "grpc"
# Triton's binary-data extension where the server reads it; MLServer's REST server does not, nor do the Ray Serve and
# LitServe peers (they read what MLServer reads, so that the JSON servers parse the same bodies)
TRANSPORTS = {BASELINE: BINARY, EXITS: BINARY, "triton": BINARY, "mlserver": JSON, "ray_serve": JSON,
              "kserve": BINARY, "litserve": JSON}
GRPC_SYSTEMS = (BASELINE, EXITS, "triton", "mlserver", "kserve")  # those that also serve KServe v2 over gRPC
SWEEP_CLIENTS = (1, 2, 4, 8, 16)
# A sweep level is within the SLO when its p99 is: at most this share of its requests may go unanswered (shed or
# failed), since an unanswered request is one later than any SLO
MAX_UNANSWERED_SHARE = 0.01
P99_GOAL = 1.1  # rampserve vanilla's median p99 at most this times the best peer's
EXITS_P50_GOAL = 0.6  # rampserve with exits: median p50 at most this times the best peer's
RATIO_KEYS = ("p50_ms", "p95_ms", "p99_ms", "throughput_rps", "saturation_rps")

BENCH_DIR = Path(__file__).resolve().parent
MLSERVER_DIR = BENCH_DIR / "mlserver"
TRITON_DIR = BENCH_DIR / "triton"
KSERVE_DIR = BENCH_DIR / "kserve"
LITSERVE_DIR = BENCH_DIR / "litserve"
LITSERVE_ROUTE = "/predict"  # LitServe's default route, where its API takes the JSON body
# Triton's Python-backend stub links this interpreter's libpython: a venv on another Python (pyenv's) fails to load
# the model
TRITON_PYTHON = Path("/usr/bin/python3.11")
# MLServer turns adaptive batching off at max_batch_time 0; a microsecond takes whatever is queued without waiting
# for more, which is what a wait of 0 means to rampserve and Ray Serve.
MLSERVER_MIN_BATCH_TIME_S = 1e-6


def _repository_root() -> Path:
    return BENCH_DIR.parents[1]


@dataclass(frozen=True)
class PeerSettings:
    # model, workload, trace, load (one) or rate, SLO, max batch and wait; `duration_s` is each round's replay, and
    # the saturation probe that sets the rate runs once, before the rounds
    live: LiveSettings = LiveSettings(duration_s=10.0, saturation_rounds=1)
    systems: tuple[str, ...] = SYSTEMS  # round 1's order; each later round starts one further along
    rounds: int = 5
    sweep_clients: tuple[int, ...] = SWEEP_CLIENTS
    sweep_s: float = 5.0  # each level of the sweep, each round ...
    sweep_settle_s: float = 1.0  # ... less its first part, while the clients start
    mlserver_venv: Path = field(default_factory=lambda: _repository_root() / ".venv-mlserver")
    triton_venv: Path = field(default_factory=lambda: _repository_root() / ".venv-triton")
    kserve_venv: Path = field(default_factory=lambda: _repository_root() / ".venv-kserve")
    litserve_venv: Path = field(default_factory=lambda: _repository_root() / ".venv-litserve")
    transport: str = "http"  # or "grpc": gRPC to the systems that serve it (GRPC_SYSTEMS), HTTP to the rest

    def __post_init__(self) -> None:
        unknown = set(self.systems) - set(SYSTEMS)
        if unknown:
            raise ValueError(f"unknown systems {sorted(unknown)}; known: {SYSTEMS}")
        if BASELINE not in self.systems or len(set(self.systems)) != len(self.systems):
            raise ValueError(f"systems name each system once, {BASELINE} among them (the ratios' base): "
                             f"{self.systems}")
        if len(self.live.loads) != 1:
            raise ValueError(f"the rounds replay at one load, got {self.live.loads}")
        if self.rounds < 1:
            raise ValueError(f"at least one round, got {self.rounds}")
        if not self.sweep_clients or min(self.sweep_clients) < 1:
            raise ValueError(f"the sweep needs levels of at least one client, got {self.sweep_clients}")
        if self.sweep_s <= self.sweep_settle_s:
            raise ValueError(f"a sweep level ({self.sweep_s} s) must outlast its settling ({self.sweep_settle_s} s)")
        if self.transport not in ("http", GRPC):
            raise ValueError(f"transport is http or grpc, not {self.transport!r}")


# --- statistics (pure) ----------------------------------------------------------------------------------------

def transport_of(name: str, transport: str) -> str:
    """What the client speaks to a system: gRPC where asked and served, else its HTTP encoding (TRANSPORTS)."""
    return GRPC if transport == GRPC and name in GRPC_SYSTEMS else TRANSPORTS[name]


def round_orders(systems: Sequence[str], rounds: int) -> list[tuple[str, ...]]:
    """Each round's order: round r starts r systems further along, so over len(systems) rounds every system runs
    once in every position."""
    n = len(systems)
    return [tuple(systems[(r + i) % n] for i in range(n)) for r in range(rounds)]


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def over_rounds(rounds: Sequence[dict]) -> tuple[dict[str, float | None], dict[str, list[float] | None]]:
    """(median, [min, max]) over the rounds of every figure that is a number or None (a latency of a round that
    answered nothing), each over the rounds where it is a number; None where no round has a number."""
    keys = list(dict.fromkeys(key for figures in rounds for key, value in figures.items()
                              if value is None or _is_number(value)))
    medians: dict[str, float | None] = {}
    spans: dict[str, list[float] | None] = {}
    for key in keys:
        values = [figures[key] for figures in rounds if _is_number(figures.get(key))]
        medians[key] = float(np.median(values)) if values else None
        spans[key] = [float(min(values)), float(max(values))] if values else None
    return medians, spans


def sweep_point(result: LoadResult, clients: int, settle_ms: float, end_ms: float) -> dict:
    """One closed-loop level of a sweep: answers per second completed between settling and the end, and the latency
    of the requests issued once every client ran (the clients start together, so queues need a moment to form)."""
    counted = result.scheduled_ms >= settle_ms
    ok = result.ok & counted
    return {"clients": clients, "requests": int(counted.sum()), "answered": int(ok.sum()),
            "shed": int((result.shed & counted).sum()), "failed": int((result.failed & counted).sum()),
            "throughput_rps": closed_loop_throughput(result, settle_ms, end_ms),
            **percentiles(result.latency_ms[ok])}


def within_slo(point: dict, slo_ms: float) -> bool:
    """The level's p99 is within the SLO and at most MAX_UNANSWERED_SHARE of its requests went unanswered."""
    unanswered = point["shed"] + point["failed"]
    return (point["p99_ms"] is not None and point["p99_ms"] <= slo_ms
            and unanswered <= MAX_UNANSWERED_SHARE * point["requests"])


def saturation_from_sweep(points: Sequence[dict], slo_ms: float) -> float:
    """The most answers per second at a level within the SLO (`within_slo`); 0 when no level was."""
    return max((p["throughput_rps"] for p in points if within_slo(p, slo_ms)), default=0.0)


def sweep_over_rounds(sweeps: Sequence[Sequence[dict]]) -> list[dict]:
    """Each concurrency level's median figures over the rounds, with their [min, max] (`min_max`)."""
    levels = sorted({p["clients"] for sweep in sweeps for p in sweep})
    curve = []
    for clients in levels:
        medians, spans = over_rounds([p for sweep in sweeps for p in sweep if p["clients"] == clients])
        curve.append(medians | {"clients": clients, "min_max": spans})
    return curve


def system_summary(name: str, rounds: list[dict], transport: str | None = None) -> dict:
    """A system's figures: the medians over its measured rounds under today's keys (`p50_ms`, `saturation_rps`, …),
    their `min_max`, every round (`rounds`), the median sweep (`sweep`) and its `transport`; `error` when no round
    was measured."""
    measured = [r for r in rounds if "error" not in r]
    base = {"transport": transport or TRANSPORTS[name], "rounds_measured": len(measured), "rounds": rounds}
    if not measured:
        why = rounds[-1]["error"] if rounds else "not run"
        return base | {"error": f"no round was measured; the last said: {why}"}
    medians, spans = over_rounds([r["figures"] for r in measured])
    return medians | base | {"min_max": spans, "sweep": sweep_over_rounds([r["sweep"] for r in measured])}


def with_ratios(systems: dict[str, dict], baseline: str = BASELINE) -> dict[str, dict]:
    """Each measured system's median p50/p95/p99, throughput and saturation over the baseline's (None where either
    is missing or zero)."""
    base = systems.get(baseline, {})
    for summary in systems.values():
        if "error" not in summary:
            summary["ratios"] = {key: ratio(summary.get(key), base.get(key)) for key in RATIO_KEYS}
    return systems


def _latency(value: float | None) -> float:
    """A missing latency (nothing answered) counts as infinitely slow."""
    return np.inf if value is None else value


def goals(systems: dict[str, dict]) -> dict[str, object]:
    """Issue 15's goals on the medians over rounds, as measured, against the peers that were measured
    (`peers_compared`): rampserve vanilla's p50 at most every peer's, its p99 at most P99_GOAL times the best peer's
    and its saturation at least every peer's; rampserve with exits' p50 at most EXITS_P50_GOAL times the best
    peer's. None: a system in question was not measured, or (saturation) no system compared had a sweep level within
    the SLO, so that every saturation is 0 and comparing them says nothing."""
    measured = {name: s for name, s in systems.items() if "error" not in s}
    peers = {name: measured[name] for name in PEERS if name in measured}
    vanilla, exits = measured.get(BASELINE), measured.get(EXITS)
    best_p50 = min((_latency(p.get("p50_ms")) for p in peers.values()), default=None)
    best_p99 = min((_latency(p.get("p99_ms")) for p in peers.values()), default=None)
    against_vanilla = vanilla is not None and bool(peers)
    saturations = against_vanilla and any(s["saturation_rps"] > 0 for s in (vanilla, *peers.values()))
    return {
        "peers_compared": list(peers),
        "vanilla_p50_at_most_every_peer": all(_latency(vanilla["p50_ms"]) <= _latency(p["p50_ms"])
                                              for p in peers.values()) if against_vanilla else None,
        f"vanilla_p99_at_most_{P99_GOAL:g}x_best_peer": bool(_latency(vanilla["p99_ms"]) <= P99_GOAL * best_p99)
        if against_vanilla else None,
        "vanilla_saturation_at_least_every_peer": all(vanilla["saturation_rps"] >= p["saturation_rps"]
                                                      for p in peers.values()) if saturations else None,
        f"exits_p50_at_most_{EXITS_P50_GOAL:g}x_best_peer": bool(_latency(exits["p50_ms"]) <= EXITS_P50_GOAL * best_p50)
        if exits is not None and peers else None,
    }


def input_specs(feeds: Sequence[dict[str, np.ndarray]]) -> list[tuple[str, str, list[int]]]:
    """Triton's declaration of each model input: (name, numpy dtype, the shape of one input without the batch axis,
    -1 where the requests' shapes differ: text padded to each request's own length)."""
    specs = []
    for name, array in feeds[0].items():
        shapes = np.array([feed[name].shape[1:] for feed in feeds])
        fixed = (shapes == shapes[0]).all(axis=0)
        specs.append((name, array.dtype.name, [int(d) if keep else -1 for d, keep in zip(shapes[0], fixed)]))
    return specs


# --- the table ----------------------------------------------------------------------------------------------------

def _median_range(summary: dict, key: str, spec: str) -> str:
    """'median (min–max)' over the measured rounds."""
    span = summary["min_max"].get(key)
    spread = "" if span is None or summary["rounds_measured"] < 2 else f" ({span[0]:{spec}}–{span[1]:{spec}})"
    return fmt(summary.get(key), spec) + spread


# (row, what each measured system shows in it)
PEER_ROWS: tuple[tuple[str, Callable[[dict], str]], ...] = (
    ("transport", lambda s: s["transport"]),
    ("rounds measured", lambda s: f"{s['rounds_measured']}/{len(s['rounds'])}"),
    ("replay p50 ms", lambda s: _median_range(s, "p50_ms", ".2f")),
    ("replay p99 ms", lambda s: _median_range(s, "p99_ms", ".2f")),
    ("replay rps", lambda s: _median_range(s, "throughput_rps", ".0f")),
    ("saturation rps", lambda s: _median_range(s, "saturation_rps", ".0f")),
    ("sweep max rps", lambda s: _median_range(s, "sweep_max_rps", ".0f")),
    ("accuracy", lambda s: fmt(s.get("accuracy"), ".4f")),
    ("exits", lambda s: fmt(s.get("exit_share"), ".1%")),
    ("p50 ×vanilla", lambda s: fmt(s["ratios"]["p50_ms"], ".2f")),
    ("p99 ×vanilla", lambda s: fmt(s["ratios"]["p99_ms"], ".2f")),
    ("saturation ×vanilla", lambda s: fmt(s["ratios"]["saturation_rps"], ".2f")),
)


def peers_table(report: dict) -> Table:
    """One column per system, one row per figure (the figures outnumber the systems, and a terminal's width): medians
    over rounds with their min–max; a system that was not measured says so in every row."""
    table = Table(title=f"{report['model']} on {report['workload']}: medians (min–max) over {report['rounds']} "
                        f"rounds; {report['trace']} replay at {report['rate_rps']:.0f} rps (load "
                        f"{fmt(report['load'], 'g')}), sweep of "
                        f"{'/'.join(map(str, report['sweep_clients']))} clients, SLO {report['slo_ms']:.2f} ms, "
                        f"max batch {report['max_batch']}, max wait {report['max_delay_ms']:g} ms")
    systems = report["systems"]
    table.add_column("")
    for name in systems:
        table.add_column(name, justify="right")
    for label, cell in PEER_ROWS:
        table.add_row(label, *(cell(s) if "error" not in s or label == "transport" else "[red]error[/red]"
                               for s in systems.values()))
    return table


def peers_notes(report: dict) -> list[str]:
    """What the table cannot show: why a system was not measured, and which systems had no sweep level within the
    SLO (saturation 0)."""
    systems = report["systems"]
    notes = [f"{name} was not measured: {s['error']}" for name, s in systems.items() if "error" in s]
    never = [name for name, s in systems.items() if "error" not in s and not s["saturation_rps"]]
    if never:
        notes.append(f"no sweep level of {', '.join(never)} kept p99 within the SLO ({report['slo_ms']:.2f} ms) in "
                     "at least half the rounds: median saturation 0 (a looser --slo-ms compares what they sustain)")
    return notes


# --- peers' installations and commands ----------------------------------------------------------------------------

def ensure_venv(venv: Path, requirements: Path, python: Path, note: Callable[[str], None]) -> Path:
    """The venv's bin folder, (re)installing the pinned requirements with `python` when the venv was not made from
    the current requirements file (a copy kept in the venv says what it was made from)."""
    stamp = venv / "rampserve-requirements.txt"
    if stamp.is_file() and stamp.read_text() == requirements.read_text():
        return venv / "bin"
    if not python.is_file():
        raise RuntimeError(f"{python} is needed to make {venv}")
    note(f"installing {requirements} into {venv} (once)")
    if not (venv / "bin" / "python").is_file():
        subprocess.run([str(python), "-m", "venv", str(venv)], check=True)
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "-r", str(requirements)], check=True)
    shutil.copyfile(requirements, stamp)
    return venv / "bin"


def export_torchscript(model: PreparedModel, example: dict[str, np.ndarray], path: Path) -> Path:
    """The bundle's original torch model traced to TorchScript (torch's kernels, loadable without rampserve)."""
    import torch

    with torch.no_grad():
        traced = torch.jit.trace(model.backend.module, tuple(torch.from_numpy(v) for v in example.values()))
    traced.save(str(path))
    return path


def peer_model(model: PreparedModel, example: dict[str, np.ndarray], workdir: Path) -> PeerModel:
    """What every peer runs: the bundle's own ONNX file at its engine's threads and rampserve's idle spin, where
    the bundle serves on ONNX Runtime; else its torch model traced into `workdir`, run with one thread."""
    if isinstance(model.backend, OnnxBackend):
        engine = engine_of(model.meta, model.backend.kind)
        return PeerModel(str(model.backend.path), tuple(model.backend.input_names), engine.intra_op_threads,
                         ONNX_SPIN_US)
    traced = export_torchscript(model, example, workdir / "model.pt")
    return PeerModel(str(traced), tuple(example), 1, ONNX_SPIN_US)


def in_peer_venv(command: Callable[[int, int], list[str]]) -> Callable[[int, int], list[str]]:
    """A peer's command, with the repository on its path for `peers_engine` alone (its venv lacks rampserve)."""
    return lambda port, grpc_port: ["env", f"PYTHONPATH={_repository_root()}", *command(port, grpc_port)]


def mlserver_repository(root: Path, model_name: str, model: PeerModel, max_batch: int, max_delay_ms: float,
                        ports: tuple[int, int, int]) -> Path:
    """A model repository for `mlserver start`: server settings (loopback, the given HTTP, gRPC and metrics ports)
    and one model folder with the custom runtime and adaptive batching at rampserve's max batch and wait."""
    http_port, grpc_port, metrics_port = ports
    root.mkdir(parents=True, exist_ok=True)
    (root / "settings.json").write_text(json.dumps({
        "host": "127.0.0.1", "http_port": http_port, "grpc_port": grpc_port, "metrics_port": metrics_port,
        "metrics_dir": str(root / ".metrics"), "debug": False}))
    folder = root / model_name
    folder.mkdir(exist_ok=True)
    shutil.copyfile(MLSERVER_DIR / "runtime.py", folder / "runtime.py")
    (folder / "model-settings.json").write_text(json.dumps({
        "name": model_name, "implementation": "runtime.Labels", "max_batch_size": max_batch,
        "max_batch_time": max(max_delay_ms / 1000.0, MLSERVER_MIN_BATCH_TIME_S),
        "parameters": {"extra": {"peer_model": model.to_json()}}}))
    return root


@dataclass(frozen=True)
class PeerLaunch:
    """What a peer's server is started with."""

    model: PeerModel
    model_name: str
    max_batch: int
    max_delay_ms: float
    inputs: list[tuple[str, str, list[int]]]  # `input_specs`: what Triton declares
    workdir: Path  # the server's log and files
    start_timeout_s: float
    venv_bin: Path | None = None  # its venv's bin folder; None for Ray Serve, which runs in rampserve's venv


def peer_server(name: str, launch: PeerLaunch) -> ServerProcess:
    """A peer's server, on loopback ports (KServe's on every interface: it has no setting for the address), to be
    started by entering it: Ray Serve's replica (`peers_ray`), or a server in the peer's own venv."""
    log, timeout = launch.workdir / f"{name}-server.log", launch.start_timeout_s
    model, model_name = launch.model.to_json(), launch.model_name
    batching = ["--max-batch", str(launch.max_batch), "--wait-ms", f"{launch.max_delay_ms:g}"]
    if name == "ray_serve":
        return ServerProcess(lambda port, _grpc_port: [
            sys.executable, "-m", "rampserve.bench.peers_ray", model, "--name", model_name, "--port", str(port),
            *batching], log, timeout)
    if launch.venv_bin is None:
        raise ValueError(f"{name} runs in a venv of its own, and none was given")
    python = str(launch.venv_bin / "python")
    if name == "triton":
        # Triton answers /v2/health/ready before its model is loaded; SIGTERM would leave tritonserver behind
        return ServerProcess(in_peer_venv(lambda port, grpc_port: [
            python, str(TRITON_DIR / "server.py"), model, "--name", model_name, "--inputs", json.dumps(launch.inputs),
            "--http-port", str(port), "--grpc-port", str(grpc_port), "--metrics-port", str(free_port()), *batching]),
            log, timeout, ready_path=f"/v2/models/{model_name}/ready", stop_signal=signal.SIGINT)
    if name == "kserve":
        return ServerProcess(in_peer_venv(lambda port, grpc_port: [
            python, str(KSERVE_DIR / "server.py"), model, "--name", model_name, "--http-port", str(port),
            "--grpc-port", str(grpc_port)]), log, timeout)
    if name == "litserve":
        # LitServe's /health answers 200 once its inference worker is up; it shuts down on SIGINT
        return ServerProcess(in_peer_venv(lambda port, _grpc_port: [
            python, str(LITSERVE_DIR / "server.py"), model, "--name", model_name, "--port", str(port), *batching]),
            log, timeout, ready_path="/health", stop_signal=signal.SIGINT)
    if name == "mlserver":
        def mlserver(port: int, grpc_port: int) -> list[str]:
            repository = mlserver_repository(launch.workdir / "mlserver", model_name, launch.model, launch.max_batch,
                                             launch.max_delay_ms, (port, grpc_port, free_port()))
            return [str(launch.venv_bin / "mlserver"), "start", str(repository)]

        return ServerProcess(in_peer_venv(mlserver), log, timeout)
    raise ValueError(f"{name} is not a peer; the peers are {PEERS}")


def infer_url(srv: ServerProcess, name: str, model_name: str, transport: str) -> str:
    """Where the client sends a system's requests: LitServe's route, else the v2 infer endpoint over the transport
    the system is spoken to in (`transport_of`)."""
    if name == "litserve":
        return srv.url(LITSERVE_ROUTE)
    return srv.infer_url(model_name, "grpc" if transport_of(name, transport) == GRPC else "http")


# --- the benchmark ------------------------------------------------------------------------------------------------

def run_peers(settings: PeerSettings, json_out: Path | None, plots_dir: Path | None, progress: bool = True) -> dict:
    live = settings.live
    note = tqdm.write if progress else (lambda _message: None)
    plan = plan_live(live)
    model, slo, max_batch = plan.model, plan.slo_ms, plan.max_batch
    inputs = v2_inputs(plan.probe_feeds[0])

    # A peer that cannot be installed is measured in no round; the rest go on without it
    install_errors: dict[str, str] = {}
    venv_bins: dict[str, Path] = {}
    for name, venv, folder, python in (
            ("mlserver", settings.mlserver_venv, MLSERVER_DIR, Path(sys.executable)),
            ("triton", settings.triton_venv, TRITON_DIR, TRITON_PYTHON),
            ("kserve", settings.kserve_venv, KSERVE_DIR, Path(sys.executable)),
            ("litserve", settings.litserve_venv, LITSERVE_DIR, Path(sys.executable))):
        if name in settings.systems:
            try:
                venv_bins[name] = ensure_venv(venv, folder / "requirements.txt", python, note)
            except (OSError, RuntimeError, subprocess.CalledProcessError) as exc:
                install_errors[name] = f"installing {name}: {exc}"
                note(install_errors[name])

    with tempfile.TemporaryDirectory(prefix="rampserve-peers-") as tmp:
        workdir = Path(tmp)
        served = peer_model(model, plan.probe_feeds[0], workdir)

        def server(name: str) -> ServerProcess:
            if name in (BASELINE, EXITS):
                return ServerProcess(rampserve_serve(live.model, slo, max_batch, live.max_delay_ms, name == BASELINE,
                                                     live.server_args), workdir / f"{name}-server.log",
                                     live.start_timeout_s)
            return peer_server(name, PeerLaunch(served, live.model, max_batch, live.max_delay_ms,
                                                input_specs(plan.probe_feeds), workdir, live.start_timeout_s,
                                                venv_bins.get(name)))

        def job(srv: ServerProcess, name: str, **kwargs: object) -> Job:
            status = srv.url("/status") if name in (BASELINE, EXITS) else None
            return Job(infer_url(srv, name, live.model, settings.transport), inputs, "label", status, live.timeout_s,
                       json_bodies=transport_of(name, settings.transport) == JSON, **kwargs)

        calibration = None
        if live.rate_rps is None:
            clients = live.saturation_clients or 2 * max_batch + 2
            note(f"calibrating the rate: {BASELINE}'s saturation, {clients} closed-loop clients for "
                 f"{live.saturation_s:g} s")
            with server(BASELINE) as vanilla:
                calibration = measure_saturation(job(vanilla, BASELINE, clients=clients, duration_s=live.saturation_s,
                                                     refused_pause_ms=slo), plan.probe_feeds, live.model,
                                                 live.saturation_rounds, live.saturation_settle_s, workdir, progress)
        schedule = replay_schedule(live, live.loads[0], None if calibration is None else calibration["throughput_rps"],
                                   plan.stream)
        rate, n, warmup = schedule.rate_rps, schedule.requests, schedule.warmup_requests
        arrivals, warmup_arrivals, expected_s = schedule.arrivals_ms, schedule.warmup_arrivals_ms, schedule.expected_s
        requests = encode_items(model, plan.stream.task, plan.stream.items(plan.first, plan.first + warmup + n))
        reference = ramp_outputs(model, plan.bundle, plan.stream, plan.first + warmup, plan.first + warmup + n).final

        def measure(name: str, label: str) -> dict:
            """One round of one system: the replay, then the sweep."""
            with server(name) as srv:
                replayed = run_loadgen(job(srv, name), requests, workdir, f"{label} replay", expected_s, progress,
                                       arrivals, warmup_arrivals)
                sweep = []
                for clients in settings.sweep_clients:
                    result = run_loadgen(job(srv, name, clients=clients, duration_s=settings.sweep_s,
                                             refused_pause_ms=slo), plan.probe_feeds, workdir,
                                         f"{label} {clients} clients", settings.sweep_s, progress)
                    sweep.append(sweep_point(result, clients, settings.sweep_settle_s * 1000.0,
                                             settings.sweep_s * 1000.0))
            figures = score_run(live, require_answers(replayed, f"{label} replay"), reference, srv.outcome())
            figures |= {"saturation_rps": saturation_from_sweep(sweep, slo),
                        "sweep_max_rps": max(p["throughput_rps"] for p in sweep)}
            return {"figures": figures, "sweep": sweep}

        orders = round_orders([s for s in settings.systems if s not in install_errors], settings.rounds)
        rounds: dict[str, list[dict]] = {name: [] for name in settings.systems}
        note(f"{settings.rounds} rounds at {rate:.0f} rps: {n} requests after {warmup} warm-up ones, then "
             f"{len(settings.sweep_clients)} closed loops of {settings.sweep_s:g} s per system")
        with tqdm(total=sum(map(len, orders)), desc="peers", unit="run", disable=not progress) as bar:
            for index, order in enumerate(orders):
                for position, name in enumerate(order):
                    bar.set_postfix_str(f"round {index + 1}: {name}")
                    entry = {"round": index + 1, "position": position + 1}
                    try:
                        entry |= measure(name, f"r{index + 1} {name}")
                    except (OSError, RuntimeError, ValueError, KeyError) as exc:  # the others are measured without it
                        entry["error"] = f"{type(exc).__name__}: {str(exc)[-2000:]}"
                        note(f"round {index + 1}, {name}: {entry['error'][:300]}")
                    rounds[name].append(entry)
                    bar.update()

    systems = {name: system_summary(name, rounds[name], transport_of(name, settings.transport))
               for name in settings.systems}
    for name, why in install_errors.items():
        systems[name]["error"] = why
    systems = with_ratios(systems)
    report = {
        "model": live.model, "workload": live.workload, "trace": live.trace, "load": schedule.load, "rate_rps": rate,
        "slo_ms": slo, "max_batch": max_batch, "max_delay_ms": live.max_delay_ms, "requests": n,
        "warmup_requests": warmup, "duration_s": live.duration_s, "rounds": settings.rounds, "orders": [list(order) for order in orders],
        "sweep_clients": list(settings.sweep_clients), "sweep_s": settings.sweep_s,
        "sweep_settle_s": settings.sweep_settle_s, "calibration": calibration,
        "client": "one process per run (rampserve.bench.loadgen): binary tensors, v2 JSON or gRPC, per system's "
                  "transport",
        "engine": asdict(served) | {"engine": served.engine, "bundle_engine": engine_of(model.meta,
                                                                                      model.backend.kind).name},
        "backends": {BASELINE: f"rampserve serve --vanilla ({model.backend.kind}; on torch its executor compiles to "
                                "TorchScript where it can: /status `compiled` in each round)",
                     EXITS: f"rampserve serve ({model.backend.kind} with ramps; compiled sets where they compile)",
                     "mlserver": f"{served.engine} in a custom runtime, behind MLServer's adaptive batching",
                     "ray_serve": f"{served.engine} behind @serve.batch",
                     "triton": f"{served.engine} in PyTriton's Python process, behind tritonserver's dynamic batcher",
                     "kserve": f"{served.engine} in a kserve.Model, one request at a time (KServe's model server has "
                               "no batcher)",
                     "litserve": f"{served.engine} in a LitAPI, behind LitServe's batching; v2 JSON bodies at "
                                 f"{LITSERVE_ROUTE} (LitServe has no v2 protocol)"},
        "systems": systems, "goals": goals(systems),
        "settings": {key: str(value) if isinstance(value, Path) else value
                     for key, value in asdict(settings).items()},
    }
    if plots_dir is not None:
        from rampserve.bench.peers_plots import write_peer_plots

        report["plots"] = [str(p) for p in write_peer_plots(report, plots_dir)]
    write_result(report, json_out)
    return report
