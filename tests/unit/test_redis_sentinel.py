"""``response_cache.redis.mode: sentinel`` against real processes: a primary, a replica and
three sentinels (``tests.redis_fixture.SentinelSet``), passwords on both.

The response cache and the KV index share one Sentinel-managed client (``RedisPools``).
Killing the primary makes them serve from memory (counted once per outage); once the
sentinels have promoted the replica, the same client finds the new primary by itself and
both stores switch back (the index replaying what it wrote during the outage).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import pytest
from redis.asyncio import Redis

from router.cache import build_cache_store
from router.config.models import KvCacheIndexConfig, RedisConfig
from router.kvindex import KvIndexUnavailable, RedisKvIndex, build_kv_index
from router.redis import RedisPools
from tests.unit.kvindex_support import GPU, P, state

if TYPE_CHECKING:
    from tests.redis_fixture import SentinelSet

pytest_plugins = ("tests.redis_fixture",)


def config(s: SentinelSet, **over: object) -> RedisConfig:
    return RedisConfig.model_validate(
        {**s.config(), "connect_timeout_ms": 300, "command_timeout_ms": 300, **over}
    )


async def on_port(s: SentinelSet, port: int) -> Redis:
    return Redis(host="127.0.0.1", port=port, password=s.password)


async def test_cache_and_index_follow_a_failover_by_themselves(
    sentinel_set: SentinelSet, redis_pools: RedisPools
) -> None:
    s = sentinel_set
    cfg = config(s)
    cache = build_cache_store("redis", 10, 60, cfg, redis_pools, monitor_interval_s=0.1)
    kv = build_kv_index(KvCacheIndexConfig(backend="redis"), cfg, pools=redis_pools)
    assert len(redis_pools) == 1  # one Sentinel-managed pool for both
    await cache.set("before", b"1")
    await kv.upsert(P(1), "vllm-1", 10, GPU)
    primary = await on_port(s, s.primary.port)
    try:  # replication is asynchronous: make sure the replica has it before the kill
        assert await primary.execute_command("WAIT", 1, 5000) == 1
    finally:
        await primary.aclose()

    old = s.kill_primary()
    # Under the outage nothing raises: both answer from memory.
    await cache.set("during", b"2")
    await kv.upsert(P(2), "vllm-1", 20, GPU)
    assert await cache.get("during") == b"2"
    assert state(await kv.query_backends(P(2))) == {"vllm-1": (20, GPU)}
    cstats = await cache.stats()
    assert cstats.fallback_active and cstats.fallback_count == 1
    assert (await kv.stats()).fallback_active

    new = await asyncio.to_thread(s.wait_failover, old)
    fb = kv.inner
    for _ in range(100):  # the monitors retry every 0.1 s (the index: on demand here)
        if not (await cache.stats()).fallback_active and await fb.try_recover():  # type: ignore[attr-defined]
            break
        await asyncio.sleep(0.1)
    assert not (await cache.stats()).fallback_active
    assert not (await kv.stats()).fallback_active
    assert (await cache.stats()).fallback_count == 1
    # The new primary has what the old one replicated, and the index's outage writes
    # (replayed; the cache keeps its outage answers in memory only), seen by a plain client.
    direct = await on_port(s, new)
    try:
        assert await direct.get(cfg.key_prefix + "before") == b"1"
        idx = RedisKvIndex(direct, 600)
        assert state(await idx.query_backends(P(1))) == {"vllm-1": (10, GPU)}
        assert state(await idx.query_backends(P(2))) == {"vllm-1": (20, GPU)}
    finally:
        await direct.aclose()
    await cache.set("after", b"3")
    assert await cache.get("after") == b"3"
    await cache.close()
    await kv.close()


async def test_wrong_sentinel_password_means_unavailable_not_a_crash(
    sentinel_set: SentinelSet, redis_pools: RedisPools
) -> None:
    s = sentinel_set
    good_cfg = config(s)
    assert good_cfg.sentinel is not None
    bad = config(s, sentinel={**good_cfg.sentinel.model_dump(), "password": "wrong"})
    idx = RedisKvIndex(redis_pools.get(bad), 600)
    with pytest.raises(KvIndexUnavailable):
        await idx.ping()
    good = RedisKvIndex(redis_pools.get(config(s)), 600)
    await good.ping()
    assert len(redis_pools) == 2


async def test_wrong_data_password_means_unavailable(
    sentinel_set: SentinelSet, redis_pools: RedisPools
) -> None:
    idx = RedisKvIndex(redis_pools.get(config(sentinel_set, password="wrong")), 600)
    with pytest.raises(KvIndexUnavailable):
        await idx.ping()


async def test_sentinel_over_tls_and_a_failover(
    sentinel_tls_set: SentinelSet, redis_pools: RedisPools
) -> None:
    """Data nodes and sentinels on TLS only, verified with the deployment's CA; the client
    follows a failover over TLS too. Without TLS the same addresses are unavailable."""
    s = sentinel_tls_set
    cfg = config(s)
    assert cfg.tls and cfg.sentinel is not None and cfg.sentinel.tls
    cache = build_cache_store("redis", 10, 60, cfg, redis_pools, monitor_interval_s=0.1)
    await cache.set("k", b"v")
    assert await cache.get("k") == b"v"
    old = s.kill_primary()
    new = await asyncio.to_thread(s.wait_failover, old)
    for _ in range(100):  # an outage may or may not be seen: the failover may be over
        await cache.set("k3", b"v3")
        if not (await cache.stats()).fallback_active:
            break
        await asyncio.sleep(0.1)
    assert not (await cache.stats()).fallback_active
    assert s.tls is not None
    direct = Redis(host="127.0.0.1", port=new, password=s.password, ssl=True,
                   ssl_ca_certs=s.tls.ca)  # fmt: skip
    try:
        assert await direct.get(cfg.key_prefix + "k3") == b"v3"  # on the new primary
    finally:
        await direct.aclose()
    await cache.close()
    assert cfg.sentinel is not None
    plain_cfg = config(s, tls=False, sentinel={**cfg.sentinel.model_dump(), "tls": False})
    plain = RedisKvIndex(redis_pools.get(plain_cfg), 600)
    with pytest.raises(KvIndexUnavailable):
        await plain.ping()
