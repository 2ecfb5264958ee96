"""The ramp operators (`kernels/ramp_exit.cpp`): built once per machine with the C++ compiler torch uses, kept in
rampserve's artifact cache, and loaded into every process that runs compiled ramps.

Where the build fails (no compiler), `available()` says so and sets with ramps are served eagerly: correct, only
slower. `python -m rampserve.ramps.kernel` builds it (the setup script does, so a server never waits); a server
loads it when it loads a model that compiles, before it serves.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import sys
import threading
from pathlib import Path

import torch

from rampserve.paths import cpu_flags, home
from rampserve.ramps.kernel_args import ARITHMETIC, DISABLE_ENV, KERNELS

log = logging.getLogger("rampserve.kernel")

SOURCES = (KERNELS / "ramp_exit.cpp", ARITHMETIC)

_lock = threading.Lock()
_state: dict[str, str | bool] = {}


@functools.cache
def build_id() -> str:
    """What a build depends on: the source, the torch it links against and the CPU it is tuned for (part of a
    compiled set's key)."""
    sources = b"".join(path.read_bytes() for path in SOURCES)
    digest = hashlib.sha256(sources + torch.__version__.encode() + cpu_flags()).hexdigest()[:16]
    return f"ramp_exit-{digest}"


def available() -> bool:
    """Whether the operators are loaded into this process, building them first if needed (once per process)."""
    with _lock:
        if "loaded" not in _state:
            _state["loaded"] = _load()
        return bool(_state["loaded"])


def _load() -> bool:
    if os.environ.get(DISABLE_ENV) == "1":
        _state["error"] = f"{DISABLE_ENV}=1"
        return False
    name = build_id().replace("-", "_")
    directory = home() / "kernels" / name
    library = directory / f"{name}.so"
    if library.is_file():  # built before (its name says from what): loading it takes milliseconds
        try:
            torch.ops.load_library(str(library))
            return True
        except OSError as exc:  # a build cut short: build it again
            log.warning("the ramp operators at %s do not load (%s); building them again", library, exc)
    directory.mkdir(parents=True, exist_ok=True)
    # torch runs `ninja` from PATH; the pinned one is installed beside this interpreter
    os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    try:
        from torch.utils import cpp_extension

        # The build directory is locked by torch while one process builds; others wait and load its library
        cpp_extension.load(name=name, sources=[str(SOURCES[0])], build_directory=str(directory), is_python_module=False,
                           extra_cflags=["-O3", "-march=native", "-Wno-psabi"], verbose=False)
    except Exception as exc:  # a missing compiler or headers: serve with ramps in Python
        _state["error"] = f"{type(exc).__name__}: {exc}"
        log.warning("the ramp operators could not be built (%s); sets with ramps are served eagerly",
                    _state["error"])
        return False
    return True


if __name__ == "__main__":
    if not available():
        raise SystemExit(f"the ramp operators did not build: {_state.get('error')}")
    print(f"ramp operators ready ({build_id()})")
