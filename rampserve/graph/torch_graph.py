"""torch.fx front end: trace a module, describe it as a `Dataflow`, and split it into stages at sites.

Stages are fx GraphModules that run exactly the original nodes in the original order, so running all stages
gives bit-for-bit the original model's output on the same inputs.
"""

from __future__ import annotations

import functools
import logging
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import fx, nn

from rampserve.graph.sites import Dataflow, Op, SiteCandidate, SitePolicy, find_sites

log = logging.getLogger("rampserve.graph")

TRACE_WARM_RUNS = 3  # runs of a traced stage before its output is compared (profiling, then optimized)
_CONTRACTIONS = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.Linear)
_CONTRACTION_FUNCTIONS = {torch.matmul, torch.bmm, torch.mm, torch.conv2d, torch.nn.functional.linear,
                          torch.nn.functional.conv2d, torch.einsum}


class _LeafTracer(fx.Tracer):
    """Keeps a model's own leaf types (declared as `rampserve_leaf_types`) whole, e.g. a Hugging Face encoder
    layer whose internals fx cannot trace."""

    def __init__(self, leaf_types: tuple[type, ...]) -> None:
        super().__init__()
        self.leaf_types = leaf_types

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return isinstance(m, self.leaf_types) or super().is_leaf_module(m, module_qualified_name)


class TraceGuard:
    """fx's tracer patches `torch.nn.Module.__call__` for the whole process while it traces, so a module run on
    another thread meanwhile (a served model, while a new version loads) would be traced instead of run, and
    fail. Tracing takes the guard alone; running modules share it. A waiting trace holds new runs back, so a
    model loading under steady traffic is not starved; the runs wait for as long as the trace takes."""

    def __init__(self) -> None:
        self._condition = threading.Condition()
        self._running = 0
        self._tracing = False
        self._waiting_traces = 0

    @contextmanager
    def running(self) -> Iterator[None]:
        with self._condition:
            while self._tracing or self._waiting_traces:
                self._condition.wait()
            self._running += 1
        try:
            yield
        finally:
            with self._condition:
                self._running -= 1
                self._condition.notify_all()

    @contextmanager
    def tracing(self) -> Iterator[None]:
        with self._condition:
            self._waiting_traces += 1
            while self._tracing or self._running:
                self._condition.wait()
            self._waiting_traces -= 1
            self._tracing = True
        try:
            yield
        finally:
            with self._condition:
                self._tracing = False
                self._condition.notify_all()


TRACE_GUARD = TraceGuard()


@contextmanager
def torchscript_quietly() -> Iterator[None]:
    """Silence the pinned torch's deprecation of TorchScript for torch.compile and torch.export, whose CPU code
    fuses kernels (not bit-equal) and compiles for tens of seconds per set of ramps: TorchScript is chosen."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        yield


def trace(module: nn.Module) -> fx.GraphModule:
    leaf_types = tuple(getattr(module, "rampserve_leaf_types", ()))
    tracer = _LeafTracer(leaf_types)
    try:
        with TRACE_GUARD.tracing():
            graph = tracer.trace(module)
    except Exception as exc:  # fx raises many types; the user needs to know which model and why
        raise ValueError(
            f"torch.fx could not trace {type(module).__name__}: {exc}. Models with data-dependent control "
            "flow need an adapter whose hard-to-trace parts are listed in `rampserve_leaf_types`."
        ) from exc
    return fx.GraphModule(tracer.root, graph, type(module).__name__)


def _is_heavy(gm: fx.GraphModule, node: fx.Node) -> bool:
    if node.op == "call_module":
        sub = gm.get_submodule(str(node.target))
        return any(isinstance(m, _CONTRACTIONS) for m in sub.modules()) or any(
            p.ndim >= 2 for m in sub.modules() if not isinstance(m, nn.Embedding)
            for p in m.parameters(recurse=False)
        )
    return node.op == "call_function" and node.target in _CONTRACTION_FUNCTIONS


def _scope(node: fx.Node) -> str:
    if node.op == "call_module":
        return str(node.target)
    stack = node.meta.get("nn_module_stack") or {}
    if stack:
        path = list(stack.values())[-1]
        return path[0] if isinstance(path, tuple) else str(path)
    return ""


def _node_inputs(node: fx.Node) -> tuple[str, ...]:
    return tuple(n.name for n in node.all_input_nodes if n.op != "get_attr")


def dataflow(gm: fx.GraphModule) -> Dataflow:
    nodes = list(gm.graph.nodes)
    placeholders = [n.name for n in nodes if n.op == "placeholder"]
    (output,) = [n for n in nodes if n.op == "output"]
    ops = tuple(
        Op(
            name=n.name,
            kind=str(n.target.__name__ if callable(n.target) else n.target)
            if n.op != "call_module" else type(gm.get_submodule(str(n.target))).__name__,
            inputs=_node_inputs(n),
            outputs=(n.name,),
            scope=_scope(n),
            heavy=_is_heavy(gm, n),
        )
        for n in nodes
        if n.op in ("call_module", "call_function", "call_method")
    )
    return Dataflow(inputs=tuple(placeholders), ops=ops, outputs=_node_inputs(output))




class TorchSplitModel:
    """A traced torch module with its sites, able to build stage modules for any subset of sites."""

    def __init__(self, module: nn.Module, policy: SitePolicy | None = None) -> None:
        self.module = module.eval()
        self.graph_module = trace(module)
        self.dataflow = dataflow(self.graph_module)
        self.sites: list[SiteCandidate] = find_sites(self.dataflow, policy)
        self.input_names = list(self.dataflow.inputs)
        self._stages: dict[tuple[str, ...], list[ModuleStage]] = {}
        self._hooked: dict[tuple[str, ...], fx.GraphModule] = {}

    def hooked(self, cuts: Sequence[str]) -> fx.GraphModule:
        """The whole model as one module that calls `hook(site, activation)` right after computing each cut
        value; it takes the model's inputs followed by the hook. Reporting a site costs one Python call, where
        running separate stages costs a module call per stage and, for encoders, recomputing in every stage
        what the stage needs besides the activation (attention masks). Its submodules are top-level
        attributes, which makes it no slower than the original module (see `_flatten_targets`)."""
        key = tuple(cuts)
        if key not in self._hooked:
            known = {s.value for s in self.sites}
            unknown = [c for c in key if c not in known]
            if unknown:
                raise ValueError(f"cuts {unknown} are not sites of this model; sites: {sorted(known)}")
            graph = fx.Graph()
            copies: dict[fx.Node, fx.Node] = {}
            graph.output(graph.graph_copy(self.graph_module.graph, copies))
            by_name = {old.name: new for old, new in copies.items()}
            last_input = [n for n in graph.nodes if n.op == "placeholder"][-1]
            with graph.inserting_after(last_input):
                hook = graph.placeholder("rampserve_hook")
            for cut in key:
                with graph.inserting_after(by_name[cut]):
                    graph.call_function(_report, (hook, cut, by_name[cut]))
            self._hooked[key] = fx.GraphModule(_flatten_targets(graph, self.graph_module), graph, "hooked")
        return self._hooked[key]

    def full(self, feeds: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.module(*(feeds[name] for name in self.input_names))

    def build(self, cuts: Sequence[str]) -> list[ModuleStage]:
        """Stage callables `stage(activation, side_inputs)` cut at the given site values.

        With no cuts the single stage is the original module itself, so a model without active ramps runs
        exactly as it would without rampserve.
        """
        key = tuple(cuts)
        if key not in self._stages:
            self._stages[key] = self._build(key)
        return self._stages[key]

    def traced(self, stages: Sequence[ModuleStage], inputs: dict[str, torch.Tensor]) -> list[ModuleStage] | None:
        """`stages` (built by `build`) traced to TorchScript with `inputs` as the
        example, or None where tracing is not faithful (see `trace_stages`)."""
        primary, *side = self.input_names
        return trace_stages(stages, inputs[primary], {n: inputs[n] for n in side})

    def _build(self, cuts: tuple[str, ...]) -> list[ModuleStage]:
        by_value = {s.value: s for s in self.sites}
        unknown = [c for c in cuts if c not in by_value]
        if unknown:
            raise ValueError(f"cuts {unknown} are not sites of this model; sites: {list(by_value)}")
        if not cuts:
            return [ModuleStage(self.module, tuple(self.input_names[1:]))]
        ordered = sorted(cuts, key=lambda c: by_value[c].index)
        boundaries = [self.input_names[0], *ordered, None]
        return [
            _stage_module(self.graph_module, self.input_names, start, stop)
            for start, stop in zip(boundaries, boundaries[1:])
        ]


def _report(hook: Callable[[str, torch.Tensor], None], site: str, value: torch.Tensor) -> None:
    hook(site, value)


def _flatten_targets(graph: fx.Graph, root: nn.Module) -> dict[str, object]:
    """Point `graph`'s module calls and attribute reads at top-level attributes, and return those attributes
    (the original objects, shared). fx's generated code reaches a nested module through a chain of
    nn.Module.__getattr__ calls, `getattr(self.layer1, "0").conv1(...)`, about 1 µs each: on resnet18-fmnist
    that made a module with hooks 0.1 ms (4%) slower than the original at batch 1; flat, it is no slower."""
    attrs: dict[str, object] = {}
    flat: dict[str, str] = {}
    for node in graph.nodes:
        if node.op not in ("call_module", "get_attr"):
            continue
        target = str(node.target)
        if target not in flat:
            name = target.replace(".", "_")
            while name in attrs:  # "a.b_c" and "a_b.c" must not share an attribute
                name += "_"
            flat[target] = name
            attrs[name] = functools.reduce(getattr, target.split("."), root)
        node.target = flat[target]
    return attrs


class ModuleStage:
    """A stage: `module(activation, *the side inputs it reads)`."""

    def __init__(self, module: Callable[..., torch.Tensor], side_names: tuple[str, ...]) -> None:
        self.module, self.side_names = module, side_names

    def __call__(self, activation: torch.Tensor, side_inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.module(activation, *(side_inputs[n] for n in self.side_names))


def _stage_module(gm: fx.GraphModule, input_names: list[str], start: str, stop: str | None) -> ModuleStage:
    """The nodes strictly after value `start` up to and including value `stop` (None: the model output)."""
    nodes = list(gm.graph.nodes)
    index = {n.name: i for i, n in enumerate(nodes)}
    by_name = {n.name: n for n in nodes}
    output_node = nodes[-1]
    last = index[stop] if stop is not None else len(nodes) - 1
    in_range = {n for n in nodes[index[start] + 1: last + 1] if n.op != "placeholder"}
    # Anything else the range reads (side values, weights) is recomputed or fetched in this stage.
    needed: set[str] = set()
    frontier = [a for n in in_range for a in n.all_input_nodes]
    while frontier:
        node = frontier.pop()
        if node.name in needed or node.name == start or node in in_range:
            continue
        needed.add(node.name)
        frontier.extend(node.all_input_nodes)
    side_names = tuple(n for n in input_names[1:] if n in needed)

    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {by_name[start]: graph.placeholder(start)}
    for name in side_names:
        env[by_name[name]] = graph.placeholder(name)
    for node in nodes:
        if node.op in ("placeholder", "output") or node in env:
            continue
        if node.name in needed or node in in_range:
            env[node] = graph.node_copy(node, lambda n: env[n])
    if stop is None:
        graph.output(fx.map_arg(output_node.args[0], lambda n: env[n]))
    else:
        graph.output(env[by_name[stop]])
    return ModuleStage(fx.GraphModule(gm, graph, f"stage_{start}"), side_names)


def trace_stages(stages: Sequence[ModuleStage], activation: torch.Tensor, side: dict[str, torch.Tensor]
                 ) -> list[ModuleStage] | None:
    """`stages` traced to TorchScript, or None unless every traced stage computes bit for bit what its eager stage
    does. TorchScript runs a whole stage in C++ without taking the GIL per operator: eager torch takes it back
    after every operator, and with the event loop busy on the same interpreter each retake can wait, which made
    a batch of one on resnet18-fmnist twice as slow under load; traced, it is also 40% faster alone.

    A stage returns its activation, which the next stage takes, and which must be bit-equal to the eager one.

    A trace records one run, so it is refused where that run may not stand for others: a tracer warning (Python
    control flow or shapes read as constants), an exception, an output other than tensors, or a different
    result from the eager stage on the example or on the example with one row more (a batch size baked in)."""
    examples = [(activation, side), (_one_row_more(activation), {n: _one_row_more(v) for n, v in side.items()})]
    traced: list[ModuleStage] = []
    with torch.no_grad():
        for stage in stages:
            try:
                with torchscript_quietly():
                    warnings.simplefilter("error", torch.jit.TracerWarning)
                    activation, side = examples[0]
                    module = torch.jit.trace(stage.module, (activation, *(side[n] for n in stage.side_names)),
                                             check_trace=False)
            except Exception:  # whatever keeps a stage from tracing leaves the model on the eager path
                log.info("stage %d of %d does not trace to TorchScript; serving it eagerly", len(traced) + 1,
                         len(stages), exc_info=True)
                return None
            candidate = ModuleStage(module, stage.side_names)
            advanced = []
            for example_activation, example_side in examples:
                expected = stage(example_activation, example_side)
                # The first runs of a TorchScript function profile it and the next one optimizes it: compare
                # what serving will run, after those.
                outputs = [candidate(example_activation, example_side) for _ in range(TRACE_WARM_RUNS)]
                if not all(_faithful(out, expected) for out in outputs):
                    log.info("stage %d of %d traced to a different function; serving it eagerly", len(traced) + 1,
                             len(stages))
                    return None
                advanced.append((expected, example_side))
            examples = advanced
            traced.append(candidate)
    return traced


def _faithful(got: object, expected: torch.Tensor) -> bool:
    """Whether a traced stage's output is the eager stage's, bit for bit."""
    return isinstance(got, torch.Tensor) and torch.equal(got, expected)


def _one_row_more(tensor: torch.Tensor) -> torch.Tensor:
    return torch.cat([tensor, tensor[:1]])
