"""CPU a server spends, from the kernel's own accounting (`/proc`): the server's process and every process it
started (the model's executor, its compile worker), each process by role and each thread by name.

A reading is taken at two moments and the difference is what the server spent between them: `read_tree` gives a
JSON-able reading (the load generator takes one beside each status it reads), `cpu_used` the difference. A process
that ended in between is charged through its parent's count of reaped children, less what it had already spent at
the first reading; one that started in between counts whole. Times come in clock ticks (10 ms here), so a
difference is only meaningful over seconds of work."""

from __future__ import annotations

import os
import time
from collections import Counter
from pathlib import Path

PROC = Path("/proc")
TICKS_PER_S = os.sysconf("SC_CLK_TCK")
# What a process of the server is, from its command line: the front end is the process the reading starts from
ROLES = (("rampserve.serving.executor", "executor"), ("multiprocessing.spawn", "compile worker"),
         ("multiprocessing.resource_tracker", "resource tracker"))


def _stat_fields(stat: str) -> list[str]:
    """The fields after the command name (which may hold spaces and parentheses): state is [0], ppid [1],
    utime [11], stime [12], cutime [13], cstime [14]."""
    return stat[stat.rindex(")") + 2:].split()


def _cpu_s(fields: list[str]) -> tuple[float, float]:
    """(own user + system seconds, reaped children's)."""
    return (int(fields[11]) + int(fields[12])) / TICKS_PER_S, (int(fields[13]) + int(fields[14])) / TICKS_PER_S


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:  # it ended while being read
        return None


def parse_stat(text: str) -> tuple[int, int]:
    """(parent pid, own user + system CPU in clock ticks) from a /proc/PID/stat line."""
    fields = _stat_fields(text)
    return int(fields[1]), int(fields[11]) + int(fields[12])


def _stats() -> dict[int, tuple[int, int]]:
    """Every live process's `parse_stat`, by pid."""
    stats = {}
    for entry in PROC.iterdir():
        if entry.name.isdigit() and (stat := _read(entry / "stat")) is not None:
            stats[int(entry.name)] = parse_stat(stat)
    return stats


def descendants(root: int, stats: dict[int, tuple[int, int]] | None = None) -> list[int]:
    """`root` and every process below it, root first (`stats`: a reading of `_stats` to use)."""
    children: dict[int, list[int]] = {}
    for pid, (parent, _) in (_stats() if stats is None else stats).items():
        children.setdefault(parent, []).append(pid)
    tree, frontier = [root], [root]
    while frontier:
        frontier = [child for pid in frontier for child in children.get(pid, [])]
        tree += frontier
    return tree


def role_of(command_line: str, is_root: bool) -> str:
    if is_root:
        return "front end"
    return next((role for marker, role in ROLES if marker in command_line), "other")


def read_tree(root: int) -> dict:
    """Each live process of the tree under `root`: its role, own and reaped children's CPU seconds, and each
    thread's CPU seconds under its name (Python names the threads it starts; native pools keep the process's)."""
    processes = {}
    for pid in descendants(root):
        base = PROC / str(pid)
        stat, command_line = _read(base / "stat"), _read(base / "cmdline")
        if stat is None or command_line is None:
            continue
        own_s, children_s = _cpu_s(_stat_fields(stat))
        threads: Counter[str] = Counter()
        for task in (base / "task").iterdir() if (base / "task").is_dir() else ():
            task_stat, name = _read(task / "stat"), _read(task / "comm")
            if task_stat is not None and name is not None:
                threads[name.strip()] += _cpu_s(_stat_fields(task_stat))[0]
        processes[str(pid)] = {"role": role_of(command_line.replace("\0", " "), pid == root), "cpu_s": own_s,
                               "children_cpu_s": children_s, "threads": dict(threads)}
    return {"root": root, "processes": processes}


def cpu_used(before: dict, after: dict) -> dict:
    """CPU seconds the tree spent between two readings of it: in all, by process role, and by role and thread
    name (threads that ended in between are in their process's total, not by name)."""
    was, now = before["processes"], after["processes"]
    by_role: Counter[str] = Counter()
    by_thread: Counter[str] = Counter()
    for pid, process in now.items():
        earlier = was.get(pid, {"cpu_s": 0.0, "children_cpu_s": 0.0, "threads": {}})
        by_role[process["role"]] += process["cpu_s"] - earlier["cpu_s"]
        by_role["ended processes"] += process["children_cpu_s"] - earlier["children_cpu_s"]
        for name, seconds in process["threads"].items():
            by_thread[f"{process['role']}: {name}"] += seconds - earlier["threads"].get(name, 0.0)
    by_role["ended processes"] -= sum(process["cpu_s"] for pid, process in was.items() if pid not in now)
    by_role = Counter({role: seconds for role, seconds in by_role.items() if seconds > 0})
    return {"total_s": sum(by_role.values()), "by_role_s": dict(by_role),
            "by_thread_s": {name: seconds for name, seconds in by_thread.most_common() if seconds > 0}}


def tree_cpu_s(root: int) -> float:
    """CPU seconds used so far by a process and all its living descendants."""
    stats = _stats()
    return sum(stats[pid][1] for pid in descendants(root, stats) if pid in stats) / TICKS_PER_S


def wait_until_quiet(root: int, window_s: float = 1.0, quiet_cores: float = 0.05, limit_s: float = 60.0) -> float:
    """Wait until the process tree under `root` has used less than `quiet_cores` of a core over `window_s` (a
    server finishing work it started while it was measured: a controller's search, a set compiling), at most
    `limit_s`; how long it took."""
    start = time.monotonic()
    used = tree_cpu_s(root)
    while time.monotonic() - start < limit_s:
        time.sleep(window_s)
        now = tree_cpu_s(root)
        if now - used < quiet_cores * window_s:
            break
        used = now
    return time.monotonic() - start
