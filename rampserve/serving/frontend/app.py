"""The HTTP server as an app: the server's state, what runs beside the routes while it serves (models, the gRPC
front end, the update stream, the dashboard's sampler), and the routes themselves (`endpoints`): the Open Inference
Protocol v2 (with Triton's binary-data extension) for models and applications, Clipper's application interface
(`/{app}/predict`, `/{app}/update`), the admin API (applications, and Triton's model repository extension;
token-protected when the server is not on loopback), Prometheus metrics and a JSON status."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fastapi import FastAPI

import rampserve
from rampserve.serving.frontend.apps.update_stream import UpdateListener
from rampserve.serving.frontend.cache import PredictionCache
from rampserve.serving.frontend.dashboard import DashboardEndpoints, DashboardSampler
from rampserve.serving.frontend.endpoints.admin import AdminToken
from rampserve.serving.frontend.endpoints.applications import ApplicationEndpoints
from rampserve.serving.frontend.endpoints.messages import ERROR_HANDLERS
from rampserve.serving.frontend.endpoints.observability import ObservabilityEndpoints
from rampserve.serving.frontend.endpoints.repository import RepositoryEndpoints
from rampserve.serving.frontend.endpoints.routes import Endpoints, register_endpoints
from rampserve.serving.frontend.endpoints.v2 import V2Endpoints
from rampserve.serving.frontend.plane import DataPlane
from rampserve.serving.frontend.repository.catalogue import Catalogue
from rampserve.serving.shared.contract import Worker
from rampserve.serving.shared.metrics import ServerMetrics, watch_loop_lag

if TYPE_CHECKING:
    from rampserve.serving.frontend.grpc_server import GrpcFrontEnd


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

    def is_ready(self) -> bool:
        """Read by the routes and gRPC when asked: the lifespan sets `ready` once the models are started."""
        return self.ready

    def cache(self, model: str) -> PredictionCache | None:
        if not self.cache_bytes:
            return None
        if model not in self.caches:
            self.caches[model] = PredictionCache(self.cache_bytes)
        return self.caches[model]


@contextlib.asynccontextmanager
async def serving(state: ServerState, plane: DataPlane, sampler: DashboardSampler | None) -> AsyncIterator[None]:
    """The server's lifespan: everything beside the routes starts before the first request and stops after the
    last."""
    catalogue = state.catalogue
    if state.grpc is not None:  # a port already taken fails the start before any model is loaded
        state.grpc.bind(plane, state.is_ready)
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


def create_app(state: ServerState) -> FastAPI:
    catalogue = state.catalogue
    plane = DataPlane(catalogue, state.metrics, state.cache)
    sampler = DashboardSampler(catalogue, state.metrics) if state.dashboard else None
    app = FastAPI(title="rampserve", version=rampserve.__version__, exception_handlers=ERROR_HANDLERS,
                  lifespan=lambda _app: serving(state, plane, sampler))
    register_endpoints(app, Endpoints(
        v2=V2Endpoints(plane, state.is_ready, state.max_body_bytes),
        applications=ApplicationEndpoints(catalogue, state.max_body_bytes),
        repository=RepositoryEndpoints(catalogue, state.max_body_bytes),
        observability=ObservabilityEndpoints(plane, state.is_ready, state.listener),
        dashboard=DashboardEndpoints(sampler),
        admin=AdminToken(state.admin_token)))
    return app
