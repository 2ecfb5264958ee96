"""Plots of `bench live`: each load's latency CDF and latency over time for both systems, and each system's p50 and
p99 against load (as perf_analyzer users read a server: the latency–load curve)."""

from __future__ import annotations

from pathlib import Path

import matplotlib
import numpy as np

from rampserve.bench.harness import fmt
from rampserve.bench.live import binned_percentile
from rampserve.bench.loadgen import LoadResult
from rampserve.workloads.traces import rate_over_time

matplotlib.use("Agg")  # files only: benchmarks run headless
import matplotlib.pyplot as plt  # noqa: E402


def _save(fig: plt.Figure, path: Path) -> Path:
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


def write_live_plots(report: dict, entry: dict, results: dict[str, LoadResult], out_dir: Path,
                     bin_ms: float = 1000.0) -> list[Path]:
    """One load's replays (`entry`, `results`): the latency CDF, and offered rate and latency per `bin_ms`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    title = (f"{report['model']} on {report['workload']}, {report['trace']} trace at load {fmt(entry['load'], 'g')} "
             f"({entry['rate_rps']:.0f} rps)")
    written = []

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, result in results.items():
        latency = np.sort(result.latency_ms[result.ok])
        ax.plot(latency, np.arange(1, len(latency) + 1) / len(latency), label=name)
    ax.set(xlabel="latency (ms)", ylabel="share of answered requests", title=f"live latency CDF: {title}",
           xscale="log")
    ax.legend()
    ax.grid(alpha=0.3)
    written.append(_save(fig, out_dir / "live_latency_cdf.png"))

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
    written.append(_save(fig, out_dir / "live_over_time.png"))
    return written


def write_load_plot(report: dict, out_dir: Path) -> Path:
    """Each system's replay p50 and p99 against load (`latency_by_load`), with the SLO."""
    out_dir.mkdir(parents=True, exist_ok=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    fig, ax = plt.subplots(figsize=(8, 5))
    for (name, curve), color in zip(report["latency_by_load"].items(), colors):
        loads = [point["load"] for point in curve]
        # a load where nothing was answered has no latency: a gap, not a point at 0
        for key, style in (("p50_ms", "o-"), ("p99_ms", "s--")):
            values = [np.nan if point[key] is None else point[key] for point in curve]
            ax.plot(loads, values, style, color=color, label=f"{name} {key.removesuffix('_ms')}")
    ax.axhline(report["slo_ms"], color="k", ls=":", lw=0.8, label=f"SLO {report['slo_ms']:.2f} ms")
    ax.set(xlabel=f"load (share of vanilla's saturation, {fmt(report['saturation_rps'], '.0f')} rps)",
           ylabel="replay latency (ms)", yscale="log",
           title=f"{report['model']} on {report['workload']}, {report['trace']} trace: latency against load")
    ax.title.set_fontsize(9)
    ax.legend(fontsize=8, ncol=2)
    ax.grid(alpha=0.3)
    return _save(fig, out_dir / "live_latency_by_load.png")
