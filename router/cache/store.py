"""The response cache's storage contract: bytes by key, with a TTL, in memory or Redis.

One small interface (:class:`CacheStore`) with backends beside it
(``memory_store.InMemoryCacheStore``, ``redis_store.RedisCacheStore``), a wrapper that keeps
Redis failures away from requests (``fallback.FallbackCacheStore``) and a factory from config
(``router.cache.build_cache_store``). Every backend passes the same conformance suite
(``tests/unit/test_cache_store.py``), so the semantics below hold for all of them.

* Keys are the caller's logical keys (the response cache's SHA-256 hex digests); a store
  adds its own namespace (Redis: ``<key_prefix><key>``). Any string is a valid key,
  including ``""``.
* Values are opaque bytes, returned exactly as stored (``b""`` included: a hit, not a miss).
* TTL: an entry is never returned ``ttl_seconds`` (a positive integer) or more after its
  last ``set``; ``None`` means the store's ``default_ttl``. Reads never refresh it.
* Idempotent: ``delete`` of a missing key and ``clear`` of an empty store change nothing.

Errors: :class:`CacheStoreError` is the root. A backend raises :class:`CacheUnavailable` when
its store cannot be used now (the retryable case: Redis down, a timeout, a read-only
replica, out of memory); other failures raise plain :class:`CacheStoreError`. The memory
backend never raises, and ``FallbackCacheStore`` turns every ``CacheStoreError`` into a miss
or a no-op, so a request never fails because the cache did. ``ValueError`` (a bad
``ttl_seconds``) is a caller's bug and always propagates.

Metrics hooks: backends take plain callables (``LatencyHook``, ``ErrorHook``,
``StateHook``) so the router's Prometheus metrics can be fed without this package
importing ``prometheus_client``. Label values come only from :data:`OPERATIONS` and
:data:`ERROR_KINDS`.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Final

__all__ = [
    "ERROR_KINDS",
    "OPERATIONS",
    "CacheStats",
    "CacheStore",
    "CacheStoreError",
    "CacheUnavailable",
    "ErrorHook",
    "LatencyHook",
    "StateHook",
    "check_ttl",
]

OPERATIONS: Final = ("get", "set", "delete", "clear", "scan", "ping")
"""``operation`` label values of the Redis latency histogram."""

ERROR_KINDS: Final = ("connection", "timeout", "other")
"""``kind`` label values of the Redis error counter (and keys of ``errors_by_kind``)."""

LatencyHook = Callable[[str, float], None]
"""``(operation, seconds)``: called once per Redis command, successful or not."""
ErrorHook = Callable[[str], None]
"""``(kind)``: called once per failed Redis command; ``kind`` is one of ERROR_KINDS."""
StateHook = Callable[[bool], None]
"""``(fallback_active)``: called on every switch to (True) and back from (False) fallback."""


class CacheStoreError(Exception):
    """Root of the cache store errors: the store failed ``operation`` (not retryable)."""

    def __init__(self, kind: str, operation: str, cause: BaseException) -> None:
        super().__init__(f"{kind} cache store failed during {operation}: {cause!r}")
        self.kind = kind
        """Backend kind: ``memory`` or ``redis``."""
        self.operation = operation
        """One of :data:`OPERATIONS`."""
        self.cause = cause
        """The client's exception."""


class CacheUnavailable(CacheStoreError):
    """The store cannot be used now (retryable): the fallback takes over."""


@dataclass(frozen=True, slots=True)
class CacheStats:
    """A point-in-time summary for the admin endpoint and metrics.

    Counters are this process's, since the store was built. Fields that do not apply to a
    backend are ``None``.
    """

    kind: str
    """``memory`` or ``redis``."""
    entries: int | None
    """Entries stored, best effort: memory counts expired ones not yet dropped; Redis
    counts keys under the prefix with SCAN (cached briefly); None if Redis is down."""
    hits: int = 0
    misses: int = 0
    sets: int = 0
    evictions: int = 0
    """Entries dropped because the memory store was full (Redis evicts on its own)."""
    expired: int = 0
    """Expired entries dropped by the memory store."""
    errors: int = 0
    """Failed store commands (Redis)."""
    errors_by_kind: Mapping[str, int] = field(default_factory=dict)
    """``errors`` split by :data:`ERROR_KINDS`."""
    size_bytes: int | None = None
    """Memory: bytes of the stored values (keys and overhead not counted)."""
    fallback_active: bool = False
    """Redis: the in-memory fallback serves (or, without one, Redis is bypassed)."""
    fallback_count: int = 0
    """Redis: switches to the fallback since start."""
    connected: bool | None = None
    """Redis: whether a PING answered while taking these stats."""
    latency_ms: float | None = None
    """Redis: that PING's round trip."""
    connections: Mapping[str, int] | None = None
    """Redis: the shared pool's ``active`` (in use) and ``idle`` connections."""


def check_ttl(ttl_seconds: int | None, default_ttl: int) -> int:
    """The TTL to apply. Raises ValueError unless it is a positive integer."""
    ttl = default_ttl if ttl_seconds is None else ttl_seconds
    if type(ttl) is int and ttl >= 1:  # the common case, one check
        return ttl
    if isinstance(ttl, int) and not isinstance(ttl, bool) and ttl >= 1:  # an int subclass
        return int(ttl)
    raise ValueError(f"ttl_seconds must be a positive integer, got {ttl!r}")


class CacheStore(abc.ABC):
    """Bytes by key with a TTL. Every method may be awaited concurrently with any other."""

    kind: str = "abstract"

    @abc.abstractmethod
    async def get(self, key: str) -> bytes | None:
        """The live value stored under ``key``, or None. Never refreshes the TTL.

        Raises:
            CacheStoreError: the backend failed (never raised by the memory store or
                ``FallbackCacheStore``).
        """

    @abc.abstractmethod
    async def set(self, key: str, value: bytes, ttl_seconds: int | None = None) -> None:
        """Store ``value`` under ``key`` for ``ttl_seconds`` (None: the store's default),
        replacing any previous value and TTL.

        Raises:
            ValueError: ``ttl_seconds`` is not a positive integer.
            CacheStoreError: the backend failed.
        """

    @abc.abstractmethod
    async def delete(self, key: str) -> bool:
        """Drop ``key``. Returns whether a value was stored (idempotent).

        Raises:
            CacheStoreError: the backend failed.
        """

    @abc.abstractmethod
    async def clear(self) -> int:
        """Drop every entry of this store's namespace (nothing outside it). Returns how many
        were dropped.

        Raises:
            CacheStoreError: the backend failed.
        """

    @abc.abstractmethod
    async def stats(self) -> CacheStats:
        """Counters and best-effort sizes. Never raises (Redis down shows in the fields)."""

    async def close(self) -> None:  # noqa: B027 - optional hook, nothing to release by default
        """Release what the store owns (never a shared Redis client). Idempotent."""
