"""Names the kernel knows threads by (`/proc/PID/task/TID/comm`: what top -H, py-spy and `bench live`'s CPU by
thread read). Python's thread names stay inside the interpreter, and a thread that a native library starts (ONNX
Runtime's pools) takes its creator's kernel name: without these, every thread of a server is "python" and what
each costs cannot be told apart from outside."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

COMM_BYTES = 15  # the kernel keeps at most this much of a name


def _comm() -> Path:
    return Path(f"/proc/self/task/{threading.get_native_id()}/comm")


def set_os_thread_name(name: str) -> None:
    """Give the calling thread `name` (its first 15 bytes) in the kernel's accounting."""
    try:
        _comm().write_bytes(name.encode()[:COMM_BYTES])
    except OSError:  # no /proc (not Linux): the names only serve measurement
        pass


@contextmanager
def native_threads_named(name: str) -> Iterator[None]:
    """Threads that native code starts inside this block (ONNX Runtime's intra-op pool, at session creation) take
    `name` rather than the calling thread's."""
    try:
        before = _comm().read_bytes().rstrip(b"\n").decode()
    except OSError:
        yield
        return
    set_os_thread_name(name)
    try:
        yield
    finally:
        set_os_thread_name(before)


def lower_os_thread_priority(niceness: int) -> None:
    """Give the calling thread `niceness` (Linux schedules threads apart: the rest of the process keeps its own)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), niceness)
    except OSError:  # not allowed here: the thread runs at the process's priority
        pass


class OsNamedThread(threading.Thread):
    """A thread the kernel knows by its Python name, at `niceness` (0: the process's priority)."""

    def __init__(self, *args, niceness: int = 0, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.niceness = niceness

    def run(self) -> None:
        set_os_thread_name(self.name)
        if self.niceness:
            lower_os_thread_priority(self.niceness)
        super().run()
