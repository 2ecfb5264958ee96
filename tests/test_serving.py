"""The live server, for real: uvicorn on a loopback port, tritonclient and aiohttp as clients, the small
prepared ResNet on real Fashion-MNIST inputs."""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from email.message import Message
from functools import partial

import aiohttp
import numpy as np
import pytest
import torch
import tritonclient.http as triton

from rampserve.control.controller import ControllerSettings
from rampserve.serving.executor.loading import load_served, loaded
from rampserve.serving.executor.loading import served as make_served
from rampserve.serving.frontend.app import ServerState
from rampserve.serving.server import ServerSettings, build_state, running_server
from rampserve.serving.shared.models import ServedModel
from rampserve.serving.shared.settings import ModelSettings

MODEL = "resnet18-small"


@pytest.fixture(scope="module")
def served(resnet_bundle) -> ServedModel:
    return loaded(load_served(str(resnet_bundle)))


@contextmanager
def server(served: ServedModel, settings: ModelSettings = ModelSettings(),
           server_settings: ServerSettings = ServerSettings(port=0, grpc=False)) -> Iterator[tuple[str, ServerState]]:
    state = build_state([served], settings, server_settings)
    with running_server(state, server_settings) as url:
        yield url, state


def fixed_exits(served: ServedModel, site_index: int, threshold: float, exit_mode: str = "auto",
                **overrides) -> ModelSettings:
    """One ramp active at a fixed threshold, the controller only watching: exits are predictable."""
    site = served.prepared.site_names[site_index]
    controller = ControllerSettings(initial=(site,), start_thresholds={site: threshold}, threshold_tuning=False,
                                    ramp_adjustment=False, exit_mode=exit_mode)
    return ModelSettings(controller=controller, **overrides)


def books_after(url: str, requests: int) -> dict:
    """The model's status once its books count `requests` requests (the control thread keeps them after the
    answers are out)."""
    deadline = time.monotonic() + 30
    while (status := get_json(url + "/status")["models"][MODEL])["requests"] < requests:
        assert time.monotonic() < deadline, f"the books never counted {requests} requests: {status['requests']}"
        time.sleep(0.01)
    return status


def mixing_threshold(served: ServedModel, site_index: int, feeds: np.ndarray) -> float:
    """A threshold for the ramp at `site_index` between these inputs' error scores there: about half exit at
    it, whatever the small test model's ramps learnt."""
    site = served.prepared.site_names[site_index]
    seen: list[np.ndarray] = []
    served.prepared.run({served.inputs[0].name: feeds}, [site], lambda _, labels, errors: seen.append(errors))
    return float(np.median(seen[0]))


def original_logits(served: ServedModel, feeds: np.ndarray) -> np.ndarray:
    """The original torch module's output, bypassing every serving path (stages, TorchScript)."""
    with torch.inference_mode():
        return served.prepared.backend.module(torch.from_numpy(feeds)).numpy()


def original_labels(served: ServedModel, feeds: np.ndarray) -> np.ndarray:
    return original_logits(served, feeds).argmax(axis=1)


def infer_body(served: ServedModel, x: np.ndarray, **parameters) -> bytes:
    return json.dumps({"inputs": [{"name": served.inputs[0].name, "shape": list(x.shape), "datatype": "FP32",
                                   "data": x.ravel().tolist()}], "parameters": parameters}).encode()


def post(url: str, body: bytes, headers: dict[str, str] | None = None) -> tuple[int, Message, dict]:
    request = urllib.request.Request(url, body, {"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request) as response:
            return response.status, response.headers, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers, json.loads(exc.read())


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url) as response:
        return json.loads(response.read())


def triton_input(served: ServedModel, x: np.ndarray, binary: bool) -> triton.InferInput:
    tensor = triton.InferInput(served.inputs[0].name, list(x.shape), "FP32")
    tensor.set_data_from_numpy(x, binary_data=binary)
    return tensor


@pytest.mark.parametrize("torchscript", [True, False])
def test_the_served_logits_are_the_original_models_bit_for_bit(served, fmnist_feeds, torchscript: bool) -> None:
    """Compiled to TorchScript (the default) or eager, with ramps active or not, the final answer is exactly the
    original module's."""
    x = fmnist_feeds[:5]
    for settings in (ModelSettings(vanilla=True, torchscript=torchscript),
                     fixed_exits(served, 1, 0.0, torchscript=torchscript)):
        with server(served, settings) as (url, _):
            client = triton.InferenceServerClient(url.removeprefix("http://"))
            result = client.infer(MODEL, [triton_input(served, x, True)],
                                  outputs=[triton.InferRequestedOutput("logits", binary_data=True)])
            compiled = get_json(url + "/status")["models"][MODEL]["compiled"]
        np.testing.assert_array_equal(result.as_numpy("logits"), original_logits(served, x))
        assert compiled is torchscript


def test_a_response_with_logits_never_contradicts_itself(served, fmnist_feeds) -> None:
    """A request that waits for the final layer (it asked for the logits) gets the final label for every row, even
    where every row could have left at a ramp; those rows count as final answers, not exits."""
    x = fmnist_feeds[:8]
    with server(served, fixed_exits(served, 0, 1.0)) as (url, _):  # threshold 1: every row exits at the ramp
        client = triton.InferenceServerClient(url.removeprefix("http://"))
        both = client.infer(MODEL, [triton_input(served, x, True)],
                            outputs=[triton.InferRequestedOutput("label"), triton.InferRequestedOutput("logits")])
        label_only = client.infer(MODEL, [triton_input(served, x, True)])
        deadline = time.monotonic() + 30  # the label-only answer leaves before its batch is recorded
        while len(batches := get_json(url + "/status")["models"][MODEL]["recent_batches"]) < 2:
            assert time.monotonic() < deadline, "the second batch was never recorded"
            time.sleep(0.01)
    np.testing.assert_array_equal(both.as_numpy("label"), both.as_numpy("logits").argmax(axis=1))
    assert both.get_response()["parameters"]["early"] is False
    assert label_only.get_response()["parameters"]["early"] is True  # without logits it leaves at the ramp
    assert [b["early"] for b in batches[-2:]] == [0, len(x)]


def test_tritonclient_infers_with_binary_data_and_with_json(served, fmnist_feeds) -> None:
    x = fmnist_feeds[:4]
    with server(served, ModelSettings(vanilla=True)) as (url, _):
        client = triton.InferenceServerClient(url.removeprefix("http://"))
        assert client.is_server_live() and client.is_server_ready() and client.is_model_ready(MODEL)
        metadata = client.get_model_metadata(MODEL)
        assert metadata["inputs"] == [{"name": served.inputs[0].name, "datatype": "FP32", "shape": [-1, 1, 28, 28]}]
        assert client.get_server_metadata()["name"] == "rampserve"
        binary = client.infer(MODEL, [triton_input(served, x, True)])  # tritonclient's defaults
        as_json = client.infer(MODEL, [triton_input(served, x, False)],
                               outputs=[triton.InferRequestedOutput("label", binary_data=False),
                                        triton.InferRequestedOutput("logits", binary_data=False)])
    expected = original_logits(served, x)
    np.testing.assert_array_equal(binary.as_numpy("label"), expected.argmax(axis=1))
    np.testing.assert_array_equal(as_json.as_numpy("label"), expected.argmax(axis=1))
    # The served logits are the original model's (vanilla: nothing exits, the final stage is the model).
    np.testing.assert_allclose(as_json.as_numpy("logits"), expected, rtol=1e-5, atol=1e-5)
    assert binary.get_response()["parameters"]["early"] is False


def test_every_bad_request_gets_its_4xx_and_the_server_keeps_serving(served, fmnist_feeds) -> None:
    x = fmnist_feeds[:1]
    name = served.inputs[0].name
    good = infer_body(served, x)
    nan = x.copy()
    nan[0, 0, 0, 0] = np.nan

    def body(**tensor) -> bytes:
        spec = {"name": name, "shape": [1, 1, 28, 28], "datatype": "FP32", "data": x.ravel().tolist()}
        return json.dumps({"inputs": [{**spec, **tensor}]}).encode()

    cases = {
        "unknown model": ("/v2/models/nope/infer", good, 404, "unknown model"),
        "unknown version": (f"/v2/models/{MODEL}/versions/7/infer", good, 404, "version"),
        "malformed JSON": (f"/v2/models/{MODEL}/infer", b'{"inputs": [', 400, "JSON"),
        "wrong input name": (f"/v2/models/{MODEL}/infer", body(name="pixels"), 400, "pixels"),
        "wrong shape": (f"/v2/models/{MODEL}/infer", body(shape=[1, 28, 28]), 400, name),
        "wrong datatype": (f"/v2/models/{MODEL}/infer", body(datatype="INT64"), 400, "datatype"),
        "short data": (f"/v2/models/{MODEL}/infer", body(data=x.ravel().tolist()[:-1]), 400, name),
        "NaN": (f"/v2/models/{MODEL}/infer", infer_body(served, nan), 400, "NaN"),
        "bad deadline": (f"/v2/models/{MODEL}/infer", infer_body(served, x, deadline_ms=-1), 400, "deadline_ms"),
        "body too large": (f"/v2/models/{MODEL}/infer", good + b" " * (1 << 20), 413, "limit"),
    }
    with server(served, ModelSettings(vanilla=True), ServerSettings(port=0, grpc=False, max_body_mb=0.5)) as (url, _):
        for case, (path, payload, status, mentioned) in cases.items():
            got, _, answer = post(url + path, payload)
            assert (got, mentioned.lower() in answer["error"].lower()) == (status, True), (case, answer)
            ok, _, answer = post(f"{url}/v2/models/{MODEL}/infer", good)
            assert ok == 200 and answer["outputs"][0]["data"] == original_labels(served, x).tolist(), case
        metrics = urllib.request.urlopen(url + "/metrics").read().decode()
    assert counter(metrics, "rampserve_requests", model=MODEL, outcome="invalid", transport="http") == len(cases) - 1


async def _concurrent(url: str, bodies: list[bytes], clients: int) -> list[tuple[int, int, dict]]:
    results: list[tuple[int, int, dict]] = []
    pending = list(enumerate(bodies))

    async def client(session: aiohttp.ClientSession) -> None:
        while pending:
            index, body = pending.pop()
            async with session.post(f"{url}/v2/models/{MODEL}/infer", data=body) as response:
                results.append((index, response.status, await response.json()))

    async with aiohttp.ClientSession() as session:
        await asyncio.gather(*(client(session) for _ in range(clients)))
    return results


def test_many_concurrent_clients_each_get_exactly_one_answer(served, fmnist_feeds) -> None:
    bodies = [infer_body(served, fmnist_feeds[i % 16: i % 16 + 1], priority=i % 3) for i in range(240)]
    expected = original_labels(served, fmnist_feeds)
    threshold = mixing_threshold(served, 1, fmnist_feeds)
    settings = fixed_exits(served, 1, threshold, max_batch=8, max_delay_ms=2.0, deadline_ms=60_000.0,
                           adaptive_batching=False)
    with server(served, settings) as (url, state):
        results = asyncio.run(_concurrent(url, bodies, clients=24))
        status = books_after(url, len(bodies))
    assert sorted(index for index, _, _ in results) == list(range(len(bodies)))
    assert all(code == 200 for _, code, _ in results)
    assert status["requests"] == len(bodies) and status["batches"] < len(bodies)  # they were batched
    early = [(i, a) for i, _, a in results if a["parameters"]["early"]]
    assert early, f"a ramp at threshold {threshold} answers some inputs"
    for _, answer in early:
        assert answer["parameters"]["exit_site"] == served.prepared.site_names[1]
        assert answer["parameters"]["error_score"] < threshold
    late = [(i, a) for i, _, a in results if not a["parameters"]["early"]]
    for index, answer in late:  # the final answers are the original model's
        assert answer["outputs"][0]["data"] == [int(expected[index % 16])]


@contextmanager
def _every_input_exiting_in_process(served: ServedModel) -> Iterator[tuple[str, object, object, object]]:
    """A server whose executor runs in this process, so that a test can reach into it, and whose every input exits
    at the first ramp (threshold 1): its URL, its worker, and the configuration and compiled set in force."""
    with server(served, fixed_exits(served, 0, 1.0, executor="thread")) as (url, state):
        worker = state.catalogue.workers[MODEL]
        config, compiled = worker.sets.in_force
        assert compiled is not None
        yield url, worker, config, compiled


class _HeldAfterItsRun:
    """A compiled runner whose batch cannot finish until `answered` is set: it runs the model, then waits (at most
    30 s) before handing the run back. Whether it was set in time is kept in `answered_in_time`."""

    def __init__(self, runner, answered: threading.Event) -> None:
        self.runner, self.answered = runner, answered
        self.answered_in_time: bool | None = None

    def forward(self, *args):
        output = self.runner.forward(*args)
        self.answered_in_time = self.answered.wait(30)
        return output


def test_an_exited_answer_arrives_before_its_batch_finishes(served, fmnist_feeds) -> None:
    """The client has its answer while the batch it exited from is held unfinished after the model's run: a server
    that sent answers only once the batch is over would keep it waiting until the hold gave up (asserting an
    order of events, not a race between the batch's remainder and the client being scheduled)."""
    x = fmnist_feeds[:4]
    with _every_input_exiting_in_process(served) as (url, worker, config, compiled):
        answered = threading.Event()
        held = _HeldAfterItsRun(compiled.runner, answered)
        worker.sets.in_force = (config, replace(compiled, runner=held))
        status, _, answer = post(f"{url}/v2/models/{MODEL}/infer", infer_body(served, x))
        answered.set()
        # The batch's books are kept by the control thread once its answers are out
        deadline = time.monotonic() + 30
        while not (batch := next((b for b in get_json(url + "/status")["models"][MODEL]["recent_batches"]
                                  if b["id"] == answer["parameters"]["batch_id"]), None)):
            assert time.monotonic() < deadline, "the batch never reached the books"
            time.sleep(0.01)
        worker.sets.in_force = (config, compiled)
    assert held.answered_in_time is True, "the answer came only after its batch stopped being held"
    assert status == 200 and answer["parameters"]["early"] is True
    assert set(answer["parameters"]["exit_site"]) == {served.prepared.site_names[0]}
    assert batch["size"] == len(x) and batch["early"] == len(x)


def test_shedding_is_explicit_and_loses_nothing(served, fmnist_feeds) -> None:
    bodies = [infer_body(served, fmnist_feeds[:1]) for _ in range(120)]
    settings = ModelSettings(vanilla=True, max_queue=2, max_batch=1, adaptive_batching=False, deadline_ms=60_000.0)
    with server(served, settings) as (url, _):
        results = asyncio.run(_concurrent(url, bodies, clients=40))
        late, headers, refused = post(f"{url}/v2/models/{MODEL}/infer",
                                      infer_body(served, fmnist_feeds[:1], deadline_ms=1e-6))
        metrics = urllib.request.urlopen(url + "/metrics").read().decode()
    assert sorted(i for i, _, _ in results) == list(range(len(bodies)))
    codes = [code for _, code, _ in results]
    assert set(codes) <= {200, 503} and 503 in codes and 200 in codes
    assert all("queue full" in a["error"] for _, code, a in results if code == 503)
    assert late == 429 and int(headers["Retry-After"]) >= 1 and "deadline" in refused["error"]
    assert f'rampserve_shed_total{{model="{MODEL}",reason="queue_full"}} {codes.count(503)}.0' in metrics


def test_prediction_cache_answers_repeats_without_the_queue(served, fmnist_feeds) -> None:
    with server(served, ModelSettings(vanilla=True), ServerSettings(port=0, grpc=False, cache_mb=1.0)) as (url, state):
        first = post(f"{url}/v2/models/{MODEL}/infer", infer_body(served, fmnist_feeds[:1]))[2]
        again = post(f"{url}/v2/models/{MODEL}/infer", infer_body(served, fmnist_feeds[:1]))[2]
        other = post(f"{url}/v2/models/{MODEL}/infer", infer_body(served, fmnist_feeds[1:2]))[2]
        batches = get_json(url + "/status")["models"][MODEL]["batches"]
    assert again["outputs"] == first["outputs"] and again["parameters"]["cached"] is True
    assert "cached" not in other["parameters"]
    assert batches == 2  # the repeat never reached the model
    assert (state.caches[MODEL].hits, state.caches[MODEL].misses) == (1, 2)


def counter(metrics: str, name: str, **labels: str) -> float:
    """A counter's value in the server's /metrics text (0 where it has no sample with those labels)."""
    wanted = ",".join(f'{key}="{value}"' for key, value in labels.items())
    found = re.search(rf"^{name}_total\{{{re.escape(wanted)}\}} (\S+)$", metrics, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


async def _repeats_under_load(url: str, probes: list[bytes], load: Iterator[bytes],
                              clients: int) -> tuple[list[tuple[dict, dict]], int]:
    """Each probe sent, then sent again as soon as its response is back, while `clients` others keep sending
    `load` (each probe only once the load has answered `clients` more requests: the load runs throughout). The
    (first, repeat) responses, and how many load requests were sent."""
    infer = f"{url}/v2/models/{MODEL}/infer"
    done, progress = asyncio.Event(), asyncio.Condition()
    sent = answered = stopped = 0

    async def keep_loading(session: aiohttp.ClientSession) -> None:
        nonlocal sent, answered, stopped
        try:
            while not done.is_set():
                sent += 1
                async with session.post(infer, data=next(load)) as response:
                    assert response.status == 200, await response.text()
                async with progress:
                    answered += 1
                    progress.notify_all()
        finally:  # a client that failed must not leave the probes waiting for the load
            async with progress:
                stopped += 1
                progress.notify_all()

    async def ask(session: aiohttp.ClientSession, body: bytes) -> dict:
        async with session.post(infer, data=body) as response:
            assert response.status == 200, await response.text()
            return await response.json()

    pairs: list[tuple[dict, dict]] = []
    async with aiohttp.ClientSession() as session:
        loading = [asyncio.create_task(keep_loading(session)) for _ in range(clients)]
        try:
            for body in probes:
                async with progress:
                    await progress.wait_for(partial(lambda since: answered >= since + clients or stopped, answered))
                assert not stopped, "a load client stopped"
                first = await ask(session, body)
                pairs.append((first, await ask(session, body)))
        finally:
            done.set()
            await asyncio.gather(*loading)
    return pairs, sent


def json_body(served: ServedModel, x: np.ndarray, outputs: list[str] | None, **parameters) -> bytes:
    """An inference request for `x`, asking for `outputs` by name (None: none named, the label alone)."""
    request = json.loads(infer_body(served, x, **parameters))
    if outputs is not None:
        request["outputs"] = [{"name": name} for name in outputs]
    return json.dumps(request).encode()


@pytest.mark.parametrize("ramps,executor", [(False, "process"), (True, "process"), (False, "thread")])
def test_a_repeat_sent_after_its_response_is_a_cache_hit_under_load(served, fmnist_feeds, ramps: bool,
                                                                     executor: str) -> None:
    """The final answer is in the prediction cache before the response carrying it is sent: a repeat sent once
    that response is back is answered by the cache, however busy the server. With ramps the probes ask for the
    logits, so their response carries the final answer, while the load's labels leave early at a ramp or not."""
    rounds, clients = 20, 8
    rng = np.random.default_rng(31)
    shape = fmnist_feeds[:1].shape

    def unique(index: int) -> np.ndarray:  # never sent twice: only the probes' repeats can hit the cache
        noise = rng.normal(0.0, 0.05, shape).astype(np.float32)
        return fmnist_feeds[index % len(fmnist_feeds)][None] + noise

    load = (json_body(served, unique(i), None) for i in itertools.count())
    # A probe goes first in its batch (its priority is higher), the load's requests behind it: its final answer is
    # kept before its response leaves, however many answers the rest of its batch sends
    probes = [json_body(served, unique(i), ["label", "logits"] if ramps else None, priority=1) for i in range(rounds)]
    batching = dict(max_batch=8, max_delay_ms=2.0, adaptive_batching=False, deadline_ms=60_000.0,
                    executor=executor)
    settings = (fixed_exits(served, 1, mixing_threshold(served, 1, fmnist_feeds), **batching) if ramps
                else ModelSettings(vanilla=True, **batching))
    with server(served, settings, ServerSettings(port=0, grpc=False, cache_mb=16.0)) as (url, state):
        pairs, sent = asyncio.run(_repeats_under_load(url, probes, load, clients))
        metrics = urllib.request.urlopen(url + "/metrics").read().decode()
    assert len(pairs) == rounds
    for first, again in pairs:
        assert "cached" not in first["parameters"] and first["parameters"]["early"] is False
        assert again["parameters"]["cached"] is True, f"a repeat missed the cache: {again['parameters']}"
        assert again["outputs"] == first["outputs"]
    assert counter(metrics, "rampserve_cache_lookups", model=MODEL, result="hit") == rounds
    assert counter(metrics, "rampserve_cache_lookups", model=MODEL, result="miss") == rounds + sent
    assert counter(metrics, "rampserve_requests", model=MODEL, outcome="cached", transport="http") == rounds
    assert (state.caches[MODEL].hits, state.caches[MODEL].misses) == (rounds, rounds + sent)


def test_controller_adapts_live_and_status_shows_its_history(served, fmnist_feeds) -> None:
    """Thresholds start at 1 on a ramp of the small model (too eager: accuracy breaks), so the controller must
    scale them down live; the configuration it publishes reaches the executor and the status endpoint."""
    site = served.prepared.site_names[0]
    controller = ControllerSettings(initial=(site,), start_thresholds={site: 1.0}, ramp_adjustment=False)
    bodies = [infer_body(served, fmnist_feeds[i % 16: i % 16 + 1]) for i in range(200)]
    with server(served, ModelSettings(controller=controller, deadline_ms=60_000.0)) as (url, _):
        results = asyncio.run(_concurrent(url, bodies, clients=4))
        status = get_json(url + "/status")["models"][MODEL]
        metrics = urllib.request.urlopen(url + "/metrics").read().decode()
    versions = {a["parameters"]["config_version"] for _, _, a in results}
    assert status["decisions"][0]["thresholds"] == [1.0]
    assert len(status["decisions"]) > 1 and status["configuration"]["version"] > 0
    assert status["decisions"][1]["reason"].startswith("risk control")  # wrong answers scaled thresholds down
    assert len(versions) > 1, "answers came from more than one configuration"
    assert "rampserve_window_accuracy" in metrics and "rampserve_ramp_threshold" in metrics
    assert "rampserve_disagreement_upper_bound" in metrics
    scale = next(float(line.split()[-1]) for line in metrics.splitlines() if line.startswith("rampserve_risk_scale{"))
    assert scale < 1.0 and status["risk_scale"] < 1.0


async def _shutdown_under_load(process: subprocess.Popen, url: str, bodies: list[bytes]) -> list[int]:
    async with aiohttp.ClientSession() as session:
        async def one(body: bytes) -> int:
            async with session.post(f"{url}/v2/models/{MODEL}/infer", data=body) as response:
                await response.read()
                return response.status

        requests = [asyncio.create_task(one(body)) for body in bodies]
        # Stop the server once it holds every request in its queue (the batch waits for its delay to pass).
        while True:
            async with session.get(f"{url}/status/{MODEL}") as response:
                if (await response.json())["queued_inputs"] == len(bodies):
                    break
        process.send_signal(signal.SIGTERM)
        return await asyncio.gather(*requests)


def test_cli_server_answers_what_it_accepted_when_stopped(resnet_bundle, served, fmnist_feeds) -> None:
    process = subprocess.Popen(
        [sys.executable, "-m", "rampserve.cli", "serve", str(resnet_bundle), "--port", "0", "--grpc-port", "0",
         "--max-batch", "64",
         "--max-delay-ms", "3000", "--no-adaptive-batching", "--deadline-ms", "60000"],
        stdout=subprocess.PIPE, text=True)
    try:
        line = process.stdout.readline()
        url = re.search(r"http://[\d.]+:\d+", line).group(0)
        codes = asyncio.run(_shutdown_under_load(process, url, [infer_body(served, fmnist_feeds[i:i + 1])
                                                                for i in range(12)]))
        # uvicorn stops gracefully, then lets the signal end the process as it would have (exit status -15).
        assert process.wait(timeout=60) == -signal.SIGTERM
    finally:
        process.kill()
    assert codes == [200] * 12
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"{url}/v2/health/live")


def test_the_cache_keeps_final_answers_never_a_ramps(served, fmnist_feeds) -> None:
    """An answer released at a ramp is cached as the original model's final answer, so a repeat gets that (in
    release mode: in stop mode an input that left has no final answer to keep)."""
    x = fmnist_feeds[:8]
    with server(served, fixed_exits(served, 0, 1.0, "release"),
                ServerSettings(port=0, grpc=False, cache_mb=1.0)) as (url, state):
        first = post(f"{url}/v2/models/{MODEL}/infer", infer_body(served, x))[2]
        deadline = time.monotonic() + 30  # the early answer leaves before its batch ends and is cached
        while len(state.caches[MODEL]) == 0:
            assert time.monotonic() < deadline, "the final answer was never cached"
            time.sleep(0.01)
        again = post(f"{url}/v2/models/{MODEL}/infer", infer_body(served, x))[2]
    assert first["parameters"]["early"] is True  # threshold 1: every row left at the first ramp
    assert again["parameters"]["cached"] is True and again["parameters"]["early"] is False
    np.testing.assert_array_equal(again["outputs"][0]["data"], original_labels(served, x))


class _FailsAfterItsRampsReleased:
    """A compiled runner whose model fails once its ramps have released their answers (a fault injected where a
    real one, out of memory or a native crash, could strike): it runs the model, waits until the releasing
    thread has handed the batch's signalled columns over, then raises."""

    def __init__(self, runner, released: threading.Event) -> None:
        self.runner, self.released = runner, released

    def forward(self, *args):
        self.runner.forward(*args)
        assert self.released.wait(30), "the releasing thread never handled the ramp's column"
        raise RuntimeError("injected failure after the ramps")


def test_answers_released_before_a_failure_reach_the_controller_unverified(served, fmnist_feeds) -> None:
    x = fmnist_feeds[:4]
    with _every_input_exiting_in_process(served) as (url, worker, config, compiled):  # a failure injected there
        released = threading.Event()
        begin = worker.runner.signals.begin

        def begin_and_tell(on_column):
            def handled(column: int) -> None:
                on_column(column)
                released.set()
            begin(handled)

        worker.runner.signals.begin = begin_and_tell
        worker.sets.in_force = (config, replace(compiled, runner=_FailsAfterItsRampsReleased(compiled.runner, released)))
        early = post(f"{url}/v2/models/{MODEL}/infer", infer_body(served, x))
        deadline = time.monotonic() + 30
        while (model := get_json(url + "/status")["models"][MODEL])["unverified_answers"] < len(x):
            assert time.monotonic() < deadline, f"the controller never heard of the released answers: {model}"
            time.sleep(0.01)
        worker.sets.in_force = (config, compiled)
        worker.runner.signals.begin = begin
        after = post(f"{url}/v2/models/{MODEL}/infer", infer_body(served, x))
    assert early[0] == 200 and early[2]["parameters"]["early"] is True  # released before the failure
    assert model["unverified_answers"] == len(x) and model["answers"]["unverified"] == len(x)
    assert model["cumulative_accuracy"] <= 1.0 - len(x) / model["inputs_observed"]
    assert after[0] == 200  # the server keeps serving


def test_status_counts_every_answer_by_the_path_it_took(served, fmnist_feeds) -> None:
    """Early, final and cached answers (one per input) sum to every answer given, in /status and /metrics."""
    sizes = [1, 3, 1, 1, 3, 1]  # requests of several inputs count each; the last three repeat the first three
    starts = [0, 1, 4, 0, 1, 4]
    # A threshold among this ramp's error scores mixes exits and finals
    threshold = mixing_threshold(served, 2, fmnist_feeds)
    # Release mode, so that every input of the first requests has a final answer for the cache to keep
    with server(served, fixed_exits(served, 2, threshold, "release"),
                ServerSettings(port=0, grpc=False, cache_mb=1.0)) as (url, _):
        def ask(first: int, last: int) -> list[dict]:
            return [post(f"{url}/v2/models/{MODEL}/infer", infer_body(served, fmnist_feeds[a:a + n]))[2]
                    for a, n in zip(starts[first:last], sizes[first:last])]

        def counted(given: int) -> dict[str, int]:
            deadline = time.monotonic() + 30  # an early answer leaves before its batch is counted
            while sum((answers := get_json(url + "/status")["models"][MODEL]["answers"]).values()) < given:
                assert time.monotonic() < deadline, f"answers never added up to {given}: {answers}"
                time.sleep(0.01)
            return answers

        responses = ask(0, 3)
        # The cache keeps final answers: the repeats go out once every first batch has run to its end
        counted(sum(sizes[:3]))
        responses += ask(3, 6)
        given = sum(sizes)
        answers = counted(given)
        with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
            metrics = response.read().decode()
    cached = sum(n for n, r in zip(sizes, responses) if r["parameters"].get("cached"))
    assert cached == sum(sizes[3:]) and answers["cached"] == cached and answers["unverified"] == 0
    assert sum(answers.values()) == given
    early = sum(site is not None for r in responses[:3]
                for site in np.atleast_1d(np.array(r["parameters"]["exit_site"], dtype=object)))
    assert answers["early"] == early and answers["final"] == sum(sizes[:3]) - early
    for path, count in answers.items():
        if count:
            assert f'rampserve_answers_total{{model="{MODEL}",path="{path}"}} {float(count)}' in metrics


@pytest.mark.parametrize("updates", [True, False])
def test_served_cache_ramp_answers_early_and_learns_from_final_answers(cache_bundle, fmnist_feeds, updates) -> None:
    served = loaded(load_served(str(cache_bundle)))  # a fresh copy per case: learning changes it
    last = len(served.prepared.site_names) - 1
    site = served.prepared.site_names[last]
    ramp = served.prepared.ramps[site]
    usage, memory = ramp.usage.clone(), ramp.memory_bytes()
    # The test reads the ramp's own memory: its executor runs in this process
    with server(served, fixed_exits(served, last, 1.0, cache_updates=updates, executor="thread")) as (url, _):
        for i in range(8):  # threshold 1: every input leaves at the cache
            status, _, body = post(f"{url}/v2/models/{MODEL}-cache/infer", infer_body(served, fmnist_feeds[i:i + 2]))
            assert status == 200, body
            assert body["parameters"]["early"] is True and body["parameters"]["exit_site"] == [site, site]
    assert ramp.memory_bytes() == memory
    if updates:  # every served input was counted at its nearest centroid
        assert ramp.usage.sum() > usage.sum() + 15
    else:
        assert torch.equal(ramp.usage, usage)


def test_an_onnx_bundle_serves_its_ramps_signalled_from_one_session(onnx_prepared, fmnist_feeds, tmp_path) -> None:
    """An ONNX model serves its compiled path (the model whole in one session, its ramp signalling from inside the
    run): a row whose error score at the active ramp is under the threshold leaves there with the eager ramp's
    label, the others get the model's, and the logits a client asks for are the whole model's, bit for bit."""
    from rampserve.runtime.bundle import save_bundle

    served = loaded(load_served(str(save_bundle(onnx_prepared, tmp_path / MODEL))))
    site, x = served.prepared.site_names[1], fmnist_feeds
    threshold = mixing_threshold(served, 1, x)
    seen: list[tuple[np.ndarray, np.ndarray]] = []
    served.prepared.run({served.inputs[0].name: x}, [site], lambda _, *scored: seen.append(scored))
    (ramp_labels, errors), = seen
    logits = served.prepared.run({served.inputs[0].name: x}, [])
    with server(served, fixed_exits(served, 1, threshold)) as (url, _):
        answers = [post(f"{url}/v2/models/{MODEL}/infer", infer_body(served, x[i:i + 1]))[2] for i in range(len(x))]
        client = triton.InferenceServerClient(url.removeprefix("http://"))
        final = client.infer(MODEL, [triton_input(served, x, True)],
                             outputs=[triton.InferRequestedOutput("logits", binary_data=True)])
        compiled = get_json(url + "/status")["models"][MODEL]["compiled"]
    assert compiled is True
    np.testing.assert_array_equal(final.as_numpy("logits"), logits)
    exits = errors < threshold
    assert 0 < exits.sum() < len(x)
    for i, answer in enumerate(answers):
        label = next(o for o in answer["outputs"] if o["name"] == "label")["data"][0]
        exit_site = np.atleast_1d(np.array(answer["parameters"]["exit_site"], dtype=object))[0]
        assert (exit_site, label) == ((site, ramp_labels[i]) if exits[i] else (None, logits[i].argmax()))


def test_the_controller_learns_each_ramps_error_in_the_models_own_score(served, fmnist_feeds) -> None:
    """A ramp no input exited at is scored after the answers are out: with the entropy as the model's error score,
    the controller's history holds each input's entropy at the ramp, as the eager ramp scores it."""
    # Compiled in this process: a compile worker would load the bundle, whose ramps score by max_prob
    model = replace(served.prepared, error_score="entropy", bundle_dir=None)
    entropic = make_served(served.name, model)
    x = fmnist_feeds[:8]
    seen: list[np.ndarray] = []
    model.run({entropic.inputs[0].name: x}, [model.site_names[1]], lambda _, labels, errors: seen.append(errors))
    with server(entropic, fixed_exits(entropic, 1, 0.0)) as (url, state):  # threshold 0: nobody exits
        assert get_json(url + "/status")["models"][MODEL]["compiled"]
        for i in range(len(x)):
            post(f"{url}/v2/models/{MODEL}/infer", infer_body(entropic, x[i:i + 1]))
        deadline = time.monotonic() + 30  # the controller learns from the books after the answers are out
        while get_json(url + "/status")["models"][MODEL]["inputs_observed"] < len(x):
            assert time.monotonic() < deadline, "the controller never observed every input"
            time.sleep(0.01)
        recent = state.workers[MODEL].control.controller.recent
        _, errors = recent.columns(recent.rows((model.site_names[1],))[-len(x):], (model.site_names[1],))
    np.testing.assert_allclose(errors[:, 0], seen[0], rtol=0, atol=1e-5)
