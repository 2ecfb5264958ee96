"""rampserve's ramp operator for ONNX Runtime (`ramps.onnx_kernel`): built by the setup, computing what a linear
ramp's ONNX nodes compute, refusing arguments it cannot read with a message, and serving a text model's ramps in its
signalled sets (kept on disk and loaded in a process without torch)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper
from typer.testing import CliRunner

from rampserve.cli import app
from rampserve.ramps import onnx_kernel
from rampserve.ramps.arrays import RampArrays
from rampserve.ramps.kernel_args import REDUCE_CODES
from rampserve.ramps.onnx_fused import ramp_tap
from rampserve.ramps.specs import RampSpec
from rampserve.runtime.bundle import load_bundle
from taps import tap_session
from test_hf_prepare import TEXTS, save_bert_with_minilm_tokenizer

OPSET = 17


def test_the_setup_builds_the_operator_against_onnx_runtimes_headers() -> None:
    library = onnx_kernel.library()
    assert library is not None and Path(library).is_file()
    assert (onnx_kernel.headers() / "onnxruntime_cxx_api.h").is_file()
    assert Path(library).parent.name == onnx_kernel.build_id()


def _ramp(reduce: str, width: int, classes: int, seed: int) -> RampArrays:
    rng = np.random.default_rng(seed)
    return RampArrays(RampSpec("linear", reduce, (width,), classes), rng.standard_normal(width).astype(np.float32),
                      ((rng.standard_normal((classes, width)).astype(np.float32),
                        rng.standard_normal(classes).astype(np.float32)),))


@settings(max_examples=60, deadline=None)
@given(reduce=st.sampled_from(sorted(REDUCE_CODES)), rows=st.integers(0, 5), tokens=st.integers(1, 12),
       hidden=st.integers(1, 40), classes=st.integers(2, 9), score=st.sampled_from(["max_prob", "entropy"]),
       padding=st.integers(0, 4), seed=st.integers(0, 2**16))
def test_the_operator_computes_what_the_ramps_onnx_nodes_compute(reduce, rows, tokens, hidden, classes, score,
                                                                 padding, seed) -> None:
    """Any token reduction or none, any error score, any batch (none included: confidence 0), with padded positions
    zeroed as an encoder zeroes them: the same logits and the same highest confidence, from one node."""
    shape = (tokens + padding, hidden)
    width = int(np.prod(shape)) if reduce == "identity" else hidden
    ramp = _ramp(reduce, width, classes, seed)
    activation = np.random.default_rng(seed + 1).standard_normal((rows, *shape)).astype(np.float32)
    activation[:, tokens:] = 0.0
    operator = ramp_tap(ramp, "site", shape, OPSET, score)
    nodes = ramp_tap(ramp, "site", shape, OPSET, score, use_operator=False)
    assert [node.op_type for node in operator.nodes] == [onnx_kernel.OP_TYPE]
    assert operator.key != nodes.key  # stages are kept by tap key: the two are never taken for each other
    found, expected = (tap_session(tap, "site", ["rows", *shape], OPSET).run(None, {"site": activation})
                       for tap in (operator, nodes))
    assert found[0].shape == (rows, classes)
    np.testing.assert_allclose(found[0], expected[0], rtol=1e-4, atol=1e-5)
    if rows:
        np.testing.assert_allclose(found[1], expected[1], rtol=0, atol=1e-5)
    else:
        assert float(found[1]) == 0.0


def _session_of(activation_shape: list, width: int, reduce: int = 4) -> ort.InferenceSession:
    """A RampHead node on an input of `activation_shape` with a (2, `width`) head."""
    rng = np.random.default_rng(0)
    weights = [numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), name)
               for name, shape in (("weight", (2, width)), ("bias", (2,)), ("center", (width,)))]
    node = helper.make_node(onnx_kernel.OP_TYPE, ["x", "weight", "bias", "center"], ["logits", "confidence"],
                            domain=onnx_kernel.DOMAIN, reduce=reduce, score=0)
    graph = helper.make_graph([node], "ramp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, activation_shape)],
                              [helper.make_tensor_value_info(v, TensorProto.FLOAT, None) for v in node.output], weights)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET),
                                                    helper.make_opsetid(onnx_kernel.DOMAIN, 1)])
    options = ort.SessionOptions()
    options.register_custom_ops_library(onnx_kernel.library())
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def test_arguments_the_operator_cannot_read_fail_the_run_with_what_is_wrong() -> None:
    with pytest.raises(ort.capi.onnxruntime_pybind11_state.InvalidArgument, match="RampHead.*8 features.*takes 6"):
        _session_of(["n", 3, 8], 6).run(None, {"x": np.ones((1, 3, 8), np.float32)})
    with pytest.raises(ort.capi.onnxruntime_pybind11_state.InvalidArgument, match="RampHead.*rank 2"):
        _session_of(["n", 8], 8).run(None, {"x": np.ones((1, 8), np.float32)})
    with pytest.raises(ort.capi.onnxruntime_pybind11_state.InvalidArgument, match="RampHead.*pooling matrix"):
        _session_of(["n", 2, 3, 3], 2, reduce=3).run(None, {"x": np.ones((1, 2, 3, 3), np.float32)})
    session = _session_of(["n", 3, 8], 8)  # a session that refused an input serves the next
    assert session.run(None, {"x": np.ones((2, 3, 8), np.float32)})[0].shape == (2, 2)


@pytest.fixture(scope="module")
def text_onnx_bundle(tmp_path_factory) -> Path:
    """A small random BERT prepared on ONNX Runtime: linear ramps on token sites (a masked token mean)."""
    directory = tmp_path_factory.mktemp("text-onnx")
    checkpoint, bundle = directory / "bert", directory / "bundle"
    save_bert_with_minilm_tokenizer(checkpoint)
    result = CliRunner().invoke(app, ["prepare", f"hf:{checkpoint}", "--workload", "rt-drift", "--out", str(bundle),
                                      "--bootstrap", "300", "--profile-budget", "0.05", "--engine", "onnxruntime"])
    assert result.exit_code == 0, result.output
    return bundle


SERVE_FROM_DISK = """
import json, sys
import numpy as np
from rampserve.runtime.bundle import load_bundle
model = load_bundle(sys.argv[1])
feeds = {name: np.asarray(ids, dtype=np.int64) for name, ids in json.loads(sys.argv[2]).items()}
sites = tuple(model.site_names)
assert model.compile(sites, feeds)
ramps = []
output = model.run(feeds, sites, lambda site, labels, errors: ramps.append(errors.tolist()), compiled=True)
print(json.dumps({"from_disk": model.compiled_set(sites).from_disk, "torch": "torch" in sys.modules,
                  "output": output.tolist(), "errors": ramps}))
"""


def test_a_text_models_signalled_set_runs_its_ramps_as_the_operator_and_loads_without_torch(text_onnx_bundle) -> None:
    """The set of every site: its graph holds one operator node per ramp and none of the nodes' masked token mean; it
    answers as the eager path does (the model's output, each ramp's error scores); kept on disk, a fresh process
    that never imports torch makes the same session from it and answers alike."""
    from rampserve.runtime.prepare import prepared_encoder

    model = load_bundle(text_onnx_bundle)
    feeds = prepared_encoder(model, "text")(TEXTS)
    sites = tuple(model.site_names)
    assert model.compile(sites, feeds)
    assert type(model.compiled_set(sites).runner).__name__ == "OnnxSignalledRunner"
    [stored] = (text_onnx_bundle / "compiled").glob("*.onnx")
    ops = [node.op_type for node in onnx.load(str(stored)).graph.node]
    assert ops.count(onnx_kernel.OP_TYPE) == len(sites) and "Abs" not in ops

    def run(compiled: bool) -> tuple[np.ndarray, list]:
        ramps: list = []
        output = model.run(feeds, sites, lambda site, labels, errors: ramps.append(errors), compiled=compiled)
        return output, ramps

    (output, errors), (eager_output, eager_errors) = run(True), run(False)
    np.testing.assert_allclose(output, eager_output, rtol=1e-4, atol=1e-5)
    for found, expected in zip(errors, eager_errors, strict=True):
        np.testing.assert_allclose(found, expected, rtol=0, atol=1e-4)  # the optimized graph rounds otherwise

    token_ids = json.dumps({name: ids.tolist() for name, ids in feeds.items()})
    fresh = json.loads(subprocess.run([sys.executable, "-c", SERVE_FROM_DISK, str(text_onnx_bundle), token_ids],
                                      check=True, capture_output=True, text=True).stdout.splitlines()[-1])
    assert fresh["from_disk"] and not fresh["torch"]
    np.testing.assert_array_equal(np.asarray(fresh["output"], np.float32), output)
    np.testing.assert_allclose(np.asarray(fresh["errors"]), np.asarray(errors), rtol=0, atol=1e-6)
