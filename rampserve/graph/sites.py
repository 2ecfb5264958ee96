"""Where a model can have exit ramps: cut vertices of its dataflow graph.

A *site* is a value after which every later computation depends on the model's data only through that one
value (Apparate §3.1: "no edge can start before a ramp and re-enter the model's computation after the
ramp"). Both the torch.fx and the ONNX front ends turn a model into a `Dataflow` and use the pure functions
here, so the analysis is written and tested once.

Values computed only from *side inputs* (an attention mask, say) are not part of the data path: every stage
can recompute or receive them, so they never keep a site from being one.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Op:
    """One operation of a dataflow graph, in topological order. Constants and weights are not inputs."""

    name: str
    kind: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    scope: str = ""  # dotted module path, e.g. "layer1.0.conv1"; "" when unknown
    heavy: bool = False  # a contraction with learned weights (conv, linear, an encoder layer): a "layer"


@dataclass(frozen=True)
class Dataflow:
    inputs: tuple[str, ...]  # graph inputs; the first is the primary (data) input, the rest are side inputs
    ops: tuple[Op, ...]
    outputs: tuple[str, ...]

    def __post_init__(self) -> None:
        if not self.inputs:
            raise ValueError("a dataflow graph needs at least one input")
        known = set(self.inputs)
        for op in self.ops:
            missing = [v for v in op.inputs if v not in known]
            if missing:
                raise ValueError(f"op {op.name!r} reads {missing} before they are produced: not topological")
            known.update(op.outputs)
        missing_out = [v for v in self.outputs if v not in known]
        if missing_out:
            raise ValueError(f"graph outputs {missing_out} are never produced")


@dataclass(frozen=True)
class SiteCandidate:
    """A cut value: the only data-path value live right after op `index`."""

    value: str
    index: int
    op_name: str
    kind: str
    scope: str
    heavy_before: int  # heavy ops at or before this site
    heavy_after: int  # heavy ops after it


SitePolicy = Callable[[Dataflow, list[SiteCandidate]], list[SiteCandidate]]


def data_path_values(graph: Dataflow) -> set[str]:
    """Values that depend on the primary input (everything else is side data)."""
    on_path = {graph.inputs[0]}
    for op in graph.ops:
        if any(v in on_path for v in op.inputs):
            on_path.update(op.outputs)
    return on_path


def cut_values(graph: Dataflow) -> list[SiteCandidate]:
    """Every op output that is the single data-path value live across the boundary after its op.

    Graph outputs count as used at the end, so the final output is never a candidate (nothing follows it).
    """
    on_path = data_path_values(graph)
    last_use: dict[str, int] = {}
    for index, op in enumerate(graph.ops):
        for value in op.inputs:
            last_use[value] = index
    end = len(graph.ops)
    for value in graph.outputs:
        last_use[value] = end

    heavy_prefix = [0]
    for op in graph.ops:
        heavy_prefix.append(heavy_prefix[-1] + int(op.heavy))
    total_heavy = heavy_prefix[-1]

    # Sweep in topological order, keeping the set of data-path values produced so far and still used later.
    live: set[str] = set()
    if last_use.get(graph.inputs[0], -1) >= 0:
        live.add(graph.inputs[0])
    candidates: list[SiteCandidate] = []
    for index, op in enumerate(graph.ops):
        for value in op.outputs:
            if value in on_path and last_use.get(value, -1) > index:
                live.add(value)
        live = {v for v in live if last_use.get(v, -1) > index}
        if len(live) == 1 and index < end - 1:
            (value,) = live
            if value in op.outputs and value not in graph.outputs:
                candidates.append(
                    SiteCandidate(
                        value=value,
                        index=index,
                        op_name=op.name,
                        kind=op.kind,
                        scope=op.scope,
                        heavy_before=heavy_prefix[index + 1],
                        heavy_after=total_heavy - heavy_prefix[index + 1],
                    )
                )
    return candidates


_INDEXED = re.compile(r"^(.*?\.\d+)(?:\.|$)")


def block_of(scope: str) -> str:
    """The repeated block a module path belongs to: the path up to its first numeric component.

    "layer1.0.conv1" -> "layer1.0", "_blocks.3._bn0" -> "_blocks.3", "encoder.layer.2" -> "encoder.layer.2";
    a path without an index is its own top-level module ("conv1" -> "conv1").
    """
    match = _INDEXED.match(scope)
    if match:
        return match.group(1)
    return scope.split(".")[0]


def default_policy(graph: Dataflow, candidates: list[SiteCandidate]) -> list[SiteCandidate]:
    """Sites a user would call "between layers" or "between blocks".

    1. Never inside a repeated block (a residual block, an MBConv block, an encoder layer), even where a block
       without a skip connection has internal cut values: ramps then see only whole blocks' outputs.
    2. After a layer's trailing cheap ops (norm, activation, pooling), not between them: of candidates with no
       heavy op between them, keep the last.
    3. Only where a heavy op precedes (a ramp on the raw input is pointless) and more than the output layer
       follows (a ramp that costs what the rest of the model costs saves nothing).
    """
    ops = graph.ops
    kept = []
    for cand in candidates:
        next_op = ops[cand.index + 1]
        inside_block = bool(cand.scope) and bool(next_op.scope) and (
            block_of(cand.scope) == block_of(next_op.scope) and re.search(r"\.\d+", cand.scope) is not None
        )
        if not inside_block:
            kept.append(cand)
    collapsed = [
        cand
        for cand, following in zip(kept, [*kept[1:], None])
        if following is None or following.heavy_before > cand.heavy_before
    ]
    return [c for c in collapsed if c.heavy_before >= 1 and c.heavy_after >= 2]


def find_sites(graph: Dataflow, policy: SitePolicy | None = None) -> list[SiteCandidate]:
    """Cut values filtered by `policy` (default: `default_policy`). A policy may only choose among cut values."""
    candidates = cut_values(graph)
    chosen = (policy or default_policy)(graph, list(candidates))
    allowed = {c.value for c in candidates}
    stray = [c.value for c in chosen if c.value not in allowed]
    if stray:
        raise ValueError(f"site policy chose values that are not cut values: {stray}")
    return sorted(chosen, key=lambda c: c.index)


def stage_ops(graph: Dataflow, cuts: Sequence[int]) -> list[tuple[int, int]]:
    """Op index ranges [start, stop) of the stages between cut op indices (sorted, each the op of a site)."""
    bounds = [0, *[c + 1 for c in sorted(cuts)], len(graph.ops)]
    return [(a, b) for a, b in zip(bounds, bounds[1:])]
