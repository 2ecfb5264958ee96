"""Request bodies in, responses out, for every route: JSON bodies refused past the server's size limit, JSON
answers, and `{"error": message}` with its status for whatever a handler refuses."""

from __future__ import annotations

import orjson
from fastapi import Request, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import Receive

from rampserve.serving.frontend.apps.state_store import StoreError
from rampserve.serving.frontend.plane import error_body
from rampserve.serving.frontend.repository.catalogue import CatalogueError
from rampserve.serving.shared.protocol import ProtocolError


def error(status: int, message: str, headers: dict[str, str] | None = None) -> Response:
    return Response(error_body(message), status, headers, media_type="application/json")


def json_response(data: object, status: int = 200) -> Response:
    return Response(orjson.dumps(data, option=orjson.OPT_SERIALIZE_NUMPY), status, media_type="application/json")


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused with 413 past `limit` bytes (`receive_body`)."""
    return await receive_body(request.receive, limit)


async def receive_body(receive: Receive, limit: int) -> bytes:
    """The body of an ASGI request, refused with 413 past `limit` bytes. The rest of a refused body is read and
    dropped (memory stays bounded): a client still sending would otherwise fail on a closed connection, never
    seeing the 413. Raises `ClientDisconnect` if the client leaves first."""
    chunks, size, more = [], 0, True
    while more:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnect()
        chunk, more = message.get("body", b""), message.get("more_body", False)
        size += len(chunk)
        if size <= limit:
            chunks.append(chunk)
        elif chunks:
            chunks.clear()
    if size > limit:
        raise ProtocolError(f"request body of {size} bytes exceeds the limit of {limit} bytes", 413)
    return b"".join(chunks)


async def json_body(request: Request, limit: int) -> dict:
    """The body as a JSON object (an empty body is an empty one)."""
    raw = await read_body(request, limit)
    try:
        body = orjson.loads(raw) if raw else {}
    except orjson.JSONDecodeError as exc:
        raise ProtocolError(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ProtocolError("request body must be a JSON object")
    return body


def binary_header_length(value: str | None) -> int | None:
    """The Inference-Header-Content-Length header as a byte count (None: absent, the body is JSON only)."""
    if value is not None and not value.strip().isdigit():
        raise ProtocolError(f"header Inference-Header-Content-Length must be a byte count, got {value!r}")
    return None if value is None else int(value)


async def http_error(_request: Request, exc: StarletteHTTPException) -> Response:
    return error(exc.status_code, str(exc.detail))


async def refused(_request: Request, exc: ProtocolError | CatalogueError) -> Response:
    return error(exc.status, exc.message)


async def store_error(_request: Request, exc: StoreError) -> Response:
    return error(503, f"the state store is unavailable: {exc}")


# FastAPI's exception handlers: every refusal, Starlette's own (404 for no route, 405) among them, answers as
# the v2 protocol does
ERROR_HANDLERS = {StarletteHTTPException: http_error, ProtocolError: refused, CatalogueError: refused,
                  StoreError: store_error}
