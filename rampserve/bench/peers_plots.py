"""Plots of `bench peers`: every system's concurrency sweep (throughput against p50 and p99, medians over rounds) and
each round's replay latency, which shows how far the rounds spread."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: benchmarks run headless
import matplotlib.pyplot as plt  # noqa: E402


def _measured(report: dict) -> dict[str, dict]:
    return {name: s for name, s in report["systems"].items() if "error" not in s}


def _save(fig: plt.Figure, ax: plt.Axes, path: Path) -> Path:
    ax.title.set_fontsize(9)
    ax.legend(fontsize=7, ncol=2)
    ax.grid(alpha=0.3)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


def write_peer_plots(report: dict, out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    title = (f"{report['model']} on {report['workload']}, max batch {report['max_batch']}, "
             f"medians over {report['rounds']} rounds")
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    written = []

    fig, ax = plt.subplots(figsize=(8, 5))
    for (name, summary), color in zip(_measured(report).items(), colors):
        curve = summary["sweep"]
        rps = [p["throughput_rps"] for p in curve]
        ax.plot(rps, [p["p50_ms"] for p in curve], "o-", color=color, label=f"{name} p50")
        ax.plot(rps, [p["p99_ms"] for p in curve], "s--", color=color, label=f"{name} p99", alpha=0.7)
        for point in curve:
            ax.annotate(str(point["clients"]), (point["throughput_rps"], point["p50_ms"]), fontsize=7,
                        textcoords="offset points", xytext=(3, 3), color=color)
    ax.axhline(report["slo_ms"], color="k", ls=":", lw=0.8, label=f"SLO {report['slo_ms']:.2f} ms")
    ax.set(xlabel="throughput (answers/s)", ylabel="latency (ms)", yscale="log",
           title=f"closed loops of {'/'.join(map(str, report['sweep_clients']))} clients (numbers): {title}")
    written.append(_save(fig, ax, out_dir / "peers_sweep.png"))

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for (name, summary), color in zip(_measured(report).items(), colors):
        measured = [r for r in summary["rounds"] if "error" not in r]
        numbers = [r["round"] for r in measured]
        ax.plot(numbers, [r["figures"]["p50_ms"] for r in measured], "o-", color=color, label=f"{name} p50")
        ax.plot(numbers, [r["figures"]["p99_ms"] for r in measured], "s--", color=color, label=f"{name} p99",
                alpha=0.7)
    ax.set(xlabel="round", ylabel="replay latency (ms)", yscale="log",
           title=f"{report['trace']} replay at {report['rate_rps']:.0f} rps, each round: {title}")
    written.append(_save(fig, ax, out_dir / "peers_rounds.png"))
    return written
