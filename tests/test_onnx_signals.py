"""ONNX sets run whole in one session whose ramps signal as the run goes on: ramps read a site's value in ONNX
Runtime's blocked layout as they read it in the model's, every reader of a site's value waits for its signal, the
blocked values ONNX Runtime keeps are the sites' activations, and a set's graph kept on disk makes the same session
in a later process."""

from __future__ import annotations

import os
import subprocess
import sys

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rampserve.graph import onnx_graph
from rampserve.graph.onnx_graph import (
    PYTHON_OP_DOMAIN, SiteValue, Tap, nchwc_block_size, optimize_for_machine, session_options, with_signals,
)
from rampserve.runtime.bundle import load_bundle, save_bundle
from rampserve.runtime.prepared import PreparedModel
from rampserve.runtime.torch_backend import site_activations
from rampserve.ramps.kinds import make_ramp
from rampserve.ramps.specs import RampSpec
from rampserve.ramps.onnx_fused import ramp_tap
from rampserve.ramps.pooling import LINEAR_CNN_GRID, POOLING_REDUCTIONS, SAMPLED_SIDE
from taps import tap_session

OPSET = 17


def _run_tap(tap: Tap, value: np.ndarray) -> list[np.ndarray]:
    (name,) = {v for node in tap.nodes for v in node.input if not v.startswith("ramp[")}
    return tap_session(tap, name, list(value.shape), OPSET).run(None, {name: value})


def _blocked(activation: np.ndarray, block: int) -> np.ndarray:
    """`activation` (n, c, h, w) in ONNX Runtime's NCHWc layout: channels padded with zeros to whole blocks, each
    block's channels innermost, given the shape (n, padded channels, h, w) that ONNX Runtime reports."""
    n, channels, h, w = activation.shape
    padded = -(-channels // block) * block
    full = np.zeros((n, padded, h, w), dtype=activation.dtype)
    full[:, :channels] = activation
    return np.ascontiguousarray(full.reshape(n, padded // block, block, h, w).transpose(0, 1, 3, 4, 2)).reshape(
        n, padded, h, w)


@settings(max_examples=40, deadline=None)
@given(channels=st.integers(1, 40), side=st.integers(3, 9) | st.integers(2 * SAMPLED_SIDE, 5 * SAMPLED_SIDE),
       block=st.sampled_from([4, 8, 16]),
       reduce=st.sampled_from(POOLING_REDUCTIONS), rows=st.integers(1, 3), seed=st.integers(0, 2**16),
       score=st.sampled_from(["max_prob", "entropy"]), hidden=st.sampled_from([None, 3, 16]))
def test_a_ramp_reads_a_blocked_value_as_it_reads_the_model_layout(channels, side, block, reduce, rows, seed,
                                                                   score, hidden) -> None:
    """A linear ramp (`hidden` None) or an MLP one: both computing the eager ramp's logits in either layout, and a
    linear one as rampserve's ONNX Runtime operator too."""
    torch.manual_seed(seed)
    features = channels * (1 if reduce == "spatial_mean" else LINEAR_CNN_GRID**2)
    ramp = make_ramp(RampSpec("mlp" if hidden else "linear", reduce, (features,), 5, hidden=hidden)).eval()
    ramp.center.normal_()
    shape = (channels, side, side)
    activation = np.random.default_rng(seed).standard_normal((rows, *shape)).astype(np.float32)
    plain = _run_tap(ramp_tap(ramp, "site", shape, OPSET, score, use_operator=False), activation)
    with torch.no_grad():
        np.testing.assert_allclose(plain[0], ramp(torch.from_numpy(activation)).numpy(), rtol=1e-4, atol=1e-5)
    if not hidden:  # a linear ramp in the model's layout is rampserve's operator, computing the same
        operator = _run_tap(ramp_tap(ramp, "site", shape, OPSET, score), activation)
        np.testing.assert_allclose(operator[0], plain[0], rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(operator[1], plain[1], rtol=0, atol=1e-5)
    blocked = _run_tap(ramp_tap(ramp, "site", shape, OPSET, score, block=block), _blocked(activation, block))
    np.testing.assert_allclose(blocked[0], plain[0], rtol=1e-4, atol=1e-5)  # logits
    np.testing.assert_allclose(blocked[1], plain[1], rtol=0, atol=1e-5)  # the batch's highest confidence


def test_the_blocked_values_onnx_runtime_keeps_are_the_sites_activations(onnx_prepared, fmnist_feeds) -> None:
    """What `optimize_for_machine` takes for each site is that site's activation, in the layout it says."""
    split = onnx_prepared.backend.split
    sites = onnx_prepared.site_names
    optimized, values = optimize_for_machine(split._model, 0, sites, nchwc_block_size())
    assert set(values) == set(sites)
    probe = onnx.ModelProto()
    probe.CopyFrom(optimized)
    probe.graph.output.extend(onnx.helper.make_tensor_value_info(v.name, onnx.TensorProto.FLOAT, None)
                              for v in values.values())
    options = session_options()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    found = ort.InferenceSession(probe.SerializeToString(), options, providers=["CPUExecutionProvider"]).run(
        [v.name for v in values.values()], {split.input_names[0]: fmnist_feeds[:3]})
    activations, _ = next(site_activations(onnx_prepared.backend, [{split.input_names[0]: fmnist_feeds[:3]}], sites))
    for (site, value), seen in zip(values.items(), found):
        expected = activations[site].numpy()
        if value.block:
            expected = _blocked(expected, value.block)
        np.testing.assert_allclose(seen, expected, rtol=1e-4, atol=1e-4, err_msg=site)
    assert nchwc_block_size() == 0 or any(v.block for v in values.values())  # the blocked layout is exercised


@settings(max_examples=10, deadline=None)
@given(data=st.data())
def test_every_reader_of_a_site_value_waits_for_its_signal(onnx_prepared, data) -> None:
    """In the signalled graph, a node that reads a site's value (other than its ramp's) has an input that adds
    the zero of that site's signal (to a small weight of its own, or to the value, once for all such readers) (an If whose then-branch calls the Python operator for the site's column), so
    ONNX Runtime cannot run it before the signal; the signals keep model order."""
    split = onnx_prepared.backend.split
    names = onnx_prepared.site_names
    active = sorted(data.draw(st.sets(st.sampled_from(names), min_size=1)), key=names.index)
    optimized, values = optimize_for_machine(split._model, 0, active, nchwc_block_size())
    taps = {site: onnx_prepared._signalled_tap(site, value) for site, value in values.items()}
    graph = with_signals(optimized, values, taps, "Signal", "floors").graph
    signals = [node for node in graph.node if node.op_type == "If"]
    calls = [next(n for n in onnx.helper.get_attribute_value(next(a for a in node.attribute if a.name == "then_branch"))
                  .node if n.domain == PYTHON_OP_DOMAIN and n.op_type == "Signal") for node in signals]
    assert [call.attribute[0].i for call in calls] == list(range(len(active)))
    producer = {v: node for node in graph.node for v in node.output}
    position = {id(node): i for i, node in enumerate(graph.node)}
    for site, signal in zip(active, signals):
        value: SiteValue = values[site]
        ramp_nodes = {node.name for node in taps[site].nodes}
        gates = [node for node in graph.node if value.name in node.input and signal.output[0] in node.input]
        assert len(gates) <= 1, site  # the value after the signal, if any reader needs it, is made once
        readers = [node for node in graph.node if node.name not in ramp_nodes and node not in gates
                   and (value.name in node.input or any(v in node.input for gate in gates for v in gate.output))]
        assert readers, site
        for reader in readers:
            waits = [producer[v] for v in reader.input if v in producer and producer[v].op_type == "Add"
                     and signal.output[0] in producer[v].input]
            assert waits, f"{reader.name} reads {site} without waiting for its signal"
            assert position[id(signal)] < position[id(waits[0])] < position[id(reader)]


@settings(deadline=None)  # the first example imports the signalling module, which takes seconds on a busy machine
@given(st.floats(-1.0, 3.0), st.floats(0.0, 1.0, width=32))
def test_a_confidence_above_a_floor_stays_above_its_float32_floor(floor: float, confidence: float) -> None:
    """The session compares float32 confidences with float32 floors: no confidence above a floor may fall to or
    under the floor's float32 form (the releasing thread would miss an input the rule releases)."""
    from rampserve.runtime.onnx_signals import float32_floors

    (converted,) = float32_floors([floor])
    assert converted.dtype == np.float32 and converted <= floor
    if np.float32(confidence) > floor:
        assert np.float32(confidence) > converted


def test_the_python_operators_load_without_the_tokenizer_converters() -> None:
    """onnxruntime_extensions' package imports its tokenizer converters, and with them transformers (seconds of an
    executor's start), and sets the protobuf implementation in the environment: loaded for its operators, neither."""
    flag = "PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION"
    code = ("import os, sys; import rampserve.runtime.onnx_signals as s; "
            f"print('transformers' in sys.modules, {flag!r} in os.environ, all(p.endswith('.so') for p in s.libraries()))")
    env = {name: value for name, value in os.environ.items() if name != flag}
    found = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert found.stdout.split() == ["False", "False", "True"]


@pytest.fixture(scope="module")
def onnx_bundle(onnx_prepared, tmp_path_factory) -> Path:
    return save_bundle(onnx_prepared, tmp_path_factory.mktemp("bundles") / "resnet18-small-onnx")


def _run(model: PreparedModel, sites: tuple[str, ...], feeds: dict) -> tuple[np.ndarray, list]:
    ramps: list = []
    output = model.run(feeds, sites, lambda *seen: ramps.append(seen), compiled=True)
    return output, ramps


def test_a_signalled_set_is_kept_on_disk_and_a_later_start_loads_it_unoptimized(onnx_bundle, fmnist_feeds,
                                                                                 monkeypatch) -> None:
    """Built once and checked against the model, a signalled set's graph is kept beside the bundle; the bundle
    loaded afresh (a restarted executor) makes its session from it, optimizing and checking nothing again, and it
    answers as the set built did, output and ramps. One whose graph does not match its index is built again."""
    first = load_bundle(onnx_bundle)
    name = first.backend.input_names[0]
    example, feeds = {name: fmnist_feeds[-2:]}, {name: fmnist_feeds[:16]}
    sites = tuple(first.site_names[1:3])
    assert first.compile(sites, example)
    built = first.compiled_set(sites)
    assert type(built.runner).__name__ == "OnnxSignalledRunner" and not built.from_disk
    [stored] = (onnx_bundle / "compiled").glob("*.onnx")
    output, ramps = _run(first, sites, feeds)

    def fail(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("a set kept on disk was optimized or checked again")

    again = load_bundle(onnx_bundle)
    with monkeypatch.context() as patched:
        patched.setattr(onnx_graph, "optimize_for_machine", fail)
        patched.setattr(PreparedModel, "_faithful", fail)
        assert again.compile(sites, example)
    loaded = again.compiled_set(sites)
    assert type(loaded.runner).__name__ == "OnnxSignalledRunner" and loaded.from_disk
    output_again, ramps_again = _run(again, sites, feeds)
    np.testing.assert_array_equal(output_again, output)
    assert [site for site, *_ in ramps_again] == [site for site, *_ in ramps] == list(sites)
    for (_, labels, errors), (_, labels_again, errors_again) in zip(ramps, ramps_again):
        np.testing.assert_array_equal(labels_again, labels)
        np.testing.assert_array_equal(errors_again, errors)

    graph = stored.read_bytes()
    stored.write_bytes(graph[:-1] + bytes([graph[-1] ^ 1]))  # no longer the graph its index hashed
    rebuilt = load_bundle(onnx_bundle)
    assert rebuilt.compile(sites, example) and not rebuilt.compiled_set(sites).from_disk
    np.testing.assert_array_equal(_run(rebuilt, sites, feeds)[0], output)
    third = load_bundle(onnx_bundle)
    assert third.compile(sites, example) and third.compiled_set(sites).from_disk  # kept again, whole
