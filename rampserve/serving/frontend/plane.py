"""The data plane: every v2 inference request, whatever stands behind its model's name (a bundle's executor, in
this process or its own, a callable, ONNX, scikit-learn, a remote model or an application), and whichever transport
brought it, takes one path here: decode it, look up the prediction cache, ask the model (`Predictor.infer`), encode
the answer. `answer` is that path, with the transport's decoder and encoder; `infer` is HTTP's use of it (a body and
its binary header's length in, an `InferResult`'s status, body and headers out), `grpc_server` gRPC's."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TypeVar

import numpy as np
import orjson

from rampserve.serving.frontend.apps.applications import ApplicationPredictor
from rampserve.serving.frontend.apps.state_store import StoreError
from rampserve.serving.frontend.cache import PredictionCache, cache_key
from rampserve.serving.frontend.repository.catalogue import Catalogue
from rampserve.serving.frontend.repository.predictors import ModelUnavailable, Predictor
from rampserve.serving.shared.contract import Answer, ExecutionFailed, ExecutorLost, ModelRequest, Shed
from rampserve.serving.shared.metrics import ServerMetrics
from rampserve.serving.shared.models import LABEL_OUTPUT, LOGITS_OUTPUT
from rampserve.serving.shared.protocol import (
    InferRequest,
    ProtocolError,
    RequestedOutput,
    TensorSpec,
    encode_infer_response,
    model_metadata,
    output_names_to_send,
    parse_infer_request,
)

JSON = "application/json"
# rampserve_requests_total's transport label: what brought the request
HTTP, GRPC = "http", "grpc"


@dataclass(frozen=True)
class InferResult:
    """A response to an inference request, whatever carries it: an answer, or `{"error": message}`."""

    status: int
    body: bytes
    headers: dict[str, str]  # Content-Type among them
    # As rampserve_requests_total counts it: early, final, cached, answered or default for an answer; invalid, shed
    # or failed for an error
    outcome: str


@dataclass(frozen=True)
class InferResponse:
    """A model's answer to a v2 request (`InferRequest`), before a transport encodes it."""

    model: str
    version: str
    id: str | None  # the request's
    outputs: list[tuple[RequestedOutput, str, np.ndarray]]  # (output asked for, its v2 datatype, its values)
    parameters: dict  # how it was answered: exit sites, early or final, cached, ...
    outcome: str  # early, final, cached, answered or default (rampserve_requests_total)


@dataclass(frozen=True)
class Refusal:
    """A request the plane refused or could not answer, whatever transport carries the refusal."""

    status: int  # as HTTP answers it; gRPC maps it to a status code (`grpc_server.STATUS_CODES`)
    message: str
    outcome: str  # invalid, shed or failed
    retry_after_s: int | None = None


# What a transport makes of an answer (an HTTP body, a gRPC message)
Encoded = TypeVar("Encoded")
# How a transport reads a request against the model's inputs and the inputs it takes in their place (a text model's
# texts, `models.TextInput`)
Decoder = Callable[[Sequence[TensorSpec], Sequence[TensorSpec]], InferRequest]


def error_body(message: str) -> bytes:
    return orjson.dumps({"error": message})


def http_refusal(refusal: Refusal) -> InferResult:
    retry = {} if refusal.retry_after_s is None else {"Retry-After": str(refusal.retry_after_s)}
    return InferResult(refusal.status, error_body(refusal.message), {**retry, "Content-Type": JSON}, refusal.outcome)


def request_options(parameters: dict) -> tuple[float | None, int, bool]:
    """The request's own deadline (ms from arrival) and priority (higher is served first), if it sets them, and
    whether it asks for its answer's trace (`traced`)."""
    deadline = parameters.get("deadline_ms")
    priority = parameters.get("priority", 0)
    trace = parameters.get("trace", False)
    if not isinstance(trace, bool):
        raise ProtocolError(f"parameter trace must be true or false, got {trace!r}")
    if deadline is not None and (isinstance(deadline, bool) or not isinstance(deadline, (int, float))
                                 or not deadline > 0):
        raise ProtocolError(f"parameter deadline_ms must be a positive number of milliseconds, got {deadline!r}")
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise ProtocolError(f"parameter priority must be an integer, got {priority!r}")
    return (None if deadline is None else float(deadline)), priority, trace


def per_input(values: Sequence) -> object:
    """A response parameter with one value per input: the value itself for a one-input request, else a list."""
    return values[0] if len(values) == 1 else list(values)


def response_parameters(answer: Answer) -> dict:
    """How an answer was reached, as its response's parameters: an application's decision; else the confidence
    per input, and for a bundle where each input was answered (the ramp, or None: the final layer, and its error
    score) by which configuration and batch."""
    if answer.decision is not None:
        return dict(answer.decision)
    confidence = per_input(answer.confidences.tolist())
    exits = answer.exits
    if exits is None:
        return {"confidence": confidence}
    return {"early": exits.early, "exit_site": per_input(exits.sites), "error_score": per_input(exits.error_scores),
            "confidence": confidence, "config_version": exits.config_version, "batch_id": exits.batch_id}


def answer_tensors(answer: Answer) -> dict[str, np.ndarray]:
    """An answer's v2 output tensors by name: the label, and a bundle's logits when they were asked for."""
    tensors = {LABEL_OUTPUT: answer.labels}
    if answer.logits is not None:
        tensors[LOGITS_OUTPUT] = answer.logits.astype(np.float32, copy=False)
    return tensors


def traced(arrived: float, submitted: float | None, answer: Answer | None, resumed: float | None) -> dict:
    """When a request passed each step of the server, `time.monotonic()` seconds (the clock a client on the same
    machine reads as `time.perf_counter`): in (the route's handler began), submitted (decoded, handed to the model),
    the executor's steps (`contract.Stamps`: admitted, started, ran, signalled, released, received), resumed (the
    request's coroutine had the answer) and answered (the response's encoding began). A cached answer has in and
    answered alone; a model without an executor has no executor steps."""
    steps = {"in": arrived}
    if submitted is not None:
        steps["submitted"] = submitted
        if answer is not None and answer.stamps is not None:
            steps |= answer.stamps.to_json()
        steps["resumed"] = resumed
    return steps | {"answered": time.monotonic()}


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

    def model_ready(self, name: str, version: str | None = None) -> bool:
        """Whether what v2 serves under `name` (and version) serves now, once the server is ready; ProtocolError where
        nothing is served so (404) or it has no signature (503: an application whose models are all unloaded)."""
        self.metadata(name, version)
        return self.find(name, version).available

    def metadata(self, name: str, version: str | None = None) -> dict:
        """The v2 model metadata; an application whose models are all unloaded has none (ProtocolError 503)."""
        predictor = self.find(name, version)
        return model_metadata(name, [predictor.version], predictor.platform, predictor.inputs or (),
                              predictor.outputs, () if predictor.text is None else (predictor.text.metadata(),))

    # ---- inference ----------------------------------------------------------------------------------------

    async def answer(self, model: str, version: str | None,
                     decode: Decoder, encode: Callable[[InferResponse], Encoded],
                     transport: str, arrived: float | None = None) -> Encoded | Refusal:
        """Answer one request, whatever its transport (HTTP or GRPC, as it is counted): `decode` reads it against
        the model's inputs (or a text model's texts in their place, which are tokenized here, so that the prediction
        cache, the queue and the controller see the token inputs whichever a client sent), `encode` turns the answer
        into what the transport sends (a ProtocolError from either refuses the request).
        `arrived` (time.monotonic()) starts the latency the metrics observe, at the request's arrival rather
        than once its body was read; default now."""
        arrived = time.monotonic() if arrived is None else arrived
        try:
            # The model is looked up only now, after the transport's last await before it is asked: a swap in
            # between cannot hand this request to a version that is draining.
            answered = await self._answer(self.find(model, version), decode, arrived)
            result: Encoded | Refusal = encode(answered)
        except ProtocolError as exc:
            result = Refusal(exc.status, exc.message, "invalid")
        except Shed as exc:
            result = Refusal(exc.status, exc.message, "shed", exc.retry_after_s)
        except ModelUnavailable as exc:
            result = Refusal(503, str(exc), "shed")
        except ExecutorLost as exc:  # its process died; a new one is starting
            result = Refusal(503, str(exc), "failed", 1)
        except ExecutionFailed as exc:
            result = Refusal(500, str(exc), "failed")
        except StoreError as exc:
            result = Refusal(503, f"the state store is unavailable: {exc}", "failed")
        self._count(model, result.outcome if isinstance(result, Refusal) else answered.outcome, transport, arrived)
        return result

    async def infer(self, model: str, version: str | None, body: bytes, header_length: int | None,
                    arrived: float | None = None) -> InferResult:
        """Answer one HTTP request: `body` as sent, `header_length` the length of its JSON part when binary tensors
        follow it (None: JSON only)."""
        result = await self.answer(
            model, version, lambda inputs, texts: parse_infer_request(body, header_length, inputs, alternative=texts),
            http_answer, HTTP, arrived)
        return http_refusal(result) if isinstance(result, Refusal) else result

    def refuse(self, model: str, error: ProtocolError, transport: str) -> Refusal:
        """A request its transport refused before the plane could read it (a body over the limit, a malformed
        binary header length, a message that does not parse), counted as the plane counts the invalid requests it
        refuses itself."""
        self._count(model, "invalid", transport, time.monotonic())
        return Refusal(error.status, error.message, "invalid")

    def refused(self, model: str, error: ProtocolError) -> InferResult:
        """`refuse` for HTTP."""
        return http_refusal(self.refuse(model, error, HTTP))

    async def _answer(self, predictor: Predictor, decode: Decoder, arrived: float) -> InferResponse:
        inputs, text = predictor.inputs, predictor.text
        if inputs is None:
            raise ProtocolError(f"model '{predictor.name}' has no known input signature", 503)
        parsed = decode(inputs, () if text is None else (text.spec,))
        if text is not None and text.spec.name in parsed.inputs:
            parsed = replace(parsed, inputs=text.token_inputs(parsed.inputs[text.spec.name]))
        problem = predictor.problem_with(parsed.inputs, parsed.batch_size)
        if problem:
            raise ProtocolError(problem)
        wanted = output_names_to_send(parsed, [spec.name for spec in predictor.outputs])
        if parsed.outputs is None:  # no outputs named: the label only, which a bundle can release early
            wanted = [output for output in wanted if output.name == LABEL_OUTPUT]
        deadline_ms, priority, trace = request_options(parsed.parameters)
        needs_final = any(output.name == LOGITS_OUTPUT for output in wanted)
        request = ModelRequest(parsed.inputs, needs_final, deadline_ms, priority, parameters=parsed.parameters)
        cache = self.cache(predictor.name) if predictor.cacheable else None
        key = cache_key(predictor.name, predictor.version, parsed.inputs) if cache is not None else None
        cached = cache.get(key) if cache is not None else None
        if cache is not None:
            self.metrics.cache.labels(model=predictor.name, result="hit" if cached else "miss").inc()
        submitted = answer = resumed = None
        if cached is not None and (cached.logits is not None or not needs_final):
            predictor.count_cached(cached.labels)
            tensors, parameters, outcome = answer_tensors(cached), response_parameters(cached) | {"cached": True}, "cached"
        else:
            if cache is not None:
                request = replace(request, on_final=final_answer_keeper(cache, key))
            submitted = time.monotonic()
            answer = await predictor.infer(request)
            resumed = time.monotonic()
            tensors, parameters, outcome = answer_tensors(answer), response_parameters(answer), answer.outcome
        if trace:
            parameters = {**parameters, "trace": traced(arrived, submitted, answer, resumed)}
        datatypes = {spec.name: spec.datatype for spec in predictor.outputs}
        return InferResponse(predictor.name, predictor.version, parsed.id,
                             [(output, datatypes[output.name], tensors[output.name]) for output in wanted], parameters,
                             outcome)

    def _count(self, model: str, outcome: str, transport: str, arrived: float) -> None:
        catalogue = self.catalogue
        label = model if model in catalogue.models or model in catalogue.apps else "unknown"
        self.metrics.requests.labels(model=label, outcome=outcome, transport=transport).inc()
        if outcome != "invalid":
            self.metrics.latency.labels(model=label).observe(time.monotonic() - arrived)


def http_answer(answer: InferResponse) -> InferResult:
    """The v2 HTTP response: JSON, with the outputs asked for in binary after it (Triton's extension)."""
    body, headers = encode_infer_response(
        answer.model, answer.version, answer.id,
        [(output.name, datatype, values) for output, datatype, values in answer.outputs],
        binary=[output.name for output, _, _ in answer.outputs if output.binary], parameters=answer.parameters)
    return InferResult(200, body, headers, answer.outcome)


def checked_version(predictor: Predictor, version: str | None) -> Predictor:
    if version is not None and version != predictor.version:
        raise ProtocolError(f"model '{predictor.name}' has no version '{version}' loaded; loaded: "
                            f"['{predictor.version}']", 404)
    return predictor


def final_answer_keeper(cache: PredictionCache, key: bytes) -> Callable[[Answer], None]:
    """Where a request's final answer goes to be cached (from any thread: the cache is thread-safe). The final
    answer, known once a bundle's batch has run to the end, never a ramp's label: thresholds move, and a cached
    early answer would be replayed unchecked."""
    return lambda final: cache.put(key, final)
