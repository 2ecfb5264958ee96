"""Triton's model repository extension: the repository's index, and loading (or swapping to) a version of a model
and unloading it."""

from __future__ import annotations

from fastapi import Request, Response

from rampserve.serving.frontend.endpoints.messages import json_body, json_response
from rampserve.serving.frontend.repository.catalogue import Catalogue
from rampserve.serving.shared.protocol import ProtocolError


class RepositoryEndpoints:
    def __init__(self, catalogue: Catalogue, max_body_bytes: int) -> None:
        self.catalogue, self.max_body_bytes = catalogue, max_body_bytes

    async def index(self) -> Response:
        return json_response(self.catalogue.index())

    async def load(self, model: str, request: Request) -> Response:
        parameters = (await json_body(request, self.max_body_bytes)).get("parameters") or {}
        version = parameters.get("version") if isinstance(parameters, dict) else None
        if version is not None and not isinstance(version, str | int):
            raise ProtocolError(f"parameters.version must be a version name, got {version!r}")
        predictor = await self.catalogue.load(model, None if version is None else str(version))
        return json_response({"name": model, "version": predictor.version, "state": "READY"})

    async def unload(self, model: str) -> Response:
        await self.catalogue.unload(model)
        return json_response({"name": model, "state": "UNAVAILABLE"})
