"""A linear ramp on a large map pools every k-th row and column of it (`pooling.sampled`): the reduction, the
NumPy evaluation and the ramp operator agree, and none of them reads a position it skips."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn import functional as F

from rampserve.ramps import kernel
from rampserve.ramps.fused import fused_ramp
from rampserve.ramps.kinds import make_ramp
from rampserve.ramps.specs import spec_for
from rampserve.ramps.pooling import LINEAR_CNN_GRID, MIN_SAMPLING_STRIDE, SAMPLED_SIDE, sampled, sampling_stride
from rampserve.ramps.torch_reductions import reduce_activation

large_side = st.integers(MIN_SAMPLING_STRIDE * SAMPLED_SIDE, (MIN_SAMPLING_STRIDE + 2) * SAMPLED_SIDE)
large_maps = st.tuples(st.integers(1, 8), large_side, large_side)


def test_only_a_map_read_at_every_fourth_row_or_fewer_is_sampled() -> None:
    side = MIN_SAMPLING_STRIDE * SAMPLED_SIDE
    small, large = (8, side - 1, 4 * side), (8, side, side)
    assert spec_for("linear", small, 10).reduce == "grid_mean"
    assert spec_for("mlp", large, 10).reduce == "sampled_grid_mean"
    assert spec_for("mlp", large, 10).feature_shape == (8 * LINEAR_CNN_GRID**2,)
    assert sampling_stride((32, 112, 112), "sampled_grid_mean") == 4 == MIN_SAMPLING_STRIDE
    assert sampled((32, 112, 112), "sampled_grid_mean") == ((32, 28, 28), "grid_mean")
    assert sampled((32, 112, 112), "grid_mean") == ((32, 112, 112), "grid_mean")


@settings(max_examples=25, deadline=None)
@given(shape=large_maps, seed=st.integers(0, 2**16))
def test_a_sampled_pooling_is_the_grid_of_the_sampled_map_and_ignores_the_rest(shape, seed) -> None:
    generator = torch.Generator().manual_seed(seed)
    activation = torch.randn(2, *shape, generator=generator)
    stride = sampling_stride(shape, "sampled_grid_mean")
    features = reduce_activation(activation, "sampled_grid_mean")
    expected = F.adaptive_avg_pool2d(activation[:, :, ::stride, ::stride], LINEAR_CNN_GRID).flatten(1)
    torch.testing.assert_close(features, expected, rtol=0, atol=0)
    skipped = torch.ones(shape[1:], dtype=torch.bool)
    skipped[::stride, ::stride] = False
    changed = activation.clone()
    changed[:, :, skipped] += torch.randn(2, shape[0], int(skipped.sum()), generator=generator)
    assert stride > 1 and not torch.equal(changed, activation)
    torch.testing.assert_close(reduce_activation(changed, "sampled_grid_mean"), features, rtol=0, atol=0)


@settings(max_examples=20, deadline=None)
@given(shape=large_maps, seed=st.integers(0, 2**16), kind=st.sampled_from(["linear", "mlp"]))
def test_numpy_evaluation_gives_the_eager_ramps_logits(shape, seed, kind) -> None:
    torch.manual_seed(seed)
    ramp = make_ramp(spec_for(kind, shape, 5, hidden=7)).eval()
    ramp.center.normal_()
    activation = torch.randn(3, *shape)
    with torch.no_grad():
        np.testing.assert_allclose(ramp.arrays().logits(activation.numpy()), ramp(activation).numpy(), rtol=1e-4,
                                   atol=1e-5)


@pytest.mark.skipif(not kernel.available(), reason="the ramp operators did not build on this machine")
@settings(max_examples=20, deadline=None)
@given(shape=large_maps, seed=st.integers(0, 2**16))
def test_the_ramp_operator_pools_the_sampled_map_as_the_eager_ramp(shape, seed) -> None:
    torch.manual_seed(seed)
    ramp = make_ramp(spec_for("linear", shape, 4)).eval()
    ramp.center.normal_()
    activation = torch.randn(2, *shape)
    fused = fused_ramp(ramp, "max_prob", shape, column=0)
    out = torch.zeros(2, 1, 4)
    fused(activation, out, 1.0, -1, [])
    with torch.no_grad():
        torch.testing.assert_close(out[:, 0], ramp(activation), rtol=1e-4, atol=1e-5)
