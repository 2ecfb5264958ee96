"""`rampserve bench dashboard`: what /dashboard costs serving, measured. The same server without the dashboard
(`--no-dashboard`: no sampler) and with it and a viewer polling /dashboard/data once a second as the page does,
each started afresh in every round, the order alternating round by round: the server's CPU at idle (the front end
and its executor processes together, so the sampler's status questions count where they are answered), one client
at a time (latency), and a closed loop of clients (throughput and latency under saturation). With `--models N` the
server serves N copies of the model (all sampled every second; the load goes to the first). Figures are medians
over rounds with their min-max, and on/off ratios paired within each round.
"""

from __future__ import annotations

import contextlib
import json
import tempfile
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from rich.table import Table
from tqdm.auto import tqdm

from rampserve.bench.cpu import tree_cpu_s
from rampserve.bench.harness import (
    ServerProcess,
    add_paired_rows,
    closed_loop_throughput,
    encode_items,
    percentiles,
    rampserve_serve,
    require_answers,
    round_ratios,
    run_loadgen,
    v2_inputs,
)
from rampserve.bench.loadgen import Job
from rampserve.bench.peers import over_rounds, round_orders
from rampserve.bench.results import write_result
from rampserve.runtime.bundle import load_bundle
from rampserve.runtime.zoo_bundles import zoo_bundle
from rampserve.workloads.streams import get_stream

ARMS = ("off", "on")
COMPARED = ("idle_cpu_percent", "one_p50_ms", "one_p99_ms", "closed_rps", "closed_p50_ms", "closed_p99_ms")


@dataclass(frozen=True)
class DashboardBenchSettings:
    model: str = "resnet18-fmnist"
    workload: str = "fmnist-drift"
    models: int = 1  # copies of the model served (sampled every second; the load goes to the first)
    rounds: int = 5
    max_batch: int = 8
    slo_ms: float = 10.0
    idle_s: float = 10.0  # the server's CPU with no load, after `warm_s`
    warm_s: float = 3.0
    sequential_requests: int = 600  # one at a time; the first sixth warms up and is not counted
    clients: int = 8
    closed_s: float = 10.0
    closed_settle_s: float = 2.0
    poll_s: float = 1.0  # the viewer's polling interval (the page's: the sampler's)
    start_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.rounds < 1 or self.clients < 1 or self.models < 1 or not self.poll_s > 0:
            raise ValueError("at least one round, one client and one model, and a positive polling interval")
        if self.closed_s <= self.closed_settle_s:
            raise ValueError(f"the closed loop ({self.closed_s} s) must outlast its settling ({self.closed_settle_s} s)")


# ---- the viewer ---------------------------------------------------------------------------------------------------------

class Viewer:
    """Polls /dashboard/data as the page does (all kept samples first, then only the new ones), timing each poll."""

    def __init__(self, url: str, interval_s: float) -> None:
        self.url, self.interval_s = url, interval_s
        self.polls: list[tuple[float, int]] = []  # (ms, bytes) per poll, the first (everything kept) included
        self.failures = 0
        self.last: dict = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dashboard viewer", daemon=True)

    def __enter__(self) -> Viewer:
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        seq = 0
        while True:
            started = time.perf_counter()
            try:
                with urllib.request.urlopen(f"{self.url}?since={seq}", timeout=10) as response:
                    body = response.read()
                self.polls.append(((time.perf_counter() - started) * 1000.0, len(body)))
                self.last = json.loads(body)
                seq = self.last["seq"]
            except (OSError, ValueError):
                self.failures += 1
            if self._stop.wait(self.interval_s):
                return

    def figures(self) -> dict:
        later = self.polls[1:]  # after the first, each brings what one sampler interval added
        return {"polls": len(self.polls), "poll_failures": self.failures,
                "poll_ms": float(np.median([ms for ms, _ in later])) if later else None,
                "poll_kb": float(np.median([size for _, size in later])) / 1024 if later else None,
                "sampler_cpu_ms_per_tick": self.last.get("sampler", {}).get("cpu_ms_per_tick")}


# ---- the bench ----------------------------------------------------------------------------------------------------------

def served_refs(settings: DashboardBenchSettings, workdir: Path) -> list[str]:
    """The model, or N names for its bundle (links to it: they share its compiled stages)."""
    if settings.models == 1:
        return [settings.model]
    bundle = zoo_bundle(settings.model)
    refs = []
    for i in range(settings.models):
        link = workdir / f"{settings.model}-{i:02d}"
        link.symlink_to(bundle, target_is_directory=True)
        refs.append(str(link))
    return refs


def run_arm(arm: str, settings: DashboardBenchSettings, refs: list[str], feeds: list, workdir: Path) -> dict:
    target = Path(refs[0]).name
    extra = (*refs[1:], *(["--no-dashboard"] if arm == "off" else []))
    command = rampserve_serve(refs[0], settings.slo_ms, settings.max_batch, 0.0, False, tuple(extra))
    with ServerProcess(command, workdir / f"{arm}.log", settings.start_timeout_s) as server:
        viewer = Viewer(server.url("/dashboard/data"), settings.poll_s) if arm == "on" else None
        with viewer if viewer is not None else contextlib.nullcontext():
            time.sleep(settings.warm_s)  # the first samples, and whatever starting left running, settle
            cpu_before, at = tree_cpu_s(server.process.pid), time.monotonic()
            time.sleep(settings.idle_s)
            idle = (tree_cpu_s(server.process.pid) - cpu_before) / (time.monotonic() - at) * 100.0
            url = server.url(f"/v2/models/{target}/infer")
            job = Job(url, v2_inputs(feeds[0]), "label", None, clients=1, requests=settings.sequential_requests)
            one = require_answers(run_loadgen(job, feeds, workdir, f"{arm} one at a time",
                                              settings.sequential_requests * 0.003, False), arm)
            warm = settings.sequential_requests // 6
            one_latency = percentiles(one.latency_ms[one.ok][warm:], "one_")
            job = Job(url, v2_inputs(feeds[0]), "label", None, clients=settings.clients, duration_s=settings.closed_s)
            closed = require_answers(run_loadgen(job, feeds, workdir, f"{arm} closed loop", settings.closed_s,
                                                 False), arm)
        counted = closed.ok & (closed.scheduled_ms >= settings.closed_settle_s * 1000.0)
        closed_latency = percentiles(closed.latency_ms[counted], "closed_")
        figures = {"idle_cpu_percent": idle, "one_p50_ms": one_latency["one_p50_ms"],
                   "one_p99_ms": one_latency["one_p99_ms"],
                   "closed_rps": closed_loop_throughput(closed, settings.closed_settle_s * 1000.0,
                                                        settings.closed_s * 1000.0),
                   "closed_p50_ms": closed_latency["closed_p50_ms"], "closed_p99_ms": closed_latency["closed_p99_ms"],
                   "failed": int((~one.ok).sum() + (~closed.ok).sum())}
        return figures | (viewer.figures() if viewer is not None else {})


def run_dashboard_bench(settings: DashboardBenchSettings, json_out: Path | None, progress: bool = True) -> dict:
    model = load_bundle(zoo_bundle(settings.model))
    stream = get_stream(settings.workload)
    start = stream.evaluation.start
    feeds = encode_items(model, stream.task, stream.items(start, start + 500))
    rounds: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    orders = round_orders(ARMS, settings.rounds)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="rampserve-dashboard-") as tmp, \
            tqdm(total=settings.rounds * len(ARMS), desc="dashboard", unit="run", disable=not progress) as bar:
        workdir = Path(tmp)
        refs = served_refs(settings, workdir)
        for order in orders:
            for arm in order:
                rounds[arm].append(run_arm(arm, settings, refs, feeds, workdir))
                bar.update()
    arms = {}
    for arm in ARMS:
        medians, spans = over_rounds(rounds[arm])
        arms[arm] = medians | {"min_max": spans, "rounds": rounds[arm]}
    report = {"model": settings.model, "models_served": settings.models, "orders": [list(o) for o in orders],
              "settings": asdict(settings), "arms": arms, "wall_s": time.monotonic() - started,
              "on_over_off": round_ratios(rounds["on"], rounds["off"], list(COMPARED))}
    write_result(report, json_out)
    return report


def dashboard_table(report: dict) -> Table:
    settings = report["settings"]
    table = Table(title=f"{report['model']} x{report['models_served']} served, max batch {settings['max_batch']}: "
                        f"without the dashboard (off) and with it and a viewer polling every {settings['poll_s']:g} s "
                        f"(on); medians (min–max) over {settings['rounds']} rounds")
    table.add_column("figure")
    for arm in ARMS:
        table.add_column(f"dashboard {arm}", justify="right")
    table.add_column("on / off (paired)", justify="right")
    rows = (("server CPU at idle (% of a core)", "idle_cpu_percent", ".2f"),
            ("1 client: p50 ms", "one_p50_ms", ".3f"), ("1 client: p99 ms", "one_p99_ms", ".3f"),
            (f"{settings['clients']} clients: rps", "closed_rps", ".0f"),
            (f"{settings['clients']} clients: p50 ms", "closed_p50_ms", ".2f"),
            (f"{settings['clients']} clients: p99 ms", "closed_p99_ms", ".2f"),
            ("sampler CPU per sample (ms, front end)", "sampler_cpu_ms_per_tick", ".3f"),
            ("a poll of /dashboard/data (ms)", "poll_ms", ".2f"), ("a poll's size (KiB)", "poll_kb", ".1f"))
    add_paired_rows(table, rows, [report["arms"][arm] for arm in ARMS], report["on_over_off"], ".3f")
    return table
