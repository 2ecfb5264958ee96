"""Open Inference Protocol v2 (KServe v2) over HTTP, with Triton's binary tensor data extension.

A pure codec and validator: the HTTP server hands it the body and the `Inference-Header-Content-Length` header
and gets back checked arrays, or hands it arrays and gets back a body and headers, so every wire-format rule is
tested here without sockets. `tritonclient.http` sends tensors as binary data by default (the JSON header, then
each binary input's raw little-endian bytes in input order) and, when it lists no outputs, asks for every output
in binary, so both encodings are first-class. The checks of a request object (`infer_request_from`) and the tensor
decoders are gRPC's too (`grpc_codec`): a ModelInferRequest passes the same rules with the same messages.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import orjson

# Explicit little-endian dtypes: the binary extension fixes the byte order whatever machine the server runs on.
DATATYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype("?"),
    "UINT8": np.dtype("<u1"),
    "UINT16": np.dtype("<u2"),
    "UINT32": np.dtype("<u4"),
    "UINT64": np.dtype("<u8"),
    "INT8": np.dtype("<i1"),
    "INT16": np.dtype("<i2"),
    "INT32": np.dtype("<i4"),
    "INT64": np.dtype("<i8"),
    "FP16": np.dtype("<f2"),
    "FP32": np.dtype("<f4"),
    "FP64": np.dtype("<f8"),
    "BYTES": np.dtype(object),  # elements are `bytes`; on the wire each is a uint32 length then the bytes
}
# The name Triton reports in server metadata when it accepts binary tensors; tritonclient users look for it.
BINARY_DATA_EXTENSION = "binary_tensor_data"

_BYTES_LENGTH = struct.Struct("<I")
# JSON element types each dtype kind accepts. bool is not an int here: `true` for an INT32 is a client bug.
_JSON_ELEMENT_TYPES: dict[str, tuple[set[type], str]] = {
    "b": ({bool}, "true/false"),
    "i": ({int}, "integers"),
    "u": ({int}, "integers"),
    "f": ({int, float}, "numbers"),
    "O": ({str}, "strings"),
}
# Parameters of tritonclient features this server does not implement; ignoring them would return wrong results.
_UNSUPPORTED_PARAMETERS = ("shared_memory_region", "classification")


@dataclass(frozen=True)
class TensorSpec:
    name: str
    datatype: str  # v2 datatype name
    shape: tuple[int, ...]  # full shape including the leading batch dimension; -1 means any size
    # Also takes the shape with a last dimension of 1: a column of the values, as Triton's clients shape a batch of
    # strings (one per row)
    column: bool = False

    def __post_init__(self) -> None:
        if self.datatype not in DATATYPES or not self.shape:
            raise ValueError(f"tensor '{self.name}': need a v2 datatype and a shape with a batch dimension")

    @property
    def shapes(self) -> tuple[tuple[int, ...], ...]:
        """The shapes it takes."""
        return (self.shape, (*self.shape, 1)) if self.column else (self.shape,)

    def to_json(self) -> dict:
        return {"name": self.name, "datatype": self.datatype, "shape": list(self.shape)}


class ProtocolError(Exception):
    """A request the protocol refuses; the server answers `{"error": message}` with `status`."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.status = status


@dataclass(frozen=True)
class RequestedOutput:
    name: str
    binary: bool


@dataclass(frozen=True)
class InferRequest:
    id: str | None
    parameters: dict  # request-level parameters as sent (deadline_ms, priority, binary_data_output, ...)
    inputs: dict[str, np.ndarray]  # decoded and validated, each with its full shape (batch first)
    outputs: tuple[RequestedOutput, ...] | None  # None: the client named no outputs, so it gets all of them
    binary_outputs: bool  # parameters.binary_data_output: the encoding of outputs the client did not list

    @property
    def batch_size(self) -> int:
        """Rows in the request: the leading dimension every input shares, so rows can be batched."""
        return _batch_size(self.inputs)


def parse_infer_request(
    body: bytes, header_length: int | str | None, inputs: Sequence[TensorSpec], allow_nonfinite: bool = False,
    alternative: Sequence[TensorSpec] = (),
) -> InferRequest:
    """Decode and validate an infer request against the model's inputs (or `alternative`, the inputs it takes in
    their place: a text model's texts); any fault is a ProtocolError (400).

    `header_length` is the `Inference-Header-Content-Length` header as sent (a str is parsed here), or None when
    the request has no such header and the body is JSON only.
    """
    json_end = _json_length(body, header_length)
    request = _load_json(body[:json_end])
    if not isinstance(request, dict):
        raise ProtocolError(f"request body must be a JSON object, got {type(request).__name__}")
    binary = memoryview(body)[json_end:]
    offset = 0  # binary inputs take consecutive slices of the bytes after the JSON, in input order

    def read(_position: int, tensor: dict, params: dict, spec: TensorSpec, shape: tuple[int, ...]) -> np.ndarray:
        nonlocal offset
        name, size = spec.name, params.get("binary_data_size")
        if ("data" in tensor) == (size is not None):
            raise ProtocolError(f"input '{name}': give exactly one of 'data' and parameters.binary_data_size")
        if size is None:
            return decode_json_data(tensor["data"], spec, shape)
        if header_length is None:
            raise ProtocolError(f"input '{name}' has binary_data_size but the request has no "
                                "Inference-Header-Content-Length header")
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise ProtocolError(f"input '{name}': binary_data_size must be a non-negative integer, got {size!r}")
        if offset + size > len(binary):
            raise ProtocolError(f"input '{name}': binary_data_size {size} runs past the end of the body "
                                f"({len(binary) - offset} bytes left)")
        array = decode_binary_data(binary[offset:offset + size], spec, shape, "binary_data_size is")
        offset += size
        return array

    parsed = infer_request_from(request, read, inputs, allow_nonfinite, alternative)
    if offset != len(binary):
        raise ProtocolError(f"{len(binary) - offset} bytes after the JSON belong to no input "
                            f"(the inputs' binary_data_size add up to {offset})")
    return parsed


# Reads one input's values: (its position among the request's inputs, the tensor's v2 object, its parameters, the
# model's input it is, its checked shape) -> the array. A JSON body reads 'data' or the binary extension's bytes; a
# gRPC request reads raw_input_contents or typed contents (`grpc_codec`).
TensorReader = Callable[[int, dict, dict, TensorSpec, tuple[int, ...]], np.ndarray]


def infer_request_from(request: dict, read: TensorReader, inputs: Sequence[TensorSpec],
                       allow_nonfinite: bool = False, alternative: Sequence[TensorSpec] = ()) -> InferRequest:
    """Validate a v2 request object (the JSON form: id, parameters, inputs, outputs) against the model's inputs or
    their `alternative`, reading each tensor's values with `read`: every transport's requests pass the same
    checks."""
    request_id = request.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise ProtocolError(f"request 'id' must be a string, got {request_id!r}")
    parameters = _optional_dict(request, "parameters", "request")
    binary_outputs = _optional_bool(parameters, "binary_data_output", "request parameters")
    decoded = _decode_inputs(request.get("inputs"), read, inputs, allow_nonfinite, alternative)
    parsed = InferRequest(request_id, parameters, decoded, _parse_outputs(request.get("outputs"), binary_outputs),
                          binary_outputs)
    _batch_size(decoded)  # refuses inputs whose rows do not line up
    return parsed


def output_names_to_send(request: InferRequest, available: Sequence[str]) -> list[RequestedOutput]:
    """The outputs to return, in order, and whether each goes as binary data."""
    if request.outputs is None:
        return [RequestedOutput(name, request.binary_outputs) for name in available]
    for output in request.outputs:
        if output.name not in available:
            raise ProtocolError(f"unknown output '{output.name}'; the model's outputs are {list(available)}")
    return list(request.outputs)


def encode_infer_response(
    model_name: str,
    model_version: str | None,
    request_id: str | None,
    outputs: Sequence[tuple[str, str, np.ndarray]],
    binary: Collection[str] = (),
    parameters: dict | None = None,
) -> tuple[bytes, dict[str, str]]:
    """The response body and the headers to add; outputs named in `binary` follow the JSON as raw bytes."""
    if unknown := set(binary) - {name for name, _, _ in outputs}:
        raise ValueError(f"binary outputs {sorted(unknown)} are not among the outputs")
    header: dict = {"model_name": model_name}
    if model_version is not None:
        header["model_version"] = model_version
    if request_id is not None:
        header["id"] = request_id
    if parameters:
        header["parameters"] = parameters
    tensors, chunks = [], []
    for name, datatype, array in outputs:
        array = as_datatype(np.asarray(array), datatype)
        tensor: dict = {"name": name, "datatype": datatype, "shape": list(array.shape)}
        if name in binary:
            chunks.append(encode_binary_data(array, datatype))
            tensor["parameters"] = {"binary_data_size": len(chunks[-1])}
        else:
            tensor["data"] = _json_data(name, array, datatype)
        tensors.append(tensor)
    header["outputs"] = tensors
    # ensure_ascii (the default) keeps characters and bytes equal, as tritonclient assumes for its own requests
    head = json.dumps(header, separators=(",", ":"), default=numpy_to_json).encode()
    if not chunks:
        return head, {"Content-Type": "application/json"}
    return head + b"".join(chunks), {"Content-Type": "application/octet-stream",
                                     "Inference-Header-Content-Length": str(len(head))}


def model_metadata(name: str, versions: Sequence[str], platform: str, inputs: Sequence[TensorSpec],
                   outputs: Sequence[TensorSpec], alternative: Sequence[dict] = ()) -> dict:
    """The v2 model metadata object (`GET /v2/models/{m}`). Inputs a request may give in place of `inputs` (a text
    model's texts, each tensor's metadata with its own parameters) are listed in its parameters as
    `alternative_inputs`, where a client that sends every input listed in `inputs` does not trip on them."""
    metadata = {"name": name, "versions": list(versions), "platform": platform,
                "inputs": [spec.to_json() for spec in inputs], "outputs": [spec.to_json() for spec in outputs]}
    if alternative:
        metadata["parameters"] = {"alternative_inputs": list(alternative)}
    return metadata


def server_metadata(name: str, version: str, extensions: Sequence[str]) -> dict:
    """The v2 server metadata object (`GET /v2`); list BINARY_DATA_EXTENSION among the extensions."""
    return {"name": name, "version": version, "extensions": list(extensions)}


def _batch_size(inputs: Mapping[str, np.ndarray]) -> int:
    sizes = {name: array.shape[0] for name, array in inputs.items()}
    if len(set(sizes.values())) != 1:
        raise ProtocolError(f"inputs must share one batch size (leading dimension), got {sizes}")
    return next(iter(sizes.values()))


def _json_length(body: bytes, header_length: int | str | None) -> int:
    """Where the JSON ends: at the header's value when binary tensors follow it, else at the end of the body."""
    if header_length is None:
        return len(body)
    try:
        if isinstance(header_length, bool) or not isinstance(header_length, int | str):
            raise ValueError
        length = int(header_length)
    except ValueError:
        raise ProtocolError(f"Inference-Header-Content-Length must be an integer, got {header_length!r}") from None
    if not 0 <= length <= len(body):
        raise ProtocolError(f"Inference-Header-Content-Length {length} is outside the {len(body)}-byte body")
    return length


def _decode_inputs(raw_inputs: object, read: TensorReader, specs: Sequence[TensorSpec],
                   allow_nonfinite: bool, alternative: Sequence[TensorSpec] = ()) -> dict[str, np.ndarray]:
    if not isinstance(raw_inputs, list) or not raw_inputs:
        raise ProtocolError("'inputs' must be a non-empty list of tensors")
    names, alternative_names = [spec.name for spec in specs], [spec.name for spec in alternative]
    expected = f"{names}" + (f", or {alternative_names} in their place" if alternative else "")
    spec_by_name = {spec.name: spec for spec in (*specs, *alternative)}
    decoded: dict[str, np.ndarray] = {}
    for position, tensor in enumerate(raw_inputs):
        if not isinstance(tensor, dict) or not isinstance(tensor.get("name"), str):
            raise ProtocolError(f"inputs[{position}] must be an object with a string 'name'")
        name = tensor["name"]
        if name not in spec_by_name:
            raise ProtocolError(f"unknown input '{name}'; the model's inputs are {expected}")
        if name in decoded:
            raise ProtocolError(f"input '{name}' appears more than once")
        spec = spec_by_name[name]
        shape = _checked_shape(tensor, spec)
        array = read(position, tensor, _optional_dict(tensor, "parameters", f"input '{name}'"), spec, shape)
        if array.dtype.kind == "f" and not allow_nonfinite and not np.isfinite(array).all():
            raise ProtocolError(f"input '{name}': {spec.datatype} data holds NaN or infinity, which this model refuses")
        decoded[name] = array
    given = [name for name in alternative_names if name in decoded]
    if given and (mixed := [name for name in names if name in decoded]):
        raise ProtocolError(f"inputs {given} take the place of {names}: give one or the other, not both "
                            f"(got {given + mixed})")
    if missing := [name for name in (alternative_names if given else names) if name not in decoded]:
        raise ProtocolError(f"missing inputs {missing}; the model's inputs are {expected}")
    return decoded


def _checked_shape(tensor: dict, spec: TensorSpec) -> tuple[int, ...]:
    """The tensor's shape once its datatype and shape agree with the model's input."""
    name, datatype, shape = spec.name, tensor.get("datatype"), tensor.get("shape")
    if datatype is None or shape is None:
        raise ProtocolError(f"input '{name}': missing {'datatype' if datatype is None else 'shape'}")
    if not isinstance(datatype, str) or datatype not in DATATYPES:
        raise ProtocolError(f"input '{name}': datatype {datatype!r} is not a v2 datatype ({', '.join(DATATYPES)})")
    if datatype != spec.datatype:
        raise ProtocolError(f"input '{name}': expected datatype {spec.datatype}, got {datatype}")
    if not isinstance(shape, list) or not all(type(dim) is int and dim >= 0 for dim in shape):
        raise ProtocolError(f"input '{name}': shape must be a list of non-negative integers, got {shape!r}")
    if not any(len(shape) == len(want) and all(dim in (-1, got) for dim, got in zip(want, shape))
               for want in spec.shapes):
        raise ProtocolError(f"input '{name}': expected shape {' or '.join(str(list(want)) for want in spec.shapes)} "
                            f"(-1: any size), got {shape}")
    if shape[0] == 0:
        raise ProtocolError(f"input '{name}': the batch dimension is 0; send at least one row")
    return tuple(shape)


def _load_json(text: bytes) -> object:
    """orjson (ten times faster on a tensor's worth of numbers); the standard library's parser for what orjson
    refuses but Python clients send (`NaN`, `Infinity`: tritonclient writes them with `json.dumps`; integers
    beyond 64 bits), and for the error message of what is not JSON at all."""
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        pass
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as error:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ProtocolError(f"request body is not valid JSON: {error}") from None


def decode_json_data(data: object, spec: TensorSpec, shape: tuple[int, ...], source: str = "'data'") -> np.ndarray:
    """An input's array from its values as a (flat or nested) list, checked against its datatype's range; `source`
    names where the values came from in messages."""
    name, datatype, dtype = spec.name, spec.datatype, DATATYPES[spec.datatype]
    if not isinstance(data, list):
        raise ProtocolError(f"input '{name}': {source} must be a list, got {type(data).__name__}")
    flat, count = _flatten(data), math.prod(shape)
    if len(flat) != count:
        raise ProtocolError(f"input '{name}': shape {list(shape)} holds {count} elements, {source} has {len(flat)}")
    allowed, described = _JSON_ELEMENT_TYPES[dtype.kind]
    if wrong := set(map(type, flat)) - allowed:
        raise ProtocolError(f"input '{name}': {datatype} data must be {described}, got "
                            f"{', '.join(sorted(kind.__name__ for kind in wrong))}")
    if datatype == "BYTES":
        try:
            return object_array([text.encode() for text in flat], shape)
        except UnicodeEncodeError as error:
            raise ProtocolError(f"input '{name}': BYTES data is not valid Unicode: {error}") from None
    if dtype.kind in "iu" and flat:
        limits, low, high = np.iinfo(dtype), min(flat), max(flat)
        if low < limits.min or high > limits.max:
            raise ProtocolError(f"input '{name}': value {low if low < limits.min else high} is out of range for "
                                f"{datatype} [{limits.min}, {limits.max}]")
    try:
        with np.errstate(over="ignore"):  # a float too large for FP16/FP32 becomes inf, refused unless allowed
            return np.array(flat, dtype=dtype).reshape(shape)
    except OverflowError:  # an integer beyond float64
        raise ProtocolError(f"input '{name}': a value is out of range for {datatype}") from None


def _flatten(data: list) -> list:
    """Row-major elements of flat or nested lists (v2 allows both), one nesting level per pass."""
    while list in set(map(type, data)):
        data = [item for value in data for item in (value if type(value) is list else (value,))]
    return data


def decode_binary_data(raw: memoryview, spec: TensorSpec, shape: tuple[int, ...], size_source: str) -> np.ndarray:
    """An input's array from its raw little-endian bytes (BYTES: each element's uint32 length, then the element);
    `size_source` names where its size came from in messages ("binary_data_size is")."""
    name, datatype, dtype, count = spec.name, spec.datatype, DATATYPES[spec.datatype], math.prod(shape)
    if datatype == "BYTES":
        return object_array(_split_bytes_elements(raw, count, name), shape)
    if len(raw) != count * dtype.itemsize:
        raise ProtocolError(f"input '{name}': shape {list(shape)} of {datatype} needs {count * dtype.itemsize} "
                            f"bytes, {size_source} {len(raw)}")
    if datatype == "BOOL" and count and np.frombuffer(raw, np.uint8).max() > 1:
        raise ProtocolError(f"input '{name}': BOOL bytes must be 0 or 1")
    # A copy owns writable memory: a view would pin the whole body and be read-only for the model's runtime.
    return np.frombuffer(raw, dtype=dtype).reshape(shape).copy()


def _split_bytes_elements(raw: memoryview, count: int, name: str) -> list[bytes]:
    """BYTES elements from their wire form: each a little-endian uint32 length followed by that many bytes."""
    elements, position = [], 0
    while position < len(raw):
        if position + _BYTES_LENGTH.size > len(raw):
            raise ProtocolError(f"input '{name}': BYTES data ends inside an element's 4-byte length")
        (length,) = _BYTES_LENGTH.unpack_from(raw, position)
        position += _BYTES_LENGTH.size
        if position + length > len(raw):
            raise ProtocolError(f"input '{name}': a BYTES element of {length} bytes runs past binary_data_size")
        elements.append(bytes(raw[position:position + length]))
        position += length
    if len(elements) != count:
        raise ProtocolError(f"input '{name}': shape needs {count} BYTES elements, binary data holds {len(elements)}")
    return elements


def object_array(elements: Sequence[bytes], shape: tuple[int, ...]) -> np.ndarray:
    # Filling an empty array keeps numpy from reading bytes of equal length as extra dimensions.
    array = np.empty(len(elements), dtype=object)
    array[:] = elements
    return array.reshape(shape)


def _parse_outputs(raw_outputs: object, default_binary: bool) -> tuple[RequestedOutput, ...] | None:
    if raw_outputs is None or raw_outputs == []:
        return None
    if not isinstance(raw_outputs, list):
        raise ProtocolError(f"'outputs' must be a list, got {type(raw_outputs).__name__}")
    requested: dict[str, RequestedOutput] = {}
    for position, output in enumerate(raw_outputs):
        if not isinstance(output, dict) or not isinstance(output.get("name"), str):
            raise ProtocolError(f"outputs[{position}] must be an object with a string 'name'")
        name = output["name"]
        if name in requested:
            raise ProtocolError(f"output '{name}' is requested more than once")
        params = _optional_dict(output, "parameters", f"output '{name}'")
        requested[name] = RequestedOutput(name, _optional_bool(params, "binary_data", f"output '{name}' parameters",
                                                               default_binary))
    return tuple(requested.values())


def _optional_dict(container: dict, key: str, where: str) -> dict:
    value = container.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ProtocolError(f"{where}: '{key}' must be an object, got {type(value).__name__}")
    if unsupported := [param for param in _UNSUPPORTED_PARAMETERS if param in value]:
        raise ProtocolError(f"{where}: parameters {unsupported} are not supported by this server")
    return value


def _optional_bool(params: Mapping, key: str, where: str, default: bool = False) -> bool:
    value = params.get(key, default)
    if not isinstance(value, bool):
        raise ProtocolError(f"{where}: '{key}' must be true or false, got {value!r}")
    return value


def as_datatype(array: np.ndarray, datatype: str) -> np.ndarray:
    if datatype not in DATATYPES:
        raise ValueError(f"{datatype!r} is not a v2 datatype")
    return array.astype(DATATYPES[datatype], copy=False)


def encode_binary_data(array: np.ndarray, datatype: str) -> bytes:
    """An array (already of its datatype) as raw bytes: the binary extension's and gRPC's raw contents."""
    if datatype != "BYTES":
        return array.tobytes()  # C order, and the dtype is little-endian already
    encoded = [element_bytes(value) for value in array.ravel()]
    return b"".join(_BYTES_LENGTH.pack(len(value)) + value for value in encoded)


def element_bytes(value: object) -> bytes:
    """A BYTES output element; models may produce str, which goes as UTF-8."""
    if isinstance(value, str):
        return value.encode()
    if not isinstance(value, bytes):
        raise TypeError(f"BYTES output elements must be bytes or str, got {type(value).__name__}")
    return value


def _json_data(name: str, array: np.ndarray, datatype: str) -> list:
    """Flat row-major data; BYTES as UTF-8 strings since JSON holds no raw bytes."""
    if datatype != "BYTES":
        return array.ravel().tolist()
    try:
        return [element_bytes(value).decode() for value in array.ravel()]
    except UnicodeDecodeError:
        raise ProtocolError(f"output '{name}': BYTES data is not UTF-8; request it with binary_data true") from None


def numpy_to_json(value: object) -> object:
    """Lets numpy scalars and arrays in response parameters serialise."""
    if isinstance(value, np.generic | np.ndarray):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")
