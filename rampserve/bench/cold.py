"""`rampserve bench live --from-cold`: a model with no bundle, served from the moment its server starts, on the user's
own inputs in their order (`--data`), as `rampserve serve MODEL` serves it: vanilla while it records its first
requests, then through training, profiling and certifying to managed (`serving.learning`).

The run: a vanilla server (`--no-record`) is probed closed loop for its saturation, which sets the replay's rate (the
load, as `bench live`'s). A fresh server then serves the model unprepared, in a fresh RAMPSERVE_HOME (so it exports
and learns everything itself), and the file is replayed at that rate, open loop, from its first row, for `duration_s`:
each request is set in the phase the server was in when it arrived (the server's own phase history, in wall-clock
time). Last, another fresh vanilla server is given the same requests at the same times, from a little before the
training job began until its end (its first `vanilla_limit_s` at most): the p99 of the requests that arrived while the
job ran, against vanilla's p99 of the same requests.

Those two runs come minutes apart, on cores other work shares. With `pause_job_every_s` the job's cost is measured
against whatever else the machine does: the bench stops the training job (SIGSTOP) and lets it go on (SIGCONT) in
turns of that many seconds while it runs, so requests that arrive while it is stopped (the same server, vanilla, with
no job) interleave with those that arrive while it runs; the job then takes about twice as long, so the times to
managed of such a run are not the model's.

Figures: from the server's start, when it was ready, its first answer, each phase's start, the first answer given at a
ramp and managed mode; per phase, requests and latency; accuracy over every answered request against the model's own
answer (its ONNX file's, or its export's, run here on each distinct input), the worst window's; requests with no
answer; the machine's load average, since every figure here is timed on shared cores.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
from rich.table import Table

from rampserve.bench.figures import ACCURACY_WINDOW
from rampserve.bench.harness import (
    ServerProcess,
    fmt,
    get_json,
    measure_saturation,
    median_ratio,
    percentiles,
    run_loadgen,
    v2_inputs,
)
from rampserve.bench.live import live_arrivals
from rampserve.bench.load import DEFAULT_LOAD
from rampserve.bench.loadgen import Job, LoadResult
from rampserve.bench.results import write_result
from rampserve.bench.sim import _rolling_min_mean
from rampserve.runtime.prepare import PrepareConfig, model_encoder, read_own_data, torch_backend_of
from rampserve.runtime.sources import ModelSource, onnx_file
from rampserve.runtime.user_data import DataOptions, rows_encoder
from rampserve.serving.learning import MANAGED, PROFILING, TRAINING, unprepared_model
from rampserve.serving.shared.settings import DEFAULT_RECORD

# The issue's bars for a model served from cold (issue 49)
MANAGED_GOAL_S = 600.0  # from the server's start to managed mode, at the default --record
P99_GOAL = 1.2  # p99 of the requests that arrive while the training job runs, at most this times vanilla's
ACCURACY_GOAL = 0.99
RECOVERY_GOAL = 0.8  # after relearning, exits pay at least this share of what they paid before the stream changed
JOB_PHASES = (TRAINING, PROFILING)  # the training job runs in these
SATURATION_CLIENTS = 8
SATURATION_ITEMS = 1000  # distinct requests the saturation probe cycles through
REFERENCE_BATCH = 256  # distinct inputs of one shape the reference labels are computed on at once


@dataclass(frozen=True)
class ColdSettings:
    model: str  # an .onnx file or hf:DIR, served unprepared
    data: Path  # its inputs in the order they arrive
    data_options: DataOptions = field(default_factory=DataOptions)
    record: int = DEFAULT_RECORD  # the server's --record
    load: float = DEFAULT_LOAD
    rate_rps: float | None = None  # replaces the load's rate
    trace: str = "maf"
    trace_minutes: int = 8
    duration_s: float = 900.0  # the replay from the server's start
    saturation_s: float = 10.0
    saturation_settle_s: float = 2.0
    server_args: tuple[str, ...] = ()  # more `rampserve serve` options, for every server
    timeout_s: float = 10.0
    start_timeout_s: float = 300.0
    seed: int = 0
    worst_window: int = ACCURACY_WINDOW
    vanilla_margin_s: float = 10.0  # vanilla's replay starts this long before the training job and ends as long after
    vanilla_limit_s: float = 300.0  # the requests compared with vanilla's: those of the job's first seconds, this many
    pause_job_every_s: float | None = None  # stop and go on with the training job in turns of this long
    change_at: int | None = None  # the row where the stream changes: its exits before it, against after relearning
    compare_s: float = 120.0  # of each side of a change, the last this many seconds are compared (vanilla replays them)

    def __post_init__(self) -> None:
        if unprepared_model(self.model) is None:
            raise ValueError(f"--from-cold serves a model with no bundle (an .onnx file or hf:DIR), not {self.model}")
        if self.duration_s <= 0 or self.load <= 0:
            raise ValueError("a replay needs a positive duration and load")


@dataclass(frozen=True)
class Requests:
    """The file's rows as batch-1 requests, in its order, and where each one's input first comes."""

    feeds: list[dict[str, np.ndarray]]
    first: np.ndarray  # per row, the row where its input first comes


def encode_requests(settings: ColdSettings, source: ModelSource, rows: int) -> Requests:
    """The file's first `rows` rows (cycling when it holds fewer) as requests, each distinct input encoded once: a text
    by the model's tokenizer, alone (its own length, as a client sends it)."""
    data = read_own_data(source, PrepareConfig(data=settings.data, data_options=settings.data_options),
                         torch_backend_of(source, None) if source.kind != "onnx" else None)
    first = data.first_occurrences()[np.arange(rows) % len(data)]
    encode = model_encoder(source, "text") if data.kind == "text" else rows_encoder
    encoded = {int(p): encode(data.take(np.array([p]))) for p in np.unique(first)}
    return Requests([encoded[int(p)] for p in first], first)


def reference_labels(source: ModelSource, requests: Requests, workdir: Path) -> np.ndarray:
    """The model's own label for each request: its ONNX file (a checkpoint's export), on ONNX Runtime, on each
    distinct input once (inputs of one shape together, `REFERENCE_BATCH` at a time)."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(onnx_file(source, workdir / "reference.onnx")),
                                   providers=["CPUExecutionProvider"])
    rows, where = np.unique(requests.first, return_index=True)  # each distinct input, and where it first comes
    distinct = {int(p): requests.feeds[int(i)] for p, i in zip(rows, where)}
    by_shape: dict[tuple, list[int]] = {}
    for p, feed in distinct.items():
        by_shape.setdefault(tuple((name, array.shape) for name, array in feed.items()), []).append(p)
    labels = {}
    for rows in by_shape.values():
        for start in range(0, len(rows), REFERENCE_BATCH):
            chunk = rows[start:start + REFERENCE_BATCH]
            feeds = {name: np.concatenate([distinct[p][name] for p in chunk]) for name in distinct[chunk[0]]}
            labels |= dict(zip(chunk, np.asarray(session.run(None, feeds)[0]).argmax(axis=1).tolist()))
    return np.array([labels[int(p)] for p in requests.first])


def serve_command(settings: ColdSettings, home: Path, *options: str):
    """`rampserve serve MODEL` in a RAMPSERVE_HOME of its own (`harness.ServerProcess` gives the ports)."""
    return lambda port, grpc_port: [
        "env", f"RAMPSERVE_HOME={home}", sys.executable, "-m", "rampserve.cli", "serve", settings.model, "--host",
        "127.0.0.1", "--port", str(port), "--grpc-port", str(grpc_port), *options, *settings.server_args]


def phase_of(times_s: np.ndarray, phases: list[dict]) -> np.ndarray:
    """The entry of the server's history (phases with when each began) in force at each time (wall clock)."""
    starts = np.array([p["at"] for p in phases])
    return np.clip(np.searchsorted(starts, times_s, side="right") - 1, 0, None)


def phase_labels(history: list[dict]) -> list[str]:
    """Each entry of the server's history by its phase, those of a relearning (after the first managed spell) told
    apart."""
    first = next((k for k, p in enumerate(history) if p["phase"] == MANAGED), len(history))
    return [p["phase"] if k <= first else f"{p['phase']}, relearning" for k, p in enumerate(history)]


def change_sides(settings: ColdSettings, arrivals: np.ndarray, occurrences: np.ndarray,
                 history: list[dict]) -> dict[str, np.ndarray] | None:
    """The rows compared across the stream's change: the last `compare_s` seconds before it, of the first managed
    spell, and the last `compare_s` seconds of the run, of the last managed spell if it began after the change (a
    relearned generation); None without both."""
    managed = [k for k, p in enumerate(history) if p["phase"] == MANAGED]
    if len(managed) < 2:
        return None
    rows = np.arange(len(arrivals))
    before = rows[(rows < settings.change_at) & (occurrences == managed[0])]
    after = rows[(rows >= settings.change_at) & (occurrences == managed[-1])]
    if not len(before) or not len(after):
        return None
    span_ms = settings.compare_s * 1000.0
    return {"before": before[arrivals[before] >= arrivals[before[-1]] - span_ms],
            "after": after[arrivals[after] >= arrivals[after[-1]] - span_ms]}


def vanilla_replays(settings: ColdSettings, workdir: Path, name: str, inputs: list, requests: Requests,
                    arrivals: np.ndarray, spans: list[tuple[int, int]], progress: bool) -> list[LoadResult]:
    """Each span of rows given again, at the same times, to one fresh vanilla server, one after the other."""
    if not spans:
        return []
    results = []
    with ServerProcess(serve_command(settings, workdir / "vanilla-home-2", "--no-record"),
                       workdir / "vanilla.log", settings.start_timeout_s) as server:
        job = Job(server.url(f"/v2/models/{name}/infer"), inputs, "label", None, settings.timeout_s, lean=True)
        for first, end in spans:
            window = arrivals[first:end] - arrivals[first]
            results.append(run_loadgen(job, requests.feeds[first:end], workdir, "vanilla", window[-1] / 1000.0,
                                       progress, window, np.zeros(0)))
    return results


def change_figures(settings: ColdSettings, cold: LoadResult, correct: np.ndarray, sides: dict[str, np.ndarray],
                   replays: list[LoadResult], spans: list[tuple[int, int]], learning: dict, started: float) -> dict:
    """Exits before the stream's change and after the relearning it caused: early share, p50 and its saving against
    vanilla's p50 of the same requests, accuracy; and each after-figure as a share of its before-figure."""
    figures = {}
    for (side, rows), replay, (first, _) in zip(sides.items(), replays[-2:], spans[-2:]):
        answered = rows[cold.ok[rows] & replay.ok[rows - first]]
        p50, vanilla_p50 = (float(np.percentile(cold.latency_ms[answered], 50)),
                            float(np.percentile(replay.latency_ms[answered - first], 50)))
        figures[side] = {"requests": int(len(rows)), "early_share": float(cold.early[answered].mean()),
                         "accuracy": float(correct[answered].mean()), "p50_ms": p50, "vanilla_p50_ms": vanilla_p50,
                         "p50_saving_ms": vanilla_p50 - p50}
    before, after = figures["before"], figures["after"]
    drifts = learning["drifts"]
    return {**figures, "change_at": settings.change_at,
            "drift_detected_s": drifts[0]["at"] - started if drifts else None,
            "relearned_managed_s": [p for p in learning["phases"] if p["phase"] == MANAGED][-1]["at"] - started,
            "early_share_recovered": after["early_share"] / before["early_share"] if before["early_share"] else None,
            "p50_saving_recovered": after["p50_saving_ms"] / before["p50_saving_ms"]
            if before["p50_saving_ms"] > 0 else None}


class JobPauser:
    """Stops the server's training job and lets it go on, in turns of `every_s` while the job runs, noting when (wall
    clock) each turn began; the job is left running at the end."""

    def __init__(self, status_url: str, model: str, every_s: float) -> None:
        self.status_url, self.model, self.every_s = status_url, model, every_s
        self.turns: list[tuple[float, bool]] = []  # (when, the job runs from then on)
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="job pauser", daemon=True)
        self._job: int | None = None

    def __enter__(self) -> JobPauser:
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._done.set()
        self._thread.join()
        self._signal(True)

    def _signal(self, running: bool) -> None:
        if self._job is None or (self.turns and self.turns[-1][1] == running):
            return
        try:
            os.kill(self._job, signal.SIGCONT if running else signal.SIGSTOP)
        except ProcessLookupError:  # the job ended meanwhile
            return
        self.turns.append((time.time(), running))

    def _run(self) -> None:
        while not self._done.wait(self.every_s):
            learning = get_json(self.status_url)["learning"][self.model]
            if learning["phase"] in JOB_PHASES and learning["job"] is not None:
                self._job = learning["job"]
                self._signal(not self.turns or not self.turns[-1][1])
            else:
                self._signal(True)


def paused_figures(result: LoadResult, arrived: np.ndarray, during_job: np.ndarray,
                   turns: list[tuple[float, bool]]) -> dict:
    """Latency of the requests that arrived while the training job ran against those that arrived while it was
    stopped, all in the job's phases: pooled, and as the ratio of each turn's p99 to the p99 of the stopped turn
    after it (the median and range over such pairs)."""
    starts = np.array([at for at, _ in turns])
    turn = np.searchsorted(starts, arrived[during_job], side="right") - 1  # -1: before the first stop (running)
    running = np.array([True if t < 0 else turns[t][1] for t in turn], dtype=bool)
    latency = result.latency_ms[during_job]
    pairs = []
    for t in range(-1, len(turns) - 1):
        if (t < 0 or turns[t][1]) and not turns[t + 1][1]:
            ran, stopped = latency[turn == t], latency[turn == t + 1]
            if len(ran) and len(stopped):
                pairs.append((float(np.percentile(ran, 99)), float(np.percentile(stopped, 99))))
    return {"running": {"requests": int(running.sum()), **percentiles(latency[running])},
            "stopped": {"requests": int((~running).sum()), **percentiles(latency[~running])},
            "turn_p99_ratio": median_ratio(pairs), "turns": len(turns)}


def phase_figures(result: LoadResult, correct: np.ndarray, phases: np.ndarray) -> dict[str, dict]:
    figures = {}
    for phase in dict.fromkeys(phases):
        mine = phases == phase
        answered = mine & result.ok
        figures[phase] = {"requests": int(mine.sum()), "unanswered": int((mine & ~result.ok).sum()),
                          "early_share": float(result.early[answered].mean()) if answered.any() else None,
                          "accuracy": float(correct[answered].mean()) if answered.any() else None,
                          **percentiles(result.latency_ms[answered])}
    return figures


def run_cold(settings: ColdSettings, json_out: Path | None, progress: bool = True) -> dict:
    source = ModelSource.parse(settings.model)
    name = unprepared_model(settings.model).name
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="rampserve-cold-") as tmp:
        workdir = Path(tmp)
        probe = encode_requests(settings, source, SATURATION_ITEMS)
        inputs = v2_inputs(probe.feeds[0])
        with ServerProcess(serve_command(settings, workdir / "vanilla-home", "--no-record"), workdir / "probe.log",
                           settings.start_timeout_s) as server:
            job = Job(server.url(f"/v2/models/{name}/infer"), inputs, "label", server.url("/status"),
                      settings.timeout_s, clients=SATURATION_CLIENTS, duration_s=settings.saturation_s, lean=True)
            saturation = measure_saturation(job, probe.feeds, name, 1, settings.saturation_settle_s, workdir, progress)
        rate = settings.rate_rps or settings.load * saturation["throughput_rps"]
        count = int(rate * settings.duration_s)
        arrivals = live_arrivals(settings.trace, count, rate, settings.seed, settings.trace_minutes)
        requests = encode_requests(settings, source, count)
        reference = reference_labels(source, requests, workdir)

        started = time.time()
        with ServerProcess(serve_command(settings, workdir / "cold-home", "--record", str(settings.record)),
                           workdir / "cold.log", settings.start_timeout_s) as server:
            job = Job(server.url(f"/v2/models/{name}/infer"), inputs, "label", None, settings.timeout_s, lean=True)
            with contextlib.ExitStack() as stack:
                pauser = None if settings.pause_job_every_s is None else stack.enter_context(
                    JobPauser(server.url("/status"), name, settings.pause_job_every_s))
                cold = run_loadgen(job, requests.feeds, workdir, "from cold", settings.duration_s, progress,
                                   arrivals, np.zeros(0))
            learning = get_json(server.url("/status"))["learning"][name]
            ready_s = server.ready_s
        history = learning["phases"]
        arrived = cold.wall_origin_s + cold.scheduled_ms / 1000.0
        occurrences = phase_of(arrived, history)
        labels = phase_labels(history)
        phases = np.array(labels)[occurrences]
        correct = cold.label == reference
        began: dict[str, float] = {}
        for label, p in zip(labels, history):  # when each phase first began
            began.setdefault(label, p["at"] - started)
        during_job = np.flatnonzero(np.isin(phases, JOB_PHASES) & cold.ok)

        vanilla, compared = None, during_job
        spans = []  # rows replayed on vanilla, each from its first to its end
        if len(during_job):
            compared = during_job[arrivals[during_job] <= arrivals[during_job[0]] + settings.vanilla_limit_s * 1000.0]
            margin_ms = settings.vanilla_margin_s * 1000.0
            spans.append((int(np.searchsorted(arrivals, arrivals[compared[0]] - margin_ms)),
                          int(np.searchsorted(arrivals, arrivals[compared[-1]] + margin_ms, side="right"))))
        sides = change_sides(settings, arrivals, occurrences, history) if settings.change_at is not None else None
        if sides is not None:
            spans += [(int(rows[0]), int(rows[-1]) + 1) for rows in sides.values() if len(rows)]
        replays = vanilla_replays(settings, workdir, name, inputs, requests, arrivals, spans, progress)
        first = spans[0][0] if len(during_job) else 0
        vanilla = replays[0] if len(during_job) else None
    early_done = cold.wall_origin_s + cold.done_ms[cold.early & cold.ok] / 1000.0
    answered = cold.ok
    job_p99, vanilla_p99 = (percentiles(cold.latency_ms[compared])["p99_ms"] if len(compared) else None), None
    if vanilla is not None:
        same = compared[vanilla.ok[compared - first]]
        vanilla_p99 = percentiles(vanilla.latency_ms[same - first])["p99_ms"]
    report = {
        "settings": {**asdict(settings), "data": str(settings.data), "data_options": None},
        "model": name, "rate_rps": rate, "saturation": saturation, "requests": count,
        "machine_load_average": {"before": load_before, "after": os.getloadavg()},
        "ready_s": ready_s,
        "first_answer_s": float(cold.wall_origin_s + cold.done_ms[answered].min() / 1000.0 - started)
        if answered.any() else None,
        "phase_start_s": began,
        "first_exit_s": float(early_done.min() - started) if len(early_done) else None,
        "managed_s": began.get(MANAGED),
        "final_phase": learning["phase"], "reason": learning["reason"],
        "unanswered": int((~answered).sum()), "errors": cold.errors,
        "accuracy": float(correct[answered].mean()) if answered.any() else None,
        "worst_window_accuracy": _rolling_min_mean(correct[answered], settings.worst_window)
        if answered.any() else None,
        "early_share": float(cold.early[answered].mean()) if answered.any() else None,
        "phases": phase_figures(cold, correct, phases),
        "during_training": {"requests": int(len(during_job)), "compared": int(len(compared)), "p99_ms": job_p99,
                            "vanilla_p99_ms": vanilla_p99,
                            "p99_ratio": None if job_p99 is None or not vanilla_p99 else job_p99 / vanilla_p99,
                            "all_p99_ms": percentiles(cold.latency_ms[during_job])["p99_ms"],
                            "vanilla_unanswered": None if vanilla is None else int((~vanilla.ok).sum())},
        "job_paused": None if pauser is None else paused_figures(cold, arrived, during_job, pauser.turns),
        "generation": learning["generation"], "drifts": learning["drifts"],
        "change": None if sides is None else change_figures(settings, cold, correct, sides, replays, spans, learning,
                                                            started),
    }
    report["goals"] = {
        f"managed within {MANAGED_GOAL_S:.0f} s": report["managed_s"] is not None and
        report["managed_s"] <= MANAGED_GOAL_S,
        f"p99 during training <= {P99_GOAL}x vanilla": report["during_training"]["p99_ratio"] is not None and
        report["during_training"]["p99_ratio"] <= P99_GOAL,
        "nothing lost": report["unanswered"] == 0,
        f"accuracy >= {ACCURACY_GOAL}": report["accuracy"] is not None and report["accuracy"] >= ACCURACY_GOAL,
    }
    if settings.change_at is not None:
        change = report["change"]
        report["goals"] |= {
            f"exit share and p50 saving recover to >= {RECOVERY_GOAL} of before the change": change is not None and
            all(change[k] is not None and change[k] >= RECOVERY_GOAL
                for k in ("early_share_recovered", "p50_saving_recovered")),
            f"every {settings.worst_window} answers >= {ACCURACY_GOAL}": report["worst_window_accuracy"] is not None
            and report["worst_window_accuracy"] >= ACCURACY_GOAL}
    write_result(report, json_out)
    return report


def cold_table(report: dict) -> Table:
    table = Table(title=f"{report['model']} from cold at {report['rate_rps']:.1f} rps: ready {fmt(report['ready_s'], '.1f')} "
                        f"s, first exit {fmt(report['first_exit_s'], '.0f')} s, managed {fmt(report['managed_s'], '.0f')} s "
                        f"after the server's start")
    for column in ("phase", "from s", "requests", "p50 ms", "p99 ms", "early", "accuracy", "unanswered"):
        table.add_column(column, justify="left" if column == "phase" else "right")
    for phase, figures in report["phases"].items():
        table.add_row(phase, fmt(report["phase_start_s"].get(phase), ".0f"), str(figures["requests"]),
                      fmt(figures["p50_ms"], ".2f"), fmt(figures["p99_ms"], ".2f"), fmt(figures["early_share"], ".1%"),
                      fmt(figures["accuracy"], ".4f"), str(figures["unanswered"]))
    during = report["during_training"]
    table.caption = (f"while the training job ran: p99 {fmt(during['p99_ms'], '.2f')} ms against vanilla's "
                     f"{fmt(during['vanilla_p99_ms'], '.2f')} ms on the same requests ({fmt(during['p99_ratio'], '.2f')}x); "
                     f"accuracy {fmt(report['accuracy'], '.4f')} over every answer (worst "
                     f"{report['settings']['worst_window']}: {fmt(report['worst_window_accuracy'], '.4f')}); "
                     f"load average {report['machine_load_average']['before'][0]:.1f} before, "
                     f"{report['machine_load_average']['after'][0]:.1f} after")
    if (change := report.get("change")) is not None:
        before, after = change["before"], change["after"]
        table.caption += (f"; the stream changed at row {change['change_at']}, drift seen at "
                          f"{fmt(change['drift_detected_s'], '.0f')} s, relearned ramps managed at "
                          f"{change['relearned_managed_s']:.0f} s: early {before['early_share']:.1%} before, "
                          f"{after['early_share']:.1%} after ({fmt(change['early_share_recovered'], '.2f')}x), p50 "
                          f"saving {before['p50_saving_ms']:.2f} ms before, {after['p50_saving_ms']:.2f} ms after "
                          f"({fmt(change['p50_saving_recovered'], '.2f')}x)")
    if (paused := report["job_paused"]) is not None:
        ratio = paused["turn_p99_ratio"]
        table.caption += (f"; the job stopped in turns: p99 {fmt(paused['running']['p99_ms'], '.2f')} ms while it ran "
                          f"against {fmt(paused['stopped']['p99_ms'], '.2f')} ms while stopped, per turn "
                          + ("-" if ratio is None else f"{ratio['median']:.2f}x ({ratio['min_max'][0]:.2f}-"
                                                       f"{ratio['min_max'][1]:.2f})"))
    return table
