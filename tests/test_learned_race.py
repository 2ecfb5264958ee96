"""The learned race decider served for real: feedback over HTTP teaches it which model to trust, its trust lives in
the state store (a real redis-server) and outlives the server, and models that are late or fail leave the decision
to those that answered."""

from __future__ import annotations

import numpy as np
import pytest
from test_applications import IMAGE, Gate, admin, constant, live, query, wait_for
from test_serving import get_json

from rampserve.serving.frontend.apps.applications import ApplicationSpec
from rampserve.serving.frontend.repository.predictors import FunctionPredictor
from rampserve.workloads.fashion_mnist import load_fashion_mnist, to_model_input

SLO_MS = 1000.0
WRONG = 2  # what the two confident models always answer


def oracle(images: np.ndarray, labels: np.ndarray):
    """A model that knows the true label of every query image, and says so with confidence 0.6."""
    table = {image.tobytes(): int(label) for image, label in zip(images, labels)}

    def predict(feeds: dict[str, np.ndarray]) -> np.ndarray:
        rows = feeds["x"]
        probabilities = np.full((len(rows), 10), 0.4 / 9)
        probabilities[np.arange(len(rows)), [table[row.tobytes()] for row in rows]] = 0.6
        return probabilities

    return predict


@pytest.fixture(scope="module")
def queries():
    """Real Fashion-MNIST test images whose true label is not the one the confident models always give."""
    images, labels = load_fashion_mnist("test")
    keep = labels[:200] != WRONG
    return to_model_input(images[:200][keep]), labels[:200][keep]


def trio(queries) -> list[FunctionPredictor]:
    return [FunctionPredictor("oracle", oracle(*queries), (IMAGE,)),
            FunctionPredictor("sure", constant(WRONG, 0.99), (IMAGE,)),
            FunctionPredictor("also", constant(WRONG, 0.95), (IMAGE,))]


def outputs(url: str, x: np.ndarray, **extra) -> list[int]:
    answers = [query(url, "trio", x[i:i + 1], **extra) for i in range(len(x))]
    assert all(status == 200 and not answer["default"] for status, answer in answers)
    return [answer["output"] for _, answer in answers]


def test_feedback_teaches_the_race_which_model_to_trust_and_the_store_keeps_it(queries, redis_url,
                                                                                redis_prefix) -> None:
    x, y = queries
    spec = {"name": "trio", "models": ["oracle", "sure", "also"], "policy": "race", "decider": "learned",
            "slo_ms": SLO_MS}
    store = {"store": redis_url, "store_prefix": redis_prefix}
    with live(trio(queries), **store) as (url, _):
        assert admin(url, "/admin/apps", spec)[0] == 201
        before = outputs(url, x[:5], uid="ann")
        updates = []
        for i in range(5, 45):
            query(url, "trio", x[i:i + 1], uid="ann")
            status, update = query(url, "trio", x[i:i + 1], path="update", label=int(y[i]), uid="ann")
            assert status == 200 and update["updated"] is True
            updates.append(update)
        after = outputs(url, x[45:60], uid="ann")
    with live(trio(queries), **store) as (url, _):  # a new server on the same Redis: the trust is still there
        restarted = outputs(url, x[60:75], uid="ann")
        other_user = outputs(url, x[60:65], uid="bob")
    assert before == [WRONG] * 5  # two of three agree: a majority, before any feedback
    assert updates[-1]["losses"] == {"oracle": 0.0, "sure": 1.0, "also": 1.0}
    assert updates[-1]["trust"] == {"oracle": 1.0, "sure": 0.0, "also": 0.0}
    assert after == y[45:60].tolist() and restarted == y[60:75].tolist()
    assert other_user == [WRONG] * 5  # trust is per context, as selection weights are


def test_late_and_failing_models_leave_the_decision_to_those_that_answered(queries) -> None:
    x = queries[0][:1]
    gate = Gate(label=9)

    def broken(feeds: dict[str, np.ndarray]) -> np.ndarray:
        raise RuntimeError("this model is down")

    models = [FunctionPredictor("a", constant(1, 0.8), (IMAGE,)), FunctionPredictor("b", constant(3, 0.7), (IMAGE,)),
              FunctionPredictor("gated", gate, (IMAGE,)), FunctionPredictor("broken", broken, (IMAGE,))]
    app = ApplicationSpec("trio", ("a", "b", "gated", "broken"), "race", slo_ms=300, decider="learned")
    with live(models, [app]) as (url, _):
        try:
            status, answer = query(url, "trio", x)
        finally:
            gate.open.set()
        wait_for(lambda: get_json(f"{url}/apps/trio")["models"]["gated"]["late"] == 1, "the gated model's answer")
        update = query(url, "trio", x, path="update", label=9)[1]
        stats = get_json(f"{url}/apps/trio")["models"]
    # One vote each for 1 and 3 by the deadline: the tie goes to the more confident answer.
    assert status == 200 and answer["default"] is False and answer["output"] == 1 and answer["models"] == ["a"]
    assert stats["broken"]["failed"] == 2 and stats["gated"]["answered"] == 0
    # The feedback learns from the late answer too; the broken model, asked again, has none to learn from.
    assert update["losses"] == {"a": 1.0, "b": 1.0, "gated": 0.0}
    assert update["trust"] == {"a": 0.0, "b": 0.0, "gated": 1.0, "broken": None}
