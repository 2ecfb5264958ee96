"""The v2 codec against the wire format of the real client: tritonclient.http builds the requests and reads the
responses (its defaults send binary tensors and ask for binary outputs), so what passes here works with it."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import tritonclient.http as triton
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from rampserve.serving.shared.protocol import (
    BINARY_DATA_EXTENSION,
    DATATYPES,
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

# The v2 datatype table, written out again so a slip in DATATYPES cannot hide behind the round trips.
V2_NUMPY = {
    "BOOL": np.bool_, "UINT8": np.uint8, "UINT16": np.uint16, "UINT32": np.uint32, "UINT64": np.uint64,
    "INT8": np.int8, "INT16": np.int16, "INT32": np.int32, "INT64": np.int64,
    "FP16": np.float16, "FP32": np.float32, "FP64": np.float64, "BYTES": np.object_,
}


def client_request(tensors: list[tuple[str, str, np.ndarray, bool]], outputs: list[triton.InferRequestedOutput]
                   | None = None, parameters: dict | None = None, request_id: str = "") -> tuple[bytes, int | None]:
    """Body and Inference-Header-Content-Length as tritonclient.http sends (name, datatype, array, binary) inputs."""
    inputs = []
    for name, datatype, array, binary in tensors:
        inputs.append(triton.InferInput(name, list(array.shape), datatype))
        inputs[-1].set_data_from_numpy(array, binary_data=binary)
    return triton.InferenceServerClient.generate_request_body(inputs, outputs=outputs, request_id=request_id,
                                                               parameters=parameters)


def client_decode(body: bytes, headers: dict[str, str]) -> dict[str, np.ndarray]:
    """Every output of a response as tritonclient.http reads it; BYTES it read from JSON as str go back to bytes."""
    header_length = headers.get("Inference-Header-Content-Length")
    result = triton.InferenceServerClient.parse_response_body(
        body, header_length=None if header_length is None else int(header_length))
    arrays = {}
    for output in result.get_response()["outputs"]:
        array = result.as_numpy(output["name"])
        if output["datatype"] == "BYTES" and "data" in output:
            array = np.array([item.encode() for item in array.flatten()], dtype=object).reshape(array.shape)
        arrays[output["name"]] = array
    return arrays


def assert_same_tensor(actual: np.ndarray, expected: np.ndarray, keep_nan_payload: bool) -> None:
    """Bit-exact equality; JSON has one NaN, so through JSON any NaN only has to stay a NaN."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    assert actual.flags.c_contiguous
    if expected.dtype == object:
        assert actual.tolist() == expected.tolist()
    elif expected.dtype.kind == "f" and not keep_nan_payload:
        nan = np.isnan(expected)
        assert np.array_equal(np.isnan(actual), nan)
        assert actual[~nan].tobytes() == expected[~nan].tobytes()
    else:
        assert actual.tobytes() == expected.tobytes()


@st.composite
def tensors(draw: st.DrawFn, utf8_bytes: bool) -> tuple[str, np.ndarray]:
    """Any v2 datatype, any shape with a batch of at least one row, any values (NaN, inf, -0.0 included)."""
    datatype = draw(st.sampled_from(sorted(V2_NUMPY)))
    shape = (draw(st.integers(1, 3)), *draw(hnp.array_shapes(min_dims=0, max_dims=2, min_side=0, max_side=3)))
    if datatype != "BYTES":
        return datatype, draw(hnp.arrays(V2_NUMPY[datatype], shape))
    # JSON carries BYTES as UTF-8 text; binary data carries any bytes
    elements = st.text(max_size=6).map(str.encode) if utf8_bytes else st.binary(max_size=6)
    array = np.empty(math.prod(shape), dtype=object)
    array[:] = draw(st.lists(elements, min_size=array.size, max_size=array.size))
    return datatype, array.reshape(shape)


def any_shape_spec(name: str, datatype: str, rank: int) -> TensorSpec:
    return TensorSpec(name, datatype, (-1,) * rank)


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
@given(data=st.data())
@settings(suppress_health_check=[HealthCheck.too_slow])  # the first st.text() draw builds Unicode tables (~2 s)
def test_every_datatype_round_trips_through_a_tritonclient_request(binary: bool, data: st.DataObject) -> None:
    datatype, array = data.draw(tensors(utf8_bytes=not binary))
    body, header_length = client_request([("x", datatype, array, binary)])
    request = parse_infer_request(body, header_length, [any_shape_spec("x", datatype, array.ndim)],
                                  allow_nonfinite=True)
    assert request.batch_size == array.shape[0] and request.binary_outputs and request.outputs is None
    assert_same_tensor(request.inputs["x"], array.astype(DATATYPES[datatype]), keep_nan_payload=binary)


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
@given(data=st.data())
@settings(suppress_health_check=[HealthCheck.too_slow])  # the first st.text() draw builds Unicode tables (~2 s)
def test_every_datatype_round_trips_through_a_response(binary: bool, data: st.DataObject) -> None:
    datatype, array = data.draw(tensors(utf8_bytes=not binary))
    body, headers = encode_infer_response("m", "1", "req-7", [("y", datatype, array)], binary={"y"} if binary else ())
    assert_same_tensor(client_decode(body, headers)["y"], array, keep_nan_payload=binary)
    assert headers["Content-Type"] == ("application/octet-stream" if binary else "application/json")


def test_tritonclient_defaults_end_to_end() -> None:
    """Binary inputs, no outputs named: every output comes back binary, in the model's order."""
    pixels = np.arange(12, dtype=np.float32).reshape(2, 6)
    words = np.array([b"caf\xc3\xa9", b"\xff\x00"], dtype=object)
    body, header_length = client_request([("pixels", "FP32", pixels, True), ("words", "BYTES", words, True)],
                                         parameters={"deadline_ms": 50}, request_id="r1")
    specs = [TensorSpec("words", "BYTES", (-1,)), TensorSpec("pixels", "FP32", (-1, 6))]
    request = parse_infer_request(body, str(header_length), specs)
    assert request.id == "r1" and request.parameters["deadline_ms"] == 50 and request.batch_size == 2
    sends = output_names_to_send(request, ["logits", "label"])
    assert sends == [RequestedOutput("logits", True), RequestedOutput("label", True)]
    logits = request.inputs["pixels"] * 2
    body, headers = encode_infer_response("m", None, request.id, [("logits", "FP32", logits),
                                                                  ("label", "BYTES", request.inputs["words"])],
                                          binary=[send.name for send in sends if send.binary])
    decoded = client_decode(body, headers)
    assert_same_tensor(decoded["logits"], logits, keep_nan_payload=True)
    assert_same_tensor(decoded["label"], words, keep_nan_payload=True)
    head = json.loads(body[: int(headers["Inference-Header-Content-Length"])])
    assert head["id"] == "r1" and "model_version" not in head and head["model_name"] == "m"
    assert all("data" not in output for output in head["outputs"])


def test_decoded_inputs_are_owned_writable_little_endian_arrays() -> None:
    array = np.arange(6, dtype=np.int16).reshape(3, 2)
    body, header_length = client_request([("x", "INT16", array, True)])
    decoded = parse_infer_request(body, header_length, [TensorSpec("x", "INT16", (-1, 2))]).inputs["x"]
    assert decoded.flags.c_contiguous and decoded.flags.writeable and decoded.flags.owndata
    assert decoded.dtype == np.dtype("<i2") and decoded.shape == (3, 2)


def test_datatypes_is_the_v2_table_in_little_endian() -> None:
    assert {name: dtype.type for name, dtype in DATATYPES.items()} == V2_NUMPY
    assert all(dtype.newbyteorder("<") == dtype for dtype in DATATYPES.values())


def test_nested_and_mixed_json_lists_are_row_major() -> None:
    spec = [TensorSpec("x", "INT32", (-1, 2, 2))]
    flat = json.dumps({"inputs": [{"name": "x", "shape": [2, 2, 2], "datatype": "INT32", "data": list(range(8))}]})
    nested = flat.replace("[0, 1, 2, 3, 4, 5, 6, 7]", "[[[0, 1], [2, 3]], [[4, 5], [6, 7]]]")
    mixed = flat.replace("[0, 1, 2, 3, 4, 5, 6, 7]", "[[0, 1, [2, 3]], 4, [[5, 6, 7]]]")
    expected = np.arange(8, dtype=np.int32).reshape(2, 2, 2)
    for body in (flat, nested, mixed):
        assert np.array_equal(parse_infer_request(body.encode(), None, spec).inputs["x"], expected)


@pytest.mark.parametrize("datatype", ["FP16", "FP32", "FP64"])
@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_nonfinite_floats_are_refused_unless_allowed(datatype: str, value: float, binary: bool) -> None:
    array = np.array([[1.0, value]], dtype=V2_NUMPY[datatype])
    body, header_length = client_request([("x", datatype, array, binary)])
    spec = [TensorSpec("x", datatype, (-1, 2))]
    with pytest.raises(ProtocolError, match="input 'x'.*NaN or infinity") as caught:
        parse_infer_request(body, header_length, spec)
    assert caught.value.status == 400
    allowed = parse_infer_request(body, header_length, spec, allow_nonfinite=True).inputs["x"]
    assert_same_tensor(allowed, array, keep_nan_payload=binary)


def test_json_floats_too_large_for_fp16_are_refused_as_infinite() -> None:
    body = json.dumps({"inputs": [{"name": "x", "shape": [1], "datatype": "FP16", "data": [70000.0]}]}).encode()
    with pytest.raises(ProtocolError, match="NaN or infinity"):
        parse_infer_request(body, None, [TensorSpec("x", "FP16", (-1,))])


def test_outputs_choose_their_encoding() -> None:
    array = np.ones((1, 2), dtype=np.float32)
    outputs = [triton.InferRequestedOutput("b", binary_data=True), triton.InferRequestedOutput("a", binary_data=False)]
    body, header_length = client_request([("x", "FP32", array, False)], outputs=outputs)
    specs = [TensorSpec("x", "FP32", (-1, 2))]
    request = parse_infer_request(body, header_length, specs)
    assert output_names_to_send(request, ["a", "b"]) == [RequestedOutput("b", True), RequestedOutput("a", False)]
    with pytest.raises(ProtocolError, match=r"unknown output 'c'.*\['a', 'b'\]") as caught:
        output_names_to_send(InferRequest(None, {}, request.inputs, (RequestedOutput("c", False),), False), ["a", "b"])
    assert caught.value.status == 400
    # an output without its own binary_data takes the request's binary_data_output
    listed = {"inputs": [{"name": "x", "shape": [1, 2], "datatype": "FP32", "data": [1, 2]}],
              "outputs": [{"name": "a"}, {"name": "b", "parameters": {"binary_data": False}}],
              "parameters": {"binary_data_output": True}}
    request = parse_infer_request(json.dumps(listed).encode(), None, specs)
    assert output_names_to_send(request, ["b", "a"]) == [RequestedOutput("a", True), RequestedOutput("b", False)]
    as_json = InferRequest(None, {}, request.inputs, None, False)
    assert output_names_to_send(as_json, ["a"]) == [RequestedOutput("a", False)]


def test_json_response_layout() -> None:
    body, headers = encode_infer_response(
        "m", "2", None, [("p", "FP64", np.array([[0.5, 0.25]])), ("ok", "BOOL", np.array([True]))],
        parameters={"confidence": np.float32(0.75), "exit_layer": np.int64(3)})
    assert headers == {"Content-Type": "application/json"}
    assert json.loads(body) == {
        "model_name": "m", "model_version": "2", "parameters": {"confidence": 0.75, "exit_layer": 3},
        "outputs": [{"name": "p", "datatype": "FP64", "shape": [1, 2], "data": [0.5, 0.25]},
                    {"name": "ok", "datatype": "BOOL", "shape": [1], "data": [True]}]}


def test_binary_response_matches_the_extension_example() -> None:
    """extension_binary_data.md: a [3, 2] FP32 output sent as 24 bytes after the JSON."""
    output = np.arange(6, dtype=np.float32).reshape(3, 2)
    body, headers = encode_infer_response("mymodel", None, None, [("output0", "FP32", output)], binary=["output0"])
    header_length = int(headers["Inference-Header-Content-Length"])
    assert headers["Content-Type"] == "application/octet-stream" and len(body) == header_length + 24
    assert json.loads(body[:header_length])["outputs"] == [
        {"name": "output0", "datatype": "FP32", "shape": [3, 2], "parameters": {"binary_data_size": 24}}]
    assert body[header_length:] == output.astype("<f4").tobytes()


def test_non_utf8_bytes_need_a_binary_output() -> None:
    with pytest.raises(ProtocolError, match="output 'y'.*binary_data") as caught:
        encode_infer_response("m", None, None, [("y", "BYTES", np.array([b"\xff"], dtype=object))])
    assert caught.value.status == 400


def test_metadata_objects() -> None:
    specs = [TensorSpec("x", "FP32", (-1, 3))]
    assert model_metadata("m", ["1"], "onnxruntime", specs, [TensorSpec("y", "INT64", (-1,))]) == {
        "name": "m", "versions": ["1"], "platform": "onnxruntime",
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 3]}],
        "outputs": [{"name": "y", "datatype": "INT64", "shape": [-1]}]}
    assert server_metadata("rampserve", "0.1.0", [BINARY_DATA_EXTENSION]) == {
        "name": "rampserve", "version": "0.1.0", "extensions": ["binary_tensor_data"]}


# --- bad requests: each is a 400 whose message names the culprit ---------------------------------------------

SPECS = [TensorSpec("x", "FP32", (-1, 2)), TensorSpec("ids", "INT64", (-1,))]


def good_x(**changes: object) -> dict:
    """A valid tensor for SPECS' "x" with `changes` applied; a change to None drops the field."""
    return _changed({"name": "x", "shape": [1, 2], "datatype": "FP32", "data": [0.5, 1.5]}, changes)


def good_ids(**changes: object) -> dict:
    return _changed({"name": "ids", "shape": [1], "datatype": "INT64", "data": [7]}, changes)


def _changed(tensor: dict, changes: dict) -> dict:
    return {key: value for key, value in {**tensor, **changes}.items() if value is not None}


def body_of(*inputs: dict, **request: object) -> bytes:
    return json.dumps({"inputs": list(inputs), **request}).encode()


def binary_body(inputs: list[dict], tail: bytes) -> tuple[bytes, int]:
    head = body_of(*inputs)
    return head + tail, len(head)


def specs_of(datatype: str, rank: int = 1) -> list[TensorSpec]:
    return [TensorSpec("t", datatype, (-1,) * rank)]


def tensor_t(datatype: str, data: list | None = None, shape: list[int] | None = None, size: int | None = None) -> dict:
    tensor: dict = {"name": "t", "shape": shape or [len(data or [])], "datatype": datatype}
    if data is not None:
        tensor["data"] = data
    if size is not None:
        tensor["parameters"] = {"binary_data_size": size}
    return tensor


BAD_REQUESTS: dict[str, tuple[bytes | tuple[bytes, int | str], list[TensorSpec], str]] = {
    # id: (body or (body, header_length), model inputs, regex the message must match)
    "not json": (b'{"inputs": [', SPECS, "not valid JSON"),
    "not utf-8": (b'{"inputs": "\xff"}', SPECS, "not valid JSON"),
    "json array": (b"[]", SPECS, "must be a JSON object"),
    "header past body": ((body_of(good_x(), good_ids()), 10_000), SPECS, "Inference-Header-Content-Length 10000"),
    "negative header": ((body_of(good_x(), good_ids()), -1), SPECS, "Inference-Header-Content-Length -1"),
    "header not int": ((body_of(good_x(), good_ids()), "12.5"), SPECS, "must be an integer, got '12.5'"),
    "no inputs": (json.dumps({"id": "a"}).encode(), SPECS, "'inputs' must be a non-empty list"),
    "empty inputs": (body_of(), SPECS, "'inputs' must be a non-empty list"),
    "input without name": (body_of({"shape": [1], "datatype": "INT64", "data": [1]}), SPECS, r"inputs\[0\].*'name'"),
    "input without shape": (body_of(good_x(shape=None), good_ids()), SPECS, "input 'x': missing shape"),
    "input without datatype": (body_of(good_x(), good_ids(datatype=None)), SPECS, "input 'ids': missing datatype"),
    "negative dim": (body_of(good_x(shape=[-1, 2]), good_ids()), SPECS, "input 'x': shape must be a list of non-neg"),
    "float dim": (body_of(good_x(shape=[1.0, 2]), good_ids()), SPECS, "input 'x': shape must be a list of non-neg"),
    "bool dim": (body_of(good_x(shape=[True, 2]), good_ids()), SPECS, "input 'x': shape must be a list of non-neg"),
    "shape not list": (body_of(good_x(shape="1,2"), good_ids()), SPECS, "input 'x': shape must be a list"),
    "unknown input": (body_of(good_x(), good_ids(), {**good_ids(), "name": "z"}), SPECS,
                      r"unknown input 'z'.*\['x', 'ids'\]"),
    "missing input": (body_of(good_x()), SPECS, r"missing inputs \['ids'\]"),
    "duplicate input": (body_of(good_x(), good_ids(), good_x()), SPECS, "input 'x' appears more than once"),
    "not a v2 datatype": (body_of(good_x(datatype="FLOAT32"), good_ids()), SPECS,
                          "input 'x': datatype 'FLOAT32' is not a v2 datatype"),
    "other datatype": (body_of(good_x(datatype="INT64"), good_ids()), SPECS,
                       "input 'x': expected datatype FP32, got INT64"),
    "rank": (body_of(good_x(shape=[2]), good_ids()), SPECS, r"input 'x': expected shape \[-1, 2\].*got \[2\]"),
    "fixed dim": (body_of(good_x(shape=[1, 3], data=[1, 2, 3]), good_ids()), SPECS,
                  r"input 'x': expected shape \[-1, 2\].*got \[1, 3\]"),
    "batch of zero": (body_of(good_x(shape=[0, 2], data=[]), good_ids(shape=[0], data=[])), SPECS,
                      "input 'x': the batch dimension is 0"),
    "batch sizes differ": (body_of(good_x(), good_ids(shape=[2], data=[1, 2])), SPECS,
                           r"one batch size.*'x': 1, 'ids': 2"),
    "too few elements": (body_of(good_x(data=[0.5]), good_ids()), SPECS, r"input 'x': shape \[1, 2\] holds 2.* has 1"),
    "too many nested": (body_of(good_x(data=[[1, 2], [3]]), good_ids()), SPECS, "input 'x': .* holds 2.* has 3"),
    "data not list": (body_of(good_x(data=1.5), good_ids()), SPECS, "input 'x': 'data' must be a list"),
    "strings for FP32": (body_of(good_x(data=["1", 2.0]), good_ids()), SPECS, "input 'x': FP32 data must be numbers"),
    "bools for FP32": (body_of(good_x(data=[True, 2.0]), good_ids()), SPECS, "input 'x': .*numbers, got bool"),
    "floats for INT64": (body_of(good_x(), good_ids(data=[7.0])), SPECS, "input 'ids': INT64 .* integers, got float"),
    "ints for BOOL": (body_of(tensor_t("BOOL", [1, 0])), specs_of("BOOL"), "input 't': BOOL data must be true/false"),
    "numbers for BYTES": (body_of(tensor_t("BYTES", [1])), specs_of("BYTES"), "input 't': BYTES data must be str"),
    "UINT8 over": (body_of(tensor_t("UINT8", [1, 256])), specs_of("UINT8"), r"input 't': value 256 .* UINT8 \[0, 255"),
    "INT8 under": (body_of(tensor_t("INT8", [-129, 0])), specs_of("INT8"), "input 't': value -129 is out of range"),
    "INT64 over": (body_of(tensor_t("INT64", [2**63])), specs_of("INT64"), "input 't': value 9223372036854775808"),
    "UINT64 negative": (body_of(tensor_t("UINT64", [-1])), specs_of("UINT64"), "input 't': value -1 is out of range"),
    "int beyond float": (body_of(tensor_t("FP64", [10**400])), specs_of("FP64"), "input 't': a value is out of range"),
    "binary size wrong": (binary_body([good_x(data=None, parameters={"binary_data_size": 4}), good_ids()], b"\0" * 4),
                          SPECS, r"input 'x': shape \[1, 2\] of FP32 needs 8 bytes, binary_data_size is 4"),
    "binary past body": (binary_body([good_x(data=None, parameters={"binary_data_size": 8}), good_ids()], b"\0" * 6),
                         SPECS, "input 'x': binary_data_size 8 runs past the end of the body"),
    "binary left over": (binary_body([good_x(data=None, parameters={"binary_data_size": 8}), good_ids()], b"\0" * 9),
                         SPECS, "1 bytes after the JSON belong to no input"),
    "bytes after json": (binary_body([good_x(), good_ids()], b"\0"), SPECS, "1 bytes after the JSON belong to no"),
    "binary size negative": (binary_body([good_x(data=None, parameters={"binary_data_size": -8}), good_ids()], b""),
                             SPECS, "input 'x': binary_data_size must be a non-negative integer"),
    "binary without header": (body_of(good_x(data=None, parameters={"binary_data_size": 8}), good_ids()), SPECS,
                              "input 'x' has binary_data_size but .* no Inference-Header-Content-Length"),
    "data and binary": (binary_body([good_x(parameters={"binary_data_size": 8}), good_ids()], b"\0" * 8), SPECS,
                        "input 'x': give exactly one of 'data' and parameters.binary_data_size"),
    "neither data nor binary": (body_of(good_x(), good_ids(data=None)), SPECS, "input 'ids': give exactly one"),
    "shared memory": (body_of(good_x(data=None, parameters={"shared_memory_region": "r"}), good_ids()), SPECS,
                      r"input 'x': parameters \['shared_memory_region'\] are not supported"),
    "BYTES count": (binary_body([tensor_t("BYTES", shape=[2], size=5)], b"\1\0\0\0a"), specs_of("BYTES"),
                    "input 't': shape needs 2 BYTES elements, binary data holds 1"),
    "BYTES cut length": (binary_body([tensor_t("BYTES", shape=[1], size=2)], b"\1\0"), specs_of("BYTES"),
                         "input 't': BYTES data ends inside an element's 4-byte length"),
    "BYTES cut element": (binary_body([tensor_t("BYTES", shape=[1], size=5)], b"\2\0\0\0a"), specs_of("BYTES"),
                          "input 't': a BYTES element of 2 bytes runs past"),
    "BOOL byte 2": (binary_body([tensor_t("BOOL", shape=[2], size=2)], b"\1\2"), specs_of("BOOL"),
                    "input 't': BOOL bytes must be 0 or 1"),
    "id not string": (body_of(good_x(), good_ids(), id=5), SPECS, "request 'id' must be a string"),
    "parameters not object": (body_of(good_x(), good_ids(), parameters=[1]), SPECS, "'parameters' must be an object"),
    "binary_data_output not bool": (body_of(good_x(), good_ids(), parameters={"binary_data_output": 1}), SPECS,
                                    "'binary_data_output' must be true or false"),
    "outputs not list": (body_of(good_x(), good_ids(), outputs={"name": "y"}), SPECS, "'outputs' must be a list"),
    "output without name": (body_of(good_x(), good_ids(), outputs=[{"parameters": {}}]), SPECS, r"outputs\[0\]"),
    "binary_data not bool": (body_of(good_x(), good_ids(), outputs=[{"name": "y", "parameters": {"binary_data": "t"}}]),
                             SPECS, "output 'y' parameters: 'binary_data' must be true or false"),
    "duplicate output": (body_of(good_x(), good_ids(), outputs=[{"name": "y"}, {"name": "y"}]), SPECS,
                         "output 'y' is requested more than once"),
    "classification": (body_of(good_x(), good_ids(), outputs=[{"name": "y", "parameters": {"classification": 3}}]),
                       SPECS, r"output 'y': parameters \['classification'\] are not supported"),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_requests_are_400_and_say_what_is_wrong(case: str) -> None:
    sent, specs, expected = BAD_REQUESTS[case]
    body, header_length = sent if isinstance(sent, tuple) else (sent, None)
    with pytest.raises(ProtocolError, match=expected) as caught:
        parse_infer_request(body, header_length, specs)
    assert caught.value.status == 400 and caught.value.message == str(caught.value)


@pytest.mark.parametrize("case", ["binary size wrong", "BYTES count", "BOOL byte 2"])
def test_bad_binary_requests_are_good_once_fixed(case: str) -> None:
    """The binary cases fail for the reason named, not for a malformed body: the same layout done right parses."""
    fixed = {"binary size wrong": (binary_body([good_x(data=None, parameters={"binary_data_size": 8}), good_ids()],
                                               b"\0" * 8), SPECS),
             "BYTES count": (binary_body([tensor_t("BYTES", shape=[2], size=10)], b"\1\0\0\0a\1\0\0\0b"),
                             specs_of("BYTES")),
             "BOOL byte 2": (binary_body([tensor_t("BOOL", shape=[2], size=2)], b"\1\0"), specs_of("BOOL"))}
    (body, header_length), specs = fixed[case]
    assert parse_infer_request(body, header_length, specs).batch_size >= 1
