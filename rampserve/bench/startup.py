"""`rampserve bench startup`: what starting a server costs. Each round starts `rampserve serve BUNDLE` afresh for
each model (the models' order rotating round by round) and measures the front end's process from the command's start
until `/v2/health/ready` answers 200 (its executor process started, its first set compiled or loaded, the sets the
controller may ask for next preloaded): that time, the front end's resident memory then and at its peak, the
executor's resident memory, and whether the front end mapped torch's or ONNX Runtime's libraries (it should not: it
serves bundles from their manifests). A zoo model's bundle is found (or prepared) once before the rounds, and one
start per model warms the compiled sets' cache and the page cache; neither is measured. Figures are medians over
rounds with their min-max.
"""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from rich.table import Table
from tqdm.auto import tqdm

from rampserve.bench.harness import ServerProcess, get_json, median_cell, write_json
from rampserve.bench.peers import over_rounds, round_orders

READY_POLL_S = 0.02  # how often readiness is asked for: the start time's resolution
LIBRARIES = {"torch": "/torch/", "onnxruntime": "/onnxruntime/"}  # where each library's native code lies
FIGURES = (("ready_s", ".2f"), ("front_end_rss_mib", ".0f"), ("front_end_peak_rss_mib", ".0f"),
           ("executor_rss_mib", ".0f"))  # the table's, after the model


@dataclass(frozen=True)
class StartupBenchSettings:
    models: tuple[str, ...] = ("resnet18-fmnist",)
    rounds: int = 5
    vanilla: bool = False  # the original model alone: no controller, no ramps' sets to compile or preload
    start_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.rounds < 1 or not self.models:
            raise ValueError("at least one round and one model")


def memory_mib(pid: int) -> dict[str, float]:
    """A process's resident memory now and at its peak (VmRSS, VmHWM), in MiB."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return {"rss_mib": int(fields["VmRSS"].split()[0]) / 1024, "peak_rss_mib": int(fields["VmHWM"].split()[0]) / 1024}


def mapped_libraries(pid: int) -> list[str]:
    """The libraries of LIBRARIES whose native code is mapped into the process: those it imported."""
    maps = Path(f"/proc/{pid}/maps").read_text()
    return [name for name, path in LIBRARIES.items() if path in maps]


def serve_command(bundle: Path, vanilla: bool) -> Callable[[int, int], list[str]]:
    """`rampserve serve` of the bundle as a user starts it, on the ports it is given."""
    return lambda port, grpc_port: [
        sys.executable, "-m", "rampserve.cli", "serve", str(bundle), "--host", "127.0.0.1", "--port", str(port),
        "--grpc-port", str(grpc_port), *(["--vanilla"] if vanilla else [])]


def start_once(bundle: Path, settings: StartupBenchSettings, log: Path) -> dict:
    """One start of the server for `bundle`: the figures of its front end (and executor) once ready."""
    with ServerProcess(serve_command(bundle, settings.vanilla), log, settings.start_timeout_s,
                       poll_s=READY_POLL_S) as server:
        front_end = memory_mib(server.process.pid)
        libraries = mapped_libraries(server.process.pid)
        executor = get_json(server.url("/status"))["models"][bundle.name]["executor"]
        executor_rss = memory_mib(executor["pid"])["rss_mib"] if executor["kind"] == "process" else None
    return {"ready_s": server.ready_s, "front_end_rss_mib": front_end["rss_mib"],
            "front_end_peak_rss_mib": front_end["peak_rss_mib"], "executor_rss_mib": executor_rss,
            "front_end_libraries": libraries}


def run_startup_bench(settings: StartupBenchSettings, json_out: Path | None, progress: bool = True) -> dict:
    from rampserve.runtime.zoo_bundles import zoo_bundle  # the bench's process prepares; the servers do not

    bundles = {model: zoo_bundle(model) for model in settings.models}
    rounds: dict[str, list[dict]] = {model: [] for model in settings.models}
    orders = round_orders(settings.models, settings.rounds)
    with tempfile.TemporaryDirectory(prefix="rampserve-startup-") as tmp, \
            tqdm(total=(settings.rounds + 1) * len(settings.models), desc="startup", unit="start",
                 disable=not progress) as bar:
        workdir = Path(tmp)
        for model in settings.models:  # warm-up: compiled sets on disk, files in the page cache
            start_once(bundles[model], settings, workdir / f"{model}-warmup.log")
            bar.update()
        for order in orders:
            for model in order:
                rounds[model].append(start_once(bundles[model], settings, workdir / f"{model}.log"))
                bar.update()
    systems = {}
    for model in settings.models:
        medians, spans = over_rounds(rounds[model])
        libraries = sorted({name for figures in rounds[model] for name in figures["front_end_libraries"]})
        systems[model] = medians | {"min_max": spans, "front_end_libraries": libraries, "rounds": rounds[model]}
    report = {"settings": asdict(settings), "orders": [list(o) for o in orders], "models": systems}
    write_json(report, json_out)
    return report


def startup_table(report: dict) -> Table:
    settings = report["settings"]
    table = Table(title=f"rampserve serve ({'vanilla' if settings['vanilla'] else 'early exits'}), start to ready: "
                        f"medians (min–max) over {settings['rounds']} rounds")
    table.add_column("model")
    for heading in ("ready (s)", "front end RSS (MiB)", "front end peak (MiB)", "executor RSS (MiB)",
                    "front end loaded"):
        table.add_column(heading, justify="right")
    for model, figures in report["models"].items():
        table.add_row(model, *(median_cell(figures, key, spec) for key, spec in FIGURES),
                      ", ".join(figures["front_end_libraries"]) or "neither torch nor ONNX Runtime")
    return table
