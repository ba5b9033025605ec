"""KV index: one conformance suite run against every backend and wrapper, then specifics.

``harness`` is parametrised over ``memory``, ``redis``, ``cluster`` (the Redis index on a
real 3-primary Redis Cluster, its per-backend key layout), ``fallback``
(``FallbackKvIndex`` around Redis, healthy) and ``instrumented`` (``InstrumentedKvIndex``
around memory); every test taking it runs on each and asserts the same observable
behaviour. Redis tests use a
key prefix of their own (parallel runs never collide) and delete their keys afterwards.
Redis specifics are in ``test_kvindex_redis.py``, the fallback's outages in
``test_kvindex_fallback.py``.
"""

from __future__ import annotations

import asyncio
import random
import time
import tracemalloc
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest

from bus.events import KvEvent
from router.config.models import KvCacheIndexConfig, RedisConfig, StorageOffloadingConfig
from router.kvindex import (
    EMPTY,
    Change,
    FallbackKvIndex,
    IndexEntry,
    InMemoryKvIndex,
    InstrumentedKvIndex,
    KvIndex,
    RedisKvIndex,
    StorageTier,
    apply_event,
    apply_events,
    build_kv_index,
)
from router.redis import RedisClient, RedisPools, build_client, build_redis, close_client
from tests.unit.kvindex_support import (
    GPU,
    WARM,
    C,
    FakeClock,
    P,
    assert_sorted,
    delete_prefix,
    new_key_prefix,
    state,
)

pytest_plugins = ("tests.redis_fixture",)


@dataclass
class Harness:
    kind: str
    """The ``harness`` parameter."""
    stats_kind: str
    """What ``stats().kind`` says."""
    counts_hits: bool
    """Whether ``stats().total_hits`` counts queries (only the instrumented wrapper does)."""
    make: Callable[..., KvIndex]
    client: RedisClient | None = None
    indexes: list[KvIndex] = field(default_factory=list)


@pytest.fixture(params=["memory", "redis", "cluster", "fallback", "instrumented"])
async def harness(request: pytest.FixtureRequest) -> AsyncIterator[Harness]:
    """``make(ttl=600, clock=None, max_entries=10_000)`` builds a fresh, empty index."""
    if request.param in ("memory", "instrumented"):
        wrap = request.param == "instrumented"

        def make_memory(
            ttl: float = 600, clock: Callable[[], float] | None = None, max_entries: int = 10_000
        ) -> KvIndex:
            idx = InMemoryKvIndex(max_entries, ttl, clock=clock or time.monotonic)
            return InstrumentedKvIndex(idx) if wrap else idx

        yield Harness(request.param, "memory", wrap, make_memory)
        return

    client: RedisClient
    if request.param == "cluster":
        c = request.getfixturevalue("shared_cluster")
        client = build_client(RedisConfig.model_validate({**c.config(), "pool_size": 16}))
    else:
        client = build_redis(RedisConfig(url=request.getfixturevalue("redis_url"), pool_size=16))
    prefixes: list[str] = []
    with_fallback = request.param == "fallback"

    def make_redis(
        ttl: float = 600, clock: Callable[[], float] | None = None, max_entries: int = 10_000
    ) -> KvIndex:
        kp = new_key_prefix()
        prefixes.append(kp)
        primary = RedisKvIndex(client, ttl, kp, clock=clock or time.time, stats_cache_s=0)
        idx: KvIndex = primary
        if with_fallback:
            fallback = InMemoryKvIndex(max_entries, ttl, clock=clock or time.monotonic)
            idx = FallbackKvIndex(primary, fallback)
        h.indexes.append(idx)
        return idx

    h = Harness(request.param, "redis", False, make_redis, client)
    try:
        yield h
    finally:
        for idx in h.indexes:
            if isinstance(idx, FallbackKvIndex):
                assert not idx.fallback_active  # the conformance suite never sees an outage
            await idx.close()
        for kp in prefixes:
            await delete_prefix(client, kp)
        await close_client(client)


# ---- conformance: every backend and wrapper ------------------------------------------


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
    assert st.kind == harness.stats_kind
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
    assert state(await idx.peek(P(1))) == {"a": (1, GPU), "b": (2, GPU)}  # never a hit
    st = await idx.stats()
    # Hits are the instrumented wrapper's; a bare backend counts none.
    assert (st.prefix_count, st.entry_count) == (2, 3)
    assert st.total_hits == (2 if harness.counts_hits else 0)
    assert st.fallback_active is False


async def test_concurrent_upserts_and_queries_stay_consistent(harness: Harness) -> None:
    idx = harness.make()
    prefixes = [P(i) for i in range(20)]
    backends = [f"b{j}" for j in range(8)]
    ops: list[Coroutine[Any, Any, Sequence[IndexEntry] | None]] = []
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

S = dict[str, tuple[int, StorageTier]]
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


# ---- chain events: the same table, into the chain index -------------------------------

_CHAIN_OF = {
    "cache_created": "chain_created",
    "cache_offloaded": "chain_offloaded",
    "cache_evicted": "chain_evicted",
}


def as_chain(ev: KvEvent) -> KvEvent:
    """``ev``'s chain namesake: the same row of the table, keyed by a chain key."""
    kind = _CHAIN_OF.get(ev.event)
    if kind is None:
        return ev
    assert ev.prefix_hash is not None
    key = int(ev.prefix_hash, 16)
    return KvEvent(kind, ev.backend, None, ev.token_count, ev.tier, chain_key=f"{key:032x}")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("name", "offloading"), [("off", OFF), ("demote", DEMOTE), ("keep", KEEP)], ids=str
)
async def test_chain_events_follow_the_table_into_the_chain_index(
    harness: Harness, name: str, offloading: StorageOffloadingConfig
) -> None:
    """Every row of the transition table, as chain events: the same labels and states, in
    the chain index (keyed by the chain key's 16 bytes); the prefix index is untouched, and
    cleared/resync empty the backend in both."""
    idx, chains = harness.make(), harness.make()
    await idx.upsert(P(7), "B", 1, GPU)  # a prefix entry the resync of B must remove
    for i, (ev, expect) in enumerate(TRANSITIONS):
        label, s1, s2 = expect[name]
        assert await apply_event(idx, as_chain(ev), offloading, chains) == label, (i, ev)
        assert state(await chains.query_backends(C(1))) == s1, (i, ev)
        assert state(await chains.query_backends(C(2))) == s2, (i, ev)
        assert await idx.query_backends(P(1)) is EMPTY
    assert await idx.query_backends(P(7)) is EMPTY  # cache_cleared of B cleared it too


async def test_chain_events_without_a_chain_index_are_ignored(harness: Harness) -> None:
    idx = harness.make()
    events = [as_chain(ev) for ev, _ in TRANSITIONS[:5]]
    assert [await apply_event(idx, ev, KEEP) for ev in events] == ["ignored"] * 5
    assert await apply_events(idx, events, KEEP) == ["ignored"] * 5
    assert (await idx.stats()).entry_count == 0


@pytest.mark.parametrize(
    ("name", "offloading"), [("off", OFF), ("demote", DEMOTE), ("keep", KEEP)], ids=str
)
async def test_apply_events_of_both_kinds_in_one_call_equals_one_by_one(
    harness: Harness, name: str, offloading: StorageOffloadingConfig
) -> None:
    """A random mix of prefix and chain events (and whole-backend ones) through
    apply_events: each event's label and both indexes' final state equal applying the
    events one by one."""
    rng = random.Random(11)
    mix: list[KvEvent] = []
    for _ in range(600):
        ev = KvEvent(
            rng.choice(["cache_created", "cache_created", "cache_evicted", "cache_offloaded"]),
            rng.choice("ABC"),
            P(rng.randrange(8)),
            rng.choice([None, 16, 64, 256]),
            rng.choice([None, "gpu", "storage"]),
        )
        if ev.event == "cache_offloaded" and ev.token_count is None and rng.random() < 0.5:
            ev = KvEvent("cache_offloaded", ev.backend, ev.prefix_hash, 32, ev.tier)
        mix.append(as_chain(ev) if rng.random() < 0.6 else ev)
    mix[200:200] = [KvEvent("resync", "B"), KvEvent("cache_cleared", "C")]
    mix[450:450] = [KvEvent("cache_cleared", "A")]
    one, one_chains = harness.make(), harness.make()
    many, many_chains = harness.make(), harness.make()
    labels = [await apply_event(one, ev, offloading, one_chains) for ev in mix]
    assert await apply_events(many, mix, offloading, many_chains) == labels
    assert await _snapshot(many, 8) == await _snapshot(one, 8)
    chain_state = [state(r) for r in await many_chains.query_many([C(i) for i in range(8)])]
    assert chain_state == [state(r) for r in await one_chains.query_many([C(i) for i in range(8)])]
    assert any(chain_state)


async def test_apply_events_makes_one_write_many_per_run_per_index() -> None:
    class Counting(InMemoryKvIndex):
        def __init__(self) -> None:
            super().__init__(1000, 600)
            self.calls: list[int] = []

        async def write_many(self, changes: Sequence[Change], ttl: float | None = None) -> None:
            self.calls.append(len(changes))
            await super().write_many(changes, ttl)

    idx, chains = Counting(), Counting()
    ck = [f"{i:032x}" for i in range(4)]
    events = [
        KvEvent("cache_created", "A", P(1), 10, "gpu"),
        KvEvent("chain_created", "A", token_count=10, tier="gpu", chain_key=ck[0]),
        KvEvent("chain_created", "A", token_count=20, tier="gpu", chain_key=ck[1]),
        KvEvent("cache_created", "A", P(2), 10, "gpu"),
        KvEvent("chain_evicted", "A", chain_key=ck[2]),
        KvEvent("resync", "B"),
        KvEvent("chain_created", "B", token_count=5, tier="gpu", chain_key=ck[3]),
    ]
    labels = await apply_events(idx, events, OFF, chains)
    assert labels == ["created", "created", "created", "created", "evicted", "resync", "created"]
    assert idx.calls == [2]
    assert chains.calls == [3, 1]


# ---- query_many, per-entry TTL (predictions), chain keys: every backend and wrapper -----


async def test_query_many_is_query_backends_of_each_key(harness: Harness) -> None:
    clock = FakeClock()
    idx = harness.make(ttl=100, clock=clock)
    await idx.upsert(P(1), "a", 10, GPU)
    await idx.upsert(P(2), "a", 5, WARM)
    await idx.upsert(P(2), "b", 7, GPU)
    await idx.upsert(P(3), "c", 1, GPU)
    clock.advance(60)
    await idx.upsert(P(3), "d", 2, GPU)
    keys = [P(1), P(9), P(2), P(3), P(1), P(8)]
    got = await idx.query_many(keys)
    assert [state(r) for r in got] == [state(await idx.query_backends(k)) for k in keys]
    assert [[e.backend for e in r] for r in got] == [["a"], [], ["b", "a"], ["d", "c"], ["a"], []]
    for r in got:
        assert_sorted(r)
    assert got[1] is EMPTY and got[5] is EMPTY  # a miss is the shared empty tuple
    assert await idx.query_many([]) == []
    # Never a refresh: an entry read by query_many still expires on time.
    clock.advance(41)
    rows = await idx.query_many([P(1), P(2), P(3)])
    assert rows[0] is EMPTY and rows[1] is EMPTY
    assert state(rows[2]) == {"d": (2, GPU)}
    assert [state(r) for r in await idx.peek_many([P(3), P(1)])] == [{"d": (2, GPU)}, {}]


async def test_query_many_of_a_long_chain(harness: Harness) -> None:
    """64 chain keys, prefix-closed per backend, in one query."""
    idx = harness.make()
    depth = {"a": 64, "b": 40, "c": 3}
    await idx.write_many(
        [(C(i), b, 100 * (i + 1), GPU) for b, d in depth.items() for i in range(d)]
    )
    rows = await idx.query_many([C(i) for i in range(70)])
    assert len(rows) == 70
    for i, row in enumerate(rows):
        assert {e.backend for e in row} == {b for b, d in depth.items() if i < d}, i
        assert all(e.token_count == 100 * (i + 1) for e in row)
    assert rows[64] is EMPTY


async def test_chain_keys_are_bytes_on_every_operation(harness: Harness) -> None:
    clock = FakeClock()
    idx = harness.make(ttl=100, clock=clock)
    await idx.upsert(C(1), "a", 10, GPU)
    await idx.write_many([(C(2), "a", 20, GPU), (C(2), "b", 5, WARM), (C(3), "b", 1, GPU)])
    assert state(await idx.query_backends(C(2))) == {"a": (20, GPU), "b": (5, WARM)}
    assert await idx.set_tier(C(1), "a", WARM) is True
    assert state(await idx.peek(C(1))) == {"a": (10, WARM)}
    assert await idx.remove(C(3), "b") is True
    assert await idx.query_backends(C(3)) is EMPTY
    assert await idx.backend_counts() == {"a": 2, "b": 1}
    st = await idx.stats()
    assert (st.prefix_count, st.entry_count) == (2, 3)
    assert await idx.remove_backend("b") == 1
    clock.advance(101)
    assert await idx.cleanup_expired() == 2
    assert await idx.query_many([C(1), C(2)]) == [EMPTY, EMPTY]


async def test_now_is_the_clock_of_expires_at(harness: Harness) -> None:
    clock = FakeClock()
    idx = harness.make(ttl=100, clock=clock)
    await idx.upsert(P(1), "a", 1, GPU)
    (e,) = await idx.query_backends(P(1))
    assert idx.now() == pytest.approx(clock.now, abs=0.01)
    assert e.expires_at - idx.now() == pytest.approx(100, abs=0.01)


async def test_a_prediction_expires_early_and_never_shortens_an_entry(harness: Harness) -> None:
    clock = FakeClock()
    idx = harness.make(ttl=100, clock=clock)
    await idx.upsert(C(1), "a", 10, GPU)  # an event: 100 s
    await idx.upsert(C(1), "a", 5, WARM, ttl=10)  # a prediction over it changes nothing
    (e,) = await idx.query_backends(C(1))
    assert (e.token_count, e.tier) == (10, GPU)
    assert e.expires_at == pytest.approx(clock.now + 100, abs=0.01)
    await idx.upsert(C(2), "a", 5, GPU, ttl=10)  # a prediction where there was nothing
    await idx.upsert(C(1), "b", 6, GPU, ttl=10)  # beside another backend's entry
    (p,) = await idx.query_backends(C(2))
    assert p.expires_at == pytest.approx(clock.now + 10, abs=0.01)
    clock.advance(6)
    await idx.upsert(C(2), "a", 7, WARM, ttl=10)  # a prediction renews a prediction
    (p,) = await idx.query_backends(C(2))
    assert (p.token_count, p.tier) == (7, WARM)
    assert p.expires_at == pytest.approx(clock.now + 10, abs=0.01)
    clock.advance(5)  # b's prediction on C(1) expired; a's event entry did not
    assert state(await idx.query_backends(C(1))) == {"a": (10, GPU)}
    await idx.upsert(C(2), "a", 9, GPU)  # an event replaces a prediction, full TTL
    (p,) = await idx.query_backends(C(2))
    assert p.token_count == 9 and p.expires_at == pytest.approx(clock.now + 100, abs=0.01)
    await idx.upsert(C(3), "a", 1, GPU, ttl=1000)  # never longer than the index's TTL
    (p,) = await idx.query_backends(C(3))
    assert p.expires_at == pytest.approx(clock.now + 100, abs=0.01)
    clock.advance(5)
    await idx.upsert(C(2), "a", 1, WARM, ttl=100)  # outlives the event entry: replaces it
    (p,) = await idx.query_backends(C(2))
    assert (p.token_count, p.tier) == (1, WARM)
    for bad in (0, -1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="ttl"):
            await idx.upsert(C(4), "a", 1, GPU, ttl=bad)
        with pytest.raises(ValueError, match="ttl"):
            await idx.write_many([(C(4), "a", 1, GPU)], ttl=bad)
    assert await idx.query_backends(C(4)) is EMPTY


async def test_write_many_with_a_ttl(harness: Harness) -> None:
    clock = FakeClock()
    idx = harness.make(ttl=100, clock=clock)
    await idx.write_many([(C(i), "a", i, GPU) for i in range(3)])  # events
    clock.advance(95)  # 5 s left
    changes: list[Change] = [(C(i), "a", 100 + i, WARM) for i in range(5)]
    changes.append((C(0), "a", 0, None))  # a removal in a predicting batch is a removal
    changes += [(C(10 + i % 40), f"b{i % 3}", i, GPU) for i in range(300)]  # > one batch
    await idx.write_many(changes, ttl=10)
    rows = await idx.query_many([C(i) for i in range(5)])
    assert [state(r) for r in rows] == [{}] + [{"a": (100 + i, WARM)} for i in range(1, 5)]
    assert all(r[0].expires_at == pytest.approx(clock.now + 10, abs=0.01) for r in rows[1:])
    assert state(await idx.query_backends(C(10))) == {
        "b0": (240, GPU),
        "b1": (280, GPU),
        "b2": (200, GPU),
    }
    clock.advance(11)
    assert await idx.query_many([C(1), C(10)]) == [EMPTY, EMPTY]
    await idx.write_many([], ttl=10)


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


def test_memory_lookup_many_misses_are_the_shared_tuple() -> None:
    idx = InMemoryKvIndex(1000, 60)
    idx.put(C(1), "a", 1, GPU)
    keys = [C(i) for i in range(2, 66)]
    tracemalloc.start()
    try:
        idx.lookup_many(keys)
        tracemalloc.reset_peak()
        before = tracemalloc.get_traced_memory()[0]
        rows = idx.lookup_many(keys)
        peak = tracemalloc.get_traced_memory()[1]
        # The result list (and its growth) is the only allocation: a miss allocates
        # nothing (a tuple per miss would add 48 B each).
        assert peak - before <= 16 * len(keys) + 256, peak - before
    finally:
        tracemalloc.stop()
    assert all(r is EMPTY for r in rows)


def test_memory_chain_entry_size_within_budget() -> None:
    """A chain key (16 bytes) held by one backend, written in batches as events arrive:
    at most 200 B per (key, backend), the key included."""
    n = 20_000
    hexes = [f"{i * 7919:032x}" for i in range(n)]
    idx = InMemoryKvIndex(n, 600)
    backends = [f"vllm-{j}" for j in range(4)]
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for start in range(0, n, 256):
            idx.write(
                [
                    (bytes.fromhex(h), backends[i % 4], 1000 + i, GPU)
                    for i, h in enumerate(hexes[start : start + 256], start)
                ]
            )
        per_entry = (tracemalloc.get_traced_memory()[0] - before) / n
    finally:
        tracemalloc.stop()
    assert per_entry <= 200, per_entry


def test_memory_single_and_shared_keys_keep_their_order_and_counts() -> None:
    """A key moves between one holder (stored bare) and several (a tuple) and back."""
    clock = FakeClock(0.0)
    idx = InMemoryKvIndex(100, 10, clock=clock)
    idx.put(C(1), "a", 5, GPU)
    idx.put(C(1), "b", 9, WARM)
    idx.put(C(1), "c", 5, GPU)
    assert [e.backend for e in idx.lookup(C(1))] == ["b", "c", "a"]
    assert idx.drop(C(1), "b") and idx.drop(C(1), "c")
    assert state(idx.lookup(C(1))) == {"a": (5, GPU)}
    assert idx.retier(C(1), "a", WARM) and state(idx.lookup(C(1))) == {"a": (5, WARM)}
    idx.put(C(1), "b", 1, GPU)
    assert idx.drop_backend("a") == 1 and state(idx.lookup(C(1))) == {"b": (1, GPU)}
    clock.advance(5)
    idx.put(C(1), "c", 2, GPU)
    clock.advance(6)  # b expired, c not: the lazy prune leaves a bare entry
    assert state(idx.lookup(C(1))) == {"c": (2, GPU)}
    st = idx.snapshot_stats()
    assert (st.prefix_count, st.entry_count, st.total_expired) == (1, 1, 1)
    assert idx.drop_all() == 1


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


# ---- the instrumented wrapper ----------------------------------------------------------


async def test_instrumented_counts_routing_queries_and_hits_only() -> None:
    inner = InMemoryKvIndex(2, 600)
    idx = InstrumentedKvIndex(inner)
    assert idx.kind == "memory" and idx.last_stats is None
    await idx.upsert(P(1), "a", 10, GPU)
    assert state(await idx.query_backends(P(1))) == {"a": (10, GPU)}
    assert await idx.query_backends(P(2)) is EMPTY
    assert await idx.peek(P(1))  # operators' reads are not routing lookups
    assert await idx.peek(P(2)) is EMPTY
    assert (idx.queries, idx.hits) == (2, 1)
    assert [state(r) for r in await idx.query_many([P(1), P(2)])] == [{"a": (10, GPU)}, {}]
    await idx.query_many([P(3), P(4)])
    assert await idx.peek_many([P(1)])
    assert (idx.queries, idx.hits) == (4, 2)  # query_many: one lookup; peek_many: none
    await idx.upsert(P(2), "a", 1, GPU)
    await idx.upsert(P(3), "a", 1, GPU)  # full: the oldest prefix is evicted by memory
    st = await idx.stats()
    assert (st.kind, st.total_hits, st.total_evictions, st.prefix_count) == ("memory", 2, 1, 2)
    assert idx.last_stats == st  # the scrape-time view
    assert (await inner.stats()).total_hits == 0  # the backend itself counts no hits


async def test_instrumented_does_not_count_a_failed_query() -> None:
    class Down(InMemoryKvIndex):
        async def query_backends(self, prefix_hash: str | bytes) -> tuple[()]:
            raise RuntimeError("down")

    idx = InstrumentedKvIndex(Down())
    with pytest.raises(RuntimeError):
        await idx.query_backends(P(1))
    assert (idx.queries, idx.hits) == (0, 0)


# ---- factory -----------------------------------------------------------------------


async def test_build_kv_index_memory() -> None:
    idx = build_kv_index(KvCacheIndexConfig(max_entries=500, entry_ttl_seconds=42), None)
    assert isinstance(idx, InstrumentedKvIndex)
    mem = idx.inner
    assert isinstance(mem, InMemoryKvIndex)
    assert (mem.max_entries, mem.ttl_seconds) == (500, 42.0)


async def test_build_kv_index_redis() -> None:
    with pytest.raises(ValueError, match=r"requires response_cache\.redis"):
        build_kv_index(KvCacheIndexConfig(backend="redis"), None)
    pools = RedisPools()
    try:
        rc = RedisConfig(url="redis://127.0.0.1:1", health_check_interval_ms=250)
        idx = build_kv_index(
            KvCacheIndexConfig(backend="redis", max_entries=500, entry_ttl_seconds=9),
            rc,
            pools=pools,
        )
        assert isinstance(idx, InstrumentedKvIndex) and idx.kind == "redis"
        fb = idx.inner
        assert isinstance(fb, FallbackKvIndex)
        assert isinstance(fb.primary, RedisKvIndex)
        assert fb.primary.key_prefix == "cr:kvidx:"
        assert fb.monitor_interval_s == 0.25
        assert isinstance(fb.fallback, InMemoryKvIndex)
        assert (fb.fallback.max_entries, fb.fallback.ttl_seconds) == (500, 9.0)
        assert fb.primary.redis is pools.get(rc)  # the shared pool
        no_fb = build_kv_index(
            KvCacheIndexConfig(backend="redis"),
            rc.model_copy(update={"fallback_to_memory": False}),
            pools=pools,
        )
        assert isinstance(no_fb.inner, RedisKvIndex)  # an outage raises KvIndexUnavailable
        own = build_kv_index(KvCacheIndexConfig(backend="redis"), rc)
        assert isinstance(own.inner, FallbackKvIndex)
        assert own.inner.primary.redis is not pools.get(rc)
        await own.close()  # closes the client it owns
    finally:
        await pools.aclose()
