"""A Redis primary killed under traffic with the KV index on Redis: the part every
deployment (Sentinel, Cluster) shares.

:func:`kv_failover_under_traffic` starts a router whose response cache and KV index use
the given ``response_cache.redis`` section, with two simulated engines publishing KV
events to the real listener; while clients send requests and the engines keep working it
calls ``kill`` (in a thread: kill a primary, wait for the failover) and then asserts: no
client request failed, the index's memory fallback switched (at most a few times) and
ended by itself (the cache's too, when ``cache_switches`` says so), and the index in Redis
holds exactly the listener's state, entry by entry (:func:`index_state` reads either key layout).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import grpc
import pytest
import pytest_asyncio

from bus._gen.continuum.kvindex.v1 import kvindex_pb2_grpc as pb_grpc
from bus.events import KvEvent
from bus.sse import SseParser
from harness.sim.fleet import SimFleet
from router.config.models import RedisConfig
from router.kvindex import RedisKvIndex
from router.redis import build_client, close_client
from router.redis.keyspace import scan_pages

from .client_load import ClientLoad
from .conftest import StartRouter, metric_value, wait_until
from .test_tier4_e2e import (
    NAMES,
    SALT_ENV,
    SECRET,
    Listener,
    Stack,
    backends,
    direct,
    engines_and_listener,
    event_sources,
    kv_backends,
    quiesce,
    sys_req,
)

__all__ = [
    "KEY_PREFIX",
    "engines",
    "failover_redis",
    "index_state",
    "kv_failover_under_traffic",
]

KEY_PREFIX = "cr:kvidx:"
Entries = dict[tuple[str, str], tuple[int, str]]


@pytest_asyncio.fixture(loop_scope="session")
async def engines(
    tmp_path_factory: pytest.TempPathFactory,
) -> AsyncIterator[tuple[SimFleet, Listener]]:
    """Two simulated engines and the real listener (a test module imports this fixture)."""
    async with engines_and_listener(tmp_path_factory.mktemp("redis-failover")) as pair:
        yield pair


def failover_redis(deployment: dict[str, Any]) -> dict[str, Any]:
    """``response_cache.redis`` for a failover test: short timeouts, a fast recovery check."""
    return {
        **deployment,
        "health_check_interval_ms": 200,
        "connect_timeout_ms": 300,
        "command_timeout_ms": 300,
    }


async def listener_state(listener: Listener) -> Entries:
    """Every backend's snapshot as the listener sends it to a new subscriber."""
    out: Entries = {}
    timeout = aiohttp.ClientTimeout(total=10)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        for name in NAMES:
            parser = SseParser()
            async with session.get(f"{listener.url}/events/{name}") as resp:
                assert resp.status == 200
                done = False
                async for chunk in resp.content.iter_any():
                    for rec in parser.feed(chunk):
                        ev = KvEvent.from_json(rec.data, event_field=rec.event, backend=name)
                        if ev.event == "cache_created":
                            assert ev.prefix_hash is not None
                            tier = "storage" if ev.tier == "storage" else "gpu"
                            out[(ev.prefix_hash, name)] = (ev.token_count or 0, tier)
                        if rec.id is not None and ".s" not in rec.id:
                            done = True  # the last record of the resync block
                    if done:
                        break
    return out


async def index_state(config: RedisConfig) -> Entries:
    """Every live entry of the KV index in Redis (the primary Sentinel names now; on a
    Cluster, every primary and every backend's ``{cr:kvidx:<backend>}`` sets)."""
    client = build_client(config)
    try:
        idx = RedisKvIndex(client, 600, KEY_PREFIX)
        prefixes: set[str] = set()
        for match in (KEY_PREFIX + "*", "{" + KEY_PREFIX + "*"):
            async for page in scan_pages(client, match, 500, "zset"):
                for key in page:
                    prefixes.add(key.decode().rpartition("}")[2].removeprefix(KEY_PREFIX))
        order = sorted(prefixes)
        out: Entries = {}
        for prefix, entries in zip(order, await idx.query_many(order), strict=True):
            for e in entries:
                tier = "storage" if e.tier.name == "STORAGE_WARM" else "gpu"
                out[(prefix, e.backend)] = (e.token_count, tier)
        return out
    finally:
        await close_client(client)


async def kv_failover_under_traffic(
    start_router: StartRouter,
    fleet: SimFleet,
    listener: Listener,
    redis: dict[str, Any],
    kill: Callable[[], object],
    *,
    cache_switches: tuple[int, ...] = (1,),
) -> None:
    """The whole test (module docstring); ``cache_switches``: the counts of cache fallback
    switches allowed (a Cluster primary may hold none of the few cache keys)."""
    router = await start_router(
        {
            "server": {"grpc_listen": "127.0.0.1:0"},
            "selection_strategy": "RoundRobin",
            "prefix_routing": {"enabled": True},
            "backends": backends(fleet, salt=False),
            "response_cache": {"enabled": True, "backend": "redis", "redis": failover_redis(redis)},
            "kv_cache_index": {
                "enabled": True,
                "backend": "redis",
                "salt_secret_env": SALT_ENV,
                "event_sources": event_sources(listener),
            },
        },
        env={SALT_ENV: SECRET},
    )

    async def connected() -> bool:
        return all(b["connection"]["connected"] for b in await kv_backends(router))

    await wait_until(connected, within=10, what="the router's event consumers")
    stop = asyncio.Event()

    async def engines_work() -> None:
        for i in itertools.count():
            if stop.is_set():
                return
            await direct(fleet.urls[i % len(NAMES)], sys_req(f"work-{i}"))

    # Repeated questions (cache hits) and prompts the engines hold (KV routing).
    load = ClientLoad(router, lambda i: {**sys_req(f"traffic-{i % 7}"), "temperature": 0})
    work = asyncio.create_task(engines_work())
    try:
        async with load:
            await load.served(20, "traffic before the kill")
            await asyncio.to_thread(kill)
            before_kill = load.count

            async def recovered() -> bool:
                text = await router.metrics()
                return (
                    metric_value(text, "continuum_cache_fallback_active") == 0
                    and metric_value(text, "continuum_kv_index_fallback_active") == 0
                    and metric_value(text, "continuum_kv_index_fallback_switches_total") >= 1
                    and metric_value(text, "continuum_cache_fallback_switches_total")
                    >= min(cache_switches)
                )

            await wait_until(recovered, within=30, interval=0.2, what="both stores back on Redis")
            await load.served(before_kill + 20, "traffic after")
    finally:
        stop.set()
        with contextlib.suppress(asyncio.CancelledError):
            await work
    assert load.failures == [], load.failures[:3]
    text = await router.metrics()
    # A failover may take the store away more than once (the old primary's slots answer
    # again before the promotion settles, seen under load): what a user relies on is that
    # every request was served, the fallback ended and the index converges, not the count.
    cache_count = metric_value(text, "continuum_cache_fallback_switches_total")
    assert min(cache_switches) <= cache_count <= max(cache_switches) + 2, cache_count
    switches = metric_value(text, "continuum_kv_index_fallback_switches_total")
    assert 1 <= switches <= 3, [  # each switch logs why
        line for line in router.log().splitlines() if "KV index" in line
    ][-10:]

    # The index converges to the listener's state, entry by entry.
    cfg = RedisConfig.model_validate(redis)
    assert router.grpc_target is not None
    async with grpc.aio.insecure_channel(router.grpc_target) as channel:
        st = Stack(fleet, listener, router, pb_grpc.KvIndexStub(channel))
        await quiesce(st, within=60)
    want = await listener_state(listener)
    assert len(want) > 20, "the engines held too little to compare"
    assert {b for _, b in want} == set(NAMES)

    async def converged() -> bool:
        return await index_state(cfg) == want

    try:
        await wait_until(converged, within=15, interval=0.2, what="the index = the listener")
    except AssertionError:
        got = await index_state(cfg)
        missing = {k: v for k, v in want.items() if got.get(k) != v}
        extra = {k: v for k, v in got.items() if k not in want}
        raise AssertionError(
            f"missing/different {list(missing.items())[:5]}, extra {list(extra.items())[:5]}"
        ) from None
