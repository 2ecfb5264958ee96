"""Where rampserve keeps artifacts it builds (trained zoo models, prepared bundles, caches)."""

from __future__ import annotations

import os
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
