"""The KV index's counters for metrics and admin, in one wrapper around any backend.

``InstrumentedKvIndex(inner)`` is a :class:`KvIndex` that forwards every call to
``inner`` and counts what the router reports about its index but no backend needs for
its own work:

* ``queries``: routing lookups (``query_backends``, and ``query_many``: one lookup however
  many keys) answered, whichever store answered them (Redis, or the memory fallback
  during an outage);
* ``hits``: those that returned at least one entry; ``stats().total_hits``.

``peek`` and ``peek_many`` (operators' reads: the gRPC Query and Score calls) are
forwarded uncounted. A
lookup that raises is not counted. What only a backend can know stays in its own stats:
the memory index's capacity evictions and expiries, Redis' expiries, the counts of what
is stored, ``fallback_active``.

``last_stats`` keeps the latest ``stats()`` result, so a scrape-time collector can read
the index's figures synchronously, without I/O (``stats()`` on Redis scans).

The counters are plain integers touched on the event loop only: no lock, and the hot
path (``query_backends``) costs one extra await and two additions.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from .base import Change, IndexEntry, IndexStats, Key, KvIndex, StorageTier

__all__ = ["InstrumentedKvIndex"]


class InstrumentedKvIndex(KvIndex):
    """``inner`` with the router's query counters (module docstring)."""

    def __init__(self, inner: KvIndex) -> None:
        self.inner = inner
        self.kind = inner.kind
        self.queries = 0
        """Routing lookups answered since start (this process only)."""
        self.hits = 0
        """Routing lookups that returned at least one entry."""
        self.last_stats: IndexStats | None = None
        """The latest ``stats()`` result (None before the first call)."""

    async def query_backends(self, prefix_hash: Key) -> Sequence[IndexEntry]:
        found = await self.inner.query_backends(prefix_hash)
        self.queries += 1
        if found:
            self.hits += 1
        return found

    async def query_many(self, keys: Sequence[Key]) -> list[Sequence[IndexEntry]]:
        rows = await self.inner.query_many(keys)
        self.queries += 1
        for row in rows:
            if row:
                self.hits += 1
                break
        return rows

    async def peek(self, prefix_hash: Key) -> Sequence[IndexEntry]:
        return await self.inner.peek(prefix_hash)

    async def peek_many(self, keys: Sequence[Key]) -> list[Sequence[IndexEntry]]:
        return await self.inner.peek_many(keys)

    def now(self) -> float:
        return self.inner.now()

    async def backend_counts(self) -> dict[str, int]:
        return await self.inner.backend_counts()

    async def upsert(
        self,
        prefix_hash: Key,
        backend: str,
        token_count: int,
        tier: StorageTier,
        ttl: float | None = None,
    ) -> None:
        await self.inner.upsert(prefix_hash, backend, token_count, tier, ttl)

    async def write_many(self, changes: Sequence[Change], ttl: float | None = None) -> None:
        await self.inner.write_many(changes, ttl)

    async def set_tier(self, prefix_hash: Key, backend: str, tier: StorageTier) -> bool:
        return await self.inner.set_tier(prefix_hash, backend, tier)

    async def remove(self, prefix_hash: Key, backend: str) -> bool:
        return await self.inner.remove(prefix_hash, backend)

    async def remove_backend(self, backend: str) -> int:
        return await self.inner.remove_backend(backend)

    async def begin_resync(self, backend: str) -> None:
        await self.inner.begin_resync(backend)

    async def end_resync(self, backend: str) -> None:
        await self.inner.end_resync(backend)

    async def clear(self) -> int:
        return await self.inner.clear()

    async def cleanup_expired(self) -> int:
        return await self.inner.cleanup_expired()

    async def stats(self) -> IndexStats:
        st = dataclasses.replace(await self.inner.stats(), total_hits=self.hits)
        self.last_stats = st
        return st

    async def close(self) -> None:
        await self.inner.close()
