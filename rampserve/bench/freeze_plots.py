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
