"""A Redis Cluster primary SIGKILLed under traffic, through the real router process.

A Redis Cluster of three primaries and three replicas (``tests.redis_fixture.ClusterSet``,
a password on every node, a 1 s node timeout) and a router whose response cache uses it in
``response_cache.redis.mode: cluster``. A primary that holds cache entries is SIGKILLed
while clients keep asking repeated questions. Asserted: no client request fails (the
memory fallback answers during the failover window, and the switch is counted in
/metrics, once), the router reaches the promoted replica by itself (the fallback ends),
and afterwards the cache stores in and answers from the Cluster again.

Then the KV index on the same Cluster (``kv_cache_index.backend: redis``): two simulated
engines publish KV events to the real listener, the primary serving one backend's index
slot is SIGKILLed under traffic, and the index must converge to the listener's state.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import grpc
import pytest
import pytest_asyncio

from bus._gen.continuum.kvindex.v1 import kvindex_pb2_grpc as pb_grpc
from router.config.models import RedisConfig

from .client_load import ClientLoad
from .conftest import RouterProc, StartRouter, backend, chat_body, metric_value, wait_until
from .test_redis_sentinel_failover import KEY_PREFIX, index_state, listener_state
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

if TYPE_CHECKING:
    from harness.sim.fleet import SimFleet
    from tests.redis_fixture import ClusterSet

pytest_plugins = ("tests.redis_fixture",)


def entries_on(c: ClusterSet, port: int) -> int:
    out = c.cli(port, "dbsize").strip()
    return int(out) if out.isdigit() else 0


async def test_primary_killed_under_traffic(
    sims: SimFleet, cluster_set: ClusterSet, start_router: StartRouter
) -> None:
    c = cluster_set
    redis = {
        **c.config(),
        "health_check_interval_ms": 200,
        "connect_timeout_ms": 300,
        "command_timeout_ms": 300,
    }
    router: RouterProc = await start_router(
        {
            "backends": [backend("sim-1", sims.urls[0])],
            "response_cache": {"enabled": True, "backend": "redis", "redis": redis},
        }
    )
    run = uuid.uuid4().hex[:8]
    load = ClientLoad(router, lambda i: chat_body(f"traffic-{run}-{i % 12}", temperature=0))
    async with load:
        await load.served(30, "traffic before the kill")
        # The primary holding the most entries (twelve questions spread over three).
        victim = max(c.primaries(), key=lambda p: entries_on(c, p))
        assert entries_on(c, victim) > 0
        c.kill(victim)
        before_kill = load.count
        await asyncio.to_thread(c.wait_failover, victim)

        async def recovered() -> bool:
            text = await router.metrics()
            return (
                metric_value(text, "continuum_cache_fallback_active") == 0
                and metric_value(text, "continuum_cache_fallback_switches_total") >= 1
            )

        await wait_until(recovered, within=30, interval=0.2, what="the cache back on Redis")
        await load.served(before_kill + 30, "traffic after")
    assert load.failures == [], load.failures[:3]
    text = await router.metrics()
    assert metric_value(text, "continuum_cache_fallback_switches_total") == 1
    assert metric_value(text, "continuum_cache_fallback_active") == 0

    # On the Cluster again: a new answer is stored there and served from there.
    stored = sum(entries_on(c, p) for p in c.primaries())
    body = chat_body(f"after-{run}", temperature=0)
    first = await router.chat(body)
    assert first.status == 200 and first.headers["x-cache"] == "MISS"
    assert sum(entries_on(c, p) for p in c.primaries()) == stored + 1
    second = await router.chat(body)
    assert second.status == 200 and second.headers["x-cache"] == "HIT"
    assert second.json()["choices"] == first.json()["choices"]


@pytest_asyncio.fixture(loop_scope="session")
async def engines(
    tmp_path_factory: pytest.TempPathFactory,
) -> AsyncIterator[tuple[SimFleet, Listener]]:
    async with engines_and_listener(tmp_path_factory.mktemp("cluster")) as pair:
        yield pair


async def test_primary_of_an_index_slot_killed_under_traffic(
    engines: tuple[Any, Listener], cluster_set: ClusterSet, start_router: StartRouter
) -> None:
    """The KV index on the Cluster (each backend's keys in one slot): the primary serving
    a backend's slot is SIGKILLed while clients send requests and the engines produce KV
    events. No client request fails, the index's memory fallback covers the failover once
    and ends by itself, and afterwards the index holds the listener's state, entry by
    entry, read through the Cluster."""
    fleet, listener = engines
    c = cluster_set
    redis = {
        **c.config(),
        "health_check_interval_ms": 200,
        "connect_timeout_ms": 300,
        "command_timeout_ms": 300,
    }
    router: RouterProc = await start_router(
        {
            "server": {"grpc_listen": "127.0.0.1:0"},
            "selection_strategy": "RoundRobin",
            "prefix_routing": {"enabled": True},
            "backends": backends(fleet, salt=False),
            "response_cache": {"enabled": True, "backend": "redis", "redis": redis},
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

    run = uuid.uuid4().hex[:8]
    load = ClientLoad(router, lambda i: {**sys_req(f"traffic-{run}-{i % 7}"), "temperature": 0})
    work = asyncio.create_task(engines_work())
    try:
        async with load:
            await load.served(20, "traffic before the kill")
            victim = c.primary_for("{" + KEY_PREFIX + NAMES[0] + "}")
            assert entries_on(c, victim) > 0
            c.kill(victim)
            before_kill = load.count
            await asyncio.to_thread(c.wait_failover, victim)

            async def recovered() -> bool:
                text = await router.metrics()
                return (
                    metric_value(text, "continuum_kv_index_fallback_active") == 0
                    and metric_value(text, "continuum_cache_fallback_active") == 0
                    and metric_value(text, "continuum_kv_index_fallback_switches_total") >= 1
                )

            await wait_until(recovered, within=30, interval=0.2, what="both stores on Redis")
            await load.served(before_kill + 20, "traffic after")
    finally:
        stop.set()
        with contextlib.suppress(asyncio.CancelledError):
            await work
    assert load.failures == [], load.failures[:3]
    text = await router.metrics()
    assert metric_value(text, "continuum_kv_index_fallback_switches_total") == 1
    assert metric_value(text, "continuum_cache_fallback_switches_total") <= 1

    # The index converges to the listener's state, entry by entry, through the Cluster.
    cfg = RedisConfig.model_validate(c.config())
    assert router.grpc_target is not None
    async with grpc.aio.insecure_channel(router.grpc_target) as channel:
        st = Stack(fleet, listener, router, pb_grpc.KvIndexStub(channel))
        await quiesce(st, within=30)
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
