"""A benchmark's result is kept as it was written: a file of its own, never written over, that says which code and
which machine the run was on."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rampserve.bench.results import ResultExists, provenance, write_result
from rampserve.cli import app

ROOT = Path(__file__).resolve().parent.parent


def test_a_result_says_which_commit_and_machine_it_ran_on(tmp_path) -> None:
    path = tmp_path / "runs" / "sim.json"
    write_result({"p50": 0.6, "settings": {"data": Path("inputs.npy")}}, path)
    kept = json.loads(path.read_text())
    assert kept["p50"] == 0.6 and kept["settings"]["data"] == "inputs.npy"
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short=7", "HEAD"], capture_output=True,
                          text=True, check=True).stdout.strip()
    assert kept["provenance"]["commit"] == head
    assert isinstance(kept["provenance"]["uncommitted_changes"], bool)
    assert kept["provenance"]["cpus"] >= 1 and kept["provenance"]["command"]


def test_a_kept_result_is_never_written_over(tmp_path) -> None:
    path = tmp_path / "live.json"
    write_result({"run": 1}, path)
    with pytest.raises(ResultExists, match="never written over"):
        write_result({"run": 2}, path)
    assert json.loads(path.read_text())["run"] == 1
    write_result({"run": 3}, None)  # no path: nothing written, nothing refused


def test_a_compact_result_stays_compact(tmp_path) -> None:
    write_result({"runs": [1, 2]}, tmp_path / "r.json", indent=None, separators=(",", ":"))
    assert (tmp_path / "r.json").read_text().startswith('{"runs":[1,2],"provenance":{')


def test_a_benchmark_refuses_a_kept_result_before_it_runs(tmp_path) -> None:
    kept = tmp_path / "sim.json"
    kept.write_text("{}")
    result = CliRunner().invoke(app, ["bench", "sim", "--model", "no-such-model", "--json", str(kept)],
                                env={"COLUMNS": "1000", "TERMINAL_WIDTH": "1000"})
    assert result.exit_code == 2
    assert "exists: a result is never written over" in " ".join(result.output.replace("│", " ").split())
    assert kept.read_text() == "{}"


def test_provenance_outside_a_checkout_has_no_commit(monkeypatch, tmp_path) -> None:
    import rampserve.bench.results as results

    monkeypatch.setattr(results, "REPOSITORY", tmp_path)  # not a git checkout
    assert provenance()["commit"] is None and provenance()["uncommitted_changes"] is None
