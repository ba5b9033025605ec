"""In-process KV index: a dict of small immutable tuples, ordered by last refresh.

Layout::

    _map: dict[prefix_hash, tuple[IndexEntry, ...]]   # tuple sorted as query returns it

* **Query** is one dict lookup; when no entry has expired the stored tuple itself is
  returned (no copy). A miss returns the shared ``EMPTY`` tuple and allocates nothing.
* **Order.** Every refresh (``upsert``, ``set_tier``) pops the prefix and re-inserts it, so
  dict order is last-refresh order. With one TTL for all entries, that is also expiry
  order of each prefix's newest entry: ``cleanup_expired`` walks from the front and stops
  at the first live prefix, O(expired) instead of O(size). ``remove`` and lazy pruning do
  not move a prefix; a prefix whose newest entry was removed may then wait behind a live
  one, at most one TTL longer. Queries never reorder (the read path stays read-only).
* **Capacity.** ``max_entries`` counts prefixes. Inserting a new prefix into a full index
  first evicts the oldest 10% (by last refresh, i.e. also the soonest to expire) in one
  step, so eviction cost is amortised over ``max_entries / 10`` inserts.
* **Memory.** An entry is a 4-slot object; a prefix's value is a tuple, not a dict; backend
  names are interned so every entry shares one string. About 320 B per (prefix, backend)
  with one backend per prefix, the 64-character key included (``bench/kvindex_bench.py``).

Concurrency-safe on the loop: no method awaits, so every call runs to completion before
another starts. Not thread-safe (use it from the loop that owns it).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from itertools import islice
from operator import attrgetter

from .base import EMPTY, Change, IndexEntry, IndexStats, KvIndex, StorageTier

__all__ = ["InMemoryKvIndex"]

_RANK = attrgetter("token_count", "backend")
_MAX_INTERNED = 4096


class InMemoryKvIndex(KvIndex):
    """The memory backend; also the fallback behind Redis (``FallbackKvIndex``), which
    uses the synchronous core below."""

    kind = "memory"

    def __init__(
        self,
        max_entries: int = 100_000,
        ttl_seconds: float = 600.0,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """
        Args:
            max_entries: prefixes kept; a full index evicts the oldest 10% at once.
            ttl_seconds: an entry expires this long after its last event.
            clock: seconds, monotonic; ``IndexEntry.expires_at`` is on this clock.
        """
        if max_entries < 1:
            raise ValueError("max_entries must be at least 1")
        if not ttl_seconds > 0:
            raise ValueError("ttl_seconds must be positive")
        self._max = max_entries
        self._evict_step = max(1, max_entries // 10)
        self._ttl = float(ttl_seconds)
        self.clock = clock
        self._map: dict[str, tuple[IndexEntry, ...]] = {}
        self._names: dict[str, str] = {}
        self._evictions = 0
        self._expired = 0

    @property
    def max_entries(self) -> int:
        return self._max

    @property
    def ttl_seconds(self) -> float:
        return self._ttl

    def __len__(self) -> int:
        """Prefix entries stored (expired ones not yet dropped included)."""
        return len(self._map)

    # ---- synchronous core (the async methods are thin wrappers) --------------------------

    def lookup(self, prefix_hash: str) -> Sequence[IndexEntry]:
        """``query_backends`` without the coroutine, for callers already on the loop."""
        entries = self._map.get(prefix_hash)
        if entries is None:
            return EMPTY
        now = self.clock()
        for e in entries:
            if e.expires_at <= now:
                return self._prune(prefix_hash, entries, now)
        return entries

    def get(self, prefix_hash: str, backend: str) -> IndexEntry | None:
        """The live entry of ``backend`` for ``prefix_hash``, if any. Never prunes."""
        entries = self._map.get(prefix_hash)
        if entries is not None:
            now = self.clock()
            for e in entries:
                if e.backend == backend and e.expires_at > now:
                    return e
        return None

    def items(self) -> Iterator[tuple[str, IndexEntry]]:
        """Every live (prefix_hash, entry). Do not mutate the index while iterating."""
        now = self.clock()
        for prefix_hash, entries in self._map.items():
            for e in entries:
                if e.expires_at > now:
                    yield prefix_hash, e

    def put(self, prefix_hash: str, backend: str, token_count: int, tier: StorageTier) -> None:
        """``upsert`` without the coroutine."""
        if token_count < 0:
            raise ValueError("token_count must be non-negative")
        now = self.clock()
        names = self._names
        name = names.get(backend)
        if name is None:
            name = backend
            if len(names) < _MAX_INTERNED:
                names[backend] = backend
        entry = IndexEntry(name, token_count, tier, now + self._ttl)
        m = self._map
        old = m.pop(prefix_hash, None)
        if old is None:
            if len(m) >= self._max:
                self._evict()
            m[prefix_hash] = (entry,)
            return
        if len(old) == 1:
            o = old[0]
            if o.backend == name:
                m[prefix_hash] = (entry,)
                return
            if o.expires_at <= now:
                self._expired += 1
                m[prefix_hash] = (entry,)
                return
            if token_count > o.token_count or (token_count == o.token_count and name > o.backend):
                m[prefix_hash] = (entry, o)
            else:
                m[prefix_hash] = (o, entry)
            return
        keep = [entry]
        for e in old:
            if e.backend != name:
                if e.expires_at > now:
                    keep.append(e)
                else:
                    self._expired += 1
        keep.sort(key=_RANK, reverse=True)
        m[prefix_hash] = tuple(keep)

    def _evict(self) -> None:
        m = self._map
        victims = list(islice(m, self._evict_step))
        n = 0
        for k in victims:
            n += len(m.pop(k))
        self._evictions += n

    def _prune(
        self, prefix_hash: str, entries: tuple[IndexEntry, ...], now: float
    ) -> Sequence[IndexEntry]:
        live = tuple(e for e in entries if e.expires_at > now)
        self._expired += len(entries) - len(live)
        if live:
            self._map[prefix_hash] = live  # existing key: position kept
            return live
        del self._map[prefix_hash]
        return EMPTY

    def drop(self, prefix_hash: str, backend: str) -> bool:
        """``remove`` without the coroutine."""
        m = self._map
        entries = m.get(prefix_hash)
        if entries is None:
            return False
        now = self.clock()
        found = False
        keep: list[IndexEntry] = []
        for e in entries:
            if e.backend == backend:
                if e.expires_at > now:
                    found = True
                else:
                    self._expired += 1
            elif e.expires_at > now:
                keep.append(e)
            else:
                self._expired += 1
        if keep:
            if len(keep) != len(entries):
                m[prefix_hash] = tuple(keep)
        else:
            del m[prefix_hash]
        return found

    def retier(self, prefix_hash: str, backend: str, tier: StorageTier) -> bool:
        """``set_tier`` without the coroutine."""
        m = self._map
        entries = m.get(prefix_hash)
        if entries is None:
            return False
        now = self.clock()
        for i, e in enumerate(entries):
            if e.backend == backend:
                if e.expires_at <= now:
                    return False
                new = IndexEntry(e.backend, e.token_count, tier, now + self._ttl)
                del m[prefix_hash]  # re-inserted at the end: a refresh
                m[prefix_hash] = (*entries[:i], new, *entries[i + 1 :])
                return True
        return False

    def drop_backend(self, backend: str) -> int:
        """``remove_backend`` without the coroutine. O(prefixes)."""
        m = self._map
        gone: list[str] = []
        shrunk: list[tuple[str, tuple[IndexEntry, ...]]] = []
        n = 0
        for k, entries in m.items():
            if len(entries) == 1:
                if entries[0].backend == backend:
                    gone.append(k)
                    n += 1
                continue
            for e in entries:
                if e.backend == backend:
                    n += 1
                    keep = tuple(x for x in entries if x.backend != backend)
                    shrunk.append((k, keep))
                    break
        for k in gone:
            del m[k]
        for k, keep in shrunk:
            m[k] = keep  # existing key: position kept
        return n

    def drop_all(self) -> int:
        """``clear`` without the coroutine."""
        n = sum(map(len, self._map.values()))
        self._map = {}
        return n

    def sweep(self) -> int:
        """``cleanup_expired`` without the coroutine: O(expired prefixes), see the header."""
        m = self._map
        now = self.clock()
        victims: list[str] = []
        n = 0
        for k, entries in m.items():
            if any(e.expires_at > now for e in entries):
                break
            victims.append(k)
            n += len(entries)
        for k in victims:
            del m[k]
        self._expired += n
        return n

    def snapshot_stats(self) -> IndexStats:
        return IndexStats(
            kind=self.kind,
            prefix_count=len(self._map),
            entry_count=sum(map(len, self._map.values())),
            total_hits=0,
            total_evictions=self._evictions,
            total_expired=self._expired,
        )

    # ---- KvIndex ----------------------------------------------------------------------

    async def query_backends(self, prefix_hash: str) -> Sequence[IndexEntry]:
        return self.lookup(prefix_hash)

    def count_per_backend(self) -> dict[str, int]:
        now = self.clock()
        counts: dict[str, int] = {}
        for _, e in self.items():
            if e.expires_at > now:
                counts[e.backend] = counts.get(e.backend, 0) + 1
        return counts

    async def backend_counts(self) -> dict[str, int]:
        return self.count_per_backend()

    async def upsert(
        self, prefix_hash: str, backend: str, token_count: int, tier: StorageTier
    ) -> None:
        self.put(prefix_hash, backend, token_count, tier)

    async def write_many(self, changes: Sequence[Change]) -> None:
        put, drop = self.put, self.drop
        for prefix_hash, backend, token_count, tier in changes:
            if tier is None:
                drop(prefix_hash, backend)
            else:
                put(prefix_hash, backend, token_count, tier)

    async def set_tier(self, prefix_hash: str, backend: str, tier: StorageTier) -> bool:
        return self.retier(prefix_hash, backend, tier)

    async def remove(self, prefix_hash: str, backend: str) -> bool:
        return self.drop(prefix_hash, backend)

    async def remove_backend(self, backend: str) -> int:
        return self.drop_backend(backend)

    async def clear(self) -> int:
        return self.drop_all()

    async def cleanup_expired(self) -> int:
        return self.sweep()

    async def stats(self) -> IndexStats:
        return self.snapshot_stats()
