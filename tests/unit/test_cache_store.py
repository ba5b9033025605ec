"""Response cache stores: one conformance suite run against every backend, then specifics.

``harness`` is parametrised over ``memory``, ``redis`` (a bare ``RedisCacheStore``) and
``redis+fallback`` (what ``build_cache_store`` returns for ``backend: redis``); every test
taking it runs on all three and asserts the same observable behaviour. Redis stores use a
key prefix of their own (parallel runs never collide) whose keys are deleted afterwards.
Tests that kill or pause Redis use a private server (``redis_server``), never the shared
one; they await state changes by polling with a deadline, never by sleeping a fixed time.
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import pytest
from redis.asyncio import Redis

from router.cache import (
    ERROR_KINDS,
    OPERATIONS,
    CacheStore,
    CacheStoreError,
    CacheUnavailable,
    FallbackCacheStore,
    InMemoryCacheStore,
    RedisCacheStore,
    build_cache_store,
)
from router.config.models import KvCacheIndexConfig, RedisConfig
from router.kvindex import FallbackKvIndex, build_kv_index
from router.redis import RedisPools, glob_escape
from tests import waiting

if TYPE_CHECKING:
    from tests.redis_fixture import RedisServer

pytest_plugins = ("tests.redis_fixture",)

MIB = 1 << 20


def K(i: int) -> str:
    """A logical key (64 hex characters, like the response cache's SHA-256 keys)."""
    return f"{i:064x}"


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


async def eventually(predicate: Callable[[], object], within: float = 10.0) -> None:
    await waiting.eventually(predicate, within, 0.02)


async def delete_prefix(client: Redis, key_prefix: str) -> None:
    keys = [k async for k in client.scan_iter(match=glob_escape(key_prefix) + "*", count=500)]
    if keys:
        await client.unlink(*keys)


def unique_prefix() -> str:
    return f"test:{uuid.uuid4().hex[:12]}:resp:"


@dataclass
class Harness:
    kind: str
    make: Callable[..., CacheStore]
    clock: FakeClock = field(default_factory=FakeClock)
    client: Redis | None = None
    stores: list[CacheStore] = field(default_factory=list)

    async def expire(self, store: CacheStore, key: str, ttl: int) -> None:
        """Let ``key`` (set with ``ttl``) expire: advance the fake clock, or poll Redis."""
        if self.kind == "memory":
            self.clock.advance(ttl)
            assert await store.get(key) is None
            return

        async def gone() -> bool:
            return await store.get(key) is None

        await eventually(gone, within=ttl + 3.0)


@pytest.fixture(params=["memory", "redis", "redis+fallback"])
async def harness(request: pytest.FixtureRequest) -> AsyncIterator[Harness]:
    """``make(capacity=10_000, default_ttl=600)`` builds a fresh, empty store."""
    if request.param == "memory":

        def make_memory(capacity: int = 10_000, default_ttl: int = 600) -> CacheStore:
            return InMemoryCacheStore(capacity, default_ttl, clock=h.clock)

        h = Harness("memory", make_memory)
        yield h
        return

    url = request.getfixturevalue("redis_url")
    pools = RedisPools()
    cfg = RedisConfig(url=url, pool_size=16)
    client = pools.get(cfg)
    prefixes: list[str] = []

    def make_redis(capacity: int = 10_000, default_ttl: int = 600) -> CacheStore:
        kp = unique_prefix()
        prefixes.append(kp)
        store: CacheStore
        if request.param == "redis":
            store = RedisCacheStore(client, kp, default_ttl=default_ttl, stats_cache_s=0)
        else:
            store = build_cache_store(
                "redis",
                capacity,
                default_ttl,
                cfg.model_copy(update={"key_prefix": kp}),
                pools,
                stats_cache_s=0,
            )
        h.stores.append(store)
        return store

    h = Harness(request.param, make_redis, client=client)
    try:
        yield h
    finally:
        for store in h.stores:
            await store.close()
        for kp in prefixes:
            await delete_prefix(client, kp)
        await pools.aclose()


# ---- conformance: every backend ------------------------------------------------------


async def test_set_get_delete(harness: Harness) -> None:
    store = harness.make()
    await store.set(K(1), b"one", 60)
    await store.set(K(2), b"two", 60)
    assert await store.get(K(1)) == b"one"
    assert await store.get(K(2)) == b"two"
    await store.set(K(1), b"uno", 60)  # replaces
    assert await store.get(K(1)) == b"uno"
    assert await store.delete(K(1)) is True
    assert await store.get(K(1)) is None
    assert await store.delete(K(1)) is False  # idempotent
    assert await store.get(K(2)) == b"two"


async def test_missing_key_and_empty_inputs(harness: Harness) -> None:
    store = harness.make()
    assert await store.get(K(404)) is None
    assert await store.delete(K(404)) is False
    assert await store.clear() == 0  # empty store
    assert await store.clear() == 0
    await store.set("", b"empty key", 60)
    assert await store.get("") == b"empty key"
    await store.set(K(1), b"", 60)  # an empty value is a hit, not a miss
    assert await store.get(K(1)) == b""
    assert await store.delete("") is True
    assert await store.get("") is None


async def test_binary_values_round_trip_exactly(harness: Harness) -> None:
    store = harness.make()
    rng = random.Random(7)
    values = {
        K(1): bytes(range(256)),
        K(2): b"\x00" * 1000,
        K(3): b"\r\n$-1\r\n*3\r\n",  # RESP framing inside a value
        K(4): "réponse ✓ 応答".encode(),
        K(5): rng.randbytes(MIB),
        K(6): rng.randbytes(MIB + 13),
    }
    for k, v in values.items():
        await store.set(k, v, 60)
    for k, v in values.items():
        got = await store.get(k)
        assert type(got) is bytes and got == v


async def test_ttl_expiry(harness: Harness) -> None:
    store = harness.make()
    await store.set(K(1), b"short", 1)
    await store.set(K(2), b"long", 600)
    assert await store.get(K(1)) == b"short"
    await harness.expire(store, K(1), 1)
    assert await store.get(K(1)) is None
    assert await store.delete(K(1)) is False  # expired is gone
    assert await store.get(K(2)) == b"long"
    await store.set(K(1), b"again", 600)  # a new set after expiry works
    assert await store.get(K(1)) == b"again"


async def test_set_resets_ttl(harness: Harness) -> None:
    store = harness.make()
    await store.set(K(1), b"v1", 1)
    await store.set(K(1), b"v2", 600)  # the second set's TTL wins
    if harness.kind == "memory":
        harness.clock.advance(2)
    else:
        assert harness.client is not None
        pttl = await harness.client.pttl(_redis_key(store, K(1)))
        assert 590_000 < pttl <= 600_000
    assert await store.get(K(1)) == b"v2"


async def test_default_ttl_and_bad_ttls(harness: Harness) -> None:
    store = harness.make(default_ttl=30)
    await store.set(K(1), b"v")  # default TTL
    if harness.kind == "memory":
        harness.clock.advance(29)
        assert await store.get(K(1)) == b"v"
        harness.clock.advance(1)
        assert await store.get(K(1)) is None
    else:
        assert harness.client is not None
        assert 29_000 < await harness.client.pttl(_redis_key(store, K(1))) <= 30_000
    for bad in (0, -1, 1.5, "60", True):
        with pytest.raises(ValueError, match="ttl_seconds"):
            await store.set(K(2), b"v", bad)  # type: ignore[arg-type]
    assert await store.get(K(2)) is None


async def test_clear_counts_and_empties(harness: Harness) -> None:
    store = harness.make()
    for i in range(1200):  # more than one SCAN page / UNLINK batch
        await store.set(K(i), b"x", 60)
    assert await store.clear() == 1200
    assert await store.get(K(0)) is None and await store.get(K(1199)) is None
    assert await store.clear() == 0
    await store.set(K(1), b"after", 60)
    assert await store.get(K(1)) == b"after"


async def test_concurrent_operations(harness: Harness) -> None:
    store = harness.make()

    async def worker(i: int) -> None:
        k, v = K(i), f"value-{i}".encode() * (1 + i % 7)
        await store.set(k, v, 60)
        assert await store.get(k) == v
        assert await store.delete(k) is True
        assert await store.get(k) is None
        await store.set(k, v, 60)

    await asyncio.gather(*(worker(i) for i in range(300)))
    got = await asyncio.gather(*(store.get(K(i)) for i in range(300)))
    assert got == [f"value-{i}".encode() * (1 + i % 7) for i in range(300)]

    # Contention on one key: readers see nothing or one complete written value.
    written = [bytes([i]) * 4096 for i in range(64)]
    ops: list[Awaitable[object]] = []
    for i, v in enumerate(written):
        ops.append(store.set("hot", v, 60))
        ops.append(store.get("hot"))
        if i % 8 == 0:
            ops.append(store.delete("hot"))
    results = await asyncio.gather(*ops)
    for r in results:
        assert r is None or isinstance(r, bool) or r in written
    assert await store.get("hot") in (None, *written)

    # Concurrent clears and writes never raise; a clear leaves the store usable.
    await asyncio.gather(store.clear(), *(store.set(K(i), b"x", 60) for i in range(50)))
    await asyncio.gather(store.clear(), store.clear())
    assert await store.get(K(0)) is None


async def test_stats_counters(harness: Harness) -> None:
    store = harness.make()
    s = await store.stats()
    assert (s.entries, s.hits, s.misses, s.sets, s.errors) == (0, 0, 0, 0, 0)
    assert not s.fallback_active
    await store.set(K(1), b"a" * 10, 60)
    await store.set(K(2), b"b" * 20, 60)
    assert await store.get(K(1)) == b"a" * 10
    assert await store.get(K(3)) is None
    s = await store.stats()
    assert s.kind == ("memory" if harness.kind == "memory" else "redis")
    assert (s.entries, s.hits, s.misses, s.sets, s.errors) == (2, 1, 1, 2, 0)
    assert s.evictions == 0 and not s.fallback_active
    await store.delete(K(1))
    assert (await store.stats()).entries == 1
    await store.clear()
    assert (await store.stats()).entries == 0
    if harness.kind == "memory":
        assert s.size_bytes == 30 and s.connected is None
    else:
        assert s.connected is True and s.latency_ms is not None and s.latency_ms >= 0
        assert s.errors_by_kind == dict.fromkeys(ERROR_KINDS, 0)
        assert s.connections is not None and set(s.connections) == {"active", "idle"}


def _redis_key(store: CacheStore, key: str) -> str:
    primary = store.primary if isinstance(store, FallbackCacheStore) else store
    assert isinstance(primary, RedisCacheStore)
    return primary.key_prefix + key


# ---- memory specifics ----------------------------------------------------------------


async def test_memory_lru_eviction_by_capacity() -> None:
    store = InMemoryCacheStore(3, 600)
    for k in "abc":
        await store.set(k, k.encode(), 60)
    assert await store.get("a") == b"a"  # a is now the most recently used
    await store.set("d", b"d", 60)  # evicts b, the least recently used
    assert await store.get("b") is None
    assert [await store.get(k) for k in "acd"] == [b"a", b"c", b"d"]
    await store.set("c", b"C", 60)  # a replace moves c to the end, evicts nothing
    await store.set("e", b"e", 60)  # evicts a (order now: a d c)
    assert len(store) == 3 and "a" not in store
    s = await store.stats()
    assert (s.entries, s.evictions, s.size_bytes) == (3, 2, 3)


async def test_memory_reads_never_refresh_ttl_and_expired_victims_count_as_expired() -> None:
    clock = FakeClock()
    store = InMemoryCacheStore(2, 600, clock=clock)
    await store.set("a", b"a", 10)
    clock.advance(6)
    assert await store.get("a") == b"a"
    clock.advance(4)
    assert await store.get("a") is None  # expired at exactly ttl after the set
    await store.set("x", b"x", 1)
    await store.set("y", b"y", 60)
    clock.advance(2)
    await store.set("z", b"z", 60)  # full: drops x, already expired
    s = await store.stats()
    assert (s.evictions, s.expired, s.entries) == (0, 2, 2)
    assert await store.clear() == 2


async def test_memory_copies_mutable_values() -> None:
    store = InMemoryCacheStore(10, 600)
    buf = bytearray(b"abc")
    await store.set("k", buf, 60)  # type: ignore[arg-type]
    buf[0] = ord("X")
    assert await store.get("k") == b"abc"


def test_memory_rejects_bad_config() -> None:
    with pytest.raises(ValueError):
        InMemoryCacheStore(0, 600)
    with pytest.raises(ValueError):
        InMemoryCacheStore(10, 0)


# ---- Redis specifics -----------------------------------------------------------------


@pytest.fixture
async def client(redis_url: str) -> AsyncIterator[Redis]:
    pools = RedisPools()
    try:
        yield pools.get(RedisConfig(url=redis_url))
    finally:
        await pools.aclose()


async def test_redis_keys_are_exactly_prefix_plus_key(client: Redis) -> None:
    kp = unique_prefix()
    store = RedisCacheStore(client, kp)
    try:
        await store.set(K(1), b"v", 120)
        # A set: SCAN may return one key twice (while the keyspace rehashes).
        assert {k async for k in client.scan_iter(match=kp + "*")} == {(kp + K(1)).encode()}
        assert await client.get(kp + K(1)) == b"v"
        assert await client.type(kp + K(1)) == b"string"
        assert 119_000 < await client.pttl(kp + K(1)) <= 120_000  # SET ... EX 120
        assert await client.get(K(1)) is None
        await client.set(kp + K(2), b"written by another instance")
        assert await store.get(K(2)) == b"written by another instance"
    finally:
        await delete_prefix(client, kp)


async def test_redis_clear_leaves_other_prefixes_alone(client: Redis) -> None:
    tag = uuid.uuid4().hex[:12]
    glob_prefix = f"test:{tag}:r*[s]?\\:"  # glob characters must be matched literally
    others = [
        f"test:{tag}:rXs!:",  # what the unescaped glob would also match
        f"test:{tag}:r*[s]?\\",  # a prefix of our prefix
        f"test:{tag}:",
    ]
    mine = RedisCacheStore(client, glob_prefix, stats_cache_s=0)
    try:
        for i in range(3):
            await mine.set(K(i), b"mine", 60)
        for o in others:
            await client.set(o + K(0), b"theirs")
        assert (await mine.stats()).entries == 3
        assert await mine.clear() == 3
        assert await mine.get(K(0)) is None
        for o in others:
            assert await client.get(o + K(0)) == b"theirs"
    finally:
        await delete_prefix(client, f"test:{tag}:")


async def test_redis_hooks_see_every_command(client: Redis) -> None:
    kp = unique_prefix()
    seen: list[tuple[str, float]] = []
    errors: list[str] = []
    store = RedisCacheStore(
        client,
        kp,
        observe_latency=lambda op, s: seen.append((op, s)),
        count_error=errors.append,
        stats_cache_s=0,
    )
    try:
        await store.set(K(1), b"v", 60)
        await store.get(K(1))
        await store.delete(K(1))
        await store.clear()
        await store.stats()
        assert [op for op, _ in seen] == ["set", "get", "delete", "clear", "ping", "scan"]
        assert {op for op, _ in seen} <= set(OPERATIONS)
        assert all(0 <= s < 5 for _, s in seen)
        # A non-availability error (WRONGTYPE) raises CacheStoreError, counted as "other".
        await client.hset(kp + K(2), "f", "v")
        with pytest.raises(CacheStoreError) as info:
            await store.get(K(2))
        assert not isinstance(info.value, CacheUnavailable)
        assert info.value.operation == "get" and info.value.kind == "redis"
        assert errors == ["other"] and seen[-1][0] == "get"
        s = await store.stats()
        assert s.errors == 1 and s.errors_by_kind["other"] == 1
    finally:
        await delete_prefix(client, kp)


def test_redis_rejects_empty_prefix_and_escapes_globs() -> None:
    with pytest.raises(ValueError, match="key_prefix"):
        RedisCacheStore(Redis(), "")
    assert glob_escape("a*b?c[d]e\\f") == "a\\*b\\?c\\[d\\]e\\\\f"
    assert glob_escape("cr:resp:") == "cr:resp:"


async def test_redis_down_raises_unavailable_and_counts(redis_server: RedisServer) -> None:
    pools = RedisPools()
    errors: list[str] = []
    store = RedisCacheStore(
        pools.get(RedisConfig(url=redis_server.url, connect_timeout_ms=200)),
        "t:resp:",
        count_error=errors.append,
    )
    try:
        await store.set(K(1), b"v", 60)
        redis_server.kill()
        for op in (store.get(K(1)), store.set(K(1), b"v", 60), store.delete(K(1)), store.clear()):
            with pytest.raises(CacheUnavailable):
                await op
        assert errors == ["connection"] * 4
        s = await store.stats()  # never raises
        assert s.connected is False and s.entries is None
        assert s.errors_by_kind["connection"] == 5  # + the stats PING
    finally:
        await store.close()
        await pools.aclose()


# ---- fallback ------------------------------------------------------------------------


@dataclass
class Recorder:
    states: list[bool] = field(default_factory=list)
    ops: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def fallback_store(
    server: RedisServer,
    pools: RedisPools,
    rec: Recorder,
    *,
    command_timeout_ms: int = 500,
    fallback_to_memory: bool = True,
    key_prefix: str = "t:resp:",
) -> FallbackCacheStore:
    cfg = RedisConfig(
        url=server.url,
        connect_timeout_ms=200,
        command_timeout_ms=command_timeout_ms,
        fallback_capacity=100,
        fallback_ttl_seconds=30,
        fallback_to_memory=fallback_to_memory,
        key_prefix=key_prefix,
    )
    store = build_cache_store(
        "redis",
        1000,
        600,
        cfg,
        pools,
        observe_latency=lambda op, _: rec.ops.append(op),
        count_error=rec.errors.append,
        on_fallback_change=rec.states.append,
        monitor_interval_s=0.05,
        stats_cache_s=0,
    )
    assert isinstance(store, FallbackCacheStore)
    return store


async def test_fallback_engages_on_kill_mid_traffic_and_recovers(
    redis_server: RedisServer,
) -> None:
    pools = RedisPools()
    rec = Recorder()
    store = fallback_store(redis_server, pools, rec)
    observer = Redis.from_url(redis_server.url)
    failures: list[Exception] = []
    slowest = 0.0
    stop = asyncio.Event()

    async def traffic(worker: int) -> None:
        nonlocal slowest
        i = 0
        while not stop.is_set():
            base = (worker + 1) * 1_000_000  # never the keys the test itself uses
            k = K(base + i % 50)
            t0 = time.perf_counter()
            try:
                await asyncio.gather(
                    store.set(k, b"payload-%d" % i, 60),
                    store.get(k),
                    store.get(K(999_999)),
                    store.delete(K(base + (i + 25) % 50)),
                )
            except Exception as exc:  # the test is that none happens
                failures.append(exc)
            slowest = max(slowest, time.perf_counter() - t0)
            i += 1
            await asyncio.sleep(0)

    tasks = [asyncio.create_task(traffic(w)) for w in range(8)]
    try:
        await eventually(lambda: rec.ops.count("set") > 100)  # traffic is flowing to Redis
        assert not store.fallback_active and rec.states == []

        redis_server.kill()
        await eventually(lambda: store.fallback_active)
        assert rec.states == [True] and store.fallback_count == 1
        assert rec.errors and set(rec.errors) <= {"connection", "timeout"}
        # Served from memory, and Redis is bypassed (only the monitor's PINGs reach it).
        await store.set(K(7), b"in memory", 600)
        assert await store.get(K(7)) == b"in memory"
        assert store.fallback is not None and K(7) in store.fallback
        await eventually(lambda: rec.ops.count("ping") >= 1)  # in-flight commands settled
        n_ops = len([op for op in rec.ops if op != "ping"])
        pings = rec.ops.count("ping")
        await eventually(lambda: rec.ops.count("ping") >= pings + 3)  # the monitor keeps trying
        assert len([op for op in rec.ops if op != "ping"]) == n_ops
        s = await store.stats()
        assert s.fallback_active and s.connected is False and s.entries is not None

        await asyncio.to_thread(redis_server.start)  # same port, empty (no persistence)
        await asyncio.wait_for(store.wait_recovered(), 10)
        assert not store.fallback_active and rec.states == [True, False]
        assert len(store.fallback) == 0  # emptied on the way back
        await store.set(K(8), b"in redis", 60)
        got = await observer.get("t:resp:" + K(8))
        assert got == b"in redis", (rec.states, rec.errors[-5:], store.fallback_active)
        assert await store.get(K(7)) is None  # outage writes stay behind
        await eventually(lambda: rec.ops.count("set") > n_ops + 100)  # traffic on Redis
    finally:
        stop.set()
        await asyncio.gather(*tasks)
        await store.close()
        await pools.aclose()
        await observer.aclose()
    assert failures == []
    assert slowest < 2.0  # connection refused fails fast; nothing waited for the monitor


async def test_command_timeout_returns_promptly_as_miss_and_engages_fallback(
    redis_server: RedisServer,
) -> None:
    pools = RedisPools()
    rec = Recorder()
    store = fallback_store(redis_server, pools, rec, command_timeout_ms=200)
    admin = Redis.from_url(redis_server.url)
    try:
        await store.set(K(1), b"kept in redis", 600)
        assert await store.get(K(1)) == b"kept in redis"
        await admin.execute_command("CLIENT", "PAUSE", 1500, "ALL")
        t0 = time.perf_counter()
        assert await store.get(K(1)) is None  # timed out: a miss, from memory
        assert time.perf_counter() - t0 < 1.0
        assert store.fallback_active and rec.states == [True]
        assert "timeout" in rec.errors
        t0 = time.perf_counter()
        await store.set(K(2), b"v", 60)  # bypasses Redis: instant
        assert await store.get(K(2)) == b"v"
        assert time.perf_counter() - t0 < 0.1
        await asyncio.wait_for(store.wait_recovered(), 10)  # the pause ends, a PING answers
        assert rec.states == [True, False]
        assert await store.get(K(1)) == b"kept in redis"  # Redis kept its data
    finally:
        await store.close()
        await pools.aclose()
        await admin.aclose()


async def test_invalidations_during_an_outage_reach_redis_on_recovery(
    redis_server: RedisServer,
) -> None:
    pools = RedisPools()
    rec = Recorder()
    store = fallback_store(redis_server, pools, rec, command_timeout_ms=100)
    admin = Redis.from_url(redis_server.url)
    try:
        for i in range(4):
            await store.set(K(i), b"old", 600)
        await admin.execute_command("CLIENT", "PAUSE", 800, "ALL")
        assert await store.delete(K(1)) is False  # timed out; unknown to memory
        assert store.fallback_active
        await store.set(K(2), b"new", 600)
        assert await store.delete(K(2)) is True  # in memory; and remembered for Redis
        await asyncio.wait_for(store.wait_recovered(), 10)
        assert await store.get(K(1)) is None
        assert await store.get(K(2)) is None

        async def deletes_applied() -> bool:
            return await admin.exists("t:resp:" + K(1), "t:resp:" + K(2)) == 0

        await eventually(deletes_applied)  # the monitor applies them after the switch
        assert await store.get(K(0)) == b"old" and await store.get(K(3)) == b"old"

        # A clear during an outage clears Redis on recovery.
        await admin.execute_command("CLIENT", "PAUSE", 800, "ALL")
        await store.get(K(9))
        assert store.fallback_active
        await store.clear()
        await asyncio.wait_for(store.wait_recovered(), 10)
        assert await store.get(K(0)) is None and await store.get(K(3)) is None
        assert await admin.dbsize() == 0
    finally:
        await store.close()
        await pools.aclose()
        await admin.aclose()


async def test_keys_deleted_during_an_outage_miss_until_redis_forgot_them(
    redis_server: RedisServer,
) -> None:
    pools = RedisPools()
    admin = Redis.from_url(redis_server.url)
    primary = RedisCacheStore(
        pools.get(RedisConfig(url=redis_server.url, command_timeout_ms=100)), "t:resp:"
    )
    # The monitor sleeps for an hour: this test drives recovery by hand, deterministically.
    store = FallbackCacheStore(primary, InMemoryCacheStore(100, 30), monitor_interval_s=3600)
    try:
        for i in range(3):
            await store.set(K(i), b"old", 600)
        await admin.execute_command("CLIENT", "PAUSE", 500, "ALL")
        assert await store.get(K(9)) is None  # times out: fallback
        assert store.fallback_active
        await store.delete(K(1))
        await store.delete(K(2))

        async def recovered() -> bool:
            return await store.try_recover()

        await eventually(recovered)  # once the pause is over
        assert not store.fallback_active
        # Redis still holds both (the monitor has not applied the deletes yet) ...
        assert await admin.exists("t:resp:" + K(1), "t:resp:" + K(2)) == 2
        assert await store.get(K(1)) is None  # ... but they are never served
        await store.set(K(2), b"new", 600)  # a new value wins over the pending delete
        assert await store.get(K(2)) == b"new"
        assert await store.get(K(0)) == b"old"
        s = await store.stats()
        assert (s.hits, s.fallback_count) == (2, 1)
    finally:
        await store.close()
        await pools.aclose()
        await admin.aclose()


async def test_too_many_deletes_during_an_outage_become_one_clear(
    redis_server: RedisServer,
) -> None:
    pools = RedisPools()
    admin = Redis.from_url(redis_server.url)
    primary = RedisCacheStore(
        pools.get(RedisConfig(url=redis_server.url, command_timeout_ms=100)), "t:resp:"
    )
    store = FallbackCacheStore(
        primary, InMemoryCacheStore(100, 30), monitor_interval_s=0.05, max_pending_deletes=3
    )
    try:
        await store.set(K(100), b"other", 600)
        await admin.execute_command("CLIENT", "PAUSE", 800, "ALL")
        for i in range(5):
            await store.delete(K(i))
        assert store.fallback_active
        await asyncio.wait_for(store.wait_recovered(), 10)
        assert await store.get(K(100)) is None  # cleared with the whole prefix
        assert await admin.exists("t:resp:" + K(100)) == 0
    finally:
        await store.close()
        await pools.aclose()
        await admin.aclose()


async def test_without_memory_fallback_operations_miss_and_never_raise(
    redis_server: RedisServer,
) -> None:
    pools = RedisPools()
    rec = Recorder()
    store = fallback_store(redis_server, pools, rec, fallback_to_memory=False)
    try:
        assert store.fallback is None
        await store.set(K(1), b"v", 60)
        redis_server.kill()
        assert await store.get(K(1)) is None
        assert store.fallback_active and rec.states == [True]
        await store.set(K(2), b"dropped", 60)
        assert await store.get(K(2)) is None
        assert await store.delete(K(1)) is False
        assert await store.clear() == 0
        s = await store.stats()
        assert s.fallback_active and s.entries == 0 and s.misses == 2
        await asyncio.to_thread(redis_server.start)
        await asyncio.wait_for(store.wait_recovered(), 10)
        await store.set(K(3), b"back", 60)
        assert await store.get(K(3)) == b"back"
        assert rec.states == [True, False]
    finally:
        await store.close()
        await pools.aclose()


async def test_fallback_caps_ttl_and_ignores_other_errors(redis_server: RedisServer) -> None:
    pools = RedisPools()
    client = pools.get(RedisConfig(url=redis_server.url, connect_timeout_ms=200))
    clock = FakeClock()
    states: list[bool] = []

    def broken_callback(active: bool) -> None:
        states.append(active)
        raise RuntimeError("metrics bug")

    store = FallbackCacheStore(
        RedisCacheStore(client, "t:resp:"),
        InMemoryCacheStore(100, 5, clock=clock),
        monitor_interval_s=0.05,
        on_state_change=broken_callback,
    )
    try:
        # WRONGTYPE is not an outage: a miss, no switch.
        await client.hset("t:resp:" + K(1), "f", "v")
        assert await store.get(K(1)) is None
        await store.set(K(1), b"v", 60)  # SET replaces any type: works
        assert not store.fallback_active
        assert (await store.stats()).errors_by_kind["other"] == 1

        redis_server.kill()
        await store.set(K(2), b"v", 600)  # engages (the callback's bug is logged only)
        assert store.fallback_active and states == [True]
        await store.set(K(2), b"v", 600)
        clock.advance(5)  # capped at the fallback's TTL
        assert await store.get(K(2)) is None
        with pytest.raises(ValueError):
            await store.set(K(3), b"v", 0)  # a caller's bug still raises
        assert await store.try_recover() is False
    finally:
        await store.close()
        await store.close()  # idempotent
        await pools.aclose()


# ---- factory ---------------------------------------------------------------------------


async def test_build_cache_store_memory() -> None:
    store = build_cache_store("memory", 123, 45, None, None)
    assert isinstance(store, InMemoryCacheStore)
    assert (store.capacity, store.default_ttl) == (123, 45)


async def test_build_cache_store_redis_shares_the_kv_index_pool() -> None:
    rc = RedisConfig(
        url="redis://127.0.0.1:1",
        key_prefix="custom:",
        fallback_capacity=77,
        fallback_ttl_seconds=9,
        health_check_interval_ms=250,
    )
    with pytest.raises(ValueError, match=r"requires response_cache\.redis"):
        build_cache_store("redis", 10, 60, None, RedisPools())
    with pytest.raises(ValueError, match="pools"):
        build_cache_store("redis", 10, 60, rc, None)
    with pytest.raises(ValueError, match="unknown"):
        build_cache_store("disk", 10, 60, rc, RedisPools())  # type: ignore[arg-type]
    pools = RedisPools()
    try:
        store = build_cache_store("redis", 10, 60, rc, pools)
        assert isinstance(store, FallbackCacheStore)
        assert store.primary.key_prefix == "custom:" and store.default_ttl == 60
        assert store.monitor_interval_s == 0.25
        fb = store.fallback
        assert isinstance(fb, InMemoryCacheStore) and (fb.capacity, fb.default_ttl) == (77, 9)
        index = build_kv_index(KvCacheIndexConfig(backend="redis"), rc, pools=pools)
        assert isinstance(index.inner, FallbackKvIndex)
        assert store.primary.redis is index.inner.primary.redis is pools.get(rc)  # one pool
        assert len(pools) == 1
        no_fb = build_cache_store(
            "redis", 10, 60, rc.model_copy(update={"fallback_to_memory": False}), pools
        )
        assert isinstance(no_fb, FallbackCacheStore) and no_fb.fallback is None
        await store.close()  # never closes the shared client
        await index.close()
        assert pools.get(rc) is store.primary.redis
    finally:
        await pools.aclose()
