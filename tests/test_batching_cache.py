"""The server's pure parts: adaptive batch size, admission estimate, prediction cache."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from rampserve.serving.executor.batching import AdaptiveBatchSize, expected_wait_ms
from rampserve.serving.shared.contract import Answer
from rampserve.serving.frontend.cache import PredictionCache, cache_key, entry_bytes


@given(st.integers(1, 64), st.lists(st.tuples(st.integers(1, 64), st.floats(0.0, 20.0)), max_size=60))
def test_adaptive_batch_size_stays_within_bounds(max_batch, batches) -> None:
    size = AdaptiveBatchSize(max_batch, slo_ms=5.0)
    for batch, ms in batches:
        size.observe(min(batch, size.size), ms)
        assert 1 <= size.size <= max_batch


def test_adaptive_batch_size_grows_while_within_the_slo_and_backs_off_on_a_miss() -> None:
    size = AdaptiveBatchSize(16, slo_ms=5.0)
    for _ in range(5):
        size.observe(size.size, 1.0)
    assert size.size == 6  # additive: one per full batch within the SLO
    size.observe(size.size, 1.0 if size.size < 6 else 9.0)
    assert size.size == 5  # multiplicative: 6 * 0.9
    size.observe(2, 1.0)  # a batch smaller than the limit says nothing about the limit
    assert size.size == 5


def test_expected_wait_counts_the_running_batch_and_those_queued_ahead() -> None:
    assert expected_wait_ms(0, 4, 2.0, running=False) == 2.0
    assert expected_wait_ms(0, 4, 2.0, running=True) == 4.0
    assert expected_wait_ms(5, 4, 2.0, running=True) == 8.0


def _answer(label: int, floats: int = 0) -> Answer:
    return Answer(np.array([label]), np.ones(1), np.zeros((1, floats), dtype=np.float32))


def test_cache_key_covers_model_version_names_dtypes_shapes_and_bytes() -> None:
    x = np.arange(6, dtype=np.float32).reshape(1, 6)
    keys = {
        cache_key("m", "1", {"x": x}),
        cache_key("n", "1", {"x": x}),
        cache_key("m", "2", {"x": x}),
        cache_key("m", "1", {"y": x}),
        cache_key("m", "1", {"x": x.astype(np.float64)}),
        cache_key("m", "1", {"x": x.reshape(2, 3)}),
        cache_key("m", "1", {"x": x + 1}),
    }
    assert len(keys) == 7
    assert cache_key("m", "1", {"x": x}) == cache_key("m", "1", {"x": x.copy()})


def test_cache_evicts_least_recently_used_and_stays_within_its_bytes() -> None:
    entry = entry_bytes(_answer(0))
    cache = PredictionCache(3 * entry)
    for key in (b"a", b"b", b"c"):
        cache.put(key, _answer(0))
    assert cache.get(b"a") is not None  # a is now the most recent
    cache.put(b"d", _answer(1))
    assert cache.get(b"b") is None and cache.get(b"a") is not None and cache.get(b"d") is not None
    assert cache.size_bytes <= cache.capacity_bytes and len(cache) == 3
    cache.put(b"huge", _answer(2, floats=10 * entry))  # larger than the whole cache: not kept
    assert cache.get(b"huge") is None and len(cache) == 3
    assert (cache.hits, cache.misses) == (3, 2)


@given(st.lists(st.tuples(st.binary(min_size=1, max_size=3), st.integers(0, 300)), max_size=80))
def test_cache_bytes_never_exceed_the_capacity(puts) -> None:
    cache = PredictionCache(4096)
    for key, floats in puts:
        cache.put(key, _answer(1, floats))
        assert cache.size_bytes == sum(entry_bytes(a) for a in cache._entries.values()) <= 4096


def test_cache_refuses_a_capacity_of_zero() -> None:
    with pytest.raises(ValueError, match="positive"):
        PredictionCache(0)
