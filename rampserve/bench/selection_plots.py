"""Plots of `bench selection`, one per forgetting mechanism (Clipper's figure of Exp3 and Exp4 under model
failure): the error rate over the stream per policy and per model, with the failure shaded, and the failing
model's weight in each bandit; lines are medians over seeds, bands their range."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: benchmarks run headless
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

BANDIT_NAMES = {"exp3": "Exp3", "exp4": "Exp4"}
# The policies in colours no single model gets (the models take tab10's first colours in order).
BANDIT_COLOURS = {"exp3": "black", "exp4": "tab:cyan"}


def write_plots(report: dict, out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    seeds = len(report["settings"]["seeds"])
    return [_plot_mechanism(report, mechanism, out_dir / f"selection_{mechanism}_seeds{seeds}.png")
            for mechanism in report["settings"]["forgetting"]]


def _plot_mechanism(report: dict, mechanism: str, path: Path) -> Path:
    settings, series = report["settings"], report["series"]
    failing = ", ".join(report["failing_models"])
    window = series["window"]
    # Each point stands for its bucket of queries, so it is drawn at the bucket's middle.
    x = np.asarray(series["starts"]) + window / 2
    fig, (err_ax, weight_ax) = plt.subplots(2, 1, figsize=(10, 7), sharex=True, height_ratios=(2, 1))
    for ax in (err_ax, weight_ax):
        ax.axvspan(settings["failure_start"], settings["failure_end"], color="red", alpha=0.08, lw=0)
        ax.grid(alpha=0.3)

    # The failing model's error of 1 would squash every other curve into the bottom of the plot: the scale
    # fits the others and the failing model runs off it while it fails.
    others = [v["median"] for name, v in series["model_error"].items() if name not in report["failing_models"]]
    top = 1.2 * max(max(v) for v in others)
    for i, (name, error) in enumerate(series["model_error"].items()):
        fails = name in report["failing_models"]
        err_ax.plot(x, error["median"], lw=0.9, alpha=0.6, color=f"C{i}", ls="--" if fails else "-",
                    label=f"{name} (fails; off the scale while failing)" if fails else name)
    weights = report["summary"]["forgetting"][mechanism]
    for bandit, label in BANDIT_NAMES.items():
        colour = BANDIT_COLOURS[bandit]
        error, weight = series["error"][mechanism][bandit], series["failing_weight"][mechanism][bandit]
        err_ax.plot(x, error["median"], lw=2.2, color=colour,
                    label=f"{label} (eta {settings[f'{bandit}_eta']:.4f})")
        err_ax.fill_between(x, error["min"], error["max"], color=colour, alpha=0.15, lw=0)
        weight_ax.plot(x, weight["median"], lw=2, color=colour, label=label)
        weight_ax.fill_between(x, weight["min"], weight["max"], color=colour, alpha=0.15, lw=0)
        half = settings["regain_share"] * weights[bandit]["failing_weight_before"]["median"]
        weight_ax.axhline(half, color=colour, lw=0.8, ls=":",
                          label=f"{settings['regain_share']:g} of its weight before the failure ({label})")
    err_ax.set(ylim=(0, top), ylabel=f"error rate (buckets of {window} queries)",
               title=f"Model selection, {mechanism} forgetting, {len(settings['seeds'])} seeds (median, band: range): "
                     f"{failing} answers {report['failure_mode']}s in the shaded stretch")
    err_ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    weight_ax.set(yscale="log", xlabel="query", ylabel=f"{failing}'s probability",
                  title="the failing model's weight in each policy (bucket means)")
    weight_ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path
