"""Clipper's prediction cache: exact match on model, version and input bytes; least recently used entries go
first once the cache holds more than its byte budget. An entry is a request's final answer (`contract.Answer`)."""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Mapping

import numpy as np

from rampserve.serving.shared.contract import Answer

# What an entry costs beyond its arrays: the key, the dict slot, the record itself (measured roughly).
ENTRY_OVERHEAD_BYTES = 200


def cache_key(model: str, version: str, inputs: Mapping[str, np.ndarray]) -> bytes:
    """A digest of everything that decides the answer: names, datatypes, shapes and bytes of every input."""
    digest = hashlib.blake2b(f"{model}\0{version}".encode(), digest_size=20)
    for name in sorted(inputs):
        array = np.ascontiguousarray(inputs[name])
        digest.update(f"\0{name}\0{array.dtype.str}\0{array.shape}\0".encode())
        digest.update(array.tobytes() if array.dtype != object else repr(array.tolist()).encode())
    return digest.digest()


def entry_bytes(answer: Answer) -> int:
    """What an answer costs the cache: its arrays and the entry's overhead."""
    arrays = (answer.labels, answer.confidences, answer.logits)
    return sum(array.nbytes for array in arrays if array is not None) + ENTRY_OVERHEAD_BYTES


class PredictionCache:
    """Bounded in bytes; thread-safe (the event loop reads, the worker thread fills)."""

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"cache capacity must be positive, got {capacity_bytes} bytes")
        self.capacity_bytes = capacity_bytes
        self.size_bytes = 0
        self.hits = 0
        self.misses = 0
        self._entries: OrderedDict[bytes, Answer] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: bytes) -> Answer | None:
        with self._lock:
            answer = self._entries.get(key)
            if answer is None:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return answer

    def put(self, key: bytes, answer: Answer) -> None:
        size = entry_bytes(answer)
        if size > self.capacity_bytes:
            return  # would evict everything and still not fit
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self.size_bytes -= entry_bytes(old)
            self._entries[key] = answer
            self.size_bytes += size
            while self.size_bytes > self.capacity_bytes:
                _, evicted = self._entries.popitem(last=False)
                self.size_bytes -= entry_bytes(evicted)
