"""Thread names the kernel knows: what `bench live`'s CPU by thread reads."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from rampserve.threads import OsNamedThread, RunnableWatch, native_threads_named, set_os_thread_name


def _comm(tid: int) -> str:
    return Path(f"/proc/self/task/{tid}/comm").read_text().strip()


def _tids() -> set[int]:
    return {int(tid) for tid in os.listdir("/proc/self/task")}


def test_a_thread_is_known_to_the_kernel_by_its_python_name_cut_to_15_bytes():
    seen: list[str] = []
    thread = OsNamedThread(target=lambda: seen.append(_comm(threading.get_native_id())),
                           name="releaser-resnet18-fmnist")
    thread.start()
    thread.join()
    assert seen == ["releaser-resnet"]


def test_threads_started_inside_the_block_take_its_name_and_the_caller_keeps_its_own():
    me = threading.get_native_id()
    set_os_thread_name("test-caller")
    seen: list[str] = []
    with native_threads_named("onnxruntime"):
        plain = threading.Thread(target=lambda: seen.append(_comm(threading.get_native_id())))
        plain.start()
        plain.join()
    assert seen == ["onnxruntime"]
    assert _comm(me) == "test-caller"


def test_an_onnx_runtime_pool_started_inside_the_block_is_named_for_it():
    import numpy as np
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper

    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 3  # a pool of two threads beside the caller
    before = _tids()
    with native_threads_named("onnxruntime"):
        session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    started = _tids() - before
    assert started and {_comm(tid) for tid in started} == {"onnxruntime"}
    assert session.run(None, {"x": np.array([-1, 0, 1, 2], dtype=np.float32)})[0].tolist() == [0, 0, 1, 2]


def test_a_thread_given_a_niceness_runs_that_much_below_its_starter_and_the_rest_of_the_process_keeps_its_own():
    # relative: under `nice -n 5` (as the test command may be run) the thread runs at 12, below the process's threads
    seen: list[int] = []
    before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    thread = OsNamedThread(target=lambda: seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id())),
                           name="controller-test", niceness=7)
    thread.start()
    thread.join()
    assert seen == [before + 7]
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before


def test_a_thread_below_the_pools_runs_idle_where_they_do_and_at_its_niceness_elsewhere(monkeypatch):
    # Where the model's native pools run under SCHED_IDLE, a thread at niceness alone would take their cores
    import rampserve.threads as threads

    def policy_and_niceness(idle_pools: bool) -> tuple[int, int]:
        monkeypatch.setattr(threads, "_idle_native_threads", idle_pools)
        seen: list[tuple[int, int]] = []
        thread = OsNamedThread(target=lambda: seen.append((os.sched_getscheduler(0), os.getpriority(
            os.PRIO_PROCESS, threading.get_native_id()))), name="controller-test", niceness=7, below_pools=True)
        thread.start()
        thread.join()
        return seen[0]

    before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    assert policy_and_niceness(False) == (os.SCHED_OTHER, before + 7)
    assert policy_and_niceness(True)[0] == os.SCHED_IDLE
    assert os.sched_getscheduler(0) == os.SCHED_OTHER  # the rest of the process keeps its own


def test_a_watch_sees_a_process_want_a_core_while_it_computes_and_not_while_it_waits_or_once_it_ended():
    """Processes of their own, so that the GIL never makes the computing one wait."""
    computing = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    # It says when it is about to sleep: an interpreter starting up waits on its files now and then, and a watch
    # that caught it between two of those waits saw it runnable again a moment later (the suite on a loaded machine)
    waiting = subprocess.Popen([sys.executable, "-c", "import time; print('sleeping', flush=True); time.sleep(600)"],
                               stdout=subprocess.PIPE, text=True)
    watch = RunnableWatch([(waiting.pid, waiting.pid)])
    try:
        assert waiting.stdout.readline() == "sleeping\n"
        settled = time.monotonic() + 30
        while watch.any_runnable():  # from the print to the sleep
            assert time.monotonic() < settled, "the sleeping process never slept"
            time.sleep(0.01)
        watch.watch([(computing.pid, computing.pid), (waiting.pid, 1 << 30)])  # no such thread: nothing to watch
        assert watch.any_runnable()
        watch.forget([(computing.pid, computing.pid)])
        assert not watch.any_runnable()
        watch.watch([(computing.pid, computing.pid)])
        computing.kill(), waiting.kill()
        computing.wait(), waiting.wait()
        assert not watch.any_runnable()  # both ended
    finally:
        computing.kill(), waiting.kill()
        waiting.stdout.close()
        watch.close()


POOLS_BESIDE_BACKGROUND = """
import json, os
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper
from rampserve import threads

def policies():
    found = []
    for task in os.listdir("/proc/self/task"):
        if open(f"/proc/self/task/{task}/comm").read().strip() == "onnxruntime":
            found.append(os.sched_getscheduler(int(task)))
    return found

assert threads.idle_native_threads()
graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])])
model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
options = ort.SessionOptions()
options.intra_op_num_threads = 3
with threads.native_threads_named("onnxruntime"):
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
alone = policies()
beside = (threads.idle_pools_while_alone(False), threads.idle_pools_while_alone(False), policies())
with threads.native_threads_named("onnxruntime"):  # a pool started while background work runs
    later = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
beside_both = policies()
after = (threads.idle_pools_while_alone(True), policies())
try:  # whether this process may leave SCHED_IDLE at all (CAP_SYS_NICE, or RLIMIT_NICE of 20)
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
    may_leave = True
except OSError:
    may_leave = False
print(json.dumps({"alone": alone, "beside": beside, "beside_both": beside_both, "after": after,
                  "may_leave": may_leave}))
"""


def test_idle_pools_leave_sched_idle_while_the_servers_background_work_runs_and_go_back_once_it_ends():
    """Under "idle-pools" the pools' threads run SCHED_IDLE; a training job is SCHED_IDLE too and would share their
    cores alike, so while one runs they run under the normal policy (a pool started meanwhile too), and once it ended
    under SCHED_IDLE again. Where the process may not leave SCHED_IDLE, nothing moves and the call says so."""
    out = subprocess.run([sys.executable, "-c", POOLS_BESIDE_BACKGROUND], capture_output=True, text=True,
                         timeout=120, check=True)
    seen = json.loads(out.stdout)
    idle, normal = os.SCHED_IDLE, os.SCHED_OTHER
    pools = len(seen["alone"])
    assert pools == 2 and set(seen["alone"]) == {idle}
    moved, again, beside = seen["beside"]
    assert again == 0  # the pools are where the call asks already
    if seen["may_leave"]:
        assert moved == pools and set(beside) == {normal}
        assert len(seen["beside_both"]) == 2 * pools and set(seen["beside_both"]) == {normal}
        assert seen["after"][0] == 2 * pools and set(seen["after"][1]) == {idle}
    else:
        assert moved == 0 and set(beside) == {idle} and set(seen["after"][1]) == {idle}
