"""`rampserve bench executor`: where a bundle's executor should run, measured. The same vanilla server with its
executor in a thread of the front end's process (`--executor thread`) and in a process of its own (`--executor
process`), started afresh in every round, the order alternating round by round: one client at a time (the server's
own overhead over the model's batch-1 time here, with binary tensors and JSON bodies over HTTP and with KServe v2
over gRPC) and a closed loop of clients over HTTP and over gRPC (throughput, latency, and the mean batch: whether
the front end keeps the model fed), the transports' order rotating round by round too. Figures are medians over
rounds with their min-max; process/thread and gRPC/HTTP ratios are paired within each round (so a noisy phase of the
machine lands on both).
"""

from __future__ import annotations

import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from rich.table import Table
from tqdm.auto import tqdm

from rampserve.bench.harness import (
    ServerProcess,
    add_paired_rows,
    closed_loop_throughput,
    encode_items,
    mean_batch_size,
    median_ratio,
    percentiles,
    rampserve_serve,
    ratio_cell,
    require_answers,
    round_ratios,
    run_loadgen,
    v2_inputs,
)
from rampserve.bench.http_cores import CORES, INFER_PATH
from rampserve.bench.live import batch1_inprocess_ms
from rampserve.bench.loadgen import Job, fetch_status
from rampserve.bench.peers import over_rounds, round_orders
from rampserve.bench.results import write_result
from rampserve.runtime.bundle import load_bundle
from rampserve.runtime.zoo_bundles import zoo_bundle
from rampserve.workloads.streams import get_stream

EXECUTORS = ("thread", "process")
# One at a time: binary tensors and JSON over HTTP, KServe v2 over gRPC, and binary tensors from the lean client
# (`loadgen.LeanHttpClient`: the server's time with little of the client's; the others use aiohttp and grpc.aio)
ENCODINGS = ("binary", "json", "grpc", "lean")
CLOSED_LOOPS = {"binary": "closed", "grpc": "closed_grpc"}  # the closed loop's transports and their figures' prefix
# Figures where lower is better (a ratio under 1 favours the process) and those where higher is better
LOWER_IS_BETTER = ("overhead_binary_ms", "overhead_json_ms", "overhead_grpc_ms", "overhead_lean_ms", "closed_p50_ms",
                   "closed_p99_ms", "closed_grpc_p50_ms", "closed_grpc_p99_ms")
HIGHER_IS_BETTER = ("closed_rps", "closed_mean_batch", "closed_grpc_rps", "closed_grpc_mean_batch")


@dataclass(frozen=True)
class ExecutorBenchSettings:
    model: str = "resnet18-fmnist"
    workload: str = "fmnist-drift"
    rounds: int = 5
    max_batch: int = 8
    slo_ms: float = 10.0  # only bounds the batch size and the adaptive batching's target
    sequential_requests: int = 600  # one at a time; the first sixth warms up and is not counted
    clients: int = 8  # the closed loop (issue 15: a mean batch of at least 3 with 8 clients)
    closed_s: float = 8.0
    closed_settle_s: float = 2.0
    inprocess_rounds: int = 500
    start_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if self.rounds < 1 or self.clients < 1:
            raise ValueError("at least one round and one client")
        if self.closed_s <= self.closed_settle_s:
            raise ValueError(f"the closed loop ({self.closed_s} s) must outlast its settling ({self.closed_settle_s} s)")


def paired_ratios(rounds: dict[str, list[dict]]) -> dict[str, dict]:
    """Per figure, process over thread within each round: the median and [min, max] of those ratios."""
    keys = [k for k in rounds["process"][0] if k in LOWER_IS_BETTER or k in HIGHER_IS_BETTER]
    return round_ratios(rounds["process"], rounds["thread"], keys)


def grpc_over_binary(rounds: list[dict], batch1_ms: float) -> dict[str, dict]:
    """One executor's rounds: gRPC over HTTP with binary tensors within each round, the median and [min, max] of
    those ratios: one request at a time (its latency: the overhead plus the model's batch-1 time) and the closed
    loop's throughput and latency."""
    def latency(overhead: float | None) -> float | None:
        return None if overhead is None else overhead + batch1_ms

    pairs = {"one_at_a_time_p50": [(latency(r.get("overhead_grpc_ms")), latency(r.get("overhead_binary_ms")))
                                   for r in rounds]}
    for figure in ("rps", "p50_ms", "p99_ms"):
        pairs[f"closed_{figure}"] = [(r.get(f"closed_grpc_{figure}"), r.get(f"closed_{figure}")) for r in rounds]
    ratios = {key: median_ratio(values) for key, values in pairs.items()}
    return {key: ratio for key, ratio in ratios.items() if ratio is not None}


def over_echo(rounds: list[dict], cores: list[dict[str, float]]) -> dict[str, dict]:
    """One executor's overhead per encoding over the round trip of the bare uvicorn echo timed in the same round (the
    HTTP core rampserve runs on, `http_cores`), the median and [min, max] of those ratios. Like for like only for
    the lean client's (the echo is timed with it); the others carry their client's cost too."""
    ratios = {key: median_ratio([(r.get(key), c.get("uvicorn")) for r, c in zip(rounds, cores)])
              for key in (f"overhead_{encoding}_ms" for encoding in ENCODINGS)}
    return {key: ratio for key, ratio in ratios.items() if ratio is not None}


def run_executor_bench(settings: ExecutorBenchSettings, json_out: Path | None, progress: bool = True) -> dict:
    model = load_bundle(zoo_bundle(settings.model))
    stream = get_stream(settings.workload)
    start = stream.evaluation.start
    feeds = encode_items(model, stream.task, stream.items(start, start + 500))
    batch1 = batch1_inprocess_ms(model, feeds, settings.inprocess_rounds)
    rounds: dict[str, list[dict]] = {kind: [] for kind in EXECUTORS}
    cores: list[dict[str, float]] = []  # per round, each bare HTTP core's one-at-a-time p50
    orders = round_orders(EXECUTORS, settings.rounds)
    with tempfile.TemporaryDirectory(prefix="rampserve-executor-") as tmp, \
            tqdm(total=settings.rounds * (len(EXECUTORS) + len(CORES)), desc="executor", unit="run",
                 disable=not progress) as bar:
        workdir = Path(tmp)
        for order in orders:
            for kind in order:
                command = rampserve_serve(settings.model, settings.slo_ms, settings.max_batch, 0.0, True,
                                          ("--executor", kind))
                with ServerProcess(command, workdir / f"{kind}.log", settings.start_timeout_s) as server:
                    figures: dict[str, float | None] = {}
                    for encoding in rotated(ENCODINGS, len(rounds[kind])):
                        url = server.infer_url(settings.model, "grpc" if encoding == "grpc" else "http")
                        figures[f"overhead_{encoding}_ms"] = one_at_a_time_p50(
                            url, feeds, settings, workdir, kind, json_bodies=encoding == "json",
                            lean=encoding == "lean") - batch1
                    for transport in rotated(tuple(CLOSED_LOOPS), len(rounds[kind])):
                        figures |= closed_loop(server, transport, feeds, settings, workdir, kind)
                rounds[kind].append(figures)
                bar.update()
            cores.append({})
            for core in rotated(tuple(CORES), len(cores)):
                cores[-1][core] = bare_core_ms(core, feeds, settings, workdir)
                bar.update()
    systems = {}
    for kind in EXECUTORS:
        medians, spans = over_rounds(rounds[kind])
        systems[kind] = medians | {"min_max": spans, "rounds": rounds[kind]}
    report = {"model": settings.model, "batch1_inprocess_ms": batch1, "orders": [list(o) for o in orders],
              "settings": asdict(settings), "systems": systems, "process_over_thread": paired_ratios(rounds),
              "grpc_over_binary": {kind: grpc_over_binary(rounds[kind], batch1) for kind in EXECUTORS},
              "over_uvicorn_echo": {kind: over_echo(rounds[kind], cores) for kind in EXECUTORS},
              "http_cores": dict(zip(("median_ms", "min_max"), over_rounds(cores))) | {"rounds": cores}}
    write_result(report, json_out)
    return report


def one_at_a_time_p50(url: str, feeds: list[dict[str, np.ndarray]], settings: ExecutorBenchSettings, workdir: Path,
                      name: str, **job_options: bool) -> float:
    """One client sending `settings.sequential_requests` one after another to `url`: the p50 in ms of those after
    the first sixth, which warms up (a request that failed fails the bench)."""
    job = Job(url, v2_inputs(feeds[0]), "label", None, clients=1, requests=settings.sequential_requests,
              **job_options)
    one = require_answers(run_loadgen(job, feeds, workdir, f"{name} one at a time",
                                      settings.sequential_requests * 0.003, False), name)
    return float(np.median(one.latency_ms[one.ok][settings.sequential_requests // 6:]))


def bare_core_ms(core: str, feeds: list[dict[str, np.ndarray]], settings: ExecutorBenchSettings,
                 workdir: Path) -> float:
    """One HTTP core serving the echo model (`http_cores`), started afresh: the lean client's p50 one request at a
    time, the same requests and count as the servers'."""
    with ServerProcess(lambda port, _: CORES[core](port), workdir / f"{core}.log", settings.start_timeout_s) as server:
        return one_at_a_time_p50(server.url(INFER_PATH), feeds, settings, workdir, core, lean=True)


def rotated(items: tuple[str, ...], by: int) -> tuple[str, ...]:
    """`items` starting `by` further along: round r's order, so that none always runs first."""
    return tuple(items[(by + i) % len(items)] for i in range(len(items)))


def closed_loop(server: ServerProcess, transport: str, feeds: list[dict[str, np.ndarray]],
                settings: ExecutorBenchSettings, workdir: Path, kind: str) -> dict[str, float | int | None]:
    """`settings.clients` closed-loop clients over `transport` (binary or grpc): throughput, latency once they all
    run, the mean batch and the requests that failed, under the transport's prefix (CLOSED_LOOPS)."""
    prefix = CLOSED_LOOPS[transport]
    before = fetch_status(server.url("/status"))
    job = Job(server.infer_url(settings.model, "grpc" if transport == "grpc" else "http"), v2_inputs(feeds[0]),
              "label", server.url("/status"), clients=settings.clients, duration_s=settings.closed_s)
    closed = require_answers(run_loadgen(job, feeds, workdir, f"{kind} closed loop ({transport})", settings.closed_s,
                                         False), kind)
    counted = closed.ok & (closed.scheduled_ms >= settings.closed_settle_s * 1000.0)
    latency = percentiles(closed.latency_ms[counted])
    return {f"{prefix}_rps": closed_loop_throughput(closed, settings.closed_settle_s * 1000.0,
                                                    settings.closed_s * 1000.0),
            f"{prefix}_p50_ms": latency["p50_ms"], f"{prefix}_p99_ms": latency["p99_ms"],
            f"{prefix}_mean_batch": mean_batch_size(before, closed.status_after, settings.model),
            f"{prefix}_failed": int((~closed.ok).sum())}


def executor_table(report: dict) -> Table:
    settings = report["settings"]
    table = Table(title=f"{report['model']}, vanilla, max batch {settings['max_batch']}: medians (min–max) over "
                        f"{settings['rounds']} rounds; in-process batch 1 {report['batch1_inprocess_ms']:.3f} ms")
    table.add_column("figure")
    for kind in EXECUTORS:
        table.add_column(f"executor {kind}", justify="right")
    table.add_column("process / thread (paired)", justify="right")
    clients = settings["clients"]
    rows = [("overhead, binary (ms)", "overhead_binary_ms", ".3f"), ("overhead, JSON (ms)", "overhead_json_ms", ".3f"),
            ("overhead, gRPC (ms)", "overhead_grpc_ms", ".3f"),
            ("overhead, binary, lean client (ms)", "overhead_lean_ms", ".3f")]
    for transport, prefix in CLOSED_LOOPS.items():
        over = "" if transport == "binary" else " over gRPC"
        rows += [(f"{clients} clients{over}: rps", f"{prefix}_rps", ".0f"),
                 (f"{clients} clients{over}: p50 ms", f"{prefix}_p50_ms", ".2f"),
                 (f"{clients} clients{over}: p99 ms", f"{prefix}_p99_ms", ".2f"),
                 (f"{clients} clients{over}: mean batch", f"{prefix}_mean_batch", ".2f")]
    add_paired_rows(table, rows, [report["systems"][kind] for kind in EXECUTORS], report["process_over_thread"])
    for label, key in (("gRPC / binary: one at a time p50", "one_at_a_time_p50"),
                       (f"gRPC / binary: {clients} clients rps", "closed_rps"),
                       (f"gRPC / binary: {clients} clients p50", "closed_p50_ms"),
                       (f"gRPC / binary: {clients} clients p99", "closed_p99_ms")):
        table.add_row(label, *(ratio_cell(report["grpc_over_binary"][kind].get(key)) for kind in EXECUTORS), "")
    for encoding in ENCODINGS:
        key = f"overhead_{encoding}_ms"
        table.add_row(f"overhead {encoding} / uvicorn echo (same round)",
                      *(ratio_cell(report["over_uvicorn_echo"][kind].get(key)) for kind in EXECUTORS), "")
    return table


def http_cores_table(report: dict) -> Table:
    """The bare HTTP cores' round trips beside the server's own overhead (both from the lean client)."""
    cores = report["http_cores"]
    table = Table(title=f"bare HTTP cores, an echo model, one request at a time from the lean client: medians "
                        f"(min–max) over {report['settings']['rounds']} rounds")
    table.add_column("core")
    table.add_column("round trip (ms)", justify="right")
    for core in CORES:
        low, high = cores["min_max"][core]
        table.add_row(core, f"{cores['median_ms'][core]:.3f} ({low:.3f}–{high:.3f})")
    return table
