"""The state store, in memory and in a real redis-server: round trips, atomic updates under concurrency (one
server's coroutines, and two servers at once), state that outlives a server, and clear errors."""

from __future__ import annotations

import asyncio
import socket

import numpy as np
import pytest
import redis
from bounded import run_bounded

from rampserve.control.selection import EXPLORATION_FLOOR, Forgetting, SelectionState, exp3_update, exp4_update
from rampserve.serving.frontend.apps.state_store import (
    MemoryStore,
    RedisStore,
    StateStore,
    StoreError,
    StoreUnavailable,
    open_store,
)


@pytest.fixture(params=["memory", "redis"])
def store(request) -> StateStore:
    if request.param == "memory":
        return open_store(None)
    return open_store(request.getfixturevalue("redis_url"), prefix=request.getfixturevalue("redis_prefix"))


def _increment(value: dict | None) -> dict:
    return {"count": (value or {"count": 0})["count"] + 1}


def test_get_put_delete_items_round_trip(store: StateStore) -> None:
    async def scenario() -> None:
        assert await store.get("apps", "a") is None
        assert await store.items("apps") == {}
        await store.put("apps", "a", {"models": ["m1", "m2"], "policy": "exp3"})
        await store.put("apps", "b:with:colons", {"models": ["m3"]})
        await store.put("other", "a", {"x": 1.5})
        assert await store.get("apps", "a") == {"models": ["m1", "m2"], "policy": "exp3"}
        assert await store.items("apps") == {"a": {"models": ["m1", "m2"], "policy": "exp3"},
                                             "b:with:colons": {"models": ["m3"]}}
        # What a caller gets is a copy: changing it changes nothing stored.
        got = await store.get("apps", "a")
        got["models"].append("m9")
        assert await store.get("apps", "a") == {"models": ["m1", "m2"], "policy": "exp3"}
        await store.put("apps", "a", {"models": ["m2"]})
        assert await store.get("apps", "a") == {"models": ["m2"]}
        assert await store.delete("apps", "a") is True
        assert await store.delete("apps", "a") is False
        assert await store.get("apps", "a") is None
        assert await store.items("apps") == {"b:with:colons": {"models": ["m3"]}}
        assert await store.items("other") == {"a": {"x": 1.5}}
        await store.ping()
        await store.close()

    run_bounded(scenario())


def test_refuses_bad_names_and_values(store: StateStore) -> None:
    async def scenario() -> None:
        with pytest.raises(ValueError, match="namespace"):
            await store.put("a:b", "k", {})
        with pytest.raises(ValueError, match="namespace"):
            await store.items("")
        with pytest.raises(ValueError, match="key"):
            await store.get("apps", "")
        with pytest.raises(TypeError, match="dict"):
            await store.put("apps", "k", [1, 2])  # type: ignore[arg-type]
        with pytest.raises(TypeError):
            await store.put("apps", "k", {"not json": object()})
        with pytest.raises(TypeError, match="dict"):
            await store.update("apps", "k", lambda old: None)  # type: ignore[arg-type, return-value]
        assert await store.get("apps", "k") is None
        await store.close()

    run_bounded(scenario())


def test_concurrent_updates_lose_nothing(store: StateStore) -> None:
    async def scenario() -> list[dict]:
        results = await asyncio.gather(*(store.update("counters", "c", _increment) for _ in range(50)))
        assert await store.get("counters", "c") == {"count": 50}
        await store.close()
        return results

    results = run_bounded(scenario())
    # Each update returned the value it wrote, and every one wrote a different count.
    assert sorted(r["count"] for r in results) == list(range(1, 51))


def test_selection_state_round_trips_through_an_update(store: StateStore) -> None:
    def learn(old: dict | None) -> dict:
        state = SelectionState.uniform(("a", "b")) if old is None else SelectionState.from_json(old)
        return exp3_update(state, chosen=0, loss=1.0, eta=0.1).to_json()

    async def scenario() -> dict:
        for _ in range(3):
            await store.update("selection", "app/user-1", learn)
        value = await store.get("selection", "app/user-1")
        await store.close()
        return value

    state = SelectionState.from_json(run_bounded(scenario()))
    assert state.models == ("a", "b") and state.updates == 3
    assert state.probabilities()[0] < 0.5  # the model that kept losing is chosen less
    # The change detector's averages of the losses observed come back too: a lost three times, b never asked.
    assert state.recent_loss.tolist() == [0.875, 0.0]
    assert state.long_run_loss.tolist() == pytest.approx([1 - (15 / 16) ** 3, 0.0])


def test_selection_state_stored_before_the_detector_resumes(store: StateStore) -> None:
    old = {"models": ["a", "b"], "weights": [0.999999, 1e-6], "updates": 41}  # no loss averages, the old floor

    def learn(stored: dict | None) -> dict:
        return exp4_update(SelectionState.from_json(stored), np.array([0.0, 0.0]), 0.1, Forgetting()).to_json()

    async def scenario() -> dict:
        await store.put("selection", "app/old-user", old)
        await store.update("selection", "app/old-user", learn)
        value = await store.get("selection", "app/old-user")
        await store.close()
        return value

    stored = run_bounded(scenario())
    state = SelectionState.from_json(stored)
    assert state.updates == 42 and set(stored) >= {"recent_loss", "long_run_loss"}
    assert state.weights[1] == pytest.approx(EXPLORATION_FLOOR)  # lifted to the floor of exploration


def test_two_redis_servers_update_one_counter_concurrently(redis_url, redis_prefix) -> None:
    first, second = RedisStore(redis_url, redis_prefix), RedisStore(redis_url, redis_prefix)

    async def scenario() -> dict | None:
        await asyncio.gather(*(s.update("counters", "shared", _increment) for _ in range(40) for s in (first, second)))
        value = await first.get("counters", "shared")
        await first.close()
        await second.close()
        return value

    assert run_bounded(scenario()) == {"count": 80}


def test_redis_state_outlives_the_store_that_wrote_it(redis_url, redis_prefix) -> None:
    async def write() -> None:
        store = open_store(redis_url, redis_prefix)
        await store.put("apps", "digits", {"models": ["resnet", "vgg"]})
        await store.update("selection", "digits/u1", _increment)
        await store.close()

    async def read_fresh() -> tuple[dict, dict]:
        store = open_store(redis_url, redis_prefix)
        values = await store.items("apps"), await store.items("selection")
        await store.close()
        return values

    async def read_other_prefix() -> dict[str, dict]:
        store = open_store(redis_url, redis_prefix + "-other")
        values = await store.items("apps")
        await store.close()
        return values

    run_bounded(write())  # the first "server", in its own event loop, then gone
    assert run_bounded(read_fresh()) == ({"digits": {"models": ["resnet", "vgg"]}}, {"digits/u1": {"count": 1}})
    assert run_bounded(read_other_prefix()) == {}


def test_one_redis_store_serves_one_event_loop_after_another(redis_url, redis_prefix) -> None:
    store = RedisStore(redis_url, redis_prefix)

    async def put_and_close() -> None:
        await store.put("apps", "a", {"n": 1})
        await store.close()

    async def get_and_close(key: str) -> dict | None:
        value = await store.get("apps", key)
        await store.close()
        return value

    run_bounded(put_and_close())
    assert run_bounded(get_and_close("a")) == {"n": 1}
    # Not closed in its loop: the next loop still gets a working client (the old one's sockets go with GC).
    run_bounded(store.put("apps", "b", {"n": 2}))
    assert run_bounded(get_and_close("b")) == {"n": 2}


def test_redis_key_layout(redis_url, redis_prefix) -> None:
    store = RedisStore(redis_url, redis_prefix)

    async def scenario() -> None:
        await store.put("apps", "a", {"n": 1})
        await store.close()

    run_bounded(scenario())
    client = redis.Redis.from_url(redis_url)
    try:
        assert client.get(f"{redis_prefix}:state:apps:a") == b'{"n":1}'
        assert client.smembers(f"{redis_prefix}:keys:apps") == {b"a"}
    finally:
        client.close()


def test_redis_value_not_written_by_rampserve_is_a_clear_error(redis_url, redis_prefix) -> None:
    client = redis.Redis.from_url(redis_url)
    try:
        client.set(f"{redis_prefix}:state:apps:broken", b"{not json")
    finally:
        client.close()
    store = RedisStore(redis_url, redis_prefix)

    async def read_broken() -> None:
        try:
            await store.get("apps", "broken")
        finally:
            await store.close()

    with pytest.raises(StoreError, match="apps/broken is not JSON"):
        run_bounded(read_broken())


def test_open_store_chooses_the_backend_and_refuses_unknown_urls() -> None:
    assert isinstance(open_store(None), MemoryStore)
    assert open_store("memory").description == "memory"
    redis_store = open_store("redis://127.0.0.1:6390/2", prefix="p")
    assert isinstance(redis_store, RedisStore) and redis_store.prefix == "p"
    assert redis_store.description == "redis://127.0.0.1:6390/2"
    assert open_store("redis://:hunter2@example:6379/0").description == "redis://:***@example:6379/0"
    for bad in ("postgres://db/x", "mem", "", "127.0.0.1:6379"):
        with pytest.raises(ValueError, match="unknown state store"):
            open_store(bad)


def test_unreachable_redis_is_a_clear_error_not_a_hang() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # nothing listens here once the probe is closed
    url = f"redis://127.0.0.1:{port}/0"
    store = open_store(url)
    for attempt in (store.ping(), store.get("apps", "a"), store.update("c", "k", _increment)):
        with pytest.raises(StoreUnavailable, match=f"state store {url} is unreachable"):
            run_bounded(attempt)
