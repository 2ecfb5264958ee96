"""A benchmark's result on disk: one JSON file per run, never written over, saying which code and which machine it
ran on (`provenance`), so that a figure quoted from it can always be traced to the run that made it."""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import rampserve

REPOSITORY = Path(rampserve.__file__).resolve().parent.parent


class ResultExists(FileExistsError):
    """A result file is already there: results are kept, each run in a file of its own."""


def provenance() -> dict:
    """The code and the machine a run is on: the checkout's commit (None outside a git checkout) and whether it had
    uncommitted changes, the command line, when, the processor and its cores."""
    commit = _git("rev-parse", "--short=7", "HEAD")
    status = _git("status", "--porcelain", "--untracked-files=no", "--", "rampserve")
    return {"commit": commit, "uncommitted_changes": None if commit is None else bool(status),
            "command": [Path(sys.argv[0]).name, *sys.argv[1:]],
            "written": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "processor": _processor(), "cpus": os.cpu_count(), "python": platform.python_version()}


def write_result(report: dict, path: Path | None, **dumps: object) -> None:
    """`report` with its provenance, as JSON at `path` (nothing for None); ResultExists where a file is there."""
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps({**report, "provenance": provenance()}, **{"indent": 2, "default": _path_text, **dumps})
    try:
        with path.open("x") as out:
            out.write(text)
    except FileExistsError:
        raise ResultExists(f"{path} exists: a result is never written over; give this run's JSON a name of its "
                           "own") from None


def _path_text(value: object) -> str:
    """A path in a report's settings (`--data`) as its text; anything else JSON cannot write stays an error."""
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"a report holds a {type(value).__name__}, which JSON cannot write")


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(REPOSITORY), *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def _processor() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            return next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), "")
    except OSError:
        return platform.processor()
