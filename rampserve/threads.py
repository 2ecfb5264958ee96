"""Names the kernel knows threads by (`/proc/PID/task/TID/comm`: what top -H, py-spy and `bench live`'s CPU by
thread read). Python's thread names stay inside the interpreter, and a thread that a native library starts (ONNX
Runtime's pools) takes its creator's kernel name: without these, every thread of a server is "python" and what
each costs cannot be told apart from outside."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

COMM_BYTES = 15  # the kernel keeps at most this much of a name
_idle_native_threads = False  # set by `idle_native_threads`
_idle_pool_threads: dict[int, str] = {}  # the pools' threads `native_threads_named` scheduled under "idle-pools"
_pools_idle = True  # whether they run SCHED_IDLE now (`idle_pools_while_alone`)


def _comm(thread: int | None = None) -> Path:
    """Where the kernel keeps the name of `thread` of this process (None: the calling one)."""
    return Path(f"/proc/self/task/{threading.get_native_id() if thread is None else thread}/comm")


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
    before = _comm_of(threading.get_native_id())
    if before is None:
        yield
        return
    existing = thread_ids() if _idle_native_threads else set()  # a listing of /proc only where it is used
    set_os_thread_name(name)
    try:
        yield
    finally:
        set_os_thread_name(before)
        if _idle_native_threads:
            kept = name.encode()[:COMM_BYTES].decode(errors="ignore")  # the name as the kernel keeps it
            for thread in thread_ids() - existing:
                if _comm_of(thread) == kept:
                    _idle_pool_threads[thread] = kept
                    if _pools_idle:
                        schedule_as_idle(thread)


def idle_pools_while_alone(alone: bool) -> int:
    """Under the "idle-pools" policy, the pools' threads run SCHED_IDLE while no background work of the server runs
    (`alone`), and under the normal policy while some does: a training job is SCHED_IDLE too, and the scheduler
    shares a core between SCHED_IDLE threads alike, so beside one a served model's pool ran at half speed (lite0-
    fmnist at batch 1 on ONNX Runtime, 2 pool threads: p50 9.65 -> 19.19 ms beside a SCHED_IDLE torch job of 2
    threads; 9.53 -> 9.67 ms with the pool under the normal policy). The number of pool threads moved (0 where the
    policy is not in force, or where leaving SCHED_IDLE is not allowed: it takes CAP_SYS_NICE or RLIMIT_NICE)."""
    global _pools_idle
    if not _idle_native_threads or alone == _pools_idle:
        return 0
    _pools_idle = alone
    moved = 0
    for thread, name in list(_idle_pool_threads.items()):
        if _comm_of(thread) != name:  # the pool ended with its session (and its id may be another thread's now)
            del _idle_pool_threads[thread]
            continue
        moved += _scheduled(thread, os.SCHED_IDLE if alone else os.SCHED_OTHER)
    return moved


def idle_native_threads() -> bool:
    """From now on, threads that native code starts inside `native_threads_named` run under Linux's SCHED_IDLE (an
    executor process's "idle-pools" policy, `ModelSettings.executor_policy`). Whether they will (not on other
    systems)."""
    global _idle_native_threads
    _idle_native_threads = hasattr(os, "SCHED_IDLE")
    return _idle_native_threads


def thread_ids() -> set[int]:
    """The ids of this process's threads (none where there is no /proc)."""
    try:
        return {int(task) for task in os.listdir("/proc/self/task")}
    except OSError:
        return set()


def _comm_of(thread: int) -> str | None:
    try:
        return _comm(thread).read_text().rstrip("\n")
    except OSError:  # it ended meanwhile
        return None


def lower_os_thread_priority(niceness: int) -> None:
    """Lower the calling thread's priority by `niceness` (Linux schedules threads apart: the rest of the process keeps
    its own). Relative to what it inherited: in a server started under `nice`, an absolute value would put the thread
    level with the model's threads, or above them."""
    thread = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, thread, os.getpriority(os.PRIO_PROCESS, thread) + niceness)
    except OSError:  # not allowed here: the thread runs at the process's priority
        pass


def schedule_as_idle(thread: int = 0) -> bool:
    """Put `thread` (0: the calling one), and every thread and process it starts from then on, under Linux's
    SCHED_IDLE: a thread of any other policy that wakes takes its core at once. Whether it could (not on other
    systems)."""
    return hasattr(os, "SCHED_IDLE") and _scheduled(thread, os.SCHED_IDLE)


def _scheduled(thread: int, policy: int) -> bool:
    """Put `thread` under `policy`; whether it could (leaving SCHED_IDLE takes CAP_SYS_NICE or RLIMIT_NICE)."""
    try:
        os.sched_setscheduler(thread, policy, os.sched_param(0))
    except OSError:
        return False
    return True


class OsNamedThread(threading.Thread):
    """A thread the kernel knows by its Python name, `niceness` below the thread that starts it. With
    `below_pools`, where native pools run under SCHED_IDLE (`idle_native_threads`), it does too: a thread of any
    niceness under the normal policy takes a SCHED_IDLE thread's core at once, so at niceness alone its bursts would
    take the cores from the model's pools."""

    def __init__(self, *args, niceness: int = 0, below_pools: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.niceness = niceness
        self.below_pools = below_pools

    def run(self) -> None:
        set_os_thread_name(self.name)
        if not (self.below_pools and _idle_native_threads and schedule_as_idle()) and self.niceness:
            lower_os_thread_priority(self.niceness)
        super().run()


class RunnableWatch:
    """Whether any of some threads wants a core (is running or runnable, state R), read from the kernel's
    `/proc/PID/task/TID/stat`, which stays open: a look costs 1-2 us. A thread that has ended wants none."""

    def __init__(self, threads: Iterable[tuple[int, int]] = ()) -> None:
        """`threads`: (process id, thread id) pairs; a process's main thread has its process's id."""
        self._files: dict[tuple[int, int], int] = {}
        self.watch(threads)

    def watch(self, threads: Iterable[tuple[int, int]]) -> None:
        for thread in threads:
            if thread not in self._files:
                try:
                    self._files[thread] = os.open(f"/proc/{thread[0]}/task/{thread[1]}/stat", os.O_RDONLY)
                except OSError:  # ended already, or no /proc (not Linux): nothing to yield to
                    pass

    def forget(self, threads: Iterable[tuple[int, int]]) -> None:
        for thread in threads:
            fd = self._files.pop(thread, None)
            if fd is not None:
                os.close(fd)

    def any_runnable(self) -> bool:
        for fd in self._files.values():
            try:
                stat = os.pread(fd, 512, 0)
            except OSError:  # ended
                continue
            name_end = stat.rindex(b")")  # the state follows the command name, which may hold anything but this
            if stat[name_end + 2:name_end + 3] == b"R":
                return True
        return False

    def close(self) -> None:
        self.forget(list(self._files))
