"""The KV index contract: which backend holds which prefix, with how many tokens, in which tier.

One small storage interface (:class:`KvIndex`) with two backends beside it
(``memory.InMemoryKvIndex``, ``redis_index.RedisKvIndex``), two wrappers that add a
cross-cutting concern to any of them (``fallback.FallbackKvIndex``: Redis with a memory
fallback; ``instrumented.InstrumentedKvIndex``: the counters the router reports) and a
factory from config that composes them (``router.kvindex.build_kv_index``). Every backend
and wrapper passes the same conformance suite (``tests/unit/test_kvindex.py``), so the
semantics below hold for all of them.

Model::

    key -> {backend -> (token_count, tier, expires_at)}

* A key (:data:`Key`) is a prefix hash (the prefix index: 64 hex characters of a
  ``bus.prefix_key`` digest) or a 16-byte ``bus.prompt_chain`` key (the chain index, a
  second instance of the same classes). A *prefix entry* is one key; an *entry* is one
  (key, backend) pair. ``max_entries`` limits prefix entries; every count returned by a
  mutation counts entries.
* ``query_backends`` returns the live entries sorted by ``token_count`` descending, ties
  broken by backend name descending (Redis' ``ZREVRANGEBYSCORE`` order). An empty result is
  always the shared :data:`EMPTY` tuple, so a miss allocates nothing. ``query_many`` is the
  same for many keys at once (one Redis round trip), e.g. every key of a prompt chain.
* TTL: an entry expires ``ttl_seconds`` after its last event. ``upsert`` and ``set_tier``
  are events and refresh it; ``query_backends`` is not and never does. Expired entries are
  never returned; they are dropped lazily and by ``cleanup_expired``.
* Per-entry TTL (predictions): ``upsert``/``write_many`` with ``ttl`` write entries that
  expire ``ttl`` from now instead (at most ``ttl_seconds``), and such a write never
  shortens a live entry: where the backend's entry already expires later, it is left
  exactly as it is. So a prediction can extend, never cut, what an event wrote.
* Tiers: ``GPU_HOT`` (blocks on the accelerator) and ``STORAGE_WARM`` (blocks only in a
  slower tier: CPU, disk, remote). Which events move an entry between them is decided in
  ``router.kvindex.apply``, not here.
* Idempotent: ``upsert`` with the same arguments, ``remove`` of an absent entry,
  ``remove_backend`` of an unknown backend and ``clear`` of an empty index change nothing.
* ``expires_at`` is in the index's own clock: the memory index's injected clock (monotonic
  by default), Unix time for Redis.

Concurrency: backends are used from one asyncio loop. The memory index never awaits inside
a mutation, so every call is atomic on the loop; Redis makes each call one atomic
transaction (MULTI/EXEC or a script), so concurrent calls from several router instances
never leave a half-written entry.
"""

from __future__ import annotations

import abc
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Final

__all__ = [
    "EMPTY",
    "Change",
    "IndexEntry",
    "IndexStats",
    "Key",
    "KvIndex",
    "KvIndexError",
    "KvIndexUnavailable",
    "StorageTier",
    "check_ttl",
]


class StorageTier(StrEnum):
    """Where a backend keeps a prefix's KV blocks."""

    GPU_HOT = "gpu_hot"
    """On the accelerator: a request reuses them at once."""
    STORAGE_WARM = "storage_warm"
    """Offloaded only (CPU memory, local disk, remote store): reusable after a reload."""


Key = str | bytes
"""An index key: a prefix hash (``str``, 64 hex) or a chain key (``bytes``, 16; Redis
names it by its 32 hex characters). One index holds one kind."""

Change = tuple[Key, str, int, "StorageTier | None"]
"""``(key, backend, token_count, tier)``: an upsert, or with tier None a remove
(``token_count`` is then ignored). See :meth:`KvIndex.write_many`."""


class IndexEntry:
    """One (prefix, backend) entry as returned by :meth:`KvIndex.query_backends`.

    Read-only by contract: the memory index returns its stored objects without copying.
    """

    __slots__ = ("backend", "expires_at", "tier", "token_count")

    backend: str
    token_count: int
    tier: StorageTier
    expires_at: float

    def __init__(
        self, backend: str, token_count: int, tier: StorageTier, expires_at: float
    ) -> None:
        self.backend = backend
        self.token_count = token_count
        self.tier = tier
        self.expires_at = expires_at

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, IndexEntry):
            return NotImplemented
        return (
            self.backend == other.backend
            and self.token_count == other.token_count
            and self.tier is other.tier
            and self.expires_at == other.expires_at
        )

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return (
            f"IndexEntry({self.backend!r}, {self.token_count}, {self.tier.name}, "
            f"expires_at={self.expires_at:.3f})"
        )


EMPTY: Final[tuple[IndexEntry, ...]] = ()
"""The one empty query result; ``query_backends`` returns it (identity) on every miss."""


def check_ttl(ttl: float | None) -> None:
    """Raise ``ValueError`` unless ``ttl`` is None or a positive finite number of seconds."""
    if ttl is not None and not (ttl > 0 and math.isfinite(ttl)):
        raise ValueError(f"ttl must be a positive number of seconds, got {ttl!r}")


@dataclass(frozen=True, slots=True)
class IndexStats:
    """A point-in-time summary for admin endpoints and metrics."""

    kind: str
    """``memory`` or ``redis``."""
    prefix_count: int
    """Prefix entries stored (Redis: counted with SCAN and cached briefly)."""
    entry_count: int
    """(prefix, backend) entries stored; may include expired ones not yet swept."""
    total_hits: int
    """Queries, since start, that returned at least one entry (this process only).
    Counted by :class:`~router.kvindex.instrumented.InstrumentedKvIndex`; 0 from a bare
    backend, which counts no queries."""
    total_evictions: int
    """Entries dropped because the index was full (this process only)."""
    total_expired: int
    """Expired entries dropped by lazy checks or ``cleanup_expired`` (this process only)."""
    fallback_active: bool = False
    """Redis only: the counts above are the in-memory fallback's."""
    fallback_count: int = 0
    """Redis only: switches to the in-memory fallback since start (outages)."""


class KvIndexError(Exception):
    """Root of the KV index errors."""


class KvIndexUnavailable(KvIndexError):
    """The store could not be reached (Redis: an error in ``router.redis.UNAVAILABLE_ERRORS``).

    :class:`~router.kvindex.fallback.FallbackKvIndex` answers from memory instead; without
    it the caller sees this error."""

    def __init__(self, kind: str, operation: str, cause: BaseException) -> None:
        super().__init__(f"{kind} KV index unavailable during {operation}: {cause!r}")
        self.kind = kind
        self.operation = operation
        self.cause = cause


class KvIndex(abc.ABC):
    """prefix_hash -> {backend -> (token_count, tier)}, with a TTL per entry.

    Every method may be awaited concurrently with any other. Counts returned by mutations
    are (prefix, backend) entries.
    """

    kind: str = "abstract"

    @abc.abstractmethod
    async def query_backends(self, prefix_hash: Key) -> Sequence[IndexEntry]:
        """Live entries for ``prefix_hash``, ``token_count`` descending (ties: backend
        name descending). Returns :data:`EMPTY` itself when there are none. Never
        refreshes a TTL."""

    async def query_many(self, keys: Sequence[Key]) -> list[Sequence[IndexEntry]]:
        """``query_backends`` of each key, in order, as one query: one Redis round trip,
        counted as one routing query (a hit when any key has an entry). Misses are
        :data:`EMPTY`. Never refreshes a TTL. This default makes one call each."""
        return [await self.query_backends(k) for k in keys]

    async def peek(self, prefix_hash: Key) -> Sequence[IndexEntry]:
        """``query_backends`` for operators' tools: not counted as a routing query or hit
        (a wrapper that counts queries forwards this uncounted)."""
        return await self.query_backends(prefix_hash)

    async def peek_many(self, keys: Sequence[Key]) -> list[Sequence[IndexEntry]]:
        """``query_many`` uncounted, like :meth:`peek`."""
        return await self.query_many(keys)

    def now(self) -> float:
        """The index's clock now: the one ``IndexEntry.expires_at`` is on (so a caller can
        tell how long an entry it read has left)."""
        return time.time()

    async def backend_counts(self) -> dict[str, int]:
        """Live entries per backend. Admin-only: may scan the whole index."""
        return {}

    @abc.abstractmethod
    async def upsert(
        self,
        prefix_hash: Key,
        backend: str,
        token_count: int,
        tier: StorageTier,
        ttl: float | None = None,
    ) -> None:
        """Create or replace the entry; its TTL restarts. Idempotent.

        With ``ttl`` (seconds, > 0; more than ``ttl_seconds`` counts as ``ttl_seconds``)
        the entry expires ``ttl`` from now, unless the backend's live entry already expires
        later: then nothing changes (a prediction never shortens an entry).

        Raises:
            ValueError: ``token_count`` is negative, or ``ttl`` is not positive.
        """

    async def write_many(self, changes: Sequence[Change], ttl: float | None = None) -> None:
        """Apply ``changes`` in order, each as ``upsert`` (a tier, with this ``ttl``) or
        ``remove`` (None) would. The consumer hands a chunk of events over at once; a
        backend with a cost per call (a Redis round trip) does them together. This
        default makes one call each.

        Not atomic as a whole. If it raises, any prefix of ``changes`` may have been
        applied; applying them again is harmless (both operations are idempotent).

        Raises:
            ValueError: a negative ``token_count`` (nothing after it is applied), or a
                ``ttl`` that is not positive (nothing is applied).
        """
        check_ttl(ttl)
        for prefix_hash, backend, token_count, tier in changes:
            if tier is None:
                await self.remove(prefix_hash, backend)
            else:
                await self.upsert(prefix_hash, backend, token_count, tier, ttl)

    @abc.abstractmethod
    async def set_tier(self, prefix_hash: Key, backend: str, tier: StorageTier) -> bool:
        """Move an existing live entry to ``tier``, keeping its ``token_count``; its TTL
        restarts. Returns False (and creates nothing) if there is no live entry."""

    @abc.abstractmethod
    async def remove(self, prefix_hash: Key, backend: str) -> bool:
        """Drop one entry. Returns whether a live entry was removed."""

    @abc.abstractmethod
    async def remove_backend(self, backend: str) -> int:
        """Drop every entry of ``backend`` (engine cleared its cache, or a resync).

        Returns the number of entries removed. O(prefixes): meant for rare events."""

    async def begin_resync(self, backend: str) -> None:
        """A snapshot of ``backend`` follows that replaces all its entries; its writes
        until :meth:`end_resync` build the new state. By default the old state is dropped
        now (an index only this router reads); a shared index keeps serving the old state
        to every reader until ``end_resync`` swaps the new one in."""
        await self.remove_backend(backend)

    async def end_resync(self, backend: str) -> None:  # noqa: B027 - optional hook
        """The snapshot begun by :meth:`begin_resync` is complete (a no-op by default)."""

    @abc.abstractmethod
    async def clear(self) -> int:
        """Drop everything. Returns the number of entries removed."""

    @abc.abstractmethod
    async def cleanup_expired(self) -> int:
        """Proactively drop expired entries (queries already hide them).

        Returns the number of entries removed by this call. Bounded work per call; an
        expired entry is removed by some later call at the latest."""

    @abc.abstractmethod
    async def stats(self) -> IndexStats:
        """Counts for admin endpoints. May be slow (Redis scans); never on the hot path."""

    async def close(self) -> None:  # noqa: B027 - optional hook, a no-op by default
        """Release background tasks. Idempotent. Shared connections are not closed."""
