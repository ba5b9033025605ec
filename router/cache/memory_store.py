"""In-process response cache: an LRU ``OrderedDict`` with a TTL per entry.

Layout::

    _data: OrderedDict[key, (value, expires_at)]    # least recently used first

* ``get`` is one dict lookup, a clock read and ``move_to_end`` on a hit, O(1). An expired
  entry is dropped by the ``get`` that finds it (lazy expiry; there is no sweeper).
* ``set`` inserts (or replaces) at the most-recently-used end; when that makes the store
  exceed ``capacity`` the least recently used entry is dropped, O(1). It counts as an
  eviction, or as expired if its TTL had already run out.
* ``capacity`` counts entries, not bytes; ``stats().size_bytes`` reports the bytes of the
  stored values so an operator can size it.

Concurrency-safe on the loop: no method awaits, so every call runs to completion before
another starts. The synchronous twins (``lookup``, ``put``, ``drop``, ``drop_all``) exist for
callers that must not yield (``FallbackCacheStore``) and for benchmarks. Not thread-safe.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

from .store import CacheStats, CacheStore, check_ttl

__all__ = ["InMemoryCacheStore"]


class InMemoryCacheStore(CacheStore):
    """The memory backend; also the Redis backend's fallback."""

    kind = "memory"

    def __init__(
        self,
        capacity: int = 1000,
        default_ttl: int = 300,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """
        Args:
            capacity: entries kept; one more evicts the least recently used.
            default_ttl: seconds, for ``set`` without a TTL.
            clock: monotonic seconds; expiries are on this clock (tests inject one).

        Raises:
            ValueError: ``capacity`` < 1 or ``default_ttl`` not a positive integer.
        """
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self.capacity = capacity
        self.default_ttl = check_ttl(default_ttl, 0)
        self.clock = clock
        self._data: OrderedDict[str, tuple[bytes, float]] = OrderedDict()
        self._bytes = 0
        self.hits = 0
        self.misses = 0
        self.sets = 0
        self.evictions = 0
        self.expired = 0

    def __len__(self) -> int:
        """Entries held, expired ones not yet dropped included."""
        return len(self._data)

    def __contains__(self, key: object) -> bool:
        """Held (live or not yet dropped); not counted as a hit or a miss."""
        return key in self._data

    # ---- synchronous core (never yields) ----------------------------------------------

    def lookup(self, key: str) -> bytes | None:
        """``get`` without the coroutine (keep the two in step)."""
        data = self._data
        entry = data.get(key)
        if entry is not None:
            if entry[1] > self.clock():
                data.move_to_end(key)
                self.hits += 1
                return entry[0]
            del data[key]
            self._bytes -= len(entry[0])
            self.expired += 1
        self.misses += 1
        return None

    def put(self, key: str, value: bytes, ttl_seconds: int | None = None) -> None:
        """``set`` without the coroutine."""
        ttl = check_ttl(ttl_seconds, self.default_ttl)
        if type(value) is not bytes:
            value = bytes(value)  # a bytearray or memoryview must not change under us
        data = self._data
        old = data.pop(key, None)
        if old is not None:
            self._bytes -= len(old[0])
        data[key] = (value, self.clock() + ttl)
        self._bytes += len(value)
        self.sets += 1
        if len(data) > self.capacity:
            _, (victim, expires_at) = data.popitem(last=False)
            self._bytes -= len(victim)
            if expires_at <= self.clock():
                self.expired += 1
            else:
                self.evictions += 1

    def drop(self, key: str) -> bool:
        """``delete`` without the coroutine."""
        entry = self._data.pop(key, None)
        if entry is None:
            return False
        self._bytes -= len(entry[0])
        if entry[1] <= self.clock():
            self.expired += 1
            return False
        return True

    def drop_all(self) -> int:
        """``clear`` without the coroutine: returns the live entries dropped."""
        now = self.clock()
        live = sum(1 for _, expires_at in self._data.values() if expires_at > now)
        self.expired += len(self._data) - live
        self._data.clear()
        self._bytes = 0
        return live

    def snapshot_stats(self) -> CacheStats:
        """``stats`` without the coroutine."""
        return CacheStats(
            kind=self.kind,
            entries=len(self._data),
            hits=self.hits,
            misses=self.misses,
            sets=self.sets,
            evictions=self.evictions,
            expired=self.expired,
            size_bytes=self._bytes,
        )

    # ---- CacheStore ----------------------------------------------------------------------

    async def get(self, key: str) -> bytes | None:
        # ``lookup`` inlined: this is the request path, and a call costs ~10% of it.
        data = self._data
        entry = data.get(key)
        if entry is not None:
            if entry[1] > self.clock():
                data.move_to_end(key)
                self.hits += 1
                return entry[0]
            del data[key]
            self._bytes -= len(entry[0])
            self.expired += 1
        self.misses += 1
        return None

    async def set(self, key: str, value: bytes, ttl_seconds: int | None = None) -> None:
        self.put(key, value, ttl_seconds)

    async def delete(self, key: str) -> bool:
        return self.drop(key)

    async def clear(self) -> int:
        return self.drop_all()

    async def stats(self) -> CacheStats:
        return self.snapshot_stats()

    async def close(self) -> None:
        """Drop every entry (the memory is the store's own). Idempotent."""
        self._data.clear()
        self._bytes = 0
