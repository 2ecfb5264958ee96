"""The executor's idle poll without the GIL: a few lines of C (`native/poll_readable.c`), built once per machine into
rampserve's artifact cache and called through ctypes, which lets go of the GIL for the whole call. The same loop in
Python takes the GIL back between looks, from the executor's releasing and control threads, every time one of them
wants it. Where no C compiler is found, `native_poll()` is None and the executor polls in Python (`executor.
poll_in_python`). `python -m rampserve.serving.idle_poll` builds it (the setup script does)."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

from rampserve.paths import home

log = logging.getLogger("rampserve.serving")

SOURCE = Path(__file__).with_name("native") / "poll_readable.c"


@functools.cache
def native_poll() -> Callable[[int, float], bool] | None:
    """`poll(fd, seconds)`: whether `fd` became readable within `seconds`, polled with the GIL let go; None where
    it cannot be built or loaded here (said once in the log)."""
    try:
        library = ctypes.CDLL(str(built_library()))
    except (OSError, subprocess.CalledProcessError) as exc:
        log.warning("the executor polls in Python (the C poll could not be built or loaded: %s)", exc)
        return None
    function = library.poll_readable
    function.argtypes = (ctypes.c_int, ctypes.c_double)
    function.restype = ctypes.c_int
    return lambda fd, seconds: bool(function(fd, seconds))


def built_library() -> Path:
    """The shared library for this source and machine, compiled first if the cache has none (written whole, so
    that processes building at once never load half a file)."""
    digest = hashlib.sha256(SOURCE.read_bytes() + platform.machine().encode()).hexdigest()[:16]
    path = home() / "native" / f"poll_readable-{digest}.so"
    if path.exists():
        return path
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise OSError("no C compiler (cc or gcc) on PATH")
    path.parent.mkdir(parents=True, exist_ok=True)
    unfinished = path.with_name(f"{path.name}.{os.getpid()}.unfinished")
    subprocess.run([compiler, "-O2", "-shared", "-fPIC", "-o", str(unfinished), str(SOURCE)], check=True,
                   capture_output=True)
    os.replace(unfinished, path)
    return path


if __name__ == "__main__":
    print(built_library() if native_poll() is not None else "the executor will poll in Python: the C poll was not built")
