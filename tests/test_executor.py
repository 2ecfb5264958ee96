"""The executor process per model: the wire format (pure), serving through it, and its faults on real processes
(a killed executor, a SIGTERM to the server, shared memory left behind)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from rampserve.serving import wire
from rampserve.serving.models import ServedModel, load_served
from rampserve.serving.server import ServerSettings, build_state, running_server
from rampserve.serving.contract import Answer, ModelSettings

MODEL = "resnet18-small"


@pytest.fixture(scope="module")
def served(resnet_bundle) -> ServedModel:
    return load_served(str(resnet_bundle))


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


@given(st.integers(1, 5), st.booleans())
def test_an_answer_survives_the_wire(rows: int, with_logits: bool) -> None:
    rng = np.random.default_rng(rows)
    sites = tuple(None if i % 2 else f"layer{i}" for i in range(rows))
    answer = Answer(rng.integers(0, 10, rows), sites, tuple(None if s is None else 0.25 for s in sites),
                    rng.random(rows), rng.random((rows, 10)).astype(np.float32) if with_logits else None, 3, 7, 1.5)
    [(kind, header, body)] = list(wire.FrameReader().feed(wire.answer_frame(wire.ANSWER, 11, answer)))
    back = wire.read_answer(header, body)
    assert kind == wire.ANSWER and header["i"] == 11
    np.testing.assert_array_equal(back.labels, answer.labels)
    np.testing.assert_array_equal(back.confidences, answer.confidences)
    assert (back.exit_sites, back.error_scores, back.config_version, back.batch_id, back.released_at) == \
        (answer.exit_sites, answer.error_scores, 3, 7, 1.5)
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


# ---- serving through the executor process ---------------------------------------------------------------------------


def test_a_bundle_is_served_by_an_executor_process_with_the_original_answers(served, fmnist_feeds) -> None:
    x = fmnist_feeds[:6]
    before = shared_memory_files()
    state = build_state([served], ModelSettings(), ServerSettings(port=0))
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
        want = served.model.run({served.inputs[0].name: big})
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


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except FileNotFoundError:
        return True


def test_a_killed_executor_fails_what_it_held_before_a_new_one_serves_and_comes_back(served, fmnist_feeds) -> None:
    """SIGKILL under load (8 closed-loop clients): every request gets one response; what the executor held fails
    as its socket closes, not once a new executor is up: each client whose request was held is told next that
    the executor is restarting. Then a new executor serves."""
    x = fmnist_feeds[:1]
    body = infer_body(served, x)
    state = build_state([served], ModelSettings(vanilla=True), ServerSettings(port=0))
    with running_server(state) as url:
        pid = get_json(url + "/status")["models"][MODEL]["executor"]["pid"]
        responses: dict[int, list[tuple[int, dict]]] = {k: [] for k in range(8)}  # per client, in order

        def client(k: int, n: int) -> None:
            for _ in range(n):
                responses[k].append(post(f"{url}/v2/models/{MODEL}/infer", body))

        with ThreadPoolExecutor(8) as pool:
            clients = [pool.submit(client, k, 60) for k in responses]
            while sum(map(len, responses.values())) < 40:  # under load
                time.sleep(0.005)
            os.kill(pid, signal.SIGKILL)
            for c in clients:
                c.result(timeout=60)
        assert [len(r) for r in responses.values()] == [60] * 8  # every request got exactly one response
        codes = [code for r in responses.values() for code, _ in r]
        assert set(codes) <= {200, 503}
        lost = [answer for r in responses.values() for code, answer in r if code == 503]
        assert lost, "killing the executor under load failed no request"
        assert all("executor process" in answer["error"] for answer in lost)
        held = 0
        for k, sequence in responses.items():
            at = [i for i, (code, answer) in enumerate(sequence) if code == 503 and "while it held" in answer["error"]]
            assert len(at) <= 1, f"client {k} had {len(at)} requests held by one executor"
            if at and at[0] + 1 < len(sequence):
                held += 1
                code, answer = sequence[at[0] + 1]
                assert code == 503 and "is restarting" in answer["error"], \
                    f"client {k}: after its held request failed it heard {code} {answer}, not that the executor " \
                    "was restarting: the held request failed only once a new executor was up"
        assert held, "the executor held no request when it was killed"
        deadline = time.monotonic() + 60
        while (status := get_json(url + "/status")["models"][MODEL]).get("unavailable"):
            assert time.monotonic() < deadline, "the executor never came back"
            time.sleep(0.05)
        assert status["executor"]["restarts"] == 1 and status["executor"]["pid"] != pid
        code, _ = post(f"{url}/v2/models/{MODEL}/infer", body)
        assert code == 200
        assert f'rampserve_executor_restarts_total{{model="{MODEL}"}} 1.0' in get_text(url + "/metrics")


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
