"""Redis/Valkey response cache: one string key per entry, shared by every router instance.

Layout: ``<key_prefix><key>`` (``cr:resp:<sha256 hex>`` by default) holds the value bytes
as they were given, with a Redis TTL. Operations, one command each:

* get: ``GET``; set: ``SET key value EX ttl``; delete: ``DEL``;
* clear: ``SCAN 0 MATCH <escaped prefix>* COUNT 500``, ``UNLINK`` of every page's keys,
  until the cursor is 0, never ``KEYS`` (it blocks the server); on a Redis Cluster, on
  every primary in turn, and one ``UNLINK`` per hash slot. The prefix is glob-escaped,
  so a prefix containing ``* ? [ ] \\`` matches only itself; keys outside it are never
  touched. Keys written concurrently with a clear may survive it (SCAN semantics);
* stats: ``PING`` (every primary of a Cluster; connected, latency) and a SCAN count of the
  prefix, cached for ``stats_cache_s`` because it walks the whole keyspace.

Every operation on one entry is one command on one key, so the store works unchanged on a
Redis Cluster (``router.redis.RedisClient``: one server or a Cluster); only the keyspace
walks (clear, the entry count) go node by node (``router.redis.keyspace``).

The client comes from ``RedisPools`` (one pool shared with the KV index); this store never
closes it unless told it owns it. Timeouts are the client's: ``socket_timeout`` is the
command timeout, ``socket_connect_timeout`` the connect timeout, and the pool's one
immediate retry on a connection error absorbs the stale connections a Redis restart leaves.

Failures raise :class:`~router.cache.store.CacheUnavailable` for the errors in
``router.redis.UNAVAILABLE_ERRORS`` (connection refused or reset, timeout, read-only replica,
OOM, loading, a Cluster down or unreachable), :class:`~router.cache.store.CacheStoreError`
for any other Redis error. Wrap this store in ``FallbackCacheStore`` so that requests never
see either.

Hooks (plain callables, so this module does not import ``prometheus_client``; they must not
raise): ``observe_latency(operation, seconds)`` after every command, successful or not,
feeds ``continuum_cache_redis_latency_seconds{operation}``; ``count_error(kind)`` after every
failure feeds ``continuum_cache_redis_errors_total{kind}``.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from redis import exceptions as rx
from redis.asyncio.cluster import RedisCluster

from router.redis import UNAVAILABLE_ERRORS, RedisClient, close_client, glob_escape
from router.redis.keyspace import scan_pages, unlink

from .store import (
    ERROR_KINDS,
    CacheStats,
    CacheStore,
    CacheStoreError,
    CacheUnavailable,
    ErrorHook,
    LatencyHook,
    check_ttl,
)

__all__ = ["DEFAULT_KEY_PREFIX", "RedisCacheStore", "error_kind"]

DEFAULT_KEY_PREFIX = "cr:resp:"
_SCAN_COUNT = 500
_CAUGHT: tuple[type[BaseException], ...] = (*UNAVAILABLE_ERRORS, rx.RedisError)
_perf = time.perf_counter


def error_kind(exc: BaseException) -> str:
    """The :data:`~router.cache.store.ERROR_KINDS` label for a client exception."""
    if isinstance(exc, rx.TimeoutError | TimeoutError):
        return "timeout"
    if isinstance(exc, rx.ConnectionError | OSError | rx.RedisClusterException):
        return "connection"
    return "other"


class RedisCacheStore(CacheStore):
    """Response cache entries as Redis strings under ``key_prefix``."""

    kind = "redis"

    def __init__(
        self,
        redis: RedisClient,
        key_prefix: str = DEFAULT_KEY_PREFIX,
        *,
        default_ttl: int = 300,
        observe_latency: LatencyHook | None = None,
        count_error: ErrorHook | None = None,
        stats_cache_s: float = 10.0,
        owns_redis: bool = False,
    ) -> None:
        """
        Args:
            redis: a client (one server or a Cluster) whose pool may be shared
                (``RedisPools``), bytes responses.
            key_prefix: namespace of this store's keys; everything under it is ours.
            default_ttl: seconds, for ``set`` without a TTL.
            observe_latency: ``(operation, seconds)`` after every command.
            count_error: ``(kind)`` after every failed command.
            stats_cache_s: how long ``stats()`` reuses its SCAN count (0: never).
            owns_redis: ``close`` also closes ``redis`` (a client nobody else uses).

        Raises:
            ValueError: an empty ``key_prefix`` (``clear`` would wipe the database) or a
                bad ``default_ttl``.
        """
        if not key_prefix:
            raise ValueError("key_prefix must not be empty")
        self._redis = redis
        self.key_prefix = key_prefix
        self._match = glob_escape(key_prefix) + "*"
        self.default_ttl = check_ttl(default_ttl, 0)
        self._observe = observe_latency
        self._count_error = count_error
        self._stats_cache_s = stats_cache_s
        self._owns_redis = owns_redis
        self._entries_cache: tuple[float, int] | None = None
        self.hits = 0
        self.misses = 0
        self.sets = 0
        self.errors = 0
        self._errors_by_kind = dict.fromkeys(ERROR_KINDS, 0)

    @property
    def redis(self) -> RedisClient:
        """The client this store uses (closed by ``close`` only if ``owns_redis``)."""
        return self._redis

    def _failed(self, operation: str, exc: BaseException, t0: float) -> CacheStoreError:
        """Count and observe a failed command; the exception to raise for it."""
        if self._observe is not None:
            self._observe(operation, _perf() - t0)
        kind = error_kind(exc)
        self.errors += 1
        self._errors_by_kind[kind] += 1
        if self._count_error is not None:
            self._count_error(kind)
        if isinstance(exc, UNAVAILABLE_ERRORS):
            return CacheUnavailable(self.kind, operation, exc)
        return CacheStoreError(self.kind, operation, exc)

    # ---- CacheStore ----------------------------------------------------------------------

    async def get(self, key: str) -> bytes | None:
        t0 = _perf()
        try:
            value = await self._redis.execute_command("GET", self.key_prefix + key)
        except _CAUGHT as exc:
            raise self._failed("get", exc, t0) from exc
        if self._observe is not None:
            self._observe("get", _perf() - t0)
        if value is None:
            self.misses += 1
        else:
            self.hits += 1
        return value

    async def set(self, key: str, value: bytes, ttl_seconds: int | None = None) -> None:
        ttl = check_ttl(ttl_seconds, self.default_ttl)
        t0 = _perf()
        try:
            await self._redis.execute_command("SET", self.key_prefix + key, value, "EX", ttl)
        except _CAUGHT as exc:
            raise self._failed("set", exc, t0) from exc
        if self._observe is not None:
            self._observe("set", _perf() - t0)
        self.sets += 1

    async def delete(self, key: str) -> bool:
        t0 = _perf()
        try:
            n = await self._redis.execute_command("DEL", self.key_prefix + key)
        except _CAUGHT as exc:
            raise self._failed("delete", exc, t0) from exc
        if self._observe is not None:
            self._observe("delete", _perf() - t0)
        self._entries_cache = None
        return bool(n)

    async def delete_many(self, keys: Iterable[str]) -> int:
        """Drop several keys (``UNLINK`` in batches of 500). Returns how many existed."""
        batch = [self.key_prefix + k for k in keys]
        t0 = _perf()
        try:
            n = await unlink(self._redis, batch)
        except _CAUGHT as exc:
            raise self._failed("delete", exc, t0) from exc
        if self._observe is not None:
            self._observe("delete", _perf() - t0)
        self._entries_cache = None
        return n

    async def clear(self) -> int:
        n = 0
        t0 = _perf()
        try:
            async for keys in scan_pages(self._redis, self._match, _SCAN_COUNT):
                n += await unlink(self._redis, keys)
        except _CAUGHT as exc:
            raise self._failed("clear", exc, t0) from exc
        if self._observe is not None:
            self._observe("clear", _perf() - t0)
        self._entries_cache = None
        return n

    async def ping(self) -> float:
        """One ``PING`` (on a Cluster: to every primary); returns its round trip in seconds.

        On a Cluster, one node answering proves little: the fallback's recovery check must
        fail while any primary is away, or the store would switch back, meet the dead
        primary's slots and switch again, once per check, until the replica is promoted.

        Raises:
            CacheUnavailable | CacheStoreError: Redis (a primary) did not answer.
        """
        t0 = _perf()
        try:
            if isinstance(self._redis, RedisCluster):
                await self._redis.execute_command("PING", target_nodes=RedisCluster.PRIMARIES)
            else:
                await self._redis.execute_command("PING")
        except _CAUGHT as exc:
            raise self._failed("ping", exc, t0) from exc
        elapsed = _perf() - t0
        if self._observe is not None:
            self._observe("ping", elapsed)
        return elapsed

    async def count_entries(self) -> int:
        """Keys under the prefix, counted with SCAN (cached for ``stats_cache_s``).

        Raises:
            CacheUnavailable | CacheStoreError: Redis failed.
        """
        cached = self._entries_cache
        now = time.monotonic()
        if cached is not None and now - cached[0] < self._stats_cache_s:
            return cached[1]
        n = 0
        t0 = _perf()
        try:
            async for keys in scan_pages(self._redis, self._match, _SCAN_COUNT):
                n += len(keys)
        except _CAUGHT as exc:
            raise self._failed("scan", exc, t0) from exc
        if self._observe is not None:
            self._observe("scan", _perf() - t0)
        self._entries_cache = (now, n)
        return n

    def connections(self) -> dict[str, int]:
        """The pool's ``active`` (checked out) and ``idle`` (connected, free) connections
        (on a Cluster: summed over the nodes' pools)."""
        if isinstance(self._redis, RedisCluster):
            active = idle = 0
            for node in self._redis.get_nodes():
                free: Any = node._free
                idle += sum(1 for c in free if c.is_connected)
                active += len(node._connections) - len(free)
            return {"active": active, "idle": idle}
        pool: Any = self._redis.connection_pool
        in_use = getattr(pool, "_in_use_connections", ())
        free = getattr(pool, "_available_connections", ())
        idle = sum(1 for c in free if c is not None and getattr(c, "is_connected", True))
        return {"active": len(in_use), "idle": idle}

    def snapshot_stats(
        self,
        entries: int | None = None,
        connected: bool | None = None,
        latency_ms: float | None = None,
    ) -> CacheStats:
        """The counters, with whatever probe results the caller has (no I/O)."""
        return CacheStats(
            kind=self.kind,
            entries=entries,
            hits=self.hits,
            misses=self.misses,
            sets=self.sets,
            errors=self.errors,
            errors_by_kind=dict(self._errors_by_kind),
            connected=connected,
            latency_ms=latency_ms,
            connections=self.connections(),
        )

    async def stats(self) -> CacheStats:
        """Counters plus a PING and an entry count; Redis down shows as ``connected``
        False and ``entries`` None (never raises)."""
        try:
            latency = await self.ping()
        except CacheStoreError:
            return self.snapshot_stats(None, False, None)
        try:
            entries: int | None = await self.count_entries()
        except CacheStoreError:
            entries = None
        return self.snapshot_stats(entries, True, latency * 1000.0)

    async def close(self) -> None:
        """Close the client only if ``owns_redis`` (a shared one belongs to RedisPools).
        Idempotent."""
        if self._owns_redis:
            self._owns_redis = False
            await close_client(self._redis)
