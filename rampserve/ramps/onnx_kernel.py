"""The ramp operator for ONNX Runtime (`kernels/ramp_head_onnx.cpp`, domain "rampserve", op "RampHead"): built once
per machine with g++ against ONNX Runtime's C++ headers, kept in rampserve's artifact cache, and registered with
the sessions whose graphs hold it. Imports neither torch nor anything that does: an ONNX model's executor uses it.

The headers are not in ONNX Runtime's Python package; the setup script unpacks them from Debian's
libonnxruntime-dev into the environment (`headers()`). The library does not link ONNX Runtime: it takes the API
from the runtime that loads it, which serves every API version up to its own. Where the headers or a compiler are
missing, `library()` is None and ramps stay ONNX nodes (correct, only slower). `python -m rampserve.ramps.onnx_kernel`
builds it (the setup script does, so a server never waits).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from rampserve.paths import cpu_flags, home
from rampserve.ramps.kernel_args import ARITHMETIC, DISABLE_ENV, KERNELS

log = logging.getLogger("rampserve.kernel")

DOMAIN = "rampserve"
OP_TYPE = "RampHead"
SOURCES = (KERNELS / "ramp_head_onnx.cpp", ARITHMETIC)
HEADERS_ENV = "RAMPSERVE_ONNXRUNTIME_HEADERS"  # a folder holding onnxruntime_cxx_api.h, where not the default


def headers() -> Path:
    """Where ONNX Runtime's C and C++ headers are: `RAMPSERVE_ONNXRUNTIME_HEADERS`, else the environment's include
    folder, where the setup script unpacks them."""
    return Path(os.environ.get(HEADERS_ENV, Path(sys.prefix) / "include" / "onnxruntime"))


@functools.cache
def build_id() -> str | None:
    """What a build depends on: the sources, the headers and the CPU it is tuned for (part of the key of a stored
    graph that holds the operator); None where there are no headers to build with."""
    api = headers() / "onnxruntime_c_api.h"
    if not api.is_file():
        return None
    sources = b"".join(p.read_bytes() for p in (*SOURCES, api))
    return f"ramp_head_onnx-{hashlib.sha256(sources + cpu_flags()).hexdigest()[:16]}"


@functools.cache
def library() -> str | None:
    """The operator's library, built first if needed (once per process); None where it cannot be built or is turned
    off (`RAMPSERVE_NO_RAMP_KERNEL=1`)."""
    if os.environ.get(DISABLE_ENV) == "1":
        return None
    name = build_id()
    if name is None:
        log.warning("no ONNX Runtime headers at %s (scripts/setup.sh unpacks them): ramps on ONNX stay ONNX nodes",
                    headers())
        return None
    path = home() / "kernels" / name / f"{name}.so"
    if not path.is_file():
        try:
            _build(path)
        except (OSError, subprocess.CalledProcessError) as exc:
            detail = getattr(exc, "stderr", "") or exc
            log.warning("the ONNX Runtime ramp operator did not build (%s): ramps on ONNX stay ONNX nodes", detail)
            return None
    return str(path)


def _build(path: Path) -> None:
    """Compile into a temporary file beside `path`, then rename: a process that finds `path` finds it whole."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as scratch:
        built = Path(scratch) / path.name
        subprocess.run(["g++", "-std=c++17", "-O3", "-march=native", "-Wno-psabi", "-shared", "-fPIC",
                        "-fvisibility=hidden", "-I", str(headers()), "-o", str(built), str(SOURCES[0])],
                       check=True, capture_output=True, text=True)
        os.replace(built, path)


if __name__ == "__main__":
    built = library()
    if built is None:
        raise SystemExit("the ONNX Runtime ramp operator did not build (see the warning above)")
    print(f"ONNX Runtime ramp operator ready ({build_id()})")
