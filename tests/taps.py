"""A ramp's tap (`graph.onnx_graph.Tap`) as a session of its own, reading its site's value as a graph input: what the
tests of taps run, with the custom operators the tap's nodes need."""

from __future__ import annotations

from collections.abc import Sequence

import onnxruntime as ort
from onnx import TensorProto, helper

from rampserve.graph.onnx_graph import Tap


def tap_session(tap: Tap, name: str, shape: Sequence[int | str], opset: int) -> ort.InferenceSession:
    """`tap` reading input `name` (float, `shape`), for a model of ONNX operator set `opset`."""
    graph = helper.make_graph(list(tap.nodes), "tap", [helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)],
                              list(tap.outputs), initializer=list(tap.initializers))
    domains = dict.fromkeys(library.domain for library in tap.libraries)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset),
                                                    *(helper.make_opsetid(domain, 1) for domain in domains)])
    options = ort.SessionOptions()
    for path in dict.fromkeys(library.path for library in tap.libraries):
        options.register_custom_ops_library(path)
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
