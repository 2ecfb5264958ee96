"""Where a request's time goes, from the traces `bench live` asks both servers for (`loadgen.Job.trace`): each
request's latency cut into stages between the steps its answer passed (the client's clock and the server's are one,
CLOCK_MONOTONIC), for exited answers and final ones apart. Means add up to the mean latency; medians do not, but say
what a typical request paid at each stage."""

from __future__ import annotations

import numpy as np
from rich.table import Table

from rampserve.bench.loadgen import TRACE_STEPS, LoadResult

# (stage, the step it starts at, the step it ends at); "scheduled", "sent" and "done" are the client's
STAGES = (
    ("client late", "scheduled", "sent"),
    ("to the handler", "sent", "in"),
    ("decode, hand-off", "in", "submitted"),
    ("to the executor", "submitted", "admitted"),
    ("queued", "admitted", "started"),
    ("batch set up", "started", "ran"),
    ("model to the exit", "ran", "signalled"),
    ("release", "signalled", "released"),
    ("back to the front end", "released", "received"),
    ("front end wakes", "received", "resumed"),
    ("response built", "resumed", "answered"),
    ("encoded, to the client", "answered", "done"),
)
PATHS = ("early", "final")  # answers released at a ramp, and those the last layer gave
WHOLE = "whole latency"  # beside the stages: from the scheduled send to the answer read
TAIL_SHARE = 0.01  # `tail_stage_costs`: the slowest 1%, the requests past p99


def step_times(result: LoadResult) -> dict[str, np.ndarray]:
    """Per request, when it passed each step (ms on the run's clock; NaN where it has no such step)."""
    if result.trace_ms is None:
        raise ValueError("the run kept no traces (a job that traces: `Job.trace`)")
    steps = {"scheduled": result.scheduled_ms, "sent": result.sent_ms, "done": result.done_ms}
    return steps | {step: result.trace_ms[:, k] for k, step in enumerate(TRACE_STEPS)}


def stage_durations(result: LoadResult) -> dict[str, np.ndarray]:
    """Per request, ms spent in each of `STAGES` and its whole latency (`WHOLE`); NaN where a step is missing."""
    steps = step_times(result)
    return {stage: steps[end] - steps[start] for stage, start, end in STAGES} | \
        {WHOLE: steps["done"] - steps["scheduled"]}


def traced_in_full(durations: dict[str, np.ndarray]) -> np.ndarray:
    """The requests whose every stage is known."""
    return ~np.any(np.isnan(np.stack(list(durations.values()))), axis=0)


def stage_costs(result: LoadResult) -> dict[str, dict | None]:
    """Per path (`PATHS`), over the answered requests whose trace has every step: how many, and per stage (and the
    whole latency) the median and mean ms. None for a path no such request took."""
    durations = stage_durations(result)
    whole = durations.pop(WHOLE)
    complete = result.ok & traced_in_full(durations)
    costs: dict[str, dict | None] = {}
    for path, taken in zip(PATHS, (result.early, ~result.early)):
        rows = complete & taken
        if not rows.any():
            costs[path] = None
            continue
        costs[path] = {"requests": int(rows.sum()),
                       "latency_ms": {"median": float(np.median(whole[rows])), "mean": float(whole[rows].mean())},
                       "stages_ms": {stage: {"median": float(np.median(d[rows])), "mean": float(d[rows].mean())}
                                     for stage, d in durations.items()}}
    return costs


def tail_stage_costs(result: LoadResult, share: float = TAIL_SHARE) -> dict | None:
    """Where the tail's time went: the slowest `share` of the answered requests whose trace has every step (at least
    one), both paths together: how many there are, how many were released early, the latency they start at, when
    each was scheduled (s on the replay's clock: one stall holds many requests scheduled within it, scattered ones
    are spread over the replay), and per stage their mean ms beside the mean of the other traced answers, so that a
    tail reads as the stage it grew in. None where no answer was traced in full."""
    durations = stage_durations(result)
    whole = durations.pop(WHOLE)
    complete = np.flatnonzero(result.ok & traced_in_full(durations))
    if not len(complete):
        return None
    count = max(1, int(round(share * len(complete))))
    by_latency = complete[np.argsort(whole[complete], kind="stable")]
    tail, rest = by_latency[-count:], by_latency[:-count]

    def mean(values: np.ndarray, rows: np.ndarray) -> float | None:
        return float(values[rows].mean()) if len(rows) else None

    return {"requests": count, "early": int(result.early[tail].sum()), "from_ms": float(whole[tail].min()),
            "scheduled_s": sorted(round(float(result.scheduled_ms[i]) / 1000.0, 2) for i in tail),
            "latency_ms": {"tail": mean(whole, tail), "rest": mean(whole, rest)},
            "stages_ms": {stage: {"tail": mean(d, tail), "rest": mean(d, rest)} for stage, d in durations.items()}}


def paired_stage_costs(managed: LoadResult, vanilla: LoadResult) -> dict[str, dict | None]:
    """The same requests in both systems (a replay sends each system the same requests in the same order): per path
    of the managed answers, the median of managed minus vanilla per stage and for the whole latency, over the
    requests both answered with every step traced. The unpaired medians of `stage_costs` compare different inputs
    where paths select them (a text that runs to the end is a longer one: its model time is longer in either
    system); these do not. `model_share_by_exit_site`: per ramp that answered, the median of the managed model's
    time to it over vanilla's whole run, on the same requests."""
    if len(managed.ok) != len(vanilla.ok):
        raise ValueError(f"the runs sent different requests ({len(managed.ok)} and {len(vanilla.ok)})")
    mine, base = stage_durations(managed), stage_durations(vanilla)
    complete = managed.ok & vanilla.ok & traced_in_full(mine) & traced_in_full(base)
    paired: dict[str, dict | None] = {}
    for path, taken in zip(PATHS, (managed.early, ~managed.early)):
        rows = complete & taken
        paired[path] = None if not rows.any() else {
            "requests": int(rows.sum()),
            "difference_ms": {stage: float(np.median(mine[stage][rows] - base[stage][rows])) for stage in mine}}
    # Per exit site, the model's time to it as a share of vanilla's whole run on the same inputs: what the latency
    # profile's cost to that site says it should be
    model = "model to the exit"
    paired["model_share_by_exit_site"] = {
        site: float(np.median(mine[model][at] / base[model][at]))
        for k, site in enumerate(managed.sites) if (at := complete & (managed.exit_site == k)).any()}
    return paired


def stages_table(systems: dict[str, dict], title: str) -> Table:
    """Median (mean) ms per stage of each system's answers by path, from `stage_costs` in each system's `stages`,
    and the managed system's paired differences from vanilla where it has them (`stages_paired`)."""
    columns = [(name, path, summary["stages"][path]) for name, summary in systems.items()
               if summary.get("stages") for path in PATHS if summary["stages"][path] is not None]
    table = Table(title=title)
    table.add_column("stage")
    for name, path, cost in columns:
        table.add_column(f"{name} {path} ({cost['requests']:,})", justify="right")
    paired = [(path, cost) for path, cost in (systems.get("rampserve", {}).get("stages_paired") or {}).items()
              if path in PATHS and cost is not None]
    for path, _ in paired:
        table.add_column(f"rampserve {path} - vanilla, same requests", justify="right")
    for stage, _, _ in STAGES:
        table.add_row(stage, *(_cell(cost["stages_ms"][stage]) for _, _, cost in columns),
                      *(f"{cost['difference_ms'][stage]:+.3f}" for _, cost in paired))
    table.add_row(WHOLE, *(_cell(cost["latency_ms"]) for _, _, cost in columns),
                  *(f"{cost['difference_ms'][WHOLE]:+.3f}" for _, cost in paired))
    return table


def tail_table(systems: dict[str, dict], title: str) -> Table:
    """Per stage, the mean ms of each system's slowest answers beside its other answers' (`tail_stages`), and
    when the slowest were scheduled."""
    tails = [(name, summary["tail_stages"]) for name, summary in systems.items() if summary.get("tail_stages")]
    table = Table(title=title)
    table.add_column("stage")
    for name, tail in tails:
        table.add_column(f"{name}: slowest {tail['requests']} (from {tail['from_ms']:.1f} ms)", justify="right")
        table.add_column(f"{name}: the others", justify="right")
    for stage, _, _ in STAGES:
        table.add_row(stage, *(_mean(tail["stages_ms"][stage][side]) for _, tail in tails for side in ("tail", "rest")))
    table.add_row(WHOLE, *(_mean(tail["latency_ms"][side]) for _, tail in tails for side in ("tail", "rest")))
    table.add_row("scheduled at (s)", *(cell for _, tail in tails
                                        for cell in (_times(tail["scheduled_s"]), "")))
    return table


def _mean(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _times(seconds: list[float], shown: int = 6) -> str:
    """A tail's scheduled times, the first `shown` of them."""
    more = f" (+{len(seconds) - shown})" if len(seconds) > shown else ""
    return " ".join(f"{t:.1f}" for t in seconds[:shown]) + more


def _cell(figure: dict) -> str:
    return f"{figure['median']:.3f} ({figure['mean']:.3f})"
