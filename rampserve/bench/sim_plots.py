"""Plots of a simulator run: latency CDFs, accuracy over time, thresholds and active ramps over time."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: benchmarks run headless
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from rampserve.bench.sim import SimResult  # noqa: E402

CDF_SYSTEMS = ("vanilla", "rampserve", "oracle", "static_shared", "static_per_ramp", "static_hindsight")


def _rolling(values: np.ndarray, window: int) -> np.ndarray:
    sums = np.cumsum(np.concatenate([[0.0], values.astype(np.float64)]))
    return (sums[window:] - sums[:-window]) / window


def write_plots(result: SimResult, out_dir: Path, window: int = 1000) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    info = result.report
    title = f"{info['model']} on {info['workload']}, {info['trace']} trace at {info['rate_rps']:.0f} rps"
    written = []

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in CDF_SYSTEMS:
        latency = np.sort(result.runs[name].queue.latency_ms)
        ax.plot(latency, np.arange(1, len(latency) + 1) / len(latency), label=name)
    ax.set(xlabel="latency (ms)", ylabel="share of requests", title=f"latency CDF: {title}", xscale="log")
    ax.legend()
    ax.grid(alpha=0.3)
    written.append(out_dir / "latency_cdf.png")
    fig.savefig(written[-1], dpi=120, bbox_inches="tight")
    plt.close(fig)

    run = result.runs["rampserve"]
    fig, (acc_ax, thr_ax, ramps_ax) = plt.subplots(3, 1, figsize=(9, 9), sharex=True)
    for name in ("rampserve", "static_shared", "static_per_ramp", "static_hindsight"):
        correct = result.runs[name].correct
        acc_ax.plot(np.arange(window, len(correct) + 1), _rolling(correct, window), label=name, lw=0.8)
    acc_ax.axhline(1 - info["controller"]["accuracy_constraint"], color="k", ls="--", lw=0.8, label="constraint")
    acc_ax.set(ylabel=f"accuracy (last {window})", title=title)
    acc_ax.legend(fontsize=8)
    # Decisions are indexed by inputs observed, which is request order in the simulator.
    decisions = run.controller.decisions
    for site in info["sites"]:
        xs, ys = [], []
        for decision in decisions:
            config = decision.configuration
            xs.append(decision.observed)
            ys.append(config.thresholds[config.sites.index(site)] if site in config.sites else np.nan)
        if not np.all(np.isnan(ys)):
            thr_ax.step(xs, ys, where="post", label=site, lw=0.8)
    thr_ax.set(ylabel="threshold")
    if thr_ax.get_lines():
        thr_ax.legend(fontsize=7, ncol=4)
    ramps_ax.step([d.observed for d in decisions], [len(d.configuration.sites) for d in decisions], where="post")
    ramps_ax.set(xlabel="request", ylabel="active ramps")
    written.append(out_dir / "over_time.png")
    fig.savefig(written[-1], dpi=120, bbox_inches="tight")
    plt.close(fig)
    return written
