"""`rampserve bench live`: vanilla and rampserve serving the same model, for real, on the same trace and stream.

One run: start the vanilla server; measure its saturation throughput (closed loop) and its latency with one
request at a time (against the model's own batch-1 time in this process: the server's overhead). Then, at each
stated load (`LiveSettings.loads`, rising), both systems start afresh, take their warm-ups, and replay the stream
open loop at that load's rate from separate client processes (`rampserve.bench.loadgen`, its lean client by
default): vanilla and rampserve on the same requests at the same times, the measured requests in slices that the
two take in turns (`replay_round`), for `replay_rounds` rounds that alternate which goes first. Released labels
are scored against the original model's, computed here from the bundle; the trace simulator's oracle on the same
stream and arrivals gives the savings an exit policy could reach.

A load is what `bench sim` calls one (`rate_at_load`): the replay's mean rate as a share of what vanilla sustains
back to back, here vanilla's measured closed-loop saturation (the simulator, with no server to measure, takes the
model's batch-1 capacity). `--rate` replaces the load's rate; the run then reports the load that rate came to.
With `--simulated-seeds` no server starts: the replays of several seeds go through the simulator alone
(`simulate_replays`).

Per-system figures carry `bench sim`'s keys. Latency percentiles, accuracy and exits are over answered requests;
shed (429/503) and failed requests (other errors, timeouts) are counted apart. The server's CPU over the measured
requests comes from the kernel's accounting of its processes and threads (`cpu`), per answered request beside it
(`cpu_ms_per_answer`): what management costs, whatever it saves. From the server's own status:
configurations it adopted during the run, of them those that changed the ramp set and those that moved thresholds
alone, and its event loop's lag (`server_figures`).

Each system's `saturation_rps` is its own closed-loop saturation, measured as `bench peers` measures it
(`measure_saturation`, the median of `saturation_rounds` probes, every round reported), after its last replay at
the highest load: the replays meet the servers as they always did, the probe meets a controller that has learnt
the stream, and the two systems' probes run back to back. Vanilla's probe before the replays (the report's
`saturation`) sets their rates. `windows_below_share` is the share
of 1,000-request windows (answered requests, in order) whose accuracy is below 1 − the accuracy constraint; the
managed system also reports its `exit_mode` and `feedback_share`. `versus_vanilla` puts issue 17's figures for
exits side by side at each load: saturation (closed loop, the same at every load), p50 and p99 of the replay at
that load and CPU per answer as ratios to vanilla paired within each round (the median over rounds, and every
round's), accuracy in the worst round; with a `bench sim` report at one of the loads
(`read_simulator_saving`), the live p50 saving beside the simulator's. `latency_by_load` gathers each system's p50
and p99 at every load.
"""
from __future__ import annotations

import contextlib
import functools
import itertools
import json
import math
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
from rich.table import Table
from tqdm.auto import tqdm

from rampserve.bench.cpu import cpu_used, wait_until_quiet
from rampserve.bench.figures import ACCURACY_WINDOW, configuration_changes, exit_mode_figures, windows_below_share
from rampserve.bench.harness import (
    QUANTILES,
    TRANSPORTS,
    ServerProcess,
    encode_items,
    fmt,
    get_json,
    mean_batch_size,
    measure_saturation,
    median_ratio,
    most_frequent,
    percentiles,
    rampserve_serve,
    ratio,
    renamed,
    require_answers,
    run_loadgen,
)
from rampserve.bench.load import DEFAULT_LOAD, rate_at_load
from rampserve.bench.loadgen import Job, LoadResult
from rampserve.bench.own_data import OwnDataSettings
from rampserve.bench.ramp_outputs import RampOutputs, ramp_outputs
from rampserve.bench.results import write_result
from rampserve.bench.sim import (
    Scenario,
    _rolling_min_mean,
    input_lengths,
    measured_part,
    replay,
    replay_oracle,
    summarize,
    with_savings,
)
from rampserve.bench.stages import paired_stage_costs, stage_costs, tail_stage_costs
from rampserve.bundle_format.latency import serving_limits
from rampserve.control.controller import Controller, ControllerSettings
from rampserve.control.costs import CostModel
from rampserve.control.records import Configuration, validation_record
from rampserve.control.settings import EXIT_MODE_CHOICES
from rampserve.runtime.bundle import load_bundle
from rampserve.runtime.prepared import PreparedModel
from rampserve.runtime.timing import interleaved_medians
from rampserve.workloads.streams import DEFAULT_LENGTH, Stream, get_stream
from rampserve.workloads.traces import MAF_MINUTE_S, arrival_times

SATURATION_ITEMS = 1000  # distinct inputs the closed-loop probes cycle through
FEEDING_CLIENTS = 8  # closed-loop clients of the probe of whether the front end keeps batches full (issue 15)
# Issue 31's bars for a managed server against vanilla in the same run (`versus_vanilla`): management costs nothing
# (release keeps vanilla's saturation and CPU per answer; stop, which skips the rest of the model, raises saturation)
SATURATION_GOALS = {"release": 0.97, "stop": 1.3}  # managed closed-loop saturation at least this times vanilla's
P50_GOAL, P99_GOAL = 0.85, 1.05  # the replay's p50 and p99 at most these times vanilla's, at the load it ran at
CPU_GOAL = 1.05  # the server's CPU per answered request (release) at most this times vanilla's
# The live p50 saving (ms) at least this share of the simulator's on the same requests and arrivals
SAVING_GOAL = 0.8
ACCURACY_GOAL = 0.99
CLIENTS = ("lean", "aiohttp")


@dataclass(frozen=True)
class LiveSettings(OwnDataSettings):
    model: str = "resnet18-fmnist"  # a zoo model; with `data`, any source
    workload: str = "fmnist-drift"
    trace: str = "maf"
    # The replays' loads (`rate_at_load`): shares of vanilla's measured closed-loop saturation, each replayed once
    loads: tuple[float, ...] = (DEFAULT_LOAD,)
    rate_rps: float | None = None  # replaces the one load's rate
    duration_s: float = 60.0  # measured part of each replay (each system at each load), in trace time
    warmup_requests: int = 300  # sent before each measured run at the target rate, then discarded
    # maf: trace minutes replayed within `duration_s` (one period of its trend); see `live_arrivals`
    trace_minutes: int = 8
    slo_ms: float | None = None  # default: twice the profiled batch-1 latency (DESIGN §8)
    max_batch: int | None = None  # default: the largest profiled batch size that fits the SLO, as `bench sim`
    # 0: work-conserving, as the simulator's queue: a request that finds the worker idle is never held back to
    # wait for company. Waiting buys little on these CPUs: resnet18-fmnist's profiled batch of 2 costs 95% of two
    # batches of 1 (and its SLO allows no larger batch).
    max_delay_ms: float = 0.0
    saturation_s: float = 10.0  # closed-loop probe of each server's throughput ...
    saturation_settle_s: float = 2.0  # ... whose first seconds are not counted ...
    saturation_rounds: int = 3  # ... repeated, one client process each: the median is the saturation
    saturation_clients: int | None = None  # default: 2 × max batch + 2, enough to keep every batch full
    sequential_requests: int = 500  # one at a time against idle vanilla: the server's overhead
    inprocess_rounds: int = 500  # batch-1 runs of the model in this process
    timeout_s: float = 10.0  # a request unanswered by then has failed
    worst_window: int = ACCURACY_WINDOW  # also the windows of `windows_below_share`
    seed: int = 0
    stream_length: int = DEFAULT_LENGTH  # the stream `bench sim` replays: the same inputs at the same positions
    start_timeout_s: float = 300.0  # a server must be ready within this
    server_args: tuple[str, ...] = ()  # more `rampserve serve` options, given to both servers (e.g. --ramp-budget)
    accuracy_constraint: float = 0.01  # the managed server's (`--accuracy-constraint`); windows are judged by it
    # The managed server's exit mode (`--exit-mode`: release or stop) and the share of exited rows it runs to the
    # end (`--feedback-share`); None: not passed, the server's defaults
    exit_mode: str | None = None
    feedback_share: float | None = None
    # More of the managed server's controller settings, as ControllerSettings fields given to it as `rampserve serve`
    # options (objective, guarantee, risk_target_share, confidence, search_every, history, shadow_share, prime); absent:
    # the server's defaults
    controller: dict[str, float | int | str | bool] = field(default_factory=dict)
    # What the client speaks: v2 over HTTP with Triton's binary tensors, or KServe v2 over gRPC (raw contents). The
    # one-at-a-time overhead is measured over both either way.
    transport: str = "http"
    # Who sends over HTTP: the lean client (one thread on blocking sockets, `loadgen.LeanHttpClient`) or aiohttp on an
    # event loop. Client and servers share this machine's cores, so what the client spends on each answer it also
    # adds to the answers it times: aiohttp's loop read answers released mid-run 1.5 ms later than a raw-socket
    # client on minilm-rt, while whole-model answers were timed alike.
    client: str = "lean"
    # Replays of each load per system, alternating which goes first: ratios are paired within a round, and the
    # median over rounds is what the goals judge
    replay_rounds: int = 3
    # A round's measured requests go in this many slices, the systems taking turns (ABBA; the warm-ups of both come
    # first), so that both meet the machine as it is within seconds of each other: replayed whole, one after the
    # other, the two systems' measured minutes lay ~4 min apart (the warm-up between), and this shared VM ran
    # minilm-rt's batch 1 at 8.0 ms in one minute and 12.4 in the next (interleaved draws, 150 runs each)
    replay_slices: int = 4
    # The replays ask both servers for each answer's trace (`loadgen.Job.trace`): where each request's time went
    # (`stages`), in both systems alike
    traced: bool = True

    def __post_init__(self) -> None:
        if self.saturation_s <= self.saturation_settle_s:
            raise ValueError(f"a saturation probe ({self.saturation_s} s) must outlast its settling "
                             f"({self.saturation_settle_s} s)")
        if not self.loads:
            raise ValueError("name at least one load")
        for load in self.loads:
            if not (math.isfinite(load) and load > 0):
                raise ValueError(f"a load is a positive share of vanilla's saturation, got {load}")
        if len(set(self.loads)) != len(self.loads):
            raise ValueError(f"each load once, got {self.loads}")
        if self.rate_rps is not None and len(self.loads) > 1:
            raise ValueError(f"a rate replaces one load's rate, not each of {len(self.loads)} loads'")
        if self.replay_rounds < 1:
            raise ValueError(f"a load is replayed at least once, got {self.replay_rounds} rounds")
        if self.replay_slices < 1:
            raise ValueError(f"a replay goes in at least one slice, got {self.replay_slices}")
        if self.saturation_rounds < 1:
            raise ValueError(f"saturation takes at least one round, got {self.saturation_rounds}")
        if self.seed < 0:
            raise ValueError(f"a seed is a non-negative integer, got {self.seed}")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport is one of {TRANSPORTS}, not {self.transport!r}")
        if self.client not in CLIENTS:
            raise ValueError(f"client is one of {CLIENTS}, not {self.client!r}")
        if self.exit_mode is not None and self.exit_mode not in EXIT_MODE_CHOICES:
            raise ValueError(f"exit mode is one of {EXIT_MODE_CHOICES}, not {self.exit_mode!r}")
        if self.feedback_share is not None and not 0.0 < self.feedback_share <= 1.0:
            raise ValueError(f"feedback share must lie in (0, 1], got {self.feedback_share}")
        ControllerSettings(**self.controller)  # what the server would refuse to start with

    def controller_settings(self) -> ControllerSettings:
        """The managed server's controller settings as this run passes them (`server_args`, which the bench does not
        read, may change others)."""
        return ControllerSettings(**{**self.controller, "accuracy_constraint": self.accuracy_constraint,
                                     **({"exit_mode": self.exit_mode} if self.exit_mode is not None else {}),
                                     **({"feedback_share": self.feedback_share}
                                        if self.feedback_share is not None else {})})

    def managed_args(self) -> tuple[str, ...]:
        """`rampserve serve` options of the managed server alone, before `server_args` (which may override)."""
        return ("--accuracy-constraint", f"{self.accuracy_constraint:g}",
                *(("--exit-mode", self.exit_mode) if self.exit_mode is not None else ()),
                *(("--feedback-share", f"{self.feedback_share:g}") if self.feedback_share is not None else ()),
                *(arg for name, value in self.controller.items() for arg in _option(name, value)))


def _option(name: str, value: float | int | str | bool) -> tuple[str, ...]:
    """A ControllerSettings field as `rampserve serve` takes it: `--name value`, or `--name`/`--no-name` for a flag."""
    flag = name.replace("_", "-")
    if isinstance(value, bool):
        return (f"--{flag}" if value else f"--no-{flag}",)
    return f"--{flag}", f"{value:g}" if isinstance(value, float) else str(value)


def parse_loads(text: str) -> tuple[float, ...]:
    """`--loads` as given ("0.1,0.2,0.3,0.5"), in rising order. A part that is not a number is refused here; a number
    that is no load, and a load named twice, by `LiveSettings`."""
    loads = []
    for part in text.split(","):
        try:
            loads.append(float(part))
        except ValueError:
            raise ValueError(f"loads are numbers separated by commas, as 0.1,0.2,0.3,0.5; {part.strip()!r} in "
                             f"{text!r} is not one") from None
    return tuple(sorted(loads))


# --- statistics (pure) ----------------------------------------------------------------------------------------

def live_arrivals(trace: str, n: int, rate_rps: float, seed: int, trace_minutes: int) -> np.ndarray:
    """n arrival times (ms) at a mean rate of exactly `rate_rps`: a trace's n arrivals drift from its rate by chance
    (the last of them arrives a few percent early or late), so its time axis is stretched to end at n / rate.

    maf changes its rate once a trace minute, so a run of a minute or two would replay one or two levels only: its
    arrivals are drawn at a k times lower rate, spanning `trace_minutes` minutes, and replayed k times faster. Same
    sequence of rate levels, each held for 60/k s instead of 60 s (still thousands of service times, so queues
    settle at every level)."""
    speedup = max(1.0, trace_minutes * MAF_MINUTE_S * rate_rps / n) if trace == "maf" else 1.0
    drawn = arrival_times(trace, n, rate_rps / speedup, seed=seed)
    return drawn * (n / rate_rps * 1000.0 / drawn[-1]) if n else drawn


def server_figures(before: dict | str | None, after: dict | str | None, model: str) -> dict[str, float | None]:
    """What the server reports of itself between two status reads: `config_changes` (how far the model's
    configuration version moved), of the controller's decisions in between those that changed the ramp set and
    those that moved thresholds alone (`decision_changes`), `loop_lag_samples_over_5ms` (event-loop lag samples
    over 5 ms taken in between) and `max_loop_lag_ms`, the largest lag since the server became ready: the status
    keeps no maximum per run, so this bounds the run's from above (a vanilla server's covers its saturation probe
    too). None where a report lacks the figure (a peer server, a failed read)."""
    def change(*path: str) -> float | None:
        first, last = _status_number(before, path), _status_number(after, path)
        return None if first is None or last is None else last - first

    return {"config_changes": change("models", model, "configuration", "version"),
            **decision_changes(before, after, model),
            "max_loop_lag_ms": _status_number(after, ("event_loop", "max_lag_ms")),
            "loop_lag_samples_over_5ms": change("event_loop", "lag_samples_over_5ms")}


def decision_changes(before: dict | str | None, after: dict | str | None, model: str) -> dict[str, int | None]:
    """`configuration_changes` of the controller decisions the model's status lists at the second read from the one
    in force at the first read on (decisions carry their configuration's version); None for both where either read
    lists none (a vanilla server, a failed read)."""
    first, last = _decisions(before, model), _decisions(after, model)
    if not first or not last:
        return {"ramp_set_changes": None, "threshold_changes": None}
    since = [d for d in last if d["version"] >= first[-1]["version"]]
    return configuration_changes([d["sites"] for d in since])


def _decisions(status: dict | str | None, model: str) -> list[dict] | None:
    model_status = status.get("models", {}).get(model) if isinstance(status, dict) else None
    decisions = model_status.get("decisions") if isinstance(model_status, dict) else None
    return decisions if isinstance(decisions, list) else None


def _status_number(status: dict | str | None, path: tuple[str, ...]) -> float | None:
    """The number at `path` in a status report, or None if the report has none there."""
    for key in path:
        if not isinstance(status, dict):
            return None
        status = status.get(key)
    return status if isinstance(status, int | float) and not isinstance(status, bool) else None


FIRST_REQUESTS = 1000  # the measured requests `summarize_live`'s "first_requests" figures are over


def summarize_live(result: LoadResult, reference: np.ndarray, worst_window: int,
                   batch_size: float | None, min_accuracy: float = 0.99) -> dict:
    """`bench sim`'s per-system figures for one live run (savings come from `with_savings`), plus what only a live
    run has: requests shed and failed, the offered rate, and how late the client sent. `windows_below_share`
    judges windows of `worst_window` answered requests against `min_accuracy` (1 − the accuracy constraint)."""
    ok = result.ok
    answered = int(ok.sum())
    correct = result.label[ok] == reference[ok]
    early = result.early[ok]
    latency = result.latency_ms[ok]
    span_ms = float(result.done_ms[ok].max() - result.scheduled_ms.min()) if answered else 0.0
    exit_sites = result.exit_site[ok]
    return {
        "accuracy": float(correct.mean()) if answered else None,
        "worst_window_accuracy": _rolling_min_mean(correct, worst_window) if answered else None,
        "windows_below_share": windows_below_share(correct, min_accuracy, worst_window),
        **percentiles(latency),
        "mean_ms": float(latency.mean()) if answered else None,
        "throughput_rps": answered / span_ms * 1000.0 if span_ms > 0 else 0.0,
        "exit_share": float(early.mean()) if answered else None,
        # A server's start, where the measured requests are its first (`--warmup-requests 0`): what issue 50 asks of
        # exits from the first request
        "first_requests": {"requests": min(answered, FIRST_REQUESTS),
                           "exit_share": float(early[:FIRST_REQUESTS].mean()) if answered else None,
                           "accuracy": float(correct[:FIRST_REQUESTS].mean()) if answered else None},
        "mean_batch_size": batch_size,
        "exit_share_by_site": {site: float(np.mean(exit_sites == i)) for i, site in enumerate(result.sites)},
        # where an exit's time goes: an answer released at a ramp should come back in about the model's time to it
        "p50_ms_by_exit_site": {site: float(np.median(latency[exit_sites == i]))
                                for i, site in (*enumerate(result.sites), (-1, "final")) if np.any(exit_sites == i)},
        "requests": len(ok),
        "answered": answered,
        "shed": int(result.shed.sum()),
        "failed": int(result.failed.sum()),
        # arrival processes start at 0, so n arrivals up to the last one is the rate they were drawn at
        "rate_rps": len(ok) / float(result.scheduled_ms.max()) * 1000.0 if len(ok) else 0.0,
        "duration_s": float(result.done_ms.max()) / 1000.0 if len(ok) else 0.0,
        **percentiles(result.sent_ms - result.scheduled_ms, prefix="client_lateness_"),
        "errors": most_frequent(result.errors),
        "stages": None if result.trace_ms is None else stage_costs(result),
        "tail_stages": None if result.trace_ms is None else tail_stage_costs(result),
    }


def with_oracle_share(systems: dict[str, dict], oracle_p50_savings: float | None) -> dict[str, dict]:
    """Savings against vanilla (`bench sim`'s `with_savings`), and each system's p50 savings as a share of the
    oracle's (simulated on the same arrivals and inputs; None when the oracle saves nothing)."""
    systems = with_savings(systems)
    for summary in systems.values():
        summary["oracle_share"] = summary["p50_savings"] / oracle_p50_savings if oracle_p50_savings else None
    return systems


def binned_percentile(times_ms: np.ndarray, values: np.ndarray, bin_ms: float, q: float
                      ) -> tuple[np.ndarray, np.ndarray]:
    """(bin starts, the q-th percentile of the values whose time falls in each bin; NaN for an empty bin)."""
    if not len(times_ms):
        return np.zeros(0), np.zeros(0)
    bins = (np.asarray(times_ms) // bin_ms).astype(np.int64)
    out = np.full(int(bins.max()) + 1, np.nan)
    for b in np.unique(bins):
        out[b] = np.percentile(values[bins == b], q)
    return np.arange(len(out)) * bin_ms, out


def _mode(summary: dict) -> str:
    """A managed system's exit mode and feedback share ("-" for a system without exits)."""
    if summary.get("exit_mode") is None:
        return "-"
    return f"{summary['exit_mode']} {fmt(summary.get('feedback_share'), '.2f')}"


def table_rows(entry: dict) -> list[tuple[str, ...]]:
    """One row per system of one load's entry: what `live_table` prints, ratios to vanilla last."""
    vanilla = entry["systems"]["vanilla"]
    rows = []
    for name, s in entry["systems"].items():
        rows.append((
            name, str(s["requests"]), str(s["shed"]), str(s["failed"]),
            *(fmt(s[f"p{q}_ms"], ".2f") for q in QUANTILES), fmt(s["throughput_rps"], ".1f"),
            fmt(s.get("saturation_rps"), ".1f"),
            fmt(s["accuracy"], ".4f"), fmt(s["worst_window_accuracy"], ".3f"),
            fmt(s.get("windows_below_share"), ".1%"), fmt(s["exit_share"], ".1%"), _mode(s),
            fmt(s["mean_batch_size"], ".2f"), fmt(s.get("config_changes"), "d"),
            fmt(s.get("ramp_set_changes"), "d"), fmt(s.get("threshold_changes"), "d"),
            fmt(s.get("max_loop_lag_ms"), ".1f"), fmt(s.get("loop_lag_samples_over_5ms"), "d"),
            fmt(s.get("cpu_ms_per_answer"), ".3f"),
            *(fmt(ratio(s.get(key), vanilla.get(key)), ".2f")
              for key in ("saturation_rps", "p50_ms", "p99_ms", "throughput_rps", "cpu_ms_per_answer")),
            fmt(s.get("oracle_share"), ".2f"),
        ))
    return rows


TABLE_COLUMNS = ("system", "sent", "shed", "failed", "p25 ms", "p50 ms", "p95 ms", "p99 ms", "rps", "sat rps",
                 "accuracy", "worst 1k", "1k <target", "exits", "exit mode", "mean batch", "configs",
                 "set changes", "threshold changes", "max loop lag ms", "lag >5 ms", "CPU ms/answer", "sat ×van",
                 "p50 ×van", "p99 ×van", "rps ×van", "CPU ×van", "oracle share")


def _at_most(value: float | None, bound: float) -> bool | None:
    return None if value is None else value <= bound


def _at_least(value: float | None, bound: float) -> bool | None:
    return None if value is None else value >= bound


def versus_vanilla(rounds: list[tuple[dict, dict]], load: float | None) -> dict:
    """Issue 17's figures for a managed server's exits against vanilla's, from one run's replay rounds, each a
    (vanilla, managed) pair of summaries taken back to back: closed-loop saturation (measured once per system: the
    median of its probes; `ratio_range` spans the lowest managed probe over the highest vanilla one to the
    reverse); p50, p99 and CPU per answer with their ratio paired within each round, the median over rounds
    (`ratio_rounds`: every round's, so the spread shows); accuracy over every answered request (and over every
    request sent, an unanswered one counting as a disagreement) in the worst round. `load` is the replay's rate
    over vanilla's saturation: the latency figures and accuracy were measured there, and each latency figure says
    so. Each goal is judged on the medians (accuracy on the worst round), None where a figure is missing."""
    if not rounds:
        raise ValueError("no replay round to compare")
    vanilla, managed = rounds[0]  # saturation and exit mode are the same in every round

    def saturation_rounds(summary: dict) -> list[float]:
        return list((summary.get("saturation") or {}).get("rounds_rps") or [])

    def paired(key: str) -> dict:
        values = [(m.get(key), v.get(key)) for v, m in rounds]
        known = [value for pair in values for value in pair]
        over_rounds = median_ratio(values)
        return {"vanilla": _median_known([v for _, v in values]), "rampserve": _median_known([m for m, _ in values]),
                "ratio": None if over_rounds is None or None in known else over_rounds["median"],
                "ratio_rounds": [ratio(m, v) for m, v in values], "load": load}

    def worst(key: str, pick=min) -> float | None:
        known = [m.get(key) for _, m in rounds]
        return None if None in known else pick(known)

    sat_vanilla, sat_managed = vanilla.get("saturation_rps"), managed.get("saturation_rps")
    vanilla_rounds, managed_rounds = saturation_rounds(vanilla), saturation_rounds(managed)
    ratio_range = [min(managed_rounds) / max(vanilla_rounds), max(managed_rounds) / min(vanilla_rounds)] \
        if vanilla_rounds and managed_rounds and min(vanilla_rounds) > 0 else None
    saturation_ratio = ratio(sat_managed, sat_vanilla)
    saturation_goal = SATURATION_GOALS[managed.get("exit_mode") or "release"]
    p50, p99, cpu = paired("p50_ms"), paired("p99_ms"), paired("cpu_ms_per_answer")
    over_all = [m["accuracy"] * m["answered"] / m["requests"] if m["accuracy"] is not None and m["requests"]
                else None for _, m in rounds]
    accuracy = worst("accuracy")
    return {
        "exit_mode": managed.get("exit_mode"), "feedback_share": managed.get("feedback_share"),
        "load": load, "rounds": len(rounds),
        "saturation_rps": {"vanilla": sat_vanilla, "rampserve": sat_managed, "ratio": saturation_ratio,
                           "ratio_range": ratio_range, "vanilla_rounds": vanilla_rounds,
                           "rampserve_rounds": managed_rounds},
        "p50_ms": p50, "p99_ms": p99,
        "accuracy": accuracy, "accuracy_over_all_requests": None if None in over_all else min(over_all),
        "worst_window_accuracy": worst("worst_window_accuracy"),
        "windows_below_share": worst("windows_below_share", max),
        "cpu_ms_per_answer": cpu,
        "goals": {
            f"saturation_at_least_{saturation_goal:g}x": _at_least(saturation_ratio, saturation_goal),
            f"p50_at_most_{P50_GOAL:g}x": _at_most(p50["ratio"], P50_GOAL),
            f"p99_at_most_{P99_GOAL:g}x": _at_most(p99["ratio"], P99_GOAL),
            f"accuracy_at_least_{ACCURACY_GOAL:g}": _at_least(accuracy, ACCURACY_GOAL),
            # stop mode skips work: its CPU per answer has no bar of its own beyond saturation
            f"cpu_per_answer_at_most_{CPU_GOAL:g}x":
                _at_most(cpu["ratio"], CPU_GOAL) if managed.get("exit_mode") != "stop" else None,
        },
    }


def _median_known(values: list[float | None]) -> float | None:
    return None if None in values or not values else float(np.median(values))


@dataclass(frozen=True)
class SimulatorSaving:
    """What `bench sim` found rampserve saves at the median against vanilla, from its JSON report."""

    source: str  # the report's path
    load: float  # the live run's load it matches
    p50_saving_ms: float  # simulated vanilla p50 less rampserve's; the median over the report's seeds
    p50_savings: float  # the same as a share of vanilla's simulated p50
    seeds: int


def read_simulator_saving(path: Path, settings: LiveSettings) -> SimulatorSaving:
    """The p50 saving of a `bench sim --json` report (one seed, or the median over `--seeds N`), refused unless it
    simulated this run's model, workload and trace at one of the run's stated loads."""
    if settings.rate_rps:
        raise ValueError("the simulator's saving goes beside the live one at a stated load; a given rate states none")
    try:
        data = json.loads(path.read_text())
        runs = data["seeds"] if "seeds" in data else [data]
        simulated = {key: {run[key] for run in runs} for key in ("model", "workload", "trace", "load")}
        savings_ms = [run["systems"]["vanilla"]["p50_ms"] - run["systems"]["rampserve"]["p50_ms"] for run in runs]
        shares = [run["systems"]["rampserve"]["p50_savings"] for run in runs]
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise ValueError(f"{path} is not a `bench sim --json` report: {type(exc).__name__}: {exc}") from None
    ran = {"model": settings.model, "workload": settings.workload_label, "trace": settings.trace}
    for key, value in ran.items():
        if simulated[key] != {value}:
            raise ValueError(f"{path} simulated {key} {sorted(simulated[key])}, this run {value!r}")
    load, *other_loads = sorted(simulated["load"])
    matching = [] if other_loads else [stated for stated in settings.loads if math.isclose(stated, load, rel_tol=1e-6)]
    if not matching:
        raise ValueError(f"{path} simulated load {sorted(simulated['load'])}; this run replays at loads "
                         f"{sorted(settings.loads)}: name its load among them")
    return SimulatorSaving(str(path), matching[0], float(np.median(savings_ms)), float(np.median(shares)), len(runs))


def p50_saving_ms(vanilla: dict, managed: dict) -> float | None:
    """Vanilla's p50 less rampserve's (ms), None where either is missing."""
    return None if vanilla["p50_ms"] is None or managed["p50_ms"] is None else vanilla["p50_ms"] - managed["p50_ms"]


def beside_simulator(vanilla: dict, managed: dict, simulator: SimulatorSaving) -> dict:
    """The live p50 saving (`p50_saving_ms`) beside the simulator's at the same load, and their ratio (None where a
    figure is missing)."""
    live = p50_saving_ms(vanilla, managed)
    return {"live": live, "simulator": simulator.p50_saving_ms, "ratio": ratio(live, simulator.p50_saving_ms),
            "load": simulator.load}


def latency_by_load(entries: list[dict]) -> dict[str, list[dict]]:
    """Per system, its replay's p50 and p99 at every load in the order run, with what went unanswered."""
    keys = ("p50_ms", "p99_ms", "answered", "shed", "failed")
    names = list(dict.fromkeys(name for entry in entries for name in entry["systems"]))
    return {name: [{"load": entry["load"], "rate_rps": entry["rate_rps"],
                    **{key: entry["systems"][name][key] for key in keys}} for entry in entries]
            for name in names}


def load_table(report: dict) -> Table:
    """`latency_by_load` as a table, one row per load: each system's p50 and p99 and rampserve's over vanilla's."""
    curves = report["latency_by_load"]
    table = Table(title=f"{report['model']} on {report['workload']}, {report['trace']} trace: latency against load "
                        f"(shares of vanilla's saturation, {fmt(report['saturation_rps'], '.0f')} rps)")
    for column in ("load", "rps", "vanilla p50 ms", "rampserve p50 ms", "p50 ×van", "vanilla p99 ms",
                   "rampserve p99 ms", "p99 ×van", "unanswered (van / rs)"):
        table.add_column(column, justify="right")
    for base, managed in zip(curves["vanilla"], curves["rampserve"], strict=True):
        table.add_row(fmt(base["load"], "g"), fmt(base["rate_rps"], ".0f"),
                      fmt(base["p50_ms"], ".2f"), fmt(managed["p50_ms"], ".2f"),
                      fmt(ratio(managed["p50_ms"], base["p50_ms"]), ".2f"),
                      fmt(base["p99_ms"], ".2f"), fmt(managed["p99_ms"], ".2f"),
                      fmt(ratio(managed["p99_ms"], base["p99_ms"]), ".2f"),
                      f"{base['shed'] + base['failed']} / {managed['shed'] + managed['failed']}")
    return table


def versus_table(entry: dict) -> Table:
    """One load's `versus_vanilla` as a table: each figure for vanilla and rampserve, their ratio and the goal's
    verdict, and the live p50 saving beside the simulator's where the run has it."""
    versus = entry["versus_vanilla"]
    saturation = versus["saturation_rps"]
    spread = saturation["ratio_range"]
    table = Table(title=f"rampserve ({_mode(versus)}) against vanilla, same run; replay at load "
                        f"{fmt(versus['load'], 'g')} (of vanilla's saturation), {versus['rounds']} round(s): "
                        "ratios paired within rounds, the median (min-max)")
    for column in ("figure", "vanilla", "rampserve", "ratio", "goal", "met"):
        table.add_column(column, justify="right")
    goals = list(versus["goals"].items())

    def verdict(index: int) -> tuple[str, str]:
        name, met = goals[index]
        return name, "-" if met is None else ("yes" if met else "no")

    rounds = "/".join(f"{r:.0f}" for r in saturation["rampserve_rounds"])
    base_rounds = "/".join(f"{r:.0f}" for r in saturation["vanilla_rounds"])
    table.add_row("saturation rps (rounds)", f"{fmt(saturation['vanilla'], '.0f')} ({base_rounds})",
                  f"{fmt(saturation['rampserve'], '.0f')} ({rounds})",
                  fmt(saturation["ratio"], ".2f") + ("" if spread is None else f" ({spread[0]:.2f}-{spread[1]:.2f})"),
                  *verdict(0))
    for index, key in ((1, "p50_ms"), (2, "p99_ms")):
        figure = versus[key]
        table.add_row(key.replace("_", " "), fmt(figure["vanilla"], ".2f"), fmt(figure["rampserve"], ".2f"),
                      paired_cell(figure), *verdict(index))
    table.add_row("accuracy, answered (all sent)", "", f"{fmt(versus['accuracy'], '.4f')} "
                  f"({fmt(versus['accuracy_over_all_requests'], '.4f')})", "", *verdict(3))
    table.add_row("1k windows below target", "", fmt(versus["windows_below_share"], ".1%"), "", "", "")
    cpu = versus["cpu_ms_per_answer"]
    table.add_row("CPU ms per answer", fmt(cpu["vanilla"], ".3f"), fmt(cpu["rampserve"], ".3f"),
                  paired_cell(cpu), *verdict(4))
    same = versus.get("p50_saving_ms_same_requests")
    if same is not None:
        table.add_row("p50 saving ms (live / simulated on the same requests)", "",
                      f"{fmt(same['live'], '.2f')} / {fmt(same['simulator'], '.2f')}", fmt(same["ratio"], ".2f"),
                      *verdict(5))
    if "p50_saving_ms" in versus:
        saving = versus["p50_saving_ms"]
        table.add_row("p50 saving ms (live / simulator)", "", f"{fmt(saving['live'], '.2f')} / "
                      f"{fmt(saving['simulator'], '.2f')}", fmt(saving["ratio"], ".2f"), "", "")
    return table


def paired_cell(figure: dict, unit: str = "") -> str:
    """A ratio paired within rounds: the median (followed by `unit`), with the rounds' range where there are
    several."""
    known = [r for r in figure["ratio_rounds"] if r is not None]
    spread = f" ({min(known):.2f}-{max(known):.2f})" if len(known) > 1 else ""
    return fmt(figure["ratio"], ".2f") + unit + spread


def live_table(report: dict, entry: dict) -> Table:
    """One load's figures (`entry`, one of the report's `loads`), with what the run measured once in the title."""
    table = Table(title=f"{report['model']} on {report['workload']}, {report['trace']} trace at load "
                        f"{fmt(entry['load'], 'g')}, round {entry['median_round'] + 1} of {len(entry['rounds'])} (the "
                        f"median p50 ratio): {entry['rate_rps']:.0f} rps (vanilla's saturation "
                        f"{fmt(report['saturation_rps'], '.0f')} rps), "
                        f"SLO {report['slo_ms']:.2f} ms, max batch {report['max_batch']}, max delay "
                        f"{report['max_delay_ms']:g} ms; server overhead {fmt(report['server_overhead_ms'], '.2f')} ms "
                        f"(binary), {fmt(report.get('server_overhead_json_ms'), '.2f')} ms (JSON); mean batch "
                        f"{fmt(report.get('feeding', {}).get('mean_batch_size'), '.2f')} with {FEEDING_CLIENTS} "
                        "closed-loop clients")
    # one column per system, one row per figure: the figures outnumber the systems, and a terminal's width
    rows = table_rows(entry)
    table.add_column("")
    for row in rows:
        table.add_column(row[0], justify="right")
    for index, figure in enumerate(TABLE_COLUMNS[1:], start=1):
        table.add_row(figure, *(row[index] for row in rows))
    return table


# --- processes ----------------------------------------------------------------------------------------------------

# --- the benchmark ------------------------------------------------------------------------------------------------

def batch1_inprocess_ms(model: PreparedModel, feeds: list[dict[str, np.ndarray]], rounds: int) -> float:
    """Median time of the original model on one input, in this process (inputs cycle so no cache is favoured),
    with one intra-op thread and compiled where it compiles, as the server's executor runs it by default."""
    torch.set_num_threads(1)
    compiled = model.compile((), feeds[0])
    inputs = itertools.cycle(feeds)
    return interleaved_medians({"batch 1": lambda: model.run(next(inputs), compiled=compiled)}, rounds=rounds,
                               desc="in-process batch 1")["batch 1"]


def measure_overhead(jobs: dict[str, Job], probe: list[dict[str, np.ndarray]], model: PreparedModel,
                     feeds: list[dict[str, np.ndarray]], settings: LiveSettings, slo_ms: float, workdir: Path,
                     progress: bool) -> dict:
    """The server's own cost: its median latency with one request at a time, less the model's batch-1 time here
    (timed while the server idles); for each of `jobs` (one client each): Triton's binary tensors
    (`server_overhead_ms`), plain JSON bodies (`server_overhead_json_ms`) and gRPC (`server_overhead_grpc_ms`). A
    job that traces (binary tensors, each answer's trace asked for: `server_overhead_traced_ms`, what the trace
    costs beside binary's) also says where the time went (`low_load_stages`, `stages.stage_costs`)."""
    expected_s = settings.sequential_requests * slo_ms / 1000.0  # for the progress bar: each well within the SLO
    low_load_p50, stages = {}, None
    for encoding, job in jobs.items():
        sequential = require_answers(run_loadgen(job, probe, workdir, f"one at a time ({encoding})", expected_s,
                                                 progress), "one at a time")
        low_load_p50[encoding] = float(np.median(sequential.latency_ms[sequential.ok]))
        if job.trace:
            stages = stage_costs(sequential)
    batch1 = batch1_inprocess_ms(model, feeds, settings.inprocess_rounds)
    named = {encoding: "" if encoding == "binary" else f"_{encoding}" for encoding in jobs}
    return {**{f"server_overhead{suffix}_ms": low_load_p50[encoding] - batch1 for encoding, suffix in named.items()},
            "batch1_inprocess_ms": batch1,
            **{f"low_load_p50{suffix}_ms": low_load_p50[encoding] for encoding, suffix in named.items()},
            "low_load_requests": int(sequential.ok.sum()), "inprocess_torch_threads": torch.get_num_threads(),
            "low_load_stages": stages}


def simulated_replay(plan: LivePlan, settings: LiveSettings, schedule: ReplaySchedule, outputs: RampOutputs
                     ) -> dict:
    """The trace simulator on the replay's own requests and arrivals, warm-up included, scored on the measured
    requests: vanilla, the oracle (the savings no exit policy can beat) and rampserve's controller with the managed
    server's settings, from the same start. Its queue charges only the profiled model times (each input's by its
    length, where inputs come in any length), no HTTP: what the live server could save with nothing around the
    model at the same point of its life, where `bench sim`'s figure is over a whole stream. `outputs`: the ramps'
    on the replay's requests, warm-up included."""
    warmup, requests = schedule.warmup_requests, schedule.requests
    stop = plan.first + warmup + requests
    lengths = input_lengths(plan.model, plan.stream, plan.first, stop) if plan.model.profile.lengths else None
    # The measured replay starts once every warm-up request is answered: a gap as long as the warm-up's mean
    warm = schedule.warmup_arrivals_ms
    offset = float(warm[-1]) + float(np.mean(np.diff(warm))) if len(warm) > 1 else 0.0
    arrivals = np.concatenate([warm, offset + schedule.arrivals_ms])
    scenario = Scenario(outputs, CostModel(plan.model.profile), arrivals, plan.max_batch, lengths)
    controller_settings = settings.controller_settings().resolved(plan.max_batch)  # as the managed server resolves it
    controller = Controller(plan.model.profile, controller_settings,
                            validation_record(tuple(plan.model.site_names), plan.model.validation))
    runs = {"vanilla": replay(scenario, Configuration(0, (), ())), "oracle": replay_oracle(scenario),
            "rampserve": replay(scenario, controller.configuration(), controller, controller_settings.stops,
                                controller_settings.kept_share, settings.seed)}
    measured = np.arange(warmup, warmup + requests)
    simulated = with_savings({name: summarize(measured_part(run, measured), settings.worst_window)
                              for name, run in runs.items()})
    oracle, vanilla, managed = simulated["oracle"], simulated["vanilla"], simulated["rampserve"]
    return {"p50_savings": oracle["p50_savings"], "p50_ms": oracle["p50_ms"], "exit_share": oracle["exit_share"],
            "vanilla_p50_ms": vanilla["p50_ms"], "vanilla_p99_ms": vanilla["p99_ms"],
            "rampserve": {key: managed[key] for key in ("p50_ms", "p99_ms", "p50_savings", "accuracy", "exit_share",
                                                        "oracle_share", "ramp_set_changes", "threshold_changes")}
            | {"p50_saving_ms": vanilla["p50_ms"] - managed["p50_ms"]}}


# What `simulate_replays` reports per seed and sums up over them: (column heading, key in a run's `rampserve`, format)
SIMULATED_FIGURES = (("p50 ×vanilla", "p50_ratio", ".3f"), ("p99 ×vanilla", "p99_ratio", ".3f"),
                     ("accuracy", "accuracy", ".4f"), ("early", "exit_share", ".2f"),
                     ("p50 saving ms", "p50_saving_ms", ".2f"))


def simulate_replays(settings: LiveSettings, seeds: int, json_out: Path | None, progress: bool = True) -> dict:
    """No server: the replays a run would serve at `settings.rate_rps` for `seeds` seeds from `settings.seed` (each its
    own stream order and arrivals), warm-up included, through the trace simulator (`simulated_replay`), and each one's p50 and
    p99 as ratios to vanilla's: what the controller saves at the point of a server's life the replay measures, over
    more draws than servers could be run for. A rate is needed where no server measures saturation."""
    if not settings.rate_rps:
        raise ValueError("a simulated replay has no server to measure saturation on: give --rate")
    runs = []
    for seed in tqdm(range(settings.seed, settings.seed + seeds), desc="simulated replays", unit="seed",
                     disable=not progress):
        seeded = replace(settings, seed=seed)
        plan = plan_live(seeded)
        schedule = replay_schedule(seeded, seeded.loads[0], None, plan.stream)
        replayed = ramp_outputs(plan.model, plan.bundle, plan.stream, plan.first,
                                plan.first + schedule.warmup_requests + schedule.requests)
        simulated = simulated_replay(plan, seeded, schedule, replayed)
        managed = simulated["rampserve"]
        runs.append({"seed": seed, **simulated,
                     "rampserve": managed | {"p50_ratio": managed["p50_ms"] / simulated["vanilla_p50_ms"],
                                             "p99_ratio": managed["p99_ms"] / simulated["vanilla_p99_ms"]}})
    summary = {}
    for _, key, _ in SIMULATED_FIGURES:
        values = [run["rampserve"][key] for run in runs]
        summary[key] = {"median": float(np.median(values)), "min": float(min(values)), "max": float(max(values))}
    report = {"model": settings.model, "workload": settings.workload_label, "trace": settings.trace,
              "rate_rps": settings.rate_rps, "duration_s": settings.duration_s,
              "warmup_requests": settings.warmup_requests, "seeds": runs, "summary": summary,
              "settings": asdict(settings)}
    write_result(report, json_out)
    return report


def simulated_replays_table(report: dict) -> Table:
    table = Table(title=f"{report['model']} on {report['workload']} ({report['trace']}), {report['rate_rps']:g} rps: "
                        f"{report['warmup_requests']} warm-up requests, then {report['duration_s']:g} s, simulated")
    table.add_column("seed", justify="right")
    for heading, _, _ in SIMULATED_FIGURES:
        table.add_column(heading, justify="right")
    rows = [(str(run["seed"]), run["rampserve"]) for run in report["seeds"]]
    rows += [(name, {key: figures[name] for key, figures in report["summary"].items()})
             for name in ("median", "min", "max")]
    for name, figures in rows:
        table.add_row(name, *(fmt(figures[key], spec) for _, key, spec in SIMULATED_FIGURES))
    return table


@dataclass(frozen=True)
class LivePlan:
    """What a live run serves and replays, decided before any server starts."""

    bundle: Path
    model: PreparedModel
    slo_ms: float
    max_batch: int
    stream: Stream
    first: int  # the stream's first evaluation item
    probe_feeds: list[dict[str, np.ndarray]]  # the saturation probe's requests
    served: str  # what `rampserve serve` is given: the zoo model's name, or the bundle prepared on the user's data
    name: str  # the model's name on the server
    data: dict | None = None  # the user's data and its split (`bench.own_data`), where it is the stream


def plan_live(settings: LiveSettings) -> LivePlan:
    from rampserve.runtime.zoo_bundles import zoo_bundle

    own = None if settings.data is None else settings.own_stream(settings.model)
    bundle = own.bundle if own else zoo_bundle(settings.model)
    model = load_bundle(bundle)
    profile = model.profile
    if profile is None:
        raise ValueError(f"{bundle} has no latency profile; run `rampserve profile {bundle}`")
    slo, max_batch = serving_limits(profile, settings.slo_ms, settings.max_batch)
    stream = own.stream if own else get_stream(settings.workload, length=settings.stream_length, seed=settings.seed)
    first = stream.evaluation.start
    probe_feeds = encode_items(model, stream.task, stream.items(first, first + SATURATION_ITEMS))
    served, name = (str(bundle), bundle.name) if own else (settings.model, settings.model)
    return LivePlan(bundle, model, slo, max_batch, stream, first, probe_feeds, served, name,
                    own.record if own else None)


@dataclass(frozen=True)
class ReplaySchedule:
    """One replay: the load it runs at, its rate, and its measured and warm-up arrivals (the stream's evaluation
    items from its start, warm-up first)."""

    load: float | None  # the rate over the baseline's saturation; None when a given rate had no saturation to share
    rate_rps: float
    arrivals_ms: np.ndarray
    warmup_arrivals_ms: np.ndarray

    @property
    def requests(self) -> int:
        return len(self.arrivals_ms)

    @property
    def warmup_requests(self) -> int:
        return len(self.warmup_arrivals_ms)

    @property
    def expected_s(self) -> float:
        """How long the load generator should take: warm-up, then the measured arrivals (each starts at 0)."""
        return (float(self.arrivals_ms[-1]) + float(self.warmup_arrivals_ms.max(initial=0.0))) / 1000.0


def replay_rate(settings: LiveSettings, load: float, saturation_rps: float | None) -> float:
    """The replay's rate: `settings.rate_rps` if given, else `load` of the baseline's measured saturation."""
    if settings.rate_rps:
        return settings.rate_rps
    if saturation_rps is None or saturation_rps <= 0:
        raise RuntimeError(f"the baseline answered nothing once its saturation probe had settled: {saturation_rps}")
    return rate_at_load(load, saturation_rps)


def replay_schedule(settings: LiveSettings, load: float, saturation_rps: float | None, stream: Stream
                    ) -> ReplaySchedule:
    """The replay at `load` (`replay_rate`); with a given rate, the load is what that rate comes to."""
    rate = replay_rate(settings, load, saturation_rps)
    if settings.rate_rps:
        load = rate / saturation_rps if saturation_rps else None
    n = round(rate * settings.duration_s)
    warmup = settings.warmup_requests
    if n < 1:
        raise ValueError(f"{settings.duration_s:g} s at {rate:.3g} rps hold no request to measure")
    if warmup + n > len(stream.evaluation):
        raise ValueError(f"{warmup + n} requests at load {fmt(load, 'g')} ({rate:.0f} rps) exceed the stream's "
                         f"{len(stream.evaluation)} evaluation items")
    arrivals = live_arrivals(settings.trace, n, rate, settings.seed, settings.trace_minutes)
    return ReplaySchedule(load, rate, arrivals, arrival_times("poisson", warmup, rate, seed=settings.seed))


CONNECTION_WARMUP = 3  # requests a slice's client sends first, unmeasured: its connection open before it times one


def slice_turns(round_index: int, slices: int) -> list[tuple[int, bool]]:
    """(slice, whether vanilla replays it) in a round's order: each slice by both systems, the one going first
    alternating from slice to slice (ABBA: a drift of the machine lands on both alike), the round's first system
    alternating from round to round."""
    return [(k, vanilla) for k in range(slices) for vanilla in
            ((True, False) if (k + round_index) % 2 == 0 else (False, True))]


def slice_bounds(requests: int, slices: int) -> list[tuple[int, int]]:
    """Consecutive [start, end) ranges of the measured requests, as even as they divide (none empty)."""
    edges = np.linspace(0, requests, min(slices, requests) + 1).round().astype(int)
    return list(itertools.pairwise(edges.tolist()))


def replay_round(settings: LiveSettings, schedule: ReplaySchedule, requests: list[dict[str, np.ndarray]],
                 round_index: int, tag: str, progress: bool, start: Callable[[bool], ServerProcess],
                 run: Callable[..., LoadResult], probe: Callable[[ServerProcess, str], dict] | None
                 ) -> tuple[dict[str, LoadResult], dict[str, dict], dict[str, dict]]:
    """One round at one load: both systems start afresh (the managed controller learns from the stream, so each
    round meets the server a run at that load alone would), take their warm-ups, then replay the measured requests
    slice by slice in turns (`slice_turns`), each slice once the other server has gone quiet (`wait_until_quiet`:
    work a server started while it was measured, a controller's search or a set compiling, never lands on the
    other's slice). `start` starts a system's server, `run` runs a load generator job on one (server, requests,
    label, expected seconds, arrivals, warm-up arrivals), `probe` (the last round: each system's saturation, back
    to back) measures a server once it has replayed. Returns each system's replay (its slices joined), how each
    server ended, and the probes."""
    note = tqdm.write if progress else (lambda _message: None)
    names = {True: "vanilla", False: "rampserve"}
    first = (True, False) if round_index % 2 == 0 else (False, True)
    warm = schedule.warmup_requests
    bounds = slice_bounds(schedule.requests, settings.replay_slices)
    parts: dict[bool, list[LoadResult]] = {True: [], False: []}
    probed: dict[str, dict] = {}
    with contextlib.ExitStack() as stack:
        servers = {is_vanilla: stack.enter_context(start(is_vanilla)) for is_vanilla in first}
        for is_vanilla in first:
            if warm:  # its last warm-up request stands as the job's one measured request, discarded
                run(servers[is_vanilla], requests[:warm], f"{names[is_vanilla]} warm-up at {tag}",
                    float(schedule.warmup_arrivals_ms[-1]) / 1000.0, np.zeros(1), schedule.warmup_arrivals_ms[:-1])
        for k, is_vanilla in slice_turns(round_index, len(bounds)):
            lo, hi = bounds[k]
            waited = wait_until_quiet(servers[not is_vanilla].pid)
            if waited > 5.0:
                note(f"{tag}: {waited:.0f} s for the {names[not is_vanilla]} server to go quiet")
            ahead = min(CONNECTION_WARMUP, warm + lo)
            arrivals = schedule.arrivals_ms[lo:hi] - schedule.arrivals_ms[lo]
            spacing = np.arange(ahead) * 1000.0 / schedule.rate_rps
            parts[is_vanilla].append(run(
                servers[is_vanilla], requests[warm + lo - ahead:warm + hi],
                f"{names[is_vanilla]} at {tag} slice {k + 1}",
                float(arrivals[-1] + spacing.max(initial=0.0)) / 1000.0, arrivals, spacing))
        if probe is not None:
            for is_vanilla in first:
                try:
                    probed[names[is_vanilla]] = probe(servers[is_vanilla], names[is_vanilla])
                except RuntimeError as exc:  # the replays' figures stand without it
                    note(f"{names[is_vanilla]} saturation: {exc}")
                    probed[names[is_vanilla]] = {"throughput_rps": None, "rounds_rps": [], "error": str(exc)[-2000:]}
    offsets = [float(schedule.arrivals_ms[lo]) for lo, _ in bounds]
    return ({names[v]: LoadResult.joined(parts[v], offsets) for v in (True, False)},
            {names[v]: servers[v].outcome() for v in (True, False)}, probed)


def run_live(settings: LiveSettings, json_out: Path | None, plots_dir: Path | None, progress: bool = True,
             simulator: SimulatorSaving | None = None) -> dict:
    """The whole run (module docstring); `simulator` (`read_simulator_saving`) goes beside the live figures at its
    load."""
    note = tqdm.write if progress else (lambda _message: None)
    plan = plan_live(settings)
    model, slo, max_batch = plan.model, plan.slo_ms, plan.max_batch
    stream, first, probe_feeds, served_name = plan.stream, plan.first, plan.probe_feeds, plan.name

    def server(vanilla: bool, workdir: Path, tag: str) -> ServerProcess:
        system = "vanilla" if vanilla else "rampserve"
        note(f"starting the {system} server ({tag})")
        extra = settings.server_args if vanilla else (*settings.managed_args(), *settings.server_args)
        return ServerProcess(rampserve_serve(plan.served, slo, max_batch, settings.max_delay_ms, vanilla, extra),
                             workdir / f"{system}-{tag.replace(' ', '-')}-server.log", settings.start_timeout_s)

    results: list[list[dict[str, LoadResult]]] = []  # per schedule, per round, per system
    servers: list[list[dict[str, dict]]] = []
    with tempfile.TemporaryDirectory(prefix="rampserve-live-") as tmp:
        workdir = Path(tmp)
        with server(True, workdir, "calibration") as vanilla:
            metadata = get_json(vanilla.url(f"/v2/models/{served_name}"))
            inputs = tuple((i["name"], i["datatype"]) for i in metadata["inputs"])
            if len(inputs) != len(model.backend.input_names):
                raise RuntimeError(f"the server's model takes {inputs}, the bundle's {model.backend.input_names}")
            probe = renamed(probe_feeds, [name for name, _ in inputs])

            def job(srv: ServerProcess, transport: str = settings.transport, **kwargs: object) -> Job:
                return Job(srv.infer_url(served_name, transport), inputs, "label", srv.url("/status"),
                           settings.timeout_s, cpu_pid=srv.pid, lean=settings.client == "lean" and transport == "http",
                           **kwargs)

            clients = settings.saturation_clients or 2 * max_batch + 2

            def saturation_of(srv: ServerProcess, system: str) -> dict:
                note(f"{system} saturation: {clients} closed-loop clients for {settings.saturation_s:g} s, "
                     f"{settings.saturation_rounds} rounds")
                measured = measure_saturation(job(srv, clients=clients, duration_s=settings.saturation_s,
                                                  refused_pause_ms=slo), probe, served_name,
                                              settings.saturation_rounds, settings.saturation_settle_s, workdir,
                                              progress)
                note(f"{system} saturation: {measured['throughput_rps']:.0f} rps (rounds "
                     f"{'/'.join(f'{r:.0f}' for r in measured['rounds_rps'])}), "
                     f"mean batch {fmt(measured['mean_batch_size'], '.2f')}")
                return measured

            saturation = saturation_of(vanilla, "vanilla")
            one_at_a_time = {"binary": job(vanilla, "http", clients=1, requests=settings.sequential_requests)}
            one_at_a_time |= {"json": replace(one_at_a_time["binary"], json_bodies=True),
                              "grpc": job(vanilla, "grpc", clients=1, requests=settings.sequential_requests)}
            if settings.traced:
                one_at_a_time["traced"] = replace(one_at_a_time["binary"], trace=True)
            overhead = measure_overhead(one_at_a_time, probe, model, probe_feeds, settings, slo, workdir, progress)
            note(f"one request at a time: p50 {overhead['low_load_p50_ms']:.3f} ms (binary), "
                 f"{overhead['low_load_p50_json_ms']:.3f} ms (JSON), {overhead['low_load_p50_grpc_ms']:.3f} ms (gRPC); "
                 f"in-process batch 1: {overhead['batch1_inprocess_ms']:.3f} ms")
            # Whether the front end keeps the model fed: a server that parses and writes too slowly leaves its batches
            # small however many clients wait
            note(f"{FEEDING_CLIENTS} closed-loop clients for {settings.saturation_s:g} s")
            feeding = measure_saturation(job(vanilla, clients=FEEDING_CLIENTS, duration_s=settings.saturation_s,
                                             refused_pause_ms=slo), probe, served_name, 1,
                                         settings.saturation_settle_s, workdir, progress)
            note(f"{FEEDING_CLIENTS} clients: {feeding['throughput_rps']:.0f} rps, "
                 f"mean batch {fmt(feeding['mean_batch_size'], '.2f')}")
        calibration_server = vanilla.outcome()

        # every schedule before any replay: a load the stream cannot hold fails before the others are measured
        schedules = [replay_schedule(settings, load, saturation["throughput_rps"], stream)
                     for load in sorted(settings.loads)]
        longest = max(s.warmup_requests + s.requests for s in schedules)
        requests = renamed(encode_items(model, stream.task, stream.items(first, first + longest)),
                           [name for name, _ in inputs])
        saturations: dict[str, dict] = {}  # each system's, probed after its last replay
        for index, schedule in enumerate(schedules):
            note(f"load {fmt(schedule.load, 'g')}: replaying {schedule.requests} requests ({settings.trace}, "
                 f"{schedule.rate_rps:.0f} rps) after {schedule.warmup_requests} warm-up requests to each system, "
                 f"{settings.replay_rounds} round(s)")
            results.append([])
            servers.append([])
            for round_index in range(settings.replay_rounds):
                tag = f"load {fmt(schedule.load, 'g')} round {round_index + 1}"
                last = index == len(schedules) - 1 and round_index == settings.replay_rounds - 1
                runs, outcomes, probed = replay_round(
                    settings, schedule, requests, round_index, tag, progress,
                    start=functools.partial(server, workdir=workdir, tag=tag),
                    run=lambda srv, part, label, expected_s, arrivals, warmup: run_loadgen(
                        job(srv, trace=settings.traced), part, workdir, label, expected_s, progress, arrivals, warmup),
                    probe=saturation_of if last else None)
                saturations |= probed
                results[-1].append(runs)
                servers[-1].append(outcomes)

    note("scoring the answers against the original model's")
    entries = [score_load(plan, settings, schedule, rounds, outcomes, saturations, simulator)
               for schedule, rounds, outcomes in zip(schedules, results, servers, strict=True)]
    report = {
        "model": settings.model, "workload": settings.workload_label, "trace": settings.trace,
        **({"data": plan.data, "bundle": str(plan.bundle)} if plan.data else {}),
        "saturation_rps": saturation["throughput_rps"], "saturation": saturation, "slo_ms": slo,
        "max_batch": max_batch, "max_delay_ms": settings.max_delay_ms, "duration_s": settings.duration_s,
        **overhead, "feeding": feeding, "calibration_server": calibration_server,
        "loads": entries, "latency_by_load": latency_by_load(entries),
        "simulator": None if simulator is None else asdict(simulator),
        "settings": asdict(settings),
    }
    return write_report(report, results, json_out, plots_dir)


def score_load(plan: LivePlan, settings: LiveSettings, schedule: ReplaySchedule,
               rounds: list[dict[str, LoadResult]], servers: list[dict[str, dict]], saturations: dict[str, dict],
               simulator: SimulatorSaving | None) -> dict:
    """One load's entry of the report: `versus_vanilla` over its replay rounds; both systems' figures (each with
    its closed-loop saturation) from the round whose p50 ratio is the median (`median_round`; its runs are the
    ones plotted), every round's in `rounds`; the simulated oracle on the same arrivals; and the simulator's saving
    beside the live one where `simulator` is at this load."""
    warmup = schedule.warmup_requests
    replayed = ramp_outputs(plan.model, plan.bundle, plan.stream, plan.first, plan.first + warmup + schedule.requests)
    oracle = simulated_replay(plan, settings, schedule, replayed)
    outputs = replayed.subset(np.arange(warmup, warmup + schedule.requests))
    scored = []
    for results, outcomes in zip(rounds, servers, strict=True):
        systems = {name: score_run(settings, require_answers(result, name), outputs.final, outcomes[name], plan.name)
                   for name, result in results.items()}
        for name, measured in saturations.items():
            systems[name] |= {"saturation_rps": measured["throughput_rps"], "saturation": measured}
        systems["rampserve"] |= managed_exit_mode(settings, plan.max_batch, results["rampserve"].status_after,
                                                  plan.name)
        if results["rampserve"].trace_ms is not None and results["vanilla"].trace_ms is not None:
            systems["rampserve"]["stages_paired"] = paired_stage_costs(results["rampserve"], results["vanilla"])
        scored.append(with_oracle_share(systems, oracle["p50_savings"]))
    versus = versus_vanilla([(systems["vanilla"], systems["rampserve"]) for systems in scored], schedule.load)
    median = median_round(versus["p50_ms"]["ratio_rounds"])
    systems = scored[median]
    if simulator is not None and simulator.load == schedule.load:
        versus["p50_saving_ms"] = beside_simulator(systems["vanilla"], systems["rampserve"], simulator)
    live_savings = [p50_saving_ms(r["vanilla"], r["rampserve"]) for r in scored]
    simulated_ms = oracle["rampserve"]["p50_saving_ms"]
    live_ms = _median_known(live_savings)
    versus["p50_saving_ms_same_requests"] = {"live": live_ms, "live_rounds": live_savings,
                                             "simulator": simulated_ms, "ratio": ratio(live_ms, simulated_ms)}
    # A saving the simulator does not find cannot be kept: no verdict where it finds none
    versus["goals"][f"live_p50_saving_at_least_{SAVING_GOAL:g}x_simulated"] = \
        _at_least(versus["p50_saving_ms_same_requests"]["ratio"], SAVING_GOAL) if simulated_ms > 0 else None
    return {"load": schedule.load, "rate_rps": schedule.rate_rps, "requests": schedule.requests,
            "warmup_requests": schedule.warmup_requests, "oracle_sim": oracle, "systems": systems,
            "median_round": median, "versus_vanilla": versus,
            "rounds": [{name: {k: v for k, v in summary.items() if k != "server"} for name, summary in r.items()}
                       for r in scored]}


def median_round(ratios: list[float | None]) -> int:
    """The round whose ratio is the median (the lower of the middle two for an even count; rounds without a ratio
    last), so that the figures shown beside the median ratio come from one real round."""
    order = sorted(range(len(ratios)), key=lambda i: (ratios[i] is None, ratios[i] or 0.0))
    known = sum(r is not None for r in ratios)
    return order[(known - 1) // 2] if known else 0


def worst_tail_round(entry: dict) -> int:
    """The round of a load's `entry` where rampserve's p99 was highest against vanilla's (rounds missing either
    last): where a tail is to be looked for."""
    def ratio(systems: dict) -> float:
        managed, vanilla = systems["rampserve"].get("p99_ms"), systems["vanilla"].get("p99_ms")
        return managed / vanilla if managed is not None and vanilla else -math.inf

    return max(range(len(entry["rounds"])), key=lambda i: ratio(entry["rounds"][i]))


def managed_exit_mode(settings: LiveSettings, batch_limit: int, status: dict | str | None,
                      name: str | None = None) -> dict:
    """The managed server's `exit_mode` and `feedback_share`: as its status reports them for the model (its
    controller may set the share itself), else as it was told (`settings`), else the controller's defaults for a
    model served in batches of at most `batch_limit`."""
    defaults = ControllerSettings().resolved(batch_limit)
    reported = _model_status(status, name or settings.model)
    reported = reported if isinstance(reported, dict) else {}

    def figure(key: str, told: object) -> object:
        for place in (reported, reported.get("controller")):
            if isinstance(place, dict) and place.get(key) is not None:
                return place[key]
        return told if told is not None else getattr(defaults, key)

    return exit_mode_figures(str(figure("exit_mode", settings.exit_mode)),
                             float(figure("feedback_share", settings.feedback_share)))


def write_report(report: dict, results: list[list[dict[str, LoadResult]]], json_out: Path | None,
                 plots_dir: Path | None) -> dict:
    """`results` holds each load's rounds of runs, in the order of the report's `loads`; each load's median round
    is plotted in a folder of its own, the latency against load beside them."""
    if plots_dir is not None:
        from rampserve.bench.live_plots import write_live_plots, write_load_plot

        report["plots"] = [str(path) for entry, runs in zip(report["loads"], results, strict=True)
                           for path in write_live_plots(report, entry, runs[entry["median_round"]],
                                                        plots_dir / f"load-{fmt(entry['load'], 'g')}")]
        report["plots"].append(str(write_load_plot(report, plots_dir)))
    write_result(report, json_out)
    return report


def score_run(settings: LiveSettings, result: LoadResult, reference: np.ndarray, server: dict,
              name: str | None = None) -> dict:
    """One replay's figures (`summarize_live`, what the server says of itself, how it stopped), its released labels
    scored against `reference`, the original model's; `name`: the model's on the server, if not `settings.model`."""
    name = name or settings.model
    status_before, status_after = result.status_before, result.status_after
    summary = summarize_live(result, reference, settings.worst_window,
                             mean_batch_size(status_before, status_after, name),
                             1.0 - settings.accuracy_constraint)
    return (summary | cpu_figures(result, summary["answered"])
            | server_figures(status_before, status_after, name)
            | {"server": server | {"status": _model_status(status_after, name)}})


def cpu_figures(result: LoadResult, answered: int) -> dict:
    """The server's CPU over the measured requests (front end, executor, compile worker: `cpu.cpu_used`) and per
    answered request; None where the run has no readings."""
    if result.cpu_before is None or result.cpu_after is None:
        return {"cpu": None, "cpu_ms_per_answer": None}
    used = cpu_used(result.cpu_before, result.cpu_after)
    return {"cpu": used, "cpu_ms_per_answer": used["total_s"] * 1000.0 / answered if answered else None}


def _model_status(status: dict | str | None, model: str) -> dict | str | None:
    """The server's own report on the model at the end of the run (configuration, batches, the controller's
    decisions) less its last few batches, or why there is none."""
    if not isinstance(status, dict) or not isinstance(status.get("models", {}).get(model), dict):
        return status
    return {k: v for k, v in status["models"][model].items() if k != "recent_batches"}
