"""What the live benches (`bench live`, `bench peers`, `bench race`) share: a server in a process of its own, the load
generator run in another (`rampserve.bench.loadgen`), closed-loop saturation probes, and the requests they send.

A server is any command that serves KServe v2 on the ports it is given (HTTP, and gRPC where it speaks it), ready
once a readiness URL answers 200 and stopped with a signal it answers by finishing what it accepted;
`rampserve_serve` is `rampserve serve`'s command. `transport` picks what the load generator speaks to it.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np
from rich.table import Table
from tqdm.auto import tqdm

from rampserve.bench.loadgen import V2_DTYPES, Job, LoadResult, fetch_status, grpc_url, save_job
from rampserve.runtime.prepare import feeds_for, prepared_encoder
from rampserve.runtime.prepared import PreparedModel

QUANTILES = (25, 50, 95, 99)
MAX_ERRORS = 10  # distinct error messages kept per run, the most frequent
STOP_GRACE_S = 40.0  # a server told to stop answers what it accepted within this (rampserve's own grace is 30 s)
READY_PATH = "/v2/health/ready"
TRANSPORTS = ("http", "grpc")  # what a live bench's client speaks: v2 over HTTP, or KServe v2 over gRPC


# --- statistics (pure) ----------------------------------------------------------------------------------------

def percentiles(values: np.ndarray, prefix: str = "", suffix: str = "_ms") -> dict[str, float | None]:
    """p25/p50/p95/p99 (None each when there are no values)."""
    points = np.percentile(values, QUANTILES) if len(values) else [None] * len(QUANTILES)
    return {f"{prefix}p{q}{suffix}": None if v is None else float(v) for q, v in zip(QUANTILES, points)}


def closed_loop_throughput(result: LoadResult, settle_ms: float, end_ms: float) -> float:
    """Answers per second completed within [settle_ms, end_ms): a closed loop's clients keep the server busy
    throughout, once they have all started."""
    done = result.done_ms[result.ok]
    return float(np.count_nonzero((done >= settle_ms) & (done < end_ms)) / ((end_ms - settle_ms) / 1000.0))


def mean_batch_size(before: dict | str | None, after: dict | str | None, model: str) -> float | None:
    """Inputs per batch the server ran between two of its status reports (`inputs`, or `requests` where it does not
    count inputs apart: one input per request here); None if either report is missing."""
    if not isinstance(before, dict) or not isinstance(after, dict):
        return None
    try:
        first, last = before["models"][model], after["models"][model]
        unit = "inputs" if "inputs" in last else "requests"
        batches, inputs = last["batches"] - first["batches"], last[unit] - first[unit]
    except (KeyError, TypeError):
        return None
    return inputs / batches if batches > 0 else None


def median_ratio(pairs: list[tuple[float | None, float | None]]) -> dict | None:
    """The median and [min, max] of a / b over the pairs where both are known (and b is not 0); None if none is."""
    values = [a / b for a, b in pairs if a is not None and b]
    return {"median": float(np.median(values)), "min_max": [min(values), max(values)]} if values else None


def round_ratios(numerator: list[dict], denominator: list[dict], keys: list[str]) -> dict[str, dict]:
    """Per figure, one system's over another's within each round (paired, so that a noisy phase of the machine lands
    on both): the median and [min, max] of those ratios, over the rounds where both have the figure."""
    ratios = {key: median_ratio([(n.get(key), d.get(key)) for n, d in zip(numerator, denominator)]) for key in keys}
    return {key: ratio for key, ratio in ratios.items() if ratio is not None}


def ratio_cell(ratio: dict | None, spec: str = ".2f") -> str:
    """A `median_ratio` as a table cell: median (min–max)."""
    return "" if ratio is None else f"{ratio['median']:{spec}} ({ratio['min_max'][0]:{spec}}–{ratio['min_max'][1]:{spec}})"


def add_paired_rows(table: Table, rows: list[tuple[str, str, str]], systems: list[dict], ratios: dict[str, dict],
                    ratio_spec: str = ".2f") -> None:
    """Rows (label, figure, format) of each system's median (min–max over rounds) and the ratio paired within
    rounds (`round_ratios`) in the last column."""
    for label, key, spec in rows:
        table.add_row(label, *(median_cell(system, key, spec) for system in systems),
                      ratio_cell(ratios.get(key), ratio_spec))


def median_cell(system: dict, key: str, spec: str) -> str:
    """A figure of a system's rounds (`peers.over_rounds`) as a table cell: median (min–max)."""
    span = system["min_max"].get(key)
    return fmt(system.get(key), spec) + ("" if span is None else f" ({span[0]:{spec}}–{span[1]:{spec}})")


def most_frequent(errors: dict[str, int]) -> dict[str, int]:
    """The MAX_ERRORS most frequent error messages with their counts."""
    return dict(sorted(errors.items(), key=lambda item: -item[1])[:MAX_ERRORS])


def fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def ratio(value: float | None, base: float | None) -> float | None:
    return None if value is None or not base else value / base


# --- requests -------------------------------------------------------------------------------------------------

def encode_items(model: PreparedModel, task: str, items: np.ndarray | list[str]) -> list[dict[str, np.ndarray]]:
    """One request per item, its inputs under the model's own input names (text: each padded to its own length)."""
    encoder = prepared_encoder(model, task)
    return [feeds_for(model.backend, encoder, items[i:i + 1]) for i in range(len(items))]


def renamed(feeds: list[dict[str, np.ndarray]], names: list[str]) -> list[dict[str, np.ndarray]]:
    """The same inputs under the names a server's metadata gives, matched by position (as `feeds_for` does)."""
    return [dict(zip(names, f.values())) for f in feeds]


def v2_inputs(feeds: dict[str, np.ndarray]) -> tuple[tuple[str, str], ...]:
    """(name, v2 datatype) of each input of one request, in order: what a `Job` sends."""
    datatypes = {np.dtype(dtype): name for name, dtype in V2_DTYPES.items()}
    return tuple((name, datatypes[array.dtype]) for name, array in feeds.items())


# --- processes ----------------------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


def http_status(url: str) -> int:
    """The status a GET of `url` is answered with, an error's included."""
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


def tail(path: Path, lines: int = 30) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.is_file() else ""


def rampserve_serve(model: str, slo_ms: float, max_batch: int, max_delay_ms: float, vanilla: bool,
                    extra_args: tuple[str, ...] = ()) -> Callable[[int, int], list[str]]:
    """`rampserve serve` of a zoo model (or bundle) on 127.0.0.1 at the given HTTP and gRPC ports."""
    return lambda port, grpc_port: [
        sys.executable, "-m", "rampserve.cli", "serve", model, "--host", "127.0.0.1", "--port", str(port),
        "--grpc-port", str(grpc_port), "--slo-ms", f"{slo_ms:.4f}", "--max-batch", str(max_batch), "--max-delay-ms", f"{max_delay_ms:g}",
        *extra_args, *(["--vanilla"] if vanilla else [])]


class ServerProcess:
    """A server in its own process (and session, so that whatever it starts can be ended with it) on free ports
    (`command` is given the HTTP one and the gRPC one), ready on entry once `ready_path` answers 200, and stopped on
    exit with `stop_signal`, after which it answers what it accepted; one still running after STOP_GRACE_S is
    killed with everything in its session."""

    def __init__(self, command: Callable[[int, int], list[str]], log: Path, start_timeout_s: float,
                 ready_path: str = READY_PATH, stop_signal: signal.Signals = signal.SIGTERM, poll_s: float = 0.2) -> None:
        self.log, self.start_timeout_s, self.poll_s = log, start_timeout_s, poll_s
        self.ready_path, self.stop_signal = ready_path, stop_signal
        self.port, self.grpc_port = free_port(), free_port()
        self.command = command(self.port, self.grpc_port)
        self.process: subprocess.Popen | None = None
        self.exit_code: int | None = None
        self.killed = False  # did not stop within its grace period after the stop signal
        self.ready_s: float | None = None  # from starting the command to its first ready answer (within `poll_s`)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    @property
    def pid(self) -> int | None:
        """The server's own process (the root of what it starts); None before it is started."""
        return None if self.process is None else self.process.pid

    def _hear_stop_signal(self) -> None:
        signal.signal(self.stop_signal, signal.SIG_DFL)

    def infer_url(self, model: str, transport: str) -> str:
        """Where a job sends its requests for `model` (a `Job.url`)."""
        if transport not in TRANSPORTS:
            raise ValueError(f"transport is one of {TRANSPORTS}, not {transport!r}")
        return grpc_url(self.grpc_port, model) if transport == "grpc" else self.url(f"/v2/models/{model}/infer")

    def __enter__(self) -> ServerProcess:
        started = time.monotonic()
        with self.log.open("wb") as log:
            # A shell that starts a job in the background (`cmd &`, nohup) ignores SIGINT in it, and children
            # inherit that: the server must hear its stop signal however the benchmark was started
            self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True, preexec_fn=self._hear_stop_signal)
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"`{' '.join(self.command)}` exited with {self.process.returncode} before it was "
                                   f"ready:\n{tail(self.log)}")
            try:
                with urllib.request.urlopen(self.url(self.ready_path), timeout=2) as response:
                    if response.status == 200:
                        self.ready_s = time.monotonic() - started
                        return self
            except OSError:
                pass
            time.sleep(self.poll_s)
        self.__exit__(None, None, None)
        raise RuntimeError(f"the server was not ready within {self.start_timeout_s} s:\n{tail(self.log)}")

    def __exit__(self, *_exc: object) -> None:
        if self.process is None or self.process.poll() is not None:
            self.exit_code = None if self.process is None else self.process.returncode
            return
        self.process.send_signal(self.stop_signal)
        try:
            self.exit_code = self.process.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            self.killed = True
            os.killpg(self.process.pid, signal.SIGKILL)  # its session: the server and what it started
            self.exit_code = self.process.wait()

    def outcome(self) -> dict:
        """How it stopped, with the end of its log when that was not cleanly (uvicorn re-raises the SIGTERM it
        handled once it has shut down gracefully, so dying of the stop signal is a clean stop too)."""
        outcome = {"exit_code": self.exit_code, "killed": self.killed}
        clean = self.exit_code in (0, -self.stop_signal) and not self.killed
        return outcome if clean else outcome | {"log_tail": tail(self.log)}


# --- the load generator -------------------------------------------------------------------------------------------

def run_loadgen(job: Job, requests: list[dict[str, np.ndarray]], workdir: Path, name: str, expected_s: float,
                progress: bool, arrivals_ms: np.ndarray | None = None,
                warmup_arrivals_ms: np.ndarray | None = None) -> LoadResult:
    """Run a job in a fresh `python -m rampserve.bench.loadgen` process and read its result."""
    job_path, out_path, log_path = (workdir / f"{name}.{suffix}" for suffix in ("job.npz", "out.npz", "log"))
    save_job(job_path, job, requests, arrivals_ms, warmup_arrivals_ms)
    command = [sys.executable, "-m", "rampserve.bench.loadgen", str(job_path), str(out_path)]
    limit_s = expected_s + job.timeout_s + 120.0  # encoding the bodies and draining the last requests come on top
    with log_path.open("wb") as log, tqdm(total=round(expected_s), desc=name, unit="s", disable=not progress,
                                          leave=False) as bar:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        start = time.monotonic()
        while process.poll() is None:
            elapsed = time.monotonic() - start
            if elapsed > limit_s:
                process.kill()
                process.wait()
                raise RuntimeError(f"the load generator ran past {limit_s:.0f} s:\n{tail(log_path)}")
            bar.update(min(round(elapsed), bar.total) - bar.n)
            time.sleep(0.5)
    if process.returncode != 0:
        raise RuntimeError(f"the load generator failed ({process.returncode}):\n{tail(log_path)}")
    return LoadResult.load(out_path)


def require_answers(result: LoadResult, what: str) -> LoadResult:
    """The result, unless the server answered none of its requests."""
    if not result.ok.any():
        raise RuntimeError(f"{what}: the server answered none of {len(result.ok)} requests: {result.errors}")
    return result


def measure_saturation(job: Job, probe: list[dict[str, np.ndarray]], model: str, rounds: int, settle_s: float,
                       workdir: Path, progress: bool) -> dict:
    """Closed loop: clients that each send again as soon as they are answered keep the server's queue from ever
    running dry, so the answers per second once they all run (after `settle_s` of the job's `duration_s`) are the
    most it sustains, at the batch sizes it chooses itself. (Open-loop rate steps would need several runs, each
    long enough for queues to settle.)

    `rounds` probes in a row, each from a client process of its own: `throughput_rps` is their median, `rounds_rps`
    every round's (their spread); counts, batch sizes and latency cover every round."""
    if job.duration_s is None:
        raise ValueError("a saturation probe runs for a duration")
    before = fetch_status(job.status_url)
    results = [require_answers(run_loadgen(job, probe, workdir, f"saturation {r + 1}", job.duration_s, progress),
                        "saturation") for r in range(rounds)]
    rounds_rps = [closed_loop_throughput(result, settle_s * 1000.0, job.duration_s * 1000.0) for result in results]
    errors: Counter[str] = Counter()
    for result in results:
        errors.update(result.errors)
    return {"clients": job.clients, "duration_s": job.duration_s, "rounds": len(rounds_rps),
            "throughput_rps": float(np.median(rounds_rps)), "rounds_rps": rounds_rps,
            "min_rps": min(rounds_rps), "max_rps": max(rounds_rps),
            "mean_batch_size": mean_batch_size(before, results[-1].status_after, model),
            "answered": sum(int(r.ok.sum()) for r in results), "shed": sum(int(r.shed.sum()) for r in results),
            "failed": sum(int(r.failed.sum()) for r in results), "errors": most_frequent(dict(errors)),
            **percentiles(np.concatenate([r.latency_ms[r.ok] for r in results]))}
