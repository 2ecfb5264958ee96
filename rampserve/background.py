"""`python -m rampserve.background PARENT MODULE ARGS...`: run MODULE's command (as `python -m MODULE ARGS...`) as a
background job of the process PARENT: every thread under Linux's SCHED_IDLE, which any thread of another policy that
wakes preempts at once (a server's requests are never kept waiting for it, however many threads the job starts), and
killed the moment PARENT dies (a server stopped by SIGKILL leaves no job behind; its successor starts the job again).

The thread limits a job keeps to (`JOB_THREADS`) go in its environment, read by torch, ONNX Runtime's sessions that
rampserve makes and the BLAS libraries as they load: fewer threads is less memory bandwidth and cache taken from the
server while the job runs."""

from __future__ import annotations

import ctypes
import os
import runpy
import signal
import sys

from rampserve.threads import schedule_as_idle

PR_SET_PDEATHSIG = 1  # prctl(2): the signal this process gets when the thread that started it exits
# Threads a background job may run at once, per pool: OpenMP's (torch), the BLAS libraries', and ONNX Runtime's in
# rampserve's own sessions
JOB_THREADS = 1
JOB_ENVIRONMENT = {name: str(JOB_THREADS) for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS",
                                                       "RAMPSERVE_ORT_THREADS")} | {"TOKENIZERS_PARALLELISM": "false"}


def job_command(module: str, args: list[str]) -> list[str]:
    """The command line that runs `python -m module args` as a background job of this process."""
    return [sys.executable, "-m", __name__, str(os.getpid()), module, *args]


def job_environment() -> dict[str, str]:
    """This process's environment with the job's thread limits."""
    return {**os.environ, **JOB_ENVIRONMENT}


def main() -> None:
    parent, module, *args = sys.argv[1:]
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the job outlives a parent that is killed
        pass
    if os.getppid() != int(parent):  # the parent died before the line above could tie this job to it
        sys.exit(1)
    schedule_as_idle()
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
