"""Model updates pushed through a Redis Stream, the broker that plays the part of speculative serving's Kafka
topics (seed 004): an operator (or a training pipeline) appends an entry, and every server listening loads or
unloads the model while it keeps serving.

Every server must apply every update, so each one reads the stream on its own with plain XREAD (a consumer
group would hand each entry to one server only), from the stream's end at the time it started listening.

An entry's fields: action ("load" | "unload"), model, and optionally version.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from rampserve.serving.frontend.apps.state_store import DEFAULT_TIMEOUT_S, redacted, redis_client

log = logging.getLogger("rampserve.serving")

UPDATE_STREAM = "rampserve:model-updates"
ACTIONS = ("load", "unload")
FIELDS = ("action", "model", "version")
# Listeners only need entries published after they started, so the stream is trimmed (approximately, which is
# cheap) instead of growing forever; a listener more than this many entries behind would miss the oldest.
STREAM_MAXLEN = 10_000
# Entries read per XREAD; they are still applied one at a time, in order.
READ_COUNT = 64
RECENT_ERRORS = 20
RECONNECT_BACKOFF_S = (0.1, 5.0)  # first wait, longest wait; doubling in between


class UpdateStreamError(RuntimeError):
    """The stream's Redis cannot be reached or refused a command."""


def _text(value: bytes | str, what: str) -> str:
    if isinstance(value, str):
        return value
    try:
        return value.decode()
    except UnicodeDecodeError as exc:
        raise ValueError(f"model update: {what} is not UTF-8 ({exc})") from exc


@dataclass(frozen=True)
class ModelUpdate:
    action: str  # "load" | "unload"
    model: str
    version: str | None = None  # None: the model's only (load) or every (unload) version

    def __post_init__(self) -> None:
        if self.action not in ACTIONS:
            raise ValueError(f"model update: action must be one of {', '.join(ACTIONS)}, got {self.action!r}")
        if not self.model:
            raise ValueError("model update: model must be a non-empty name")
        if self.version is not None and not self.version:
            raise ValueError(f"model update: version of {self.model!r} must be non-empty when given")

    @classmethod
    def from_fields(cls, fields: Mapping[bytes | str, bytes | str]) -> ModelUpdate:
        """A stream entry's fields (bytes, as Redis returns them, or str), validated; ValueError says what is
        wrong. Unknown fields are refused: a misspelt "verison" must not silently load the wrong version."""
        decoded = {_text(name, "a field name"): value for name, value in fields.items()}
        unknown = sorted(set(decoded) - set(FIELDS))
        if unknown:
            raise ValueError(f"model update: unknown field(s) {', '.join(map(repr, unknown))}; "
                             f"expected {', '.join(FIELDS)}")
        for required in ("action", "model"):
            if required not in decoded:
                raise ValueError(f"model update: field {required!r} is missing")
        version = decoded.get("version")
        return cls(_text(decoded["action"], "action"), _text(decoded["model"], "model"),
                   None if version is None else _text(version, "version"))

    def to_fields(self) -> dict[str, str]:
        fields = {"action": self.action, "model": self.model}
        if self.version is not None:
            fields["version"] = self.version
        return fields


async def publish_update(url: str, update: ModelUpdate, stream: str = UPDATE_STREAM) -> str:
    """Append the update to the stream; returns the entry's id."""
    client = redis_client(url)
    try:
        entry_id = await client.xadd(stream, update.to_fields(), maxlen=STREAM_MAXLEN, approximate=True)
    except RedisError as exc:
        raise UpdateStreamError(f"cannot publish to {stream!r} at {redacted(url)}: {exc}") from exc
    finally:
        await client.aclose()
    return _text(entry_id, "entry id")


class UpdateListener:
    """Applies every update published on the stream after `start()`, one at a time, in stream order. A bad
    entry or a failing `apply` is logged, counted and skipped; a lost Redis is retried with backoff. Neither
    stops the listener: a server must keep serving, and keep following updates once Redis is back."""

    def __init__(self, url: str, apply: Callable[[ModelUpdate], Awaitable[object]], stream: str = UPDATE_STREAM,
                 block_ms: int = 1000) -> None:
        if block_ms <= 0:
            raise ValueError(f"block_ms must be positive (0 would block forever), got {block_ms}")
        self.url = url
        self.apply = apply
        self.stream = stream
        self.block_ms = block_ms
        self.last_id: str | None = None
        self.applied = 0
        self.failed = 0
        self.connection_error: str | None = None
        self.recent_errors: deque[str] = deque(maxlen=RECENT_ERRORS)
        self._client: aioredis.Redis | None = None
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        """Resolve the stream's current end to a concrete id, then follow it from there in a task. Raises
        UpdateStreamError if Redis cannot be reached now: a server configured with a broker should not come up
        silently deaf to it."""
        if self._task is not None:
            raise RuntimeError("the update listener is already running")
        # A blocked XREAD legitimately waits block_ms before answering; the socket must wait longer than that.
        self._client = redis_client(self.url, self.block_ms / 1000 + DEFAULT_TIMEOUT_S)
        try:
            newest = await self._client.xrevrange(self.stream, count=1)
        except RedisError as exc:
            await self._client.aclose()
            self._client = None
            raise UpdateStreamError(f"cannot read {self.stream!r} at {redacted(self.url)}: {exc}") from exc
        # An absent or empty stream: every entry published from now on has an id above 0-0.
        self.last_id = _text(newest[0][0], "entry id") if newest else "0-0"
        self._task = asyncio.create_task(self._follow(), name=f"update-listener:{self.stream}")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            # Once is not always enough: on Python 3.11, asyncio.wait_for (which redis-py wraps around every
            # socket write) swallows a cancel that lands just as the write completes, and the task reads on.
            while not task.done():
                task.cancel()
                await asyncio.wait([task], timeout=0.1)
            if not task.cancelled() and task.exception() is not None:
                log.error("update stream %s: the listener had died", self.stream, exc_info=task.exception())
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    def status(self) -> dict:
        return {"stream": self.stream, "running": self._task is not None and not self._task.done(),
                "last_id": self.last_id, "applied": self.applied, "failed": self.failed,
                "connection_error": self.connection_error, "recent_errors": list(self.recent_errors)}

    def _error(self, message: str, exc_info: bool = False) -> None:
        log.warning("update stream %s: %s", self.stream, message, exc_info=exc_info)
        self.recent_errors.append(message)

    async def _follow(self) -> None:
        assert self._client is not None and self.last_id is not None
        backoff = RECONNECT_BACKOFF_S[0]
        while True:
            try:
                reply = await self._client.xread({self.stream: self.last_id}, count=READ_COUNT, block=self.block_ms)
            except RedisError as exc:
                message = f"cannot read {self.stream!r} at {redacted(self.url)}: {exc}"
                if message != self.connection_error:  # once per outage, not once per retry
                    self._error(message)
                self.connection_error = message
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, RECONNECT_BACKOFF_S[1])
                continue
            self.connection_error = None
            backoff = RECONNECT_BACKOFF_S[0]
            for _stream, entries in reply or ():
                for entry_id, fields in entries:
                    await self._apply_entry(_text(entry_id, "entry id"), fields)

    async def _apply_entry(self, entry_id: str, fields: Mapping[bytes, bytes]) -> None:
        # Moved past before applying: an entry that fails is reported once, not retried forever.
        self.last_id = entry_id
        try:
            update = ModelUpdate.from_fields(fields)
        except ValueError as exc:
            self.failed += 1
            self._error(f"entry {entry_id}: {exc}")
            return
        try:
            await self.apply(update)
        except Exception as exc:  # whatever apply raises, the server keeps following the stream
            self.failed += 1
            self._error(f"entry {entry_id}: {update.action} {update.model!r} failed: {type(exc).__name__}: {exc}",
                        exc_info=True)
            return
        self.applied += 1
