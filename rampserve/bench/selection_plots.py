"""Plot of `bench selection`: error rate over the stream per policy and per model, with the failure shaded,
and the failing model's weight in each bandit (Clipper's figure of Exp3 and Exp4 under model failure)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: benchmarks run headless
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

BANDITS = {"exp3": "Exp3", "exp4": "Exp4"}
# The policies in colours no single model gets (the models take tab10's first colours in order).
BANDIT_COLOURS = {"exp3": "black", "exp4": "tab:cyan"}


def write_plots(report: dict, out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    settings, series = report["settings"], report["series"]
    failing = report["failing_model"]
    window = series["window"]
    # Each point stands for its bucket of queries, so it is drawn at the bucket's middle.
    x = np.asarray(series["starts"]) + window / 2
    fig, (err_ax, weight_ax) = plt.subplots(2, 1, figsize=(10, 7), sharex=True, height_ratios=(2, 1))
    for ax in (err_ax, weight_ax):
        ax.axvspan(settings["failure_start"], settings["failure_end"], color="red", alpha=0.08, lw=0)
        ax.grid(alpha=0.3)

    # The failing model's error of 1 would squash every other curve into the bottom of the plot: the scale
    # fits the others and the failing model runs off it while it fails.
    others = [v for name, v in series["error"].items() if name != failing]
    top = 1.2 * max(max(v) for v in others)
    for i, name in enumerate(report["models"]):
        label = f"{name} (fails; off the scale while failing)" if name == failing else name
        err_ax.plot(x, series["error"][name], lw=0.9, alpha=0.6, color=f"C{i}", ls="--" if name == failing else "-",
                    label=label)
    for key, label in BANDITS.items():
        eta = settings[f"{key}_eta"]
        median = f", median of {len(settings['exp3_seeds'])} seeds" if key == "exp3" else ""
        colour = BANDIT_COLOURS[key]
        err_ax.plot(x, series["error"][key], lw=2.2, color=colour, label=f"{label} (eta {eta:.4f}{median})")
        weight_ax.plot(x, series["failing_weight"][key], lw=2, color=colour, label=label)
    err_ax.set(ylim=(0, top), ylabel=f"error rate (buckets of {window} queries)",
               title=f"Model selection on Fashion-MNIST test queries: {failing} answers "
                     f"{report['failure_mode']}s in the shaded stretch")
    err_ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    weight_ax.set(yscale="log", xlabel="query", ylabel=f"{failing}'s probability",
                  title="the failing model's weight in each policy (bucket means)")
    weight_ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    path = out_dir / "selection_error_over_time.png"
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return [path]
