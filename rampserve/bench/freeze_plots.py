"""Plots of `bench freeze`: where inputs exit (Freeze Inference's Figures 4/5), exit share over the stream
with and without online cache updates, and cache memory per site (its Table 1)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: benchmarks run headless
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from rampserve.bench.freeze import SHIFT_WINDOW, ModelRuns  # noqa: E402
from rampserve.bench.sim_plots import _rolling  # noqa: E402

DEPTH_SYSTEMS = ("static", "static_online", "managed", "managed_online")


def _save(fig: plt.Figure, path: Path, written: list[Path]) -> None:
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    written.append(path)


def write_plots(report: dict, models: dict[str, ModelRuns], out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    for name, runs in models.items():
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for system in DEPTH_SYSTEMS:
            depth = np.sort(runs.depth[runs.runs[system].exit_column])
            ax.step(depth, np.arange(1, len(depth) + 1) / len(depth), where="post", label=system)
        ax.set(xlabel="share of the model run before the answer (batch-1 time)", ylabel="share of requests",
               title=f"{name}: where requests are answered (CDF)", xlim=(0, 1.02))
        ax.legend()
        ax.grid(alpha=0.3)
        _save(fig, out_dir / f"{name}-exit_depth_cdf.png", written)

        fig, ax = plt.subplots(figsize=(9, 4.5))
        for system in DEPTH_SYSTEMS:
            ax.plot(_rolling(runs.runs[system].exited, SHIFT_WINDOW), label=system, lw=1)
        for shift in report["models"][name]["shift_recovery"]["static"]["shifts"]:
            ax.axvline(shift["position"] - SHIFT_WINDOW, color="grey", lw=0.5, ls=":")
        ax.set(xlabel=f"request (rolling window of {SHIFT_WINDOW} ending here)", ylabel="exit share",
               title=f"{name}: exit share over the drifting stream; dotted: phase shifts")
        ax.legend()
        ax.grid(alpha=0.3)
        _save(fig, out_dir / f"{name}-exit_share_over_time.png", written)

        memory = report["models"][name]["memory"]
        sites = [row["site"] for row in memory]
        x = np.arange(len(sites))
        fig, ax = plt.subplots(figsize=(9, 4.5))
        for offset, key, label in ((-0.27, "knn_raw_bytes", "k-NN, raw activations"),
                                   (0.0, "knn_reduced_bytes", "k-NN, reduced"), (0.27, "kmeans_bytes", "k-means")):
            ax.bar(x + offset, [row[key] for row in memory], width=0.27, label=label)
        ax.set(yscale="log", ylabel="bytes", title=f"{name}: cache memory per site")
        ax.set_xticks(x, sites, rotation=45, ha="right", fontsize=7)
        ax.legend()
        _save(fig, out_dir / f"{name}-memory.png", written)
    return written


def write_exit_kinds_plots(report: dict, out_dir: Path) -> Path:
    """`bench freeze --model`: per site, the share of the stream a cache and the model's ramp can answer at the
    oracle's disagreement beside the share a cache must answer to repay its charge; and each system's p50 against
    vanilla over seeds (median, min–max)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = report["sites"]
    x = np.arange(len(rows))
    fig, (sites_ax, systems_ax) = plt.subplots(1, 2, figsize=(14, 4.8), gridspec_kw={"width_ratios": [3, 2]})
    for key, label, marker in (("cache_answerable", "cache answers", "o"), ("ramp_answerable", "ramp answers", "s")):
        values = np.array([row[key] for row in rows])  # (sites, seeds)
        median = np.median(values, axis=1)
        sites_ax.errorbar(x, median, yerr=[median - values.min(axis=1), values.max(axis=1) - median], marker=marker,
                          capsize=2, label=f"{label} at {report['oracle_disagreement']:.0%} disagreement")
    even = [np.nan if row["break_even_share"] is None else row["break_even_share"] for row in rows]
    sites_ax.plot(x, even, "k--", marker="x", label="share a cache must answer to repay its charge (mean)")
    sites_ax.axhline(0.5, color="grey", lw=1, ls=":", label="more than half must exit before the end to move p50")
    sites_ax.set_xticks(x, [row["site"] for row in rows], rotation=60, ha="right", fontsize=7)
    sites_ax.set(ylabel="share of the stream", ylim=(0, 1.02), title=f"{report['model']}: per site, batch 1")
    sites_ax.legend(fontsize=8)
    sites_ax.grid(alpha=0.3)
    names = list(report["summary"])
    p50 = [report["summary"][n].get("p50_ratio") for n in names]
    median = np.array([f["median"] for f in p50])
    spread = np.array([[f["median"] - f["min"], f["max"] - f["median"]] for f in p50]).T
    systems_ax.barh(np.arange(len(names)), median, xerr=spread, capsize=3, color="tab:blue", alpha=0.7)
    systems_ax.axvline(1.0, color="k", lw=0.8)
    systems_ax.set_yticks(np.arange(len(names)), names)
    systems_ax.set(xlabel=f"p50 × vanilla (median, min–max over {report['seeds']} seeds)",
                   title=f"{report['model']}: managed exits, simulated")
    systems_ax.grid(alpha=0.3, axis="x")
    written: list[Path] = []
    _save(fig, out_dir / f"{report['model']}-caches-vs-ramps.png", written)
    return written[0]
