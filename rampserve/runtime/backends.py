"""The two ways a model's stages run: torch modules (fx stages, `runtime.torch_backend`) or ONNX Runtime sessions
(sub-graphs, here: serving an ONNX model imports no torch).

Both split models expose the same surface (`sites`, `input_names`, `full`, `build`); a backend adds what differs:
how arrays cross into and out of it, and the context its runs take.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Protocol

import numpy as np

from rampserve.graph.sites import SiteCandidate, SitePolicy


class SplitModel(Protocol):
    sites: list[SiteCandidate]
    input_names: list[str]

    def full(self, feeds: dict) -> object: ...

    def build(self, cuts: Sequence[str]) -> list[Callable]: ...


class Backend:
    """A split model plus conversions between numpy feeds and the backend's native arrays."""

    kind: str
    split: SplitModel

    def __init__(self, split: SplitModel) -> None:
        self.split = split
        self._primary, *self._side_names = split.input_names
        self._plans: dict[tuple[str, ...], tuple[tuple[str, ...], list[Callable]]] = {}
        self._ordered: dict[tuple[str, ...], tuple[str, ...]] = {}

    def native(self, array: np.ndarray) -> object:
        raise NotImplementedError

    def to_numpy(self, value: object) -> np.ndarray:
        """A value the backend computed (an activation, the output) as an array."""
        raise NotImplementedError

    def inference_mode(self) -> AbstractContextManager:
        """The context runs of the model take (torch's inference mode: its operators skip autograd)."""
        return contextlib.nullcontext()

    def serving(self, threads: int) -> AbstractContextManager:
        """The context an executor thread runs batches in for its life, at most `threads` intra-op threads where the
        backend takes them from the thread (0: the backend's default)."""
        return self.inference_mode()

    def ramps_signal(self) -> bool:
        """Whether a compiled set's ramps can signal possible exits while the model runs (a torch set needs the ramp
        operators built and loaded)."""
        return True

    def native_feeds(self, feeds: dict[str, np.ndarray]) -> dict[str, object]:
        try:
            return {name: self.native(feeds[name]) for name in self.split.input_names}
        except KeyError:
            missing = [n for n in self.split.input_names if n not in feeds]
            raise ValueError(f"missing model inputs {missing}; the model takes {self.split.input_names}") from None

    @property
    def sites(self) -> list[SiteCandidate]:
        return self.split.sites

    @property
    def input_names(self) -> list[str]:
        return self.split.input_names

    def ordered_cuts(self, cuts: Sequence[str]) -> tuple[str, ...]:
        """`cuts` in model order, validated once per set: the serving path asks for the same few sets for
        every batch, and checking them again costs tens of microseconds."""
        key = tuple(cuts)
        if key not in self._ordered:
            order = {s.value: s.index for s in self.sites}
            unknown = [c for c in key if c not in order]
            if unknown:
                raise ValueError(f"{unknown} are not sites of this model; sites: {list(order)}")
            self._ordered[key] = tuple(sorted(set(key), key=order.__getitem__))
        return self._ordered[key]

    def plan(self, cuts: Sequence[str]) -> tuple[tuple[str, ...], list[Callable]]:
        """The ordered cuts and their stages, built once per set of cuts."""
        key = tuple(cuts)
        if key not in self._plans:
            ordered = self.ordered_cuts(key)
            self._plans[key] = (ordered, self.split.build(ordered))
        return self._plans[key]

    def split_feeds(self, feeds: dict[str, np.ndarray]) -> tuple[object, dict[str, object]]:
        """The primary input (what the first stage takes) and the side inputs, as native arrays."""
        native = self.native_feeds(feeds)
        return native[self._primary], {n: native[n] for n in self._side_names}

    def stage_outputs(self, feeds: dict[str, np.ndarray], cuts: Sequence[str]) -> Iterator[tuple[str | None, object]]:
        """Run stage by stage, cut only at `cuts`; yield (site, activation) after each cut and (None, output)
        at the end. The caller acts between stages (a ramp, an early release) before asking for the next."""
        ordered, stages = self.plan(cuts)
        activation, side = self.split_feeds(feeds)
        for cut, stage in zip((*ordered, None), stages):
            activation = stage(activation, side)
            yield cut, activation

    def run_hooked(self, feeds: dict[str, np.ndarray], cuts: Sequence[str],
                   hook: Callable[[str, object], None]) -> object:
        """Run the model, calling `hook(site, activation)` after each cut in model order; returns the output.
        The eager serving path: backends that can report a site without splitting the model do so."""
        for cut, activation in self.stage_outputs(feeds, cuts):
            if cut is None:
                return activation
            hook(cut, activation)
        raise AssertionError("the last stage always yields the output")


class OnnxBackend(Backend):
    kind = "onnx"

    def __init__(self, path: Path, policy: SitePolicy | None = None, intra_op_threads: int = 0,
                 spin_after_run: bool = False) -> None:
        from rampserve.graph.onnx_graph import OnnxSplitModel

        self.path = Path(path)
        self.intra_op_threads = intra_op_threads  # 0: ONNX Runtime's default, one per core
        super().__init__(OnnxSplitModel(self.path, policy, intra_op_threads, spin_after_run))

    def native(self, array: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(array)

    def to_numpy(self, value: object) -> np.ndarray:
        return np.asarray(value)
