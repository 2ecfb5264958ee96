"""The HTTP load generator of `rampserve bench live`: its own process, so the client never shares an
interpreter (or a GIL) with the server or with the benchmark that starts both.

`python -m rampserve.bench.loadgen JOB OUT` reads a job (`save_job`), sends its requests to a KServe v2
infer endpoint, over HTTP with Triton's binary-data extension (or plain JSON) or over gRPC (raw tensor contents, one
HTTP/2 connection), and writes what happened to each request (`LoadResult`).

- **Open loop** (`Job.clients == 0`): request i is sent at its arrival time whatever the server has answered,
  after a warm-up run whose results are discarded. A pacing thread sleeps until each arrival (`time.sleep` wakes
  within tens of microseconds; the event loop's timers only have millisecond resolution) and hands the request
  to the event loop. Latency is measured from the scheduled arrival, so a late client counts against the system.
- **Closed loop** (`Job.clients > 0`): that many clients, each sending its next request when the last one is
  answered, for a duration or a number of requests: the server's saturation throughput, or (one client) its
  latency with nothing else queued.

Every request body is encoded before the clock starts. Times are `time.perf_counter` milliseconds from the
start of the measured run. A job that traces (`Job.trace`) asks the server for each answer's trace and keeps its
steps (`TRACE_STEPS`) on the same clock: on Linux the server's `time.monotonic()` and this process's
`time.perf_counter()` are one clock, CLOCK_MONOTONIC.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import heapq
import itertools
import json
import math
import re
import select
import socket
import sys
import threading
import time
import urllib.request
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp
import grpc
import numpy as np
import orjson
import uvloop
from tritonclient.grpc import service_pb2 as pb

from rampserve.bench.cpu import read_tree

# KServe v2 tensor datatypes (BYTES has no fixed width and is not sent by this benchmark).
V2_DTYPES = {"BOOL": np.bool_, "UINT8": np.uint8, "UINT16": np.uint16, "UINT32": np.uint32, "UINT64": np.uint64,
             "INT8": np.int8, "INT16": np.int16, "INT32": np.int32, "INT64": np.int64, "FP16": np.float16,
             "FP32": np.float32, "FP64": np.float64}
TIMED_OUT = 0  # status of a request with no answer within the job's timeout
CLIENT_ERROR = -1  # status of a request whose connection failed or whose answer could not be read
SHED_STATUSES = (429, 503)
NUMBER = re.compile(r"\d+(\.\d+)?")  # error messages are counted with their figures left out
# aiohttp closes idle pooled connections after this long: sooner than servers do (uvicorn: 5 s), so a request is
# never written to a connection the server is closing at that moment (a POST is not retried).
CLIENT_KEEPALIVE_S = 3.0
LEAN_CONNECTIONS = 512  # the lean client waits with select(), which takes descriptors below 1024
# The steps of a traced answer (rampserve's `plane.traced`), in the order a request passes them
TRACE_STEPS = ("in", "submitted", "admitted", "started", "ran", "signalled", "released", "received", "resumed", "answered")
GRPC_SCHEME = "grpc://"
GRPC_INFER = "/inference.GRPCInferenceService/ModelInfer"
# gRPC refusals as the HTTP statuses the results count: RESOURCE_EXHAUSTED is shed, as 429 is; UNAVAILABLE is the
# server's 503 (an executor restarting), though a connection that failed reads the same over gRPC
GRPC_STATUSES = {grpc.StatusCode.RESOURCE_EXHAUSTED: 429, grpc.StatusCode.UNAVAILABLE: 503,
                 grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.NOT_FOUND: 404, grpc.StatusCode.INTERNAL: 500}


def grpc_url(port: int, model: str, host: str = "127.0.0.1") -> str:
    """A job's `url` for a model served over gRPC (KServe v2's GRPCInferenceService)."""
    return f"{GRPC_SCHEME}{host}:{port}/{model}"


@dataclass(frozen=True)
class Job:
    url: str  # the model's infer endpoint: http://host:port/v2/models/{model}/infer, or grpc_url()
    inputs: tuple[tuple[str, str], ...]  # (name, v2 datatype) of each model input, in the model's order
    output: str  # the output whose first value is the released label
    status_url: str | None  # read after the warm-up and at the end (the server's batch counts); None: not read
    timeout_s: float = 10.0
    max_connections: int = 2048  # HTTP/1.1 has one request in flight per connection: bounds the requests in flight
    clients: int = 0  # 0: open loop over the arrival times; otherwise closed loop with this many clients
    duration_s: float | None = None  # closed loop: start no request after this long ...
    requests: int | None = None  # ... or after this many
    # Closed loop: how long a client whose request was shed or failed waits before its next one. Refusals are
    # cheap and immediate: clients that resend at once keep the server busy refusing instead of serving.
    refused_pause_ms: float = 0.0
    # Plain v2 JSON bodies instead of Triton's binary tensors: for servers without the extension (MLServer).
    json_bodies: bool = False
    # The server's process: its tree's CPU (`cpu.read_tree`) is read with each status. None: not read.
    cpu_pid: int | None = None
    # HTTP from one thread on blocking sockets (`LeanHttpClient`) instead of aiohttp on the event loop: the
    # server's time with as little of the client's own as Python allows, as a native client measures it
    lean: bool = False
    # Ask the server for each answer's trace (a rampserve server's `trace` parameter) and keep it (`LoadResult.trace_ms`)
    trace: bool = False

    def __post_init__(self) -> None:
        if self.lean and self.over_grpc:
            raise ValueError("the lean client speaks HTTP only")

    @property
    def over_grpc(self) -> bool:
        return self.url.startswith(GRPC_SCHEME)


@dataclass
class LoadResult:
    """One row per measured request, in the order the requests were issued (open loop: arrival order)."""

    scheduled_ms: np.ndarray  # arrival time (closed loop: when its client issued it)
    sent_ms: np.ndarray  # when the client began sending it
    done_ms: np.ndarray  # when its answer was read (or the request failed)
    status: np.ndarray  # HTTP status, TIMED_OUT or CLIENT_ERROR
    label: np.ndarray  # released label, -1 without an answer
    early: np.ndarray  # released before the last stage
    exit_site: np.ndarray  # index into `sites` of the ramp that released it; -1: the final layer or no answer
    sites: tuple[str, ...]
    errors: dict[str, int]  # every outcome other than an answer, by message, for the report
    status_before: dict | str | None  # the server's status after the warm-up (a string: why it could not be read)
    status_after: dict | str | None  # ... and once every measured request was answered
    cpu_before: dict | None = None  # the server's CPU (`cpu.read_tree`) read with status_before
    cpu_after: dict | None = None  # ... and with status_after
    wall_origin_s: float | None = None  # the measured run's time 0 as time.time(): to set its requests beside events
    # A traced job's: per request, when its answer passed each of `TRACE_STEPS` (ms on the clock of `sent_ms`; NaN
    # where the answer has no such step, or no trace); None for a job that does not trace
    trace_ms: np.ndarray | None = None

    @property
    def ok(self) -> np.ndarray:
        return self.status == 200

    @property
    def shed(self) -> np.ndarray:
        return np.isin(self.status, SHED_STATUSES)

    @property
    def failed(self) -> np.ndarray:
        return ~(self.ok | self.shed)

    @property
    def latency_ms(self) -> np.ndarray:
        return self.done_ms - self.scheduled_ms

    @classmethod
    def joined(cls, parts: Sequence[LoadResult], offsets_ms: Sequence[float]) -> LoadResult:
        """One replay from consecutive slices of it, each run from its own time 0 (`offsets_ms`: where each began in
        the replay's schedule), on the schedule's clock. Statuses and CPU readings are the first slice's before and
        the last one's after: they span whatever ran between the slices too. Exit sites are numbered over all
        slices. No wall origin: the slices' own clocks are not one clock."""
        if not parts or len(parts) != len(offsets_ms):
            raise ValueError(f"{len(parts)} slices with {len(offsets_ms)} offsets")
        timed = ("scheduled_ms", "sent_ms", "done_ms")
        # each slice numbers the exit sites in the order its answers named them
        sites = tuple(dict.fromkeys(site for part in parts for site in part.sites))
        position = {site: k for k, site in enumerate(sites)}
        # -1 (no exit) indexes the lookup's last entry, -1
        exit_site = np.concatenate([np.array([*(position[site] for site in part.sites), -1])[part.exit_site]
                                    for part in parts])

        def column(name: str) -> np.ndarray:  # adding 0 to the others would make `early` an integer array
            return np.concatenate([getattr(part, name) + offset if name in timed else getattr(part, name)
                                   for part, offset in zip(parts, offsets_ms, strict=True)])

        traces = [part.trace_ms for part in parts]
        errors: Counter[str] = Counter()
        for part in parts:
            errors.update(part.errors)
        first, last = parts[0], parts[-1]
        return cls(**{name: column(name) for name in (*timed, "status", "label", "early")}, exit_site=exit_site,
                   sites=sites, errors=dict(errors), status_before=first.status_before,
                   status_after=last.status_after, cpu_before=first.cpu_before, cpu_after=last.cpu_after,
                   trace_ms=None if any(t is None for t in traces) else
                   np.concatenate([t + offset for t, offset in zip(traces, offsets_ms, strict=True)]))

    def save(self, path: Path) -> None:
        arrays = {k: v for k, v in vars(self).items() if isinstance(v, np.ndarray)}
        meta = {k: v for k, v in vars(self).items() if not isinstance(v, np.ndarray)}
        np.savez(path, meta=np.array(json.dumps(meta)), **arrays)

    @classmethod
    def load(cls, path: Path) -> LoadResult:
        with np.load(path) as data:
            meta = json.loads(str(data["meta"]))
            arrays = {k: data[k] for k in data.files if k != "meta"}
        arrays.setdefault("trace_ms", None)
        return cls(**arrays, sites=tuple(meta["sites"]), errors=meta["errors"], status_before=meta["status_before"],
                   status_after=meta["status_after"], cpu_before=meta.get("cpu_before"),
                   cpu_after=meta.get("cpu_after"), wall_origin_s=meta.get("wall_origin_s"))


# --- jobs on disk: the spec as JSON, each input as one flat array plus per-request shapes -----------------------

def save_job(path: Path, job: Job, requests: list[dict[str, np.ndarray]], arrivals_ms: np.ndarray | None = None,
             warmup_arrivals_ms: np.ndarray | None = None) -> None:
    """Open loop: `requests` holds the warm-up's requests, then one per arrival. Closed loop: the clients cycle
    through `requests`. Each request maps every input name of `job.inputs` to its array."""
    arrays: dict[str, np.ndarray] = {}
    for k, (name, datatype) in enumerate(job.inputs):
        dtype = V2_DTYPES[datatype]
        tensors = [np.asarray(request[name], dtype=dtype) for request in requests]
        arrays[f"input{k}_data"] = np.concatenate([t.ravel() for t in tensors])
        arrays[f"input{k}_shapes"] = np.array([t.shape for t in tensors], dtype=np.int64)
    times = {"arrivals_ms": arrivals_ms, "warmup_arrivals_ms": warmup_arrivals_ms}
    arrays |= {k: np.asarray(v, dtype=np.float64) for k, v in times.items() if v is not None}
    np.savez(path, job=np.array(json.dumps(asdict(job))), **arrays)


def load_job(path: Path) -> tuple[Job, list[dict[str, np.ndarray]], np.ndarray, np.ndarray]:
    """(job, requests, arrival times, warm-up arrival times); the times are empty for a closed-loop job."""
    with np.load(path) as data:
        spec = json.loads(str(data["job"]))
        job = Job(**(spec | {"inputs": tuple(tuple(i) for i in spec["inputs"])}))
        columns = []
        for k, _ in enumerate(job.inputs):
            shapes = data[f"input{k}_shapes"]
            ends = np.cumsum(np.prod(shapes, axis=1))
            flat = np.split(data[f"input{k}_data"], ends[:-1])
            columns.append([values.reshape(shape) for values, shape in zip(flat, shapes)])
        empty = np.zeros(0)
        arrivals = data["arrivals_ms"] if "arrivals_ms" in data.files else empty
        warmup = data["warmup_arrivals_ms"] if "warmup_arrivals_ms" in data.files else empty
    names = [name for name, _ in job.inputs]
    requests = [dict(zip(names, tensors)) for tensors in zip(*columns)]
    return job, requests, arrivals, warmup


def encode_request(job: Job, request: dict[str, np.ndarray]) -> tuple[bytes, dict[str, str]]:
    """Body and headers of a v2 infer request with Triton's binary-data extension: the JSON header, then each
    input's raw little-endian bytes; the label comes back as JSON. With `job.json_bodies`, plain v2 JSON; over
    gRPC, a ModelInferRequest with raw contents (and no headers)."""
    if job.over_grpc:
        return encode_grpc_request(job, request), {}
    if job.json_bodies:
        return encode_json_request(job, request)
    tensors = [np.asarray(request[name], dtype=np.dtype(V2_DTYPES[datatype]).newbyteorder("<"))
               for name, datatype in job.inputs]
    header = {
        "inputs": [{"name": name, "shape": list(t.shape), "datatype": datatype,
                    "parameters": {"binary_data_size": t.nbytes}} for (name, datatype), t in zip(job.inputs, tensors)],
        "outputs": [{"name": job.output, "parameters": {"binary_data": False}}],
        **request_parameters(job),
    }
    head = json.dumps(header).encode()
    body = head + b"".join(t.tobytes() for t in tensors)
    return body, {"Inference-Header-Content-Length": str(len(head)), "Content-Type": "application/octet-stream"}


def encode_json_request(job: Job, request: dict[str, np.ndarray]) -> tuple[bytes, dict[str, str]]:
    inputs = []
    for name, datatype in job.inputs:
        tensor = np.asarray(request[name], dtype=V2_DTYPES[datatype])
        inputs.append({"name": name, "shape": list(tensor.shape), "datatype": datatype,
                       "data": tensor.ravel().tolist()})
    return json.dumps({"inputs": inputs, "outputs": [{"name": job.output}], **request_parameters(job)}).encode(), \
        {"Content-Type": "application/json"}


def request_parameters(job: Job) -> dict:
    """What a v2 request's `parameters` hold for `job`: the trace where it asks for one."""
    return {"parameters": {"trace": True}} if job.trace else {}


def encode_grpc_request(job: Job, request: dict[str, np.ndarray]) -> bytes:
    message = pb.ModelInferRequest(model_name=job.url.rsplit("/", 1)[1])
    for name, datatype in job.inputs:
        tensor = np.asarray(request[name], dtype=np.dtype(V2_DTYPES[datatype]).newbyteorder("<"))
        message.inputs.add(name=name, datatype=datatype, shape=tensor.shape)
        message.raw_input_contents.append(tensor.tobytes())
    message.outputs.add(name=job.output)
    if job.trace:
        message.parameters["trace"].bool_param = True
    return message.SerializeToString()


def read_grpc_answer(payload: bytes, output: str) -> tuple[int, bool, str | None, dict | None]:
    """(label, early, exit site, trace) from a ModelInferResponse, its outputs raw or typed (MLServer answers
    typed)."""
    answer = pb.ModelInferResponse.FromString(payload)
    index = next(i for i, o in enumerate(answer.outputs) if o.name == output)
    tensor = answer.outputs[index]
    if answer.raw_output_contents:
        label = int(np.frombuffer(answer.raw_output_contents[index], V2_DTYPES[tensor.datatype])[0])
    else:
        label = int(next(values for _, values in tensor.contents.ListFields())[0])
    parameters = answer.parameters
    early = "early" in parameters and parameters["early"].bool_param
    site = parameters["exit_site"].string_param if "exit_site" in parameters else None  # none: the final layer
    trace = orjson.loads(parameters["trace"].string_param) if "trace" in parameters else None  # a dict goes as JSON
    return label, early, site, trace


def read_answer(payload: bytes, output: str) -> tuple[int, bool, str | None, dict | None]:
    """(label, early, exit site, trace) from a v2 infer response."""
    answer = orjson.loads(payload)
    data = next(o for o in answer["outputs"] if o["name"] == output)["data"]
    parameters = answer.get("parameters") or {}
    return int(data[0]), bool(parameters.get("early", False)), parameters.get("exit_site"), parameters.get("trace")


def fetch_status(url: str | None) -> dict | str | None:
    if url is None:
        return None
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return json.loads(response.read())
    except (OSError, ValueError) as exc:  # urllib's HTTP and connection errors are OSErrors
        return f"GET {url}: {exc}"


def read_cpu(pid: int | None) -> dict | None:
    return None if pid is None else read_tree(pid)


# --- the client ---------------------------------------------------------------------------------------------------

class _Recorder:
    """Collects request outcomes as requests end; `result` puts them back in the order they were issued."""

    def __init__(self, job: Job) -> None:
        self.job = job
        self.read = read_grpc_answer if job.over_grpc else read_answer
        self.rows: list[tuple[int, float, float, float, int, int, bool, int]] = []
        self.sites: dict[str, int] = {}
        self.errors: Counter[str] = Counter()
        self.traces: dict[int, tuple[float, ...]] = {}  # per request answered with a trace: its steps, in seconds

    def add(self, index: int, scheduled_ms: float, sent_ms: float, done_ms: float, status: int, label: int = -1,
            early: bool = False, site: str | None = None, trace: dict | None = None) -> None:
        site_index = -1 if site is None else self.sites.setdefault(site, len(self.sites))
        self.rows.append((index, scheduled_ms, sent_ms, done_ms, status, label, early, site_index))
        if trace is not None:
            self.traces[index] = tuple(math.nan if trace.get(step) is None else trace[step] for step in TRACE_STEPS)

    def answered(self, index: int, scheduled_ms: float, sent_ms: float, done_ms: float, status: int, payload: bytes
                 ) -> int:
        """Record a request the server answered (a refusal too); returns its status."""
        if status != 200:
            transport = "gRPC" if self.job.over_grpc else "HTTP"
            self.errors[f"{transport} {status}: {NUMBER.sub('#', payload[:200].decode(errors='replace'))}"] += 1
            self.add(index, scheduled_ms, sent_ms, done_ms, status)
            return status
        try:
            label, early, site, trace = self.read(payload, self.job.output)
        except (ValueError, KeyError, IndexError, TypeError, StopIteration) as exc:
            self.errors[f"unreadable answer ({type(exc).__name__}: {exc}): {payload[:200]!r}"] += 1
            self.add(index, scheduled_ms, sent_ms, done_ms, CLIENT_ERROR)
            return CLIENT_ERROR
        self.add(index, scheduled_ms, sent_ms, done_ms, status, label, early, site, trace)
        return status

    def failed(self, index: int, scheduled_ms: float, sent_ms: float, done_ms: float, exc: BaseException) -> int:
        """Record a request with no answer: timed out, or its connection failed; returns its status."""
        if isinstance(exc, TimeoutError):
            self.errors[f"no answer within {self.job.timeout_s} s"] += 1
            status = TIMED_OUT
        else:
            self.errors[f"{type(exc).__name__}: {exc}"] += 1
            status = CLIENT_ERROR
        self.add(index, scheduled_ms, sent_ms, done_ms, status)
        return status

    def result(self, origin_s: float, status_before: dict | str | None, status_after: dict | str | None,
               cpu_before: dict | None = None, cpu_after: dict | None = None) -> LoadResult:
        """`origin_s`: the measured run's time 0, `time.perf_counter()` seconds."""
        rows = sorted(self.rows)
        columns = list(zip(*rows)) if rows else [()] * 8
        as_array = [np.array(c, dtype=t) for c, t in zip(columns, (np.int64, np.float64, np.float64, np.float64,
                                                                   np.int64, np.int64, bool, np.int64))]
        trace_ms = None
        if self.job.trace:
            nothing = (math.nan,) * len(TRACE_STEPS)
            trace_ms = (np.array([self.traces.get(int(i), nothing) for i in as_array[0]], dtype=np.float64)
                        .reshape(-1, len(TRACE_STEPS)) - origin_s) * 1000.0
        return LoadResult(*as_array[1:], sites=tuple(self.sites), errors=dict(self.errors),
                          status_before=status_before, status_after=status_after, cpu_before=cpu_before,
                          cpu_after=cpu_after, trace_ms=trace_ms)


class _Client:
    """Requests as event-loop tasks through `send` (aiohttp over HTTP, grpc.aio over gRPC)."""

    def __init__(self, job: Job, send: Callable[[tuple[bytes, dict[str, str]]], Awaitable[tuple[int, bytes]]]
                 ) -> None:
        self.job, self.send = job, send
        self.origin = time.perf_counter()

    def now_ms(self) -> float:
        return (time.perf_counter() - self.origin) * 1000.0

    async def issue(self, recorder: _Recorder, index: int, scheduled_ms: float, body: tuple[bytes, dict[str, str]]
                    ) -> int:
        """Send one request and record how it ended; returns its status."""
        sent = self.now_ms()
        try:
            status, payload = await self.send(body)
        except (TimeoutError, aiohttp.ClientError, OSError, grpc.aio.AioRpcError) as exc:
            return recorder.failed(index, scheduled_ms, sent, self.now_ms(), exc)
        return recorder.answered(index, scheduled_ms, sent, self.now_ms(), status, payload)

    async def open_loop(self, bodies: list[tuple[bytes, dict[str, str]]], arrivals_ms: np.ndarray) -> _Recorder:
        """Request i at arrivals_ms[i] from now on, whatever has been answered; returns once all have ended."""
        loop = asyncio.get_running_loop()
        recorder = _Recorder(self.job)
        tasks: list[asyncio.Task] = []
        all_launched = asyncio.Event()
        self.origin = time.perf_counter()

        def launch(i: int) -> None:
            tasks.append(loop.create_task(self.issue(recorder, i, float(arrivals_ms[i]), bodies[i])))

        def pace() -> None:
            for i, at_ms in enumerate(arrivals_ms):
                delay = self.origin + at_ms / 1000.0 - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
                loop.call_soon_threadsafe(launch, i)
            loop.call_soon_threadsafe(all_launched.set)  # callbacks run in order: after the last launch

        threading.Thread(target=pace, name="pacer", daemon=True).start()
        await all_launched.wait()
        await asyncio.gather(*tasks)
        return recorder

    async def closed_loop(self, bodies: list[tuple[bytes, dict[str, str]]]) -> _Recorder:
        recorder = _Recorder(self.job)
        issued = itertools.count()
        self.origin = time.perf_counter()
        job = self.job

        async def client() -> None:
            for index in issued:
                now = self.now_ms()
                if (job.requests is not None and index >= job.requests) or \
                        (job.duration_s is not None and now >= job.duration_s * 1000.0):
                    return
                if await self.issue(recorder, index, now, bodies[index % len(bodies)]) != 200:
                    await asyncio.sleep(job.refused_pause_ms / 1000.0)

        await asyncio.gather(*(client() for _ in range(job.clients)))
        return recorder


def http_sender(job: Job, session: aiohttp.ClientSession
                ) -> Callable[[tuple[bytes, dict[str, str]]], Awaitable[tuple[int, bytes]]]:
    async def send(body: tuple[bytes, dict[str, str]]) -> tuple[int, bytes]:
        async with session.post(job.url, data=body[0], headers=body[1]) as response:
            return response.status, await response.read()

    return send


class _Connection:
    """One kept-alive HTTP/1.1 connection of the lean client and the request it carries, if any."""

    def __init__(self, address: tuple[str, int], timeout_s: float) -> None:
        self.socket = socket.create_connection(address, timeout_s)
        self.socket.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.received = bytearray()
        self.request: tuple[int, float, float] | None = None  # (index, scheduled_ms, sent_ms) in flight
        self.idle_since = 0.0  # perf_counter seconds

    def answer(self) -> tuple[int, bytes] | None:
        """(status, body) once the whole response is in; the bytes past it stay for the next."""
        received = self.received
        if (end := received.find(b"\r\n\r\n")) < 0:
            return None
        head = bytes(received[:end]).decode("latin-1").split("\r\n")
        fields = {name.strip().lower(): value.strip() for name, value in (line.split(":", 1) for line in head[1:])}
        stop = end + 4 + int(fields["content-length"])
        if len(received) < stop:
            return None
        body = bytes(received[end + 4:stop])
        del received[:stop]
        return int(head[0].split(" ", 2)[1]), body


class LeanHttpClient:
    """Every request of a run from one thread on blocking sockets, one request in flight per kept-alive HTTP/1.1
    connection: `select` waits for the next answer and the next request's time together (to the microsecond), and
    no event loop, task or parser object stands between the server's answer and the clock. On the machine the
    server runs on, the client's own CPU delays the answers it times: aiohttp's event loop read answers released
    mid-run 1.5 ms later than this client did. A connection whose request failed is closed; one idle longer than
    the server keeps it is never reused (a POST is not retried). Its loops are coroutines only to stand where the
    event-loop clients' do: each blocks until every request has ended."""

    def __init__(self, job: Job) -> None:
        url = urlsplit(job.url)
        self.job, self.address = job, (url.hostname, url.port)
        self.start = f"POST {url.path} HTTP/1.1\r\nHost: {url.netloc}\r\n".encode()
        self.idle: list[_Connection] = []  # the most recently used last: it is reused first
        self.busy: dict[socket.socket, _Connection] = {}
        self.origin = time.perf_counter()

    def now_ms(self) -> float:
        return (time.perf_counter() - self.origin) * 1000.0

    async def open_loop(self, bodies: list[tuple[bytes, dict[str, str]]], arrivals_ms: np.ndarray) -> _Recorder:
        return self._run(bodies, [(float(at), i) for i, at in enumerate(arrivals_ms)], None)

    async def closed_loop(self, bodies: list[tuple[bytes, dict[str, str]]]) -> _Recorder:
        first = self.job.clients if self.job.requests is None else min(self.job.clients, self.job.requests)
        return self._run(bodies, [(0.0, i) for i in range(first)], itertools.count(first))

    def _run(self, bodies: list[tuple[bytes, dict[str, str]]], due: list[tuple[float, int]],
             issued: Iterator[int] | None) -> _Recorder:
        """Send each request when it is due (`due`, a heap of (ms, index)); in closed loop (`issued`) an ended
        request's client takes the next index, at once or after the job's pause for a refusal."""
        job, recorder, waiting = self.job, _Recorder(self.job), deque[tuple[int, float]]()
        heapq.heapify(due)
        self.origin = time.perf_counter()

        def ended(status: int) -> None:
            if issued is None:
                return
            now, index = self.now_ms(), next(issued)
            if (job.requests is None or index < job.requests) and \
                    (job.duration_s is None or now < job.duration_s * 1000.0):
                heapq.heappush(due, (now + (0.0 if status == 200 else job.refused_pause_ms), index))

        while due or waiting or self.busy:
            now = self.now_ms()
            while due and due[0][0] <= now:
                at, index = heapq.heappop(due)
                waiting.append((index, at if issued is None else now))
            while waiting and len(self.busy) < min(job.max_connections, LEAN_CONNECTIONS):
                index, scheduled = waiting.popleft()
                if (status := self._send(recorder, index, scheduled, bodies[index % len(bodies)])) is not None:
                    ended(status)
            deadlines = [c.request[2] + job.timeout_s * 1000.0 for c in self.busy.values()]
            wake = min(deadlines + ([due[0][0]] if due else []), default=now)
            readable, _, _ = select.select(list(self.busy), [], [], max(0.0, wake - self.now_ms()) / 1000.0)
            for sock in readable:
                if (status := self._receive(recorder, self.busy[sock])) is not None:
                    ended(status)
            for connection in [c for c in self.busy.values() if self.now_ms() > c.request[2] + job.timeout_s * 1e3]:
                ended(self._fail(recorder, connection, TimeoutError()))
        return recorder

    def _send(self, recorder: _Recorder, index: int, scheduled: float, body: tuple[bytes, dict[str, str]]
              ) -> int | None:
        """Write the request on a kept-alive connection; the status if it failed at once."""
        now = time.perf_counter()
        while self.idle and now - self.idle[-1].idle_since > CLIENT_KEEPALIVE_S:
            self.idle.pop().socket.close()  # the next to be reused is the newest: past it, all are older
        sent = self.now_ms()
        try:
            connection = self.idle.pop() if self.idle else _Connection(self.address, self.job.timeout_s)
        except OSError as exc:
            return recorder.failed(index, scheduled, sent, self.now_ms(), exc)
        connection.request = (index, scheduled, sent)
        self.busy[connection.socket] = connection
        headers = "".join(f"{name}: {value}\r\n" for name, value in body[1].items())
        try:
            connection.socket.sendall(self.start + f"{headers}Content-Length: {len(body[0])}\r\n\r\n".encode()
                                      + body[0])
        except OSError as exc:
            return self._fail(recorder, connection, exc)
        return None

    def _receive(self, recorder: _Recorder, connection: _Connection) -> int | None:
        """Read what arrived on a busy connection; the request's status once its answer is whole."""
        try:
            data = connection.socket.recv(1 << 16)
            if not data:
                raise ConnectionError("the server closed the connection")
            connection.received += data
            answer = connection.answer()
        except (OSError, ValueError, KeyError, IndexError) as exc:
            return self._fail(recorder, connection, exc)
        if answer is None:
            return None
        done = self.now_ms()
        index, scheduled, sent = connection.request
        del self.busy[connection.socket]
        connection.request, connection.idle_since = None, time.perf_counter()
        self.idle.append(connection)
        return recorder.answered(index, scheduled, sent, done, *answer)

    def _fail(self, recorder: _Recorder, connection: _Connection, exc: BaseException) -> int:
        index, scheduled, sent = connection.request
        del self.busy[connection.socket]
        connection.socket.close()
        return recorder.failed(index, scheduled, sent, self.now_ms(), exc)

    def close(self) -> None:
        for connection in [*self.idle, *self.busy.values()]:
            connection.socket.close()
        self.idle, self.busy = [], {}


def grpc_sender(job: Job, channel: grpc.aio.Channel
                ) -> Callable[[tuple[bytes, dict[str, str]]], Awaitable[tuple[int, bytes]]]:
    """ModelInfer with the request already serialised; the answer is parsed once the clock has stopped."""
    call = channel.unary_unary(GRPC_INFER)  # bytes in and out

    async def send(body: tuple[bytes, dict[str, str]]) -> tuple[int, bytes]:
        try:
            return 200, await call(body[0], timeout=job.timeout_s)
        except grpc.aio.AioRpcError as error:
            if error.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise TimeoutError from None
            if error.code() not in GRPC_STATUSES:
                raise
            return GRPC_STATUSES[error.code()], f"{error.code().name}: {error.details()}".encode()

    return send


async def run_job(job: Job, requests: list[dict[str, np.ndarray]], arrivals_ms: np.ndarray,
                  warmup_arrivals_ms: np.ndarray) -> LoadResult:
    bodies = [encode_request(job, request) for request in requests]
    # A full collection pass over every body and connection can stall the client for milliseconds mid-run: what
    # exists now is never garbage, and the process ends with the run (it holds at most the run's requests).
    gc.collect()
    gc.freeze()
    gc.disable()
    async with contextlib.AsyncExitStack() as stack:
        if job.over_grpc:
            channel = grpc.aio.insecure_channel(job.url.removeprefix(GRPC_SCHEME).rsplit("/", 1)[0])
            client = _Client(job, grpc_sender(job, await stack.enter_async_context(channel)))
        elif job.lean:
            client = LeanHttpClient(job)
            stack.callback(client.close)
        else:
            connector = aiohttp.TCPConnector(limit=job.max_connections, keepalive_timeout=CLIENT_KEEPALIVE_S)
            session = aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=job.timeout_s))
            client = _Client(job, http_sender(job, await stack.enter_async_context(session)))
        if job.clients > 0:
            recorder = await client.closed_loop(bodies)
            return recorder.result(client.origin, None, fetch_status(job.status_url))
        warmup = len(warmup_arrivals_ms)
        if len(bodies) != warmup + len(arrivals_ms):
            raise ValueError(f"{len(bodies)} requests for {warmup} warm-up and {len(arrivals_ms)} measured arrivals")
        await client.open_loop(bodies[:warmup], warmup_arrivals_ms)
        # Blocking on purpose: nothing is in flight between the two runs.
        before, cpu_before = fetch_status(job.status_url), read_cpu(job.cpu_pid)
        recorder = await client.open_loop(bodies[warmup:], arrivals_ms)
        origin = time.time() - (time.perf_counter() - client.origin)
        cpu_after = read_cpu(job.cpu_pid)  # before the status request, which costs the server CPU of its own
        result = recorder.result(client.origin, before, fetch_status(job.status_url), cpu_before, cpu_after)
        result.wall_origin_s = origin
        return result


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m rampserve.bench.loadgen JOB.npz OUT.npz", file=sys.stderr)
        return 2
    # The pacing thread must get the GIL back quickly when the event loop is busy (default: 5 ms).
    sys.setswitchinterval(0.0005)
    job, requests, arrivals, warmup = load_job(Path(argv[0]))
    result = uvloop.run(run_job(job, requests, arrivals, warmup))
    result.save(Path(argv[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
