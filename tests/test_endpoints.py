"""The route handlers called as they are, with no HTTP server: each endpoint class bound to a started catalogue of
plain models."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import numpy as np
import orjson
import pytest
from fastapi import Request, Response

from rampserve.serving.frontend.app import ServerState
from rampserve.serving.frontend.endpoints.admin import AdminToken
from rampserve.serving.frontend.endpoints.applications import ApplicationEndpoints
from rampserve.serving.frontend.endpoints.observability import ObservabilityEndpoints
from rampserve.serving.frontend.endpoints.repository import RepositoryEndpoints
from rampserve.serving.frontend.endpoints.v2 import InferRoute, V2Endpoints
from rampserve.serving.frontend.plane import DataPlane
from rampserve.serving.frontend.repository.catalogue import CatalogueError
from rampserve.serving.frontend.repository.predictors import FunctionPredictor
from rampserve.serving.server import ServerSettings, build_state
from rampserve.serving.shared.protocol import ProtocolError, TensorSpec
from rampserve.serving.shared.settings import ModelSettings

MODEL = "positive"
ROW = TensorSpec("x", "FP32", (-1, 3))
LIMIT = 1 << 20


def is_positive(feeds: dict[str, np.ndarray]) -> np.ndarray:
    return (feeds["x"].sum(axis=1) > 0).astype(np.int64)


class Restarting(FunctionPredictor):
    """A model served but not available now, as a bundle is while its executor process restarts."""

    available = False


@contextlib.asynccontextmanager
async def started(*more: FunctionPredictor) -> AsyncIterator[tuple[ServerState, DataPlane]]:
    state = build_state([FunctionPredictor(MODEL, is_positive, (ROW,)), *more], ModelSettings(vanilla=True),
                        ServerSettings(port=0, grpc=False))
    await state.catalogue.start()
    try:
        yield state, DataPlane(state.catalogue, state.metrics, state.cache)
    finally:
        await state.catalogue.close()
        await state.catalogue.store.close()


def request(body: object = None, headers: dict[str, str] | None = None, **path_params: str) -> Request:
    """A request as Starlette hands it to a handler, its JSON body sent in one piece."""
    raw = b"" if body is None else orjson.dumps(body)
    sent = False

    async def receive() -> dict:
        nonlocal sent
        if sent:  # past the body, the client is only ever heard from again when it leaves
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": raw, "more_body": False}

    scope = {"type": "http", "method": "POST", "path": "/", "query_string": b"", "path_params": path_params,
             "headers": [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]}
    return Request(scope, receive)


def decoded(response: Response) -> tuple[int, object]:
    return response.status_code, orjson.loads(response.body)


def test_status_comes_from_each_model_itself() -> None:
    async def scenario() -> tuple:
        async with started() as (state, plane):
            observability = ObservabilityEndpoints(plane, state.is_ready, None)
            overall = decoded(await observability.status())
            one = decoded(await observability.model_status(MODEL))
            with pytest.raises(ProtocolError) as unknown:
                await observability.model_status("ghost")
            return overall, one, unknown.value

    (status, overall), (one_status, one), unknown = asyncio.run(scenario())
    described = {"name": MODEL, "version": "1", "kind": "python", "inputs": [ROW.to_json()]}
    assert status == 200 and overall["ready"] is False and overall["updates"] is None
    # A plain model has no executor of its own: it is listed with what it is, beside no bundle
    assert overall["models"] == {} and overall["other_models"] == {MODEL: described}
    assert (one_status, one) == (200, described)
    assert unknown.status == 404 and "unknown model 'ghost'" in unknown.message


def test_readiness_is_read_when_asked() -> None:
    """A model is ready once the server is, and while it is available: a model not available now (a bundle whose
    executor restarts) is not ready, though the server and its other models are."""
    async def scenario() -> tuple:
        async with started(Restarting("restarting", is_positive, (ROW,))) as (state, plane):
            v2 = V2Endpoints(plane, state.is_ready, LIMIT)
            before = decoded(await v2.ready()), decoded(await v2.model_ready(MODEL))
            state.ready = True
            after = decoded(await v2.ready()), decoded(await v2.model_ready(MODEL))
            restarting = decoded(await v2.model_ready("restarting"))
            with pytest.raises(ProtocolError) as unknown:
                await v2.model_ready("ghost")
            return before, after, restarting, unknown.value

    before, after, (restarting_status, restarting), unknown = asyncio.run(scenario())
    assert before == ((503, {"error": "models are still loading"}), (503, {"error": "model is loading"}))
    assert after == ((200, {"ready": True}), (200, {"name": MODEL, "ready": True}))
    assert restarting_status == 503 and "restarting" in restarting["error"]
    assert unknown.status == 404


def test_infer_answers_a_body_and_refuses_one_past_the_limit() -> None:
    body = {"inputs": [{"name": "x", "shape": [2, 3], "datatype": "FP32", "data": [1, 2, 3, -1, -2, -3]}]}

    async def scenario() -> tuple:
        async with started() as (state, plane):
            v2 = V2Endpoints(plane, state.is_ready, len(orjson.dumps(body)))
            answered = await v2.infer(MODEL, None, [], request(body).receive)
            refused = await v2.infer(MODEL, None, [], request({**body, "id": "longer"}).receive)
            return answered, refused

    answered, refused = asyncio.run(scenario())
    assert answered.status == 200 and orjson.loads(answered.body)["outputs"][0]["data"] == [1, 0]
    assert refused.status == 413 and "exceeds the limit" in orjson.loads(refused.body)["error"]


def test_the_infer_route_answers_its_path_ahead_of_the_app_and_hands_on_every_other() -> None:
    """`InferRoute` as ASGI calls it: a POST to a model's infer path (with or without a version) is answered with
    its length; another method there is refused with 405; any other path, and the lifespan, reach the app."""
    body = {"inputs": [{"name": "x", "shape": [1, 3], "datatype": "FP32", "data": [1, 2, 3]}]}
    handed_on: list[str] = []

    async def app(scope, _receive, _send) -> None:
        handed_on.append(scope["path"] if scope["type"] == "http" else scope["type"])

    async def call(route: InferRoute, method: str, path: str) -> list[dict]:
        sent: list[dict] = []

        async def send(message: dict) -> None:
            sent.append(message)

        await route({"type": "http", "method": method, "path": path, "headers": []}, request(body).receive, send)
        return sent

    async def scenario() -> tuple:
        async with started() as (state, plane):
            route = InferRoute(app, V2Endpoints(plane, state.is_ready, LIMIT))
            answers = [await call(route, "POST", f"/v2/models/{MODEL}/infer"),
                       await call(route, "POST", f"/v2/models/{MODEL}/versions/1/infer"),
                       await call(route, "POST", f"/v2/models/{MODEL}/versions/9/infer"),
                       await call(route, "GET", f"/v2/models/{MODEL}/infer")]
            others = [await call(route, "POST", "/v2/models/a/b/infer"), await call(route, "GET", "/v2")]
            await route({"type": "lifespan"}, request().receive, None)
            return answers, others

    answers, others = asyncio.run(scenario())
    statuses = [start["status"] for start, _ in answers]
    assert statuses == [200, 200, 404, 405]
    for start, message in answers:
        headers = dict(start["headers"])
        assert headers[b"content-length"] == str(len(message["body"])).encode()
        assert headers[b"content-type"] == b"application/json"
    assert orjson.loads(answers[0][1]["body"])["outputs"][0]["data"] == [1]
    assert "no version '9'" in orjson.loads(answers[2][1]["body"])["error"]
    assert dict(answers[3][0]["headers"])[b"allow"] == b"POST"
    assert others == [[], []] and handed_on == ["/v2/models/a/b/infer", "/v2", "lifespan"]


def test_applications_are_registered_and_queried_through_their_endpoints() -> None:
    async def scenario() -> tuple:
        async with started() as (state, _plane):
            applications = ApplicationEndpoints(state.catalogue, LIMIT)
            registered = decoded(await applications.register(request({"name": "sign", "models": [MODEL]})))
            answered = decoded(await applications.predict("sign", request({"input": [-1.0, -1.0, 0.5]})))
            with pytest.raises(ProtocolError) as bad_label:
                await applications.update("sign", request({"input": [1.0, 1.0, 1.0], "label": -1}))
            with pytest.raises(CatalogueError) as unknown:
                await applications.predict("ghost", request({"input": [1.0, 1.0, 1.0]}))
            return registered, answered, bad_label.value, unknown.value

    (created, spec), (status, answer), bad_label, unknown = asyncio.run(scenario())
    assert created == 201 and spec["spec"]["models"] == [MODEL]
    assert status == 200 and answer["output"] == 0 and answer["models"] == [MODEL]
    assert bad_label.status == 400 and "non-negative integer" in bad_label.message
    assert unknown.status == 404


def test_the_repository_endpoints_without_a_repository() -> None:
    async def scenario() -> tuple:
        async with started() as (state, _plane):
            repository = RepositoryEndpoints(state.catalogue, LIMIT)
            index = decoded(await repository.index())
            with pytest.raises(CatalogueError) as no_repository:
                await repository.load(MODEL, request({"parameters": {"version": "2"}}))
            with pytest.raises(ProtocolError) as bad_version:
                await repository.load(MODEL, request({"parameters": {"version": [2]}}))
            unloaded = decoded(await repository.unload(MODEL))
            return index, no_repository.value, bad_version.value, unloaded, dict(state.catalogue.models)

    index, no_repository, bad_version, unloaded, models = asyncio.run(scenario())
    assert index == (200, [{"name": MODEL, "version": "1", "state": "READY", "reason": ""}])
    assert no_repository.status == 404 and "--repository" in no_repository.message
    assert bad_version.status == 400 and "parameters.version" in bad_version.message
    assert unloaded == (200, {"name": MODEL, "state": "UNAVAILABLE"}) and models == {}


@pytest.mark.parametrize(("header", "status"), [
    (None, 401), ("Basic s3cret", 401), ("Bearer ", 401), ("Bearer guess", 403), ("Bearer s3cret!", 403)])
def test_an_admin_request_without_the_token_is_refused(header: str | None, status: int) -> None:
    with pytest.raises(ProtocolError) as refused:
        asyncio.run(AdminToken("s3cret")(request(headers={} if header is None else {"Authorization": header})))
    assert refused.value.status == status


@pytest.mark.parametrize(("token", "header"), [("s3cret", "Bearer s3cret"), ("s3cret", "bearer s3cret"),
                                               (None, None)])
def test_an_admin_request_with_the_token_or_to_an_open_server_passes(token: str | None, header: str | None) -> None:
    headers = {} if header is None else {"Authorization": header}
    assert asyncio.run(AdminToken(token)(request(headers=headers))) is None
