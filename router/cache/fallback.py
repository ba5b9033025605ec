"""Redis with an automatic in-memory fallback: a request never fails because Redis did.

The switching itself (``fallback_active``, one engage per outage, the monitor task that
PINGs Redis every ``monitor_interval_s``, ``try_recover``, ``on_state_change`` on every
switch) is the shared :class:`~router.redis.FallbackSupervisor`, explained
there. What is the response cache's own:

* **What switches**: an operation that raises ``CacheUnavailable`` (connection refused or
  reset, the client's command or connect timeout, read-only replica, OOM, loading) engages
  the fallback and is itself answered there. Any other ``CacheStoreError`` is a miss (get),
  a no-op (set) or False (delete) for that one operation and switches nothing; during a
  recovery attempt any ``CacheStoreError`` means Redis is still down.
* **During the outage**: reads and writes go to the ``InMemoryCacheStore`` only (entries
  live at most its ``default_ttl``, the ``fallback_ttl_seconds``), or, without one, every
  get misses and every write is dropped; Redis is not touched at all, so a Redis that hangs
  costs one timeout, not one per request.
* **Replay, before switching back**: a ``clear`` made during the outage is applied to
  Redis; the switch back then empties the memory fallback, with no ``await`` between the
  applied clear and the flag, so nothing lands between the two stores.
* **After switching back** (the monitor's ``settle``): the keys deleted during the outage
  (Redis may still hold them) are deleted from Redis in the background, in batches, and
  until a key's delete has reached Redis a ``get`` of it is a miss without asking Redis,
  so an invalidated entry is never served again. (Applying them before the switch could
  livelock: deletes may keep arriving faster than they are applied.) A ``set`` of such a
  key wins over the pending delete, which may still drop the new value: a miss, never
  stale data. More than ``max_pending_deletes`` deletes during one outage turn into one
  ``clear`` of the prefix on recovery (a cache may always forget more than asked).
* **Not replayed**: writes made during the outage are not copied to Redis: they are cache
  fills, and losing one costs a miss; keeping them in memory would let them go stale
  behind a later invalidation made in Redis by another instance.

Validation (``ValueError`` for a bad TTL) happens before anything else and propagates; it
is a caller's bug, not a Redis failure. ``asyncio.CancelledError`` always propagates.
"""

from __future__ import annotations

import itertools
import logging

from router.redis import FallbackSupervisor, SupervisedStore

from .memory_store import InMemoryCacheStore
from .redis_store import RedisCacheStore
from .store import CacheStats, CacheStore, CacheStoreError, CacheUnavailable, StateHook, check_ttl

__all__ = ["FallbackCacheStore"]

log = logging.getLogger(__name__)

_MAX_CLEAR_ROUNDS = 8
_DRAIN_BATCH = 500


class FallbackCacheStore(SupervisedStore, CacheStore):
    """``primary`` while it works, ``fallback`` (or nothing) while it does not."""

    kind = "redis"

    def __init__(
        self,
        primary: RedisCacheStore,
        fallback: InMemoryCacheStore | None,
        *,
        monitor_interval_s: float = 30.0,
        on_state_change: StateHook | None = None,
        max_pending_deletes: int = 10_000,
    ) -> None:
        """
        Args:
            primary: the Redis store; its client's timeouts bound every operation.
            fallback: serves while Redis is unusable; None makes those operations misses
                and no-ops instead.
            monitor_interval_s: PING period while the fallback is active.
            on_state_change: ``(fallback_active)`` on every switch (must not block).
            max_pending_deletes: deletes remembered during an outage before they turn into
                one ``clear`` on recovery.
        """
        self._primary = primary
        self._fallback = fallback
        self._max_pending = max_pending_deletes
        self._supervisor = FallbackSupervisor(
            "response cache",
            ping=primary.ping,
            replay=self._replay,
            switch_back=self._switch_back,
            unavailable=(CacheStoreError,),
            interval_s=monitor_interval_s,
            settle=self._drain_deletes,
            on_state_change=on_state_change,
            serving="serving from memory" if fallback is not None else "caching nothing",
            logger=log,
        )
        self._pending_deletes: dict[str, None] = {}  # insertion-ordered set
        self._pending_clear = False
        self._unanswered_misses = 0  # gets answered by neither store

    # ---- state ---------------------------------------------------------------------------

    @property
    def primary(self) -> RedisCacheStore:
        return self._primary

    @property
    def fallback(self) -> InMemoryCacheStore | None:
        return self._fallback

    @property
    def default_ttl(self) -> int:
        return self._primary.default_ttl

    # ---- fallback ------------------------------------------------------------------------

    def _engage(self, operation: str, exc: CacheUnavailable) -> None:
        self._supervisor.engage(operation, exc.cause)

    async def _replay(self) -> bool:
        """Apply the outage's ``clear`` to Redis; False while clears keep arriving."""
        for _ in range(_MAX_CLEAR_ROUNDS):
            if not self._pending_clear:
                break
            self._pending_clear = False
            try:
                await self._primary.clear()
            except BaseException:
                self._pending_clear = True
                raise
        return not self._pending_clear

    def _switch_back(self) -> str:
        if self._fallback is not None:
            self._fallback.drop_all()
        return f"{len(self._pending_deletes)} outage deletes to apply"

    async def _drain_deletes(self) -> bool:
        """Delete one batch of the outage's deleted keys from Redis; each stays masked (a
        miss on ``get``) until its delete has succeeded. False when none was left."""
        batch = list(itertools.islice(self._pending_deletes, _DRAIN_BATCH))
        if not batch:
            return False
        try:
            await self._primary.delete_many(batch)
        except CacheUnavailable as exc:
            self._engage("delete", exc)
            return True
        except CacheStoreError as exc:
            log.warning("response cache: dropping %d outage deletes: %r", len(batch), exc.cause)
        for key in batch:
            self._pending_deletes.pop(key, None)
        return True

    def _remember_delete(self, key: str) -> None:
        if self._pending_clear:
            return  # the clear covers it
        self._pending_deletes[key] = None
        if len(self._pending_deletes) > self._max_pending:
            log.warning(
                "more than %d response cache deletes during the Redis outage: "
                "the whole prefix will be cleared on recovery",
                self._max_pending,
            )
            self._pending_deletes = {}
            self._pending_clear = True

    # ---- CacheStore ----------------------------------------------------------------------

    async def get(self, key: str) -> bytes | None:
        if not self._supervisor.active:
            if self._pending_deletes and key in self._pending_deletes:
                self._unanswered_misses += 1  # deleted during the outage, maybe not in Redis yet
                return None
            try:
                return await self._primary.get(key)
            except CacheUnavailable as exc:
                self._engage("get", exc)
            except CacheStoreError:
                self._unanswered_misses += 1
                return None
        fb = self._fallback
        if fb is None:
            self._unanswered_misses += 1
            return None
        return fb.lookup(key)

    async def set(self, key: str, value: bytes, ttl_seconds: int | None = None) -> None:
        ttl = check_ttl(ttl_seconds, self._primary.default_ttl)
        if not self._supervisor.active:
            if self._pending_deletes:
                self._pending_deletes.pop(key, None)  # the new value wins over the delete
            try:
                await self._primary.set(key, value, ttl)
                return
            except CacheUnavailable as exc:
                self._engage("set", exc)
            except CacheStoreError:
                return
        fb = self._fallback
        if fb is not None:
            fb.put(key, value, min(ttl, fb.default_ttl))

    async def delete(self, key: str) -> bool:
        if not self._supervisor.active:
            try:
                return await self._primary.delete(key)
            except CacheUnavailable as exc:
                self._engage("delete", exc)
            except CacheStoreError as exc:
                log.warning("response cache delete of %s failed: %r", key, exc.cause)
                return False
        self._remember_delete(key)
        fb = self._fallback
        return fb.drop(key) if fb is not None else False

    async def clear(self) -> int:
        """Redis: keys dropped under the prefix. Fallback: memory entries dropped (Redis is
        cleared on recovery)."""
        if not self._supervisor.active:
            try:
                return await self._primary.clear()
            except CacheUnavailable as exc:
                self._engage("clear", exc)
            except CacheStoreError as exc:
                log.warning("response cache clear failed: %r", exc.cause)
                return 0
        self._pending_clear = True
        self._pending_deletes = {}
        fb = self._fallback
        return fb.drop_all() if fb is not None else 0

    async def stats(self) -> CacheStats:
        """Both stores' counters summed. ``entries`` is Redis' count while Redis serves,
        the memory fallback's while it serves; Redis is not probed during an outage."""
        active = self._supervisor.active
        if active:
            p = self._primary.snapshot_stats(None, False, None)
        else:
            p = await self._primary.stats()
        fb = self._fallback
        f = fb.snapshot_stats() if fb is not None else None
        if active:
            entries: int | None = f.entries if f is not None else 0
        else:
            entries = p.entries
        return CacheStats(
            kind=self.kind,
            entries=entries,
            hits=p.hits + (f.hits if f else 0),
            misses=p.misses + (f.misses if f else 0) + self._unanswered_misses,
            sets=p.sets + (f.sets if f else 0),
            evictions=f.evictions if f else 0,
            expired=f.expired if f else 0,
            errors=p.errors,
            errors_by_kind=p.errors_by_kind,
            size_bytes=f.size_bytes if f and active else None,
            fallback_active=active,
            fallback_count=self._supervisor.count,
            connected=p.connected,
            latency_ms=p.latency_ms,
            connections=p.connections,
        )

    async def close(self) -> None:
        """Stop the monitor, close both stores (the shared client stays open). Idempotent."""
        await self._supervisor.close()
        await self._primary.close()
        if self._fallback is not None:
            await self._fallback.close()
