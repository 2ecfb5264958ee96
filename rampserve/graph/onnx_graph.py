"""ONNX front end: describe an ONNX model as a `Dataflow`, and run it in stages split at sites.

Stages are sub-graphs of the original graph, each in its own onnxruntime session, so a third-party model
needs no Python source to get exit ramps: only its ONNX file. A stage may also compute a `Tap` on the value it
ends at (an exit ramp, say) as an extra output of its sub-graph, in the same session call.

Or the model runs whole, in the graph ONNX Runtime optimized for this machine (`optimize_for_machine`), with
taps that hand their outputs to a Python operator as soon as their site's value exists (`with_signals`): no cut,
no session call per site, and the sites' values stay in whatever layout ONNX Runtime chose for them.
"""

from __future__ import annotations

import functools
import re
import tempfile
import threading
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import onnx
import onnxruntime as ort

from rampserve.graph.sites import Dataflow, Op, SiteCandidate, SitePolicy, find_sites
from rampserve.threads import native_threads_named

if TYPE_CHECKING:
    import torch

Stage = Callable[[np.ndarray, Mapping[str, np.ndarray]], np.ndarray]

# Contractions. They count as heavy (a "layer") only when an operand is a constant, i.e. learned weights:
# attention's activation-by-activation MatMuls belong to a layer whose weighted projections already count,
# and counting them would make one attention layer look like three layers to the site policy.
_CONTRACTIONS = frozenset({
    "Conv", "ConvInteger", "ConvTranspose", "DeformConv", "QLinearConv",
    "Gemm", "MatMul", "MatMulInteger", "QLinearMatMul", "Einsum",
    "LSTM", "GRU", "RNN",
    "Attention", "FusedConv", "FusedGemm", "FusedMatMul", "MatMulNBits",  # onnxruntime's com.microsoft ops
})
# Ops that produce a fresh value on every run even from constant inputs, so their outputs are not constants.
_RANDOM = frozenset({
    "RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Multinomial", "Bernoulli",
})

_MODULE_PATH = re.compile(r"\w+(?:\.\w+)*")
# Where ONNX Runtime's CPU provider keeps its blocked-layout (NCHWc) operators, and where onnxruntime-extensions
# registers operators written in Python
NCHWC_DOMAIN = "com.microsoft.nchwc"
PYTHON_OP_DOMAIN = "ai.onnx.contrib"


def scope_from_node_name(name: str) -> str:
    """The dotted module path of a node named by `torch.onnx.export(..., dynamo=False)`, or "" when unknown.

    The exporter names a node by its module call stack, one component per module, ending with the op:
    "/layer1/layer1.0/conv1/Conv". Each component is the module's qualified name from its last non-numeric
    atom on, so a container's child repeats the container's path ("layer1" then "layer1.0", "seq.0" then
    "seq.0.1") while any other child is its attribute name ("conv1"). Joining accordingly gives the module's
    qualified name, "layer1.0.conv1". A container that is indexed but never called (a ModuleDict, a
    ModuleList) has no component of its own; a ModuleList's index survives in its child's ("lst.0.0") but a
    ModuleDict's attribute name is lost. A module called twice gets "_1" on its second call's component
    ("layer1.0.relu_1"), kept as is: a module may really be named so.
    """
    parts = name.split("/")
    if len(parts) < 2 or parts[0] != "":
        return ""
    path: list[str] = []
    for component in parts[1:-1]:
        if not _MODULE_PATH.fullmatch(component):
            return ""
        if path and component.startswith(path[-1] + "."):
            path[-1] = component
        else:
            path.append(component)
    return ".".join(path)


def _subgraph_references(node: onnx.NodeProto) -> list[str]:
    """Outer-scope values read inside a node's sub-graphs (If/Loop/Scan bodies): hidden inputs of the node."""
    refs: list[str] = []
    for attr in node.attribute:
        bodies = [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)
        for body in bodies:
            local = {v.name for v in body.input} | {t.name for t in body.initializer} | {""}
            for inner in body.node:
                refs.extend(v for v in (*inner.input, *_subgraph_references(inner)) if v not in local)
                local.update(inner.output)
    return refs


def _node_inputs(node: onnx.NodeProto) -> list[str]:
    """Every value a node reads, hidden sub-graph reads included, once each and without absent optionals."""
    return list(dict.fromkeys(v for v in (*node.input, *_subgraph_references(node)) if v))


def _real_inputs(graph: onnx.GraphProto) -> list[str]:
    # Older exporters also list initializers as graph inputs (to allow overriding them); those are weights.
    weights = {t.name for t in graph.initializer}
    return [v.name for v in graph.input if v.name not in weights]


def _topological_order(graph: onnx.GraphProto) -> list[int]:
    """Node indices in an order where each node reads only values already available; the identity when the
    graph is sorted, as the ONNX spec requires but not every producer ensures."""
    available = {*_real_inputs(graph), *(t.name for t in graph.initializer)}
    reads = [_node_inputs(node) for node in graph.node]
    pending, order = list(range(len(graph.node))), []
    while pending:
        blocked = []
        for index in pending:
            if all(v in available for v in reads[index]):
                order.append(index)
                available.update(graph.node[index].output)
            else:
                blocked.append(index)
        if len(blocked) == len(pending):
            node = graph.node[blocked[0]]
            missing = [v for v in reads[blocked[0]] if v not in available]
            raise ValueError(f"ONNX node {node.name or node.op_type!r} reads {missing}, which nothing produces")
        pending = blocked
    return order


def _sorted_model(model: onnx.ModelProto) -> onnx.ModelProto:
    order = _topological_order(model.graph)
    if order == sorted(order):
        return model
    ordered = onnx.ModelProto()
    ordered.CopyFrom(model)
    del ordered.graph.node[:]
    ordered.graph.node.extend(model.graph.node[i] for i in order)
    return ordered


def onnx_dataflow(model: onnx.ModelProto) -> Dataflow:
    """The model's graph as a `Dataflow`. The primary input is the first graph input that is not a weight.

    Constants are not data values: initializers, Constant nodes, and nodes computing only from constants
    (the exporter leaves shape arithmetic such as a Pad's pads unfolded) are left out, ops and inputs alike.
    """
    graph = model.graph
    constants = {t.name for t in graph.initializer}
    ops = []
    for index in _topological_order(graph):
        node = graph.node[index]
        reads = _node_inputs(node)
        if node.op_type not in _RANDOM and all(v in constants for v in reads):
            constants.update(node.output)
            continue
        ops.append(
            Op(
                name=node.name or f"{node.op_type}_{index}",
                kind=node.op_type,
                inputs=tuple(v for v in reads if v not in constants),
                outputs=tuple(v for v in node.output if v),
                scope=scope_from_node_name(node.name),
                heavy=node.op_type in _CONTRACTIONS and any(v in constants for v in reads),
            )
        )
    return Dataflow(inputs=tuple(_real_inputs(graph)), ops=tuple(ops), outputs=tuple(v.name for v in graph.output))


@dataclass(frozen=True)
class OperatorLibrary:
    """A library of custom ONNX Runtime operators: the domain of its nodes, which a graph holding them imports, and
    the path from which a session running them registers them."""

    domain: str
    path: str


@dataclass(frozen=True, eq=False)  # holds protobufs, which do not hash
class Tap:
    """Extra work on a cut value inside the stage that ends at it: ONNX nodes that read the cut value by its name,
    the initializers they read, and the values they produce (typed), which the stage returns beside its output;
    `libraries`, those of the custom operators among its nodes. `key` names what the nodes compute: stages are kept
    per segment and tap key."""

    key: str
    nodes: tuple[onnx.NodeProto, ...]
    initializers: tuple[onnx.TensorProto, ...]
    outputs: tuple[onnx.ValueInfoProto, ...]
    libraries: tuple[OperatorLibrary, ...] = ()


def _importing(model: onnx.ModelProto, domains: Iterable[str]) -> None:
    """Make `model` import operator set `domains` (version 1), where it does not already."""
    imported = {o.domain for o in model.opset_import}
    for domain in dict.fromkeys(domains):
        if domain not in imported:
            model.opset_import.append(onnx.helper.make_opsetid(domain, 1))


def _feeds(input_name: str, side_names: Sequence[str], x: np.ndarray, side: Mapping[str, np.ndarray]
           ) -> dict[str, np.ndarray]:
    missing = [name for name in side_names if name not in side]
    if missing:
        raise KeyError(f"this stage reads side inputs {missing}, which were not given")
    return {input_name: x, **{name: side[name] for name in side_names}}


@dataclass(frozen=True)
class _Runner:
    """One session that maps the data value `input_name` (plus the side inputs it reads) to `output_name`, and
    with a tap also to the tap's outputs."""

    session: ort.InferenceSession
    input_name: str
    side_names: tuple[str, ...]
    output_name: str
    tap_outputs: tuple[str, ...] = ()

    def _feeds(self, x: np.ndarray, side: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return _feeds(self.input_name, self.side_names, x, side)

    def __call__(self, x: np.ndarray, side: Mapping[str, np.ndarray]) -> np.ndarray:
        return self.session.run([self.output_name], self._feeds(x, side))[0]

    def tapped(self, x: np.ndarray, side: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        """The stage's output, then its tap's outputs, from one session call."""
        return self.session.run([self.output_name, *self.tap_outputs], self._feeds(x, side))


ONNX_SPIN_US = 200  # how long an idle pool thread spins before it sleeps, in microseconds
ORT_POOL_NAME = "onnxruntime"  # the kernel's name for the threads of a served session's pool


def session_options(intra_op_threads: int = 0, spin_after_run: bool = False) -> ort.SessionOptions:
    """Options for the sessions of a model: `intra_op_threads` (0: ONNX Runtime's default, one per core), and
    whether its threads go on spinning as long as ONNX Runtime's default has them after a run returns (never where
    rampserve serves)."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = intra_op_threads
    if not spin_after_run:
        # ONNX Runtime's pool threads spin between the operators of a run, which is much of its speed at batch 1
        # (lite0-fmnist 5.5 ms, 7.5 ms with spinning off), but by default go on spinning for about 24 ms of a core
        # after the run returns, taking the cores that the next stage's session, a ramp in torch or the server's own
        # threads need (seen on 2 cores: lite0-fmnist cut in 4 stages ran 2.3x slower; torch at batch 1 went from
        # about 3 ms to over 600 ms). Spinning at most ONNX_SPIN_US before sleeping keeps the speed (resnet18-fmnist
        # 0.178 ms against 0.177 with the default spin and 0.250 stopped at every run's end) for 1.3 ms of a core.
        options.add_session_config_entry("session.intra_op.spin_duration_us", str(ONNX_SPIN_US))
    return options


SIGNAL_FLOORS = "rampserve_signal_floors"  # the graph input of `with_signals`' floors
RAMP_LOGITS = "rampserve_ramp_logits"  # and its output of every ramp's logits


@dataclass(frozen=True)
class SignalledRunner:
    """The session of `OnnxSplitModel.signalled`: the model's output and each site's ramp logits from its inputs
    and the sites' exit floors."""

    session: ort.InferenceSession
    input_name: str
    side_names: tuple[str, ...]
    output_name: str

    def __call__(self, x: np.ndarray, side: Mapping[str, np.ndarray], floors: np.ndarray,
                 options: ort.RunOptions | None = None) -> list[np.ndarray]:
        """The model's output, then every ramp's logits side by side (rows, sites * classes)."""
        feeds = _feeds(self.input_name, self.side_names, x, side)
        feeds[SIGNAL_FLOORS] = floors
        return self.session.run([self.output_name, RAMP_LOGITS], feeds, options)


class OnnxSplitModel:
    """An ONNX model with its sites, runnable whole or as a chain of stages cut at chosen sites."""

    def __init__(self, model: onnx.ModelProto | str | Path, policy: SitePolicy | None = None,
                 intra_op_threads: int = 0, spin_after_run: bool = False) -> None:
        loaded = model if isinstance(model, onnx.ModelProto) else onnx.load(str(model))
        # Shape inference gives every cut value a type, which a stage needs to declare it as an input/output.
        self._model = onnx.shape_inference.infer_shapes(_sorted_model(loaded))
        graph = self._model.graph
        if len(graph.output) != 1:
            raise ValueError(f"staged execution needs a model with one output, not {len(graph.output)}")
        self.dataflow = onnx_dataflow(self._model)
        self.sites: list[SiteCandidate] = find_sites(self.dataflow, policy)
        self.input_names: list[str] = list(self.dataflow.inputs)
        self.output_name: str = graph.output[0].name
        self._types = {v.name: v for v in (*graph.input, *graph.value_info, *graph.output)}
        self._producer = {v: index for index, node in enumerate(graph.node) for v in node.output if v}
        self._initializers = {t.name: t for t in graph.initializer}
        self._options = session_options(intra_op_threads, spin_after_run)
        self._threads = (intra_op_threads, spin_after_run)
        self._runners: dict[tuple[str, str, str | None], _Runner] = {}
        self._whole_values: ort.InferenceSession | None = None
        self._lock = threading.Lock()

    def full(self, feeds: Mapping[str, np.ndarray]) -> np.ndarray:
        """The model's output from all its inputs, by one session over the whole graph."""
        primary = self.input_names[0]
        return self._runner(primary, self.output_name)(feeds[primary], feeds)

    def whole_values(self, feeds: Mapping[str, np.ndarray], cuts: Sequence[str]) -> dict[str, np.ndarray]:
        """The values of `cuts` as one session over the whole graph computes them (every site an output of it),
        in the model's layout."""
        with self._lock:
            if self._whole_values is None:
                exposed = onnx.ModelProto()
                exposed.CopyFrom(self._model)
                exposed.graph.output.extend(self._types[site.value] for site in self.sites)
                self._whole_values = self._session(exposed)
        found = self._whole_values.run(list(cuts), {name: feeds[name] for name in self.input_names})
        return dict(zip(cuts, found))

    @property
    def opset(self) -> int:
        """The model's version of the default ONNX operator set (what a tap's nodes must be written for)."""
        return next(o.version for o in self._model.opset_import if o.domain in ("", "ai.onnx"))

    def build(self, cuts: Sequence[str]) -> list[Stage]:
        """One callable per stage, cutting at the given site values (in any order); `()` gives one stage."""
        return self.build_tapped(cuts, {})

    def build_tapped(self, cuts: Sequence[str], taps: Mapping[str, Tap]) -> list[_Runner]:
        """`build`'s stages, where the stage that ends at a cut with a tap in `taps` also computes the tap (its
        `tapped` returns the tap's outputs after the stage's)."""
        position = {site.value: site.index for site in self.sites}
        strays = [cut for cut in cuts if cut not in position]
        if strays:
            raise ValueError(
                f"cuts {strays} are not sites of this model; the {len(self.sites)} sites are "
                f"{[site.value for site in self.sites]}"
            )
        if len(set(cuts)) != len(cuts):
            raise ValueError(f"cuts {list(cuts)} name a site more than once")
        strays = [cut for cut in taps if cut not in cuts]
        if strays:
            raise ValueError(f"taps on {strays}, which are not among the cuts {list(cuts)}")
        bounds = [self.input_names[0], *sorted(cuts, key=position.__getitem__), self.output_name]
        return [self._runner(start, stop, taps.get(stop)) for start, stop in zip(bounds, bounds[1:])]

    def tap_alone(self, cut: str, tap: Tap) -> Callable[[np.ndarray], list[np.ndarray]]:
        """`tap` in a session of its own, from the cut value it reads to its outputs (to time it)."""
        if cut not in self._types:
            raise ValueError(f"shape inference found no type for {cut!r}")
        session = self._session(self._as_model(onnx.helper.make_graph(
            list(tap.nodes), f"tap[{cut}]", [self._types[cut]], list(tap.outputs), initializer=list(tap.initializers))),
            tap.libraries)
        return lambda activation: session.run([v.name for v in tap.outputs], {cut: activation})

    def signalled(self, cuts: Sequence[str], tap_for: Callable[[str, SiteValue], Tap], op_type: str,
                  libraries: Sequence[str], keep_layout: Collection[str] = ()) -> tuple[SignalledRunner, bytes]:
        """One session running the whole model as ONNX Runtime optimized it for this machine, in which the value of
        each of `cuts` (in model order) feeds its tap `tap_for(site, value)`, whose outputs go to a node of Python
        operator `op_type` as soon as they exist where they clear the floor fed for the site (`with_signals`);
        `libraries` are the paths of the library that runs Python operators and of any other the taps' nodes need. A
        cut in `keep_layout` is read in the model's own layout. With it, the session's graph as bytes, from which
        `signalled_session` makes the same session without optimizing it again."""
        block = nchwc_block_size()
        optimized, values = optimize_for_machine(self._model, self._threads[0], cuts, block, keep_layout)
        taps = {cut: tap_for(cut, value) for cut, value in values.items()}
        graph = with_signals(optimized, values, taps, op_type, SIGNAL_FLOORS).SerializeToString()
        needed = [*libraries, *(library.path for tap in taps.values() for library in tap.libraries)]
        return self.signalled_session(graph, needed), graph

    def signalled_session(self, graph: bytes | str, libraries: Sequence[str]) -> SignalledRunner:
        """A `signalled` session from its graph (optimized already: ONNX Runtime's optimizations are off), as bytes
        or a file's path, with the custom operators of `libraries` (paths)."""
        options = self._options_with(libraries)
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        with native_threads_named(ORT_POOL_NAME):
            session = ort.InferenceSession(graph, options, providers=["CPUExecutionProvider"])
        return SignalledRunner(session, self.input_names[0], tuple(self.input_names[1:]), self.output_name)

    def _as_model(self, graph: onnx.GraphProto) -> onnx.ModelProto:
        """A graph of this model's nodes as a model of its own, with this model's versions and functions."""
        return onnx.helper.make_model(graph, ir_version=self._model.ir_version,
                                      opset_imports=self._model.opset_import, functions=self._model.functions)

    def _session(self, model: onnx.ModelProto, libraries: Sequence[OperatorLibrary] = ()) -> ort.InferenceSession:
        """A session of `model` with the custom operators of `libraries`, whose domains are added to the model's
        imports (with libraries, `model` is the session's own copy)."""
        _importing(model, (library.domain for library in libraries))
        options = self._options_with([library.path for library in libraries]) if libraries else self._options
        with native_threads_named(ORT_POOL_NAME):
            return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])

    def _options_with(self, libraries: Iterable[str]) -> ort.SessionOptions:
        """This model's session options, in a copy that registers the custom operators of `libraries` (paths)."""
        options = session_options(*self._threads)
        for library in dict.fromkeys(libraries):
            options.register_custom_ops_library(library)
        return options

    def _runner(self, start: str, stop: str, tap: Tap | None = None) -> _Runner:
        # Keyed by segment rather than by cut tuple: a segment's session is the same whatever the other cuts
        # are, so cut tuples that share a segment share its session.
        key = (start, stop, None if tap is None else tap.key)
        with self._lock:
            runner = self._runners.get(key)
            if runner is None:
                runner = self._runners[key] = self._make_runner(start, stop, tap)
            return runner

    def _make_runner(self, start: str, stop: str, tap: Tap | None) -> _Runner:
        if (start, stop) == (self.input_names[0], self.output_name):  # `full`, and the one stage of `build(())`
            model, side = self._model, self.input_names[1:]
        else:
            model, side = self._segment(start, stop)
        if tap is not None:
            model = _with_tap(model, tap)
        if tap is None:
            return _Runner(self._session(model), start, tuple(side), stop)
        outputs = tuple(v.name for v in tap.outputs)
        return _Runner(self._session(model, tap.libraries), start, tuple(side), stop, outputs)

    def _segment(self, start: str, stop: str) -> tuple[onnx.ModelProto, list[str]]:
        """The sub-graph computing `stop` from `start` and side inputs, and which side inputs it reads.

        Built here rather than by `onnx.utils.Extractor`, which misses values read inside If/Loop bodies.
        Constants and side values are recomputed by every stage that needs them (they cost little, and a
        site is defined as the only *data* value crossing the cut).
        """
        graph = self._model.graph
        graph_inputs = set(self.input_names)
        chosen: set[int] = set()
        side_used: set[str] = set()
        frontier, seen = [stop], {start}
        while frontier:
            value = frontier.pop()
            if value in seen or value in self._initializers:
                continue
            seen.add(value)
            if value in graph_inputs:
                if value == self.input_names[0]:
                    raise ValueError(f"{stop!r} depends on the primary input other than through {start!r}")
                side_used.add(value)
                continue
            index = self._producer[value]
            chosen.add(index)
            frontier.extend(_node_inputs(graph.node[index]))
        nodes = [graph.node[index] for index in sorted(chosen)]
        weights = [self._initializers[v] for v in dict.fromkeys(v for n in nodes for v in _node_inputs(n))
                   if v in self._initializers]
        inputs = [start, *(v for v in self.input_names[1:] if v in side_used)]
        for value in (*inputs, stop):
            if value not in self._types:
                raise ValueError(f"shape inference found no type for {value!r}, so no stage can carry it")
        sub = onnx.helper.make_graph(
            nodes, f"{graph.name}[{start}->{stop}]", [self._types[v] for v in inputs], [self._types[stop]],
            initializer=weights,
        )
        return self._as_model(sub), inputs[1:]


@dataclass(frozen=True)
class SiteValue:
    """Where a site's activation is in a graph ONNX Runtime optimized (`optimize_for_machine`): the value's
    name, and the channel block of its layout: ONNX Runtime's NCHWc keeps a convolution's channels in blocks of
    `block`, each block's values innermost, the channel count padded to a whole block; 0 is the model's own
    layout."""

    name: str
    block: int = 0


@functools.cache
def nchwc_block_size() -> int:
    """The channels per block of ONNX Runtime's NCHWc layout on this machine (it follows the processor's vector
    width: 8 with AVX2, 16 with AVX-512), found by optimizing two convolutions and reading the value between them
    in both layouts; 0 where ONNX Runtime keeps convolutions in the NCHW layout here."""
    channels, side = 64, 4
    weight = onnx.numpy_helper.from_array(np.eye(channels, dtype=np.float32).reshape(channels, channels, 1, 1), "w")
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("Conv", ["x", "w"], ["between"]), onnx.helper.make_node("Conv", ["between", "w"], ["y"])],
        "nchwc_probe", [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, channels, side, side])],
        [onnx.helper.make_tensor_value_info(v, onnx.TensorProto.FLOAT, None) for v in ("y", "between")],
        initializer=[weight])
    # block 1 stands for "any": which block this is, is what the probe finds out
    optimized, values = optimize_for_machine(onnx.helper.make_model(graph), 0, ["between"], 1)
    blocked = values["between"].name
    if blocked == "between":
        return 0
    optimized.graph.output.append(onnx.helper.make_tensor_value_info(blocked, onnx.TensorProto.FLOAT, None))
    x = np.arange(channels * side * side, dtype=np.float32).reshape(1, channels, side, side)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    found = ort.InferenceSession(optimized.SerializeToString(), options, providers=["CPUExecutionProvider"]).run(
        [blocked], {"x": x})[0]
    # blocked: channel blocks, each pixel by pixel, a block's channels side by side
    return next(block for block in (4, 8, 16, 32, 64)
                if np.array_equal(found.reshape(channels // block, side * side, block),
                                  x.reshape(channels // block, block, side * side).transpose(0, 2, 1)))


def optimize_for_machine(model: onnx.ModelProto, intra_op_threads: int, cuts: Sequence[str], block: int,
                         keep_layout: Collection[str] = ()) -> tuple[onnx.ModelProto, dict[str, SiteValue]]:
    """`model` as ONNX Runtime optimizes it for this machine at `intra_op_threads` (its layout changes included; not
    portable), and
    where each of `cuts` is in it: optimized with the cuts as outputs, so that each keeps a value, then without
    those outputs. A cut (not in `keep_layout`) whose value ONNX Runtime holds in its NCHWc layout and converts
    back only for that output is taken in that layout (`block` > 0 says what it is), and the conversion goes."""
    exposed = onnx.ModelProto()
    exposed.CopyFrom(model)
    exposed.graph.output.extend(onnx.helper.make_tensor_value_info(c, onnx.TensorProto.FLOAT, None) for c in cuts)
    optimizing = ort.SessionOptions()
    optimizing.intra_op_num_threads = intra_op_threads
    optimizing.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    optimizing.log_severity_level = 3  # not its warning that the file is for this machine alone: it is kept in memory
    with tempfile.TemporaryDirectory(prefix="rampserve-ort-") as directory:
        optimizing.optimized_model_filepath = str(Path(directory) / "optimized.onnx")
        ort.InferenceSession(exposed.SerializeToString(), optimizing, providers=["CPUExecutionProvider"])
        optimized = onnx.load(optimizing.optimized_model_filepath)
    graph = optimized.graph
    producer = {v: node for node in graph.node for v in node.output}
    read = {v for node in graph.node for v in _node_inputs(node)}
    values: dict[str, SiteValue] = {}
    conversions = set()
    for cut in cuts:
        node = producer.get(cut)
        if (block and node is not None and node.domain == NCHWC_DOMAIN and node.op_type == "ReorderOutput"
                and cut not in read and cut not in keep_layout):
            values[cut] = SiteValue(node.input[0], block)
            conversions.add(id(node))
        else:
            values[cut] = SiteValue(cut)
    kept = [node for node in graph.node if id(node) not in conversions]
    outputs = [v for v in graph.output if v.name not in values]
    del graph.node[:], graph.output[:]
    graph.node.extend(kept)
    graph.output.extend(outputs)
    return optimized, values


def with_signals(model: onnx.ModelProto, values: Mapping[str, SiteValue], taps: Mapping[str, Tap], op_type: str,
                 floors: str) -> onnx.ModelProto:
    """`model` (optimized, see `optimize_for_machine`) in which each site's tap (in `values`' order, computed on the
    site's value) computes its values (a ramp's logits and the batch's highest confidence) and, where the confidence
    is above the site's entry of the new graph input `floors` (float, one per site), hands them to a node of Python
    operator `op_type` (attribute `column`: the site's position) at once, inside an If: Python runs only when some
    input may exit there. The If outputs a float zero, which every node that reads the site's value waits for
    (`_wait_for`), so the test runs as soon as its site's value exists, not wherever ONNX Runtime's order of the run
    puts it. Every ramp's logits leave the run as one output, `RAMP_LOGITS` (rows, sites * classes): each output
    fetched costs about 6 us of ONNX Runtime's Python binding (lite0-fmnist, 17 ramps: 0.1 ms a run)."""
    signalled = onnx.ModelProto()
    signalled.CopyFrom(model)
    graph = signalled.graph
    weights = {t.name: t for t in graph.initializer if t.data_type == onnx.TensorProto.FLOAT}
    graph.input.append(onnx.helper.make_tensor_value_info(floors, onnx.TensorProto.FLOAT, [len(values)]))
    for column, (site, value) in enumerate(values.items()):
        tap = taps[site]
        prefix = f"signal[{site}]"
        # A node that reads the value only inside an If or Loop body is not made to wait (it stays correct; its
        # signal may come later)
        readers = [node for node in graph.node if value.name in node.input]
        graph.node.extend(tap.nodes)
        graph.initializer.extend(tap.initializers)
        confidence = tap.outputs[-1].name
        graph.initializer.append(onnx.numpy_helper.from_array(np.array(column, dtype=np.int64), f"{prefix}/column"))
        graph.node.extend([
            onnx.helper.make_node("Gather", [floors, f"{prefix}/column"], [f"{prefix}/floor"], name=f"{prefix}/floor"),
            onnx.helper.make_node("Greater", [confidence, f"{prefix}/floor"], [f"{prefix}/may_exit"],
                                  name=f"{prefix}/may_exit"),
            onnx.helper.make_node(
                "If", [f"{prefix}/may_exit"], [f"{prefix}/zero"], name=f"{prefix}/zero",
                then_branch=onnx.helper.make_graph(
                    [onnx.helper.make_node(op_type, [v.name for v in tap.outputs], [f"{prefix}/signalled"],
                                           domain=PYTHON_OP_DOMAIN, column=column)],
                    f"{prefix}/then", [], [onnx.helper.make_tensor_value_info(f"{prefix}/signalled",
                                                                              onnx.TensorProto.FLOAT, [])]),
                else_branch=onnx.helper.make_graph(
                    [onnx.helper.make_node("Constant", [], [f"{prefix}/quiet"], value=onnx.numpy_helper.from_array(
                        np.array(0.0, dtype=np.float32)))],
                    f"{prefix}/else", [], [onnx.helper.make_tensor_value_info(f"{prefix}/quiet",
                                                                              onnx.TensorProto.FLOAT, [])])),
        ])
        gated = f"{prefix}/gated"  # the value once the signal is in, for readers with no cheaper input to wait on
        waiting = [reader for index, reader in enumerate(readers)
                   if not _wait_for(f"{prefix}/zero", reader, weights, graph, f"{prefix}/wait{index}")]
        if waiting:
            graph.node.append(onnx.helper.make_node("Add", [value.name, f"{prefix}/zero"], [gated], name=gated))
        for reader in waiting:
            reader.input[:] = [gated if v == value.name else v for v in reader.input]
    graph.node.append(onnx.helper.make_node("Concat", [taps[site].outputs[0].name for site in values], [RAMP_LOGITS],
                                            name=RAMP_LOGITS, axis=1))
    graph.output.append(onnx.helper.make_tensor_value_info(RAMP_LOGITS, onnx.TensorProto.FLOAT, None))
    _importing(signalled, [PYTHON_OP_DOMAIN, *(library.domain for tap in taps.values() for library in tap.libraries)])
    return _sorted_model(signalled)


# A weight at most this large is copied (plus zero) at every run to make its reader wait for a signal
SMALL_WEIGHT = 4096
_CONVOLUTIONS = frozenset({"Conv", "FusedConv"})


def _wait_for(zero: str, reader: onnx.NodeProto, weights: Mapping[str, onnx.TensorProto], graph: onnx.GraphProto,
              name: str) -> bool:
    """Make `reader` wait for the float `zero`, added (node `name`) to an input it reads at little cost: a
    convolution's bias (a zero bias given to one without), else its smallest float weight if small (a norm's scale).
    Never a convolution's filter, which ONNX Runtime may hold reordered. False where it has no such input: it is
    then to read the site's value once the signal is in (one copy of the value, whatever the number of such
    readers: a transformer's site feeds three projections and a residual)."""
    inputs = list(reader.input)
    if reader.op_type in _CONVOLUTIONS and len(inputs) >= 2 and inputs[1] in weights:
        if len(inputs) < 3 or not inputs[2]:  # no bias: a zero one, third after the filter (before a Sum input)
            graph.initializer.append(onnx.numpy_helper.from_array(
                np.zeros(weights[inputs[1]].dims[0], dtype=np.float32), f"{name}/bias"))
            if len(inputs) < 3:
                reader.input.append(f"{name}/bias")
            else:
                reader.input[2] = f"{name}/bias"
        position = 2
    else:
        held = [i for i, v in enumerate(inputs) if v in weights and int(np.prod(weights[v].dims)) <= SMALL_WEIGHT]
        if not held:
            return False
        position = min(held, key=lambda i: int(np.prod(weights[inputs[i]].dims)))
    graph.node.append(onnx.helper.make_node("Add", [reader.input[position], zero], [name], name=name))
    reader.input[position] = name
    return True


def _with_tap(model: onnx.ModelProto, tap: Tap) -> onnx.ModelProto:
    """`model` that also computes `tap` and outputs its values after its own output."""
    tapped = onnx.ModelProto()
    tapped.CopyFrom(model)
    tapped.graph.node.extend(tap.nodes)
    tapped.graph.initializer.extend(tap.initializers)
    tapped.graph.output.extend(tap.outputs)
    return tapped


def export_onnx(
    module: torch.nn.Module, example: tuple[torch.Tensor, ...], input_names: Sequence[str], path: str | Path
) -> Path:
    """Export with the TorchScript exporter, whose node names carry module paths (see `scope_from_node_name`),
    with a dynamic batch dimension on every input and on the output ("logits"), and a dynamic second dimension
    on integer inputs (token ids and attention masks: sentences come in any length)."""
    import torch  # here, so that serving an ONNX model does not import torch

    path = Path(path)
    dynamic = {name: {0: "batch"} for name in [*input_names, "logits"]}
    for name, tensor in zip(input_names, example):
        if tensor.dim() == 2 and not tensor.is_floating_point():
            dynamic[name][1] = "positions"
    torch.onnx.export(
        module, example, str(path), dynamo=False, opset_version=17,
        input_names=list(input_names), output_names=["logits"], dynamic_axes=dynamic,
    )
    return path
