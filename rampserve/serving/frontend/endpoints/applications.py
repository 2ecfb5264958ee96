"""Clipper's application interface (`/{app}/predict`, `/{app}/update`), the applications' state, and their
administration (register, link models, remove)."""

from __future__ import annotations

import numpy as np
from fastapi import Request, Response

from rampserve.serving.frontend.apps.applications import Application, ApplicationSpec, context_of, parse_query_input
from rampserve.serving.frontend.endpoints.messages import json_body, json_response
from rampserve.serving.frontend.repository.catalogue import Catalogue
from rampserve.serving.shared.protocol import ProtocolError


def query_parts(app: Application, body: dict) -> tuple[dict[str, np.ndarray], str]:
    """A query's inputs, checked against the application's signature, and its context (the uid's)."""
    if "input" not in body:
        raise ProtocolError("request body needs 'input'")
    return parse_query_input(body["input"], app.signature()), context_of(body.get("uid"))


class ApplicationEndpoints:
    def __init__(self, catalogue: Catalogue, max_body_bytes: int) -> None:
        self.catalogue, self.max_body_bytes = catalogue, max_body_bytes

    async def predict(self, app_name: str, request: Request) -> Response:
        app = self.catalogue.app(app_name)
        inputs, context = query_parts(app, await json_body(request, self.max_body_bytes))
        return json_response((await app.predict(inputs, context)).to_json())

    async def update(self, app_name: str, request: Request) -> Response:
        app = self.catalogue.app(app_name)
        body = await json_body(request, self.max_body_bytes)
        inputs, context = query_parts(app, body)
        label = body.get("label")
        if isinstance(label, bool) or not isinstance(label, int) or label < 0:
            raise ProtocolError(f"'label' must be a non-negative integer class, got {label!r}")
        return json_response(await app.update(inputs, label, context))

    async def applications(self) -> Response:
        return json_response({name: app.status() for name, app in self.catalogue.apps.items()})

    async def application(self, app_name: str, uid: str | None = None) -> Response:
        app = self.catalogue.app(app_name)
        return json_response({**app.status(), "weights": await app.weights(context_of(uid))})

    # ---- administration ------------------------------------------------------------------------------------

    async def register(self, request: Request) -> Response:
        try:
            spec = ApplicationSpec.from_json(await json_body(request, self.max_body_bytes))
        except (ValueError, TypeError) as exc:
            raise ProtocolError(str(exc)) from None
        app = await self.catalogue.register(spec)
        return json_response(app.status(), 201)

    async def link(self, app_name: str, request: Request) -> Response:
        models = (await json_body(request, self.max_body_bytes)).get("models")
        if not isinstance(models, list) or not models or not all(isinstance(m, str) for m in models):
            raise ProtocolError("'models' must be a non-empty list of model names")
        return json_response((await self.catalogue.link(app_name, models)).status())

    async def remove(self, app_name: str) -> Response:
        await self.catalogue.remove(app_name)
        return json_response({"removed": app_name})
