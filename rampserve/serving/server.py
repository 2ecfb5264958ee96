"""Load models, build their workers and run the HTTP server (uvicorn) until SIGINT/SIGTERM."""

from __future__ import annotations

import socket
import sys
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import uvicorn
from tqdm.auto import tqdm

from rampserve.serving.app import ServerState, create_app
from rampserve.serving.cache import PredictionCache
from rampserve.serving.metrics import ServerMetrics
from rampserve.serving.models import ServedModel, load_served
from rampserve.serving.worker import ModelSettings, ModelWorker

LOOPBACK = "127.0.0.1"
# How long a thread holding the GIL runs before a waiting one may take it. Python's default (5 ms) would let the
# executor, between two of the model's operators, keep the event loop from sending an answer released early
# for longer than the whole model takes; 0.2 ms bounds that wait at a tenth of a small model's batch.
GIL_SWITCH_INTERVAL_S = 0.0002


@dataclass(frozen=True)
class ServerSettings:
    host: str = LOOPBACK  # loopback unless told otherwise
    port: int = 8000
    max_body_mb: float = 64.0
    cache_mb: float = 0.0  # prediction cache per model; 0: off
    # Longest the server waits, once told to stop, for requests in flight before it closes their connections.
    graceful_timeout_s: float = 30.0


def build_state(models: Sequence[ServedModel], model_settings: ModelSettings,
                settings: ServerSettings) -> ServerState:
    metrics = ServerMetrics()
    workers = {m.name: ModelWorker(m, model_settings, metrics) for m in models}
    if len(workers) != len(models):
        raise ValueError(f"two models share a name: {[m.name for m in models]}")
    caches = {name: PredictionCache(int(settings.cache_mb * (1 << 20))) for name in workers} \
        if settings.cache_mb > 0 else {}
    return ServerState(workers, metrics, int(settings.max_body_mb * (1 << 20)), caches)


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


def serve(refs: Sequence[str], model_settings: ModelSettings, settings: ServerSettings) -> None:
    """Serve the models until interrupted; a SIGTERM or SIGINT stops accepting and answers what was accepted."""
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    models = [load_served(ref) for ref in tqdm(refs, desc="loading models", unit="model")]
    state = build_state(models, model_settings, settings)
    sock = bind(settings.host, settings.port)
    host, port = sock.getsockname()[:2]
    print(f"rampserve: serving {', '.join(state.workers)} on http://{host}:{port} "
          f"({'vanilla' if model_settings.vanilla else 'early exits'}); metrics at /metrics, status at /status",
          flush=True)
    uvicorn_server(state, settings).run(sockets=[sock])


@contextmanager
def running_server(state: ServerState, settings: ServerSettings = ServerSettings(port=0)) -> Iterator[str]:
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
