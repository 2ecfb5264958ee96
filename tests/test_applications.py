"""Applications over several models, for real: uvicorn on loopback, models of every kind on real Fashion-MNIST
(a prepared bundle, torch, ONNX, scikit-learn, Python callables, another rampserve as a remote model), Exp3/Exp4
learning from feedback, stragglers at the deadline, speculative races with their deciders, the admin API and
its token."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import numpy as np
import pytest
import torch
from sklearn.linear_model import LogisticRegression
from test_serving import get_json, post

from rampserve.serving.executor.loading import load_served, loaded
from rampserve.serving.frontend.app import ServerState
from rampserve.serving.frontend.apps.applications import ApplicationSpec
from rampserve.serving.frontend.repository.predictors import (
    FunctionPredictor,
    ModelUnavailable,
    Predictor,
    RemotePredictor,
    sklearn_predictor,
)
from rampserve.serving.plain_models import onnx_predictor, torch_predictor
from rampserve.serving.server import ServerSettings, build_state, check_admin_access, running_server
from rampserve.serving.shared.protocol import TensorSpec
from rampserve.serving.shared.settings import ModelSettings
from rampserve.workloads.fashion_mnist import load_fashion_mnist, to_model_input

IMAGE = TensorSpec("x", "FP32", (-1, 1, 28, 28))
# Generous: the blocked models below never answer within it, and every other model answers far inside it.
SLO_MS = 1000.0


@pytest.fixture(scope="module")
def fmnist():
    """A few thousand real training images (to fit the small models) and test images (the queries)."""
    train_x, train_y = load_fashion_mnist("train")
    test_x, test_y = load_fashion_mnist("test")
    return to_model_input(train_x[:2000]), train_y[:2000], to_model_input(test_x[:200]), test_y[:200]


@pytest.fixture(scope="module")
def logreg(fmnist):
    x, y, _, _ = fmnist
    return LogisticRegression(max_iter=300).fit(x.reshape(len(x), -1), y)


def centroid_model(x: np.ndarray, y: np.ndarray) -> Callable[[dict[str, np.ndarray]], np.ndarray]:
    """A Python callable: nearest class mean, minus squared distances as logits."""
    means = np.stack([x[y == c].reshape((y == c).sum(), -1).mean(axis=0) for c in range(10)])

    def predict(feeds: dict[str, np.ndarray]) -> np.ndarray:
        rows = feeds["x"].reshape(len(feeds["x"]), -1)
        return -((rows[:, None, :] - means[None]) ** 2).sum(axis=2) / 100.0

    return predict


def constant(label: int, confidence: float) -> Callable[[dict[str, np.ndarray]], np.ndarray]:
    def predict(feeds: dict[str, np.ndarray]) -> np.ndarray:
        rows = len(feeds["x"])
        probabilities = np.full((rows, 10), (1.0 - confidence) / 9)
        probabilities[:, label] = confidence
        return probabilities

    return predict


class Gate:
    """A model that answers only once released: a straggler that is certain to miss any deadline."""

    def __init__(self, label: int = 7) -> None:
        self.label = label
        self.open = threading.Event()

    def __call__(self, feeds: dict[str, np.ndarray]) -> np.ndarray:
        if not self.open.wait(60):
            raise RuntimeError("the test never released the gate")
        return np.full(len(feeds["x"]), self.label)


def const_onnx(path, label: int) -> None:
    """An ONNX graph that always answers `label` (a linear layer whose bias alone decides)."""
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, 10))
    with torch.no_grad():
        model[1].weight.zero_()
        model[1].bias.copy_(torch.nn.functional.one_hot(torch.tensor(label), 10).float() * 5)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.onnx.export(model, (torch.zeros(1, 1, 28, 28),), str(path), input_names=["x"], output_names=["logits"],
                      dynamic_axes={"x": {0: "batch"}}, dynamo=False, opset_version=17)


@contextmanager
def live(models: Sequence, apps: Sequence[ApplicationSpec] = (), settings: ModelSettings = ModelSettings(),
         **server_settings) -> Iterator[tuple[str, ServerState]]:
    settings_ = ServerSettings(port=0, grpc=False, **server_settings)
    state = build_state(models, settings, settings_, apps)
    with running_server(state, settings_) as url:
        yield url, state


def infer(url: str, model: str, x: np.ndarray, **parameters) -> tuple[int, dict]:
    body = {"inputs": [{"name": "x", "shape": list(x.shape), "datatype": "FP32", "data": x.ravel().tolist()}],
            "parameters": parameters}
    status, _, answer = post(f"{url}/v2/models/{model}/infer", json.dumps(body).encode())
    return status, answer


def query(url: str, app: str, x: np.ndarray, path: str = "predict", **extra) -> tuple[int, dict]:
    status, _, answer = post(f"{url}/{app}/{path}", json.dumps({"input": x[0].tolist(), **extra}).encode())
    return status, answer


def labels_of(answer: dict) -> np.ndarray:
    return np.array(answer["outputs"][0]["data"])


def admin(url: str, path: str, body: dict | None = None, token: str | None = None) -> tuple[int, dict]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    status, _, answer = post(url + path, json.dumps(body or {}).encode(), headers)
    return status, answer


def wait_for(condition: Callable[[], bool], what: str, limit_s: float = 30.0) -> None:
    """Poll a real condition until it holds; fail with `what` past the limit."""
    give_up = time.monotonic() + limit_s
    while not condition():
        if time.monotonic() > give_up:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def test_models_of_every_kind_answer_through_v2(resnet_bundle, fmnist, logreg, tmp_path) -> None:
    _, _, x, _ = fmnist
    x = x[:6]
    served = loaded(load_served(str(resnet_bundle)))
    from model_factories import tiny_resnet

    module = tiny_resnet()
    const_onnx(tmp_path / "const.onnx", 4)
    with live([served], settings=ModelSettings(vanilla=True)) as (remote_url, _):
        centroid = centroid_model(*fmnist[:2])
        predictors: list[Predictor] = [
            torch_predictor("torch", module, (IMAGE,)),
            onnx_predictor("onnx", tmp_path / "const.onnx"),
            sklearn_predictor("sklearn", logreg, IMAGE),
            FunctionPredictor("python", centroid, (IMAGE,)),
            RemotePredictor("remote", remote_url, served.name, timeout_ms=5000),
        ]
        with live([served, *predictors]) as (url, _):
            answers = {name: infer(url, name, x) for name in ("torch", "onnx", "sklearn", "python", "remote",
                                                               served.name)}
            metadata = get_json(f"{url}/v2/models/remote")
    assert all(status == 200 for status, _ in answers.values()), {n: a for n, (s, a) in answers.items() if s != 200}
    with torch.inference_mode():
        np.testing.assert_array_equal(labels_of(answers["torch"][1]), module(torch.from_numpy(x)).argmax(1).numpy())
    np.testing.assert_array_equal(labels_of(answers["onnx"][1]), np.full(6, 4))
    np.testing.assert_array_equal(labels_of(answers["sklearn"][1]), logreg.predict(x.reshape(6, -1)))
    np.testing.assert_array_equal(labels_of(answers["python"][1]), centroid({"x": x}).argmax(axis=1))
    # The remote server runs the original model (vanilla), so its labels are the model's own.
    expected = served.prepared.run({"x": x}).argmax(axis=1)
    np.testing.assert_array_equal(labels_of(answers["remote"][1]), expected)
    assert metadata["inputs"] == [IMAGE.to_json()] and metadata["platform"] == "rampserve_remote"
    confidences = answers["sklearn"][1]["parameters"]["confidence"]
    np.testing.assert_allclose(confidences, logreg.predict_proba(x.reshape(6, -1)).max(axis=1), rtol=1e-6)


def test_an_ensemble_answers_at_its_deadline_from_the_models_that_answered(fmnist) -> None:
    _, _, x, _ = fmnist
    gate = Gate()
    models = [FunctionPredictor("fast", constant(3, 0.9), (IMAGE,)), FunctionPredictor("slow", gate, (IMAGE,))]
    apps = [ApplicationSpec("ensemble", ("fast", "slow"), "exp4", slo_ms=SLO_MS),
            ApplicationSpec("stuck", ("slow",), "exp4", slo_ms=SLO_MS, default_output="unknown")]
    with live(models, apps) as (url, _):
        try:
            status, answer = query(url, "ensemble", x)
            stuck_status, stuck = query(url, "stuck", x)
        finally:
            gate.open.set()
        wait_for(lambda: get_json(f"{url}/apps/ensemble")["models"]["slow"]["late"] == 1, "the straggler's answer")
        ensemble = get_json(f"{url}/apps/ensemble")
    assert status == 200 and answer["default"] is False and answer["output"] == 3
    # Half the ensemble's weight answered: the confidence says so.
    assert answer["models"] == ["fast"] and answer["confidence"] == pytest.approx(0.5)
    assert stuck_status == 200 and stuck["default"] is True and stuck["output"] == "unknown"
    assert "no model answered within the SLO" in stuck["explanation"]
    assert ensemble["models"]["fast"]["wins"] == 1 and ensemble["models"]["slow"]["answered"] == 0


@pytest.mark.parametrize("policy", ["exp3", "exp4"])
def test_feedback_moves_the_weight_to_the_better_model(policy, fmnist, logreg) -> None:
    _, _, x, y = fmnist
    models = [sklearn_predictor("good", logreg, IMAGE), FunctionPredictor("zero", constant(0, 0.99), (IMAGE,))]
    app = ApplicationSpec("pick", ("good", "zero"), policy, slo_ms=SLO_MS, seed=0)  # Exp3's draws reproducible
    with live(models, [app]) as (url, _):
        before = get_json(f"{url}/apps/pick")["weights"]
        for i in range(60):
            status, _ = query(url, "pick", x[i:i + 1])
            assert status == 200
            status, update = query(url, "pick", x[i:i + 1], path="update", label=int(y[i]))
            assert status == 200 and update["updated"] is True
        after = get_json(f"{url}/apps/pick")
        other_user = get_json(f"{url}/apps/pick?uid=someone-else")["weights"]
    assert before == {"good": 0.5, "zero": 0.5} and other_user == before  # state is per context
    assert after["weights"]["good"] > 0.9
    stats = after["models"]
    assert stats["good"]["accuracy"] > stats["zero"]["accuracy"]


def race_models() -> list[Predictor]:
    return [FunctionPredictor("a", constant(1, 0.6), (IMAGE,)), FunctionPredictor("b", constant(2, 0.9), (IMAGE,)),
            FunctionPredictor("c", constant(1, 0.7), (IMAGE,))]


@pytest.mark.parametrize(("decider", "label", "winners"), [
    ("best_confidence", 2, ["b"]),
    ("consensus", 1, ["a", "c"]),
    ("confidence_weighted", 1, ["a", "c"]),
    ("learned", 1, ["a", "c"]),  # before any feedback: a majority
])
def test_a_race_lets_its_decider_choose(decider, label, winners, fmnist) -> None:
    _, _, x, _ = fmnist
    app = ApplicationSpec("race", ("a", "b", "c"), "race", slo_ms=SLO_MS, decider=decider)
    with live(race_models(), [app]) as (url, _):
        answers = [query(url, "race", x[i:i + 1]) for i in range(3)]
        stats = get_json(f"{url}/apps/race")
        metrics = get_json_text(f"{url}/metrics")
    for status, answer in answers:
        assert status == 200 and answer["output"] == label and sorted(answer["models"]) == winners
        assert len(answer["query_id"]) == 32  # the race's GUID
    for model in ("a", "b", "c"):
        assert stats["models"][model]["asked"] == 3
        latency = stats["models"][model]["latency_ms"]
        assert 0 <= latency["min"] <= latency["mean"] <= latency["max"]
        assert stats["models"][model]["wins"] == (3 if model in winners else 0)
    assert stats["requests"] == 3 and stats["defaults"] == 0
    assert f'rampserve_app_model_answers_total{{app="race",model="{winners[0]}",outcome="won"}} 3.0' in metrics


def get_json_text(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url) as response:
        return response.read().decode()


def test_first_answer_and_a_users_own_decider(fmnist) -> None:
    _, _, x, _ = fmnist
    gate = Gate(label=9)
    models = [FunctionPredictor("quick", constant(8, 0.5), (IMAGE,)), FunctionPredictor("gated", gate, (IMAGE,))]
    apps = [ApplicationSpec("first", ("quick", "gated"), "race", slo_ms=SLO_MS, decider="first"),
            ApplicationSpec("mine", ("quick", "gated"), "race", slo_ms=SLO_MS,
                            decider="model_factories:largest_label")]
    with live(models, apps) as (url, _):
        status, fastest = query(url, "first", x)  # decided before the gated model could answer
        gate.open.set()
        mine_status, mine = query(url, "mine", x)  # waits for both, then takes the largest label
    assert status == 200 and fastest["output"] == 8 and fastest["models"] == ["quick"]
    assert mine_status == 200 and mine["output"] == 9 and mine["models"] == ["gated"]


def test_applications_answer_through_v2_too(fmnist, logreg) -> None:
    _, _, x, _ = fmnist
    app = ApplicationSpec("v2app", ("good",), "exp3", slo_ms=SLO_MS)
    with live([sklearn_predictor("good", logreg, IMAGE)], [app]) as (url, _):
        status, answer = infer(url, "v2app", x[:1], uid="user-1")
        batch_status, batch = infer(url, "v2app", x[:2])
        metadata = get_json(f"{url}/v2/models/v2app")
    assert status == 200 and labels_of(answer).tolist() == logreg.predict(x[:1].reshape(1, -1)).tolist()
    assert answer["parameters"]["default"] is False and answer["parameters"]["models"] == ["good"]
    assert batch_status == 400 and "one query per request" in batch["error"]
    assert metadata["platform"] == "rampserve_application" and metadata["inputs"] == [IMAGE.to_json()]


def test_bad_application_requests_get_clear_errors_and_serving_goes_on(fmnist, logreg) -> None:
    _, _, x, _ = fmnist
    other = TensorSpec("pixels", "FP32", (-1, 784))
    models = [sklearn_predictor("good", logreg, IMAGE), sklearn_predictor("flat", logreg, other)]
    with live(models, [ApplicationSpec("app", ("good",), "exp4")]) as (url, _):
        cases = {
            "unknown app": post(f"{url}/nope/predict", b'{"input": [1]}'),
            "no input": post(f"{url}/app/predict", b'{"uid": "u"}'),
            "not json": post(f"{url}/app/predict", b"{nope"),
            "wrong shape": post(f"{url}/app/predict", json.dumps({"input": [[1.0, 2.0]]}).encode()),
            "not numbers": post(f"{url}/app/predict", json.dumps({"input": [["a"] * 28] * 28}).encode()),
            "bad label": post(f"{url}/app/update", json.dumps({"input": x[0].tolist(), "label": "cat"}).encode()),
            "unknown model": admin(url, "/admin/apps", {"name": "x", "models": ["ghost"]}),
            "bad policy": admin(url, "/admin/apps", {"name": "x", "models": ["good"], "policy": "greedy"}),
            "unknown field": admin(url, "/admin/apps", {"name": "x", "models": ["good"], "sl0_ms": 5}),
            "name of a model": admin(url, "/admin/apps", {"name": "good", "models": ["good"]}),
            "reserved name": admin(url, "/admin/apps", {"name": "v2", "models": ["good"]}),
            "mixed inputs": admin(url, "/admin/apps", {"name": "x", "models": ["good", "flat"]}),
            "bad decider": admin(url, "/admin/apps", {"name": "x", "models": ["good"], "policy": "race",
                                                      "decider": "nope"}),
        }
        still = query(url, "app", x)
    statuses = {case: result[0] for case, result in cases.items()}
    assert statuses == {"unknown app": 404, "no input": 400, "not json": 400, "wrong shape": 400,
                        "not numbers": 400, "bad label": 400, "unknown model": 404, "bad policy": 400,
                        "unknown field": 400, "name of a model": 409, "reserved name": 400, "mixed inputs": 400,
                        "bad decider": 400}
    messages = {case: result[-1]["error"] for case, result in cases.items()}
    assert "unknown application 'nope'" in messages["unknown app"]
    assert "shape [1, 2]" in messages["wrong shape"] and "sl0_ms" in messages["unknown field"]
    assert "ghost" in messages["unknown model"] and "different inputs" in messages["mixed inputs"]
    assert still[0] == 200 and still[1]["default"] is False


def test_admin_endpoints_need_the_token_when_one_is_set(fmnist, logreg) -> None:
    spec = {"name": "guarded", "models": ["good"], "policy": "exp3"}
    with live([sklearn_predictor("good", logreg, IMAGE)], admin_token="s3cret") as (url, _):
        missing = admin(url, "/admin/apps", spec)
        wrong = admin(url, "/admin/apps", spec, token="guess")
        index = admin(url, "/v2/repository/index")
        apps_before = get_json(f"{url}/apps")
        right = admin(url, "/admin/apps", spec, token="s3cret")
        served = query(url, "guarded", fmnist[2])  # queries need no token
    assert (missing[0], wrong[0], index[0]) == (401, 403, 401) and "Bearer" in missing[1]["error"]
    assert apps_before == {} and right[0] == 201 and served[0] == 200
    with pytest.raises(ValueError, match="admin token"):
        check_admin_access(ServerSettings(host="0.0.0.0"))
    check_admin_access(ServerSettings(host="0.0.0.0", admin_token="s3cret"))
    check_admin_access(ServerSettings(host="::1"))


def test_a_remote_model_times_out_and_retries_without_duplicating(fmnist) -> None:
    _, _, x, _ = fmnist
    gate = Gate()
    with live([FunctionPredictor("held", gate, (IMAGE,))]) as (url, _):

        async def ask(predictor: RemotePredictor) -> str:
            try:
                await predictor.predict({"x": x[:1]})
                return "answered"
            except ModelUnavailable as exc:
                return str(exc)
            finally:
                await predictor.close()

        try:
            timed_out = RemotePredictor("r", url, "held", timeout_ms=150, retries=1, inputs=(IMAGE,))
            message = asyncio.run(ask(timed_out))
        finally:
            gate.open.set()
        unreachable = RemotePredictor("r", "http://127.0.0.1:9", "m", timeout_ms=500, retries=2, inputs=(IMAGE,))
        unreachable_message = asyncio.run(ask(unreachable))
    assert "no answer within 150 ms" in message and timed_out.attempts == 2 and timed_out.retried == 1
    assert unreachable.attempts == 3 and "127.0.0.1:9" in unreachable_message


def test_a_remote_straggler_answers_late_and_its_answer_is_kept(fmnist) -> None:
    _, _, x, _ = fmnist
    gate = Gate(label=6)
    with live([FunctionPredictor("held", gate, (IMAGE,))]) as (remote_url, _):
        models = [FunctionPredictor("near", constant(2, 0.9), (IMAGE,)),
                  RemotePredictor("far", remote_url, "held", timeout_ms=30_000, inputs=(IMAGE,))]
        app = ApplicationSpec("spread", ("near", "far"), "exp4", slo_ms=300)
        with live(models, [app]) as (url, _):
            try:
                status, answer = query(url, "spread", x)
            finally:
                gate.open.set()
            wait_for(lambda: get_json(f"{url}/apps/spread")["models"]["far"]["late"] == 1, "the remote's late answer")
            far = get_json(f"{url}/apps/spread")["models"]["far"]
            update = query(url, "spread", x, path="update", label=6)[1]
    assert status == 200 and answer["models"] == ["near"] and answer["output"] == 2
    assert far["failed"] == 0 and far["answered"] == 0
    # The feedback scores the late answer: the remote was right, the near model wrong.
    assert update["losses"] == {"near": 1.0, "far": 0.0}
