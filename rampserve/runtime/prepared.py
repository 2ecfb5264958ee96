"""A prepared model: the user's model split at its sites, a ramp per site, and a latency profile."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from rampserve.graph.torch_graph import TRACE_GUARD
from rampserve.ramps.cache import CacheRamp
from rampserve.ramps.kinds import Ramp, RampSpec
from rampserve.runtime.backends import Backend
from rampserve.runtime.profile import LatencyProfile

# Called after each active ramp with the site's name, every input's top label and error score.
RampCallback = Callable[[str, np.ndarray, np.ndarray], None]


@dataclass(frozen=True)
class SiteInfo:
    name: str  # the cut value in the model's graph
    index: int  # position in the graph's op order
    op_kind: str
    scope: str
    activation_shape: tuple[int, ...]  # per input
    ramp: RampSpec
    val_accuracy: float | None = None  # ramp's agreement with the original model on held-out bootstrap data

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "index": self.index,
            "op_kind": self.op_kind,
            "scope": self.scope,
            "activation_shape": list(self.activation_shape),
            "ramp": self.ramp.to_json(),
            "val_accuracy": self.val_accuracy,
        }

    @classmethod
    def from_json(cls, data: dict) -> SiteInfo:
        return cls(
            name=str(data["name"]),
            index=int(data["index"]),
            op_kind=str(data["op_kind"]),
            scope=str(data["scope"]),
            activation_shape=tuple(int(d) for d in data["activation_shape"]),
            ramp=RampSpec.from_json(data["ramp"]),
            val_accuracy=None if data.get("val_accuracy") is None else float(data["val_accuracy"]),
        )


@dataclass
class PreparedModel:
    backend: Backend
    sites: list[SiteInfo]
    ramps: dict[str, Ramp | CacheRamp]
    profile: LatencyProfile | None = None
    meta: dict = field(default_factory=dict)  # source, encoder, training report, oracle statistics
    error_score: str = "max_prob"

    @property
    def site_names(self) -> list[str]:
        return [s.name for s in self.sites]

    def evaluate_ramp(self, site: str, activation: object) -> tuple[np.ndarray, np.ndarray]:
        """Every input's top label and error score from the ramp at `site`, given the site's activation as the
        backend computes it: what `run` does at each active site, and what the latency profile times."""
        return self.ramps[site].evaluate(self.backend.to_tensor(activation), self.error_score)

    def run(self, feeds: dict[str, np.ndarray], active: Sequence[str] = (),
            on_ramp: RampCallback | None = None, compiled: bool = False) -> np.ndarray:
        """Run the model, evaluating the active ramps as their sites are computed and reporting every input's
        top label and error score to `on_ramp`. Returns the original model's output (logits). `compiled`: run
        the path `compile` made for these ramps, if it made one."""
        def report(site: str, activation: object) -> None:
            labels, errors = self.evaluate_ramp(site, activation)
            if on_ramp is not None:
                on_ramp(site, labels, errors)

        with TRACE_GUARD.running(), torch.inference_mode():
            return self.backend.to_tensor(self.backend.run_hooked(feeds, active, report, compiled)).numpy()

    def compile(self, active: Sequence[str], example: dict[str, np.ndarray]) -> bool:
        """Compile the serving path with these active ramps ahead of its first batch (see `Backend.compile`);
        whether `run(..., compiled=True)` with them runs compiled."""
        with TRACE_GUARD.running():  # torch.jit.trace runs the model; fx's tracer must not patch it meanwhile
            return self.backend.compile(active, example)

    def learn(self, final_labels: np.ndarray) -> list[str]:
        """Update the cache ramps that `run` last evaluated with the batch's final labels (online cache updates:
        every input ran to the end, so its final answer is known). Returns the sites updated."""
        return [site for site, ramp in self.ramps.items() if isinstance(ramp, CacheRamp) and ramp.learn(final_labels)]

    def memory_bytes(self) -> dict[str, int]:
        """What each cache ramp holds in memory (bounded: online updates never grow it)."""
        return {site: ramp.memory_bytes() for site, ramp in self.ramps.items() if isinstance(ramp, CacheRamp)}
