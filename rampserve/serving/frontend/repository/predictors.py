"""The models an application can put behind it, whatever they are: a prepared bundle served with early exits,
a plain torch module, an ONNX graph, a scikit-learn estimator, any Python callable, or a model behind another
Open Inference Protocol server (rampserve, Triton, MLServer).

Each is a `Predictor`: `await predict(inputs)` gives a label and a confidence per input row (what an application
asks of its models), and `await infer(request)` answers a whole v2 request (what the data plane asks of every
model): a bundle releases its label early, gives its logits when asked and hands its final answer to the
prediction cache once its batch has run to the end. In-process models that are not bundles run on a thread of
their own (one call at a time: a Python callable need not be thread-safe), with a bounded number of calls waiting,
so overload is refused instead of queued without bound.
"""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

import aiohttp
import numpy as np
import orjson

from rampserve.control.scores import top_label_and_error
from rampserve.serving.shared.contract import Answer, ModelRequest, Worker
from rampserve.serving.shared.models import LABEL_OUTPUT, V2_DATATYPES, ServedModel, TextInput
from rampserve.serving.shared.protocol import TensorSpec

# Remote answers are retried only when the remote did not run the request (it refused it or was unreachable),
# or the attempt timed out; a 4xx or a model failure would fail again.
RETRY_STATUSES = frozenset({429, 502, 503, 504})
# What every model but a bundle answers through v2: a label per input.
LABEL_TENSOR = TensorSpec(LABEL_OUTPUT, "INT64", (-1,))


class ModelUnavailable(Exception):
    """The model gave no answer: overloaded, unreachable, timed out or failed."""


def answer_from_scores(scores: np.ndarray) -> Answer:
    """Labels and confidences from what a model returns: labels (confidence 1, the model gave no other),
    probabilities (rows of non-negative numbers summing to 1) or logits (softmax)."""
    scores = np.asarray(scores)
    if scores.ndim == 1:
        if not np.issubdtype(scores.dtype, np.integer):
            raise ValueError(f"a model returning one value per input must return integer labels, got {scores.dtype}")
        return Answer(scores.astype(np.int64), np.ones(len(scores)))
    if scores.ndim != 2:
        raise ValueError(f"a model must return labels (rows,) or scores (rows, classes), got shape {scores.shape}")
    scores = scores.astype(np.float64)
    if np.all(scores >= 0) and np.allclose(scores.sum(axis=1), 1.0, atol=1e-4):
        return Answer(scores.argmax(axis=1).astype(np.int64), scores.max(axis=1))
    labels, errors = top_label_and_error(scores)
    return Answer(labels, 1.0 - errors)


class Predictor:
    name: str
    version: str
    kind: str
    inputs: tuple[TensorSpec, ...] | None  # None: not known until the model is asked (a bare callable)
    outputs: tuple[TensorSpec, ...] = (LABEL_TENSOR,)
    # Whether the prediction cache may answer for the model: its answer is a function of the inputs
    cacheable: bool = True
    # A prepared bundle's batching executor, which answers v2 inference itself and keeps its own status and
    # metrics; None for every other kind
    worker: Worker | None = None
    # Texts the model takes in place of its token inputs (a text model's bundle); None: its inputs alone
    text: TextInput | None = None

    @property
    def platform(self) -> str:
        """The v2 metadata's platform."""
        return f"rampserve_{self.kind}"

    @property
    def available(self) -> bool:
        """Whether the model serves now, once the server has started it (its readiness): a bundle's is not while its
        executor process restarts."""
        return True

    async def start(self) -> None:
        """Called once the event loop runs, before the first prediction."""

    async def predict(self, inputs: Mapping[str, np.ndarray], deadline_ms: float | None = None) -> Answer:
        """Labels and confidences per input row: what an application asks of each of its models."""
        raise NotImplementedError

    def problem_with(self, inputs: Mapping[str, np.ndarray], rows: int) -> str | None:
        """What is wrong with inputs the protocol accepted but the model cannot take, or None."""
        return None

    async def infer(self, request: ModelRequest) -> Answer:
        """The answer to a v2 request. A model's answer here is final as soon as it is given, so it goes to
        `on_final` too."""
        answer = await self.predict(request.inputs, request.deadline_ms)
        if request.on_final is not None:
            request.on_final(answer)
        return answer

    def count_cached(self, labels: np.ndarray) -> None:
        """Answers the prediction cache gave for the model, for books the model keeps (a bundle's controller)."""

    async def close(self) -> None:
        """Answer what was accepted, then release the model's resources."""

    def describe(self) -> dict:
        return {"name": self.name, "version": self.version, "kind": self.kind,
                "inputs": None if self.inputs is None else [spec.to_json() for spec in self.inputs]}

    async def status(self, latest_decisions: int | None = None) -> dict:
        """What `/status` shows of the model now: what it is, or for a bundle its executor's counts, latencies
        and the controller's latest decisions (None: all of them)."""
        return self.describe()


class WorkerPredictor(Predictor):
    """A prepared bundle: the server's batching executor with early exits and the Apparate controller."""

    kind = "bundle"

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.name, self.version, self.inputs = worker.served.name, worker.served.version, worker.served.inputs
        self.text = worker.served.text

    @property
    def served(self) -> ServedModel:
        return self.worker.served

    @property
    def outputs(self) -> tuple[TensorSpec, ...]:
        return self.served.outputs

    @property
    def platform(self) -> str:
        return self.served.platform

    @property
    def available(self) -> bool:
        return self.worker.available

    async def start(self) -> None:
        await self.worker.launch()

    async def predict(self, inputs: Mapping[str, np.ndarray], deadline_ms: float | None = None) -> Answer:
        return await self.infer(ModelRequest(inputs, deadline_ms=deadline_ms))

    def problem_with(self, inputs: Mapping[str, np.ndarray], rows: int) -> str | None:
        return self.served.check_limits(inputs)

    async def infer(self, request: ModelRequest) -> Answer:
        """The label as soon as a ramp or the final layer gives it; asking for the logits waits for the final
        layer. The final answer reaches `on_final` once the batch has run to the end, however early the
        response left; before this returns when the answer returned is the final one."""
        return await self.worker.submit(request)

    def count_cached(self, labels: np.ndarray) -> None:
        self.worker.count_cached(labels)

    async def status(self, latest_decisions: int | None = None) -> dict:
        return await self.worker.current_status(latest_decisions)

    async def close(self) -> None:
        await self.worker.shutdown()


class FunctionPredictor(Predictor):
    """Any callable from a dict of input arrays to labels, probabilities or logits, on a thread of its own."""

    def __init__(self, name: str, function: Callable[[dict[str, np.ndarray]], np.ndarray],
                 inputs: Sequence[TensorSpec] | None = None, kind: str = "python", version: str = "1",
                 max_waiting: int = 256) -> None:
        self.name, self.version, self.kind = name, version, kind
        self.inputs = None if inputs is None else tuple(inputs)
        self.function = function
        self.max_waiting = max_waiting
        self._waiting = 0
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=f"model-{name}")

    async def predict(self, inputs: Mapping[str, np.ndarray], deadline_ms: float | None = None) -> Answer:
        if self._waiting >= self.max_waiting:
            raise ModelUnavailable(f"model {self.name}: {self._waiting} calls waiting, at most {self.max_waiting}")
        self._waiting += 1
        try:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self._pool, self._call, dict(inputs))
        finally:
            self._waiting -= 1

    def _call(self, inputs: dict[str, np.ndarray]) -> Answer:
        return answer_from_scores(self.function(inputs))

    async def close(self) -> None:
        await asyncio.to_thread(self._pool.shutdown, wait=True)


def sklearn_predictor(name: str, estimator: object, inputs: TensorSpec, version: str = "1") -> Predictor:
    """A fitted scikit-learn classifier over one input, flattened to a row per input; probabilities from
    `predict_proba` where it has one, mapped to the estimator's own class labels."""
    classes = np.asarray(estimator.classes_)
    if not np.issubdtype(classes.dtype, np.integer):
        raise ValueError(f"model {name}: class labels must be integers, got {classes.dtype}")

    def run(feeds: dict[str, np.ndarray]) -> np.ndarray:
        rows = feeds[inputs.name].reshape(len(feeds[inputs.name]), -1)
        if not hasattr(estimator, "predict_proba"):
            return np.asarray(estimator.predict(rows), dtype=np.int64)
        probabilities = estimator.predict_proba(rows)
        # Columns follow classes_; spread them over label positions so argmax is the label itself.
        scores = np.zeros((len(rows), int(classes.max()) + 1))
        scores[:, classes] = probabilities
        return scores

    return FunctionPredictor(name, run, (inputs,), "sklearn", version)


class RemotePredictor(Predictor):
    """A model behind an Open Inference Protocol (v2) endpoint. Each attempt has a timeout; attempts the
    remote did not run (refused, unreachable) or that timed out are retried with the same request id, one at a
    time, so at most one answer ever comes back."""

    kind = "remote"
    # The remote's answer may be a ramp's (another rampserve releases early), which a cache would replay unchecked
    cacheable = False

    def __init__(self, name: str, url: str, model: str, version: str | None = None, timeout_ms: float = 1000.0,
                 retries: int = 1, label_output: str = "label", scores_output: str | None = None,
                 inputs: Sequence[TensorSpec] | None = None) -> None:
        if timeout_ms <= 0 or retries < 0:
            raise ValueError("a remote model needs a positive timeout and a non-negative number of retries")
        self.name, self.url, self.model, self.version = name, url.rstrip("/"), model, version or "1"
        self.timeout_ms, self.retries = timeout_ms, retries
        self.label_output, self.scores_output = label_output, scores_output
        self.inputs = None if inputs is None else tuple(inputs)
        path = f"/v2/models/{model}" + (f"/versions/{version}" if version else "")
        self.endpoint = self.url + path
        self.attempts = 0
        self.retried = 0
        self._ids = itertools.count()
        self._session: aiohttp.ClientSession | None = None
        self._in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:  # made inside the running loop, which aiohttp requires
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=256))
        return self._session

    async def start(self) -> None:
        if self.inputs is not None:
            return
        timeout = aiohttp.ClientTimeout(total=max(self.timeout_ms, 1000.0) / 1000.0)
        try:
            async with self._client().get(self.endpoint, timeout=timeout) as response:
                metadata = await response.json(content_type=None)
                if response.status != 200:
                    raise ModelUnavailable(f"remote model {self.endpoint}: {response.status} {metadata}")
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise ModelUnavailable(f"remote model {self.endpoint} is unreachable: {exc!r}") from None
        self.inputs = tuple(TensorSpec(t["name"], t["datatype"], tuple(t["shape"])) for t in metadata["inputs"])

    def request_body(self, inputs: Mapping[str, np.ndarray], request_id: str, deadline_ms: float | None) -> bytes:
        tensors = [{"name": name, "shape": list(array.shape), "datatype": V2_DATATYPES[array.dtype],
                    "data": array.ravel().tolist()} for name, array in inputs.items()]
        outputs = [{"name": self.label_output}]
        if self.scores_output:
            outputs.append({"name": self.scores_output})
        request = {"id": request_id, "inputs": tensors, "outputs": outputs}
        if deadline_ms is not None:
            request["parameters"] = {"deadline_ms": deadline_ms}
        return orjson.dumps(request)

    def read_answer(self, body: dict) -> Answer:
        outputs = {o.get("name"): o for o in body.get("outputs", [])}
        if self.label_output not in outputs:
            raise ModelUnavailable(f"remote model {self.endpoint} answered without output '{self.label_output}'")
        labels = np.asarray(outputs[self.label_output]["data"], dtype=np.int64)
        parameters = body.get("parameters") or {}
        if "confidence" in parameters:  # rampserve's own answers carry it
            confidences = np.atleast_1d(np.asarray(parameters["confidence"], dtype=np.float64))
        elif self.scores_output in outputs:
            scores = outputs[self.scores_output]
            confidences = answer_from_scores(np.reshape(scores["data"], scores["shape"])).confidences
        else:
            confidences = np.ones(len(labels))
        return Answer(labels, confidences)

    async def predict(self, inputs: Mapping[str, np.ndarray], deadline_ms: float | None = None) -> Answer:
        self._in_flight += 1
        self._idle.clear()
        try:
            return await self._predict(inputs, deadline_ms)
        finally:
            self._in_flight -= 1
            if not self._in_flight:
                self._idle.set()

    async def _predict(self, inputs: Mapping[str, np.ndarray], deadline_ms: float | None) -> Answer:
        request_id = f"{self.name}-{uuid.uuid4().hex[:12]}-{next(self._ids)}"
        give_up = None if deadline_ms is None else time.perf_counter() + deadline_ms / 1000.0
        problem = "no attempt was made"
        for attempt in range(self.retries + 1):
            remaining_ms = None if give_up is None else (give_up - time.perf_counter()) * 1000.0
            if attempt and remaining_ms is not None and remaining_ms <= 0:
                break  # retry only while the caller still waits for the answer
            self.attempts += 1
            self.retried += attempt > 0
            # The remote learns the deadline and refuses work it cannot finish in time; an attempt it takes
            # is waited for up to timeout_ms even past the deadline, so a late answer still reaches the
            # caller (an application keeps it for feedback).
            body = self.request_body(inputs, request_id, None if remaining_ms is None else max(remaining_ms, 1.0))
            try:
                async with asyncio.timeout(self.timeout_ms / 1000.0):
                    async with self._client().post(self.endpoint + "/infer", data=body,
                                                   headers={"Content-Type": "application/json"}) as response:
                        answer = await response.json(content_type=None)
                if response.status == 200:
                    return self.read_answer(answer)
                problem = f"{response.status}: {answer.get('error', answer) if isinstance(answer, dict) else answer}"
                if response.status not in RETRY_STATUSES:
                    break
            except TimeoutError:
                problem = f"no answer within {self.timeout_ms:.0f} ms"
            except (aiohttp.ClientError, ValueError) as exc:
                problem = repr(exc)
        raise ModelUnavailable(f"remote model {self.endpoint}: {problem}")

    async def close(self) -> None:
        # Requests in flight finish first (each is bounded by its attempts' timeouts): a swap fails none.
        await self._idle.wait()
        if self._session is not None:
            await self._session.close()
            self._session = None

    def describe(self) -> dict:
        return {**super().describe(), "url": self.url, "model": self.model, "timeout_ms": self.timeout_ms,
                "retries": self.retries, "attempts": self.attempts, "retried": self.retried}
