"""`bench startup`'s figures and table, on this process and on a made-up report (the bench itself starts servers)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import pytest
from rich.console import Console

from rampserve.bench.startup import (
    RESTART_ROWS, StartupBenchSettings, mapped_libraries, restart_table, startup_table,
)


# In a fresh interpreter: a test worker's allocator may hand back pages it already holds (resident, freed by an
# earlier test), and its memory would not grow
GROWS = """
import json, os
import numpy as np
from rampserve.bench.startup import memory_mib
before = memory_mib(os.getpid())
touched = np.ones(64 << 20, dtype=np.uint8)  # 64 MiB, every page written
after = memory_mib(os.getpid())
print(json.dumps({"before": before, "after": after, "touched": int(touched.sum())}))
"""


def test_a_process_memory_is_at_most_its_peak_and_grows_with_what_it_touches() -> None:
    found = json.loads(subprocess.run([sys.executable, "-c", GROWS], check=True, stdout=subprocess.PIPE,
                                      text=True).stdout)
    before, after = found["before"], found["after"]
    assert 0 < before["rss_mib"] <= before["peak_rss_mib"] and after["rss_mib"] <= after["peak_rss_mib"]
    assert after["rss_mib"] - before["rss_mib"] >= 60 and found["touched"] == 64 << 20
    assert "torch" in mapped_libraries(os.getpid())  # the tests import it


def test_the_table_shows_each_models_medians_spans_and_what_its_front_end_loaded() -> None:
    def figures(ready: float, libraries: list[str]) -> dict:
        return {"ready_s": ready, "front_end_rss_mib": 80.0, "front_end_peak_rss_mib": 90.0, "executor_rss_mib": None,
                "min_max": {"ready_s": [ready - 1, ready + 1], "front_end_rss_mib": [79.0, 81.0],
                            "front_end_peak_rss_mib": [88.0, 92.0], "executor_rss_mib": None},
                "front_end_libraries": libraries}

    report = {"settings": {"rounds": 3, "vanilla": False},
              "models": {"a": figures(4.0, []), "b": figures(9.0, ["torch"])}}
    out = io.StringIO()
    Console(file=out, width=200).print(startup_table(report))
    lines = out.getvalue().splitlines()
    row_a, row_b = (next(line for line in lines if line.startswith(f"│ {m} ")) for m in "ab")
    assert "4.00 (3.00–5.00)" in row_a and "80 (79–81)" in row_a and "neither torch nor ONNX Runtime" in row_a
    assert "9.00 (8.00–10.00)" in row_b and row_b.rstrip("│ ").endswith("torch")
    assert "over 3 rounds" in out.getvalue()


def test_the_restart_table_shows_each_phase_idle_and_under_load() -> None:
    """A row per figure of a restart (kill to ready, then each phase), a column per model and load, each cell the
    figure's median and span over the rounds."""
    figures: dict = {"min_max": {}}
    for k, (_, key) in enumerate(RESTART_ROWS):
        for load, base in (("", 1.0), ("loaded_", 5.0)):
            value = base + k / 10
            figures[f"restart_{load}{key}"] = value
            figures["min_max"][f"restart_{load}{key}"] = [value - 0.5, value + 0.5]
    report = {"settings": {"rounds": 3, "restart_clients": 8}, "models": {"m": figures}}
    out = io.StringIO()
    Console(file=out, width=200).print(restart_table(report))
    text = out.getvalue()
    assert "m idle" in text and "m 8 clients" in text and "over 3 rounds" in text
    for k, (label, _) in enumerate(RESTART_ROWS):
        row = next(line for line in text.splitlines() if line.startswith(f"│ {label} "))
        assert f"{1 + k / 10:.2f} ({0.5 + k / 10:.2f}–{1.5 + k / 10:.2f})" in row
        assert f"{5 + k / 10:.2f} ({4.5 + k / 10:.2f}–{5.5 + k / 10:.2f})" in row


@pytest.mark.parametrize("bad", [{"models": ()}, {"rounds": 0}])
def test_settings_refuse_no_model_or_no_round(bad: dict) -> None:
    with pytest.raises(ValueError, match="at least one round and one model"):
        StartupBenchSettings(**bad)


def test_settings_refuse_a_restart_under_no_load() -> None:
    with pytest.raises(ValueError, match="a client at least"):
        StartupBenchSettings(restart=True, restart_clients=0)
