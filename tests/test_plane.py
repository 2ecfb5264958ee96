"""The data plane called directly, with no transport: real answers of the small prepared ResNet (through its executor
in this process and in one of its own), other models and applications through the same path, the prediction
cache, and how every way a request can fail maps to a status, headers and the outcome counted."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable, Sequence

import numpy as np
import pytest
import torch

from rampserve.control.controller import ControllerSettings
from rampserve.serving.executor.loading import load_served, loaded
from rampserve.serving.frontend.apps.applications import ApplicationSpec
from rampserve.serving.frontend.apps.state_store import StoreError
from rampserve.serving.frontend.plane import DataPlane, InferResult
from rampserve.serving.frontend.repository.predictors import FunctionPredictor, ModelUnavailable, Predictor
from rampserve.serving.server import ServerSettings, build_state
from rampserve.serving.shared.contract import ExecutionFailed, ExecutorLost, Shed
from rampserve.serving.shared.models import ServedModel
from rampserve.serving.shared.protocol import DATATYPES, TensorSpec
from rampserve.serving.shared.settings import ModelSettings

MODEL = "resnet18-small"
IMAGE = TensorSpec("x", "FP32", (-1, 1, 28, 28))


@pytest.fixture(scope="module")
def served(resnet_bundle) -> ServedModel:
    return loaded(load_served(str(resnet_bundle)))


@contextlib.asynccontextmanager
async def data_plane(models: Sequence[ServedModel | Predictor], settings: ModelSettings = ModelSettings(vanilla=True),
                     apps: Sequence[ApplicationSpec] = (), cache_mb: float = 0.0
                     ) -> AsyncIterator[tuple[DataPlane, object]]:
    """A server's catalogue, started, and the data plane over it; no HTTP server."""
    state = build_state(models, settings, ServerSettings(port=0, grpc=False, cache_mb=cache_mb), apps)
    await state.catalogue.start()
    try:
        yield DataPlane(state.catalogue, state.metrics, state.cache), state
    finally:
        await state.catalogue.close()
        await state.catalogue.store.close()


def body_of(x: np.ndarray, outputs: Sequence[str] | None = None, **parameters) -> bytes:
    request: dict = {"id": "q", "inputs": [{"name": "x", "shape": list(x.shape), "datatype": "FP32",
                                          "data": x.ravel().tolist()}], "parameters": parameters}
    if outputs is not None:
        request["outputs"] = [{"name": name} for name in outputs]
    return json.dumps(request).encode()


def binary_request(x: np.ndarray, outputs: Sequence[str]) -> tuple[bytes, int]:
    """Triton's binary form: the JSON header, then the input's raw bytes; every output asked for in binary."""
    header = json.dumps({"inputs": [{"name": "x", "shape": list(x.shape), "datatype": "FP32",
                                     "parameters": {"binary_data_size": x.nbytes}}],
                         "outputs": [{"name": name, "parameters": {"binary_data": True}} for name in outputs]}).encode()
    return header + x.astype("<f4").tobytes(), len(header)


def decoded(result: InferResult) -> tuple[dict, dict[str, np.ndarray]]:
    """The response's JSON header and its output tensors, whether they came as JSON data or binary."""
    length = int(result.headers.get("Inference-Header-Content-Length", len(result.body)))
    header, offset, tensors = json.loads(result.body[:length]), length, {}
    for output in header.get("outputs", []):
        dtype, shape = DATATYPES[output["datatype"]], output["shape"]
        if "data" in output:
            tensors[output["name"]] = np.array(output["data"], dtype=dtype).reshape(shape)
        else:
            size = output["parameters"]["binary_data_size"]
            tensors[output["name"]] = np.frombuffer(result.body[offset:offset + size], dtype=dtype).reshape(shape)
            offset += size
    return header, tensors


def original_logits(served: ServedModel, x: np.ndarray) -> np.ndarray:
    with torch.inference_mode():
        return served.prepared.backend.module(torch.from_numpy(x)).numpy()


def requests_counted(state, model: str, outcome: str) -> float:
    return state.metrics.registry.get_sample_value("rampserve_requests_total",
                                                   {"model": model, "outcome": outcome, "transport": "http"}) or 0.0


@pytest.mark.parametrize("executor", ["thread", "process"])
def test_a_bundle_answers_through_the_plane_with_its_labels_and_logits(served, fmnist_feeds, executor) -> None:
    x = fmnist_feeds[:3]
    expected = original_logits(served, x)

    async def scenario() -> tuple[InferResult, InferResult, InferResult]:
        async with data_plane([served], ModelSettings(vanilla=True, executor=executor)) as (plane, _):
            labels = await plane.infer(MODEL, None, body_of(x), None)
            both = await plane.infer(MODEL, "1", body_of(x, ["label", "logits"]), None)
            binary = await plane.infer(MODEL, None, *binary_request(x[:1], ["logits"]))
            return labels, both, binary

    labels, both, binary = asyncio.run(scenario())
    assert (labels.status, labels.outcome, labels.headers["Content-Type"]) == (200, "final", "application/json")
    header, tensors = decoded(labels)
    assert (header["model_name"], header["model_version"], header["id"]) == (MODEL, "1", "q")
    assert list(tensors) == ["label"]  # no outputs named: the label alone
    np.testing.assert_array_equal(tensors["label"], expected.argmax(axis=1))
    parameters = header["parameters"]
    assert parameters["early"] is False and parameters["exit_site"] == [None] * 3
    assert parameters["error_score"] == [None] * 3 and len(parameters["confidence"]) == 3
    _, tensors = decoded(both)
    np.testing.assert_array_equal(tensors["label"], expected.argmax(axis=1))
    np.testing.assert_allclose(tensors["logits"], expected, rtol=1e-5, atol=1e-6)
    assert binary.headers["Content-Type"] == "application/octet-stream"
    header, tensors = decoded(binary)
    assert header["parameters"]["exit_site"] is None  # one input: scalars
    np.testing.assert_allclose(tensors["logits"], expected[:1], rtol=1e-5, atol=1e-6)


def test_an_early_label_leaves_at_its_ramp_and_the_cache_keeps_the_final_answer(served, fmnist_feeds) -> None:
    site = served.prepared.site_names[0]
    # Threshold 1: every input exits at the ramp; release mode: each still runs to the end, whose answer is cached
    controller = ControllerSettings(initial=(site,), start_thresholds={site: 1.0}, threshold_tuning=False,
                                    ramp_adjustment=False, exit_mode="release")
    settings = ModelSettings(controller=controller, executor="thread")
    x = fmnist_feeds[:4]

    async def scenario() -> tuple[InferResult, InferResult, InferResult, InferResult, dict, object]:
        async with data_plane([served], settings, cache_mb=1.0) as (plane, state):
            early = await plane.infer(MODEL, None, body_of(x), None)
            with_logits = await plane.infer(MODEL, None, body_of(fmnist_feeds[4:6], ["logits"]), None)
            for _ in range(3000):  # the early answer's batch runs on to its end before its final answer is kept
                if len(state.caches[MODEL]) == 2:
                    break
                await asyncio.sleep(0.01)
            repeat = await plane.infer(MODEL, None, body_of(x), None)
            repeat_logits = await plane.infer(MODEL, None, body_of(x, ["logits"]), None)
            status = await state.workers[MODEL].current_status()
            return early, with_logits, repeat, repeat_logits, status, state

    early, with_logits, repeat, repeat_logits, status, state = asyncio.run(scenario())
    header, _ = decoded(early)
    assert early.outcome == "early" and header["parameters"]["exit_site"] == [site] * 4
    header, tensors = decoded(with_logits)  # asking for the logits waits for the final layer
    assert with_logits.outcome == "final" and header["parameters"]["early"] is False
    np.testing.assert_allclose(tensors["logits"], original_logits(served, fmnist_feeds[4:6]), rtol=1e-5, atol=1e-6)
    header, tensors = decoded(repeat)
    assert repeat.outcome == "cached" and header["parameters"]["cached"] is True
    assert header["parameters"]["early"] is False  # the final answer was kept, never the ramp's
    np.testing.assert_array_equal(tensors["label"], original_logits(served, x).argmax(axis=1))
    _, tensors = decoded(repeat_logits)  # the kept final answer has the logits too
    assert repeat_logits.outcome == "cached" and tensors["logits"].shape == (4, 10)
    assert status["answers"]["cached"] == 8  # the controller's books hear of the cache's answers
    assert requests_counted(state, MODEL, "cached") == 2 and requests_counted(state, MODEL, "early") == 1


def constant(label: int, confidence: float) -> Callable[[dict[str, np.ndarray]], np.ndarray]:
    def predict(feeds: dict[str, np.ndarray]) -> np.ndarray:
        probabilities = np.full((len(feeds["x"]), 10), (1.0 - confidence) / 9)
        probabilities[:, label] = confidence
        return probabilities

    return predict


def raising(error: Exception) -> Callable[[dict[str, np.ndarray]], np.ndarray]:
    def predict(_feeds: dict[str, np.ndarray]) -> np.ndarray:
        raise error

    return predict


def test_other_models_and_applications_answer_labels_through_the_same_path(fmnist_feeds) -> None:
    x = fmnist_feeds[:2]
    models = [FunctionPredictor("three", constant(3, 0.8), (IMAGE,)),
              FunctionPredictor("broken", raising(RuntimeError("no")), (IMAGE,))]
    apps = [ApplicationSpec("app", ("three",), "exp4", slo_ms=5000.0),
            ApplicationSpec("fallback", ("broken",), "exp4", slo_ms=5000.0, default_output="unknown")]

    async def scenario() -> list[InferResult]:
        async with data_plane(models, apps=apps, cache_mb=1.0) as (plane, _):
            return [await plane.infer("three", None, body_of(x), None),
                    await plane.infer("three", None, body_of(x), None),  # a repeat: the cache answers
                    await plane.infer("app", None, body_of(x[:1], uid="someone"), None),
                    await plane.infer("app", None, body_of(x[:1], uid="someone"), None),  # applications: never cached
                    await plane.infer("fallback", None, body_of(x[:1]), None),
                    await plane.infer("app", None, body_of(x), None)]

    model, cached, app, again, fallback, two_queries = asyncio.run(scenario())
    header, tensors = decoded(model)
    assert model.outcome == "final" and header["parameters"] == {"confidence": [0.8, 0.8]}
    np.testing.assert_array_equal(tensors["label"], [3, 3])
    assert cached.outcome == "cached" and decoded(cached)[0]["parameters"]["cached"] is True
    header, tensors = decoded(app)
    assert app.outcome == again.outcome == "answered" and tensors["label"].tolist() == [3]
    assert header["model_version"] == "1" and header["parameters"]["models"] == ["three"]
    header, tensors = decoded(fallback)
    assert fallback.outcome == "default" and tensors["label"].tolist() == [-1]
    assert header["parameters"]["default_output"] == "unknown" and header["parameters"]["default"] is True
    assert two_queries.status == 400 and "one query per request" in json.loads(two_queries.body)["error"]


@pytest.mark.parametrize(("error", "status", "retry_after", "outcome"), [
    (Shed(429, "deadline", "too late", 2), 429, "2", "shed"),
    (Shed(503, "queue_full", "queue full"), 503, None, "shed"),
    (ModelUnavailable("unreachable"), 503, None, "shed"),
    (ExecutorLost("its process died"), 503, "1", "failed"),
    (ExecutionFailed("the model raised"), 500, None, "failed"),
    (StoreError("redis is gone"), 503, None, "failed"),
])
def test_each_failure_maps_to_its_status_and_outcome(error, status, retry_after, outcome) -> None:
    x = np.zeros((1, 1, 28, 28), dtype=np.float32)

    async def scenario() -> tuple[InferResult, object]:
        async with data_plane([FunctionPredictor("failing", raising(error), (IMAGE,))]) as (plane, state):
            return await plane.infer("failing", None, body_of(x), None), state

    result, state = asyncio.run(scenario())
    assert (result.status, result.outcome, result.headers.get("Retry-After")) == (status, outcome, retry_after)
    assert result.headers["Content-Type"] == "application/json"
    assert str(error) in json.loads(result.body)["error"]
    assert requests_counted(state, "failing", outcome) == 1


def test_invalid_requests_are_refused_and_counted_as_invalid(served, fmnist_feeds) -> None:
    x = fmnist_feeds[:1]

    async def scenario() -> tuple[dict[str, InferResult], InferResult, object]:
        async with data_plane([served], ModelSettings(vanilla=True, executor="thread")) as (plane, state):
            results = {
                "unknown model": await plane.infer("ghost", None, body_of(x), None),
                "unknown version": await plane.infer(MODEL, "9", body_of(x), None),
                "not json": await plane.infer(MODEL, None, b"{nope", None),
                "header past the body": await plane.infer(MODEL, None, body_of(x), 10 ** 6),
                "bad deadline": await plane.infer(MODEL, None, body_of(x, deadline_ms=-1), None),
                "unknown output": await plane.infer(MODEL, None, body_of(x, ["nope"]), None),
            }
            late = await plane.infer(MODEL, None, body_of(x, deadline_ms=1e-6), None)
            return results, late, state

    results, late, state = asyncio.run(scenario())
    assert {case: r.status for case, r in results.items()} == {
        "unknown model": 404, "unknown version": 404, "not json": 400, "header past the body": 400,
        "bad deadline": 400, "unknown output": 400}
    assert all(r.outcome == "invalid" for r in results.values())
    assert "no version '9'" in json.loads(results["unknown version"].body)["error"]
    assert late.status == 429 and late.outcome == "shed" and int(late.headers["Retry-After"]) >= 1
    assert requests_counted(state, "unknown", "invalid") == 1 and requests_counted(state, MODEL, "invalid") == 5
