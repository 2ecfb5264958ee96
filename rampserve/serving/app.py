"""The HTTP face of the server: the Open Inference Protocol v2 (with Triton's binary-data extension),
Prometheus metrics and a JSON status, over the models' workers."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import numpy as np
import orjson
from fastapi import FastAPI, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

import rampserve
from rampserve.serving.cache import CachedAnswer, PredictionCache, cache_key
from rampserve.serving.metrics import ServerMetrics
from rampserve.serving.models import LABEL_OUTPUT, LOGITS_OUTPUT
from rampserve.serving.protocol import (
    ProtocolError,
    encode_infer_response,
    model_metadata,
    output_names_to_send,
    parse_infer_request,
    server_metadata,
)
from rampserve.serving.worker import Answer, ExecutionFailed, ModelWorker, Shed

HEADER_LENGTH = "inference-header-content-length"


@dataclass
class ServerState:
    workers: dict[str, ModelWorker]
    metrics: ServerMetrics
    max_body_bytes: int = 64 << 20
    caches: dict[str, PredictionCache] = field(default_factory=dict)  # models that opted in
    ready: bool = False


def error(status: int, message: str, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps({"error": message}), status, headers, media_type="application/json")


def json_response(data: object) -> Response:
    return Response(orjson.dumps(data, option=orjson.OPT_SERIALIZE_NUMPY), media_type="application/json")


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


def request_options(parameters: dict) -> tuple[float | None, int]:
    """The request's own deadline (ms from arrival) and priority (higher is served first), if it sets them."""
    deadline = parameters.get("deadline_ms")
    priority = parameters.get("priority", 0)
    if deadline is not None and (isinstance(deadline, bool) or not isinstance(deadline, (int, float))
                                 or not deadline > 0):
        raise ProtocolError(f"parameter deadline_ms must be a positive number of milliseconds, got {deadline!r}")
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise ProtocolError(f"parameter priority must be an integer, got {priority!r}")
    return (None if deadline is None else float(deadline)), priority


def answer_parameters(answer: Answer) -> dict:
    """Where each input was answered: scalars for a one-input request, lists otherwise."""
    one = len(answer.exit_sites) == 1
    return {
        "early": answer.early,
        "exit_site": answer.exit_sites[0] if one else list(answer.exit_sites),
        "error_score": answer.error_scores[0] if one else list(answer.error_scores),
        "config_version": answer.config_version,
        "batch_id": answer.batch_id,
    }


def create_app(state: ServerState) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        for worker in state.workers.values():
            worker.start()
        state.ready = True
        yield
        # uvicorn has stopped accepting and waited for the requests in flight; the workers answer whatever is
        # still queued before they stop.
        state.ready = False
        await asyncio.gather(*(asyncio.to_thread(w.stop) for w in state.workers.values()))

    app = FastAPI(title="rampserve", version=rampserve.__version__, lifespan=lifespan)
    metrics = state.metrics

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, exc: StarletteHTTPException) -> Response:
        return error(exc.status_code, str(exc.detail))

    @app.exception_handler(ProtocolError)
    async def protocol_error(_request: Request, exc: ProtocolError) -> Response:
        return error(exc.status, exc.message)

    def worker_for(model: str, version: str | None) -> ModelWorker:
        worker = state.workers.get(model)
        if worker is None:
            raise ProtocolError(f"unknown model '{model}'; served: {sorted(state.workers)}", 404)
        if version is not None and version != worker.served.version:
            raise ProtocolError(f"model '{model}' has no version '{version}'; versions: "
                                f"['{worker.served.version}']", 404)
        return worker

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
        served = worker_for(model, version).served
        return json_response(model_metadata(served.name, [served.version], served.platform, served.inputs,
                                            served.outputs))

    @app.get("/v2/models/{model}/ready")
    @app.get("/v2/models/{model}/versions/{version}/ready")
    async def model_ready(model: str, version: str | None = None) -> Response:
        worker_for(model, version)
        return json_response({"name": model, "ready": True}) if state.ready else error(503, "model is loading")

    async def infer(request: Request) -> Response:
        started = time.perf_counter()
        model, version = request.path_params["model"], request.path_params.get("version")
        try:
            response, outcome = await _infer(worker_for(model, version), request)
        except ProtocolError as exc:
            response, outcome = error(exc.status, exc.message), "invalid"
        except Shed as exc:
            retry = None if exc.retry_after_s is None else {"Retry-After": str(exc.retry_after_s)}
            response, outcome = error(exc.status, exc.message, retry), "shed"
        except ExecutionFailed as exc:
            response, outcome = error(500, str(exc)), "failed"
        label = model if model in state.workers else "unknown"
        metrics.requests.labels(model=label, outcome=outcome).inc()
        if outcome != "invalid":
            metrics.latency.labels(model=label).observe(time.perf_counter() - started)
        return response

    async def _infer(worker: ModelWorker, request: Request) -> tuple[Response, str]:
        served = worker.served
        body = await read_body(request, state.max_body_bytes)
        header_length = request.headers.get(HEADER_LENGTH)
        if header_length is not None and not header_length.strip().isdigit():
            raise ProtocolError(f"header Inference-Header-Content-Length must be a byte count, got {header_length!r}")
        parsed = parse_infer_request(body, None if header_length is None else int(header_length), served.inputs)
        problem = served.check_limits(parsed.inputs)
        if problem:
            raise ProtocolError(problem)
        wanted = output_names_to_send(parsed, [o.name for o in served.outputs])
        if parsed.outputs is None:  # no outputs named: the label only, which can be released early
            wanted = [o for o in wanted if o.name == LABEL_OUTPUT]
        deadline_ms, priority = request_options(parsed.parameters)
        needs_final = any(o.name == LOGITS_OUTPUT for o in wanted)
        cache = state.caches.get(served.name)
        key = cache_key(served.name, served.version, parsed.inputs) if cache is not None else None
        cached = cache.get(key) if cache is not None else None
        if cache is not None:
            metrics.cache.labels(model=served.name, result="hit" if cached else "miss").inc()
        if cached is not None and all(o.name in cached.outputs for o in wanted):
            tensors, parameters, outcome = cached.outputs, {**cached.parameters, "cached": True}, "cached"
        else:
            future = worker.submit(parsed.inputs, parsed.batch_size, needs_final, deadline_ms, priority)
            answer: Answer = await future
            tensors = {LABEL_OUTPUT: answer.labels}
            if answer.logits is not None:
                tensors[LOGITS_OUTPUT] = answer.logits.astype(np.float32)
            parameters, outcome = answer_parameters(answer), "early" if answer.early else "final"
            if cache is not None:
                cache.put(key, CachedAnswer(tensors, parameters))
        datatypes = {o.name: o.datatype for o in served.outputs}
        body, headers = encode_infer_response(
            served.name, served.version, parsed.id,
            [(o.name, datatypes[o.name], tensors[o.name]) for o in wanted],
            binary=[o.name for o in wanted if o.binary], parameters=parameters)
        return Response(body, headers=headers), outcome

    # The hot path is a plain Starlette route: FastAPI's parameter resolution adds nothing the handler needs.
    app.add_route("/v2/models/{model}/infer", infer, methods=["POST"])
    app.add_route("/v2/models/{model}/versions/{version}/infer", infer, methods=["POST"])

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/status")
    async def status() -> Response:
        return json_response({"ready": state.ready, "models": {n: w.status() for n, w in state.workers.items()}})

    @app.get("/status/{model}")
    async def model_status(model: str) -> Response:
        return json_response(worker_for(model, None).status())

    return app
