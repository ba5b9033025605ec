"""``response_cache.redis.mode: cluster`` against a real Redis Cluster: three primaries and
three replicas (``tests.redis_fixture.ClusterSet``), a password on every node.

The response cache's entries are one key each, so they spread over every primary; clear
and the entry count walk every primary; a killed primary makes the cache serve from memory
(counted once) until its replica is promoted, and then the same client reaches the new
primary by itself. The KV index refuses a Cluster (its scripts touch many slots).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import pytest
from redis.asyncio.cluster import RedisCluster

from router.cache import RedisCacheStore, build_cache_store
from router.config.models import KvCacheIndexConfig, RedisConfig
from router.kvindex import CLUSTER_REFUSED, build_kv_index
from router.redis import RedisPools, build_client, build_redis, close_client

if TYPE_CHECKING:
    from tests.redis_fixture import ClusterSet

pytest_plugins = ("tests.redis_fixture",)


def config(c: ClusterSet, **over: object) -> RedisConfig:
    return RedisConfig.model_validate(
        {**c.config(), "connect_timeout_ms": 300, "command_timeout_ms": 300, **over}
    )


async def plain(c: ClusterSet) -> RedisCluster:
    """A bare redis-py Cluster client, to see what is really stored."""
    return RedisCluster(host="127.0.0.1", port=c.nodes[0].port, password=c.password)


async def test_cache_operations_across_every_primary(
    cluster_set: ClusterSet, redis_pools: RedisPools
) -> None:
    c = cluster_set
    cfg = config(c, pool_size=2)
    store = RedisCacheStore(redis_pools.client(cfg), cfg.key_prefix, default_ttl=60)
    assert isinstance(store.redis, RedisCluster)
    keys = [f"k{i}" for i in range(60)]
    for k in keys:
        await store.set(k, k.encode())
    assert [await store.get(k) for k in keys] == [k.encode() for k in keys]
    owners = {c.primary_for(cfg.key_prefix + k) for k in keys}
    assert owners == set(c.primaries()) and len(owners) == 3  # every primary holds some
    # A burst far above pool_size waits for turns instead of failing.
    got = await asyncio.gather(*(store.get(k) for k in keys * 3))
    assert got == [k.encode() for k in keys * 3]

    direct = await plain(c)
    try:
        await direct.set(b"other:keep", b"1")
        assert await store.count_entries() == 60
        assert await store.delete("k0") and not await store.delete("k0")
        assert await store.delete_many(["k1", "k2", "k3", "missing"]) == 3
        stats = await store.stats()
        assert stats.connected and stats.entries == 56
        assert stats.connections is not None
        assert stats.connections["idle"] + stats.connections["active"] >= 3
        assert await store.clear() == 56
        for k in keys:
            assert await store.get(k) is None
        assert await direct.get(b"other:keep") == b"1"  # outside the prefix: untouched
        assert await store.count_entries() == 0
    finally:
        await direct.aclose()


async def test_primary_killed_memory_covers_then_the_promoted_replica_serves(
    cluster_set: ClusterSet, redis_pools: RedisPools
) -> None:
    c = cluster_set
    cfg = config(c)
    cache = build_cache_store("redis", 10, 60, cfg, redis_pools, monitor_interval_s=0.1)
    await cache.set("before", b"1")
    victim = c.primary_for(cfg.key_prefix + "before")
    # Replication is asynchronous: make sure the replica has it before the kill.
    assert (await asyncio.to_thread(c.cli, victim, "wait", "1", "5000")).strip() == "1"

    c.kill(victim)
    # Nothing raises during the outage: the cache answers from memory, one switch.
    await cache.set("before", b"2")
    assert await cache.get("before") == b"2"
    stats = await cache.stats()
    assert stats.fallback_active and stats.fallback_count == 1
    # The other primaries answer, but a recovery check fails while one is away (else the
    # store would switch back and forth until the replica is promoted).
    assert not await cache.try_recover()  # type: ignore[attr-defined]

    promoted = await asyncio.to_thread(c.wait_failover, victim)
    for _ in range(100):  # the monitor retries every 0.1 s
        if not (await cache.stats()).fallback_active:
            break
        await asyncio.sleep(0.1)
    stats = await cache.stats()
    assert not stats.fallback_active and stats.fallback_count == 1
    # Back on the cluster: the promoted replica has the entry written before the kill
    # (the outage write stayed in memory and went with the switch back).
    assert c.primary_for(cfg.key_prefix + "before") == promoted
    assert await cache.get("before") == b"1"
    await cache.set("after", b"3")
    assert await cache.get("after") == b"3"

    c.restart(victim)  # the old primary rejoins, as a replica of the one that replaced it
    await asyncio.to_thread(c.wait_ready)
    assert victim not in c.primaries()
    assert await cache.get("after") == b"3"
    await cache.close()


async def test_the_kv_index_refuses_a_cluster(
    cluster_set: ClusterSet, redis_pools: RedisPools
) -> None:
    cfg = config(cluster_set)
    with pytest.raises(ValueError, match="hash slots") as e:
        build_kv_index(KvCacheIndexConfig(backend="redis"), cfg, pools=redis_pools)
    assert str(e.value) == CLUSTER_REFUSED
    with pytest.raises(ValueError, match="hash slots"):
        build_kv_index(KvCacheIndexConfig(backend="redis"), cfg)
    with pytest.raises(ValueError, match="Cluster"):
        redis_pools.get(cfg)
    with pytest.raises(ValueError, match="Cluster"):
        build_redis(cfg)
    assert len(redis_pools) == 0  # nothing was built for the refused client
    # The cache and a memory index are fine on the same config.
    build_kv_index(KvCacheIndexConfig(backend="memory"), cfg, pools=redis_pools)
    client = build_client(cfg)
    try:
        assert await client.ping()
    finally:
        await close_client(client)


async def test_wrong_password_means_unavailable_not_a_crash(
    cluster_set: ClusterSet, redis_pools: RedisPools
) -> None:
    from router.cache import CacheUnavailable

    store = RedisCacheStore(redis_pools.client(config(cluster_set, password="wrong")), "cr:resp:")
    with pytest.raises(CacheUnavailable):
        await store.get("x")


async def test_cluster_over_tls(cluster_tls_set: ClusterSet, redis_pools: RedisPools) -> None:
    """Every node TLS only (clients, bus, replication), verified with the deployment's CA;
    without ``tls`` the same nodes are unavailable, not a crash."""
    from router.cache import CacheUnavailable

    c = cluster_tls_set
    cfg = config(c)
    assert cfg.tls and cfg.tls_ca_file
    store = RedisCacheStore(redis_pools.client(cfg), cfg.key_prefix)
    for i in range(20):
        await store.set(f"t{i}", b"v")
    assert await store.count_entries() == 20
    assert await store.clear() == 20
    plain_cfg = config(c, tls=False, tls_ca_file=None)
    with pytest.raises(CacheUnavailable):
        await RedisCacheStore(redis_pools.client(plain_cfg), cfg.key_prefix).get("t0")
