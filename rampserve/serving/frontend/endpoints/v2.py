"""The Open Inference Protocol v2 over HTTP: health, server and model metadata, and inference (JSON, or Triton's
binary-data extension), every request answered by the data plane."""

from __future__ import annotations

import re
import time
from collections.abc import Callable

from fastapi import Response
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Receive, Scope, Send

import rampserve
from rampserve.serving.frontend.endpoints.messages import binary_header_length, error, json_response, receive_body
from rampserve.serving.frontend.plane import JSON, DataPlane, InferResult, error_body
from rampserve.serving.shared.protocol import ProtocolError, server_metadata

# The v2 infer path, with or without a version (`InferRoute`)
INFER_PATH = re.compile(r"/v2/models/(?P<model>[^/]+)(?:/versions/(?P<version>[^/]+))?/infer")
HEADER_LENGTH = b"inference-header-content-length"  # as ASGI gives header names: lower case


class V2Endpoints:
    """`is_ready` says whether the server has started its models (a model is ready once the server is, and while it
    serves: not while its executor process restarts)."""

    def __init__(self, plane: DataPlane, is_ready: Callable[[], bool], max_body_bytes: int) -> None:
        self.plane, self.is_ready, self.max_body_bytes = plane, is_ready, max_body_bytes

    async def live(self) -> Response:
        return json_response({"live": True})

    async def ready(self) -> Response:
        return json_response({"ready": True}) if self.is_ready() else error(503, "models are still loading")

    async def metadata(self) -> Response:
        return json_response(server_metadata("rampserve", rampserve.__version__, ["binary_tensor_data"]))

    async def model_metadata(self, model: str, version: str | None = None) -> Response:
        return json_response(self.plane.metadata(model, version))

    async def model_ready(self, model: str, version: str | None = None) -> Response:
        available = self.plane.model_ready(model, version)  # 404 where not served
        if not self.is_ready():
            return error(503, "model is loading")
        if not available:
            return error(503, f"model {model} is not available: its executor process is restarting")
        return json_response({"name": model, "ready": True})

    async def infer(self, model: str, version: str | None, headers: list[tuple[bytes, bytes]],
                    receive: Receive) -> InferResult:
        """An inference request as ASGI hands it over (`InferRoute`): its headers and its body still to be read.
        Raises `ClientDisconnect` if the client leaves before its body is in."""
        arrived = time.monotonic()
        try:
            body = await receive_body(receive, self.max_body_bytes)
            length = next((value.decode("latin-1") for name, value in headers if name == HEADER_LENGTH), None)
            header_length = binary_header_length(length)
        except ProtocolError as exc:
            return self.plane.refused(model, exc)
        return await self.plane.infer(model, version, body, header_length, arrived)


class InferRoute:
    """The v2 infer route as bare ASGI, ahead of FastAPI's exception handling and router (a Starlette middleware:
    inside the error middleware, which still answers 500 for whatever escapes). Inference is on every request's
    path, and the framework's routing with Starlette's request and response objects doubled an echo's round trip
    (`bench executor`'s HTTP cores: 0.073-0.078 ms on FastAPI's route, 0.036-0.045 ms as a bare ASGI callable, on
    this 2-core machine). Every other path goes on to the app."""

    def __init__(self, app: ASGIApp, v2: V2Endpoints) -> None:
        self.app, self.v2 = app, v2

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = INFER_PATH.fullmatch(scope["path"]) if scope["type"] == "http" else None
        if route is None:
            await self.app(scope, receive, send)
            return
        if scope["method"] != "POST":
            result = InferResult(405, error_body("Method Not Allowed: inference takes POST"),
                                 {"Allow": "POST", "Content-Type": JSON}, "invalid")
        else:
            try:
                result = await self.v2.infer(route["model"], route["version"], scope["headers"], receive)
            except ClientDisconnect:  # nobody to answer
                return
        headers = [(name.lower().encode("latin-1"), value.encode("latin-1")) for name, value in result.headers.items()]
        headers.append((b"content-length", str(len(result.body)).encode()))
        await send({"type": "http.response.start", "status": result.status, "headers": headers})
        await send({"type": "http.response.body", "body": result.body})
