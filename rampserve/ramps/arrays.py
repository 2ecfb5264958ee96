"""A linear or MLP ramp as NumPy arrays: what a server of an ONNX model holds, fuses into its sessions
(`ramps.onnx_fused`) and evaluates where a set runs eagerly, without torch.

A bundle keeps a ramp's weights under the names of the torch module that trained it (`ramps.kinds.Ramp`'s
`state_dict`), so the two read and write the same file; `Ramp.arrays()` gives a trained ramp in this form (views of
its parameters)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from rampserve.control.scores import top_label_and_error
from rampserve.ramps.pooling import POOLING_REDUCTIONS, PooledLinear, reduce_array
from rampserve.ramps.specs import DENSE_KINDS, RampSpec

# A bundle's names for a dense ramp's arrays, by kind: the center, then (weight, bias) per linear map
STATE_NAMES = {"linear": ("center", (("head.weight", "head.bias"),)),
               "mlp": ("center", (("head.0.weight", "head.0.bias"), ("head.2.weight", "head.2.bias")))}


@dataclass(frozen=True, eq=False)  # holds arrays, which do not compare to a bool
class RampArrays:
    """logits = (reduce(activation) - center) @ W1.T + b1, then for an MLP max(0, that) @ W2.T + b2 (weights
    (outputs, inputs) as in nn.Linear), in float32."""

    spec: RampSpec
    center: np.ndarray  # (features,)
    layers: tuple[tuple[np.ndarray, np.ndarray], ...]  # (weight, bias) per linear map, a ReLU between
    _pooled: list = field(default_factory=lambda: [None], init=False, repr=False)  # [PooledLinear | None]

    def __post_init__(self) -> None:
        if self.spec.kind not in DENSE_KINDS:
            raise ValueError(f"a {self.spec.kind} ramp is not linear maps")

    @classmethod
    def from_state(cls, spec: RampSpec, state: Mapping[str, np.ndarray]) -> RampArrays:
        """The ramp from a bundle's arrays for it (raises ValueError naming what is missing or misshapen)."""
        if spec.kind not in STATE_NAMES:
            raise ValueError(f"a {spec.kind} ramp is not linear maps")
        center_name, layer_names = STATE_NAMES[spec.kind]
        wanted = {center_name, *(name for pair in layer_names for name in pair)}
        if set(state) != wanted:
            raise ValueError(f"expected arrays {sorted(wanted)}, found {sorted(state)}")
        as_float = {name: np.ascontiguousarray(state[name], dtype=np.float32) for name in wanted}
        ramp = cls(spec, as_float[center_name], tuple((as_float[w], as_float[b]) for w, b in layer_names))
        ramp._check_shapes()
        return ramp

    def _check_shapes(self) -> None:
        features = int(np.prod(self.spec.feature_shape))
        widths = [features, *([self.spec.hidden] if self.spec.kind == "mlp" else []), self.spec.num_classes]
        if self.center.shape != (features,):
            raise ValueError(f"center has shape {self.center.shape}, the spec's features are {features}")
        for (weight, bias), inputs, outputs in zip(self.layers, widths, widths[1:]):
            if weight.shape != (outputs, inputs) or bias.shape != (outputs,):
                raise ValueError(f"a layer of shapes {weight.shape} and {bias.shape} where ({outputs}, {inputs}) "
                                 f"and ({outputs},) were expected")

    def arrays(self) -> RampArrays:
        return self

    def state_dict(self) -> dict[str, np.ndarray]:
        """The arrays under a bundle's names (`STATE_NAMES`)."""
        center_name, layer_names = STATE_NAMES[self.spec.kind]
        state = {center_name: self.center}
        for (weight_name, bias_name), (weight, bias) in zip(layer_names, self.layers):
            state |= {weight_name: weight, bias_name: bias}
        return state

    def head_logits(self, features: np.ndarray) -> np.ndarray:
        value = features - self.center
        for index, (weight, bias) in enumerate(self.layers):
            if index:
                value = np.maximum(value, 0.0)
            value = value @ weight.T + bias
        return value

    def logits(self, activation: np.ndarray) -> np.ndarray:
        """(n, classes) for an (n, ...) activation; a pooling as `PooledLinear`'s two small matmuls."""
        if self.spec.reduce in POOLING_REDUCTIONS:
            self._pooled[0] = pooled = PooledLinear.current(self._pooled[0], (activation.shape[1:],),
                                                            self.spec.reduce, self._pooled_params)
            return pooled(activation)
        return self.head_logits(reduce_array(activation, self.spec.reduce))

    def _pooled_params(self) -> dict[str, np.ndarray]:
        (weight, bias), *out = self.layers
        params = {"weight": weight, "bias": bias, "center": self.center}
        if out:
            params |= {"out_weight": out[0][0], "out_bias": out[0][1]}
        return params

    def evaluate(self, activation: np.ndarray, score: str = "max_prob") -> tuple[np.ndarray, np.ndarray]:
        """Top label and error score per input, as the torch ramp's `evaluate` gives them (to float rounding)."""
        return top_label_and_error(self.logits(np.asarray(activation)), score)

    def from_features(self, features: np.ndarray, score: str = "max_prob") -> tuple[np.ndarray, np.ndarray]:
        """Top label and error score per input from already reduced features."""
        return top_label_and_error(self.head_logits(np.asarray(features, dtype=np.float32)), score)
