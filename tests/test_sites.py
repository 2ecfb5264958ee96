"""Cut-vertex site analysis on hand-made dataflow graphs."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rampserve.graph.sites import Dataflow, Op, block_of, cut_values, data_path_values, find_sites


def chain(n: int, heavy_every: int = 1) -> Dataflow:
    ops = []
    prev = "x"
    for i in range(n):
        ops.append(Op(f"op{i}", "conv", (prev,), (f"v{i}",), scope=f"layers.{i}", heavy=i % heavy_every == 0))
        prev = f"v{i}"
    return Dataflow(inputs=("x",), ops=tuple(ops), outputs=(prev,))


def residual() -> Dataflow:
    # stem -> [block: a=conv(s), b=conv(a), c=add(b, s)] -> head
    return Dataflow(
        inputs=("x",),
        ops=(
            Op("stem", "conv", ("x",), ("s",), "stem", heavy=True),
            Op("a", "conv", ("s",), ("a",), "layer.0.conv1", heavy=True),
            Op("b", "conv", ("a",), ("b",), "layer.0.conv2", heavy=True),
            Op("c", "add", ("b", "s"), ("c",), "layer.0"),
            Op("d", "conv", ("c",), ("d",), "layer.1.conv1", heavy=True),
            Op("e", "add", ("d", "c"), ("e",), "layer.1"),
            Op("fc1", "linear", ("e",), ("f",), "fc1", heavy=True),
            Op("fc2", "linear", ("f",), ("y",), "fc2", heavy=True),
        ),
        outputs=("y",),
    )


def test_every_op_of_a_chain_is_a_cut_but_the_output() -> None:
    graph = chain(5)
    assert [c.value for c in cut_values(graph)] == ["v0", "v1", "v2", "v3"]


def test_no_cut_inside_a_residual_block() -> None:
    assert [c.value for c in cut_values(residual())] == ["s", "c", "e", "f"]


def test_default_policy_drops_sites_that_leave_only_the_output_layer() -> None:
    assert [s.value for s in find_sites(residual())] == ["s", "c", "e"]


def test_side_inputs_do_not_block_sites() -> None:
    graph = Dataflow(
        inputs=("x", "mask"),
        ops=(
            Op("m", "neg", ("mask",), ("m",)),
            Op("l0", "layer", ("x", "m"), ("h0",), "layers.0", heavy=True),
            Op("l1", "layer", ("h0", "m"), ("h1",), "layers.1", heavy=True),
            Op("l2", "layer", ("h1", "m"), ("h2",), "layers.2", heavy=True),
            Op("head", "linear", ("h2",), ("y",), "head", heavy=True),
        ),
        outputs=("y",),
    )
    assert data_path_values(graph) == {"x", "h0", "h1", "h2", "y"}
    assert [c.value for c in cut_values(graph)] == ["h0", "h1", "h2"]


def test_cheap_ops_after_a_layer_collapse_into_one_site() -> None:
    ops = []
    prev = "x"
    for layer in range(3):
        for kind, heavy in (("conv", True), ("bn", False), ("relu", False)):
            name = f"{kind}{layer}"
            ops.append(Op(name, kind, (prev,), (name,), f"features.{len(ops)}", heavy=heavy))
            prev = name
    ops.append(Op("fc", "linear", (prev,), ("y",), "fc", heavy=True))
    graph = Dataflow(("x",), tuple(ops), ("y",))
    assert [s.value for s in find_sites(graph)] == ["relu0", "relu1"]


def test_policy_may_restrict_and_extend_but_not_invent() -> None:
    graph = residual()
    only_first = find_sites(graph, lambda g, cands: cands[:1])
    assert [s.value for s in only_first] == ["s"]
    everything = find_sites(graph, lambda g, cands: cands)
    assert [s.value for s in everything] == ["s", "c", "e", "f"]
    with pytest.raises(ValueError, match="not cut values"):
        find_sites(graph, lambda g, cands: [*cands, cands[0].__class__("b", 2, "b", "conv", "", 1, 1)])


def test_graph_must_be_topological() -> None:
    with pytest.raises(ValueError, match="not topological"):
        Dataflow(("x",), (Op("a", "relu", ("b",), ("a",)), Op("b", "relu", ("x",), ("b",))), ("a",))


@pytest.mark.parametrize(
    ("scope", "block"),
    [("layer1.0.conv1", "layer1.0"), ("_blocks.3._bn0", "_blocks.3"), ("conv1", "conv1"), ("", ""),
     ("encoder.layer.2.attention", "encoder.layer.2")],
)
def test_block_of(scope: str, block: str) -> None:
    assert block_of(scope) == block


@st.composite
def random_dags(draw) -> Dataflow:
    n = draw(st.integers(2, 12))
    ops = []
    values = ["x"]
    for i in range(n):
        k = draw(st.integers(1, min(3, len(values))))
        inputs = tuple(sorted(set(draw(st.lists(st.sampled_from(values), min_size=k, max_size=k)))))
        ops.append(Op(f"o{i}", "op", inputs, (f"v{i}",), heavy=draw(st.booleans())))
        values.append(f"v{i}")
    return Dataflow(("x",), tuple(ops), (values[-1],))


@settings(max_examples=200, deadline=None)
@given(random_dags())
def test_cuts_match_the_definition(graph: Dataflow) -> None:
    """A value is a cut iff it is the only value produced at or before its op and read after it."""
    found = {c.value for c in cut_values(graph)}
    ops = graph.ops
    for i, op in enumerate(ops[:-1]):
        produced = {"x"} | {v for o in ops[: i + 1] for v in o.outputs}
        read_later = {v for o in ops[i + 1:] for v in o.inputs} | set(graph.outputs)
        crossing = produced & read_later
        expected = crossing == set(op.outputs) and op.outputs[0] not in graph.outputs
        assert (op.outputs[0] in found) == expected
