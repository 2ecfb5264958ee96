"""`bench peers` without MLServer's venv: the Ray Serve peer answers the original model's labels through v2 JSON,
the TorchScript and ONNX exports MLServer serves agree with the torch model, the client's JSON bodies are what
every system reads, and the per-system ratios and goals."""

from __future__ import annotations

import json
import socket
import urllib.request

import numpy as np
import orjson
import pytest
from ray import serve

from rampserve.bench.live import summarize_live
from rampserve.bench.loadgen import Job, LoadResult, encode_request, read_answer
from rampserve.bench.peers import (
    export_onnx, export_torchscript, goals, mlserver_repository, with_ratios,
)
from rampserve.bench.peers_ray import V2Classifier
from rampserve.runtime.bundle import load_bundle
from rampserve.workloads.fashion_mnist import to_model_input
from rampserve.workloads.streams import get_stream


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def inputs() -> np.ndarray:
    stream = get_stream("fmnist-drift")
    start = stream.evaluation.start
    return to_model_input(stream.items(start, start + 12))


def original_labels(bundle, inputs: np.ndarray) -> np.ndarray:
    model = load_bundle(bundle)
    return model.run({model.backend.input_names[0]: inputs}).argmax(axis=1)


def json_job(url: str, input_name: str) -> Job:
    return Job(url, ((input_name, "FP32"),), "label", None, json_bodies=True)


def post(job: Job, request: dict[str, np.ndarray]) -> bytes:
    body, headers = encode_request(job, request)
    with urllib.request.urlopen(urllib.request.Request(job.url, data=body, headers=headers), timeout=60) as response:
        return response.read()


def test_json_request_is_plain_v2(inputs):
    job = json_job("http://unused", "x")
    body, headers = encode_request(job, {"x": inputs[:2]})
    decoded = orjson.loads(body)
    assert headers == {"Content-Type": "application/json"}
    tensor = decoded["inputs"][0]
    assert (tensor["name"], tensor["datatype"], tensor["shape"]) == ("x", "FP32", list(inputs[:2].shape))
    np.testing.assert_array_equal(np.asarray(tensor["data"], dtype=np.float32).reshape(tensor["shape"]), inputs[:2])


def test_ray_serve_peer_answers_the_original_labels(local_ray, resnet_bundle, inputs):
    expected = original_labels(resnet_bundle, inputs)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        serve.run(V2Classifier.bind(str(resnet_bundle), "small", 4, 0.001), name="peer", route_prefix="/")
        job = json_job(f"http://127.0.0.1:{port}/v2/models/small/infer", "x")
        labels = [read_answer(post(job, {"x": inputs[i:i + 1]}), "label")[0] for i in range(len(inputs))]
        assert labels == expected.tolist()
        whole = orjson.loads(post(job, {"x": inputs}))  # several inputs in one request keep their order
        assert whole["model_name"] == "small"
        assert whole["outputs"][0]["data"] == expected.tolist()
        with pytest.raises(urllib.error.HTTPError) as wrong_path:
            post(json_job(f"http://127.0.0.1:{port}/v2/models/other/infer", "x"), {"x": inputs[:1]})
        assert wrong_path.value.code == 404
    finally:
        serve.shutdown()


def test_onnx_export_agrees_with_the_torch_model(resnet_bundle, inputs, tmp_path):
    import onnxruntime as ort

    model = load_bundle(resnet_bundle)
    name = model.backend.input_names[0]
    path = export_onnx(model, {name: inputs[:1]}, tmp_path / "model.onnx")
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for batch in (1, 5, 12):  # the batch axis is dynamic
        logits = session.run(None, {session.get_inputs()[0].name: inputs[:batch]})[0]
        np.testing.assert_array_equal(logits.argmax(axis=1), original_labels(resnet_bundle, inputs[:batch]))


def test_torchscript_export_agrees_with_the_torch_model(resnet_bundle, inputs, tmp_path):
    import torch

    model = load_bundle(resnet_bundle)
    path = export_torchscript(model, {model.backend.input_names[0]: inputs[:1]}, tmp_path / "model.pt")
    traced = torch.jit.load(str(path))
    for batch in (1, 5, 12):
        with torch.inference_mode():
            logits = traced(torch.from_numpy(inputs[:batch])).numpy()
        np.testing.assert_array_equal(logits.argmax(axis=1), original_labels(resnet_bundle, inputs[:batch]))


def test_mlserver_repository_sets_adaptive_batching(tmp_path):
    root = mlserver_repository(tmp_path / "repo", "m", tmp_path / "model.onnx", 8, 0.0, (1, 2, 3))
    server = json.loads((root / "settings.json").read_text())
    assert (server["http_port"], server["grpc_port"], server["metrics_port"]) == (1, 2, 3)
    model = json.loads((root / "m" / "model-settings.json").read_text())
    assert model["max_batch_size"] == 8
    assert 0 < model["max_batch_time"] <= 1e-3  # 0 would turn MLServer's batching off
    assert model["implementation"] == "runtime.Labels"
    assert (root / "m" / "runtime.py").is_file()


def load_result(latency_ms: list[float], labels: list[int], status: list[int] | None = None) -> LoadResult:
    n = len(latency_ms)
    scheduled = np.arange(n, dtype=np.float64) * 10.0
    return LoadResult(scheduled_ms=scheduled, sent_ms=scheduled.copy(), done_ms=scheduled + np.asarray(latency_ms),
                      status=np.asarray(status or [200] * n), label=np.asarray(labels),
                      early=np.zeros(n, dtype=bool), exit_site=np.full(n, -1), sites=(), errors={},
                      status_before=None, status_after=None)


def test_ratios_and_goals():
    reference = np.zeros(4, dtype=np.int64)
    systems = {name: summarize_live(load_result(latency, [0, 0, 0, 0]), reference, 2, None) | {"saturation_rps": rps}
               for name, latency, rps in (("rampserve_vanilla", [2.0] * 4, 300.0), ("rampserve", [1.0] * 4, 280.0),
                                          ("ray_serve", [4.0] * 4, 40.0), ("mlserver", [3.0] * 4, 300.0))}
    systems = with_ratios(systems)
    assert systems["rampserve_vanilla"]["ratios"]["p50_ms"] == 1.0
    assert systems["ray_serve"]["ratios"]["p50_ms"] == pytest.approx(2.0)
    assert systems["mlserver"]["ratios"]["p99_ms"] == pytest.approx(1.5)
    assert systems["rampserve"]["ratios"]["throughput_rps"] == pytest.approx(
        systems["rampserve"]["throughput_rps"] / systems["rampserve_vanilla"]["throughput_rps"])
    assert systems["ray_serve"]["ratios"]["saturation_rps"] == pytest.approx(40.0 / 300.0)
    assert goals(systems) == {"vanilla_throughput_at_least_peers": True, "vanilla_saturation_at_least_peers": True,
                              "vanilla_p50_at_most_peers": True, "rampserve_lowest_p50": True}
    systems["mlserver"]["saturation_rps"] = 301.0  # a peer that sustains more
    assert goals(systems)["vanilla_saturation_at_least_peers"] is False


def test_goals_count_a_peer_that_answered_nothing_as_slowest():
    reference = np.zeros(2, dtype=np.int64)
    systems = {"rampserve_vanilla": summarize_live(load_result([5.0, 5.0], [0, 0]), reference, 2, None),
               "ray_serve": summarize_live(load_result([1.0, 1.0], [-1, -1], [503, 503]), reference, 2, None)}
    for summary in systems.values():
        summary["saturation_rps"] = 0.0
    systems = with_ratios(systems)
    assert systems["ray_serve"]["ratios"]["p50_ms"] is None
    assert goals(systems)["vanilla_p50_at_most_peers"] is True
    assert goals(systems)["rampserve_lowest_p50"] is None
