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

import numpy as np
import orjson
from fastapi import APIRouter, Depends, FastAPI, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

import rampserve
from rampserve.serving.apps.applications import DEFAULT_CONTEXT, Application, ApplicationSpec, parse_query_input
from rampserve.serving.cache import CachedAnswer, PredictionCache, cache_key
from rampserve.serving.apps.catalogue import Catalogue, CatalogueError
from rampserve.serving.executor import ExecutorLost
from rampserve.serving.metrics import MergedRegistry, ServerMetrics, watch_loop_lag
from rampserve.serving.models import LABEL_OUTPUT, LOGITS_OUTPUT
from rampserve.serving.apps.predictors import ModelUnavailable, Predictor, WorkerPredictor
from rampserve.serving.protocol import (
    InferRequest,
    ProtocolError,
    RequestedOutput,
    TensorSpec,
    encode_infer_response,
    model_metadata,
    output_names_to_send,
    parse_infer_request,
    server_metadata,
)
from rampserve.serving.apps.state_store import StoreError
from rampserve.serving.apps.update_stream import UpdateListener
from rampserve.serving.worker import Answer, ExecutionFailed, Shed, Worker

HEADER_LENGTH = "inference-header-content-length"
# Applications and models without ramps answer through v2 with a label per input.
APPLICATION_OUTPUT = TensorSpec(LABEL_OUTPUT, "INT64", (-1,))
APPLICATION_VERSION = "1"


@dataclass
class ServerState:
    catalogue: Catalogue
    metrics: ServerMetrics
    max_body_bytes: int = 64 << 20
    cache_bytes: int = 0  # prediction cache per bundle; 0: off
    caches: dict[str, PredictionCache] = field(default_factory=dict)
    admin_token: str | None = None  # None: admin endpoints are open (only allowed on loopback)
    listener: UpdateListener | None = None  # model updates from a Redis Stream
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
    return Response(orjson.dumps({"error": message}), status, headers, media_type="application/json")


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
        "confidence": float(answer.confidences[0]) if one else answer.confidences.tolist(),
        "config_version": answer.config_version,
        "batch_id": answer.batch_id,
    }


def answer_tensors(answer: Answer) -> dict[str, np.ndarray]:
    tensors = {LABEL_OUTPUT: answer.labels}
    if answer.logits is not None:
        tensors[LOGITS_OUTPUT] = answer.logits.astype(np.float32)
    return tensors


def cached_answer(final: Answer) -> CachedAnswer:
    return CachedAnswer(answer_tensors(final), answer_parameters(final))


def create_app(state: ServerState) -> FastAPI:
    catalogue = state.catalogue

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        await catalogue.start()
        if state.listener is not None:
            await state.listener.start()
        # Watched from here on: uvicorn accepts no connection until this returns, so a loop busy loading models
        # keeps no request waiting.
        lag_watch = asyncio.create_task(watch_loop_lag(state.metrics), name="event-loop lag")
        state.ready = True
        yield
        # uvicorn has stopped accepting and waited for the requests in flight; the models answer whatever is
        # still queued before they stop.
        state.ready = False
        lag_watch.cancel()
        await asyncio.wait([lag_watch])
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

    def check_version(name: str, served_version: str, version: str | None) -> None:
        if version is not None and version != served_version:
            raise ProtocolError(f"model '{name}' has no version '{version}' loaded; loaded: ['{served_version}']",
                                404)

    def predictor_for(model: str, version: str | None) -> Predictor:
        predictor = catalogue.models.get(model)
        if predictor is None:
            raise ProtocolError(f"unknown model '{model}'; served: {sorted(catalogue.models)}, applications: "
                                f"{sorted(catalogue.apps)}", 404)
        check_version(model, predictor.version, version)
        return predictor

    @app.get("/v2/health/live")
    async def live() -> Response:
        return json_response({"live": True})

    @app.get("/v2/health/ready")
    async def ready() -> Response:
        return json_response({"ready": True}) if state.ready else error(503, "models are still loading")

    @app.get("/v2")
    async def server() -> Response:
        return json_response(server_metadata("rampserve", rampserve.__version__, ["binary_tensor_data"]))

    def signature(name: str, version: str | None) -> dict:
        if name in catalogue.apps and name not in catalogue.models:
            app_ = catalogue.apps[name]
            check_version(name, APPLICATION_VERSION, version)
            return model_metadata(name, [APPLICATION_VERSION], "rampserve_application", app_.signature(),
                                  [APPLICATION_OUTPUT])
        predictor = predictor_for(name, version)
        if isinstance(predictor, WorkerPredictor):
            served = predictor.served
            return model_metadata(name, [served.version], served.platform, served.inputs, served.outputs)
        return model_metadata(name, [predictor.version], f"rampserve_{predictor.kind}", predictor.inputs or (),
                              [APPLICATION_OUTPUT])

    @app.get("/v2/models/{model}")
    @app.get("/v2/models/{model}/versions/{version}")
    async def metadata(model: str, version: str | None = None) -> Response:
        return json_response(signature(model, version))

    @app.get("/v2/models/{model}/ready")
    @app.get("/v2/models/{model}/versions/{version}/ready")
    async def model_ready(model: str, version: str | None = None) -> Response:
        signature(model, version)
        return json_response({"name": model, "ready": True}) if state.ready else error(503, "model is loading")

    async def infer(request: Request) -> Response:
        started = time.perf_counter()
        model, version = request.path_params["model"], request.path_params.get("version")
        try:
            body = await read_body(request, state.max_body_bytes)
            header_length = request.headers.get(HEADER_LENGTH)
            if header_length is not None and not header_length.strip().isdigit():
                raise ProtocolError(f"header Inference-Header-Content-Length must be a byte count, got "
                                    f"{header_length!r}")
            length = None if header_length is None else int(header_length)
            # The model is looked up only now, after the last await before it is asked: a swap in between
            # cannot hand this request to a version that is draining.
            if model in catalogue.apps and model not in catalogue.models:
                check_version(model, APPLICATION_VERSION, version)
                response, outcome = await _infer_app(catalogue.apps[model], body, length)
            else:
                predictor = predictor_for(model, version)
                if isinstance(predictor, WorkerPredictor):
                    response, outcome = await _infer(predictor.worker, body, length)
                else:
                    response, outcome = await _infer_predictor(predictor, body, length)
        except ProtocolError as exc:
            response, outcome = error(exc.status, exc.message), "invalid"
        except Shed as exc:
            retry = None if exc.retry_after_s is None else {"Retry-After": str(exc.retry_after_s)}
            response, outcome = error(exc.status, exc.message, retry), "shed"
        except ModelUnavailable as exc:
            response, outcome = error(503, str(exc)), "shed"
        except ExecutorLost as exc:
            response, outcome = error(503, str(exc), {"Retry-After": "1"}), "failed"
        except ExecutionFailed as exc:
            response, outcome = error(500, str(exc)), "failed"
        except StoreError as exc:
            response, outcome = error(503, f"the state store is unavailable: {exc}"), "failed"
        label = model if model in catalogue.models or model in catalogue.apps else "unknown"
        metrics.requests.labels(model=label, outcome=outcome).inc()
        if outcome != "invalid":
            metrics.latency.labels(model=label).observe(time.perf_counter() - started)
        return response

    async def _infer(worker: Worker, body: bytes, header_length: int | None) -> tuple[Response, str]:
        served = worker.served
        parsed = parse_infer_request(body, header_length, served.inputs)
        problem = served.check_limits(parsed.inputs)
        if problem:
            raise ProtocolError(problem)
        wanted = output_names_to_send(parsed, [o.name for o in served.outputs])
        if parsed.outputs is None:  # no outputs named: the label only, which can be released early
            wanted = [o for o in wanted if o.name == LABEL_OUTPUT]
        deadline_ms, priority = request_options(parsed.parameters)
        needs_final = any(o.name == LOGITS_OUTPUT for o in wanted)
        cache = state.cache(served.name)
        key = cache_key(served.name, served.version, parsed.inputs) if cache is not None else None
        cached = cache.get(key) if cache is not None else None
        if cache is not None:
            metrics.cache.labels(model=served.name, result="hit" if cached else "miss").inc()
        if cached is not None and all(o.name in cached.outputs for o in wanted):
            tensors, parameters, outcome = cached.outputs, {**cached.parameters, "cached": True}, "cached"
            worker.count_cached(cached.outputs[LABEL_OUTPUT])
        else:
            # The cache keeps the final answer, known once the batch has run to the end, never a ramp's label:
            # thresholds move, and a cached early answer would be replayed unchecked
            loop = asyncio.get_running_loop()
            on_final = None if cache is None else (
                lambda final: loop.call_soon_threadsafe(cache.put, key, cached_answer(final)))
            future = worker.submit(parsed.inputs, parsed.batch_size, needs_final, deadline_ms, priority, on_final)
            answer: Answer = await future
            tensors = answer_tensors(answer)
            parameters, outcome = answer_parameters(answer), "early" if answer.early else "final"
        datatypes = {o.name: o.datatype for o in served.outputs}
        return label_response(served.name, served.version, parsed, wanted,
                              [(o.name, datatypes[o.name], tensors[o.name]) for o in wanted], parameters), outcome

    def label_response(name: str, version: str, parsed: InferRequest, wanted: list[RequestedOutput],
                       tensors: list[tuple[str, str, np.ndarray]], parameters: dict) -> Response:
        body, headers = encode_infer_response(name, version, parsed.id, tensors,
                                              binary=[o.name for o in wanted if o.binary], parameters=parameters)
        return Response(body, headers=headers)

    async def _infer_predictor(predictor: Predictor, body: bytes, header_length: int | None) -> tuple[Response, str]:
        """A model without ramps (torch, ONNX, scikit-learn, a callable, a remote one): labels and confidences."""
        if predictor.inputs is None:
            raise ProtocolError(f"model '{predictor.name}' has no known input signature", 503)
        parsed = parse_infer_request(body, header_length, predictor.inputs)
        wanted = output_names_to_send(parsed, [LABEL_OUTPUT])
        deadline_ms, _ = request_options(parsed.parameters)
        prediction = await predictor.predict(parsed.inputs, deadline_ms)
        confidences = prediction.confidences.tolist()
        parameters = {"confidence": confidences[0] if len(confidences) == 1 else confidences}
        return label_response(predictor.name, predictor.version, parsed, wanted,
                              [(LABEL_OUTPUT, "INT64", prediction.labels)], parameters), "final"

    async def _infer_app(app_: Application, body: bytes, header_length: int | None) -> tuple[Response, str]:
        """An application through v2: one query per request, the context from parameters.uid."""
        parsed = parse_infer_request(body, header_length, app_.signature())
        if parsed.batch_size != 1:
            raise ProtocolError(f"application '{app_.name}' answers one query per request, got {parsed.batch_size}")
        wanted = output_names_to_send(parsed, [LABEL_OUTPUT])
        answer = await app_.predict(parsed.inputs, context_of(parsed.parameters.get("uid")))
        label = answer.output if isinstance(answer.output, int) and not isinstance(answer.output, bool) else -1
        parameters = {k: v for k, v in answer.to_json().items() if k != "output"}
        if answer.default:
            parameters["default_output"] = answer.output
        return label_response(app_.name, APPLICATION_VERSION, parsed, wanted,
                              [(LABEL_OUTPUT, "INT64", np.array([label]))], parameters), \
            "default" if answer.default else "answered"

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
        predictor = predictor_for(model, None)
        return json_response(await predictor.worker.current_status() if isinstance(predictor, WorkerPredictor)
                             else predictor.describe())

    return app


def context_of(uid: object) -> str:
    """The selection context of a query: the user or session key it names, or the application's default."""
    if uid is None:
        return DEFAULT_CONTEXT
    if not isinstance(uid, str | int) or isinstance(uid, bool) or not str(uid):
        raise ProtocolError(f"'uid' must be a non-empty string, got {uid!r}")
    return str(uid)
