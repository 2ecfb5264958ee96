"""`rampserve bench peers`: the same model, stream and open-loop trace against rampserve vanilla, rampserve with early
exits, Ray Serve (`@serve.batch`) and MLServer (a custom runtime with its adaptive batching), one after another, at
the same max batch and wait, through the same client process.

The client is `bench live`'s load generator with plain v2 JSON bodies (`"data"` lists) instead of Triton's
binary-data extension, which MLServer's REST server does not read: every system parses the same JSON. Every system
runs the bundle's torch model traced to TorchScript, the same kernels: rampserve as its executor compiles it by
default (rampserve vanilla and Ray Serve: the original model, no ramps), MLServer from a traced file (or, with
`mlserver_backend="onnx"`, exported to ONNX under ONNX Runtime: a different kernel library, not a different server)
in a venv of its own
(`.venv-mlserver`, created on first use from `rampserve/bench/mlserver/requirements.txt`: its fastapi/starlette pins
conflict with rampserve's). Every model runs with one intra-op thread. The request rate is `bench live`'s: half of
rampserve vanilla's closed-loop saturation throughput unless given. Each system's figures carry `bench live`'s keys
plus its ratios to rampserve vanilla.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
from rich.table import Table
from tqdm.auto import tqdm

from rampserve.bench.harness import (
    ServerProcess, encode_items, fmt, free_port, get_json, measure_saturation, rampserve_serve, ratio, renamed,
    run_loadgen,
)
from rampserve.bench.live import LiveSettings, plan_live, replay_schedule, score_systems, write_report
from rampserve.bench.loadgen import Job, LoadResult
from rampserve.runtime.prepared import PreparedModel

SYSTEMS = ("rampserve_vanilla", "rampserve", "ray_serve", "mlserver")
BASELINE = "rampserve_vanilla"
MLSERVER_DIR = Path(__file__).resolve().parent / "mlserver"
# MLServer turns adaptive batching off at max_batch_time 0; a microsecond takes whatever is queued without waiting
# for more, which is what a wait of 0 means to rampserve and Ray Serve.
MLSERVER_MIN_BATCH_TIME_S = 1e-6


def _default_mlserver_venv() -> Path:
    return Path(__file__).resolve().parents[2] / ".venv-mlserver"


@dataclass(frozen=True)
class PeerSettings:
    live: LiveSettings = LiveSettings()  # model, workload, trace, rate, duration, SLO, max batch and wait
    systems: tuple[str, ...] = SYSTEMS  # run in this order; rampserve_vanilla first (rate and ratios)
    mlserver_venv: Path = field(default_factory=_default_mlserver_venv)
    mlserver_backend: str = "torch"  # or "onnx"; an ONNX bundle is served as ONNX


# --- statistics (pure) ----------------------------------------------------------------------------------------

RATIO_KEYS = ("p50_ms", "p95_ms", "p99_ms", "throughput_rps", "saturation_rps")


def with_ratios(systems: dict[str, dict], baseline: str = BASELINE) -> dict[str, dict]:
    """Each system's p50/p95/p99 and throughput over the baseline's (None where either is missing or zero)."""
    base = systems[baseline]
    for summary in systems.values():
        summary["ratios"] = {key: ratio(summary[key], base[key]) for key in RATIO_KEYS}
    return systems


def goals(systems: dict[str, dict]) -> dict[str, bool | None]:
    """The issue's goals, reported as measured: rampserve vanilla's throughput at least each peer's (both the
    replay's, where every system below capacity answers at the offered rate, and the closed-loop saturation, which
    tells what each sustains) and its p50 at most each peer's; rampserve with early exits the lowest p50 of all
    (None: a system in question is missing)."""
    peers = [systems[name] for name in ("ray_serve", "mlserver") if name in systems]
    vanilla, exits = systems.get(BASELINE), systems.get("rampserve")
    p50s = [s["p50_ms"] for s in systems.values()]

    def every(test: Callable[[dict], bool]) -> bool | None:
        return None if vanilla is None or not peers else all(test(peer) for peer in peers)

    return {
        "vanilla_throughput_at_least_peers": every(lambda p: vanilla["throughput_rps"] >= p["throughput_rps"]),
        "vanilla_saturation_at_least_peers": every(lambda p: vanilla["saturation_rps"] >= p["saturation_rps"]),
        "vanilla_p50_at_most_peers": every(lambda p: _le(vanilla["p50_ms"], p["p50_ms"])),
        "rampserve_lowest_p50": None if exits is None or None in p50s else exits["p50_ms"] == min(p50s),
    }


def _served_as(kind: str, summary: dict | None) -> str:
    """How a rampserve server ran the model, from the status it left: TorchScript when its executor compiled it."""
    compiled = summary is not None and (summary["server"].get("status") or {}).get("compiled")
    return "TorchScript" if compiled and kind == "torch" else kind


def _le(value: float | None, other: float | None) -> bool:
    """value ≤ other, a missing latency (nothing answered) counting as infinitely slow."""
    return (np.inf if value is None else value) <= (np.inf if other is None else other)


PEER_COLUMNS = ("system", "sent", "shed", "failed", "p50 ms", "p95 ms", "p99 ms", "rps", "saturation rps",
                "accuracy", "exits", "p50 ×van", "p95 ×van", "p99 ×van", "rps ×van", "saturation ×van")


def peers_table(report: dict) -> Table:
    table = Table(title=f"{report['model']} on {report['workload']}, {report['trace']} trace at "
                        f"{report['rate_rps']:.0f} rps (vanilla saturation {fmt(report['saturation_rps'], '.0f')} "
                        f"rps), max batch {report['max_batch']}, max wait {report['max_delay_ms']:g} ms")
    for column in PEER_COLUMNS:
        table.add_column(column, justify="right")
    for name, s in report["systems"].items():
        table.add_row(name, str(s["requests"]), str(s["shed"]), str(s["failed"]),
                      *(fmt(s[f"p{q}_ms"], ".2f") for q in (50, 95, 99)), fmt(s["throughput_rps"], ".1f"),
                      fmt(s["saturation_rps"], ".1f"), fmt(s["accuracy"], ".4f"), fmt(s["exit_share"], ".1%"),
                      *(fmt(s["ratios"][key], ".2f") for key in RATIO_KEYS))
    return table


# --- peers' processes -------------------------------------------------------------------------------------------

def ensure_mlserver_venv(venv: Path, note: Callable[[str], None]) -> Path:
    """MLServer's venv's `mlserver` executable, (re)installing the pinned requirements when the venv was not made
    from the current requirements file (a copy kept in the venv says what it was made from)."""
    requirements = MLSERVER_DIR / "requirements.txt"
    stamp = venv / "rampserve-requirements.txt"
    if stamp.is_file() and stamp.read_text() == requirements.read_text():
        return venv / "bin" / "mlserver"
    note(f"installing MLServer into {venv} from {requirements}")
    if not (venv / "bin" / "python").is_file():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "-r", str(requirements)], check=True)
    shutil.copyfile(requirements, stamp)
    return venv / "bin" / "mlserver"


def export_torchscript(model: PreparedModel, example: dict[str, np.ndarray], path: Path) -> Path:
    """The bundle's original torch model traced to TorchScript (torch's kernels, loadable without rampserve)."""
    import torch

    with torch.no_grad():
        traced = torch.jit.trace(model.backend.module, tuple(torch.from_numpy(v) for v in example.values()))
    traced.save(str(path))
    return path


def export_onnx(model: PreparedModel, example: dict[str, np.ndarray], path: Path) -> Path:
    """The bundle's original model as ONNX with a dynamic batch axis (an ONNX bundle's own graph is copied)."""
    from rampserve.runtime.backends import OnnxBackend

    if isinstance(model.backend, OnnxBackend):
        return Path(shutil.copyfile(model.backend.path, path))
    import torch

    names = list(model.backend.input_names)
    with torch.inference_mode():
        torch.onnx.export(model.backend.module, tuple(torch.from_numpy(example[n]) for n in names), str(path),
                          input_names=names, output_names=["logits"], opset_version=17, dynamo=False,
                          dynamic_axes={**{n: {0: "batch"} for n in names}, "logits": {0: "batch"}})
    return path


def mlserver_repository(root: Path, model_name: str, model_path: Path, max_batch: int, max_delay_ms: float,
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
        "parameters": {"uri": str(model_path)}}))
    return root


# --- the benchmark ------------------------------------------------------------------------------------------------

def run_peers(settings: PeerSettings, json_out: Path | None, plots_dir: Path | None, progress: bool = True) -> dict:
    live = settings.live
    if settings.systems[0] != BASELINE:
        raise ValueError(f"{BASELINE} runs first: it sets the rate and the ratios")
    if settings.mlserver_backend not in ("torch", "onnx"):
        raise ValueError(f"mlserver_backend is torch or onnx, not {settings.mlserver_backend!r}")
    unknown = set(settings.systems) - set(SYSTEMS)
    if unknown:
        raise ValueError(f"unknown systems {sorted(unknown)}; known: {SYSTEMS}")
    note = tqdm.write if progress else (lambda _message: None)
    plan = plan_live(live)
    bundle, model, slo, max_batch = plan.bundle, plan.model, plan.slo_ms, plan.max_batch
    stream, first, probe_feeds = plan.stream, plan.first, plan.probe_feeds
    mlserver = ensure_mlserver_venv(settings.mlserver_venv, note) if "mlserver" in settings.systems else None
    mlserver_backend = "onnx" if model.backend.kind == "onnx" else settings.mlserver_backend

    results: dict[str, LoadResult] = {}
    servers: dict[str, dict] = {}
    saturations: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="rampserve-peers-") as tmp:
        workdir = Path(tmp)

        def start(name: str) -> ServerProcess:
            note(f"starting {name}")
            log = workdir / f"{name}-server.log"
            if name in (BASELINE, "rampserve"):
                return ServerProcess(rampserve_serve(live.model, slo, max_batch, live.max_delay_ms, name == BASELINE,
                                                     live.server_args), log, live.start_timeout_s)
            if name == "ray_serve":
                return ServerProcess(lambda port: [
                    sys.executable, "-m", "rampserve.bench.peers_ray", str(bundle), "--name", live.model,
                    "--port", str(port), "--max-batch", str(max_batch), "--wait-ms", f"{live.max_delay_ms:g}"],
                    log, live.start_timeout_s)
            model_path = (export_torchscript(model, probe_feeds[0], workdir / "model.pt") if mlserver_backend == "torch"
                          else export_onnx(model, probe_feeds[0], workdir / "model.onnx"))

            def command(port: int) -> list[str]:
                repository = mlserver_repository(workdir / "mlserver", live.model, model_path, max_batch,
                                                 live.max_delay_ms, (port, free_port(), free_port()))
                return [str(mlserver), "start", str(repository)]

            return ServerProcess(command, log, live.start_timeout_s)

        def job(srv: ServerProcess, rampserve_server: bool, **kwargs: object) -> Job:
            # JSON bodies for every system: MLServer does not take Triton's binary tensors
            return Job(srv.url(f"/v2/models/{live.model}/infer"), inputs, "label",
                       srv.url("/status") if rampserve_server else None, live.timeout_s, json_bodies=True, **kwargs)

        for name in settings.systems:
            with start(name) as server:
                rampserve_server = name in (BASELINE, "rampserve")
                if name == BASELINE:
                    metadata = get_json(server.url(f"/v2/models/{live.model}"))
                    inputs = tuple((i["name"], i["datatype"]) for i in metadata["inputs"])
                    probe = renamed(probe_feeds, [n for n, _ in inputs])
                    clients = live.saturation_clients or 2 * max_batch + 2
                # Every system's own closed-loop saturation: under the open-loop replay below capacity each one
                # answers at the offered rate, so only this compares what they sustain.
                note(f"{name} saturation: {clients} closed-loop clients for {live.saturation_s:g} s")
                saturations[name] = measure_saturation(
                    job(server, rampserve_server, clients=clients, duration_s=live.saturation_s, refused_pause_ms=slo),
                    probe, live, workdir, progress)
                note(f"{name} saturation: {saturations[name]['throughput_rps']:.0f} rps")
                if name == BASELINE:
                    saturation = saturations[name]
                    rate, n, warmup, arrivals, warmup_arrivals = replay_schedule(live, saturation["throughput_rps"], stream)
                    requests = renamed(encode_items(model, stream.task, stream.items(first, first + warmup + n)),
                                        [n for n, _ in inputs])
                    expected_s = float(arrivals[-1] + warmup_arrivals[-1]) / 1000.0
                    note(f"replaying {n} requests ({live.trace}, {rate:.0f} rps) after {warmup} warm-up requests "
                         "against each system")
                results[name] = run_loadgen(job(server, rampserve_server), requests, workdir, name, expected_s,
                                            progress, arrivals, warmup_arrivals)
            servers[name] = server.outcome()

    note("scoring the answers against the original model's")
    _, systems = score_systems(plan, live, results, servers, warmup, n)
    for name, summary in systems.items():
        summary["saturation_rps"] = saturations[name]["throughput_rps"]
        summary["saturation"] = saturations[name]
    systems = with_ratios(systems)
    report = {
        "model": live.model, "workload": live.workload, "trace": live.trace, "rate_rps": rate,
        "saturation_rps": saturation["throughput_rps"], "saturation": saturation, "slo_ms": slo,
        "max_batch": max_batch, "max_delay_ms": live.max_delay_ms, "requests": n, "warmup_requests": warmup,
        "duration_s": live.duration_s, "client": "v2 JSON bodies, one process (rampserve.bench.loadgen)",
        "backends": {BASELINE: _served_as(model.backend.kind, systems.get(BASELINE)),
                     "rampserve": f"{_served_as(model.backend.kind, systems.get('rampserve'))} with ramps",
                     "ray_serve": "TorchScript" if model.backend.kind == "torch" else model.backend.kind,
                     "mlserver": "TorchScript" if mlserver_backend == "torch" else "ONNX Runtime"},
        "systems": systems, "goals": goals(systems),
        "settings": asdict(settings) | {"mlserver_venv": str(settings.mlserver_venv)},
    }
    return write_report(report, results, json_out, plots_dir)
