"""The Redis KV index with an automatic in-memory fallback: routing never fails because Redis did.

``FallbackKvIndex(primary, fallback)`` serves from ``primary`` (a :class:`RedisKvIndex`)
while it works. An operation that raises :class:`KvIndexUnavailable` (a connection error,
timeout, read-only replica, OOM or loading Redis) switches the index to ``fallback`` (an
:class:`InMemoryKvIndex`) and is itself answered there: queries and writes go to memory
until Redis answers again. The switching itself (``fallback_active``, one engage per
outage, the monitor task that PINGs Redis every ``monitor_interval_s``, ``try_recover``)
is the shared :class:`~router.redis.FallbackSupervisor`, explained there. What is the KV
index's own:

* **During the outage**, Redis is not touched at all. Every write is applied to memory and
  remembered: the (prefix, backend) pairs it touched (in a log of at most twice the
  fallback's ``max_entries``, ordered by last touch, each with whether its last operation
  was a put), every ``remove_backend``, and a ``clear`` (which forgets everything logged
  before it). Writes for prefixes known only to Redis are not lost; reads of them miss
  until recovery (the scorer then routes by prefix hash alone).
* **Replay, before switching back**: the pending ``clear``, then the ``remove_backend``s,
  then the final state of every logged pair (written with the lifetime it has left if
  live in memory, deleted if its last operation was a removal, nothing if it was written
  and has since expired or been evicted), in rounds until nothing is left; writes that
  keep arriving faster than a round replays them keep the fallback active until the next
  attempt. More touched pairs than the log holds replay the whole fallback instead
  (removals not replayed are left to the TTL). Then the fallback is emptied and Redis
  serves again, with no await between the last replay round and the flag, so no write
  falls between the two stores. A Redis that restarted empty is refilled by what this
  instance saw during the outage and, afterwards, by new events; what was written before
  the outage only the listeners still know, so ``on_recovered`` (called at every switch
  back) lets the owner ask them again (``router.kv_runtime`` restarts every event stream
  from a snapshot).
* **Stats**: while Redis serves, Redis' own; during the outage the fallback's counts, with
  ``fallback_active`` set (Redis is not probed).

A replay round that fails puts back what it took out, so nothing is lost for the next
attempt (every replayed operation is idempotent). ``asyncio.CancelledError`` always
propagates.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterator, Sequence

from router.redis import FallbackSupervisor, SupervisedStore

from .base import (
    Change,
    IndexEntry,
    IndexStats,
    Key,
    KvIndex,
    KvIndexUnavailable,
    StorageTier,
    check_ttl,
)
from .memory import InMemoryKvIndex
from .redis_index import RedisKvIndex, Restore

__all__ = ["FallbackKvIndex"]

log = logging.getLogger(__name__)

_MAX_REPLAY_ROUNDS = 8


class FallbackKvIndex(SupervisedStore, KvIndex):
    """``primary`` while it works, ``fallback`` while it does not (module docstring)."""

    def __init__(
        self,
        primary: RedisKvIndex,
        fallback: InMemoryKvIndex,
        *,
        monitor_interval_s: float = 30.0,
        on_recovered: Callable[[], None] | None = None,
    ) -> None:
        """
        Args:
            primary: the Redis index; its client's timeouts bound every operation.
            fallback: serves while Redis is unusable; its ``max_entries`` sizes the replay
                log (twice as many pairs).
            monitor_interval_s: PING period while the fallback is active.
            on_recovered: called (without awaiting) when Redis serves again after an
                outage; settable later as ``on_recovered``.
        """
        self.kind = primary.kind
        self.on_recovered = on_recovered
        self._primary = primary
        self._fallback = fallback
        self._supervisor = FallbackSupervisor(
            "KV index",
            ping=primary.ping,
            replay=self._replay,
            switch_back=self._switch_back,
            unavailable=(KvIndexUnavailable,),
            interval_s=monitor_interval_s,
            logger=log,
        )
        self._dirty: dict[tuple[Key, str], bool] = {}  # (prefix, backend) -> last op was a put
        self._dirty_cap = 2 * fallback.max_entries
        self._dirty_overflow = False
        self._pending_backends: set[str] = set()
        self._pending_clear = False

    # ---- state ---------------------------------------------------------------------------

    @property
    def primary(self) -> RedisKvIndex:
        return self._primary

    @property
    def fallback(self) -> InMemoryKvIndex:
        return self._fallback

    def start_monitor(self, interval_s: float | None = None) -> None:
        """Start the task that PINGs Redis while the fallback is active and switches back
        when it answers (started by every outage anyway); ``interval_s`` replaces
        ``monitor_interval_s``. Needs a running loop."""
        self._supervisor.start_monitor(interval_s)

    # ---- fallback ------------------------------------------------------------------------

    def _engage(self, operation: str, exc: KvIndexUnavailable) -> InMemoryKvIndex:
        """Switch to the fallback (once per outage); returns it."""
        self._supervisor.engage(operation, exc.cause)
        return self._fallback

    def _mark(self, prefix_hash: Key, backend: str, put: bool) -> None:
        if self._dirty_overflow:
            return
        dirty = self._dirty
        dirty.pop((prefix_hash, backend), None)  # keep the dict ordered by last touch
        dirty[(prefix_hash, backend)] = put
        if len(dirty) > self._dirty_cap:
            # Too much to replay pair by pair: replay the whole fallback instead; removals
            # not replayed are left to the TTL.
            self._dirty = {}
            self._dirty_overflow = True

    async def _replay(self) -> bool:
        """Replay the outage's changes in rounds; False while writes keep arriving."""
        for _ in range(_MAX_REPLAY_ROUNDS):
            if not await self._replay_round():
                break
        return not (
            self._pending_clear or self._pending_backends or self._dirty or self._dirty_overflow
        )

    def _switch_back(self) -> str:
        self._fallback.drop_all()
        self._primary.forget_counts()
        if self.on_recovered is not None:
            try:
                self.on_recovered()
            except Exception:  # the switch back must happen whatever the hook does
                log.exception("KV index on_recovered callback failed")
        return "outage changes replayed"

    async def _replay_round(self) -> bool:
        """Push one round of outage changes to Redis; False when there was nothing."""
        primary, fb = self._primary, self._fallback
        did = False
        if self._pending_clear:
            self._pending_clear = False
            try:
                await primary.clear()
            except BaseException:
                self._pending_clear = True
                raise
            did = True
        while self._pending_backends:
            backend = next(iter(self._pending_backends))
            await primary.remove_backend(backend)
            self._pending_backends.discard(backend)
            did = True
        if self._dirty_overflow:
            self._dirty_overflow = False
            batch: dict[tuple[Key, str], bool] = {(p, e.backend): True for p, e in fb.items()}
        else:
            batch, self._dirty = self._dirty, {}
        if batch:
            try:
                await primary.restore(self._restores(batch))
            except BaseException:
                for pair, put in batch.items():
                    self._dirty.setdefault(pair, put)
                raise
            did = True
        return did

    def _restores(self, batch: dict[tuple[Key, str], bool]) -> Iterator[Restore]:
        """What ``batch`` means for Redis now, read from the fallback as Redis takes it."""
        fb = self._fallback
        fb_now = fb.clock()
        for (prefix_hash, backend), put in batch.items():
            e = fb.get(prefix_hash, backend)
            if e is not None:
                yield prefix_hash, backend, e.token_count, e.tier, e.expires_at - fb_now
            elif not put:
                yield prefix_hash, backend, 0, None, 0.0
            # else: written during the outage, since expired or evicted: nothing to write

    # ---- KvIndex -------------------------------------------------------------------------

    async def query_backends(self, prefix_hash: Key) -> Sequence[IndexEntry]:
        if self._supervisor.active:
            return self._fallback.lookup(prefix_hash)
        try:
            return await self._primary.query_backends(prefix_hash)
        except KvIndexUnavailable as exc:
            return self._engage("query", exc).lookup(prefix_hash)

    async def query_many(self, keys: Sequence[Key]) -> list[Sequence[IndexEntry]]:
        if self._supervisor.active:
            return self._fallback.lookup_many(keys)
        try:
            return await self._primary.query_many(keys)
        except KvIndexUnavailable as exc:
            return self._engage("query", exc).lookup_many(keys)

    def now(self) -> float:
        """The clock of the store that answers now (entries read from the other one may be
        on another clock: a caller comparing across a switch errs for one call)."""
        return self._fallback.now() if self._supervisor.active else self._primary.now()

    async def backend_counts(self) -> dict[str, int]:
        if self._supervisor.active:
            return self._fallback.count_per_backend()
        try:
            return await self._primary.backend_counts()
        except KvIndexUnavailable as exc:
            return self._engage("backend_counts", exc).count_per_backend()

    async def upsert(
        self,
        prefix_hash: Key,
        backend: str,
        token_count: int,
        tier: StorageTier,
        ttl: float | None = None,
    ) -> None:
        if token_count < 0:
            raise ValueError("token_count must be non-negative")
        check_ttl(ttl)
        if not self._supervisor.active:
            try:
                await self._primary.upsert(prefix_hash, backend, token_count, tier, ttl)
                return
            except KvIndexUnavailable as exc:
                self._engage("upsert", exc)
        self._fallback.put(prefix_hash, backend, token_count, tier, ttl)
        self._mark(prefix_hash, backend, True)

    async def write_many(self, changes: Sequence[Change], ttl: float | None = None) -> None:
        """Redis' ``write_batch`` changes at a time, so that when one call fails exactly
        the changes from it on go to memory (and the replay log)."""
        check_ttl(ttl)
        for _, _, token_count, tier in changes:
            if tier is not None and token_count < 0:
                raise ValueError("token_count must be non-negative")
        step = self._primary.write_batch
        fb = self._fallback
        for start in range(0, len(changes), step):
            part = changes[start : start + step]
            if not self._supervisor.active:
                try:
                    await self._primary.write_many(part, ttl)
                    continue
                except KvIndexUnavailable as exc:
                    self._engage("write_many", exc)
            fb.write(part, ttl)
            for prefix_hash, backend, _, tier in part:
                self._mark(prefix_hash, backend, tier is not None)

    async def set_tier(self, prefix_hash: Key, backend: str, tier: StorageTier) -> bool:
        if not self._supervisor.active:
            try:
                return await self._primary.set_tier(prefix_hash, backend, tier)
            except KvIndexUnavailable as exc:
                self._engage("set_tier", exc)
        done = self._fallback.retier(prefix_hash, backend, tier)
        if done:
            self._mark(prefix_hash, backend, True)
        return done

    async def remove(self, prefix_hash: Key, backend: str) -> bool:
        if not self._supervisor.active:
            try:
                return await self._primary.remove(prefix_hash, backend)
            except KvIndexUnavailable as exc:
                self._engage("remove", exc)
        done = self._fallback.drop(prefix_hash, backend)
        self._mark(prefix_hash, backend, False)
        return done

    async def remove_backend(self, backend: str) -> int:
        if not self._supervisor.active:
            try:
                return await self._primary.remove_backend(backend)
            except KvIndexUnavailable as exc:
                self._engage("remove_backend", exc)
        self._pending_backends.add(backend)
        return self._fallback.drop_backend(backend)

    async def begin_resync(self, backend: str) -> None:
        """On Redis, the primary's generation swap; during an outage, as ``remove_backend``
        (memory is this router's alone, and recovery resyncs every stream anyway)."""
        if not self._supervisor.active:
            try:
                await self._primary.begin_resync(backend)
                return
            except KvIndexUnavailable as exc:
                self._engage("begin_resync", exc)
        await self.remove_backend(backend)

    async def end_resync(self, backend: str) -> None:
        if not self._supervisor.active:
            try:
                await self._primary.end_resync(backend)
                return
            except KvIndexUnavailable as exc:
                self._engage("end_resync", exc)
        self._primary.discard_resync(backend)

    async def clear(self) -> int:
        if not self._supervisor.active:
            try:
                return await self._primary.clear()
            except KvIndexUnavailable as exc:
                self._engage("clear", exc)
        self._pending_clear = True
        self._pending_backends.clear()
        self._dirty = {}
        self._dirty_overflow = False
        return self._fallback.drop_all()

    async def cleanup_expired(self) -> int:
        if not self._supervisor.active:
            try:
                return await self._primary.cleanup_expired()
            except KvIndexUnavailable as exc:
                self._engage("cleanup_expired", exc)
        return self._fallback.sweep()

    async def stats(self) -> IndexStats:
        if not self._supervisor.active:
            try:
                st = await self._primary.stats()
                return dataclasses.replace(st, fallback_count=self._supervisor.count)
            except KvIndexUnavailable as exc:
                self._engage("stats", exc)
        fb = self._fallback.snapshot_stats()
        return IndexStats(
            kind=self.kind,
            prefix_count=fb.prefix_count,
            entry_count=fb.entry_count,
            total_hits=0,
            total_evictions=fb.total_evictions,
            total_expired=self._primary.total_expired + fb.total_expired,
            fallback_active=True,
            fallback_count=self._supervisor.count,
        )

    async def close(self) -> None:
        """Stop the monitor, close both indexes (a shared client stays open). Idempotent."""
        await self._supervisor.close()
        await self._primary.close()
        await self._fallback.close()
