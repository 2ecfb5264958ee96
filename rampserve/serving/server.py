"""Load models, build their workers and run the HTTP server (uvicorn) until SIGINT/SIGTERM."""

from __future__ import annotations

import ipaddress
import socket
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import partial

import uvicorn
from tqdm.auto import tqdm

from rampserve.serving.executor.loading import load_served, read_served
from rampserve.serving.executor.process_worker import make_worker
from rampserve.serving.frontend.app import ServerState, create_app
from rampserve.serving.frontend.apps.applications import ApplicationSpec
from rampserve.serving.frontend.apps.state_store import RedisStore, open_store
from rampserve.serving.frontend.apps.update_stream import ModelUpdate, UpdateListener
from rampserve.serving.frontend.grpc_server import GrpcFrontEnd, address
from rampserve.serving.frontend.repository.catalogue import Catalogue, CatalogueError, ModelLoaders, ModelRepository
from rampserve.serving.frontend.repository.predictors import Predictor, WorkerPredictor
from rampserve.serving.learning import LearningSettings, UnpreparedModel, open_unprepared, unprepared_model
from rampserve.serving.plain_models import onnx_predictor
from rampserve.serving.shared.contract import GIL_SWITCH_INTERVAL_S, ControlLink, freeze_startup_objects
from rampserve.serving.shared.metrics import ServerMetrics
from rampserve.serving.shared.models import ServedModel
from rampserve.serving.shared.settings import ModelSettings, ServerSettings


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve anywhere
        return False


def check_admin_access(settings: ServerSettings) -> None:
    if settings.admin_token is None and not is_loopback(settings.host):
        raise ValueError(f"the server would bind {settings.host}, beyond loopback, with open admin endpoints: "
                         "give an admin token (--admin-token or RAMPSERVE_ADMIN_TOKEN)")


def build_state(models: Sequence[ServedModel | Predictor | UnpreparedModel], model_settings: ModelSettings,
                settings: ServerSettings, apps: Sequence[ApplicationSpec] = (),
                control: Callable[[ServedModel], ControlLink | None] | None = None,
                learning: LearningSettings = LearningSettings()) -> ServerState:
    """The server's state: the given models (prepared bundles get a batching executor with early exits; a model
    given unprepared is served vanilla while it learns its ramps from its traffic, under `learning`; any other
    `Predictor` is served as it is) and every model of the repository, plus applications over them. `control` links
    a bundle to its controller (default: one of its own in this process)."""
    check_admin_access(settings)
    metrics = ServerMetrics()
    loaders = ModelLoaders(
        bundle=lambda folder, name, version, settings: WorkerPredictor(
            make_worker(read_served(folder, name, version), settings, metrics)),
        onnx=onnx_predictor)
    repository = None if settings.repository is None else ModelRepository(settings.repository, model_settings,
                                                                             loaders)
    if repository is not None:
        repository.check()
    predictors, learners = [], []
    for m in models:
        if isinstance(m, UnpreparedModel):
            predictor, learner = open_unprepared(m, learning, model_settings, metrics)
            predictors.append(predictor)
            learners.append(learner)
        else:
            predictors.append(WorkerPredictor(make_worker(m, model_settings, metrics, control and control(m)))
                              if isinstance(m, ServedModel) else m)
    if repository is not None:
        predictors += [repository.build(name) for name in tqdm(repository.names(), desc="loading repository",
                                                               unit="model")]
    store = open_store(settings.store, settings.store_prefix)
    if settings.update_stream and not isinstance(store, RedisStore):
        raise ValueError("following the update stream needs a Redis store (--store redis://...)")
    catalogue = Catalogue(metrics, store, repository, predictors, apps, learners)
    listener = None
    if settings.update_stream:
        listener = UpdateListener(settings.store, partial(apply_update, catalogue))
    max_body = int(settings.max_body_mb * (1 << 20))
    grpc = GrpcFrontEnd(settings.host, settings.grpc_port, max_body, settings.graceful_timeout_s) if settings.grpc \
        else None
    return ServerState(catalogue, metrics, max_body, int(settings.cache_mb * (1 << 20)),
                       admin_token=settings.admin_token, listener=listener, grpc=grpc, dashboard=settings.dashboard)


async def apply_update(catalogue: Catalogue, update: ModelUpdate) -> None:
    """A model update from the stream: load (or swap to) a version from the repository, or unload."""
    if update.action == "load":
        await catalogue.load(update.model, update.version)
        return
    loaded = catalogue.models.get(update.model)
    if update.version is not None and loaded is not None and loaded.version != update.version:
        raise CatalogueError(f"model {update.model} serves version {loaded.version}, not {update.version}")
    await catalogue.unload(update.model)


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the server starts so that port 0 gives a known free port; it listens
    at once, so clients that connect before the server has started wait in its backlog instead of being
    refused."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    return sock


def uvicorn_server(state: ServerState, settings: ServerSettings) -> uvicorn.Server:
    config = uvicorn.Config(create_app(state), loop="uvloop", http="httptools", log_level="warning",
                            access_log=False, timeout_graceful_shutdown=settings.graceful_timeout_s)
    return uvicorn.Server(config)


def serve(refs: Sequence[str], model_settings: ModelSettings, settings: ServerSettings,
          apps: Sequence[ApplicationSpec] = (), learning: LearningSettings = LearningSettings()) -> None:
    """Serve the models until interrupted; a SIGTERM or SIGINT stops accepting and answers what was accepted."""
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    models = [unprepared_model(ref) or load_served(ref) for ref in tqdm(refs, desc="loading models", unit="model")]
    state = build_state(models, model_settings, settings, apps, learning=learning)
    sock = bind(settings.host, settings.port)
    host, port = sock.getsockname()[:2]
    freeze_startup_objects()
    grpc = f", gRPC on {address(host, settings.grpc_port)}" if settings.grpc else ""
    print(f"rampserve: serving {', '.join(state.catalogue.models) or 'no models yet'} on http://{host}:{port}{grpc} "
          f"({'vanilla' if model_settings.vanilla else 'early exits'}); metrics at /metrics, status at /status"
          + (", dashboard at /dashboard" if settings.dashboard else ""), flush=True)
    uvicorn_server(state, settings).run(sockets=[sock])


@contextmanager
def running_server(state: ServerState, settings: ServerSettings = ServerSettings(port=0, grpc=False)) -> Iterator[str]:
    """A real server on a free loopback port in a background thread, for tests and in-process benchmarks;
    yields its base URL and shuts it down gracefully on exit."""
    sock = bind(settings.host, settings.port)
    host, port = sock.getsockname()[:2]
    server = uvicorn_server(state, settings)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="uvicorn", daemon=True)
    thread.start()
    try:
        while not server.started:
            if not thread.is_alive():
                raise RuntimeError("the server failed to start")
            thread.join(0.01)
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join()
        sock.close()
