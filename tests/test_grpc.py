"""KServe v2 over gRPC, for real: the server's gRPC front end on a loopback port beside its HTTP one, driven with
tritonclient.grpc (and grpcio's stub of the same service for requests tritonclient will not build), the small
prepared ResNet on real Fashion-MNIST inputs, and models of other signatures for malformed requests.

Every class of bad input that the HTTP tests check (test_serving, test_plane, test_protocol) has its twin here where
a protobuf message can express it: a gRPC status code, a message naming what is wrong, and the server serving the
next request. What a message cannot express has no twin: float, boolean or non-list shapes, a non-string id, a
non-object parameters or outputs, nested or non-list data, integers beyond the typed field's width; a body that
is not JSON is a bytes payload that is not a ModelInferRequest."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import grpc
import numpy as np
import pytest
import tritonclient.grpc as triton
from test_serving import MODEL, fixed_exits, get_json, infer_body, original_logits, post
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc

from rampserve.serving.executor.loading import load_served, loaded
from rampserve.serving.frontend.app import ServerState
from rampserve.serving.frontend.apps.applications import ApplicationSpec
from rampserve.serving.frontend.apps.state_store import StoreError
from rampserve.serving.frontend.dashboard.sampler import front_end_readings
from rampserve.serving.frontend.grpc_codec import set_parameters
from rampserve.serving.frontend.grpc_server import GrpcFrontEnd
from rampserve.serving.frontend.plane import DataPlane
from rampserve.serving.frontend.repository.predictors import FunctionPredictor, ModelUnavailable, Predictor
from rampserve.serving.server import ServerSettings, build_state, running_server
from rampserve.serving.shared.contract import ExecutionFailed, ExecutorLost, Shed
from rampserve.serving.shared.models import ServedModel
from rampserve.serving.shared.protocol import TensorSpec
from rampserve.serving.shared.settings import ModelSettings

INVALID, NOT_FOUND = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND
EXHAUSTED, UNAVAILABLE = grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE
THREAD = ModelSettings(vanilla=True, executor="thread", torchscript=False)


@pytest.fixture(scope="module")
def served(resnet_bundle) -> ServedModel:
    return loaded(load_served(str(resnet_bundle)))


@contextmanager
def grpc_server(models: Sequence[ServedModel | Predictor], settings: ModelSettings = THREAD,
                apps: Sequence[ApplicationSpec] = (), **server: object) -> Iterator[tuple[str, str, ServerState]]:
    """A real server with gRPC on a free loopback port; yields its HTTP URL, its gRPC address and its state. The
    bundle's executor runs in the server's process (an executor process of its own takes seconds to start, and
    what it changes lies below the data plane: test_executor covers it)."""
    server_settings = ServerSettings(port=0, grpc_port=0, **server)
    state = build_state(models, settings, server_settings, apps)
    with running_server(state, server_settings) as url:
        yield url, f"127.0.0.1:{state.grpc.port}", state


def image_input(x: np.ndarray) -> triton.InferInput:
    tensor = triton.InferInput("x", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)  # raw_input_contents, as tritonclient always sends
    return tensor


def outputs(*names: str) -> list[triton.InferRequestedOutput]:
    return [triton.InferRequestedOutput(name) for name in names]


def parameters(result: triton.InferResult) -> dict:
    """The response's parameters as values."""
    return {key: value.get("bool_param", value.get("string_param", value.get("int64_param", value.get("double_param"))))
            for key, value in result.get_response(as_json=True).get("parameters", {}).items()}


def message(*inputs: dict, raw: Sequence[bytes] = (), requested: Sequence[tuple[str, dict]] = (), model: str = "m",
            version: str = "", **request_parameters: object) -> pb.ModelInferRequest:
    """A ModelInferRequest; each input a dict of name, datatype, shape, contents ({field: values}), parameters."""
    request = pb.ModelInferRequest(model_name=model, model_version=version)
    for spec in inputs:
        tensor = request.inputs.add(name=spec.get("name", ""), datatype=spec.get("datatype", ""),
                                    shape=spec.get("shape", []))
        for field, values in spec.get("contents", {}).items():
            getattr(tensor.contents, field).extend(values)
        set_parameters(tensor.parameters, spec.get("parameters", {}))
    request.raw_input_contents.extend(raw)
    for name, params in requested:
        set_parameters(request.outputs.add(name=name).parameters, params)
    set_parameters(request.parameters, request_parameters)
    return request


def typed_image(x: np.ndarray, model: str = MODEL, **request_parameters: object) -> pb.ModelInferRequest:
    return message({"name": "x", "datatype": "FP32", "shape": list(x.shape), "contents": {"fp32_contents": x.ravel()}},
                   requested=[("label", {}), ("logits", {})], model=model, **request_parameters)


def call(address: str, request: pb.ModelInferRequest | bytes) -> tuple[grpc.StatusCode, str, dict, object]:
    """(status code, details, trailing metadata, response) of one ModelInfer call; bytes go as they are."""
    with grpc.insecure_channel(address) as channel:
        method = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer",
                                     request_serializer=lambda r: r if isinstance(r, bytes) else r.SerializeToString(),
                                     response_deserializer=pb.ModelInferResponse.FromString)
        try:
            response = method(request, timeout=60)
        except grpc.RpcError as error:
            return error.code(), error.details(), dict(error.trailing_metadata() or ()), None
        return grpc.StatusCode.OK, "", {}, response


# --- health, metadata and answers -------------------------------------------------------------------------------

def test_health_metadata_and_the_original_models_logits_raw_and_typed(served, fmnist_feeds) -> None:
    x = fmnist_feeds[:4]
    expected = original_logits(served, x)
    with grpc_server([served]) as (_, address, _state):
        client = triton.InferenceServerClient(address)
        assert client.is_server_live() and client.is_server_ready() and client.is_model_ready(MODEL)
        assert not client.is_model_ready("nope") and not client.is_model_ready(MODEL, "7")  # as Triton answers
        server = client.get_server_metadata()
        assert (server.name, list(server.extensions)) == ("rampserve", ["binary_tensor_data"])
        metadata = client.get_model_metadata(MODEL)
        assert (metadata.name, list(metadata.versions)) == (MODEL, [served.version])
        assert [(t.name, t.datatype, list(t.shape)) for t in metadata.inputs] == [("x", "FP32", [-1, 1, 28, 28])]
        assert {t.name for t in metadata.outputs} == {"label", "logits"}
        label_only = client.infer(MODEL, [image_input(x)], request_id="q1")
        both = client.infer(MODEL, [image_input(x)], outputs=outputs("label", "logits"))
        code, _, _, typed = call(address, typed_image(x))
    assert label_only.get_response().id == "q1" and label_only.get_response().model_version == served.version
    assert [o.name for o in label_only.get_response().outputs] == ["label"]  # none named: the label alone
    np.testing.assert_array_equal(label_only.as_numpy("label"), expected.argmax(axis=1))
    np.testing.assert_array_equal(both.as_numpy("logits"), expected)  # bit for bit, as over HTTP
    np.testing.assert_array_equal(both.as_numpy("label"), expected.argmax(axis=1))
    answered = parameters(both)
    assert answered["early"] is False and {"config_version", "batch_id", "confidence"} <= set(answered)
    # Typed contents in, typed contents out
    assert code == grpc.StatusCode.OK and len(typed.raw_output_contents) == 0
    label, logits = typed.outputs
    assert list(label.contents.int64_contents) == expected.argmax(axis=1).tolist()
    np.testing.assert_array_equal(np.array(logits.contents.fp32_contents, np.float32).reshape(list(logits.shape)),
                                  expected)


def test_labels_leave_at_the_ramp_and_asking_for_logits_waits_for_the_original_models(served, fmnist_feeds) -> None:
    x, site = fmnist_feeds[:8], served.prepared.site_names[0]
    settings = fixed_exits(served, 0, 1.0, executor="thread", torchscript=False)  # threshold 1: every row exits
    with grpc_server([served], settings) as (url, address, _):
        client = triton.InferenceServerClient(address)
        early = client.infer(MODEL, [image_input(x)])
        one = client.infer(MODEL, [image_input(x[:1])])
        final = client.infer(MODEL, [image_input(x)], outputs=outputs("label", "logits"))
        deadline = time.monotonic() + 30  # an early answer leaves before its batch is counted
        while get_json(url + "/status")["models"][MODEL]["answers"]["early"] < len(x) + 1:
            assert time.monotonic() < deadline, "the books never counted the early answers"
            time.sleep(0.01)
    exited = parameters(early)
    assert exited["early"] is True and json.loads(exited["exit_site"]) == [site] * len(x)  # one per row, as JSON
    assert parameters(one)["exit_site"] == site and parameters(one)["early"] is True  # one row: the value itself
    answered = parameters(final)
    assert answered["early"] is False and json.loads(answered["exit_site"]) == [None] * len(x)  # the final layer
    np.testing.assert_array_equal(final.as_numpy("logits"), original_logits(served, x))
    np.testing.assert_array_equal(final.as_numpy("label"), original_logits(served, x).argmax(axis=1))


def test_requests_are_counted_by_transport_and_the_dashboard_adds_them_up(served, fmnist_feeds) -> None:
    x = fmnist_feeds[:2]
    with grpc_server([served]) as (url, address, state):
        status, _, _ = post(f"{url}/v2/models/{MODEL}/infer", infer_body(served, x))
        answered, _, _, _ = call(address, typed_image(x))
        refused, _, _, _ = call(address, b"not a ModelInferRequest")
        counted = {(sample.labels["transport"], sample.labels["model"], sample.labels["outcome"]): sample.value
                   for family in state.metrics.requests.collect() for sample in family.samples
                   if sample.name.endswith("_total")}
        requests, _ = front_end_readings(state.metrics)
    assert (status, answered, refused) == (200, grpc.StatusCode.OK, INVALID)
    assert counted == {("http", MODEL, "final"): 1.0, ("grpc", MODEL, "final"): 1.0,
                       ("grpc", "unknown", "invalid"): 1.0}
    assert requests[MODEL] == (2.0, 0.0)  # the dashboard's rates: answered, refused, whatever the transport


# --- bad input: every HTTP class's twin --------------------------------------------------------------------------

def constant(feeds: dict[str, np.ndarray]) -> np.ndarray:
    return np.zeros(len(next(iter(feeds.values()))), dtype=np.int64)


def raising(error: Exception) -> Callable[[dict[str, np.ndarray]], np.ndarray]:
    def predict(_feeds: dict[str, np.ndarray]) -> np.ndarray:
        raise error

    return predict


SPECS = (TensorSpec("x", "FP32", (-1, 2)), TensorSpec("ids", "INT64", (-1,)))
ONE_INPUT = ("BOOL", "BYTES", "UINT8", "INT8", "FP16")  # a model "t-{datatype}" taking one input "t" of each
FAILURES = {  # a model raising each, and the status code its refusal gets
    "shed-deadline": (Shed(429, "deadline", "too late", 2), EXHAUSTED, "2"),
    "shed-queue": (Shed(503, "queue_full", "queue full"), EXHAUSTED, None),
    "unreachable": (ModelUnavailable("unreachable"), EXHAUSTED, None),
    "lost": (ExecutorLost("its process died"), UNAVAILABLE, "1"),
    "failed": (ExecutionFailed("the model raised"), grpc.StatusCode.INTERNAL, None),
    "store": (StoreError("redis is gone"), UNAVAILABLE, None),
}


@pytest.fixture(scope="module")
def many_models(served) -> Iterator[tuple[str, ServerState]]:
    """The bundle (vanilla, in the server's process), a model of SPECS and an application over it, a model of each
    ONE_INPUT datatype and one per FAILURES, behind one server that takes messages of at most 0.5 MiB."""
    models = [served, FunctionPredictor("m", constant, SPECS),
              *(FunctionPredictor(f"t-{d}", constant, (TensorSpec("t", d, (-1,)),)) for d in ONE_INPUT),
              *(FunctionPredictor(name, raising(error), SPECS) for name, (error, _, _) in FAILURES.items())]
    app = ApplicationSpec("app", ("m",), "exp4", slo_ms=5000.0)
    with grpc_server(models, apps=[app], max_body_mb=0.5) as (_, address, state):
        yield address, state


def good_x(**changes: object) -> dict:
    return {"name": "x", "datatype": "FP32", "shape": [1, 2], "contents": {"fp32_contents": [0.5, 1.5]}, **changes}


def good_ids(**changes: object) -> dict:
    return {"name": "ids", "datatype": "INT64", "shape": [1], "contents": {"int64_contents": [7]}, **changes}


def raw_x(**changes: object) -> dict:
    return {"name": "x", "datatype": "FP32", "shape": [1, 2], **changes}


def raw_ids(**changes: object) -> dict:
    return {"name": "ids", "datatype": "INT64", "shape": [1], **changes}


X_BYTES, IDS_BYTES = np.array([0.5, 1.5], "<f4").tobytes(), np.array([7], "<i8").tobytes()


def one(datatype: str, shape: list[int], contents: dict | None = None, raw: Sequence[bytes] = ()
        ) -> pb.ModelInferRequest:
    return message({"name": "t", "datatype": datatype, "shape": shape, "contents": contents or {}}, raw=raw,
                   model=f"t-{datatype}")


BAD_REQUESTS: dict[str, tuple[pb.ModelInferRequest | bytes, grpc.StatusCode, str]] = {
    # id: (request, status code, regex the details must match); "HTTP: ..." names the class it twins
    "not a message (HTTP: malformed JSON)": (b"\x0a\x05ab", INVALID, "not a ModelInferRequest"),
    "unknown model": (message(good_x(), good_ids(), model="nope"), NOT_FOUND, "unknown model 'nope'"),
    "unknown version": (message(good_x(), good_ids(), version="7"), NOT_FOUND, "no version '7'"),
    "raw tensors for fewer inputs (HTTP: header past the body)": (
        message(raw_x(), raw_ids(), raw=[X_BYTES]), INVALID, "raw_input_contents holds 1 tensors for 2 inputs"),
    "no inputs": (message(), INVALID, "'inputs' must be a non-empty list"),
    "input without name": (message(good_x(name=""), good_ids()), INVALID, r"inputs\[0\].*'name'"),
    "input without shape": (message(good_x(shape=[]), good_ids()), INVALID, "input 'x': missing shape"),
    "input without datatype": (message(good_x(), good_ids(datatype="")), INVALID, "input 'ids': missing datatype"),
    "negative dim": (message(good_x(shape=[-1, 2]), good_ids()), INVALID, "input 'x': shape must be a list of non-neg"),
    "unknown input (HTTP: wrong input name)": (message(good_x(), good_ids(), good_ids(name="z")), INVALID,
                                               r"unknown input 'z'.*\['x', 'ids'\]"),
    "missing input": (message(good_x()), INVALID, r"missing inputs \['ids'\]"),
    "duplicate input": (message(good_x(), good_ids(), good_x()), INVALID, "input 'x' appears more than once"),
    "not a v2 datatype": (message(good_x(datatype="FLOAT32"), good_ids()), INVALID, "'FLOAT32' is not a v2 datatype"),
    "other datatype (HTTP: wrong datatype)": (message(good_x(datatype="INT64"), good_ids()), INVALID,
                                              "input 'x': expected datatype FP32, got INT64"),
    "rank (HTTP: wrong shape)": (message(good_x(shape=[2]), good_ids()), INVALID,
                                 r"input 'x': expected shape \[-1, 2\].*got \[2\]"),
    "fixed dim": (message(good_x(shape=[1, 3], contents={"fp32_contents": [1, 2, 3]}), good_ids()), INVALID,
                  r"expected shape \[-1, 2\].*got \[1, 3\]"),
    "batch of zero": (message(good_x(shape=[0, 2], contents={}), good_ids(shape=[0], contents={})), INVALID,
                      "input 'x': the batch dimension is 0"),
    "batch sizes differ": (message(good_x(), good_ids(shape=[2], contents={"int64_contents": [1, 2]})), INVALID,
                           r"one batch size.*'x': 1, 'ids': 2"),
    "too few elements (HTTP: short data)": (message(good_x(contents={"fp32_contents": [0.5]}), good_ids()), INVALID,
                                            r"input 'x': shape \[1, 2\] holds 2 elements, contents.fp32_contents has 1"),
    "too few bytes (HTTP: binary size wrong)": (message(raw_x(), raw_ids(), raw=[X_BYTES[:4], IDS_BYTES]), INVALID,
                                                r"needs 8 bytes, raw_input_contents\[0\] holds 4"),
    "too many bytes (HTTP: binary left over)": (message(raw_x(), raw_ids(), raw=[X_BYTES, IDS_BYTES + b"\0"]),
                                                INVALID, r"needs 8 bytes, raw_input_contents\[1\] holds 9"),
    "no values (HTTP: neither data nor binary)": (message(good_x(), good_ids(contents={})), INVALID,
                                                  "input 'ids': .* contents.int64_contents has 0"),
    "raw and typed (HTTP: data and binary)": (message(good_x(), raw_ids(), raw=[X_BYTES, IDS_BYTES]), INVALID,
                                              "input 'x': its values are in raw_input_contents and in contents"),
    "strings for FP32": (message(good_x(contents={"bytes_contents": [b"1", b"2"]}), good_ids()), INVALID,
                         "input 'x': FP32 values go in contents.fp32_contents, got contents.bytes_contents"),
    "bools for FP32": (message(good_x(contents={"bool_contents": [True, False]}), good_ids()), INVALID,
                       "got contents.bool_contents"),
    "floats for INT64": (message(good_x(), good_ids(contents={"fp32_contents": [7.0]})), INVALID,
                         "input 'ids': INT64 values go in contents.int64_contents"),
    "ints for BOOL": (one("BOOL", [2], {"int_contents": [1, 0]}), INVALID, "input 't': BOOL values go in "
                                                                             "contents.bool_contents"),
    "numbers for BYTES": (one("BYTES", [1], {"int_contents": [1]}), INVALID, "BYTES values go in contents.bytes"),
    "UINT8 over": (one("UINT8", [2], {"uint_contents": [1, 256]}), INVALID, r"value 256 .* UINT8 \[0, 255"),
    "INT8 under": (one("INT8", [2], {"int_contents": [-129, 0]}), INVALID, "input 't': value -129 is out of range"),
    "FP16 typed": (one("FP16", [1], {"fp32_contents": [1.0]}), INVALID, "FP16 has no typed contents"),
    "NaN": (message(good_x(contents={"fp32_contents": [float("nan"), 1.0]}), good_ids()), INVALID, "NaN"),
    "NaN raw": (message(raw_x(), raw_ids(), raw=[np.array([np.inf, 1], "<f4").tobytes(), IDS_BYTES]), INVALID,
                "input 'x': FP32 data holds NaN or infinity"),
    "shared memory": (message(good_x(parameters={"shared_memory_region": "r"}), good_ids()), INVALID,
                      r"input 'x': parameters \['shared_memory_region'\] are not supported"),
    "BYTES count": (one("BYTES", [2], raw=[b"\1\0\0\0a"]), INVALID, "shape needs 2 BYTES elements, binary data holds 1"),
    "BYTES cut length": (one("BYTES", [1], raw=[b"\1\0"]), INVALID, "BYTES data ends inside an element's 4-byte"),
    "BYTES cut element": (one("BYTES", [1], raw=[b"\2\0\0\0a"]), INVALID, "a BYTES element of 2 bytes runs past"),
    "BOOL byte 2": (one("BOOL", [2], raw=[b"\1\2"]), INVALID, "input 't': BOOL bytes must be 0 or 1"),
    "binary_data_output not bool": (message(good_x(), good_ids(), binary_data_output=1), INVALID,
                                    "'binary_data_output' must be true or false"),
    "output without name": (message(good_x(), good_ids(), requested=[("", {})]), INVALID, r"outputs\[0\]"),
    "unknown output": (message(good_x(), good_ids(), requested=[("nope", {})]), INVALID, "unknown output 'nope'"),
    "binary_data not bool": (message(good_x(), good_ids(), requested=[("label", {"binary_data": "t"})]), INVALID,
                             "output 'label' parameters: 'binary_data' must be true or false"),
    "duplicate output": (message(good_x(), good_ids(), requested=[("label", {}), ("label", {})]), INVALID,
                         "output 'label' is requested more than once"),
    "classification": (message(good_x(), good_ids(), requested=[("label", {"classification": 3})]), INVALID,
                       r"output 'label': parameters \['classification'\] are not supported"),
    "bad deadline": (message(good_x(), good_ids(), deadline_ms=-1), INVALID, "deadline_ms must be a positive"),
    "bad priority": (message(good_x(), good_ids(), priority="high"), INVALID, "priority must be an integer"),
    "too large (HTTP: body too large, 413)": (message(raw_x(shape=[1 << 16, 2]), raw_ids(shape=[1 << 16]),
                                                      raw=[b"\0" * (1 << 19), b"\0" * (1 << 19)]), EXHAUSTED, "larger"),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_every_bad_request_gets_its_status_code_and_the_server_keeps_serving(many_models, served, fmnist_feeds,
                                                                             case: str) -> None:
    address, state = many_models
    request, expected_code, expected = BAD_REQUESTS[case]
    counted = state.metrics.registry.get_sample_value
    model = "unknown" if isinstance(request, bytes) or request.model_name == "nope" else request.model_name
    labels = {"model": model, "outcome": "invalid", "transport": "grpc"}
    invalid_before = counted("rampserve_requests_total", labels) or 0.0
    code, details, _, _ = call(address, request)
    assert code == expected_code and re.search(expected, details), (code, details)
    # Counted as HTTP counts it, but for a message over the limit: grpcio refuses it before the server sees it
    invalid_after = counted("rampserve_requests_total", labels) or 0.0
    assert invalid_after - invalid_before == (0 if expected_code == EXHAUSTED else 1)
    code, _, _, answer = call(address, typed_image(fmnist_feeds[:2]))
    assert code == grpc.StatusCode.OK
    assert list(answer.outputs[0].contents.int64_contents) == original_logits(served, fmnist_feeds[:2]).argmax(
        axis=1).tolist()


def test_the_same_request_done_right_is_answered(many_models) -> None:
    """The bad requests fail for the reason named: their good forms, typed and raw, of every signature, pass."""
    address, _ = many_models
    good = [message(good_x(), good_ids()), message(raw_x(), raw_ids(), raw=[X_BYTES, IDS_BYTES]),
            one("BOOL", [2], {"bool_contents": [True, False]}), one("BOOL", [2], raw=[b"\1\0"]),
            one("BYTES", [2], {"bytes_contents": [b"a", b"bc"]}), one("BYTES", [1], raw=[b"\1\0\0\0a"]),
            one("UINT8", [2], {"uint_contents": [0, 255]}), one("INT8", [2], {"int_contents": [-128, 127]}),
            one("FP16", [1], raw=[np.array([1.0], "<f2").tobytes()])]
    for request in good:
        code, details, _, answer = call(address, request)
        assert code == grpc.StatusCode.OK and list(answer.outputs[0].shape) == list(request.inputs[0].shape[:1]), \
            (request, details)


def test_an_application_answers_under_its_name(many_models) -> None:
    address, _ = many_models
    code, details, _, answer = call(address, message(good_x(), good_ids(), model="app", uid="someone"))
    assert code == grpc.StatusCode.OK, details
    assert (answer.model_name, list(answer.outputs[0].contents.int64_contents)) == ("app", [0])
    assert answer.parameters["models"].string_param == '["m"]'  # a list: JSON text


@pytest.mark.parametrize("name", list(FAILURES))
def test_each_failure_maps_to_its_status_code(many_models, name: str) -> None:
    address, state = many_models
    error, expected_code, retry_after = FAILURES[name]
    code, details, trailing, _ = call(address, message(good_x(), good_ids(), model=name))
    assert (code, trailing.get("retry-after")) == (expected_code, retry_after)
    assert str(error) in details


# --- load and shutdown --------------------------------------------------------------------------------------------

def test_shedding_is_explicit_and_every_call_gets_one_answer(served, fmnist_feeds) -> None:
    settings = ModelSettings(vanilla=True, max_queue=2, max_batch=1, adaptive_batching=False, deadline_ms=60_000.0,
                             executor="thread", torchscript=False)
    request = typed_image(fmnist_feeds[:1])
    with grpc_server([served], settings) as (_, address, _):
        with grpc.insecure_channel(address) as channel:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            calls = [stub.ModelInfer.future(request, timeout=60) for _ in range(60)]
            codes = [call_.code() for call_ in calls]  # waits for each
            messages = [call_.details() for call_ in calls if call_.code() != grpc.StatusCode.OK]
        late, details, trailing, _ = call(address, typed_image(fmnist_feeds[:1], deadline_ms=1e-6))
    assert set(codes) == {grpc.StatusCode.OK, EXHAUSTED}, set(codes)
    assert all("queue full" in text for text in messages)
    assert late == EXHAUSTED and "deadline" in details and int(trailing["retry-after"]) >= 1


def test_a_stopping_server_answers_the_calls_in_flight(served, fmnist_feeds) -> None:
    # Batches wait up to 2 s to fill: the calls are still queued when the server is told to stop
    settings = ModelSettings(vanilla=True, max_batch=64, max_delay_ms=2000.0, adaptive_batching=False,
                             executor="thread", torchscript=False)
    x = fmnist_feeds[:6]
    with grpc_server([served], settings) as (url, address, _):
        channel = grpc.insecure_channel(address)
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        calls = [stub.ModelInfer.future(typed_image(x[i:i + 1]), timeout=60) for i in range(len(x))]
        deadline = time.monotonic() + 30
        while get_json(f"{url}/status/{MODEL}")["queued_inputs"] < len(x):
            assert time.monotonic() < deadline, "the calls never reached the queue"
            time.sleep(0.01)
    labels = [list(call_.result().outputs[0].contents.int64_contents) for call_ in calls]
    channel.close()
    assert labels == [[label] for label in original_logits(served, x).argmax(axis=1).tolist()]
    assert call(address, typed_image(x[:1]))[0] == UNAVAILABLE  # stopped: nothing listens any more


def test_a_grpc_port_already_taken_is_refused(many_models) -> None:
    """grpcio would share a port with SO_REUSEPORT, splitting the calls between two servers; a second server
    refuses to start instead."""
    address, state = many_models
    second = GrpcFrontEnd("127.0.0.1", int(address.rsplit(":", 1)[1]), 1 << 20, 1.0)

    async def bind() -> None:
        second.bind(DataPlane(state.catalogue, state.metrics, state.cache), lambda: True)

    with pytest.raises(RuntimeError, match="gRPC cannot listen on 127.0.0.1:.*--grpc-port N picks another"):
        asyncio.run(bind())
