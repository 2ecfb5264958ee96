"""The padding-invariant token mean: in Python, in the ramp operator and in an ONNX tap."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rampserve.ramps import kernel
from rampserve.ramps.fused import fused_ramp
from rampserve.ramps.kinds import Ramp
from rampserve.ramps.specs import RampSpec
from rampserve.ramps.onnx_fused import ramp_tap
from rampserve.ramps.torch_reductions import reduce_activation
from taps import tap_session

HIDDEN = 8


def padded_batch(lengths: list[int], width: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Hidden states (n, width, HIDDEN) as an encoder that zeroes padded positions gives them, and the mask."""
    g = torch.Generator().manual_seed(seed)
    mask = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).to(torch.float32)
    hidden = torch.randn(len(lengths), width, HIDDEN, generator=g) * mask[:, :, None]
    return hidden, mask


batches = st.tuples(st.lists(st.integers(1, 12), min_size=1, max_size=5), st.integers(0, 6), st.integers(0, 2**16))


@settings(max_examples=60, deadline=None)
@given(batches)
def test_masked_token_mean_is_the_mean_over_real_tokens_whatever_the_padding(batch) -> None:
    lengths, extra, seed = batch
    hidden, mask = padded_batch(lengths, max(lengths), seed)
    pooled = reduce_activation(hidden, "token_mean_masked")
    expected = (hidden * mask[:, :, None]).sum(dim=1) / mask.sum(dim=1, keepdim=True)
    torch.testing.assert_close(pooled, expected, rtol=1e-6, atol=1e-6)
    more_padding = torch.cat([hidden, torch.zeros(len(lengths), extra, HIDDEN)], dim=1)
    # equal up to the order in which torch adds the tokens up, which depends on their count
    torch.testing.assert_close(reduce_activation(more_padding, "token_mean_masked"), pooled, rtol=1e-6, atol=1e-6)
    # Each input alone, unpadded, pools as it does in the batch
    for row, length in enumerate(lengths):
        alone = reduce_activation(hidden[row:row + 1, :length], "token_mean_masked")
        torch.testing.assert_close(alone[0], pooled[row], rtol=1e-6, atol=1e-6)
    # the plain mean is what padding changes
    if extra:
        assert not torch.allclose(reduce_activation(more_padding, "token_mean"), reduce_activation(hidden, "token_mean"))


def test_an_input_of_padding_only_pools_to_zeros() -> None:
    assert torch.equal(reduce_activation(torch.zeros(2, 3, HIDDEN), "token_mean_masked"), torch.zeros(2, HIDDEN))


def linear_ramp(seed: int = 0) -> Ramp:
    torch.manual_seed(seed)
    ramp = Ramp(RampSpec("linear", "token_mean_masked", (HIDDEN,), 3)).eval()
    ramp.center.normal_()
    return ramp


@pytest.mark.skipif(not kernel.available(), reason="the ramp operators did not build on this machine")
@settings(max_examples=30, deadline=None)
@given(batches)
def test_the_ramp_operator_pools_as_the_eager_ramp(batch) -> None:
    lengths, extra, seed = batch
    hidden, _ = padded_batch(lengths, max(lengths) + extra, seed)
    ramp = linear_ramp(seed % 7)
    fused = fused_ramp(ramp, "max_prob", tuple(hidden.shape[1:]), column=1)
    out = torch.zeros(len(lengths), 2, 3)
    fused(hidden, out, 1.0, -1, [])
    with torch.no_grad():
        torch.testing.assert_close(out[:, 1], ramp(hidden), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out[:, 1], ramp(hidden[:, :max(lengths)]), rtol=1e-5, atol=1e-5)


def test_an_onnx_tap_pools_as_the_eager_ramp() -> None:
    ramp = linear_ramp()
    hidden, _ = padded_batch([3, 7, 1, 5], 9, seed=3)
    for opset in (17, 18):  # axes as attributes, then as inputs
        for use_operator in (False, True):  # ONNX's operators, then rampserve's
            tap = ramp_tap(ramp, "hidden", (9, HIDDEN), opset, "max_prob", use_operator=use_operator)
            session = tap_session(tap, "hidden", ["batch", "tokens", HIDDEN], opset)
            logits, _ = session.run(None, {"hidden": hidden.numpy()})
            with torch.no_grad():
                np.testing.assert_allclose(logits, ramp(hidden).numpy(), rtol=1e-5, atol=1e-5)
