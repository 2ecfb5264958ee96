"""Models and state that change while serving, for real: a versioned repository swapped under concurrent load, a
model update pushed through a Redis Stream, and selection state in a real redis-server outliving the server."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from test_applications import IMAGE, admin, const_onnx, constant, infer, labels_of, live, query, wait_for
from test_serving import get_json

from rampserve.serving.frontend.apps.applications import ApplicationSpec
from rampserve.serving.frontend.apps.update_stream import ModelUpdate, publish_update
from rampserve.serving.frontend.repository.predictors import FunctionPredictor


@pytest.fixture
def repository(tmp_path, resnet_bundle):
    """`clf` answers its version number (1, 2); `resnet` has two versions of the small prepared bundle."""
    root = tmp_path / "repository"
    for version in (1, 2):
        const_onnx(root / "clf" / str(version) / "model.onnx", version)
        (root / "resnet" / str(version)).parent.mkdir(parents=True, exist_ok=True)
        (root / "resnet" / str(version)).symlink_to(resnet_bundle, target_is_directory=True)
    return root


def test_the_repository_loads_the_latest_and_swaps_versions_through_the_admin_api(repository, fmnist_feeds) -> None:
    x = fmnist_feeds[:2]
    with live([], repository=repository) as (url, _):
        index = admin(url, "/v2/repository/index")[1]
        latest = labels_of(infer(url, "clf", x)[1])
        loaded = admin(url, "/v2/repository/models/clf/load", {"parameters": {"version": "1"}})
        older = infer(url, "clf", x)[1]
        missing = admin(url, "/v2/repository/models/clf/load", {"parameters": {"version": "7"}})
        unknown = admin(url, "/v2/repository/models/ghost/load")
        unloaded = admin(url, "/v2/repository/models/clf/unload")
        gone = infer(url, "clf", x)
        index_after = admin(url, "/v2/repository/index")[1]
    assert {(e["name"], e["version"], e["state"]) for e in index} == {
        ("clf", "1", "UNAVAILABLE"), ("clf", "2", "READY"), ("resnet", "1", "UNAVAILABLE"), ("resnet", "2", "READY")}
    assert latest.tolist() == [2, 2]
    assert loaded == (200, {"name": "clf", "version": "1", "state": "READY"})
    assert labels_of(older).tolist() == [1, 1] and older["model_version"] == "1"
    assert missing[0] == 404 and "no version '7'" in missing[1]["error"]
    assert unknown[0] == 404 and "not in the repository" in unknown[1]["error"]
    assert unloaded[0] == 200 and gone[0] == 404
    assert all(e["state"] == "UNAVAILABLE" for e in index_after if e["name"] == "clf")


def test_a_swap_under_concurrent_load_fails_no_request(repository, fmnist_feeds) -> None:
    """Clients keep sending to the bundle and to an application over the ONNX model while both are swapped to
    another version: every request is answered, by one version or the other."""
    x = fmnist_feeds[:1]
    body = json.dumps({"inputs": [{"name": "x", "shape": [1, 1, 28, 28], "datatype": "FP32",
                                   "data": x.ravel().tolist()}]})
    app = ApplicationSpec("over-clf", ("clf",), "exp4", slo_ms=5000)
    with live([], [app], repository=repository) as (url, _):

        async def traffic() -> tuple[list[tuple[int, str | None]], list[tuple[int, object]], list[int]]:
            async with aiohttp.ClientSession() as session:

                async def bundle() -> tuple[int, str | None]:
                    async with session.post(f"{url}/v2/models/resnet/infer", data=body) as response:
                        answer = await response.json()
                        return response.status, answer.get("model_version")

                async def application() -> tuple[int, object]:
                    async with session.post(f"{url}/over-clf/predict",
                                            data=json.dumps({"input": x[0].tolist()})) as response:
                        answer = await response.json()
                        return response.status, answer.get("output")

                async def swap(model: str) -> int:
                    await asyncio.sleep(0)  # let the first wave of requests in before the swap starts
                    async with session.post(f"{url}/v2/repository/models/{model}/load",
                                            json={"parameters": {"version": "1"}}) as response:
                        return response.status

                waves = []
                for _ in range(4):  # requests before, during and after the swaps
                    waves.append(asyncio.gather(*(bundle() for _ in range(40))))
                    waves.append(asyncio.gather(*(application() for _ in range(40))))
                swaps = asyncio.gather(swap("resnet"), swap("clf"))
                results = await asyncio.gather(*waves)
                swapped = await swaps
                after_bundle = await asyncio.gather(*(bundle() for _ in range(10)))
                after_app = await asyncio.gather(*(application() for _ in range(10)))
            bundle_answers = [a for wave in results[0::2] for a in wave] + list(after_bundle)
            app_answers = [a for wave in results[1::2] for a in wave] + list(after_app)
            return bundle_answers, app_answers, list(swapped)

        bundle_answers, app_answers, swapped = asyncio.run(traffic())
        stats = get_json(f"{url}/apps/over-clf")
    assert swapped == [200, 200]
    assert len(bundle_answers) == 170 and {status for status, _ in bundle_answers} == {200}
    assert {version for _, version in bundle_answers} <= {"1", "2"}
    assert [version for _, version in bundle_answers[-10:]] == ["1"] * 10  # after the swap: the new version
    assert len(app_answers) == 170 and {status for status, _ in app_answers} == {200}
    assert {output for _, output in app_answers} <= {1, 2} and [o for _, o in app_answers[-10:]] == [1] * 10
    assert stats["defaults"] == 0 and stats["models"]["clf"]["failed"] == 0


def test_a_model_update_pushed_to_the_stream_is_applied(repository, redis_url, redis_prefix, fmnist_feeds) -> None:
    x = fmnist_feeds[:1]
    with live([], repository=repository, store=redis_url, store_prefix=redis_prefix,
              update_stream=True) as (url, _):
        assert get_json(f"{url}/v2/models/clf")["versions"] == ["2"]
        asyncio.run(publish_update(redis_url, ModelUpdate("load", "clf", "1")))
        wait_for(lambda: get_json(f"{url}/v2/models/clf")["versions"] == ["1"], "version 1 of clf to be served")
        answered = labels_of(infer(url, "clf", x)[1])
        asyncio.run(publish_update(redis_url, ModelUpdate("unload", "clf")))
        wait_for(lambda: infer(url, "clf", x)[0] == 404, "clf to be unloaded")
        # the listener counts an update once it is applied: the unload can answer 404 a moment before
        wait_for(lambda: get_json(f"{url}/status")["updates"]["applied"] >= 2, "both updates to be counted")
        status = get_json(f"{url}/status")["updates"]
    assert answered.tolist() == [1]
    assert status["applied"] == 2 and status["failed"] == 0


def test_selection_state_and_applications_survive_a_server_restart(redis_url, redis_prefix, fmnist_feeds) -> None:
    x = fmnist_feeds

    def models() -> list[FunctionPredictor]:  # each server gets models of its own (a server closes its models)
        return [FunctionPredictor("right", constant(3, 0.8), (IMAGE,)),
                FunctionPredictor("wrong", constant(5, 0.8), (IMAGE,))]

    spec = {"name": "lasting", "models": ["right", "wrong"], "policy": "exp4", "slo_ms": 5000}
    with live(models(), store=redis_url, store_prefix=redis_prefix) as (url, _):
        assert admin(url, "/admin/apps", spec)[0] == 201
        for i in range(30):
            assert query(url, "lasting", x[i % len(x):i % len(x) + 1], path="update", label=3, uid="ann")[0] == 200
        before = get_json(f"{url}/apps/lasting?uid=ann")["weights"]
    with live(models(), store=redis_url, store_prefix=redis_prefix) as (url, _):
        after = get_json(f"{url}/apps/lasting?uid=ann")["weights"]
        default_context = get_json(f"{url}/apps/lasting")["weights"]
        status, answer = query(url, "lasting", x[:1], uid="ann")
    assert before["right"] > 0.9
    assert after == pytest.approx(before) and default_context == {"right": 0.5, "wrong": 0.5}
    assert status == 200 and answer["output"] == 3 and answer["confidence"] == pytest.approx(before["right"])


def test_a_lost_store_is_a_503_for_applications_and_models_go_on(private_redis, fmnist_feeds) -> None:
    x = fmnist_feeds[:1]
    models = [FunctionPredictor("m", constant(2, 0.9), (IMAGE,))]
    app = ApplicationSpec("needs-state", ("m",), "exp4", slo_ms=5000)
    with live(models, [app], store=private_redis.url) as (url, _):
        served = query(url, "needs-state", x)
        private_redis.stop()
        lost = query(url, "needs-state", x)
        model_status, answer = infer(url, "m", x)
        private_redis.start()
        back = query(url, "needs-state", x)
    assert served[0] == 200 and back[0] == 200
    assert lost[0] == 503 and "state store" in lost[1]["error"] and "unreachable" in lost[1]["error"]
    assert model_status == 200 and labels_of(answer).tolist() == [2]
