"""Threshold tuning benchmark: Apparate's greedy search against the exhaustive grid on real ramp records.

Windows of recent inputs are cut from a workload stream's real ramp outputs; for each, both searches tune the
thresholds of evenly spaced active ramps for the same accuracy target. Reports the greedy search's time and
its savings as a share of the grid's.
"""

from __future__ import annotations

import time

import numpy as np
from tqdm.auto import tqdm

from rampserve.bench.ramp_outputs import ramp_outputs
from rampserve.control.costs import CostModel
from rampserve.control.ramps import evenly_spaced
from rampserve.control.thresholds import ExitData, tune_greedy, tune_grid
from rampserve.runtime.bundle import load_bundle
from rampserve.runtime.zoo_bundles import zoo_bundle
from rampserve.workloads.streams import get_stream


def run_tuning_bench(model: str, workload: str, ramp_counts: tuple[int, ...] = (2, 4, 8), windows: int = 20,
                     history: int = 512, target_accuracy: float = 0.99, grid_step: float = 0.1,
                     length: int = 120_000, small: bool = False) -> dict:
    bundle = zoo_bundle(model, small)
    prepared = load_bundle(bundle)
    stream = get_stream(workload, length=length)
    outputs = ramp_outputs(prepared, bundle, stream, stream.evaluation.start, stream.evaluation.stop)
    costs = CostModel(prepared.profile)
    starts = np.linspace(0, len(outputs.final) - history, windows).astype(int)
    cases = []
    for ramps in ramp_counts:
        if ramps > len(costs.sites):
            continue
        sites = tuple(costs.sites[p] for p in evenly_spaced(len(costs.sites), ramps))
        columns = outputs.columns(sites)
        greedy_ms, grid_ms, shares, accuracies = [], [], [], []
        for start in tqdm(starts, desc=f"tuning, {ramps} ramps", unit="window"):
            rows = slice(start, start + history)
            data = ExitData(outputs.labels[rows][:, columns] == outputs.final[rows, None],
                            outputs.errors[rows][:, columns].astype(np.float64),
                            costs.saved_ms(sites, np.ones(history, dtype=np.int64)))
            began = time.perf_counter()
            greedy = tune_greedy(data, target_accuracy)
            greedy_ms.append((time.perf_counter() - began) * 1000)
            began = time.perf_counter()
            grid = tune_grid(data, target_accuracy, grid_step)
            grid_ms.append((time.perf_counter() - began) * 1000)
            # Savings count from "no exit" (all ramps' cost), so both are comparable even when tiny.
            floor = data.saved_ms[:, -1].mean()
            shares.append((greedy.saved_ms - floor) / (grid.saved_ms - floor) if grid.saved_ms > floor else 1.0)
            accuracies.append((greedy.accuracy, grid.accuracy))
        accuracy = np.array(accuracies)
        cases.append({
            "ramps": ramps, "sites": list(sites), "windows": len(starts), "history": history,
            "greedy_ms_mean": float(np.mean(greedy_ms)), "greedy_ms_median": float(np.median(greedy_ms)),
            "greedy_ms_max": float(np.max(greedy_ms)),
            "grid_ms_mean": float(np.mean(grid_ms)), "grid_step": grid_step,
            "savings_share_of_grid_mean": float(np.mean(shares)),
            "savings_share_of_grid_min": float(np.min(shares)),
            "greedy_accuracy_mean": float(accuracy[:, 0].mean()), "grid_accuracy_mean": float(accuracy[:, 1].mean()),
        })
    return {"model": model, "workload": workload, "target_accuracy": target_accuracy, "cases": cases}
