"""A model served as torch modules (fx stages, TorchScript sets), and what runs any backend's model in torch:
the site activations ramps are trained on. Serving an ONNX model with linear or MLP ramps never imports this."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

import numpy as np
import safetensors.torch
import torch
from torch import nn

from rampserve.bundle_format.manifest import BundleError
from rampserve.graph.sites import SitePolicy
from rampserve.graph.torch_graph import TRACE_GUARD, TorchSplitModel
from rampserve.ramps import kernel
from rampserve.runtime.backends import Backend


class TorchBackend(Backend):
    kind = "torch"

    def __init__(self, module: nn.Module, policy: SitePolicy | None = None) -> None:
        self.module = module.eval()
        super().__init__(TorchSplitModel(self.module, policy))

    def native(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array))

    def to_numpy(self, value: object) -> np.ndarray:
        assert isinstance(value, torch.Tensor)
        return value.numpy()

    def inference_mode(self) -> AbstractContextManager:
        return torch.inference_mode()

    @contextmanager
    def serving(self, threads: int) -> Iterator[None]:
        # The executor is the only thread that runs the model; the event loop and the controller need a core too,
        # and torch's intra-op threads contending with them made a batch of one 1.5-3x slower on two cores.
        if threads:
            torch.set_num_threads(threads)
        # Inference mode for the thread's life rather than per batch: the runner's operators skip autograd, and
        # the batch's path takes one step fewer
        with torch.inference_mode():
            yield

    def ramps_signal(self) -> bool:
        return kernel.available()

    def run_hooked(self, feeds: dict[str, np.ndarray], cuts: Sequence[str],
                   hook: Callable[[str, object], None]) -> object:
        key = self.ordered_cuts(cuts)
        native = self.native_feeds(feeds)
        inputs = [native[name] for name in self.input_names]
        with TRACE_GUARD.running():  # fx's tracer patches nn.Module.__call__ while it traces: not during a run
            if not key:
                return self.module(*inputs)
            return self.split.hooked(key)(*inputs, hook)

    def save_weights(self, path: Path) -> None:
        safetensors.torch.save_file({k: v.contiguous() for k, v in self.module.state_dict().items()}, path)

    @classmethod
    def from_weights(cls, module: nn.Module, path: Path, what: str, policy: SitePolicy | None) -> TorchBackend:
        """`module` with the weights at `path` (a safetensors file; raises BundleError where they do not fit)."""
        try:
            module.load_state_dict(safetensors.torch.load_file(path), strict=True)
        except RuntimeError as exc:
            raise BundleError(f"{path} does not fit {what}: {exc}") from exc
        return cls(module, policy)


def site_activations(backend: Backend, feed_batches: Iterable[dict[str, np.ndarray]], cuts: Sequence[str]
                     ) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
    """(activation at each cut, final output) per batch, as tensors, for training ramps and building caches."""
    with torch.inference_mode():
        for feeds in feed_batches:
            found = {cut: torch.as_tensor(act) for cut, act in backend.stage_outputs(feeds, cuts)}
            output = found.pop(None)
            yield found, output
