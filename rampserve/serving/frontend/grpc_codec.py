"""KServe v2's gRPC messages (`inference.GRPCInferenceService`, as Triton and `tritonclient.grpc` speak it) to and
from what the data plane takes and gives. Pure, like `protocol.py`, whose rules every request passes: a
`ModelInferRequest` becomes the v2 request object (id, parameters, inputs, outputs) that an HTTP body holds, and its
tensors are read from `raw_input_contents` or typed `contents` by the same decoders; an `InferResponse` becomes a
`ModelInferResponse`, in raw contents unless the request sent typed ones.

The messages are the ones generated inside `tritonclient.grpc` (Triton's service, a superset of KServe's in the same
protobuf package, `inference`). A copy of our own would register the same protobuf names again, and a process that
also imports tritonclient (a test, a benchmark, an application calling Triton) would fail on the duplicates.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, MutableMapping, Sequence

import numpy as np
from tritonclient.grpc import service_pb2 as pb

from rampserve.serving.frontend.plane import InferResponse
from rampserve.serving.shared.protocol import (
    InferRequest,
    ProtocolError,
    TensorSpec,
    as_datatype,
    decode_binary_data,
    decode_json_data,
    element_bytes,
    encode_binary_data,
    infer_request_from,
    numpy_to_json,
    object_array,
)

# The typed contents field that holds each datatype's values (FP16 has none: raw contents only)
CONTENTS_FIELDS = {"BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents", "INT32": "int_contents",
                   "INT64": "int64_contents", "UINT8": "uint_contents", "UINT16": "uint_contents",
                   "UINT32": "uint_contents", "UINT64": "uint64_contents", "FP32": "fp32_contents",
                   "FP64": "fp64_contents", "BYTES": "bytes_contents"}
INT64_MAX = (1 << 63) - 1


def parameter_values(parameters: Mapping[str, pb.InferParameter]) -> dict:
    """A parameters map as the plain values a v2 JSON body would carry."""
    values = {}
    for key, parameter in parameters.items():
        choice = parameter.WhichOneof("parameter_choice")
        values[key] = None if choice is None else getattr(parameter, choice)
    return values


def set_parameters(target: MutableMapping[str, pb.InferParameter], values: Mapping[str, object]) -> None:
    """Response parameters into a parameters map: booleans, integers, numbers and strings as themselves; lists and
    objects (one value per input of a request of several rows) as JSON text; None (no exit site: the final layer)
    left out, as the map has no null."""
    for key, value in values.items():
        value = value.item() if isinstance(value, np.generic) else value
        if value is None:
            continue
        if isinstance(value, bool):
            target[key].bool_param = value
        elif isinstance(value, int):
            if value > INT64_MAX:
                target[key].uint64_param = value
            else:
                target[key].int64_param = value
        elif isinstance(value, float):
            target[key].double_param = value
        elif isinstance(value, str):
            target[key].string_param = value
        else:
            target[key].string_param = json.dumps(value, separators=(",", ":"), default=numpy_to_json)


def _request_object(message: pb.ModelInferRequest) -> dict:
    """The v2 request object of a gRPC request, without the tensors' values (an unset string or shape: missing)."""
    return {
        "id": message.id or None,
        "parameters": parameter_values(message.parameters),
        "inputs": [{"name": tensor.name or None, "datatype": tensor.datatype or None, "shape": list(tensor.shape) or None,
                    "parameters": parameter_values(tensor.parameters)} for tensor in message.inputs],
        "outputs": [{"name": output.name or None, "parameters": parameter_values(output.parameters)}
                    for output in message.outputs],
    }


def infer_request(message: pb.ModelInferRequest, inputs: Sequence[TensorSpec], allow_nonfinite: bool = False,
                  alternative: Sequence[TensorSpec] = ()) -> InferRequest:
    """Decode and validate a gRPC infer request against the model's inputs (or `alternative`, the inputs it takes in
    their place); any fault is a ProtocolError."""
    raw = message.raw_input_contents
    if raw and len(raw) != len(message.inputs):
        raise ProtocolError(f"raw_input_contents holds {len(raw)} tensors for {len(message.inputs)} inputs: give one "
                            "per input, in the inputs' order")

    def read(position: int, _tensor: dict, _params: dict, spec: TensorSpec, shape: tuple[int, ...]) -> np.ndarray:
        contents = message.inputs[position].contents
        typed = [field.name for field, _ in contents.ListFields()]
        if raw:
            if typed:
                raise ProtocolError(f"input '{spec.name}': its values are in raw_input_contents and in "
                                    f"contents.{typed[0]}; give them once")
            return decode_binary_data(memoryview(raw[position]), spec, shape,
                                      f"raw_input_contents[{position}] holds")
        return _typed_values(contents, typed, spec, shape)

    return infer_request_from(_request_object(message), read, inputs, allow_nonfinite, alternative)


def _typed_values(contents: pb.InferTensorContents, typed: list[str], spec: TensorSpec,
                  shape: tuple[int, ...]) -> np.ndarray:
    field = CONTENTS_FIELDS.get(spec.datatype)
    if field is None:
        raise ProtocolError(f"input '{spec.name}': {spec.datatype} has no typed contents; send it in "
                            "raw_input_contents")
    if typed and typed != [field]:
        raise ProtocolError(f"input '{spec.name}': {spec.datatype} values go in contents.{field}, got "
                            f"contents.{', contents.'.join(typed)}")
    values, source = list(getattr(contents, field)), f"contents.{field}"
    if spec.datatype != "BYTES":
        return decode_json_data(values, spec, shape, source)
    if len(values) != int(np.prod(shape)):
        raise ProtocolError(f"input '{spec.name}': shape {list(shape)} holds {int(np.prod(shape))} elements, "
                            f"{source} has {len(values)}")
    return object_array(values, shape)


def infer_response(answer: InferResponse, typed: bool) -> pb.ModelInferResponse:
    """The response to a request: its outputs in raw_output_contents (as Triton answers), or, when `typed` (the
    request sent typed contents), in typed contents where every output's datatype has them."""
    response = pb.ModelInferResponse(model_name=answer.model, model_version=answer.version, id=answer.id or "")
    set_parameters(response.parameters, answer.parameters)
    typed = typed and all(datatype in CONTENTS_FIELDS for _, datatype, _ in answer.outputs)
    for output, datatype, values in answer.outputs:
        array = as_datatype(np.asarray(values), datatype)
        tensor = response.outputs.add(name=output.name, datatype=datatype, shape=array.shape)
        if not typed:
            response.raw_output_contents.append(encode_binary_data(array, datatype))
        elif datatype == "BYTES":
            tensor.contents.bytes_contents.extend(element_bytes(value) for value in array.ravel())
        else:
            getattr(tensor.contents, CONTENTS_FIELDS[datatype]).extend(array.ravel().tolist())
    return response


def model_metadata_response(metadata: dict) -> pb.ModelMetadataResponse:
    """The gRPC form of the v2 model metadata object (`protocol.model_metadata`)."""
    return pb.ModelMetadataResponse(
        name=metadata["name"], versions=metadata["versions"], platform=metadata["platform"],
        inputs=[pb.ModelMetadataResponse.TensorMetadata(**tensor) for tensor in metadata["inputs"]],
        outputs=[pb.ModelMetadataResponse.TensorMetadata(**tensor) for tensor in metadata["outputs"]])
