"""The executor process per model: the wire format (pure), serving through it, and its faults on real processes
(a killed executor, a SIGTERM to the server, shared memory left behind)."""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as triton_grpc
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from prometheus_client.parser import text_string_to_metric_families
from test_shadow_batches import FixedControl, HeldCompiler

from rampserve.bench.harness import free_port, http_status
from rampserve.bench.loadgen import TRACE_STEPS
from rampserve.control.records import Configuration
from rampserve.graph.onnx_graph import ORT_POOL_NAME
from rampserve.runtime.bundle import save_bundle
from rampserve.serving.executor.compiling import likely_next_sets
from rampserve.serving.executor.core import StatusReplies, wait_readable
from rampserve.serving.executor.loading import load_served, loaded
from rampserve.serving.executor.loading import served as make_served
from rampserve.serving.executor.worker import ModelWorker
from rampserve.serving.server import ServerSettings, build_state, running_server
from rampserve.serving.shared import wire
from rampserve.serving.shared.contract import Answer, Exits, ModelRequest, Stamps
from rampserve.serving.shared.metrics import ServerMetrics
from rampserve.serving.shared.models import ServedModel
from rampserve.serving.shared.settings import ModelSettings

MODEL = "resnet18-small"


@pytest.fixture(scope="module")
def served(resnet_bundle) -> ServedModel:
    return loaded(load_served(str(resnet_bundle)))


def infer_body(served: ServedModel, x: np.ndarray, **parameters) -> bytes:
    return json.dumps({"inputs": [{"name": served.inputs[0].name, "shape": list(x.shape), "datatype": "FP32",
                                   "data": x.ravel().tolist()}], "parameters": parameters}).encode()


def post(url: str, body: bytes) -> tuple[int, dict]:
    request = urllib.request.Request(url, body, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as response:
        return json.loads(response.read())


def get_text(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as response:
        return response.read().decode()


def shared_memory_files() -> set[str]:
    return set(os.listdir("/dev/shm"))


# ---- the wire format (pure) ----------------------------------------------------------------------------------------


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([wire.REQUEST, wire.ANSWER, wire.REPLY]),
                          st.dictionaries(st.text(max_size=5), st.integers(-2**63, 2**63 - 1), max_size=4),
                          st.binary(max_size=300)), min_size=1, max_size=6),
       st.lists(st.integers(1, 64), min_size=1, max_size=20))
def test_frames_come_out_whole_however_the_stream_is_cut(messages, cuts) -> None:
    stream = b"".join(wire.frame(kind, header, body) for kind, header, body in messages)
    reader, got, at, k = wire.FrameReader(), [], 0, 0
    while at < len(stream):
        step = cuts[k % len(cuts)]
        got += [(kind, header, bytes(body)) for kind, header, body in reader.feed(stream[at:at + step])]
        at, k = at + step, k + 1
    assert got == messages


@settings(max_examples=50, deadline=None)
@given(hnp.arrays(st.sampled_from([np.float32, np.int64, np.uint8]), hnp.array_shapes(min_dims=1, max_dims=3,
                                                                                    max_side=6)),
       hnp.arrays(np.float64, hnp.array_shapes(min_dims=1, max_dims=2, max_side=5)))
def test_tensors_come_out_of_a_slot_as_they_went_in(first: np.ndarray, second: np.ndarray) -> None:
    inputs = {"a": first, "b": second}
    arena = wire.SlotArena.create("test", 4096, 2)
    try:
        layout, size = wire.layout_of(inputs)
        slot = arena.take()
        wire.pack_into(arena.view[arena.offset(slot):arena.offset(slot) + size], inputs, layout)
        layout = json.loads(json.dumps(layout))  # as it travels
        out = wire.unpack(arena.view, layout, arena.offset(slot))
    finally:
        arena.close()
    for name, array in inputs.items():
        assert out[name].dtype == array.dtype and out[name].shape == array.shape
        np.testing.assert_array_equal(out[name], array)


@given(st.integers(1, 5), st.booleans(), st.none() | st.floats(0.5, 500.0), st.integers(-3, 3), st.booleans())
def test_a_request_survives_the_wire(rows: int, needs_final: bool, deadline_ms: float | None, priority: int,
                                     keeps_final: bool) -> None:
    """In the frame's body (no arena slot): the executor reads back the request the front end sent, field for field."""
    inputs = {"x": np.arange(rows * 3, dtype=np.float32).reshape(rows, 3), "mask": np.ones((rows, 2), np.int64)}
    request = ModelRequest(inputs, needs_final, deadline_ms, priority, parameters={"uid": "stays"},
                           on_final=(lambda final: None) if keeps_final else None)
    layout, size = wire.layout_of(inputs)
    body = bytearray(size)
    wire.pack_into(memoryview(body), inputs, layout)
    [(kind, header, frame_body)] = list(wire.FrameReader().feed(wire.request_frame(5, request, layout, None, body)))
    sent_back: list[Answer] = []
    back = wire.read_request(header, wire.unpack(frame_body, header["layout"]), sent_back.append)
    assert kind == wire.REQUEST and header["i"] == 5 and header["slot"] is None and header["keep"] == keeps_final
    assert (back.needs_final, back.deadline_ms, back.priority, back.arrival, back.rows, back.parameters) == \
        (needs_final, deadline_ms, priority, request.arrival, rows, {})
    assert (back.on_final == sent_back.append) if keeps_final else back.on_final is None
    for name, array in inputs.items():
        np.testing.assert_array_equal(back.inputs[name], array)
        assert back.inputs[name].dtype == array.dtype


@given(st.integers(1, 5), st.booleans())
def test_an_answer_survives_the_wire(rows: int, with_logits: bool) -> None:
    rng = np.random.default_rng(rows)
    sites = tuple(None if i % 2 else f"layer{i}" for i in range(rows))
    answer = Answer(rng.integers(0, 10, rows), rng.random(rows),
                    rng.random((rows, 10)).astype(np.float32) if with_logits else None,
                    Exits(sites, tuple(None if s is None else 0.25 for s in sites), 3, 7),
                    Stamps(1.5, 1.75, 1.875, 2.0, 2.25))
    [(kind, header, body)] = list(wire.FrameReader().feed(wire.answer_frame(wire.ANSWER, 11, answer)))
    read_before = time.monotonic()
    back = wire.read_answer(header, body)
    assert kind == wire.ANSWER and header["i"] == 11
    np.testing.assert_array_equal(back.labels, answer.labels)
    np.testing.assert_array_equal(back.confidences, answer.confidences)
    assert back.exits == answer.exits and back.exits.config_version == 3 and back.exits.batch_id == 7
    assert back.stamps.to_json() | {"received": 0} == answer.stamps.to_json() | {"received": 0}
    assert read_before <= back.stamps.received <= time.monotonic()  # the front end's own reading
    if with_logits:
        np.testing.assert_array_equal(back.logits, answer.logits)
    else:
        assert back.logits is None


def test_slots_are_taken_once_and_come_back() -> None:
    arena = wire.SlotArena.create("test", 4096, 3)
    try:
        taken = [arena.take() for _ in range(3)]
        assert sorted(taken) == [0, 1, 2] and arena.take() is None
        arena.give(taken[1])
        assert arena.take() == taken[1]
    finally:
        arena.close()


# ---- how the executor waits for frames ------------------------------------------------------------------------------


def send_once_waiting(writer: socket.socket, reader: int, stage: str) -> threading.Thread:
    """A thread that sends a byte once thread `reader` is inside `wait_readable` and has set `stage` (a local of
    it), i.e. has looked once and found nothing."""
    def send() -> None:
        while True:
            frame = sys._current_frames().get(reader)
            if frame is not None and frame.f_code is wait_readable.__code__ and stage in frame.f_locals:
                break
            time.sleep(0.001)
        writer.send(b"y")
    thread = threading.Thread(target=send)
    thread.start()
    return thread


def test_a_frame_is_found_by_polling_within_the_window_and_by_sleeping_after_it() -> None:
    reader, writer = socket.socketpair()
    with reader, writer:
        now = time.monotonic()
        assert wait_readable(reader, 0.01, now + 60) is None  # nothing came: the timeout ends the poll
        assert wait_readable(reader, 0.0, now - 1) is None
        writer.send(b"x")
        assert wait_readable(reader, None, now + 60) == "ready"
        reader.recv(1)
        for poll_until, stage, how in ((time.monotonic() + 60, "stop_polling", "polled"),
                                       (time.monotonic() - 1, "remaining", "slept")):
            sender = send_once_waiting(writer, threading.get_ident(), stage)
            assert wait_readable(reader, None, poll_until) == how
            sender.join()
            reader.recv(1)


def test_while_a_sched_idle_thread_waits_for_a_core_the_poll_rests_in_the_kernel_and_a_frame_still_ends_it() -> None:
    """sched_yield passes the core to normal threads alone: a poll that kept looking would keep the controller and a
    training job (SCHED_IDLE) off the core for as long as requests come."""
    asked = []

    def others_waiting() -> bool:
        asked.append(time.monotonic())
        return True

    reader, writer = socket.socketpair()
    with reader, writer:
        now = time.monotonic()
        # nothing comes: it rests until the poll window ends, then sleeps until the timeout
        assert wait_readable(reader, 0.05, now + 0.02, others_waiting) is None
        assert asked and asked[-1] < now + 0.02  # asked only within the poll window
        sender = send_once_waiting(writer, threading.get_ident(), "stop_polling")
        assert wait_readable(reader, None, time.monotonic() + 60, others_waiting) == "rested"  # woken, not polled
        sender.join()


# ---- serving through the executor process ---------------------------------------------------------------------------


def test_a_bundle_is_served_by_an_executor_process_with_the_original_answers(served, fmnist_feeds) -> None:
    x = fmnist_feeds[:6]
    before = shared_memory_files()
    state = build_state([served], ModelSettings(), ServerSettings(port=0, grpc=False))
    with running_server(state) as url:
        status = get_json(url + "/status")["models"][MODEL]
        assert status["executor"]["kind"] == "process" and status["executor"]["pid"] != os.getpid()
        # one input per request through shared memory, and 32 in one request: more than a slot holds
        for i in range(len(x)):
            code, body = post(f"{url}/v2/models/{MODEL}/infer", infer_body(served, x[i:i + 1]))
            assert code == 200, body
        big = np.concatenate([fmnist_feeds, fmnist_feeds])
        assert big.nbytes > 64 << 10
        code, body = post(f"{url}/v2/models/{MODEL}/infer", json.dumps({"inputs": [
            {"name": served.inputs[0].name, "shape": list(big.shape), "datatype": "FP32", "data": big.ravel().tolist()}],
            "outputs": [{"name": "logits"}]}).encode())
        assert code == 200, body
        logits = np.asarray(body["outputs"][0]["data"], dtype=np.float32).reshape(len(big), -1)
        want = served.prepared.run({served.inputs[0].name: big})
        np.testing.assert_allclose(logits, want, rtol=0, atol=1e-5)
        deadline = time.monotonic() + 30  # the books are kept after the answers are out
        while get_json(url + "/status")["models"][MODEL]["inputs"] < len(x) + len(big):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        metrics = get_text(url + "/metrics")
        assert f'rampserve_answers_total{{model="{MODEL}",path="final"}}' in metrics or \
            f'rampserve_answers_total{{model="{MODEL}",path="early"}}' in metrics
        assert metrics.count("# TYPE rampserve_answers_total counter") == 1  # merged, not repeated
        pid = status["executor"]["pid"]
    assert not Path(f"/proc/{pid}").exists() or _is_zombie(pid)
    assert shared_memory_files() <= before


def test_a_traced_answer_says_when_it_passed_each_step(served, fmnist_feeds) -> None:
    """The steps come in the order the request passed them, on the client's clock, which `bench live` reads them on
    (`loadgen.TRACE_STEPS`); an answer not asked for its trace carries none; a trace asked for wrongly is refused."""
    state = build_state([served], ModelSettings(), ServerSettings(port=0, grpc=False))
    with running_server(state) as url:
        infer = f"{url}/v2/models/{MODEL}/infer"
        for i in range(4):  # distinct inputs: none is answered from the prediction cache
            sent = time.perf_counter()
            code, body = post(infer, infer_body(served, fmnist_feeds[i:i + 1], trace=True))
            back = time.perf_counter()
            assert code == 200, body
            trace = body["parameters"]["trace"]
            assert tuple(trace) == TRACE_STEPS
            assert sent <= trace["in"] and trace["answered"] <= back
            assert all(a <= b for a, b in zip(trace.values(), list(trace.values())[1:])), trace
        code, body = post(infer, infer_body(served, fmnist_feeds[4:5]))
        assert code == 200 and "trace" not in body["parameters"]
        code, body = post(infer, infer_body(served, fmnist_feeds[5:6], trace="yes"))
        assert code == 400 and "parameter trace must be true or false" in body["error"]


def frames_found(url: str) -> dict[str, float]:
    """How the executor found the front end's frames so far, by way (`Executor.collect`)."""
    return {sample.labels["how"]: sample.value
            for family in text_string_to_metric_families(get_text(url + "/metrics"))
            for sample in family.samples if sample.name == "rampserve_executor_frames_found_total"}


@pytest.mark.parametrize("idle_poll_ms", [0.0, 60_000.0])
def test_the_executor_polls_for_requests_only_within_its_window(served, fmnist_feeds, idle_poll_ms) -> None:
    state = build_state([served], ModelSettings(idle_poll_ms=idle_poll_ms), ServerSettings(port=0, grpc=False))
    with running_server(state) as url:
        assert get_json(url + "/status")["models"][MODEL]["executor"]["idle_poll_ms"] == idle_poll_ms
        for i in range(5):
            code, body = post(f"{url}/v2/models/{MODEL}/infer", infer_body(served, fmnist_feeds[i:i + 1]))
            assert code == 200, body
            if i == 0:
                before = frames_found(url)
        after = frames_found(url)
    # each frame after the first request was found one way (already there if it came while the last batch ended;
    # within the window, while polling or while the poll rested for the control thread): a window of a minute holds
    # them all, none without one
    found = {how: after[how] - before.get(how, 0.0) for how in after}
    within, slept = found["polled"] + found["rested"], found["slept"]
    assert found["ready"] + within + slept >= 5 and (slept if idle_poll_ms else within) == 0


def test_a_status_question_waits_for_the_controller_off_the_executor_thread(served, fmnist_feeds) -> None:
    """The control thread holds the controller while it learns from a record (a search: 0.3 s of a core or more).
    A status question asked meanwhile takes the serving part at once, on the thread that asks (the executor thread,
    which has batches to run), and its reply waits for the controller on the status thread; requests are answered
    meanwhile."""
    worker = ModelWorker(served, ModelSettings(), ServerMetrics())
    replies: queue.SimpleQueue[bytes] = queue.SimpleQueue()
    statuses = StatusReplies(worker, replies.put)
    name = served.inputs[0].name
    answered = threading.Semaphore(0)
    worker.start()
    try:
        with worker.control._lock:  # as the control thread holds it while it learns
            asking = threading.Thread(target=statuses.ask, args=(7, 1))
            asking.start()
            asking.join(60)
            assert not asking.is_alive(), "the status question waited for the controller"
            worker.queue.admit(ModelRequest({name: fmnist_feeds[:1]}), lambda _: answered.release())
            assert answered.acquire(timeout=60), "a request waited for the controller"
            assert replies.empty()  # the reply waits for the controller's part
        reply = replies.get(timeout=60)
    finally:
        statuses.close()
        worker.stop()
    [(kind, header, _)] = list(wire.FrameReader().feed(reply))
    status = header["r"]
    assert kind == wire.REPLY and header["i"] == 7
    assert sum(status["answers"].values()) == 0  # the serving part, as it was when asked: before the request
    assert status["vanilla"] is False and len(status["decisions"]) == 1 and "window_accuracy" in status


def test_frames_other_than_requests_open_no_poll_window(served, fmnist_feeds) -> None:
    """The dashboard's sampler asks an idle server for metrics and status every second: were each of its frames to
    open the poll window, an idle executor would spend a core's 5% polling."""
    state = build_state([served], ModelSettings(idle_poll_ms=60_000.0), ServerSettings(port=0, grpc=False))
    with running_server(state) as url:
        for _ in range(4):
            get_json(url + "/status")
        before = frames_found(url)
        code, body = post(f"{url}/v2/models/{MODEL}/infer", infer_body(served, fmnist_feeds[:1]))
        assert code == 200, body
        after = frames_found(url)
    # status and metrics frames before any request: none polled for (a minute's window would hold them all)
    assert before.get("polled", 0) + before.get("rested", 0) == 0 and before["ready"] + before["slept"] >= 5
    assert sum(after.values()) > sum(before.values())


@pytest.mark.parametrize("policy", ["normal", "idle-pools", "idle"])
def test_the_executor_process_runs_under_its_scheduling_policy(onnx_prepared, fmnist_feeds, tmp_path, policy) -> None:
    """An ONNX model's executor: under "idle-pools" ONNX Runtime's pool threads and the control thread (which would
    take their cores at niceness alone) are SCHED_IDLE and the others keep the normal policy, under "idle" every
    thread is (those there when it was set and those started after, the pools among them), under "normal" none; the
    front end's own threads keep theirs."""
    served = load_served(str(save_bundle(onnx_prepared, tmp_path / MODEL)))
    state = build_state([served], ModelSettings(executor_policy=policy), ServerSettings(port=0, grpc=False))
    with running_server(state) as url:
        code, body = post(f"{url}/v2/models/{MODEL}/infer", infer_body(served, fmnist_feeds[:1]))
        assert code == 200, body
        executor = get_json(url + "/status")["models"][MODEL]["executor"]
        threads = thread_policies(executor["pid"])
        front_end = thread_policies(os.getpid())
    below_pools = (ORT_POOL_NAME, f"controller-{MODEL}"[:15])
    pools = {scheduled for name, scheduled in threads.values() if name in below_pools}
    others = {scheduled for name, scheduled in threads.values() if name not in below_pools}
    assert {name for name, _ in threads.values()} >= set(below_pools)
    idle, normal = os.SCHED_IDLE, os.SCHED_OTHER
    assert executor["policy"] == policy
    # ONNX Runtime at its default threads starts a pool on a machine of two cores or more
    assert (pools, others) == {"normal": ({normal}, {normal}), "idle-pools": ({idle}, {normal}),
                               "idle": ({idle}, {idle})}[policy]
    assert {scheduled for _, scheduled in front_end.values()} == {normal}


def thread_policies(pid: int) -> dict[int, tuple[str, int]]:
    """The kernel's name and scheduling policy of each thread of process `pid` (those still there once read)."""
    policies = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            policies[int(task.name)] = ((task / "comm").read_text().rstrip("\n"), os.sched_getscheduler(int(task.name)))
        except (ProcessLookupError, FileNotFoundError):  # the thread ended meanwhile
            pass
    return policies


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.parametrize("compile_ahead", [True, False])
def test_a_restarted_executor_loads_the_sets_on_disk_and_asks_for_no_other_before_it_serves(
        resnet_prepared, fmnist_feeds, compile_ahead: bool) -> None:
    """A first start asks for every set the controller may want next, the shadow batches' first; a restart
    (`compile_ahead` off, as the front end starts one) loads those already on disk and asks for none of the others,
    so that its compile worker starts only once a set not on disk is wanted."""
    model = replace(resnet_prepared)  # compiled sets of its own
    names, name = tuple(model.site_names), model.backend.input_names[0]
    active = (names[1],)
    example = {name: fmnist_feeds[-2:]}
    config = Configuration(1, active, (0.5,), names, 10)
    worker = ModelWorker(make_served("m", model), ModelSettings(preload_s=0.0, compile_ahead=compile_ahead),
                         ServerMetrics(), FixedControl(config))
    compiler = worker.sets.compiler = HeldCompiler(model, example, worker.sets.mode)
    on_disk = {names, likely_next_sets(active, names)[1]}
    compiler.released |= on_disk
    try:
        worker.sets.preload(config)
    finally:
        if worker.runner.signals is not None:
            worker.runner.signals.close()
    asked = [sites for sites, _ in compiler.requests]
    assert asked[0] == names and all(model.has_compiled(sites, worker.sets.mode) for sites in on_disk)
    if compile_ahead:
        assert set(asked) > on_disk
    else:
        assert set(asked) == on_disk and compiler.loads == len(on_disk)


# The phases a restarted executor logs, in order, between the front end's word of the death and its word that the
# new process serves
RESTART_PHASES = ("process started", "imports done", "bundle loaded", "sets loaded", "ready")


@dataclass(frozen=True)
class Reply:
    sent: float  # time.monotonic() when sent, and when answered
    done: float
    code: int
    body: dict


def test_a_killed_executor_fails_what_it_held_is_not_ready_until_its_sets_load_from_disk_then_serves(
        resnet_bundle, served, fmnist_feeds, tmp_path) -> None:
    """SIGKILL under load (8 closed-loop clients) on `rampserve serve` as a user runs it, with its controller and
    compiled sets, asserting the sequence: every request gets one response; what the executor held fails with 503
    at once, once per client, whose next request hears that the executor is restarting; the model is ready (HTTP
    and gRPC) until the kill, then not, then ready for good, and requests meanwhile are refused; ready means the
    new executor logged its start's phases in order and loaded its sets from disk, the compile worker compiling
    none of them; then it answers."""
    grpc_port = free_port()
    log_path = tmp_path / "server.log"
    with log_path.open("w") as log:
        process = subprocess.Popen(
            # The first start preloads for 10 s at most: it is answered within the status request's timeout
            [sys.executable, "-m", "rampserve.cli", "serve", str(resnet_bundle), "--port", "0",
             "--grpc-port", str(grpc_port), "--preload-s", "10"], stdout=subprocess.PIPE, stderr=log, text=True)
    try:
        url = re.search(r"http://[\d.]+:\d+", process.stdout.readline()).group(0)
        old = get_json(f"{url}/status/{MODEL}")["executor"]  # answered once the server has started
        _kill_under_load(url, grpc_port, old["pid"], infer_body(served, fmnist_feeds[:1]), log_path)
    finally:
        process.kill()
        process.wait()


def _kill_under_load(url: str, grpc_port: int, pid: int, body: bytes, log_path: Path) -> None:
    infer, ready_url = f"{url}/v2/models/{MODEL}/infer", f"{url}/v2/models/{MODEL}/ready"
    grpc_client = triton_grpc.InferenceServerClient(f"127.0.0.1:{grpc_port}")
    replies: dict[int, list[Reply]] = {k: [] for k in range(8)}  # per client, in order
    readiness: list[tuple[float, int, bool]] = []  # (when asked, HTTP status, gRPC ModelReady)
    stop = threading.Event()

    def client(k: int) -> None:
        while not stop.is_set():
            sent = time.monotonic()
            code, answer = post(infer, body)
            replies[k].append(Reply(sent, time.monotonic(), code, answer))
            if code != 200:
                time.sleep(0.02)  # a refusal is immediate: resent at once, it would keep the server busy refusing

    def watch() -> None:
        while not stop.is_set():
            asked = time.monotonic()
            readiness.append((asked, http_status(ready_url), grpc_client.is_model_ready(MODEL)))
            time.sleep(0.02)

    def answered() -> int:
        return sum(r.code == 200 for sequence in replies.values() for r in sequence)

    assert http_status(ready_url) == 200 and grpc_client.is_model_ready(MODEL)
    with ThreadPoolExecutor(9) as pool:
        running = [pool.submit(client, k) for k in replies] + [pool.submit(watch)]
        deadline = time.monotonic() + 60
        while answered() < 40:  # under load
            assert time.monotonic() < deadline, "the server did not answer under load before the kill"
            time.sleep(0.01)
        killed = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 120
        while not any(asked > killed and code == 200 for asked, code, _ in readiness[-1:]) or \
                answered() < sum(r.code == 200 and r.sent < killed for rs in replies.values() for r in rs) + 40:
            assert time.monotonic() < deadline, "the model never became ready and answering again"
            time.sleep(0.02)
        stop.set()
        for future in running:
            future.result(timeout=60)
    grpc_client.close()

    # Ready, then not, then ready for good: one window of unavailability, on both transports
    after = [(asked, code, ok) for asked, code, ok in readiness if asked > killed]
    assert re.fullmatch("A*B+A+", "".join("A" if code == 200 else "B" for _, code, _ in after)), after
    assert set(code for _, code, _ in after) == {200, 503}
    assert re.fullmatch("T*F+T+", "".join("T" if ok else "F" for *_, ok in after)), after
    unready = [asked for asked, code, _ in after if code == 503]

    # What the executor held failed at once, once per client, and the client's next request heard it restarting
    every = [r for sequence in replies.values() for r in sequence]
    assert {r.code for r in every} == {200, 503}
    assert all("executor process" in r.body["error"] for r in every if r.code == 503)
    held = 0
    for k, sequence in replies.items():
        at = [i for i, r in enumerate(sequence) if r.code == 503 and "while it held" in r.body["error"]]
        assert len(at) <= 1, f"client {k} had {len(at)} requests held by one executor"
        if at:
            held += 1
            after_held = sequence[at[0] + 1]
            assert after_held.code == 503 and "is restarting" in after_held.body["error"], \
                f"client {k}: after its held request failed it heard {after_held}, not that the executor was " \
                "restarting: the held request failed only once a new executor was up"
    assert held, "the executor held no request when it was killed"
    # A request sent and answered while the model was seen unavailable throughout was refused
    within = [r for r in every if unready[0] < r.sent and r.done < unready[-1]]
    assert within and all(r.code == 503 for r in within)
    # Then it answers, with labels
    last = [r for r in every if r.sent > unready[-1]]
    assert last and any(r.code == 200 for r in last)
    assert all(r.body["outputs"][0]["name"] == "label" for r in last if r.code == 200)

    # Ready only once the new executor had loaded its sets from disk, none compiled again
    status = get_json(f"{url}/status/{MODEL}")["executor"]
    assert status["restarts"] == 1 and status["pid"] != pid and status["available"]
    start = status["last_start"]
    assert list(start["phases"]) == list(RESTART_PHASES)
    assert start["sets"]["held"] >= 2  # the configuration's and the shadow batches' (every site)
    assert start["sets"]["from_disk"] == start["sets"]["held"] and start["sets"]["compiled"] == 0
    metrics = get_text(f"{url}/metrics")
    assert f'rampserve_executor_restarts_total{{model="{MODEL}"}} 1.0' in metrics
    loaded = re.search(rf'rampserve_compiles_total{{model="{MODEL}",outcome="loaded"}} ([\d.]+)', metrics)
    assert loaded and float(loaded.group(1)) >= start["sets"]["held"]

    # The server's log: the death, the new executor's phases in order (a restart's, at WARNING), then it serves
    lines = log_path.read_text().splitlines()
    death = next(i for i, line in enumerate(lines) if f"(pid {pid}) was killed by signal 9; restarting it" in line)
    phases = [next(i for i, line in enumerate(lines) if f"executor restart: {phase} at " in line)
              for phase in RESTART_PHASES]
    serves = next(i for i, line in enumerate(lines) if f"its new executor process (pid {status['pid']}) serves" in line)
    assert [death, *phases, serves] == sorted([death, *phases, serves])
    assert f"{start['sets']['held']} of {start['sets']['held']} compiled sets from disk, 0 compiled" in \
        lines[phases[RESTART_PHASES.index("sets loaded")]]


def test_a_stopped_server_answers_what_it_accepted_and_leaves_no_process_or_shared_memory(
        resnet_bundle, served, fmnist_feeds) -> None:
    before = shared_memory_files()
    # Batches wait up to 3 s to fill: the requests are still queued in the executor when the signal comes
    process = subprocess.Popen(
        [sys.executable, "-m", "rampserve.cli", "serve", str(resnet_bundle), "--port", "0", "--grpc-port", "0",
         "--max-batch", "64",
         "--max-delay-ms", "3000", "--no-adaptive-batching"], stdout=subprocess.PIPE, text=True)
    try:
        url = re.search(r"http://[\d.]+:\d+", process.stdout.readline()).group(0)
        executor = get_json(url + "/status")["models"][MODEL]["executor"]["pid"]
        with ThreadPoolExecutor(12) as pool:
            replies = [pool.submit(post, f"{url}/v2/models/{MODEL}/infer", infer_body(served, fmnist_feeds[i:i + 1]))
                       for i in range(12)]
            deadline = time.monotonic() + 30
            while get_json(url + "/status")["models"][MODEL]["queued_inputs"] < 12:
                assert time.monotonic() < deadline, "the requests never reached the executor's queue"
                time.sleep(0.01)
            process.send_signal(signal.SIGTERM)
            codes = [reply.result(timeout=60)[0] for reply in replies]
        assert process.wait(timeout=60) == -signal.SIGTERM
    finally:
        process.kill()
    assert codes == [200] * 12
    assert _is_zombie(executor) or not Path(f"/proc/{executor}").exists()
    assert shared_memory_files() <= before
