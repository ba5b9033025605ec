"""KV index: one conformance suite run against every backend, then backend specifics.

``harness`` is parametrised over ``memory`` and ``redis``; every test taking it runs on
both and asserts the same observable behaviour. Redis tests use a key prefix of their own
(parallel runs never collide) and delete their keys afterwards. Tests that kill or pause
Redis use a private server (``redis_server``), never the shared one.
"""

from __future__ import annotations

import asyncio
import random
import time
import tracemalloc
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import pytest
from redis.asyncio import Redis

from bus.events import KvEvent
from router.config.models import KvCacheIndexConfig, RedisConfig, StorageOffloadingConfig
from router.kvindex import (
    EMPTY,
    Change,
    IndexEntry,
    InMemoryKvIndex,
    KvIndex,
    KvIndexUnavailable,
    RedisKvIndex,
    Tier,
    apply_event,
    apply_events,
    build_kv_index,
)
from router.redis import RedisPools, build_redis

if TYPE_CHECKING:
    from tests.redis_fixture import RedisServer

pytest_plugins = ("tests.redis_fixture",)

GPU = Tier.GPU_HOT
WARM = Tier.STORAGE_WARM


def P(i: int) -> str:
    """A prefix hash (64 hex characters, like ``bus.prefix_key``'s)."""
    return f"{i:064x}"


def state(entries: Sequence[IndexEntry]) -> dict[str, tuple[int, Tier]]:
    return {e.backend: (e.token_count, e.tier) for e in entries}


def assert_sorted(entries: Sequence[IndexEntry]) -> None:
    ranks = [(e.token_count, e.backend) for e in entries]
    assert ranks == sorted(ranks, reverse=True)
    assert len({e.backend for e in entries}) == len(entries)


class FakeClock:
    def __init__(self, start: float | None = None) -> None:
        self.now = time.time() if start is None else start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


async def _delete_prefix(client: Redis, key_prefix: str) -> None:
    keys = [k async for k in client.scan_iter(match=key_prefix + "*", count=500)]
    if keys:
        await client.unlink(*keys)


@dataclass
class Harness:
    kind: str
    make: Callable[..., KvIndex]
    client: Redis | None = None
    indexes: list[KvIndex] = field(default_factory=list)


@pytest.fixture(params=["memory", "redis"])
async def harness(request: pytest.FixtureRequest) -> AsyncIterator[Harness]:
    """``make(ttl=600, clock=None, max_entries=10_000)`` builds a fresh, empty index."""
    if request.param == "memory":

        def make_memory(
            ttl: float = 600, clock: Callable[[], float] | None = None, max_entries: int = 10_000
        ) -> KvIndex:
            return InMemoryKvIndex(max_entries, ttl, clock=clock or time.monotonic)

        yield Harness("memory", make_memory)
        return

    url = request.getfixturevalue("redis_url")
    client = build_redis(RedisConfig(url=url, pool_size=16))
    prefixes: list[str] = []

    def make_redis(
        ttl: float = 600, clock: Callable[[], float] | None = None, max_entries: int = 10_000
    ) -> KvIndex:
        kp = f"test:{uuid.uuid4().hex[:12]}:kvidx:"
        prefixes.append(kp)
        idx = RedisKvIndex(client, ttl, None, kp, clock=clock or time.time, stats_cache_s=0)
        h.indexes.append(idx)
        return idx

    h = Harness("redis", make_redis, client)
    try:
        yield h
    finally:
        for idx in h.indexes:
            await idx.close()
        for kp in prefixes:
            await _delete_prefix(client, kp)
        await client.aclose(close_connection_pool=True)


# ---- conformance: every backend ------------------------------------------------------


async def test_upsert_and_query_order(harness: Harness) -> None:
    idx = harness.make()
    await idx.upsert(P(1), "vllm-2", 512, GPU)
    await idx.upsert(P(1), "vllm-1", 2048, WARM)
    await idx.upsert(P(1), "vllm-3", 1024, GPU)
    await idx.upsert(P(1), "vllm-0", 512, GPU)  # tie with vllm-2: name descending
    got = await idx.query_backends(P(1))
    assert [(e.backend, e.token_count, e.tier) for e in got] == [
        ("vllm-1", 2048, WARM),
        ("vllm-3", 1024, GPU),
        ("vllm-2", 512, GPU),
        ("vllm-0", 512, GPU),
    ]
    # Replacing an entry re-ranks it; the same upsert twice changes nothing.
    await idx.upsert(P(1), "vllm-0", 4096, GPU)
    await idx.upsert(P(1), "vllm-0", 4096, GPU)
    got = await idx.query_backends(P(1))
    assert [e.backend for e in got] == ["vllm-0", "vllm-1", "vllm-3", "vllm-2"]
    assert_sorted(got)
    assert await idx.query_backends(P(2)) is EMPTY


async def test_empty_results_are_the_shared_tuple(harness: Harness) -> None:
    idx = harness.make()
    assert await idx.query_backends(P(7)) is EMPTY
    assert await idx.query_backends("") is EMPTY
    await idx.upsert(P(7), "a", 1, GPU)
    assert await idx.remove(P(7), "a") is True
    assert await idx.query_backends(P(7)) is EMPTY


async def test_empty_inputs(harness: Harness) -> None:
    idx = harness.make()
    assert await idx.remove(P(1), "a") is False
    assert await idx.set_tier(P(1), "a", WARM) is False
    assert await idx.remove_backend("a") == 0
    assert await idx.clear() == 0
    assert await idx.cleanup_expired() == 0
    st = await idx.stats()
    assert (st.prefix_count, st.entry_count, st.total_hits, st.total_evictions) == (0, 0, 0, 0)
    assert st.kind == harness.kind
    assert await idx.query_backends(P(1)) is EMPTY
    await idx.upsert(P(1), "a", 0, GPU)  # zero tokens is a valid entry
    assert state(await idx.query_backends(P(1))) == {"a": (0, GPU)}
    with pytest.raises(ValueError):
        await idx.upsert(P(1), "a", -1, GPU)


async def test_remove(harness: Harness) -> None:
    idx = harness.make()
    await idx.upsert(P(1), "a", 10, GPU)
    await idx.upsert(P(1), "b", 20, WARM)
    assert await idx.remove(P(1), "a") is True
    assert await idx.remove(P(1), "a") is False
    assert await idx.remove(P(2), "a") is False
    assert state(await idx.query_backends(P(1))) == {"b": (20, WARM)}


async def test_remove_backend_and_clear_count_entries(harness: Harness) -> None:
    idx = harness.make()
    for i in range(5):
        await idx.upsert(P(i), "a", 100 + i, GPU)
    for i in range(3):
        await idx.upsert(P(i), "b", 10 + i, WARM)
    await idx.upsert(P(9), "c", 1, GPU)
    assert await idx.remove_backend("a") == 5
    assert await idx.remove_backend("a") == 0
    assert await idx.remove_backend("unknown") == 0
    for i in range(3):
        assert state(await idx.query_backends(P(i))) == {"b": (10 + i, WARM)}
    for i in (3, 4):
        assert await idx.query_backends(P(i)) is EMPTY
    st = await idx.stats()
    assert (st.prefix_count, st.entry_count) == (4, 4)
    assert await idx.clear() == 4
    assert await idx.clear() == 0
    for i in (*range(5), 9):
        assert await idx.query_backends(P(i)) is EMPTY
    st = await idx.stats()
    assert (st.prefix_count, st.entry_count) == (0, 0)


async def test_tier_kept_and_set_tier(harness: Harness) -> None:
    idx = harness.make()
    await idx.upsert(P(1), "a", 300, WARM)
    await idx.upsert(P(1), "b", 200, GPU)
    assert state(await idx.query_backends(P(1))) == {"a": (300, WARM), "b": (200, GPU)}
    assert await idx.set_tier(P(1), "a", GPU) is True
    assert await idx.set_tier(P(1), "b", WARM) is True
    assert await idx.set_tier(P(1), "b", WARM) is True  # idempotent
    got = await idx.query_backends(P(1))
    assert state(got) == {"a": (300, GPU), "b": (200, WARM)}  # token counts kept
    assert [e.backend for e in got] == ["a", "b"]
    # No entry: nothing is created (the token count would be unknown).
    assert await idx.set_tier(P(1), "c", WARM) is False
    assert await idx.set_tier(P(2), "a", WARM) is False
    assert "c" not in state(await idx.query_backends(P(1)))
    assert await idx.query_backends(P(2)) is EMPTY


async def test_ttl_expiry_refresh_and_cleanup(harness: Harness) -> None:
    clock = FakeClock()
    idx = harness.make(ttl=100, clock=clock)
    await idx.upsert(P(3), "a", 1, GPU)
    await idx.upsert(P(1), "a", 1, GPU)
    await idx.upsert(P(2), "a", 5, GPU)
    clock.advance(50)
    await idx.upsert(P(2), "b", 3, WARM)  # P(2) now holds an old and a fresh entry
    clock.advance(49)
    assert [e.backend for e in await idx.query_backends(P(2))] == ["a", "b"]
    e = (await idx.query_backends(P(1)))[0]
    assert e.expires_at == pytest.approx(clock.now + 1, abs=0.01)
    clock.advance(2)  # a expired everywhere (last event 101 s ago), b has 49 s left
    assert await idx.query_backends(P(1)) is EMPTY
    assert state(await idx.query_backends(P(2))) == {"b": (3, WARM)}
    assert await idx.remove(P(3), "a") is False  # expired: not a live entry
    assert await idx.set_tier(P(2), "a", WARM) is False  # expired: not revived
    assert state(await idx.query_backends(P(2))) == {"b": (3, WARM)}
    assert await idx.cleanup_expired() >= 0
    st = await idx.stats()
    assert (st.prefix_count, st.entry_count) == (1, 1)
    clock.advance(49)
    assert await idx.query_backends(P(2)) is EMPTY


async def test_ttl_refreshed_by_events_not_by_queries(harness: Harness) -> None:
    clock = FakeClock()
    idx = harness.make(ttl=10, clock=clock)
    await idx.upsert(P(1), "a", 1, GPU)
    await idx.upsert(P(2), "a", 1, GPU)
    await idx.upsert(P(3), "a", 1, GPU)
    clock.advance(9)
    await idx.upsert(P(1), "a", 2, GPU)  # refresh by upsert
    assert await idx.set_tier(P(2), "a", WARM)  # refresh by set_tier
    assert await idx.query_backends(P(3))  # a query does not refresh
    clock.advance(2)
    assert state(await idx.query_backends(P(1))) == {"a": (2, GPU)}
    assert state(await idx.query_backends(P(2))) == {"a": (1, WARM)}
    assert await idx.query_backends(P(3)) is EMPTY


async def test_cleanup_expired_removes_unqueried(harness: Harness) -> None:
    clock = FakeClock()
    idx = harness.make(ttl=10, clock=clock)
    for i in range(20):
        await idx.upsert(P(i), "a", i, GPU)
    clock.advance(5)
    for i in range(20, 25):
        await idx.upsert(P(i), "b", i, GPU)
    clock.advance(6)
    assert await idx.cleanup_expired() == 20
    assert await idx.cleanup_expired() == 0
    st = await idx.stats()
    assert (st.prefix_count, st.entry_count) == (5, 5)
    assert st.total_expired >= 20


async def test_stats_counts_and_hits(harness: Harness) -> None:
    idx = harness.make()
    await idx.upsert(P(1), "a", 1, GPU)
    await idx.upsert(P(1), "b", 2, GPU)
    await idx.upsert(P(2), "a", 3, WARM)
    await idx.query_backends(P(1))
    await idx.query_backends(P(2))
    await idx.query_backends(P(3))
    st = await idx.stats()
    assert (st.prefix_count, st.entry_count, st.total_hits) == (2, 3, 2)
    assert st.fallback_active is False


async def test_concurrent_upserts_and_queries_stay_consistent(harness: Harness) -> None:
    idx = harness.make()
    prefixes = [P(i) for i in range(20)]
    backends = [f"b{j}" for j in range(8)]
    ops = []
    for p in prefixes:
        for j, b in enumerate(backends):
            ops.append(idx.upsert(p, b, 100 * (j + 1), GPU if j % 2 else WARM))
            ops.append(idx.query_backends(p))
    random.Random(7).shuffle(ops)
    for result in await asyncio.gather(*ops):
        if result is not None:
            assert_sorted(result)
    for p in prefixes:
        got = await idx.query_backends(p)
        assert [(e.backend, e.token_count) for e in got] == [
            (f"b{j}", 100 * (j + 1)) for j in reversed(range(8))
        ]
        assert all(e.tier is (GPU if int(e.backend[1:]) % 2 else WARM) for e in got)

    # Racing writes to one entry: exactly one survives, count and tier from the same write.
    counts = list(range(1, 201))
    await asyncio.gather(
        *(idx.upsert(P(99), "x", c, GPU if c % 2 else WARM) for c in counts),
        *(idx.query_backends(P(99)) for _ in range(50)),
    )
    (e,) = await idx.query_backends(P(99))
    assert e.token_count in counts
    assert e.tier is (GPU if e.token_count % 2 else WARM)

    # Concurrent removals and queries: every entry of b3 goes, each counted once.
    removed = await asyncio.gather(
        idx.remove_backend("b3"), *(idx.query_backends(p) for p in prefixes)
    )
    assert removed[0] == len(prefixes)
    assert sum(await asyncio.gather(*(idx.remove(p, "b3") for p in prefixes))) == 0


# ---- apply_event: the tier transitions, on every backend -------------------------------

OFF = StorageOffloadingConfig(enabled=False)
DEMOTE = StorageOffloadingConfig(enabled=True, treat_eviction_as_offload=True)
KEEP = StorageOffloadingConfig(enabled=True, treat_eviction_as_offload=False)

S = dict[str, tuple[int, Tier]]
# (event, {config name: (label, P(1) state after, P(2) state after)})
TRANSITIONS: list[tuple[KvEvent, dict[str, tuple[str, S, S]]]] = [
    (
        KvEvent("cache_created", "A", P(1), 100, "gpu"),
        {k: ("created", {"A": (100, GPU)}, {}) for k in ("off", "demote", "keep")},
    ),
    (
        KvEvent("cache_created", "B", P(1), 50, "gpu"),
        {k: ("created", {"A": (100, GPU), "B": (50, GPU)}, {}) for k in ("off", "demote", "keep")},
    ),
    (
        KvEvent("cache_created", "B", P(2), 70, "gpu"),
        {
            k: ("created", {"A": (100, GPU), "B": (50, GPU)}, {"B": (70, GPU)})
            for k in ("off", "demote", "keep")
        },
    ),
    (
        KvEvent("cache_offloaded", "A", P(1), 100, "storage"),
        {
            "off": ("evicted", {"B": (50, GPU)}, {"B": (70, GPU)}),
            "demote": ("offloaded", {"A": (100, WARM), "B": (50, GPU)}, {"B": (70, GPU)}),
            "keep": ("offloaded", {"A": (100, WARM), "B": (50, GPU)}, {"B": (70, GPU)}),
        },
    ),
    (
        KvEvent("cache_evicted", "B", P(1)),
        {
            "off": ("evicted", {}, {"B": (70, GPU)}),
            "demote": ("offloaded", {"A": (100, WARM), "B": (50, WARM)}, {"B": (70, GPU)}),
            "keep": ("evicted", {"A": (100, WARM)}, {"B": (70, GPU)}),
        },
    ),
    (
        KvEvent("cache_created", "A", P(1), 200, "gpu"),  # back on the GPU, chain grew
        {
            "off": ("created", {"A": (200, GPU)}, {"B": (70, GPU)}),
            "demote": ("created", {"A": (200, GPU), "B": (50, WARM)}, {"B": (70, GPU)}),
            "keep": ("created", {"A": (200, GPU)}, {"B": (70, GPU)}),
        },
    ),
    (
        KvEvent("cache_evicted", "C", P(1)),  # a backend the index never saw
        {
            "off": ("evicted", {"A": (200, GPU)}, {"B": (70, GPU)}),
            "demote": ("ignored", {"A": (200, GPU), "B": (50, WARM)}, {"B": (70, GPU)}),
            "keep": ("evicted", {"A": (200, GPU)}, {"B": (70, GPU)}),
        },
    ),
    (
        KvEvent("cache_offloaded", "A", P(1)),  # no token count: tier change only
        {
            "off": ("evicted", {}, {"B": (70, GPU)}),
            "demote": ("offloaded", {"A": (200, WARM), "B": (50, WARM)}, {"B": (70, GPU)}),
            "keep": ("offloaded", {"A": (200, WARM)}, {"B": (70, GPU)}),
        },
    ),
    (
        KvEvent("cache_offloaded", "C", P(1)),  # no count and no entry: nothing to demote
        {
            "off": ("evicted", {}, {"B": (70, GPU)}),
            "demote": ("ignored", {"A": (200, WARM), "B": (50, WARM)}, {"B": (70, GPU)}),
            "keep": ("ignored", {"A": (200, WARM)}, {"B": (70, GPU)}),
        },
    ),
    (
        KvEvent("cache_created", "D", P(2), 30, "storage"),  # created straight in storage
        {
            "off": ("evicted", {}, {"B": (70, GPU)}),
            "demote": (
                "offloaded",
                {"A": (200, WARM), "B": (50, WARM)},
                {"B": (70, GPU), "D": (30, WARM)},
            ),
            "keep": ("offloaded", {"A": (200, WARM)}, {"B": (70, GPU), "D": (30, WARM)}),
        },
    ),
    (
        KvEvent("cache_cleared", "B"),
        {
            "off": ("cleared", {}, {}),
            "demote": ("cleared", {"A": (200, WARM)}, {"D": (30, WARM)}),
            "keep": ("cleared", {"A": (200, WARM)}, {"D": (30, WARM)}),
        },
    ),
    (
        KvEvent("resync", "A", reason="gap"),
        {
            "off": ("resync", {}, {}),
            "demote": ("resync", {}, {"D": (30, WARM)}),
            "keep": ("resync", {}, {"D": (30, WARM)}),
        },
    ),
    (
        KvEvent("cache_created", "A", P(1), 64, "gpu"),  # the snapshot after a resync
        {
            "off": ("created", {"A": (64, GPU)}, {}),
            "demote": ("created", {"A": (64, GPU)}, {"D": (30, WARM)}),
            "keep": ("created", {"A": (64, GPU)}, {"D": (30, WARM)}),
        },
    ),
]


@pytest.mark.parametrize(
    ("name", "offloading"), [("off", OFF), ("demote", DEMOTE), ("keep", KEEP)], ids=str
)
async def test_apply_event_transitions(
    harness: Harness, name: str, offloading: StorageOffloadingConfig
) -> None:
    idx = harness.make()
    for i, (ev, expect) in enumerate(TRANSITIONS):
        label, s1, s2 = expect[name]
        assert await apply_event(idx, ev, offloading) == label, (i, ev)
        assert state(await idx.query_backends(P(1))) == s1, (i, ev)
        assert state(await idx.query_backends(P(2))) == s2, (i, ev)


async def test_apply_event_without_prefix_is_ignored(harness: Harness) -> None:
    idx = harness.make()
    assert await apply_event(idx, KvEvent("cache_created", "A"), DEMOTE) == "ignored"
    assert (await idx.stats()).entry_count == 0


async def _snapshot(idx: KvIndex, n: int) -> list[S]:
    return [state(await idx.query_backends(P(i))) for i in range(n)]


@pytest.mark.parametrize(
    ("name", "offloading"), [("off", OFF), ("demote", DEMOTE), ("keep", KEEP)], ids=str
)
async def test_apply_events_in_one_call_equals_one_by_one(
    harness: Harness, name: str, offloading: StorageOffloadingConfig
) -> None:
    """The whole transition table, and a random mix of the same kinds over 8 prefixes and 3
    backends, through apply_events at once: the labels and the final state of applying
    each event alone."""
    rng = random.Random(7)
    kinds = [ev for ev, _ in TRANSITIONS]
    mix = [
        KvEvent(
            rng.choice(["cache_created", "cache_created", "cache_evicted", "cache_offloaded"]),
            rng.choice("ABC"),
            P(rng.randrange(8)),
            rng.choice([None, 16, 64, 256]),
            rng.choice([None, "gpu", "storage"]),
        )
        for _ in range(400)
    ]
    mix[150:150] = [KvEvent("resync", "B"), KvEvent("cache_cleared", "C")]
    for events in (kinds, mix):
        one, many = harness.make(), harness.make()
        labels = [await apply_event(one, ev, offloading) for ev in events]
        assert await apply_events(many, events, offloading) == labels
        assert await _snapshot(many, 8) == await _snapshot(one, 8)


async def test_write_many_runs_upserts_and_removes_in_order(harness: Harness) -> None:
    idx = harness.make()
    await idx.upsert(P(1), "A", 10, GPU)
    changes: list[Change] = [
        (P(1), "B", 20, WARM),
        (P(1), "A", 0, None),  # remove
        (P(2), "A", 5, GPU),
        (P(2), "A", 0, None),
        (P(2), "A", 7, WARM),  # re-created after its removal
        (P(3), "C", 0, None),  # removing what is not there changes nothing
    ]
    changes += [(P(4 + i % 50), f"b{i % 3}", i, GPU) for i in range(600)]  # > one batch
    await idx.write_many(changes)
    assert state(await idx.query_backends(P(1))) == {"B": (20, WARM)}
    assert state(await idx.query_backends(P(2))) == {"A": (7, WARM)}
    assert await idx.query_backends(P(3)) is EMPTY
    assert state(await idx.query_backends(P(4))) == {
        "b0": (450, GPU),
        "b1": (550, GPU),
        "b2": (500, GPU),
    }
    await idx.write_many([])
    with pytest.raises(ValueError, match="non-negative"):
        await idx.write_many([(P(9), "A", 1, GPU), (P(9), "B", -1, GPU)])


async def test_redis_write_many_falls_back_and_is_replayed(redis_server: RedisServer) -> None:
    cfg = RedisConfig(url=redis_server.url, connect_timeout_ms=200, command_timeout_ms=500)
    client, observer_client = build_redis(cfg), build_redis(cfg)
    idx = RedisKvIndex(client, 600, InMemoryKvIndex(1000, 600), "wm:kvidx:", stats_cache_s=0)
    observer = RedisKvIndex(observer_client, 600, None, "wm:kvidx:")
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


# ---- memory specifics ----------------------------------------------------------------


def test_memory_miss_allocates_nothing() -> None:
    idx = InMemoryKvIndex(1000, 60)
    idx.put(P(1), "a", 1, GPU)
    misses = [P(i) for i in range(2, 1002)]
    tracemalloc.start()
    try:
        for k in misses:  # nothing retained over many misses
            assert idx.lookup(k) is EMPTY
        before = tracemalloc.get_traced_memory()[0]
        for k in misses:
            idx.lookup(k)
        after = tracemalloc.get_traced_memory()[0]
        assert after - before <= 64, after - before
        for k in misses[:20]:  # and nothing allocated even transiently by one miss
            tracemalloc.reset_peak()
            r = idx.lookup(k)
            current, peak = tracemalloc.get_traced_memory()
            assert peak == current and r is EMPTY
    finally:
        tracemalloc.stop()


async def test_memory_async_miss_returns_shared_tuple_without_growth() -> None:
    idx = InMemoryKvIndex(1000, 60)
    misses = [P(i) for i in range(500)]
    tracemalloc.start()
    try:
        for k in misses:
            assert await idx.query_backends(k) is EMPTY
        before = tracemalloc.get_traced_memory()[0]
        for k in misses:
            await idx.query_backends(k)
        assert tracemalloc.get_traced_memory()[0] - before <= 64
    finally:
        tracemalloc.stop()


def test_memory_evicts_oldest_tenth_in_one_step() -> None:
    clock = FakeClock(0.0)
    idx = InMemoryKvIndex(100, 600, clock=clock)
    for i in range(100):
        idx.put(P(i), "a", i, GPU)
        clock.advance(1)
    idx.put(P(1), "b", 7, GPU)  # a second backend on P(1): evicted entries count it
    for i in range(1, 5):
        idx.put(P(i), "a", 1000, GPU)  # updates move to the end
    assert idx.retier(P(5), "a", WARM)  # so does set_tier
    assert idx.lookup(P(6))  # a query does not
    assert len(idx) == 100
    idx.put(P(100), "a", 1, GPU)  # full: the oldest 10 go (0 and 6..14), then insert
    present = {i for i in range(101) if idx.lookup(P(i))}
    assert present == set(range(101)) - {0, *range(6, 15)}
    st = idx.snapshot_stats()
    assert (st.prefix_count, st.total_evictions) == (91, 10)
    idx.put(P(50), "z", 1, GPU)  # updating an existing prefix never evicts
    assert len(idx) == 91


def test_memory_entry_size_within_budget() -> None:
    n = 20_000
    idx = InMemoryKvIndex(n, 600)
    backends = [f"vllm-{j}" for j in range(4)]
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(n):
            idx.put(f"{i:064x}", backends[i % 4], 1000 + i, GPU)  # keys created here count
        per_entry = (tracemalloc.get_traced_memory()[0] - before) / n
    finally:
        tracemalloc.stop()
    assert per_entry <= 400, per_entry


def test_memory_sweep_stops_at_first_live_prefix() -> None:
    clock = FakeClock(0.0)
    idx = InMemoryKvIndex(1000, 10, clock=clock)
    for i in range(10):
        idx.put(P(i), "a", i, GPU)
    clock.advance(5)
    idx.put(P(3), "b", 1, GPU)  # refreshed: moves behind the rest
    clock.advance(6)
    assert idx.sweep() == 9  # P(3) keeps a live entry; its expired one is hidden
    assert len(idx) == 1
    assert state(idx.lookup(P(3))) == {"b": (1, GPU)}


def test_memory_rejects_bad_config() -> None:
    with pytest.raises(ValueError):
        InMemoryKvIndex(0, 10)
    with pytest.raises(ValueError):
        InMemoryKvIndex(10, 0)


# ---- Redis specifics -----------------------------------------------------------------


@pytest.fixture
async def redis_client(redis_url: str) -> AsyncIterator[Redis]:
    client = build_redis(RedisConfig(url=redis_url))
    try:
        yield client
    finally:
        await client.aclose(close_connection_pool=True)


@pytest.fixture
def key_prefix() -> str:
    return f"test:{uuid.uuid4().hex[:12]}:kvidx:"


@pytest.fixture
async def cleanup(redis_client: Redis, key_prefix: str) -> AsyncIterator[None]:
    yield
    await _delete_prefix(redis_client, key_prefix)


async def test_redis_layout_one_sorted_set_per_prefix(
    redis_client: Redis, key_prefix: str, cleanup: None
) -> None:
    idx = RedisKvIndex(redis_client, 600, None, key_prefix)
    await idx.upsert(P(1), "vllm-1", 2048, GPU)
    await idx.upsert(P(1), "vllm-2", 512, WARM)
    key = (key_prefix + P(1)).encode()
    assert await redis_client.zrevrangebyscore(key, "+inf", "-inf", withscores=True) == [
        (b"vllm-1", 2048.0),
        (b"vllm-2", 512.0),
    ]
    meta = await redis_client.hgetall(key + b":t")
    assert sorted(meta) == [b"vllm-1", b"vllm-2"]
    assert meta[b"vllm-1"][:1] == b"g" and meta[b"vllm-2"][:1] == b"s"
    assert abs(int(meta[b"vllm-1"][1:]) - (time.time() + 600) * 1000) < 5000
    for k in (key, key + b":t"):  # EXPIRE set in the same transaction as the write
        assert 590_000 < await redis_client.pttl(k) <= 600_000


async def test_redis_keys_really_expire(
    redis_client: Redis, key_prefix: str, cleanup: None
) -> None:
    idx = RedisKvIndex(redis_client, 1, None, key_prefix)
    await idx.upsert(P(1), "a", 1, GPU)
    key = (key_prefix + P(1)).encode()
    assert await redis_client.exists(key, key + b":t") == 2
    ttl_ms = max(await redis_client.pttl(key), await redis_client.pttl(key + b":t"))
    assert 0 < ttl_ms <= 1000
    await asyncio.sleep(ttl_ms / 1000 + 0.05)  # Redis' own clock: nothing else to await
    assert await redis_client.exists(key, key + b":t") == 0  # expired keys are gone on access
    assert await idx.query_backends(P(1)) is EMPTY


async def test_redis_member_written_by_a_foreign_tool(
    redis_client: Redis, key_prefix: str, cleanup: None
) -> None:
    idx = RedisKvIndex(redis_client, 600, None, key_prefix)
    key = key_prefix + P(1)
    await redis_client.zadd(key, {"legacy": 4096})  # the seed's layout, no tier hash
    (e,) = await idx.query_backends(P(1))
    assert (e.backend, e.token_count, e.tier) == ("legacy", 4096, GPU)
    assert e.expires_at <= time.time() + 601
    await idx.upsert(P(1), "new", 1, WARM)
    assert state(await idx.query_backends(P(1))) == {"legacy": (4096, GPU), "new": (1, WARM)}
    # A hash value not in our format is tolerated by reads, set_tier and the sweep.
    await redis_client.zadd(key, {"odd": 8})
    await redis_client.hset(key + ":t", "odd", "garbage")
    assert state(await idx.query_backends(P(1)))["odd"] == (8, GPU)
    assert await idx.set_tier(P(1), "odd", WARM) is True
    assert await idx.set_tier(P(1), "legacy", WARM) is True
    assert await idx.cleanup_expired() == 0
    assert state(await idx.query_backends(P(1))) == {
        "legacy": (4096, WARM),
        "odd": (8, WARM),
        "new": (1, WARM),
    }


async def test_redis_two_instances_share_state(redis_url: str, key_prefix: str) -> None:
    c1 = build_redis(RedisConfig(url=redis_url))
    c2 = build_redis(RedisConfig(url=redis_url))
    a = RedisKvIndex(c1, 600, InMemoryKvIndex(100, 600), key_prefix, stats_cache_s=0)
    b = RedisKvIndex(c2, 600, InMemoryKvIndex(100, 600), key_prefix, stats_cache_s=0)
    try:
        await a.upsert(P(1), "x", 100, GPU)
        await b.upsert(P(1), "y", 200, WARM)
        for idx in (a, b):
            assert state(await idx.query_backends(P(1))) == {"x": (100, GPU), "y": (200, WARM)}
        assert await b.set_tier(P(1), "x", WARM)
        assert state(await a.query_backends(P(1)))["x"] == (100, WARM)
        assert await a.remove(P(1), "y") is True
        assert await b.remove(P(1), "y") is False
        await a.upsert(P(2), "x", 5, GPU)
        assert await b.remove_backend("x") == 2
        assert await a.query_backends(P(1)) is EMPTY
        await b.upsert(P(3), "z", 1, GPU)
        assert (await a.stats()).prefix_count == 1
        assert await a.clear() == 1
        assert await b.query_backends(P(3)) is EMPTY
        assert not a.fallback_active and not b.fallback_active
    finally:
        await _delete_prefix(c1, key_prefix)
        for idx in (a, b):
            await idx.close()
        await c1.aclose(close_connection_pool=True)
        await c2.aclose(close_connection_pool=True)


async def test_redis_scans_stay_inside_the_key_prefix(redis_client: Redis) -> None:
    tag = uuid.uuid4().hex[:12]
    glob_prefix = f"test:{tag}:kv*[x]:"  # glob characters must be matched literally
    other_prefix = f"test:{tag}:kvAx:"  # what the unescaped glob would also match
    mine = RedisKvIndex(redis_client, 600, None, glob_prefix, stats_cache_s=0)
    other = RedisKvIndex(redis_client, 600, None, other_prefix, stats_cache_s=0)
    try:
        await mine.upsert(P(1), "a", 1, GPU)
        await other.upsert(P(1), "a", 2, GPU)
        await redis_client.set(f"test:{tag}:unrelated", b"1")
        assert (await mine.stats()).prefix_count == 1
        assert await mine.remove_backend("a") == 1
        await mine.upsert(P(2), "a", 1, GPU)
        assert await mine.clear() == 1
        assert state(await other.query_backends(P(1))) == {"a": (2, GPU)}
        assert await redis_client.get(f"test:{tag}:unrelated") == b"1"
    finally:
        await _delete_prefix(redis_client, f"test:{tag}:")


async def test_redis_without_fallback_raises(redis_server: RedisServer) -> None:
    client = build_redis(RedisConfig(url=redis_server.url, connect_timeout_ms=200))
    idx = RedisKvIndex(client, 600, None, "t:kvidx:")
    try:
        await idx.upsert(P(1), "a", 1, GPU)
        redis_server.kill()
        with pytest.raises(KvIndexUnavailable) as info:
            await idx.query_backends(P(1))
        assert info.value.operation == "query"
        with pytest.raises(KvIndexUnavailable):
            await idx.upsert(P(1), "a", 1, GPU)
        assert not idx.fallback_active
    finally:
        await idx.close()
        await client.aclose(close_connection_pool=True)


async def test_redis_failure_falls_back_to_memory_and_recovers(redis_server: RedisServer) -> None:
    cfg = RedisConfig(url=redis_server.url, connect_timeout_ms=200, command_timeout_ms=500)
    client = build_redis(cfg)
    idx = RedisKvIndex(client, 600, InMemoryKvIndex(1000, 600), "t:kvidx:", stats_cache_s=0)
    observer_client = build_redis(cfg)
    observer = RedisKvIndex(observer_client, 600, None, "t:kvidx:")
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
        assert len(idx.fallback) == 0  # type: ignore[arg-type]
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
    idx = RedisKvIndex(client, 600, InMemoryKvIndex(1000, 600), "t:kvidx:", monitor_interval_s=0.05)
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
    idx = RedisKvIndex(client, 600, fb, "t:kvidx:", monitor_interval_s=0.05)
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


# ---- factory -----------------------------------------------------------------------


async def test_build_kv_index_memory() -> None:
    idx = build_kv_index(KvCacheIndexConfig(max_entries=500, entry_ttl_seconds=42), None)
    assert isinstance(idx, InMemoryKvIndex)
    assert (idx.max_entries, idx.ttl_seconds) == (500, 42.0)


async def test_build_kv_index_redis() -> None:
    with pytest.raises(ValueError, match=r"requires response_cache\.redis"):
        build_kv_index(KvCacheIndexConfig(backend="redis"), None)
    pools = RedisPools()
    try:
        rc = RedisConfig(url="redis://127.0.0.1:1", health_check_interval_ms=250)
        idx = build_kv_index(KvCacheIndexConfig(backend="redis"), rc, pools=pools)
        assert isinstance(idx, RedisKvIndex)
        assert idx.key_prefix == "cr:kvidx:"
        assert idx.monitor_interval_s == 0.25
        assert isinstance(idx.fallback, InMemoryKvIndex)
        assert idx.redis is pools.get(rc)  # the shared pool
        no_fb = build_kv_index(
            KvCacheIndexConfig(backend="redis"),
            rc.model_copy(update={"fallback_to_memory": False}),
            pools=pools,
        )
        assert isinstance(no_fb, RedisKvIndex) and no_fb.fallback is None
        own = build_kv_index(KvCacheIndexConfig(backend="redis"), rc)
        assert isinstance(own, RedisKvIndex) and own.redis is not pools.get(rc)
        await own.close()  # closes the client it owns
    finally:
        await pools.aclose()
