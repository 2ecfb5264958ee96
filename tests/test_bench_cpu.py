"""The server's CPU from the kernel's accounting: a real process tree, read before and after known work."""

from __future__ import annotations

import subprocess
import sys

from rampserve.bench.cpu import cpu_used, descendants, read_tree, role_of

# A parent that, on each line it reads, runs a child through a fixed amount of work and reaps it; beside it a
# child that lives until the parent's input closes. No clock decides anything: the test waits for the parent's line.
PARENT = """
import subprocess, sys
idle = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
print("ready", flush=True)
for _ in sys.stdin:
    subprocess.run([sys.executable, "-c", "sum(i * i for i in range(3_000_000))"], check=True)
    print("done", flush=True)
idle.stdin.close()
idle.wait()
"""


def test_a_reaped_child_is_charged_to_the_tree_and_live_children_are_found():
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout.readline().strip() == "ready"
        tree = descendants(parent.pid)
        assert tree[0] == parent.pid and len(tree) == 2  # the parent and its idle child
        before = read_tree(parent.pid)
        assert {p["role"] for p in before["processes"].values()} == {"front end", "other"}
        assert cpu_used(before, before)["total_s"] == 0.0
        parent.stdin.write("go\n")
        parent.stdin.flush()
        assert parent.stdout.readline().strip() == "done"
        used = cpu_used(before, read_tree(parent.pid))
        # three million squares take a tenth of a second or more of a core: many clock ticks
        assert used["by_role_s"]["ended processes"] >= 0.05
        assert used["total_s"] >= used["by_role_s"]["ended processes"]
        assert all(seconds > 0 for seconds in used["by_thread_s"].values())
    finally:
        parent.stdin.close()
        parent.wait(timeout=30)


def test_roles_come_from_the_command_line():
    assert role_of("python -m rampserve.cli serve m", is_root=True) == "front end"
    assert role_of("python -m rampserve.serving.executor 5 6", is_root=False) == "executor"
    assert role_of("python -c from multiprocessing.spawn import spawn_main; spawn_main()", is_root=False) == \
        "compile worker"
    assert role_of("sleep 1", is_root=False) == "other"
