"""Where rampserve keeps artifacts it builds (trained zoo models, prepared bundles, caches), and what an artifact built
for this machine is keyed by (`cpu_flags`)."""

from __future__ import annotations

import fcntl
import os
import platform
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def home() -> Path:
    """Root of rampserve's artifact cache; `RAMPSERVE_HOME` overrides the default."""
    root = Path(os.environ.get("RAMPSERVE_HOME", Path.home() / ".cache" / "rampserve"))
    root.mkdir(parents=True, exist_ok=True)
    return root


def zoo_dir() -> Path:
    path = home() / "zoo"
    path.mkdir(parents=True, exist_ok=True)
    return path


def bundles_dir() -> Path:
    path = home() / "bundles"
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextmanager
def exclusive(folder: Path, name: str) -> Iterator[None]:
    """Hold the machine-wide lock `name` in `folder` (a hidden lock file there): the cache is shared by every
    rampserve process on the machine (a server, a bench, parallel tests), and two that build the same artifact at
    once would each replace the other's under its readers."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / f".{name}.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def cpu_flags() -> bytes:
    """The CPU's instruction set, which what is built for this machine depends on: the operators are compiled for it
    (`-march=native`), ONNX Runtime optimizes a graph for it; a cache shared with another machine must not hand it
    what was built elsewhere."""
    try:
        with open("/proc/cpuinfo", "rb") as info:
            return next((line for line in info if line.startswith(b"flags")), b"")
    except OSError:
        return platform.processor().encode()
