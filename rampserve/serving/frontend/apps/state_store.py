"""Where state that outlives a request lives: bandit selection state per context (application, user or session)
and the applications' definitions. In memory by default; in Redis when several servers share it or it must
survive a restart (Clipper keeps its per-context selection state in Redis, seed 003).

Values are JSON objects (dicts). Both stores keep them as orjson bytes, so what a caller gets back is always a
fresh copy and anything one store refuses to serialise the other refuses too.

Redis key layout (`prefix` defaults to "rampserve"; a namespace may not contain ':', so keys never collide):
    {prefix}:state:{namespace}:{key}   a string holding the value's JSON
    {prefix}:keys:{namespace}          a set of the namespace's keys, kept in the same transactions, so that
                                       `items` reads one namespace without scanning the whole database
Each entry is its own Redis key, so optimistic updates of different entries never conflict.
"""

from __future__ import annotations

import abc
import asyncio
import random
import threading
import weakref
from collections.abc import Callable
from urllib.parse import urlsplit, urlunsplit

import orjson
import redis.asyncio as aioredis
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError, WatchError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

# Long enough for a loaded Redis on another host, short enough that a dead one answers a request with a 503
# within seconds instead of holding it.
DEFAULT_TIMEOUT_S = 2.0
# Contended updates of one key collide again if every loser retries at once; a little jitter spreads them.
WATCH_BACKOFF_S = 0.002


def redis_client(url: str, read_timeout_s: float = DEFAULT_TIMEOUT_S) -> aioredis.Redis:
    """A redis.asyncio client that fails in seconds, not minutes, when Redis is gone: bounded connect and read
    timeouts, and one quick retry (it rides over a dropped idle connection; more would only delay the 503)."""
    return aioredis.Redis.from_url(url, socket_connect_timeout=DEFAULT_TIMEOUT_S, socket_timeout=read_timeout_s,
                                   retry=Retry(ExponentialWithJitterBackoff(base=0.01, cap=0.1), retries=1))


class StoreError(RuntimeError):
    """The store cannot do what was asked (its content is not what rampserve wrote, or Redis refused)."""


class StoreUnavailable(StoreError):
    """The backend cannot be reached; the server answers 503 while this lasts."""


def redacted(url: str) -> str:
    """The URL without its password, fit for logs, errors and status pages."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urlunsplit(parts._replace(netloc=netloc))


def _check_names(namespace: str, key: str | None = None) -> None:
    if not namespace or ":" in namespace:
        raise ValueError(f"a store namespace must be non-empty and free of ':', got {namespace!r}")
    if key is not None and not key:
        raise ValueError(f"a store key must be non-empty (namespace {namespace!r})")


def _encode(value: dict) -> bytes:
    if not isinstance(value, dict):
        raise TypeError(f"a stored value must be a dict, got {type(value).__name__}")
    return orjson.dumps(value)


class StateStore(abc.ABC):
    description: str

    @abc.abstractmethod
    async def get(self, namespace: str, key: str) -> dict | None: ...

    @abc.abstractmethod
    async def put(self, namespace: str, key: str, value: dict) -> None: ...

    @abc.abstractmethod
    async def update(self, namespace: str, key: str, change: Callable[[dict | None], dict]) -> dict:
        """Atomically replace the value by `change(old)` (old is None when absent) and return the new value.
        Concurrent updates, from coroutines or from other servers sharing the backend, never lose one another;
        `change` may run more than once, so it must not have side effects."""

    @abc.abstractmethod
    async def delete(self, namespace: str, key: str) -> bool:
        """True when the key was there."""

    @abc.abstractmethod
    async def items(self, namespace: str) -> dict[str, dict]: ...

    @abc.abstractmethod
    async def ping(self) -> None:
        """Raises StoreUnavailable when the backend cannot be reached."""

    @abc.abstractmethod
    async def close(self) -> None: ...


class MemoryStore(StateStore):
    """One process's state. A thread lock rather than an asyncio one: `change` is synchronous, so holding the
    lock never spans an await, and the store stays safe when tests touch it from outside the server's loop."""

    description = "memory"

    def __init__(self) -> None:
        self._data: dict[str, dict[str, bytes]] = {}
        self._lock = threading.Lock()

    async def get(self, namespace: str, key: str) -> dict | None:
        _check_names(namespace, key)
        with self._lock:
            raw = self._data.get(namespace, {}).get(key)
        return None if raw is None else orjson.loads(raw)

    async def put(self, namespace: str, key: str, value: dict) -> None:
        _check_names(namespace, key)
        raw = _encode(value)
        with self._lock:
            self._data.setdefault(namespace, {})[key] = raw

    async def update(self, namespace: str, key: str, change: Callable[[dict | None], dict]) -> dict:
        _check_names(namespace, key)
        with self._lock:
            entries = self._data.setdefault(namespace, {})
            old = entries.get(key)
            raw = _encode(change(None if old is None else orjson.loads(old)))
            entries[key] = raw
        return orjson.loads(raw)

    async def delete(self, namespace: str, key: str) -> bool:
        _check_names(namespace, key)
        with self._lock:
            return self._data.get(namespace, {}).pop(key, None) is not None

    async def items(self, namespace: str) -> dict[str, dict]:
        _check_names(namespace)
        with self._lock:
            entries = dict(self._data.get(namespace, {}))
        return {key: orjson.loads(raw) for key, raw in entries.items()}

    async def ping(self) -> None:
        return None

    async def close(self) -> None:
        return None


class RedisStore(StateStore):
    """State shared by every server pointed at the same Redis, kept across restarts (as durable as that Redis
    is configured to be)."""

    def __init__(self, url: str, prefix: str = "rampserve") -> None:
        if not prefix:
            raise ValueError("a Redis store needs a non-empty key prefix")
        self.url = url
        self.prefix = prefix
        self.description = redacted(url)
        # A redis.asyncio client belongs to the loop it first ran in, and the store is usually built before
        # the server's loop exists; so the client is made on first use, and again if the loop changes.
        self._client: aioredis.Redis | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        # Updates of one key from this store's own coroutines queue here rather than collide in Redis: with n of
        # them optimistic retries cost O(n²) round trips, queued O(n). Weak values: a lock lives while in use,
        # so per-user keys do not pile up locks.
        self._update_locks: weakref.WeakValueDictionary[str, asyncio.Lock] = weakref.WeakValueDictionary()

    def _value_key(self, namespace: str, key: str) -> str:
        return f"{self.prefix}:state:{namespace}:{key}"

    def _index_key(self, namespace: str) -> str:
        return f"{self.prefix}:keys:{namespace}"

    def _redis(self) -> aioredis.Redis:
        loop = asyncio.get_running_loop()
        if self._client is None or self._loop is not loop:
            self._client = redis_client(self.url)
            self._loop = loop
            self._update_locks = weakref.WeakValueDictionary()  # an asyncio.Lock belongs to one loop too
        return self._client

    def _failure(self, exc: RedisError) -> StoreError:
        if isinstance(exc, RedisConnectionError | RedisTimeoutError):
            return StoreUnavailable(f"state store {self.description} is unreachable: {exc}")
        return StoreError(f"state store {self.description} failed: {exc}")

    def _decode(self, raw: bytes, namespace: str, key: str) -> dict:
        try:
            value = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise StoreError(f"state store {self.description}: {namespace}/{key} is not JSON ({exc})") from exc
        if not isinstance(value, dict):
            raise StoreError(f"state store {self.description}: {namespace}/{key} is not a JSON object")
        return value

    async def get(self, namespace: str, key: str) -> dict | None:
        _check_names(namespace, key)
        try:
            raw = await self._redis().get(self._value_key(namespace, key))
        except RedisError as exc:
            raise self._failure(exc) from exc
        return None if raw is None else self._decode(raw, namespace, key)

    async def put(self, namespace: str, key: str, value: dict) -> None:
        _check_names(namespace, key)
        raw = _encode(value)
        try:
            async with self._redis().pipeline(transaction=True) as pipe:
                pipe.set(self._value_key(namespace, key), raw)
                pipe.sadd(self._index_key(namespace), key)
                await pipe.execute()
        except RedisError as exc:
            raise self._failure(exc) from exc

    async def update(self, namespace: str, key: str, change: Callable[[dict | None], dict]) -> dict:
        _check_names(namespace, key)
        value_key = self._value_key(namespace, key)
        client = self._redis()
        lock = self._update_locks.get(value_key)
        if lock is None:
            lock = self._update_locks[value_key] = asyncio.Lock()
        attempt = 0
        try:
            async with lock, client.pipeline(transaction=True) as pipe:
                while True:
                    try:
                        await pipe.watch(value_key)
                        old = await pipe.get(value_key)
                        raw = _encode(change(None if old is None else self._decode(old, namespace, key)))
                        pipe.multi()
                        pipe.set(value_key, raw)
                        pipe.sadd(self._index_key(namespace), key)
                        await pipe.execute()
                        return orjson.loads(raw)
                    except WatchError:
                        # Another server changed the value between our read and our write: read it again. If
                        # the connection died instead, the next WATCH fails to connect and raises, so this ends.
                        attempt += 1
                        await asyncio.sleep(random.uniform(0, WATCH_BACKOFF_S * min(attempt, 10)))
        except RedisError as exc:
            raise self._failure(exc) from exc

    async def delete(self, namespace: str, key: str) -> bool:
        _check_names(namespace, key)
        try:
            async with self._redis().pipeline(transaction=True) as pipe:
                pipe.delete(self._value_key(namespace, key))
                pipe.srem(self._index_key(namespace), key)
                deleted, _ = await pipe.execute()
        except RedisError as exc:
            raise self._failure(exc) from exc
        return deleted > 0

    async def items(self, namespace: str) -> dict[str, dict]:
        _check_names(namespace)
        client = self._redis()
        try:
            keys = sorted(member.decode() for member in await client.smembers(self._index_key(namespace)))
            if not keys:
                return {}
            raws = await client.mget([self._value_key(namespace, key) for key in keys])
        except RedisError as exc:
            raise self._failure(exc) from exc
        # A key deleted between the two reads has no value any more: it is simply gone.
        return {key: self._decode(raw, namespace, key) for key, raw in zip(keys, raws) if raw is not None}

    async def ping(self) -> None:
        try:
            await self._redis().ping()
        except RedisError as exc:
            raise self._failure(exc) from exc

    async def close(self) -> None:
        # A client made in another loop cannot be closed from this one; its connections die with that loop.
        if self._client is not None and self._loop is asyncio.get_running_loop():
            await self._client.aclose()
        self._client = None
        self._loop = None


def open_store(url: str | None, prefix: str = "rampserve") -> StateStore:
    """None or "memory": this process's memory; "redis://…" or "rediss://…": a shared Redis."""
    if url is None or url == "memory":
        return MemoryStore()
    if urlsplit(url).scheme in ("redis", "rediss", "unix"):
        return RedisStore(url, prefix)
    raise ValueError(f"unknown state store {url!r}: expected 'memory' or a redis:// (rediss://, unix://) URL")
