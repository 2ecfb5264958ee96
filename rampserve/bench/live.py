"""`rampserve bench live`: vanilla and rampserve serving the same model, for real, on the same trace and stream.

One run: start the vanilla server; measure its saturation throughput (closed loop) and its latency with one
request at a time (against the model's own batch-1 time in this process: the server's overhead); replay the
stream open loop at the target rate (half of saturation unless given) from a separate client process
(`rampserve.bench.loadgen`); stop it; start rampserve with the same settings and replay the same requests at the
same times. Released labels are scored against the original model's, computed here from the bundle; the
trace simulator's oracle on the same stream and arrivals gives the savings an exit policy could reach.

Per-system figures carry `bench sim`'s keys. Latency percentiles, accuracy and exits are over answered requests;
shed (429/503) and failed requests (other errors, timeouts) are counted apart. From the server's own status:
configurations it adopted during the run, of them those that changed the ramp set and those that moved thresholds
alone, and its event loop's lag (`server_figures`).

Each system's `saturation_rps` is its own closed-loop saturation, measured as `bench peers` measures it
(`measure_saturation`, the median of `saturation_rounds` probes, every round reported): vanilla's before its replay
(it sets the replay's rate), rampserve's after its replay (so the replay meets the server as it always did, and the
probe meets a controller that has learnt the stream). `windows_below_share` is the share of 1,000-request windows
(answered requests, in order) whose accuracy is below 1 − the accuracy constraint; the managed system also reports
its `exit_mode` and `feedback_share`. `versus_vanilla` puts issue 17's figures for exits side by side: saturation,
p50 and p99 at half of vanilla's saturation, accuracy, as ratios to vanilla from this one run.
"""

from __future__ import annotations

import itertools
import tempfile
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
from rich.table import Table
from tqdm.auto import tqdm

from rampserve.bench.figures import ACCURACY_WINDOW, configuration_changes, exit_mode_figures, windows_below_share
from rampserve.bench.harness import (
    QUANTILES, TRANSPORTS, ServerProcess, encode_items, fmt, get_json, mean_batch_size, measure_saturation,
    most_frequent, percentiles, rampserve_serve, ratio, renamed, require_answers, run_loadgen, write_json,
)
from rampserve.bench.loadgen import Job, LoadResult
from rampserve.bench.ramp_outputs import RampOutputs, ramp_outputs
from rampserve.bench.sim import Scenario, _rolling_min_mean, replay, replay_oracle, summarize, with_savings
from rampserve.runtime.timing import interleaved_medians
from rampserve.control.controller import ControllerSettings
from rampserve.control.costs import CostModel
from rampserve.control.records import Configuration
from rampserve.ramps.exit_rule import EXIT_MODES
from rampserve.runtime.bundle import load_bundle
from rampserve.runtime.latency import LatencyProfile, max_batch_for_slo
from rampserve.runtime.prepared import PreparedModel
from rampserve.workloads.streams import DEFAULT_LENGTH, Stream, get_stream
from rampserve.workloads.traces import MAF_MINUTE_S, arrival_times, rate_over_time

SATURATION_ITEMS = 1000  # distinct inputs the closed-loop probes cycle through
FEEDING_CLIENTS = 8  # closed-loop clients of the probe of whether the front end keeps batches full (issue 15)
# Issue 17's bars for exits that stop early, against vanilla in the same run (`versus_vanilla`)
SATURATION_GOAL = 1.4  # managed closed-loop saturation at least this times vanilla's
P50_GOAL, P99_GOAL = 0.5, 1.0  # at half of vanilla's saturation, p50 and p99 at most these times vanilla's
ACCURACY_GOAL = 0.99
HALF_LOAD = 0.5


@dataclass(frozen=True)
class LiveSettings:
    model: str = "resnet18-fmnist"  # a zoo model
    workload: str = "fmnist-drift"
    trace: str = "maf"
    rate_rps: float | None = None  # default: `load` times vanilla's measured saturation throughput
    load: float = 0.5
    duration_s: float = 60.0  # measured part of each system's run, in trace time
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
    # options (objective, guarantee, risk_target_share, confidence, search_every, history, shadow_share); absent:
    # the server's defaults
    controller: dict[str, float | int | str] = field(default_factory=dict)
    # What the client speaks: v2 over HTTP with Triton's binary tensors, or KServe v2 over gRPC (raw contents). The
    # one-at-a-time overhead is measured over both either way.
    transport: str = "http"

    def __post_init__(self) -> None:
        if self.saturation_s <= self.saturation_settle_s:
            raise ValueError(f"a saturation probe ({self.saturation_s} s) must outlast its settling "
                             f"({self.saturation_settle_s} s)")
        if self.saturation_rounds < 1:
            raise ValueError(f"saturation takes at least one round, got {self.saturation_rounds}")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport is one of {TRANSPORTS}, not {self.transport!r}")
        if self.exit_mode is not None and self.exit_mode not in EXIT_MODES:
            raise ValueError(f"exit mode is one of {EXIT_MODES}, not {self.exit_mode!r}")
        if self.feedback_share is not None and not 0.0 < self.feedback_share <= 1.0:
            raise ValueError(f"feedback share must lie in (0, 1], got {self.feedback_share}")
        ControllerSettings(**self.controller)  # what the server would refuse to start with

    def managed_args(self) -> tuple[str, ...]:
        """`rampserve serve` options of the managed server alone, before `server_args` (which may override)."""
        return ("--accuracy-constraint", f"{self.accuracy_constraint:g}",
                *(("--exit-mode", self.exit_mode) if self.exit_mode is not None else ()),
                *(("--feedback-share", f"{self.feedback_share:g}") if self.feedback_share is not None else ()),
                *(arg for name, value in self.controller.items()
                  for arg in (f"--{name.replace('_', '-')}", f"{value:g}" if isinstance(value, float) else str(value))))


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
        "mean_batch_size": batch_size,
        "exit_share_by_site": {site: float(np.mean(exit_sites == i)) for i, site in enumerate(result.sites)},
        "requests": len(ok),
        "answered": answered,
        "shed": int(result.shed.sum()),
        "failed": int(result.failed.sum()),
        # arrival processes start at 0, so n arrivals up to the last one is the rate they were drawn at
        "rate_rps": len(ok) / float(result.scheduled_ms.max()) * 1000.0 if len(ok) else 0.0,
        "duration_s": float(result.done_ms.max()) / 1000.0 if len(ok) else 0.0,
        **percentiles(result.sent_ms - result.scheduled_ms, prefix="client_lateness_"),
        "errors": most_frequent(result.errors),
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


def table_rows(report: dict) -> list[tuple[str, ...]]:
    """One row per system: what `live_table` prints, ratios to vanilla last."""
    vanilla = report["systems"]["vanilla"]
    rows = []
    for name, s in report["systems"].items():
        rows.append((
            name, str(s["requests"]), str(s["shed"]), str(s["failed"]),
            *(fmt(s[f"p{q}_ms"], ".2f") for q in QUANTILES), fmt(s["throughput_rps"], ".1f"),
            fmt(s.get("saturation_rps"), ".1f"),
            fmt(s["accuracy"], ".4f"), fmt(s["worst_window_accuracy"], ".3f"),
            fmt(s.get("windows_below_share"), ".1%"), fmt(s["exit_share"], ".1%"), _mode(s),
            fmt(s["mean_batch_size"], ".2f"), fmt(s.get("config_changes"), "d"),
            fmt(s.get("ramp_set_changes"), "d"), fmt(s.get("threshold_changes"), "d"),
            fmt(s.get("max_loop_lag_ms"), ".1f"), fmt(s.get("loop_lag_samples_over_5ms"), "d"),
            *(fmt(ratio(s.get(key), vanilla.get(key)), ".2f")
              for key in ("saturation_rps", "p50_ms", "p99_ms", "throughput_rps")),
            fmt(s.get("oracle_share"), ".2f"),
        ))
    return rows


TABLE_COLUMNS = ("system", "sent", "shed", "failed", "p25 ms", "p50 ms", "p95 ms", "p99 ms", "rps", "sat rps",
                 "accuracy", "worst 1k", "1k <target", "exits", "exit mode", "mean batch", "configs",
                 "set changes", "threshold changes", "max loop lag ms", "lag >5 ms", "sat ×van", "p50 ×van",
                 "p99 ×van", "rps ×van", "oracle share")


def _at_most(value: float | None, bound: float) -> bool | None:
    return None if value is None else value <= bound


def _at_least(value: float | None, bound: float) -> bool | None:
    return None if value is None else value >= bound


def versus_vanilla(vanilla: dict, managed: dict, replay_load: float | None) -> dict:
    """Issue 17's figures for a managed server's exits against vanilla's, measured in one run: closed-loop saturation
    (median of each one's rounds; `ratio_range` spans the lowest managed round over the highest vanilla one to the
    reverse), p50 and p99 of the open-loop replay with their ratios, and accuracy over every answered request (and
    over every request sent, an unanswered one counting as a disagreement). `replay_load` is the replay's rate over
    vanilla's saturation; the p50 and p99 bars hold at half of it only, so they are None at another load. Each
    goal is None where a figure is missing."""
    def rounds(summary: dict) -> list[float]:
        return list((summary.get("saturation") or {}).get("rounds_rps") or [])

    sat_vanilla, sat_managed = vanilla.get("saturation_rps"), managed.get("saturation_rps")
    vanilla_rounds, managed_rounds = rounds(vanilla), rounds(managed)
    ratio_range = [min(managed_rounds) / max(vanilla_rounds), max(managed_rounds) / min(vanilla_rounds)] \
        if vanilla_rounds and managed_rounds and min(vanilla_rounds) > 0 else None
    saturation_ratio = ratio(sat_managed, sat_vanilla)
    p50_ratio, p99_ratio = (ratio(managed[key], vanilla[key]) for key in ("p50_ms", "p99_ms"))
    at_half = replay_load is not None and abs(replay_load - HALF_LOAD) <= 0.01 * HALF_LOAD
    accuracy = managed["accuracy"]
    over_all = accuracy * managed["answered"] / managed["requests"] if accuracy is not None and managed["requests"] \
        else None
    return {
        "exit_mode": managed.get("exit_mode"), "feedback_share": managed.get("feedback_share"),
        "replay_share_of_vanilla_saturation": replay_load, "replayed_at_half_vanilla_saturation": at_half,
        "saturation_rps": {"vanilla": sat_vanilla, "rampserve": sat_managed, "ratio": saturation_ratio,
                           "ratio_range": ratio_range, "vanilla_rounds": vanilla_rounds,
                           "rampserve_rounds": managed_rounds},
        **{key: {"vanilla": vanilla[key], "rampserve": managed[key], "ratio": ratio}
           for key, ratio in (("p50_ms", p50_ratio), ("p99_ms", p99_ratio))},
        "accuracy": accuracy, "accuracy_over_all_requests": over_all,
        "worst_window_accuracy": managed["worst_window_accuracy"],
        "windows_below_share": managed.get("windows_below_share"),
        "goals": {
            f"saturation_at_least_{SATURATION_GOAL:g}x": _at_least(saturation_ratio, SATURATION_GOAL),
            f"p50_at_most_{P50_GOAL:g}x_at_half_saturation": _at_most(p50_ratio, P50_GOAL) if at_half else None,
            f"p99_at_most_{P99_GOAL:g}x_at_half_saturation": _at_most(p99_ratio, P99_GOAL) if at_half else None,
            f"accuracy_at_least_{ACCURACY_GOAL:g}": _at_least(accuracy, ACCURACY_GOAL),
        },
    }


def versus_table(report: dict) -> Table:
    """`versus_vanilla` as a table: each figure for vanilla and rampserve, their ratio and the goal's verdict."""
    versus = report["versus_vanilla"]
    saturation = versus["saturation_rps"]
    spread = saturation["ratio_range"]
    table = Table(title=f"rampserve ({_mode(versus)}) against vanilla, same run; replay at "
                        f"{fmt(versus['replay_share_of_vanilla_saturation'], '.2f')} of vanilla's saturation")
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
                      fmt(figure["ratio"], ".2f"), *verdict(index))
    table.add_row("accuracy, answered (all sent)", "", f"{fmt(versus['accuracy'], '.4f')} "
                  f"({fmt(versus['accuracy_over_all_requests'], '.4f')})", "", *verdict(3))
    table.add_row("1k windows below target", "", fmt(versus["windows_below_share"], ".1%"), "", "", "")
    return table


def live_table(report: dict) -> Table:
    table = Table(title=f"{report['model']} on {report['workload']}, {report['trace']} trace at "
                        f"{report['rate_rps']:.0f} rps (saturation {fmt(report['saturation_rps'], '.0f')} rps), "
                        f"SLO {report['slo_ms']:.2f} ms, max batch {report['max_batch']}, max delay "
                        f"{report['max_delay_ms']:g} ms; server overhead {fmt(report['server_overhead_ms'], '.2f')} ms "
                        f"(binary), {fmt(report.get('server_overhead_json_ms'), '.2f')} ms (JSON); mean batch "
                        f"{fmt(report.get('feeding', {}).get('mean_batch_size'), '.2f')} with {FEEDING_CLIENTS} "
                        "closed-loop clients")
    # one column per system, one row per figure: the figures outnumber the systems, and a terminal's width
    rows = table_rows(report)
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
    (`server_overhead_ms`), plain JSON bodies (`server_overhead_json_ms`) and gRPC (`server_overhead_grpc_ms`)."""
    expected_s = settings.sequential_requests * slo_ms / 1000.0  # for the progress bar: each well within the SLO
    low_load_p50 = {}
    for encoding, job in jobs.items():
        sequential = require_answers(run_loadgen(job, probe, workdir, f"one at a time ({encoding})", expected_s,
                                                 progress), "one at a time")
        low_load_p50[encoding] = float(np.median(sequential.latency_ms[sequential.ok]))
    batch1 = batch1_inprocess_ms(model, feeds, settings.inprocess_rounds)
    named = {encoding: "" if encoding == "binary" else f"_{encoding}" for encoding in jobs}
    return {**{f"server_overhead{suffix}_ms": low_load_p50[encoding] - batch1 for encoding, suffix in named.items()},
            "batch1_inprocess_ms": batch1,
            **{f"low_load_p50{suffix}_ms": low_load_p50[encoding] for encoding, suffix in named.items()},
            "low_load_requests": int(sequential.ok.sum()), "inprocess_torch_threads": torch.get_num_threads()}


def simulated_oracle(outputs: RampOutputs, profile: LatencyProfile, arrivals_ms: np.ndarray, max_batch: int,
                     worst_window: int) -> dict:
    """The trace simulator's oracle and vanilla on the same inputs and arrivals: the savings no exit policy can
    beat (its queue charges only the profiled model times, no HTTP)."""
    scenario = Scenario(outputs, CostModel(profile), arrivals_ms, max_batch)
    simulated = with_savings({name: summarize(run, worst_window) for name, run in (
        ("vanilla", replay(scenario, Configuration(0, (), ()))), ("oracle", replay_oracle(scenario)))})
    oracle, vanilla = simulated["oracle"], simulated["vanilla"]
    return {"p50_savings": oracle["p50_savings"], "p50_ms": oracle["p50_ms"], "exit_share": oracle["exit_share"],
            "vanilla_p50_ms": vanilla["p50_ms"]}


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


def plan_live(settings: LiveSettings) -> LivePlan:
    from rampserve.runtime.zoo_bundles import zoo_bundle

    bundle = zoo_bundle(settings.model)
    model = load_bundle(bundle)
    profile = model.profile
    if profile is None:
        raise ValueError(f"{bundle} has no latency profile; run `rampserve profile {bundle}`")
    slo = settings.slo_ms or 2.0 * profile.full(1)
    max_batch = settings.max_batch or max_batch_for_slo(profile.batch_sizes, profile.full_ms, slo)
    stream = get_stream(settings.workload, length=settings.stream_length, seed=settings.seed)
    first = stream.evaluation.start
    probe_feeds = encode_items(model, stream.task, stream.items(first, first + SATURATION_ITEMS))
    return LivePlan(bundle, model, slo, max_batch, stream, first, probe_feeds)


def replay_schedule(settings: LiveSettings, saturation_rps: float | None, stream: Stream
                    ) -> tuple[float, int, int, np.ndarray, np.ndarray]:
    """The replay's rate (given, or `settings.load` times the baseline's measured saturation), measured and warm-up
    request counts, and their arrival times."""
    rate = settings.rate_rps or settings.load * (saturation_rps or 0.0)
    if rate <= 0:
        raise RuntimeError(f"the baseline answered nothing once its saturation probe had settled: {saturation_rps}")
    n = round(rate * settings.duration_s)
    warmup = settings.warmup_requests
    if warmup + n > len(stream.evaluation):
        raise ValueError(f"{warmup + n} requests exceed the stream's {len(stream.evaluation)} evaluation items")
    arrivals = live_arrivals(settings.trace, n, rate, settings.seed, settings.trace_minutes)
    return rate, n, warmup, arrivals, arrival_times("poisson", warmup, rate, seed=settings.seed)


def run_live(settings: LiveSettings, json_out: Path | None, plots_dir: Path | None, progress: bool = True) -> dict:
    note = tqdm.write if progress else (lambda _message: None)
    plan = plan_live(settings)
    model, slo, max_batch = plan.model, plan.slo_ms, plan.max_batch
    profile, stream, first, probe_feeds = model.profile, plan.stream, plan.first, plan.probe_feeds

    def server(vanilla: bool, workdir: Path) -> ServerProcess:
        name = "vanilla" if vanilla else "rampserve"
        note(f"starting the {name} server")
        extra = settings.server_args if vanilla else (*settings.managed_args(), *settings.server_args)
        return ServerProcess(rampserve_serve(settings.model, slo, max_batch, settings.max_delay_ms, vanilla, extra),
                             workdir / f"{name}-server.log", settings.start_timeout_s)

    results: dict[str, LoadResult] = {}
    servers: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="rampserve-live-") as tmp:
        workdir = Path(tmp)
        with server(True, workdir) as vanilla:
            metadata = get_json(vanilla.url(f"/v2/models/{settings.model}"))
            inputs = tuple((i["name"], i["datatype"]) for i in metadata["inputs"])
            if len(inputs) != len(model.backend.input_names):
                raise RuntimeError(f"the server's model takes {inputs}, the bundle's {model.backend.input_names}")
            probe = renamed(probe_feeds, [name for name, _ in inputs])

            def job(srv: ServerProcess, transport: str = settings.transport, **kwargs: object) -> Job:
                return Job(srv.infer_url(settings.model, transport), inputs, "label", srv.url("/status"),
                           settings.timeout_s, **kwargs)

            clients = settings.saturation_clients or 2 * max_batch + 2

            def saturation_of(srv: ServerProcess, name: str) -> dict:
                note(f"{name} saturation: {clients} closed-loop clients for {settings.saturation_s:g} s, "
                     f"{settings.saturation_rounds} rounds")
                measured = measure_saturation(job(srv, clients=clients, duration_s=settings.saturation_s,
                                                  refused_pause_ms=slo), probe, settings.model,
                                              settings.saturation_rounds, settings.saturation_settle_s, workdir,
                                              progress)
                note(f"{name} saturation: {measured['throughput_rps']:.0f} rps (rounds "
                     f"{'/'.join(f'{r:.0f}' for r in measured['rounds_rps'])}), "
                     f"mean batch {fmt(measured['mean_batch_size'], '.2f')}")
                return measured

            saturation = saturation_of(vanilla, "vanilla")
            one_at_a_time = {"binary": job(vanilla, "http", clients=1, requests=settings.sequential_requests)}
            one_at_a_time |= {"json": replace(one_at_a_time["binary"], json_bodies=True),
                              "grpc": job(vanilla, "grpc", clients=1, requests=settings.sequential_requests)}
            overhead = measure_overhead(one_at_a_time, probe, model, probe_feeds, settings, slo, workdir, progress)
            note(f"one request at a time: p50 {overhead['low_load_p50_ms']:.3f} ms (binary), "
                 f"{overhead['low_load_p50_json_ms']:.3f} ms (JSON), {overhead['low_load_p50_grpc_ms']:.3f} ms (gRPC); "
                 f"in-process batch 1: {overhead['batch1_inprocess_ms']:.3f} ms")
            # Whether the front end keeps the model fed: a server that parses and writes too slowly leaves its batches
            # small however many clients wait
            note(f"{FEEDING_CLIENTS} closed-loop clients for {settings.saturation_s:g} s")
            feeding = measure_saturation(job(vanilla, clients=FEEDING_CLIENTS, duration_s=settings.saturation_s,
                                             refused_pause_ms=slo), probe, settings.model, 1,
                                         settings.saturation_settle_s, workdir, progress)
            note(f"{FEEDING_CLIENTS} clients: {feeding['throughput_rps']:.0f} rps, "
                 f"mean batch {fmt(feeding['mean_batch_size'], '.2f')}")

            rate, n, warmup, arrivals, warmup_arrivals = replay_schedule(settings, saturation["throughput_rps"], stream)
            note(f"replaying {n} requests ({settings.trace}, {rate:.0f} rps) after {warmup} warm-up requests")
            requests = renamed(encode_items(model, stream.task, stream.items(first, first + warmup + n)),
                                [name for name, _ in inputs])
            expected_s = float(arrivals[-1] + warmup_arrivals[-1]) / 1000.0
            results["vanilla"] = run_loadgen(job(vanilla), requests, workdir, "vanilla", expected_s, progress,
                                             arrivals, warmup_arrivals)
        servers["vanilla"] = vanilla.outcome()
        with server(False, workdir) as rampserve:
            results["rampserve"] = run_loadgen(job(rampserve), requests, workdir, "rampserve", expected_s, progress,
                                               arrivals, warmup_arrivals)
            # after its replay: the replay meets the server as it always did, the probe a controller that has learnt
            try:
                managed_saturation = saturation_of(rampserve, "rampserve")
            except RuntimeError as exc:  # the replay's figures stand without it
                note(f"rampserve saturation: {exc}")
                managed_saturation = {"throughput_rps": None, "rounds_rps": [], "error": str(exc)[-2000:]}
        servers["rampserve"] = rampserve.outcome()

    note("scoring the answers against the original model's")
    outputs, systems = score_systems(plan, settings, results, servers, warmup, n)
    for name, measured in (("vanilla", saturation), ("rampserve", managed_saturation)):
        systems[name] |= {"saturation_rps": measured["throughput_rps"], "saturation": measured}
    systems["rampserve"] |= managed_exit_mode(settings, results["rampserve"].status_after)
    oracle = simulated_oracle(outputs, profile, arrivals, max_batch, settings.worst_window)
    systems = with_oracle_share(systems, oracle["p50_savings"])
    report = {
        "model": settings.model, "workload": settings.workload, "trace": settings.trace, "rate_rps": rate,
        "saturation_rps": saturation["throughput_rps"], "saturation": saturation, "slo_ms": slo,
        "max_batch": max_batch, "max_delay_ms": settings.max_delay_ms, "requests": n, "warmup_requests": warmup,
        "duration_s": settings.duration_s, **overhead, "feeding": feeding, "oracle_sim": oracle,
        "systems": systems,
        "versus_vanilla": versus_vanilla(systems["vanilla"], systems["rampserve"],
                                         rate / saturation["throughput_rps"]),
        "settings": asdict(settings),
    }
    return write_report(report, results, json_out, plots_dir)


def managed_exit_mode(settings: LiveSettings, status: dict | str | None) -> dict:
    """The managed server's `exit_mode` and `feedback_share`: as its status reports them for the model (its
    controller may set the share itself), else as it was told (`settings`), else the controller's defaults."""
    defaults = ControllerSettings()
    reported = _model_status(status, settings.model)
    reported = reported if isinstance(reported, dict) else {}

    def figure(key: str, told: object) -> object:
        for place in (reported, reported.get("controller")):
            if isinstance(place, dict) and place.get(key) is not None:
                return place[key]
        return told if told is not None else getattr(defaults, key)

    return exit_mode_figures(str(figure("exit_mode", settings.exit_mode)),
                             float(figure("feedback_share", settings.feedback_share)))


def write_report(report: dict, results: dict[str, LoadResult], json_out: Path | None, plots_dir: Path | None
                 ) -> dict:
    if plots_dir is not None:
        report["plots"] = [str(p) for p in write_live_plots(report, results, plots_dir)]
    write_json(report, json_out)
    return report


def score_systems(plan: LivePlan, settings: LiveSettings, results: dict[str, LoadResult], servers: dict[str, dict],
                  warmup: int, n: int) -> tuple[RampOutputs, dict[str, dict]]:
    """Every system's answers to the `n` measured requests, scored against the original model's."""
    start = plan.first + warmup
    outputs = ramp_outputs(plan.model, plan.bundle, plan.stream, start, start + n)
    return outputs, {name: score_run(settings, require_answers(result, name), outputs.final, servers[name])
                     for name, result in results.items()}


def score_run(settings: LiveSettings, result: LoadResult, reference: np.ndarray, server: dict) -> dict:
    """One replay's figures (`summarize_live`, what the server says of itself, how it stopped), its released labels
    scored against `reference`, the original model's."""
    status_before, status_after = result.status_before, result.status_after
    return (summarize_live(result, reference, settings.worst_window,
                           mean_batch_size(status_before, status_after, settings.model),
                           1.0 - settings.accuracy_constraint)
            | server_figures(status_before, status_after, settings.model)
            | {"server": server | {"status": _model_status(status_after, settings.model)}})


def _model_status(status: dict | str | None, model: str) -> dict | str | None:
    """The server's own report on the model at the end of the run (configuration, batches, the controller's
    decisions) less its last few batches, or why there is none."""
    if not isinstance(status, dict) or not isinstance(status.get("models", {}).get(model), dict):
        return status
    return {k: v for k, v in status["models"][model].items() if k != "recent_batches"}


def write_live_plots(report: dict, results: dict[str, LoadResult], out_dir: Path, bin_ms: float = 1000.0
                     ) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")  # files only: benchmarks run headless
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    title = f"{report['model']} on {report['workload']}, {report['trace']} trace at {report['rate_rps']:.0f} rps"
    written = []

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, result in results.items():
        latency = np.sort(result.latency_ms[result.ok])
        ax.plot(latency, np.arange(1, len(latency) + 1) / len(latency), label=name)
    ax.set(xlabel="latency (ms)", ylabel="share of answered requests", title=f"live latency CDF: {title}",
           xscale="log")
    ax.legend()
    ax.grid(alpha=0.3)
    written.append(out_dir / "live_latency_cdf.png")
    fig.savefig(written[-1], dpi=120, bbox_inches="tight")
    plt.close(fig)

    fig, (rate_ax, latency_ax) = plt.subplots(2, 1, figsize=(9, 6.5), sharex=True)
    # every system replays the same arrivals: the first one's are the offered load
    starts, rates = rate_over_time(next(iter(results.values())).scheduled_ms, bin_ms)
    rate_ax.step(starts / 1000.0, rates, where="post", color="k", lw=0.8)
    rate_ax.axhline(report["saturation_rps"], color="r", ls="--", lw=0.8, label="vanilla saturation")
    rate_ax.set(ylabel="offered rps", title=title)
    rate_ax.legend(fontsize=8)
    for name, result in results.items():
        ok = result.ok
        for q, style in ((50, "-"), (99, ":")):
            starts, values = binned_percentile(result.scheduled_ms[ok], result.latency_ms[ok], bin_ms, q)
            latency_ax.plot(starts / 1000.0, values, style, label=f"{name} p{q}", lw=0.9)
    latency_ax.set(xlabel="trace time (s)", ylabel=f"latency per {bin_ms / 1000:g} s (ms)", yscale="log")
    latency_ax.legend(fontsize=8, ncol=2)
    written.append(out_dir / "live_over_time.png")
    fig.savefig(written[-1], dpi=120, bbox_inches="tight")
    plt.close(fig)
    return written
