"""The Redis KV index's own behaviour, beyond the conformance suite (``test_kvindex.py``).

Layout and expiry in Redis itself, what a foreign tool leaves, sharing between instances,
SCAN staying inside the key prefix, and the error an outage raises (the fallback wrapper
that turns it into a switch to memory: ``test_kvindex_fallback.py``). Tests that kill
Redis use a private server (``redis_server``), never the shared one.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import pytest
from redis.asyncio import Redis

from router.config.models import RedisConfig
from router.kvindex import (
    EMPTY,
    FallbackKvIndex,
    InMemoryKvIndex,
    KvIndexUnavailable,
    RedisKvIndex,
)
from router.kvindex.server_clock import ServerClock
from router.redis import build_redis
from tests.unit.kvindex_support import GPU, WARM, FakeClock, P, delete_prefix, new_key_prefix, state

if TYPE_CHECKING:
    from tests.redis_fixture import RedisServer

pytest_plugins = ("tests.redis_fixture",)


@pytest.fixture
async def redis_client(redis_url: str) -> AsyncIterator[Redis]:
    client = build_redis(RedisConfig(url=redis_url))
    try:
        yield client
    finally:
        await client.aclose(close_connection_pool=True)


@pytest.fixture
def key_prefix() -> str:
    return new_key_prefix()


@pytest.fixture
async def cleanup(redis_client: Redis, key_prefix: str) -> AsyncIterator[None]:
    yield
    await delete_prefix(redis_client, key_prefix)


async def test_redis_layout_one_sorted_set_per_prefix(
    redis_client: Redis, key_prefix: str, cleanup: None
) -> None:
    idx = RedisKvIndex(redis_client, 600, key_prefix)
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
    idx = RedisKvIndex(redis_client, 1, key_prefix)
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
    idx = RedisKvIndex(redis_client, 600, key_prefix)
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
    a = FallbackKvIndex(RedisKvIndex(c1, 600, key_prefix, stats_cache_s=0), InMemoryKvIndex(100))
    b = FallbackKvIndex(RedisKvIndex(c2, 600, key_prefix, stats_cache_s=0), InMemoryKvIndex(100))
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
        await delete_prefix(c1, key_prefix)
        for idx in (a, b):
            await idx.close()
        await c1.aclose(close_connection_pool=True)
        await c2.aclose(close_connection_pool=True)


async def test_redis_scans_stay_inside_the_key_prefix(redis_client: Redis) -> None:
    tag = uuid.uuid4().hex[:12]
    glob_prefix = f"test:{tag}:kv*[x]:"  # glob characters must be matched literally
    other_prefix = f"test:{tag}:kvAx:"  # what the unescaped glob would also match
    mine = RedisKvIndex(redis_client, 600, glob_prefix, stats_cache_s=0)
    other = RedisKvIndex(redis_client, 600, other_prefix, stats_cache_s=0)
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
        await delete_prefix(redis_client, f"test:{tag}:")


async def test_redis_without_fallback_raises(redis_server: RedisServer) -> None:
    client = build_redis(RedisConfig(url=redis_server.url, connect_timeout_ms=200))
    idx = RedisKvIndex(client, 600, "t:kvidx:")
    try:
        await idx.upsert(P(1), "a", 1, GPU)
        redis_server.kill()
        with pytest.raises(KvIndexUnavailable) as info:
            await idx.query_backends(P(1))
        assert (info.value.kind, info.value.operation) == ("redis", "query")
        with pytest.raises(KvIndexUnavailable):
            await idx.upsert(P(1), "a", 1, GPU)
        with pytest.raises(KvIndexUnavailable) as info:
            await idx.write_many([(P(1), "a", 0, None)])
        assert info.value.operation == "write_many"
        with pytest.raises(KvIndexUnavailable) as info:
            await idx.ping()
        assert info.value.operation == "ping"
        with pytest.raises(KvIndexUnavailable):  # nothing switched: every call raises
            await idx.query_backends(P(1))
    finally:
        await idx.close()
        await client.aclose(close_connection_pool=True)


async def test_redis_restore_writes_the_lifetime_left_and_removals(
    redis_client: Redis, key_prefix: str, cleanup: None
) -> None:
    """What the fallback's replay uses: entries keep the expiry they had elsewhere."""
    clock = FakeClock()
    idx = RedisKvIndex(redis_client, 600, key_prefix, clock=clock, stats_cache_s=0)
    await idx.upsert(P(0), "gone", 1, GPU)
    items = [(P(i), "a", i, WARM if i % 2 else GPU, 5.0) for i in range(1, 301)]  # 3 MULTIs
    await idx.restore(iter([*items, (P(0), "gone", 0, None, 0.0)]))
    assert await idx.query_backends(P(0)) is EMPTY
    (e,) = await idx.query_backends(P(7))
    assert (e.token_count, e.tier) == (7, WARM)
    assert e.expires_at == pytest.approx(clock.now + 5, abs=0.01)  # not now + the TTL
    assert (await idx.stats()).prefix_count == 300
    clock.advance(6)
    assert await idx.query_backends(P(7)) is EMPTY


async def test_redis_chain_keys_are_named_by_their_hex(
    redis_client: Redis, key_prefix: str, cleanup: None
) -> None:
    idx = RedisKvIndex(redis_client, 600, key_prefix)
    chain_key = bytes(range(16))
    await idx.upsert(chain_key, "vllm-1", 300, GPU)
    key = (key_prefix + chain_key.hex()).encode()
    assert await redis_client.zrange(key, 0, -1, withscores=True) == [(b"vllm-1", 300.0)]
    assert (await redis_client.hget(key + b":t", "vllm-1") or b"")[:1] == b"g"


async def test_redis_a_prediction_never_shortens_a_key(
    redis_client: Redis, key_prefix: str, cleanup: None
) -> None:
    """A prediction beside an event entry leaves the key's PEXPIRE at the event's TTL; a key
    holding only a prediction expires with it; a later event lengthens it again."""
    idx = RedisKvIndex(redis_client, 600, key_prefix)
    await idx.upsert(P(1), "a", 10, GPU)
    await idx.write_many([(P(1), "b", 5, GPU), (P(2), "b", 5, GPU)], ttl=10)
    k1, k2 = (key_prefix + P(1)).encode(), (key_prefix + P(2)).encode()
    for k in (k1, k1 + b":t"):
        assert 590_000 < await redis_client.pttl(k) <= 600_000
    for k in (k2, k2 + b":t"):
        assert 0 < await redis_client.pttl(k) <= 10_000
    await idx.upsert(P(2), "a", 7, GPU)
    assert 590_000 < await redis_client.pttl(k2) <= 600_000
    await idx.upsert(P(2), "c", 7, GPU, ttl=10)
    assert 590_000 < await redis_client.pttl(k2) <= 600_000
    # A member we cannot date (a foreign tool's) is left alone by a prediction.
    await redis_client.zadd(k2, {"legacy": 4096})
    await idx.upsert(P(2), "legacy", 1, WARM, ttl=10)
    assert state(await idx.query_backends(P(2)))["legacy"] == (4096, GPU)


async def test_redis_query_many_rereads_a_line_it_cannot_parse(
    redis_client: Redis, key_prefix: str, cleanup: None
) -> None:
    """query_many's one-string reply separates fields with spaces; a member with a space
    in it (no backend name has one) makes its key's line odd, and that key is read again
    with the per-key query, so the answer is still exact."""
    idx = RedisKvIndex(redis_client, 600, key_prefix)
    await idx.upsert(P(1), "a", 10, GPU)
    await redis_client.zadd(key_prefix + P(2), {"two words": 5})
    await idx.upsert(P(3), "b", 3, WARM)
    rows = await idx.query_many([P(1), P(2), P(3), P(4)])
    assert [state(r) for r in rows] == [
        {"a": (10, GPU)},
        {"two words": (5, GPU)},
        {"b": (3, WARM)},
        {},
    ]
    assert rows[3] is EMPTY


async def test_redis_query_many_of_more_keys_than_one_script_call(
    redis_client: Redis, key_prefix: str, cleanup: None
) -> None:
    idx = RedisKvIndex(redis_client, 600, key_prefix)
    keys = [i.to_bytes(16, "big") for i in range(1100)]
    await idx.write_many([(k, "a", i, GPU) for i, k in enumerate(keys) if i % 3 == 0])
    rows = await idx.query_many(keys)
    assert len(rows) == 1100
    assert [i for i, r in enumerate(rows) if r] == list(range(0, 1100, 3))
    assert all(r[0].token_count == i for i, r in enumerate(rows) if r)


async def test_a_router_whose_clock_steps_forward_deletes_nothing_of_the_fleets(
    redis_client: Redis, key_prefix: str, cleanup: None
) -> None:
    """Expiries are on Redis's clock: a router whose wall clock jumped an hour ahead sweeps
    the shared index without deleting the live entries every router relies on (on its
    own wall clock it would delete them all)."""
    fleet = RedisKvIndex(redis_client, 600, key_prefix, stats_cache_s=0)
    await fleet.ping()
    await fleet.write_many([(P(i), "vllm-1", 100, GPU) for i in range(20)])
    jumped = RedisKvIndex(
        redis_client,
        600,
        key_prefix,
        clock=ServerClock(wall=lambda: time.time() + 3600),
        stats_cache_s=0,
    )
    assert await jumped.cleanup_expired() == 0
    assert len(state(await fleet.query_backends(P(7)))) == 1
    wall = RedisKvIndex(redis_client, 600, key_prefix, clock=lambda: time.time() + 3600)
    assert await wall.cleanup_expired() == 20  # the same sweep on the jumped wall clock


async def test_the_server_clock_follows_redis_time_and_the_monotonic_clock(
    redis_client: Redis,
) -> None:
    mono = FakeClock(100.0)
    clock = ServerClock(wall=lambda: 0.0, monotonic=mono)
    assert clock() == 0.0 and not clock.synced
    await clock.sync(redis_client)
    seconds, micros = await redis_client.time()
    assert clock.synced and abs(clock() - (seconds + micros / 1e6)) < 1.0
    before = clock()
    mono.advance(5.0)
    assert clock() == pytest.approx(before + 5.0)
