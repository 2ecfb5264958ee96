"""Model updates through a real Redis Stream: every entry published after the listener started is applied, in
order; bad entries and failing applies are reported and skipped; a lost Redis is waited out."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable

import pytest
import redis.asyncio as aioredis
from bounded import run_bounded
from hypothesis import given
from hypothesis import strategies as st

from rampserve.serving.frontend.apps.update_stream import (
    UPDATE_STREAM,
    ModelUpdate,
    UpdateListener,
    UpdateStreamError,
    publish_update,
)


async def _until(condition: Callable[[], bool]) -> None:
    """Poll the listener's real state until the condition holds (bounded by the caller's wait_for)."""
    while not condition():
        await asyncio.sleep(0.01)


class Recorder:
    """An `apply` that records what it got, and fails on the models it is told to."""

    def __init__(self, failing: tuple[str, ...] = ()) -> None:
        self.seen: list[ModelUpdate] = []
        self.failing = failing
        self.changed = asyncio.Event()

    async def __call__(self, update: ModelUpdate) -> None:
        self.seen.append(update)
        self.changed.set()
        if update.model in self.failing:
            raise RuntimeError(f"boom loading {update.model}")

    async def wait_for(self, count: int) -> None:
        while len(self.seen) < count:
            self.changed.clear()
            await self.changed.wait()


@pytest.fixture
def stream(redis_prefix) -> str:
    return f"{redis_prefix}:model-updates"


def test_published_updates_are_applied_in_order_and_only_those_after_start(redis_url, stream) -> None:
    updates = [ModelUpdate("load", f"m{i}", version=str(i) if i % 2 else None) for i in range(6)]
    updates.append(ModelUpdate("unload", "m0"))

    async def scenario() -> tuple[Recorder, dict, list[str]]:
        await publish_update(redis_url, ModelUpdate("load", "before-start"), stream)
        recorder = Recorder()
        listener = UpdateListener(redis_url, recorder, stream=stream, block_ms=200)
        await listener.start()
        try:
            ids = [await publish_update(redis_url, update, stream) for update in updates]
            await recorder.wait_for(len(updates))
            await _until(lambda: listener.status()["applied"] == len(updates))
            return recorder, listener.status(), ids
        finally:
            await listener.stop()

    recorder, status, ids = run_bounded(scenario())
    assert recorder.seen == updates
    assert status["stream"] == stream and status["last_id"] == ids[-1]
    assert status["applied"] == len(updates) and status["failed"] == 0 and status["recent_errors"] == []


def test_malformed_entries_are_counted_and_later_ones_still_apply(redis_url, stream) -> None:
    bad_entries = [{"action": "explode", "model": "m"}, {"action": "load"}, {"action": "load", "model": "m",
                                                                               "verison": "2"}, {"action": "load", "model": b"\xff"}]

    async def scenario() -> tuple[Recorder, dict]:
        recorder = Recorder()
        listener = UpdateListener(redis_url, recorder, stream=stream, block_ms=200)
        await listener.start()
        client = aioredis.Redis.from_url(redis_url)
        try:
            for fields in bad_entries:
                await client.xadd(stream, fields)
            await publish_update(redis_url, ModelUpdate("load", "good", "3"), stream)
            await recorder.wait_for(1)
            return recorder, listener.status()
        finally:
            await client.aclose()
            await listener.stop()

    recorder, status = run_bounded(scenario())
    assert recorder.seen == [ModelUpdate("load", "good", "3")]
    assert status["applied"] == 1 and status["failed"] == len(bad_entries)
    errors = "\n".join(status["recent_errors"])
    for expected in ("'explode'", "'model' is missing", "unknown field(s) 'verison'", "not UTF-8"):
        assert expected in errors


def test_an_apply_that_raises_does_not_stop_the_listener(redis_url, stream) -> None:
    async def scenario() -> tuple[Recorder, dict]:
        recorder = Recorder(failing=("broken",))
        listener = UpdateListener(redis_url, recorder, stream=stream, block_ms=200)
        await listener.start()
        try:
            for model in ("broken", "fine"):
                await publish_update(redis_url, ModelUpdate("load", model), stream)
            await recorder.wait_for(2)
            await _until(lambda: listener.status()["applied"] == 1)
            return recorder, listener.status()
        finally:
            await listener.stop()

    recorder, status = run_bounded(scenario())
    assert [u.model for u in recorder.seen] == ["broken", "fine"]
    assert status["failed"] == 1 and status["running"]
    assert "load 'broken' failed: RuntimeError: boom loading broken" in status["recent_errors"][0]


def test_the_listener_waits_out_a_lost_redis_and_follows_it_again(private_redis) -> None:
    async def scenario() -> tuple[Recorder, dict, dict]:
        recorder = Recorder()
        listener = UpdateListener(private_redis.url, recorder, block_ms=200)
        await listener.start()
        try:
            await publish_update(private_redis.url, ModelUpdate("load", "first"), UPDATE_STREAM)
            await recorder.wait_for(1)
            private_redis.stop()
            await _until(lambda: listener.status()["connection_error"] is not None)
            down = listener.status()
            private_redis.start()
            await publish_update(private_redis.url, ModelUpdate("load", "after-restart"), UPDATE_STREAM)
            await recorder.wait_for(2)
            return recorder, down, listener.status()
        finally:
            await listener.stop()

    recorder, down, up = run_bounded(scenario())
    assert [u.model for u in recorder.seen] == ["first", "after-restart"]
    assert down["running"] and private_redis.url in down["connection_error"]
    assert up["connection_error"] is None and up["applied"] == 2 and up["failed"] == 0


def test_an_unreachable_broker_is_a_clear_error() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    url = f"redis://127.0.0.1:{port}/0"

    async def recorder(update: ModelUpdate) -> None:
        raise AssertionError("nothing can arrive")

    with pytest.raises(UpdateStreamError, match=f"at {url}"):
        run_bounded(publish_update(url, ModelUpdate("load", "m")))
    with pytest.raises(UpdateStreamError, match=f"at {url}"):
        run_bounded(UpdateListener(url, recorder).start())


@pytest.mark.parametrize(("fields", "message"), [
    ({"model": "m"}, "'action' is missing"),
    ({"action": "load"}, "'model' is missing"),
    ({"action": "reload", "model": "m"}, "action must be one of load, unload"),
    ({"action": "load", "model": ""}, "model must be a non-empty name"),
    ({"action": "load", "model": "m", "version": ""}, "version of 'm' must be non-empty"),
    ({"action": "load", "model": "m", "owner": "x"}, "unknown field"),
    ({b"action": b"load", b"model": b"\xc3"}, "model is not UTF-8"),
])
def test_model_update_validation(fields, message) -> None:
    with pytest.raises(ValueError, match=message):
        ModelUpdate.from_fields(fields)


def test_model_update_from_bytes_or_str() -> None:
    assert ModelUpdate.from_fields({b"action": b"unload", b"model": b"resnet"}) == ModelUpdate("unload", "resnet")
    assert ModelUpdate.from_fields({"action": "load", "model": "r", "version": "7"}) == ModelUpdate("load", "r", "7")


@given(st.sampled_from(["load", "unload"]), st.text(min_size=1), st.none() | st.text(min_size=1), st.booleans())
def test_model_update_round_trips_through_its_fields(action, model, version, as_bytes) -> None:
    update = ModelUpdate(action, model, version)
    fields = update.to_fields()
    assert all(isinstance(v, str) for v in fields.values())
    if as_bytes:  # as Redis hands them back
        fields = {k.encode(): v.encode() for k, v in fields.items()}
    assert ModelUpdate.from_fields(fields) == update
