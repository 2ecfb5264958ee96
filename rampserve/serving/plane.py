"""The data plane: every v2 inference request, whatever stands behind its model's name (a bundle's executor, in
this process or its own, a callable, ONNX, scikit-learn, a remote model or an application), takes one path here:
parse it, look up the prediction cache, ask the model (`Predictor.infer`), encode the answer. It knows nothing of
transports: a front end hands it the body and the binary header's length and sends back the `InferResult`'s
status, body and headers (the HTTP routes in `app.py`; a gRPC front end would do the same)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import orjson

from rampserve.serving.apps.applications import ApplicationPredictor
from rampserve.serving.apps.catalogue import Catalogue
from rampserve.serving.apps.predictors import ModelUnavailable, Prediction, PredictRequest, Predictor
from rampserve.serving.apps.state_store import StoreError
from rampserve.serving.cache import CachedAnswer, PredictionCache, cache_key
from rampserve.serving.executor import ExecutorLost
from rampserve.serving.metrics import ServerMetrics
from rampserve.serving.models import LABEL_OUTPUT
from rampserve.serving.protocol import (
    ProtocolError,
    encode_infer_response,
    model_metadata,
    output_names_to_send,
    parse_infer_request,
)
from rampserve.serving.worker import ExecutionFailed, Shed

JSON = "application/json"


@dataclass(frozen=True)
class InferResult:
    """A response to an inference request, whatever carries it: an answer, or `{"error": message}`."""

    status: int
    body: bytes
    headers: dict[str, str]  # Content-Type among them
    # As rampserve_requests_total counts it: early, final, cached, answered or default for an answer; invalid, shed
    # or failed for an error
    outcome: str


def error_body(message: str) -> bytes:
    return orjson.dumps({"error": message})


def refusal(status: int, message: str, outcome: str, headers: dict[str, str] | None = None) -> InferResult:
    return InferResult(status, error_body(message), {**(headers or {}), "Content-Type": JSON}, outcome)


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


class DataPlane:
    """Inference, model metadata and model lookups over a server's catalogue; runs on the server's event loop.
    `cache` gives a model's prediction cache by name (None: caching is off)."""

    def __init__(self, catalogue: Catalogue, metrics: ServerMetrics,
                 cache: Callable[[str], PredictionCache | None]) -> None:
        self.catalogue, self.metrics, self.cache = catalogue, metrics, cache

    # ---- lookups ------------------------------------------------------------------------------------------

    def model(self, name: str, version: str | None = None) -> Predictor:
        """A served model (not an application) by name, and version if given; ProtocolError 404 if not served."""
        predictor = self.catalogue.models.get(name)
        if predictor is None:
            raise ProtocolError(f"unknown model '{name}'; served: {sorted(self.catalogue.models)}, applications: "
                                f"{sorted(self.catalogue.apps)}", 404)
        return checked_version(predictor, version)

    def find(self, name: str, version: str | None = None) -> Predictor:
        """What v2 serves under `name`: a model, or an application of that name (models come first)."""
        if name in self.catalogue.apps and name not in self.catalogue.models:
            return checked_version(ApplicationPredictor(self.catalogue.apps[name]), version)
        return self.model(name, version)

    def metadata(self, name: str, version: str | None = None) -> dict:
        """The v2 model metadata; an application whose models are all unloaded has none (ProtocolError 503)."""
        predictor = self.find(name, version)
        return model_metadata(name, [predictor.version], predictor.platform, predictor.inputs or (),
                              predictor.outputs)

    # ---- inference ----------------------------------------------------------------------------------------

    async def infer(self, model: str, version: str | None, body: bytes, header_length: int | None,
                    arrived: float | None = None) -> InferResult:
        """Answer one request: `body` as sent, `header_length` the length of its JSON part when binary tensors
        follow it (None: JSON only). `arrived` (time.perf_counter()) starts the latency the metrics observe, at
        the request's arrival rather than once its body was read; default now."""
        arrived = time.perf_counter() if arrived is None else arrived
        try:
            # The model is looked up only now, after the transport's last await before it is asked: a swap in
            # between cannot hand this request to a version that is draining.
            result = await self._answer(self.find(model, version), body, header_length)
        except ProtocolError as exc:
            result = refusal(exc.status, exc.message, "invalid")
        except Shed as exc:
            retry = None if exc.retry_after_s is None else {"Retry-After": str(exc.retry_after_s)}
            result = refusal(exc.status, exc.message, "shed", retry)
        except ModelUnavailable as exc:
            result = refusal(503, str(exc), "shed")
        except ExecutorLost as exc:  # its process died; a new one is starting
            result = refusal(503, str(exc), "failed", {"Retry-After": "1"})
        except ExecutionFailed as exc:
            result = refusal(500, str(exc), "failed")
        except StoreError as exc:
            result = refusal(503, f"the state store is unavailable: {exc}", "failed")
        self._count(model, result.outcome, arrived)
        return result

    def refused(self, model: str, error: ProtocolError) -> InferResult:
        """A request its transport refused before the plane could read it (a body over the limit, a malformed
        binary header length), counted as the plane counts the invalid requests it refuses itself."""
        result = refusal(error.status, error.message, "invalid")
        self._count(model, result.outcome, time.perf_counter())
        return result

    async def _answer(self, predictor: Predictor, body: bytes, header_length: int | None) -> InferResult:
        inputs = predictor.inputs
        if inputs is None:
            raise ProtocolError(f"model '{predictor.name}' has no known input signature", 503)
        parsed = parse_infer_request(body, header_length, inputs)
        problem = predictor.problem_with(parsed.inputs, parsed.batch_size)
        if problem:
            raise ProtocolError(problem)
        wanted = output_names_to_send(parsed, [spec.name for spec in predictor.outputs])
        if parsed.outputs is None:  # no outputs named: the label only, which a bundle can release early
            wanted = [output for output in wanted if output.name == LABEL_OUTPUT]
        deadline_ms, priority = request_options(parsed.parameters)
        request = PredictRequest(parsed.inputs, deadline_ms, priority, tuple(output.name for output in wanted),
                                 parsed.parameters)
        cache = self.cache(predictor.name) if predictor.cacheable else None
        key = cache_key(predictor.name, predictor.version, parsed.inputs) if cache is not None else None
        cached = cache.get(key) if cache is not None else None
        if cache is not None:
            self.metrics.cache.labels(model=predictor.name, result="hit" if cached else "miss").inc()
        if cached is not None and all(name in cached.outputs for name in request.outputs):
            predictor.count_cached(cached.outputs[LABEL_OUTPUT])
            tensors, parameters, outcome = cached.outputs, {**cached.parameters, "cached": True}, "cached"
        else:
            if cache is not None:
                request = replace(request, on_final=final_answer_keeper(cache, key))
            prediction = await predictor.infer(request)
            tensors, parameters, outcome = prediction.outputs, prediction.parameters, prediction.outcome
        datatypes = {spec.name: spec.datatype for spec in predictor.outputs}
        response, headers = encode_infer_response(
            predictor.name, predictor.version, parsed.id,
            [(output.name, datatypes[output.name], tensors[output.name]) for output in wanted],
            binary=[output.name for output in wanted if output.binary], parameters=parameters)
        return InferResult(200, response, headers, outcome)

    def _count(self, model: str, outcome: str, arrived: float) -> None:
        catalogue = self.catalogue
        label = model if model in catalogue.models or model in catalogue.apps else "unknown"
        self.metrics.requests.labels(model=label, outcome=outcome).inc()
        if outcome != "invalid":
            self.metrics.latency.labels(model=label).observe(time.perf_counter() - arrived)


def checked_version(predictor: Predictor, version: str | None) -> Predictor:
    if version is not None and version != predictor.version:
        raise ProtocolError(f"model '{predictor.name}' has no version '{version}' loaded; loaded: "
                            f"['{predictor.version}']", 404)
    return predictor


def final_answer_keeper(cache: PredictionCache, key: bytes) -> Callable[[Prediction], None]:
    """Where a request's final answer goes to be cached (from any thread: the cache is thread-safe). The final
    answer, known once a bundle's batch has run to the end, never a ramp's label: thresholds move, and a cached
    early answer would be replayed unchecked."""
    return lambda final: cache.put(key, CachedAnswer(final.outputs, final.parameters))
