"""The Open Inference Protocol v2 over HTTP: health, server and model metadata, and inference (JSON, or Triton's
binary-data extension), every request answered by the data plane."""

from __future__ import annotations

import time
from collections.abc import Callable

from fastapi import Request, Response

import rampserve
from rampserve.serving.endpoints.messages import (
    HEADER_LENGTH,
    binary_header_length,
    error,
    http_response,
    json_response,
    read_body,
)
from rampserve.serving.plane import DataPlane
from rampserve.serving.protocol import ProtocolError, server_metadata


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

    async def infer(self, request: Request) -> Response:
        """A plain Starlette handler (the request alone): FastAPI's parameter resolution adds nothing the hot
        path needs."""
        arrived = time.monotonic()
        model, version = request.path_params["model"], request.path_params.get("version")
        try:
            body = await read_body(request, self.max_body_bytes)
            header_length = binary_header_length(request.headers.get(HEADER_LENGTH))
        except ProtocolError as exc:
            return http_response(self.plane.refused(model, exc))
        return http_response(await self.plane.infer(model, version, body, header_length, arrived))
