"""FallbackKvIndex: Redis with an in-memory fallback, through real outages.

The healthy wrapper runs the conformance suite (``test_kvindex.py``, ``fallback``); these
tests kill, restart or pause a private Redis (``redis_server``, never the shared one) and
check what the wrapper promises: the failing operation is answered from memory, writes
during the outage reach Redis on recovery (in order, removals included, the whole fallback
when the replay log overflowed), and Redis serves again afterwards. A fake primary drives
the cases a real outage cannot time exactly. State changes are awaited, never slept for.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from redis.asyncio import Redis

from router.config.models import RedisConfig
from router.kvindex import (
    EMPTY,
    Change,
    FallbackKvIndex,
    IndexEntry,
    InMemoryKvIndex,
    InstrumentedKvIndex,
    Key,
    KvIndexUnavailable,
    RedisKvIndex,
    Restore,
    StorageTier,
)
from router.redis import build_redis
from tests.unit.kvindex_support import GPU, WARM, P, state

if TYPE_CHECKING:
    from tests.redis_fixture import RedisServer

pytest_plugins = ("tests.redis_fixture",)


async def test_redis_failure_falls_back_to_memory_and_recovers(redis_server: RedisServer) -> None:
    cfg = RedisConfig(url=redis_server.url, connect_timeout_ms=200, command_timeout_ms=500)
    client = build_redis(cfg)
    idx = FallbackKvIndex(
        RedisKvIndex(client, 600, "t:kvidx:", stats_cache_s=0), InMemoryKvIndex(1000, 600)
    )
    observer_client = build_redis(cfg)
    observer = RedisKvIndex(observer_client, 600, "t:kvidx:")
    try:
        idx.start_monitor(0.05)
        await idx.upsert(P(1), "a", 100, GPU)
        assert not idx.fallback_active

        redis_server.kill()
        # The failing query switches over and is answered from memory (empty so far).
        assert await idx.query_backends(P(1)) is EMPTY
        assert idx.fallback_active and idx.fallback_count == 1
        await idx.upsert(P(2), "b", 200, WARM)  # writes go to memory
        assert state(await idx.query_backends(P(2))) == {"b": (200, WARM)}
        assert (await idx.stats()).fallback_active
        assert await idx.try_recover() is False  # still down

        await asyncio.to_thread(redis_server.start)  # same port, empty (no persistence)
        await asyncio.wait_for(idx.wait_recovered(), 10)
        assert not idx.fallback_active
        assert len(idx.fallback) == 0
        # The outage's write was replayed: another instance sees it.
        assert state(await observer.query_backends(P(2))) == {"b": (200, WARM)}
        assert await observer.query_backends(P(1)) is EMPTY  # lost with the restart
        await idx.upsert(P(3), "c", 1, GPU)
        assert state(await observer.query_backends(P(3))) == {"c": (1, GPU)}
        assert not (await idx.stats()).fallback_active
    finally:
        for i in (idx, observer):
            await i.close()
        for c in (client, observer_client):
            await c.aclose(close_connection_pool=True)


async def test_redis_timeout_falls_back_and_replays_removals(redis_server: RedisServer) -> None:
    cfg = RedisConfig(url=redis_server.url, connect_timeout_ms=200, command_timeout_ms=100)
    client = build_redis(cfg)
    admin = Redis.from_url(redis_server.url)
    idx = FallbackKvIndex(
        RedisKvIndex(client, 600, "t:kvidx:"), InMemoryKvIndex(1000, 600), monitor_interval_s=0.05
    )
    try:
        await idx.upsert(P(1), "a", 100, GPU)
        await idx.upsert(P(1), "b", 50, GPU)
        await idx.upsert(P(3), "c", 10, GPU)
        await idx.upsert(P(4), "d", 10, GPU)
        await admin.execute_command("CLIENT", "PAUSE", 1000, "ALL")
        assert await idx.query_backends(P(1)) is EMPTY  # timed out: served from memory
        assert idx.fallback_active
        assert await idx.remove(P(1), "a") is False  # unknown to memory; replayed later
        await idx.upsert(P(2), "b", 7, WARM)
        await idx.remove_backend("c")
        await idx.upsert(P(4), "d", 11, GPU)
        await idx.remove(P(4), "d")
        await asyncio.wait_for(idx.wait_recovered(), 10)  # monitor started by the failure
        # Redis kept its data; the outage's changes were applied on top, in order.
        assert state(await idx.query_backends(P(1))) == {"b": (50, GPU)}
        assert state(await idx.query_backends(P(2))) == {"b": (7, WARM)}
        assert await idx.query_backends(P(3)) is EMPTY
        assert await idx.query_backends(P(4)) is EMPTY
    finally:
        await idx.close()
        await client.aclose(close_connection_pool=True)
        await admin.aclose()


async def test_redis_outage_larger_than_the_replay_log(redis_server: RedisServer) -> None:
    client = build_redis(RedisConfig(url=redis_server.url, connect_timeout_ms=200))
    fb = InMemoryKvIndex(100, 600)  # replay log holds 2 x 100 pairs
    idx = FallbackKvIndex(RedisKvIndex(client, 600, "t:kvidx:"), fb, monitor_interval_s=0.05)
    try:
        redis_server.kill()
        for i in range(300):
            await idx.upsert(P(i), "a", i, GPU)  # memory keeps the newest ~100 prefixes
        assert idx.fallback_active
        expected = {p: state([e]) for p, e in fb.items()}
        await asyncio.to_thread(redis_server.start)
        await asyncio.wait_for(idx.wait_recovered(), 10)
        for p, s in expected.items():
            assert state(await idx.query_backends(p)) == s
        assert (await idx.stats()).prefix_count == len(expected)
    finally:
        await idx.close()
        await client.aclose(close_connection_pool=True)


async def test_redis_write_many_falls_back_and_is_replayed(redis_server: RedisServer) -> None:
    cfg = RedisConfig(url=redis_server.url, connect_timeout_ms=200, command_timeout_ms=500)
    client, observer_client = build_redis(cfg), build_redis(cfg)
    idx = FallbackKvIndex(
        RedisKvIndex(client, 600, "wm:kvidx:", stats_cache_s=0), InMemoryKvIndex(1000, 600)
    )
    observer = RedisKvIndex(observer_client, 600, "wm:kvidx:")
    try:
        idx.start_monitor(0.05)
        await idx.write_many([(P(1), "a", 1, GPU), (P(2), "a", 2, GPU)])
        redis_server.kill()
        await idx.write_many([(P(1), "a", 0, None), (P(3), "b", 3, WARM)])  # to memory
        assert idx.fallback_active
        assert state(await idx.query_backends(P(3))) == {"b": (3, WARM)}
        await asyncio.to_thread(redis_server.start)  # same port, empty
        await asyncio.wait_for(idx.wait_recovered(), 10)
        assert state(await observer.query_backends(P(3))) == {"b": (3, WARM)}
        assert await observer.query_backends(P(1)) is EMPTY
    finally:
        for i in (idx, observer):
            await i.close()
        for c in (client, observer_client):
            await c.aclose(close_connection_pool=True)


# ---- with a fake primary: exact failure points ------------------------------------------

SLOW = 3600.0  # a monitor period no test waits for: recovery is driven by hand


class FlakyPrimary(InMemoryKvIndex):
    """Stands in for ``RedisKvIndex``: memory that raises ``KvIndexUnavailable`` while
    ``down``, with the recovery surface the wrapper uses (ping, restore, ...)."""

    kind = "redis"

    def __init__(self, write_batch: int = 256) -> None:
        super().__init__(10_000, 600)
        self.write_batch = write_batch
        self.down = False
        self.writes_before_outage: int | None = None
        """``write_many`` calls that succeed before Redis goes down (None: never)."""
        self.restore_failures = 0
        self.restored: list[Restore] = []

    def _check(self, operation: str) -> None:
        if self.down:
            raise KvIndexUnavailable(self.kind, operation, ConnectionError("down"))

    @property
    def total_expired(self) -> int:
        return self.snapshot_stats().total_expired

    def forget_counts(self) -> None:
        pass

    async def ping(self) -> None:
        self._check("ping")

    async def restore(self, items: Iterable[Restore]) -> None:
        self._check("restore")
        if self.restore_failures:
            self.restore_failures -= 1
            raise KvIndexUnavailable(self.kind, "restore", ConnectionError("down again"))
        for prefix_hash, backend, token_count, tier, ttl_left_s in items:
            self.restored.append((prefix_hash, backend, token_count, tier, ttl_left_s))
            if tier is None:
                self.drop(prefix_hash, backend)
            else:
                self.put(prefix_hash, backend, token_count, tier)

    async def query_backends(self, prefix_hash: str | bytes) -> Sequence[IndexEntry]:
        self._check("query")
        return self.lookup(prefix_hash)

    async def query_many(self, keys: Sequence[Key]) -> list[Sequence[IndexEntry]]:
        self._check("query")
        return self.lookup_many(keys)

    async def upsert(
        self,
        prefix_hash: Key,
        backend: str,
        token_count: int,
        tier: StorageTier,
        ttl: float | None = None,
    ) -> None:
        self._check("upsert")
        self.put(prefix_hash, backend, token_count, tier, ttl)

    async def write_many(self, changes: Sequence[Change], ttl: float | None = None) -> None:
        assert len(changes) <= self.write_batch  # the wrapper hands over one slice at a time
        if self.writes_before_outage is not None:
            if self.writes_before_outage == 0:
                self.down = True
            self.writes_before_outage -= 1
        self._check("write_many")
        await super().write_many(changes, ttl)

    async def remove(self, prefix_hash: str | bytes, backend: str) -> bool:
        self._check("remove")
        return self.drop(prefix_hash, backend)


def flaky(write_batch: int = 256) -> tuple[FlakyPrimary, FallbackKvIndex]:
    primary = FlakyPrimary(write_batch)
    fallback = InMemoryKvIndex(100, 600)
    idx = FallbackKvIndex(primary, fallback, monitor_interval_s=SLOW)  # type: ignore[arg-type]
    return primary, idx


async def test_write_many_falls_back_from_the_failing_slice_on() -> None:
    primary, idx = flaky(write_batch=2)
    primary.writes_before_outage = 1
    try:
        await idx.write_many([(P(i), "a", i, GPU) for i in range(5)])
        assert idx.fallback_active and idx.fallback_count == 1
        # The first slice reached "Redis"; the failing one and everything after went to memory.
        assert {p for p, _ in primary.items()} == {P(0), P(1)}
        assert {p for p, _ in idx.fallback.items()} == {P(2), P(3), P(4)}
        assert await idx.try_recover() is False  # still down: nothing replayed, nothing lost
        primary.down = False
        assert await idx.try_recover() is True
        assert not idx.fallback_active and len(idx.fallback) == 0
        assert {p: state(primary.lookup(p)) for p in map(P, range(5))} == {
            P(i): {"a": (i, GPU)} for i in range(5)
        }
        # Each restored entry keeps the lifetime it had left in memory, not a fresh TTL.
        assert sorted(r[0] for r in primary.restored) == [P(2), P(3), P(4)]
        assert all(0 < r[4] <= 600 for r in primary.restored)
    finally:
        await idx.close()


async def test_a_failed_replay_keeps_the_outage_log_for_the_next_attempt() -> None:
    primary, idx = flaky()
    try:
        await primary.upsert(P(1), "a", 1, GPU)
        await primary.upsert(P(2), "b", 2, GPU)
        primary.down = True
        assert await idx.remove(P(1), "a") is False  # unknown to memory: replayed as a delete
        await idx.upsert(P(3), "c", 3, WARM)
        assert idx.fallback_active
        primary.down = False
        primary.restore_failures = 1  # Redis answers the PING, then fails again mid-replay
        assert await idx.try_recover() is False
        assert idx.fallback_active
        assert await idx.try_recover() is True
        assert primary.lookup(P(1)) is EMPTY
        assert state(primary.lookup(P(2))) == {"b": (2, GPU)}  # untouched by the outage
        assert state(primary.lookup(P(3))) == {"c": (3, WARM)}
    finally:
        await idx.close()


# ---- hits through the whole composition ------------------------------------------------


async def test_hits_and_stats_through_an_outage(redis_server: RedisServer) -> None:
    """``InstrumentedKvIndex(FallbackKvIndex(...))`` as the router builds it: a hit counts
    whichever store answered, and the outage's stats are the fallback's."""
    cfg = RedisConfig(url=redis_server.url, connect_timeout_ms=200, command_timeout_ms=500)
    client = build_redis(cfg)
    fb = FallbackKvIndex(
        RedisKvIndex(client, 600, "hits:kvidx:", stats_cache_s=0), InMemoryKvIndex(1000, 600)
    )
    idx = InstrumentedKvIndex(fb)
    try:
        fb.start_monitor(0.05)
        await idx.upsert(P(1), "a", 1, GPU)
        assert await idx.query_backends(P(1))  # a hit served by Redis
        redis_server.kill()
        await idx.upsert(P(2), "b", 2, WARM)  # the failing write switches over
        assert fb.fallback_active
        assert await idx.query_backends(P(2))  # a hit served by memory
        assert await idx.query_backends(P(1)) is EMPTY  # known only to Redis: a miss
        assert await idx.peek(P(2))  # never counted
        st = await idx.stats()
        assert (st.kind, st.fallback_active, st.prefix_count, st.entry_count) == (
            "redis",
            True,
            1,
            1,
        )
        assert (st.total_hits, idx.queries) == (2, 3)
        await asyncio.to_thread(redis_server.start)  # same port, empty
        await asyncio.wait_for(fb.wait_recovered(), 10)
        st = await idx.stats()
        assert (st.fallback_active, st.prefix_count, st.total_hits) == (False, 1, 2)
        assert state(await idx.query_backends(P(2))) == {"b": (2, WARM)}  # replayed
    finally:
        await idx.close()
        await client.aclose(close_connection_pool=True)


async def test_query_many_and_predictions_through_an_outage() -> None:
    """query_many is answered from memory while Redis is down; predictions (writes with a
    ttl) go to memory and are replayed with the short lifetime they have left."""
    primary, idx = flaky()
    try:
        await idx.upsert(P(1), "a", 10, GPU)
        primary.down = True
        rows = await idx.query_many([P(1), P(2)])
        assert idx.fallback_active and rows == [EMPTY, EMPTY]  # Redis-only state misses
        await idx.write_many([(P(2), "b", 5, GPU), (P(3), "b", 6, GPU)], ttl=10)
        await idx.upsert(P(4), "b", 7, GPU, ttl=10)
        rows = await idx.query_many([P(2), P(3), P(4)])
        assert [state(r) for r in rows] == [{"b": (5, GPU)}, {"b": (6, GPU)}, {"b": (7, GPU)}]
        assert all(r[0].expires_at - idx.now() <= 10 for r in rows)
        primary.down = False
        assert await idx.try_recover() is True
        restored = {r[0]: r for r in primary.restored}
        assert sorted(restored) == [P(2), P(3), P(4)]
        assert all(0 < r[4] <= 10 for r in restored.values())
        rows = await idx.query_many([P(1), P(2)])
        assert [state(r) for r in rows] == [{"a": (10, GPU)}, {"b": (5, GPU)}]
    finally:
        await idx.close()


async def test_on_recovered_is_called_at_each_switch_back_and_only_then() -> None:
    """A Redis that restarted empty lost what was written before the outage; the hook is
    how the owner learns it must ask the listeners again (router.kv_runtime)."""
    primary, idx = flaky()
    calls: list[bool] = []
    idx.on_recovered = lambda: calls.append(idx.fallback_active)
    try:
        await idx.upsert(P(1), "a", 1, GPU)
        assert calls == []
        primary.down = True
        await idx.upsert(P(2), "a", 2, GPU)
        assert await idx.try_recover() is False and calls == []
        primary.down = False
        assert await idx.try_recover() is True
        assert calls == [False]  # called once, with Redis already serving
        assert await idx.try_recover() is True and calls == [False]
    finally:
        await idx.close()


async def test_a_failing_on_recovered_does_not_stop_the_switch_back() -> None:
    primary, idx = flaky()

    def boom() -> None:
        raise RuntimeError("hook failed")

    idx.on_recovered = boom
    try:
        primary.down = True
        await idx.upsert(P(1), "a", 1, GPU)
        primary.down = False
        assert await idx.try_recover() is True
        assert not idx.fallback_active
        assert state(primary.lookup(P(1))) == {"a": (1, GPU)}
    finally:
        await idx.close()
