"""`rampserve serve MODEL` for a model with no bundle, for real: the command line serves a small classifier that the
test trains on scikit-learn's digits (no zoo model, no stream of the project's) and exports to ONNX. It answers from
its first request, records its traffic, trains ramps in a background job, adopts them under a client firing through
the adoption, and resumes from its folder after a kill; a training that fails leaves it served vanilla, saying why.
A Hugging Face folder (a BERT classifier the own-data tests train on docstrings) is served at once too, from its
ONNX export, and its token ids are recorded as sent."""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import aiohttp
import numpy as np
import pytest
from test_own_data import text_model, transformers_labels  # text_model: a fixture, asked for by name
from test_serving import get_json

MODEL = "digits"
# The training job kept short (the engine named, not timed; a short latency profile), and the controller let spend
# whatever a ramp costs this small a model and search every 512 inputs: the test is about the model's path to
# managed, not what its exits save. ONNX Runtime's fixed cost of a ramp, about 25 us, is 5% of its 0.5 ms, but a
# 0.05 s profile taken under the suite's load measured one at 21% of the model at batch 1 (and 39% at batch 8): at a
# budget of 0.2 no set fitted, and the second generation served vanilla, certifying, until the test gave up
QUICK = ("--prepare-arg=--engine", "--prepare-arg=onnxruntime-1thread", "--prepare-arg=--profile-budget",
         "--prepare-arg=0.05", "--ramp-budget", "1.0", "--search-every", "512")
RECORD = 600  # `prepare --data` asks for 500 distinct inputs at least
RELEARN_WINDOW = 100  # answers per window of the watch on the exits' pay: a test's stream is short
DEADLINE_S = 600.0  # the longest a phase may take to come on this shared machine before the test fails


@pytest.fixture(scope="module")
def digits(tmp_path_factory) -> tuple[Path, np.ndarray, np.ndarray]:
    """The quickstart's digits perceptron as an ONNX file taking `pixels` (FP32, 64 per input); the digits' images,
    shuffled; and the model's own label for each, by ONNX Runtime."""
    import onnxruntime as ort

    from rampserve.zoo.digits import INPUT, digits_onnx, shuffled_rows

    path = digits_onnx(tmp_path_factory.mktemp("digits") / "model.onnx")
    pixels = shuffled_rows()
    own = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {INPUT: pixels})[0]
    return path, pixels, own.argmax(axis=1)


def model_folder(tmp_path: Path, digits) -> Path:
    """A folder holding the model file alone, as a user's repository folder would."""
    folder = tmp_path / MODEL
    folder.mkdir()
    shutil.copyfile(digits[0], folder / "model.onnx")
    return folder


def body(pixels: np.ndarray, request_id: str) -> bytes:
    return json.dumps({"id": request_id, "inputs": [{"name": "pixels", "shape": [1, 64], "datatype": "FP32",
                                                     "data": pixels.tolist()}]}).encode()


@contextmanager
def server(model: str | Path, *options: str) -> Iterator[tuple[str, subprocess.Popen]]:
    """`rampserve serve MODEL OPTIONS` on a free loopback port: its URL and process, stopped (SIGTERM) at the end
    unless the test killed it."""
    process = subprocess.Popen([sys.executable, "-m", "rampserve.cli", "serve", str(model), "--port", "0",
                                "--grpc-port", "0", *options], stdout=subprocess.PIPE, text=True)
    try:
        line = process.stdout.readline()
        found = re.search(r"http://[\d.]+:\d+", line)
        assert found, f"the server did not start: {line!r}"
        yield found.group(0), process
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def learning(url: str, model: str = MODEL) -> dict:
    return get_json(f"{url}/status")["learning"][model]


def wait_for_phase(url: str, *phases: str, deadline_s: float = DEADLINE_S, model: str = MODEL) -> dict:
    """The model's learning status once its phase is one of `phases`; fails at the deadline, or at an unexpected
    failure, with the status as it stood."""
    give_up = time.monotonic() + deadline_s
    while True:
        status = learning(url, model)
        if status["phase"] in phases:
            return status
        assert status["phase"] != "failed", f"the training failed: {status['reason']}"
        assert time.monotonic() < give_up, f"not {phases} after {deadline_s:.0f} s: {status}"
        time.sleep(0.2)


def send(url: str, pixels: np.ndarray, ids: Iterable[int]) -> list[dict]:
    """One request per id, one at a time (request i sends image i), each answered 200."""
    async def run() -> list[dict]:
        async with aiohttp.ClientSession() as session:
            answers = []
            for i in ids:
                async with session.post(f"{url}/v2/models/{MODEL}/infer", data=body(pixels[i], str(i))) as response:
                    assert response.status == 200, await response.text()
                    answers.append(await response.json())
            return answers

    return asyncio.run(run())


def label(answer: dict) -> int:
    return answer["outputs"][0]["data"][0]


def requests_counted(url: str) -> float:
    """Every request the server counted for the model, whatever its outcome (rampserve_requests_total)."""
    return sum(float(line.split()[-1]) for line in metrics(url).splitlines()
               if line.startswith("rampserve_requests_total{") and f'model="{MODEL}"' in line)


def metrics(url: str) -> str:
    with urllib.request.urlopen(f"{url}/metrics") as response:
        return response.read().decode()


def test_an_unprepared_model_answers_at_once_is_managed_and_relearns_when_its_stream_changes(tmp_path, digits):
    """Every request answered once throughout: vanilla while recording, across the adoption of its first ramps
    (trained on digits the model calls 0-4, the only ones sent at first), and across the relearning that follows
    when the stream turns to digits it calls 5-9, on which those ramps cannot answer."""
    _, pixels, own = digits
    before, after = pixels[own < 5], pixels[own >= 5]
    own_before, own_after = own[own < 5], own[own >= 5]
    folder = model_folder(tmp_path, digits)
    record = RECORD
    with server(folder, "--record", str(record), "--relearn-window", str(RELEARN_WINDOW), *QUICK) as (url, _):
        first = send(url, before, range(1))[0]
        recording = learning(url)
        # Traffic until the recording is full: distinct inputs (the first again and again counts once)
        send(url, before, range(1, record))
        send(url, before, itertools.repeat(0, 5))
        traffic = asyncio.run(fire_until_managed(url, before, generation=1))
        managed = learning(url)
        counted = requests_counted(url)
        model_status = get_json(f"{url}/status/{MODEL}")
        yielding = []
        changed = asyncio.run(fire_until_managed(url, after, generation=2, yielding=yielding))
        relearned = learning(url)
        yielded_after = get_json(f"{url}/status/{MODEL}")["executor"]["yields_to"]
    assert label(first) == own_before[0] and "early" not in first["parameters"]
    assert recording["phase"] == "recording" and recording["recorded"] == 1 and recording["record_target"] == record
    for (answers, sent, since), labels in ((traffic, own_before), (changed, own_after)):
        # Every request in flight across the adoption answered once, with the model's own label or at a ramp
        assert sorted(answers) == list(range(sent)), "a request was lost or answered twice"
        early = [i for i, a in answers.items() if a["parameters"].get("early")]
        assert all(label(answers[i]) == labels[i % len(labels)] for i in answers if i not in early)
        # Once managed, exits answer as the model does, within what the guarantee allows
        agreement = np.mean([label(answers[i]) == labels[i % len(labels)] for i in answers if i >= since])
        assert agreement >= 0.99, agreement
    answers, sent, _ = traffic
    vanilla = [i for i, a in answers.items() if "exit_site" not in a["parameters"]]
    assert vanilla and len(vanilla) < sent  # some answered before the adoption, some after
    assert counted == record + 5 + sent
    assert [p["phase"] for p in managed["phases"]] == ["recording", "training", "profiling", "certifying", "managed"]
    assert managed["bundle"] == str(folder / "bundle") and managed["generation"] == 1
    assert managed["phase"] == model_status["learning"]["phase"] == "managed"
    assert model_status["configuration"]["sites"]
    lines = (folder / "recording.jsonl").read_bytes().splitlines()
    assert len(lines) == record
    recorded = np.array([json.loads(line)["inputs"][0]["data"] for line in lines], dtype=np.float32)
    assert np.array_equal(recorded, before[:record])  # the first `record` distinct inputs, as sent
    # The change: the exits stopped paying, the next requests were recorded and a second generation trained on them
    assert [p["phase"] for p in relearned["phases"][5:]] == ["recording", "training", "profiling", "certifying",
                                                             "managed"]
    assert relearned["generation"] == 2 and relearned["bundle"] == str(folder / "bundle-2")
    assert not (folder / "bundle").exists()  # the first generation is gone once the second serves
    # While the second generation trained beside the first's executor, that executor's polling yielded to the job
    # (in a snapshot taken between the job's start and its end: the status reads the two at slightly different
    # moments); once the job ended, to nothing
    assert any(yields_to == [job] for job, yields_to in yielding), yielding
    assert yielded_after == []
    (drift,) = relearned["drifts"]
    assert all(share < 0.5 * drift["level"] for share in drift["shares"]) and drift["level"] >= 0.1
    lines = (folder / "relearning-2.jsonl").read_bytes().splitlines()
    relearned_on = np.array([json.loads(line)["inputs"][0]["data"] for line in lines], dtype=np.float32)
    assert len(relearned_on) == record
    assert all((row == after).all(axis=1).any() for row in relearned_on)  # requests sent after the change


async def fire_until_managed(url: str, pixels: np.ndarray, generation: int, clients: int = 4,
                             yielding: list[tuple[int, list[int]]] | None = None) -> tuple[dict[int, dict], int, int]:
    """Requests from `clients` concurrent clients, request i sending image i (cycling), each with an id of its own,
    until the model is managed at bundle `generation`, has answered 50 of the requests sent since at a ramp, and
    its watch on the exits' pay has seen the level they hold: every answer by id, how many were sent, and the
    first id sent once it was managed. `yielding` collects, while a training job runs beside an executor process,
    the job and the processes that executor's polling yields to (`Worker.yield_to`)."""
    answers: dict[int, dict] = {}
    counter = itertools.count()
    done = asyncio.Event()
    give_up = time.monotonic() + DEADLINE_S

    async def client(session: aiohttp.ClientSession) -> None:
        while not done.is_set():
            i = next(counter)
            async with session.post(f"{url}/v2/models/{MODEL}/infer", data=body(pixels[i % len(pixels)], str(i))) \
                    as response:
                answer = await response.json()
                assert response.status == 200, answer
                assert answer["id"] == str(i) and i not in answers
                answers[i] = answer
            await asyncio.sleep(0.005)  # paced: the training job runs on what serving leaves idle

    since = None

    async def watch(session: aiohttp.ClientSession) -> None:
        nonlocal since
        early_since, status = 0, None
        while early_since < 50:
            # what the server said last says where it stood: which phase, and the executor's view of its controller
            assert time.monotonic() < give_up, f"not managed in time: {status and status['learning']}, " \
                                               f"{status and status['models'].get(MODEL)}"
            async with session.get(f"{url}/status") as response:
                status = await response.json()
            phase = status["learning"][MODEL]
            assert phase["phase"] != "failed" and phase["reason"] is None, phase["reason"]
            if yielding is not None and phase["job"] is not None and MODEL in status["models"]:
                yielding.append((phase["job"], status["models"][MODEL]["executor"]["yields_to"]))
            if since is None and phase["phase"] == "managed" and phase["generation"] == generation:
                since = max(answers, default=-1) + 1
            if since is not None and (phase["early_share_level"] or 0.0) >= 0.1:
                early_since = sum(a["parameters"].get("early", False) for i, a in list(answers.items()) if i >= since)
            await asyncio.sleep(0.2)
        done.set()

    async with aiohttp.ClientSession() as session:
        await asyncio.gather(watch(session), *(client(session) for _ in range(clients)))
    return answers, next(counter), since


def test_a_server_stopped_or_killed_while_recording_or_training_resumes_from_its_folder(tmp_path, digits):
    _, pixels, own = digits
    model = tmp_path / "elsewhere" / "digits.onnx"  # an ONNX file: its state goes to RAMPSERVE_HOME/learning
    model.parent.mkdir()
    shutil.copyfile(digits[0], model)
    options = ("--record", str(RECORD), *QUICK)
    with server(model, *options) as (url, process):
        send(url, pixels, range(300))
        folder = Path(learning(url)["folder"])
        process.kill()  # mid-recording
        process.wait()
    with server(model, *options) as (url, process):
        resumed = learning(url)
        send(url, pixels, range(250, RECORD))  # 250-299 were recorded before the kill
        stopped_job = wait_for_phase(url, "training", "profiling")["job"]
    # ... stopped mid-training as a server is told to stop (SIGTERM, at the end of the block): its job stops
    wait_for(lambda: not Path(f"/proc/{stopped_job}").exists(), "the stopped server's training job to end")
    untouched = not (folder / "bundle").exists() and not (folder / "failed.json").exists()
    with server(model, *options) as (url, process):
        after_stop = learning(url)
        killed_job = wait_for_phase(url, "training", "profiling")["job"]
        process.kill()  # mid-training: its job dies with it
        process.wait()
    wait_for(lambda: not Path(f"/proc/{killed_job}").exists(), "the killed server's training job to end")
    untouched_again = not (folder / "bundle").exists() and not (folder / "failed.json").exists()
    with server(model, *options) as (url, process):
        after_kill = learning(url)
        send(url, pixels, range(3))
        wait_for(lambda: learning(url)["bundle"] is not None, "the bundle to be adopted", DEADLINE_S)
        adopted = learning(url)
        answer = send(url, pixels, range(5, 6))[0]
    assert resumed["phase"] == "recording" and resumed["recorded"] == 300
    assert untouched and untouched_again  # an interrupted training is no failure, and leaves no bundle
    for restarted in (after_stop, after_kill):
        assert restarted["phase"] == "training" and restarted["recorded"] == RECORD, restarted
    assert adopted["phases"][0]["phase"] == "training" and adopted["phase"] in ("certifying", "managed")
    assert adopted["job_cpu_s"] > 0  # what the job took, as the kernel counted it
    assert "exit_site" in answer["parameters"]  # the bundle's
    assert answer["parameters"]["early"] or label(answer) == own[5]
    assert len((folder / "recording.jsonl").read_bytes().splitlines()) == RECORD


def wait_for(condition, what: str, limit_s: float = 60.0) -> None:
    give_up = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < give_up, f"waited {limit_s:.0f} s for {what}"
        time.sleep(0.05)


def test_a_failed_training_leaves_the_model_served_vanilla_saying_why(tmp_path, digits):
    _, pixels, own = digits
    folder = model_folder(tmp_path, digits)
    with server(folder, "--record", "5", *QUICK) as (url, _):
        send(url, pixels, range(5))
        failed = wait_for_phase(url, "failed")
        after = send(url, pixels, range(5, 25))
        exported = metrics(url)
        wait_for(lambda: (get_json(f"{url}/dashboard/data")["models"].get(MODEL, {}).get("learning") or {})
                 .get("phase") == "failed", "the dashboard's sampler to show the failure")
        shown = get_json(f"{url}/dashboard/data")["models"][MODEL]["learning"]
    with server(folder, "--record", "5") as (url, _):
        again = learning(url)
        still = send(url, pixels, range(3))
    assert "at least 500 distinct inputs" in failed["reason"] and f"{folder}/recording.jsonl" in failed["reason"]
    assert [label(a) for a in after] == own[5:25].tolist() and all("exit_site" not in a["parameters"] for a in after)
    assert f'rampserve_learning_phase{{model="{MODEL}",phase="failed"}} 1.0' in exported
    assert shown["phase"] == "failed" and shown["reason"] == failed["reason"]
    assert json.loads((folder / "failed.json").read_text())["reason"] == failed["reason"]
    assert "$ " in (folder / "training.log").read_text()
    # Nothing new to train on: the next server serves it vanilla, failed for the same reason, and trains nothing
    assert again["phase"] == "failed" and again["reason"] == failed["reason"]
    assert [label(a) for a in still] == own[:3].tolist()
    assert not (folder / "bundle").exists()


def test_a_hugging_face_folder_is_served_at_once_and_its_token_ids_recorded_as_sent(request):
    from tokenizers import Tokenizer

    checkpoint = request.getfixturevalue(text_model.__name__)

    tokenizer = Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
    tokenizer.enable_truncation(64)
    texts = ["Return a new list.", "Open the file and return a stream; raise an error where it cannot be opened.",
             "Split the string.", "Count the elements of an iterable, from the first to the last."]
    model = checkpoint.name

    async def ask() -> list[dict]:
        async with aiohttp.ClientSession() as session:
            answers = []
            for i, text in enumerate(texts):
                ids = tokenizer.encode(text).ids
                request = {"id": str(i), "inputs": [
                    {"name": "input_ids", "shape": [1, len(ids)], "datatype": "INT64", "data": ids},
                    {"name": "attention_mask", "shape": [1, len(ids)], "datatype": "INT64", "data": [1] * len(ids)}]}
                async with session.post(f"{url}/v2/models/{model}/infer", json=request) as response:
                    assert response.status == 200, await response.text()
                    answers.append(await response.json())
            return answers

    with server(f"hf:{checkpoint}", "--record", str(len(texts))) as (url, _):
        answers = asyncio.run(ask())
        failed = wait_for_phase(url, "failed", model=model)  # too few inputs to train on
    folder = Path(failed["folder"])
    assert [label(a) for a in answers] == transformers_labels(checkpoint, texts).tolist()
    assert (folder / "vanilla.onnx").is_file()  # exported once, served on ONNX Runtime
    lines = [json.loads(line) for line in (folder / "recording.jsonl").read_bytes().splitlines()]
    assert [line["inputs"][0]["data"] for line in lines] == [tokenizer.encode(text).ids for text in texts]
    assert "500" in failed["reason"], failed["reason"]
