"""`rampserve bench startup`: what starting a server costs. Each round starts `rampserve serve BUNDLE` afresh for
each model (the models' order rotating round by round) and measures the front end's process from the command's start
until `/v2/health/ready` answers 200 (its executor process started, its first set compiled or loaded, the sets the
controller may ask for next preloaded): that time, the front end's resident memory then and at its peak, the
executor's resident memory, and whether the front end mapped torch's or ONNX Runtime's libraries (it should not: it
serves bundles from their manifests). A zoo model's bundle is found (or prepared) once before the rounds, and one
start per model warms the compiled sets' cache and the page cache; neither is measured. Figures are medians over
rounds with their min-max.

With `--restart`, each round then kills the model's executor process (SIGKILL) twice, idle and under a closed loop
of clients (the load generator's, which resend at once when refused), and times each from the kill until
`/v2/models/{m}/ready` answers 200 again (it answers 503 while the executor restarts), with the phases of the new
executor's start as it logged and reported them (`serving.executor.StartLog`). Each kill comes `QUICK_DEATH_S` after
the executor became ready, so that no restart waits as a crash loop's would.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from rich.table import Table
from tqdm.auto import tqdm

from rampserve.bench.harness import ServerProcess, get_json, http_status, median_cell, v2_inputs
from rampserve.bench.loadgen import Job, save_job
from rampserve.bench.peers import over_rounds, round_orders
from rampserve.bench.results import write_result
from rampserve.serving.executor.loading import read_served
from rampserve.serving.executor.process_worker import QUICK_DEATH_S
from rampserve.serving.shared.models import LABEL_OUTPUT

READY_POLL_S = 0.02  # how often readiness is asked for: the start time's resolution
LIBRARIES = {"torch": "/torch/", "onnxruntime": "/onnxruntime/"}  # where each library's native code lies
FIGURES = (("ready_s", ".2f"), ("front_end_rss_mib", ".0f"), ("front_end_peak_rss_mib", ".0f"),
           ("executor_rss_mib", ".0f"))  # the table's, after the model
# A restart's phases as the new executor reports them (the end of each, from its spawn), each shown as its own
# duration; then the rest of the time from the kill: the front end's (the death seen, the process reaped and started;
# READY read) and the bench's readiness polling
RESTART_PHASES = (("process started", "interpreter"), ("imports done", "imports"), ("bundle loaded", "bundle"),
                  ("sets loaded", "sets"), ("ready", "ready"))
RESTART_ROWS = (("kill → ready again", "serving_s"), ("  interpreter started", "interpreter_s"),
                ("  imports (torch, ONNX Runtime, …)", "imports_s"), ("  bundle loaded", "bundle_s"),
                ("  compiled sets loaded", "sets_s"), ("  ready (gc freeze, READY sent)", "ready_s"),
                ("  front end and polling", "front_end_s"))
LOAD_SETTLE_REQUESTS = 200  # requests the server answers under load before the kill
LOAD_LIMIT_S = 600.0  # the load generator's duration: it is stopped once the restart is timed
RESTART_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class StartupBenchSettings:
    models: tuple[str, ...] = ("resnet18-fmnist",)
    rounds: int = 5
    vanilla: bool = False  # the original model alone: no controller, no ramps' sets to compile or preload
    start_timeout_s: float = 600.0
    restart: bool = False  # also time an executor's restart after a SIGKILL, idle and under load
    restart_clients: int = 8  # the closed loop the second kill comes under

    def __post_init__(self) -> None:
        if self.rounds < 1 or not self.models:
            raise ValueError("at least one round and one model")
        if self.restart_clients < 1:
            raise ValueError("the load a restart comes under needs a client at least")


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
    """One start of the server for `bundle`: the figures of its front end (and executor) once ready; with
    `settings.restart`, then its executor's restarts (`restart_once`), idle and under load."""
    with ServerProcess(serve_command(bundle, settings.vanilla), log, settings.start_timeout_s,
                       poll_s=READY_POLL_S) as server:
        front_end = memory_mib(server.process.pid)
        libraries = mapped_libraries(server.process.pid)
        executor = get_json(server.url("/status"))["models"][bundle.name]["executor"]
        executor_rss = memory_mib(executor["pid"])["rss_mib"] if executor["kind"] == "process" else None
        restarts = {}
        if settings.restart:
            idle, ready_at = restart_once(server, bundle.name, time.monotonic())
            with closed_loop(server, bundle, settings.restart_clients, log.with_suffix(".load")):
                loaded, _ = restart_once(server, bundle.name, ready_at)
            restarts = {f"restart_{key}": value for key, value in idle.items()} | \
                {f"restart_loaded_{key}": value for key, value in loaded.items()}
    return {"ready_s": server.ready_s, "front_end_rss_mib": front_end["rss_mib"],
            "front_end_peak_rss_mib": front_end["peak_rss_mib"], "executor_rss_mib": executor_rss,
            "front_end_libraries": libraries, **restarts}


def restart_once(server: ServerProcess, model: str, ready_at: float) -> tuple[dict, float]:
    """SIGKILL the model's executor (`QUICK_DEATH_S` after it became ready, at `ready_at`) and time it until the model
    is ready again: from the kill (seconds, `serving_s`), and each phase of the new executor's start as it reported
    it, with the rest (the front end's and the polling's); and when it was ready again."""
    time.sleep(max(0.0, ready_at + QUICK_DEATH_S - time.monotonic()))
    ready_url = server.url(f"/v2/models/{model}/ready")
    pid = get_json(server.url(f"/status/{model}"))["executor"]["pid"]
    killed = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    seen_down = False  # the front end may answer once more before it has read of the death
    while (code := http_status(ready_url)) != 200 or not seen_down:
        seen_down = seen_down or code != 200
        if time.monotonic() - killed > RESTART_TIMEOUT_S:
            raise RuntimeError(f"model {model} was not ready again within {RESTART_TIMEOUT_S:.0f} s of its "
                               "executor's kill")
        time.sleep(READY_POLL_S)
    ready_again = time.monotonic()
    serving_s = ready_again - killed
    phases = get_json(server.url(f"/status/{model}"))["executor"]["last_start"]["phases"]
    ends = [phases[phase] for phase, _ in RESTART_PHASES]
    took = {f"{name}_s": end - before for (_, name), end, before in zip(RESTART_PHASES, ends, [0.0, *ends])}
    return {"serving_s": serving_s, **took, "front_end_s": serving_s - ends[-1]}, ready_again


@contextlib.contextmanager
def closed_loop(server: ServerProcess, bundle: Path, clients: int, workdir: Path) -> Iterator[None]:
    """The load generator's closed loop of `clients` on the model, one input per request from its bundle's example
    inputs, from once the server has answered LOAD_SETTLE_REQUESTS of them until the block ends."""
    example = read_served(bundle, bundle.name).example
    requests = [{name: values[i:i + 1] for name, values in example.items()} for i in range(len(next(iter(
        example.values()))))]
    job = Job(server.url(f"/v2/models/{bundle.name}/infer"), v2_inputs(requests[0]), LABEL_OUTPUT, None,
              clients=clients, duration_s=LOAD_LIMIT_S)
    workdir.mkdir(exist_ok=True)
    save_job(workdir / "job.npz", job, requests)
    status_url = server.url(f"/status/{bundle.name}")
    before = get_json(status_url)["requests"]
    with (workdir / "loadgen.log").open("wb") as log:
        process = subprocess.Popen([sys.executable, "-m", "rampserve.bench.loadgen", str(workdir / "job.npz"),
                                    str(workdir / "out.npz")], stdout=log, stderr=subprocess.STDOUT)
    try:
        while get_json(status_url)["requests"] < before + LOAD_SETTLE_REQUESTS:
            if process.poll() is not None:
                raise RuntimeError(f"the load generator exited with {process.returncode}; see {workdir}")
            time.sleep(0.1)
        yield
    finally:
        process.kill()  # its figures are not wanted: the restart's are
        process.wait()


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
    write_result(report, json_out)
    return report


def restart_table(report: dict) -> Table:
    """Per model, a restart's time from the kill to ready again and each phase's share of it, idle and under load."""
    clients = report["settings"]["restart_clients"]
    table = Table(title=f"executor restart after SIGKILL, seconds: medians (min–max) over {report['settings']['rounds']} "
                        f"rounds, idle and under {clients} closed-loop clients")
    table.add_column("phase")
    for model in report["models"]:
        table.add_column(f"{model} idle", justify="right")
        table.add_column(f"{model} {clients} clients", justify="right")
    for label, key in RESTART_ROWS:
        table.add_row(label, *(median_cell(figures, f"restart_{load}{key}", ".2f")
                               for figures in report["models"].values() for load in ("", "loaded_")))
    return table


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
