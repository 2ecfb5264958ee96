"""`bench dashboard`'s parts that need no server: CPU of a process tree from /proc, and the table."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from rampserve.bench.cpu import parse_stat, tree_cpu_s
from rampserve.bench.dashboard import ARMS, COMPARED, DashboardBenchSettings, dashboard_table
from rampserve.bench.harness import round_ratios
from rampserve.bench.peers import over_rounds


def test_a_stat_line_is_read_past_a_command_name_with_spaces_and_parentheses() -> None:
    fields = ["S", "41"] + [str(i) for i in range(9)] + ["120", "30"] + ["0"] * 30
    assert parse_stat(f"1234 (a (b) c) {' '.join(fields)}") == (41, 150)
    with open(f"/proc/{os.getpid()}/stat") as f:
        assert parse_stat(f.read())[0] == os.getppid()


def test_a_trees_cpu_counts_its_busy_child() -> None:
    """The tree's CPU is the kernel's account of each process in it, as the processes keep their own: the busy
    child's lies between what the child read of itself before and after, less what /proc's whole clock ticks
    drop (a tick each of user and system time); this process's tree holds this process and the child."""
    spin = ("import sys, time\n"
            "end = time.process_time() + 0.3\n"
            "while time.process_time() < end: pass\n"
            "print(time.process_time(), flush=True)\n"
            "sys.stdin.readline()\n"
            "print(time.process_time(), flush=True)\n"
            "time.sleep(30)")
    dropped = 2 / os.sysconf("SC_CLK_TCK")
    child = subprocess.Popen([sys.executable, "-c", spin], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        before = float(child.stdout.readline())  # it has spun 0.3 s of CPU and waits, alive
        own = tree_cpu_s(child.pid)
        mine = time.process_time()
        tree = tree_cpu_s(os.getpid())
        child.stdin.write("\n")
        child.stdin.flush()
        after = float(child.stdout.readline())
        assert before >= 0.3 and before - dropped <= own <= after
        assert tree >= mine - dropped + own  # this process, and the child in its tree
    finally:
        child.kill()
        child.wait()


def test_the_table_shows_medians_spans_and_ratios() -> None:
    settings = DashboardBenchSettings(rounds=2)
    rounds = {"off": [{key: 10.0 for key in COMPARED}] * 2,
              "on": [{key: 11.0 for key in COMPARED} | {"sampler_cpu_ms_per_tick": 0.3, "poll_ms": 1.5,
                                                          "poll_kb": 2.0}] * 2}
    arms = {}
    for arm in ARMS:
        medians, spans = over_rounds(rounds[arm])
        arms[arm] = medians | {"min_max": spans, "rounds": rounds[arm]}
    report = {"model": "m", "models_served": 10, "settings": settings.__dict__, "arms": arms,
              "on_over_off": round_ratios(rounds["on"], rounds["off"], list(COMPARED))}
    text = str([list(column.cells) for column in dashboard_table(report).columns])
    assert "1.100 (1.100–1.100)" in text and "0.300 (0.300–0.300)" in text and "11.00 (11.00–11.00)" in text
