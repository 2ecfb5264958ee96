"""The HTTP face of the server: the Open Inference Protocol v2 (with Triton's binary-data extension) for models
and applications, Clipper's application interface (`/{app}/predict`, `/{app}/update`), the admin API
(applications, and Triton's model repository extension; token-protected when the server is not on loopback),
Prometheus metrics and a JSON status."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import orjson
from fastapi import APIRouter, Depends, FastAPI, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

import rampserve
from rampserve.serving.apps.applications import Application, ApplicationSpec, context_of, parse_query_input
from rampserve.serving.repository.catalogue import Catalogue, CatalogueError
from rampserve.serving.repository.predictors import WorkerPredictor
from rampserve.serving.apps.state_store import StoreError
from rampserve.serving.apps.update_stream import UpdateListener
from rampserve.serving.cache import PredictionCache
from rampserve.serving.dashboard import DashboardSampler, dashboard_router
from rampserve.serving.metrics import MergedRegistry, ServerMetrics, watch_loop_lag
from rampserve.serving.plane import DataPlane, InferResult, error_body
from rampserve.serving.protocol import ProtocolError, server_metadata
from rampserve.serving.worker import Worker

if TYPE_CHECKING:
    from rampserve.serving.grpc_server import GrpcFrontEnd

HEADER_LENGTH = "inference-header-content-length"


@dataclass
class ServerState:
    catalogue: Catalogue
    metrics: ServerMetrics
    max_body_bytes: int = 64 << 20
    cache_bytes: int = 0  # prediction cache per model (see `Predictor.cacheable`); 0: off
    caches: dict[str, PredictionCache] = field(default_factory=dict)
    admin_token: str | None = None  # None: admin endpoints are open (only allowed on loopback)
    listener: UpdateListener | None = None  # model updates from a Redis Stream
    grpc: GrpcFrontEnd | None = None  # KServe v2 over gRPC beside HTTP, same models and data plane
    dashboard: bool = True  # sample the models once a second for /dashboard
    ready: bool = False

    @property
    def workers(self) -> dict[str, Worker]:
        return self.catalogue.workers

    def cache(self, model: str) -> PredictionCache | None:
        if not self.cache_bytes:
            return None
        if model not in self.caches:
            self.caches[model] = PredictionCache(self.cache_bytes)
        return self.caches[model]


def error(status: int, message: str, headers: dict[str, str] | None = None) -> Response:
    return Response(error_body(message), status, headers, media_type="application/json")


def json_response(data: object, status: int = 200) -> Response:
    return Response(orjson.dumps(data, option=orjson.OPT_SERIALIZE_NUMPY), status, media_type="application/json")


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused with 413 past `limit` bytes. The rest of a refused body is read and dropped (memory
    stays bounded): a client still sending would otherwise fail on a closed connection, never seeing the 413."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size <= limit:
            chunks.append(chunk)
        elif chunks:
            chunks.clear()
    if size > limit:
        raise ProtocolError(f"request body of {size} bytes exceeds the limit of {limit} bytes", 413)
    return b"".join(chunks)


def binary_header_length(value: str | None) -> int | None:
    """The Inference-Header-Content-Length header as a byte count (None: absent, the body is JSON only)."""
    if value is not None and not value.strip().isdigit():
        raise ProtocolError(f"header Inference-Header-Content-Length must be a byte count, got {value!r}")
    return None if value is None else int(value)


def http_response(result: InferResult) -> Response:
    return Response(result.body, result.status, result.headers)


def create_app(state: ServerState) -> FastAPI:
    catalogue = state.catalogue
    sampler = DashboardSampler(catalogue, state.metrics) if state.dashboard else None

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        if state.grpc is not None:  # a port already taken fails the start before any model is loaded
            state.grpc.bind(plane, lambda: state.ready)
        await catalogue.start()
        if state.listener is not None:
            await state.listener.start()
        # Watched from here on: uvicorn accepts no connection until this returns, so a loop busy loading models
        # keeps no request waiting.
        lag_watch = asyncio.create_task(watch_loop_lag(state.metrics), name="event-loop lag")
        if state.grpc is not None:
            await state.grpc.start()
        if sampler is not None:
            sampler.start()
        state.ready = True
        yield
        # uvicorn has stopped accepting and waited for the requests in flight, gRPC does the same; the models
        # answer whatever is still queued before they stop.
        state.ready = False
        if state.grpc is not None:
            await state.grpc.stop()
        lag_watch.cancel()
        await asyncio.wait([lag_watch])
        if sampler is not None:
            await sampler.stop()
        if state.listener is not None:
            await state.listener.stop()
        await catalogue.close()
        await catalogue.store.close()

    app = FastAPI(title="rampserve", version=rampserve.__version__, lifespan=lifespan)
    metrics = state.metrics

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, exc: StarletteHTTPException) -> Response:
        return error(exc.status_code, str(exc.detail))

    @app.exception_handler(ProtocolError)
    async def protocol_error(_request: Request, exc: ProtocolError) -> Response:
        return error(exc.status, exc.message)

    @app.exception_handler(CatalogueError)
    async def catalogue_error(_request: Request, exc: CatalogueError) -> Response:
        return error(exc.status, exc.message)

    @app.exception_handler(StoreError)
    async def store_error(_request: Request, exc: StoreError) -> Response:
        return error(503, f"the state store is unavailable: {exc}")

    plane = DataPlane(catalogue, metrics, state.cache)

    @app.get("/v2/health/live")
    async def live() -> Response:
        return json_response({"live": True})

    @app.get("/v2/health/ready")
    async def ready() -> Response:
        return json_response({"ready": True}) if state.ready else error(503, "models are still loading")

    @app.get("/v2")
    async def server() -> Response:
        return json_response(server_metadata("rampserve", rampserve.__version__, ["binary_tensor_data"]))

    @app.get("/v2/models/{model}")
    @app.get("/v2/models/{model}/versions/{version}")
    async def metadata(model: str, version: str | None = None) -> Response:
        return json_response(plane.metadata(model, version))

    @app.get("/v2/models/{model}/ready")
    @app.get("/v2/models/{model}/versions/{version}/ready")
    async def model_ready(model: str, version: str | None = None) -> Response:
        plane.metadata(model, version)  # served, and with a signature (an application's models may all be gone)
        return json_response({"name": model, "ready": True}) if state.ready else error(503, "model is loading")

    async def infer(request: Request) -> Response:
        arrived = time.perf_counter()
        model, version = request.path_params["model"], request.path_params.get("version")
        try:
            body = await read_body(request, state.max_body_bytes)
            header_length = binary_header_length(request.headers.get(HEADER_LENGTH))
        except ProtocolError as exc:
            return http_response(plane.refused(model, exc))
        return http_response(await plane.infer(model, version, body, header_length, arrived))

    # The hot path is a plain Starlette route: FastAPI's parameter resolution adds nothing the handler needs.
    app.add_route("/v2/models/{model}/infer", infer, methods=["POST"])
    app.add_route("/v2/models/{model}/versions/{version}/infer", infer, methods=["POST"])

    # ---- applications (Clipper's query interface) ---------------------------------------------------------

    async def json_body(request: Request) -> dict:
        raw = await read_body(request, state.max_body_bytes)
        try:
            body = orjson.loads(raw) if raw else {}
        except orjson.JSONDecodeError as exc:
            raise ProtocolError(f"request body is not valid JSON: {exc}") from None
        if not isinstance(body, dict):
            raise ProtocolError("request body must be a JSON object")
        return body

    def query_parts(app_: Application, body: dict) -> tuple[dict[str, np.ndarray], str]:
        if "input" not in body:
            raise ProtocolError("request body needs 'input'")
        return parse_query_input(body["input"], app_.signature()), context_of(body.get("uid"))

    @app.post("/{app_name}/predict")
    async def predict(app_name: str, request: Request) -> Response:
        app_ = catalogue.app(app_name)
        inputs, context = query_parts(app_, await json_body(request))
        return json_response((await app_.predict(inputs, context)).to_json())

    @app.post("/{app_name}/update")
    async def update(app_name: str, request: Request) -> Response:
        app_ = catalogue.app(app_name)
        body = await json_body(request)
        inputs, context = query_parts(app_, body)
        label = body.get("label")
        if isinstance(label, bool) or not isinstance(label, int) or label < 0:
            raise ProtocolError(f"'label' must be a non-negative integer class, got {label!r}")
        return json_response(await app_.update(inputs, label, context))

    @app.get("/apps")
    async def applications() -> Response:
        return json_response({name: a.status() for name, a in catalogue.apps.items()})

    @app.get("/apps/{app_name}")
    async def application(app_name: str, uid: str | None = None) -> Response:
        app_ = catalogue.app(app_name)
        return json_response({**app_.status(), "weights": await app_.weights(context_of(uid))})

    # ---- administration: applications and the model repository (Triton's repository extension) -----------

    def require_admin(request: Request) -> None:
        if state.admin_token is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise ProtocolError("this endpoint needs the admin token: send 'Authorization: Bearer <token>'", 401)
        if not hmac.compare_digest(token.encode(), state.admin_token.encode()):
            raise ProtocolError("the admin token is wrong", 403)

    admin = APIRouter(dependencies=[Depends(require_admin)])

    @admin.post("/admin/apps")
    async def register_app(request: Request) -> Response:
        try:
            spec = ApplicationSpec.from_json(await json_body(request))
        except (ValueError, TypeError) as exc:
            raise ProtocolError(str(exc)) from None
        app_ = await catalogue.register(spec)
        return json_response(app_.status(), 201)

    @admin.post("/admin/apps/{app_name}/models")
    async def link_models(app_name: str, request: Request) -> Response:
        models = (await json_body(request)).get("models")
        if not isinstance(models, list) or not models or not all(isinstance(m, str) for m in models):
            raise ProtocolError("'models' must be a non-empty list of model names")
        return json_response((await catalogue.link(app_name, models)).status())

    @admin.delete("/admin/apps/{app_name}")
    async def remove_app(app_name: str) -> Response:
        await catalogue.remove(app_name)
        return json_response({"removed": app_name})

    @admin.post("/v2/repository/index")
    async def repository_index() -> Response:
        return json_response(catalogue.index())

    @admin.post("/v2/repository/models/{model}/load")
    async def load_model(model: str, request: Request) -> Response:
        parameters = (await json_body(request)).get("parameters") or {}
        version = parameters.get("version") if isinstance(parameters, dict) else None
        if version is not None and not isinstance(version, str | int):
            raise ProtocolError(f"parameters.version must be a version name, got {version!r}")
        predictor = await catalogue.load(model, None if version is None else str(version))
        return json_response({"name": model, "version": predictor.version, "state": "READY"})

    @admin.post("/v2/repository/models/{model}/unload")
    async def unload_model(model: str) -> Response:
        await catalogue.unload(model)
        return json_response({"name": model, "state": "UNAVAILABLE"})

    app.include_router(admin)
    app.include_router(dashboard_router(sampler))

    # ---- observability ------------------------------------------------------------------------------------

    @app.get("/metrics")
    async def prometheus() -> Response:
        # Executor processes keep their models' metrics; they are merged into this server's, family by family
        elsewhere = await asyncio.gather(*(w.exported_metrics() for w in list(state.workers.values())))
        merged = MergedRegistry(metrics.registry, [f for families in elsewhere for f in families])
        return Response(generate_latest(merged), media_type=CONTENT_TYPE_LATEST)

    @app.get("/status")
    async def status() -> Response:
        workers = dict(state.workers)
        statuses = await asyncio.gather(*(w.current_status() for w in workers.values()))
        return json_response({
            "ready": state.ready,
            "process": os.getpid(),  # which replica answered, where several serve one address
            "models": dict(zip(workers, statuses)),
            "other_models": {n: p.describe() for n, p in catalogue.models.items() if n not in state.workers},
            "applications": sorted(catalogue.apps),
            "store": catalogue.store.description,
            "updates": None if state.listener is None else state.listener.status(),
            "event_loop": metrics.loop_lag.to_json(),
        })

    @app.get("/status/{model}")
    async def model_status(model: str) -> Response:
        predictor = plane.model(model)
        return json_response(await predictor.worker.current_status() if isinstance(predictor, WorkerPredictor)
                             else predictor.describe())

    return app

