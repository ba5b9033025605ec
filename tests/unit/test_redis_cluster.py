"""``response_cache.redis.mode: cluster`` against a real Redis Cluster: three primaries and
three replicas (``tests.redis_fixture.ClusterSet``), a password on every node.

The response cache's entries are one key each, so they spread over every primary; clear
and the entry count walk every primary; a killed primary makes the cache serve from memory
(counted once) until its replica is promoted, and then the same client reaches the new
primary by itself.

The KV index on a Cluster keeps each backend's keys in one slot (``{<kp><backend>}``), so
two routers share it like one server's; an instrumented client checks that no command or
script of any index operation ever spans two slots. The index's conformance suite runs on
a Cluster too (``test_kvindex.py``), and so do the resync tests.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import pytest
from redis.asyncio.cluster import RedisCluster

from router.cache import RedisCacheStore, build_cache_store
from router.config.models import KvCacheIndexConfig, RedisConfig
from router.kvindex import RedisKvIndex, StorageTier, build_kv_index
from router.redis import RedisPools, build_client, build_redis, close_client
from router.redis.keyspace import scan_pages
from tests.unit.kvindex_support import GPU, WARM, C, FakeClock, P, delete_prefix, new_key_prefix

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


async def test_the_kv_index_keeps_each_backend_in_one_slot_and_routers_share_it(
    cluster_set: ClusterSet, redis_pools: RedisPools
) -> None:
    c = cluster_set
    cfg = config(c)
    built = build_kv_index(KvCacheIndexConfig(backend="redis"), cfg, pools=redis_pools)
    idx = built.inner.primary  # type: ignore[attr-defined]
    assert isinstance(idx, RedisKvIndex) and isinstance(idx.redis, RedisCluster)
    assert idx.redis is redis_pools.client(cfg)  # the response cache's client, shared
    with pytest.raises(ValueError, match="Cluster"):
        redis_pools.get(cfg)  # one server only
    with pytest.raises(ValueError, match="Cluster"):
        build_redis(cfg)
    backends = [f"vllm-{i}" for i in range(12)]
    keys = [f"{i:064x}" for i in range(40)]
    await built.write_many(
        [(k, b, 100 * (j + 1), StorageTier.GPU_HOT) for j, b in enumerate(backends) for k in keys]
    )
    # Another router on its own client sees every backend at once, ordered by tokens.
    other_client = build_client(cfg)
    try:
        other = RedisKvIndex(other_client, 600)
        got = await other.query_many(keys)
        want = [(b, 100 * (j + 1)) for j, b in reversed(list(enumerate(backends)))]
        assert all([(e.backend, e.token_count) for e in g] == want for g in got)
        assert (await other.stats()).prefix_count == 40  # distinct prefixes, not sets
        assert (await other.stats()).entry_count == 40 * 12
        # Each backend's keys are in one slot; the backends spread over every primary.
        direct = await plain(c)
        try:
            slots: dict[str, set[int]] = {}
            async for page in scan_pages(direct, b"{cr:kvidx:*", 500):
                for k in page:
                    name = k[len(b"{cr:kvidx:") : k.index(b"}")].decode()
                    slots.setdefault(name, set()).add(direct.keyslot(k))
            assert set(slots) == set(backends)
            assert all(len(s) == 1 for s in slots.values())
            owners = {c.primary_for(f"{{cr:kvidx:{b}}}") for b in backends}
            assert len(owners) == 3
        finally:
            await direct.aclose()
        assert await other.remove_backend("vllm-0") == 40
        assert {e.backend for e in (await built.query_backends(keys[0]))} == set(backends[1:])
        assert await other.clear() == 40 * 11
        assert await built.query_backends(keys[0]) == ()
    finally:
        await close_client(other_client)
    await built.close()


def check_slots(client: RedisCluster) -> list[tuple[str, int]]:
    """Make ``client`` record the keys of every command it sends (one by one, or as the
    per-node pipelines of ``send_by_node``) and fail on one whose keys are in more than one
    slot, before redis-py or Redis would; the list of the multi-key commands seen (name,
    number of keys). ``client.piped`` lists the sizes of the pipelines answered."""
    seen: list[tuple[str, int]] = []
    send = client.execute_command

    async def execute_command(*args: Any, **kwargs: Any) -> Any:
        name = str(args[0].decode() if isinstance(args[0], bytes) else args[0]).upper()
        if name in ("EVALSHA", "EVAL"):
            keys = list(args[3 : 3 + int(args[2])])
        elif name in ("UNLINK", "DEL", "EXISTS", "MGET", "TOUCH"):
            keys = list(args[1:])
        else:
            keys = []
        if len(keys) > 1:
            slots = {client.keyslot(k) for k in keys}
            assert len(slots) == 1, f"{name} across slots {sorted(slots)}: {keys[:4]}"
            seen.append((name, len(keys)))
        return await send(*args, **kwargs)

    async def send_by_node(commands: Any) -> Any:
        for _, cmd in commands:
            if cmd[0] != "EVALSHA":
                continue  # single-key commands of a scan page
            slots = {client.keyslot(k) for k in cmd[3 : 3 + int(cmd[2])]}
            assert len(slots) == 1, f"EVALSHA across slots {sorted(slots)}"
            seen.append(("EVALSHA", int(cmd[2])))
        replies = await pipe(commands)
        if replies is not None and commands[0][1][0] == "EVALSHA":  # answered, not handed back
            piped.append(len(commands))
        return replies

    pipe = client.send_by_node  # type: ignore[attr-defined]
    piped: list[int] = []
    client.execute_command = execute_command  # type: ignore[method-assign]
    client.send_by_node = send_by_node  # type: ignore[attr-defined]
    client.piped = piped  # type: ignore[attr-defined]
    return seen


async def test_no_command_of_the_kv_index_crosses_a_slot(shared_cluster: ClusterSet) -> None:
    """Every operation of the index, on two instances sharing one Cluster: each script,
    and every multi-key command, keeps to one hash slot."""
    c = shared_cluster
    client = build_client(config(c))
    assert isinstance(client, RedisCluster)
    multi_key = check_slots(client)
    kp = new_key_prefix()
    clock = FakeClock()
    a = RedisKvIndex(client, 60, kp, clock=clock, stats_cache_s=0, backends_refresh_s=0)
    b = RedisKvIndex(client, 60, kp, clock=clock, stats_cache_s=0, backends_refresh_s=0)
    try:
        names = [f"b{i}" for i in range(6)]
        keys = [P(i) for i in range(30)] + [C(i) for i in range(5)]
        await a.upsert(P(0), "b0", 10, GPU)
        await a.upsert(P(1), "b1", 10, GPU, ttl=5)
        await a.write_many([(k, n, 7, WARM) for n in names for k in keys])
        await a.write_many([(k, n, 3, GPU) for n in names for k in keys[:5]], ttl=5)
        await a.write_many([(k, "b2", 0, None) for k in keys[:3]])
        assert await a.set_tier(P(10), "b3", GPU)
        assert await a.remove(P(11), "b3")
        got = await b.query_many(keys)
        assert {e.backend for e in got[10]} == set(names)
        assert {e.backend: e.tier for e in await b.query_backends(P(10))}["b3"] is GPU
        await b.begin_resync("b4")
        await b.write_many([(k, "b4", 99, GPU) for k in keys[:4]])
        await b.end_resync("b4")
        assert {e.backend for e in await a.query_backends(P(20))} == set(names) - {"b4"}
        await a.restore([(P(50), "b5", 5, GPU, 30.0), (P(20), "b5", 0, None, 0.0)])
        assert await a.backend_counts() == {"b0": 35, "b1": 35, "b2": 32, "b3": 34,
                                            "b4": 4, "b5": 35}  # fmt: skip
        clock.advance(61)
        await a.upsert(P(60), "b0", 1, GPU)
        assert await a.cleanup_expired() >= 30 * 5
        assert (await a.stats()).entry_count == 1
        assert await b.remove_backend("b0") == 1
        await a.upsert(P(61), "b1", 1, GPU)
        assert await b.clear() == 1
        assert "EVALSHA" in {n for n, _ in multi_key} and len(multi_key) > 20
        # Queries went out as per-node pipelines of one script call per backend.
        assert 6 in client.piped  # type: ignore[attr-defined]
        piped = len(client.piped)  # type: ignore[attr-defined]
        await a.upsert(P(70), "b1", 5, GPU)
        assert [e.backend for e in await a.query_backends(P(70))] == ["b1"]
        assert len(client.piped) == piped + 1  # type: ignore[attr-defined]
    finally:
        await delete_prefix(client, kp)
        await close_client(client)


async def test_a_backend_another_router_starts_writing_shows_up_in_queries(
    shared_cluster: ClusterSet,
) -> None:
    """On a Cluster a query asks the backends listed in ``<kp>#backends``: one that
    another router writes for the first time after this router's first query is asked
    as soon as the list is read again (``backends_refresh_s``, 0 here)."""
    client = build_client(config(shared_cluster))
    kp = new_key_prefix()
    try:
        reader = RedisKvIndex(client, 600, kp, backends_refresh_s=0)
        writer = RedisKvIndex(client, 600, kp)
        assert await reader.query_backends(P(1)) == ()
        await writer.upsert(P(1), "late", 64, GPU)
        assert [(e.backend, e.token_count) for e in await reader.query_backends(P(1))] == [
            ("late", 64)
        ]
        assert await reader.remove_backend("late") == 1
        # Taken off the list too: nobody asks it any more.
        assert await client.smembers((kp + "#backends").encode()) == set()
    finally:
        await delete_prefix(client, kp)
        await close_client(client)
