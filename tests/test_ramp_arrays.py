"""A linear or MLP ramp as arrays (what a server of an ONNX model holds, without torch) computes what the torch ramp
it was trained as computes, reads and writes the same arrays in a bundle, and the NumPy reductions and pooling
matrices it is built from are torch's."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rampserve.ramps.arrays import RampArrays
from rampserve.ramps.kinds import Ramp, ramp_from_state
from rampserve.ramps.pooling import POOLING_REDUCTIONS, TOKEN_REDUCTIONS, pooling_matrix, reduce_array
from rampserve.ramps.specs import RampSpec, spec_for
from rampserve.ramps.torch_reductions import reduce_activation

SHAPES = st.one_of(
    st.tuples(st.integers(1, 6), st.integers(1, 30), st.integers(1, 30)),  # (C, H, W) maps, some of them sampled
    st.tuples(st.integers(1, 9), st.integers(1, 24)),  # (tokens, hidden)
)


def _trained_like(spec: RampSpec, seed: int) -> Ramp:
    torch.manual_seed(seed)
    ramp = Ramp(spec).eval()
    with torch.no_grad():  # trained heads are far from their initialisation's scale, and centers not zero
        for p in ramp.parameters():
            p.mul_(4.0)
        ramp.center.normal_()
    return ramp


def _activation(shape: tuple[int, ...], batch: int, seed: int) -> np.ndarray:
    activation = np.random.default_rng(seed).normal(size=(batch, *shape)).astype(np.float32)
    if len(shape) == 2:  # padding: rows of zeros after each input's tokens, as an encoder's layers leave them
        activation[:, shape[0] // 2 + 1:] = 0.0
    return activation


@settings(max_examples=40, deadline=None)
@given(shape=SHAPES, kind=st.sampled_from(["linear", "mlp"]), token_reduce=st.sampled_from(TOKEN_REDUCTIONS),
       batch=st.integers(1, 5), seed=st.integers(0, 2**16))
def test_the_arrays_score_every_input_as_the_torch_ramp(shape, kind, token_reduce, batch, seed) -> None:
    """Through a bundle's arrays and back: the arrays' logits are the torch ramp's (to float rounding), so are
    labels and error scores, and the torch ramp rebuilt from the arrays' state is the same ramp."""
    ramp = _trained_like(spec_for(kind, shape, 5, token_reduce=token_reduce), seed)
    state = {name: value.detach().numpy() for name, value in ramp.state_dict().items()}
    arrays = RampArrays.from_state(ramp.spec, state)
    activation = _activation(shape, batch, seed)
    with torch.no_grad():
        expected = ramp(torch.from_numpy(activation)).numpy()
    np.testing.assert_allclose(arrays.logits(activation), expected, rtol=1e-4, atol=1e-4)
    labels, errors = arrays.evaluate(activation)
    torch_labels, torch_errors = ramp.evaluate(torch.from_numpy(activation))
    ranked = np.sort(expected, axis=1)
    clear = ranked[:, -1] - ranked[:, -2] > 1e-3  # a near tie may go either way under float rounding
    np.testing.assert_array_equal(labels[clear], torch_labels[clear])
    np.testing.assert_allclose(errors, torch_errors, rtol=0, atol=1e-4)
    assert {k: v.tolist() for k, v in arrays.state_dict().items()} == {k: v.tolist() for k, v in state.items()}
    rebuilt = ramp_from_state(ramp.spec, arrays.state_dict())
    assert all(torch.equal(rebuilt.state_dict()[k], v) for k, v in ramp.state_dict().items())


def test_the_torch_ramp_as_arrays_is_a_view_of_its_parameters() -> None:
    """`Ramp.arrays()` reads the parameters' memory: an optimiser's step shows in it (a tap built from it is the
    ramp as it stands)."""
    ramp = _trained_like(spec_for("linear", (4, 6, 6), 3), 0)
    arrays = ramp.arrays()
    with torch.no_grad():
        ramp.head.weight.add_(1.0)
    np.testing.assert_array_equal(arrays.layers[0][0], ramp.head.weight.detach().numpy())


@pytest.mark.parametrize(("state", "message"), [
    ({"center": np.zeros(4), "head.weight": np.zeros((3, 4))}, "expected arrays"),
    ({"center": np.zeros(5), "head.weight": np.zeros((3, 4)), "head.bias": np.zeros(3)}, "center has shape"),
    ({"center": np.zeros(4), "head.weight": np.zeros((3, 5)), "head.bias": np.zeros(3)}, "a layer of shapes"),
])
def test_arrays_that_do_not_fit_the_spec_are_refused_naming_what_is_wrong(state, message) -> None:
    with pytest.raises(ValueError, match=message):
        RampArrays.from_state(RampSpec("linear", "identity", (4,), 3), state)


def test_a_ramp_that_is_not_linear_maps_has_no_arrays_form() -> None:
    with pytest.raises(ValueError, match="not linear maps"):
        RampArrays.from_state(spec_for("deep", (4, 8, 8), 3), {})


@settings(max_examples=40, deadline=None)
@given(height=st.integers(1, 40), width=st.integers(1, 40), reduce=st.sampled_from(POOLING_REDUCTIONS[:2]))
def test_a_pooling_matrix_pools_a_map_as_torch_does(height, width, reduce) -> None:
    """Each column of the matrix is a cell of torch's adaptive average pooling, exact to float64."""
    maps = np.random.default_rng(height * 41 + width).normal(size=(2, 3, height, width))
    pooled = (maps.reshape(-1, height * width) @ pooling_matrix((3, height, width), reduce)).reshape(2, -1)
    expected = reduce_activation(torch.from_numpy(maps), reduce).numpy()
    np.testing.assert_allclose(pooled, expected, rtol=0, atol=1e-12)


@settings(max_examples=30, deadline=None)
@given(tokens=st.integers(1, 9), hidden=st.integers(1, 12), how=st.sampled_from([*TOKEN_REDUCTIONS, "identity"]),
       seed=st.integers(0, 2**16))
def test_the_numpy_reductions_of_tokens_are_torchs(tokens, hidden, how, seed) -> None:
    activation = _activation((tokens, hidden), 3, seed)
    np.testing.assert_allclose(reduce_array(activation, how),
                               reduce_activation(torch.from_numpy(activation), how).numpy(), rtol=1e-6, atol=1e-6)
