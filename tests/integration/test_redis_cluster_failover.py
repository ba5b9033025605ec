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
import uuid
from typing import TYPE_CHECKING, Any

from .client_load import ClientLoad
from .conftest import RouterProc, StartRouter, backend, chat_body, metric_value, wait_until
from .redis_failover import (  # noqa: F401 (engines: the fixture)
    KEY_PREFIX,
    engines,
    failover_redis,
    kv_failover_under_traffic,
)
from .test_tier4_e2e import NAMES, Listener

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
    redis = failover_redis(c.config())
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


async def test_primary_of_an_index_slot_killed_under_traffic(
    engines: tuple[Any, Listener],  # noqa: F811 (the imported fixture)
    cluster_set: ClusterSet,
    start_router: StartRouter,
) -> None:
    """The KV index on the Cluster (each backend's keys in one slot): the primary serving
    a backend's slot is SIGKILLed while clients send requests and the engines produce KV
    events. No client request fails, the index's memory fallback covers the failover once
    and ends by itself, and afterwards the index holds the listener's state, entry by
    entry, read through the Cluster."""
    fleet, listener = engines
    c = cluster_set

    def kill() -> None:
        victim = c.primary_for("{" + KEY_PREFIX + NAMES[0] + "}")
        assert entries_on(c, victim) > 0
        c.kill(victim)
        c.wait_failover(victim)

    await kv_failover_under_traffic(
        start_router, fleet, listener, c.config(), kill, cache_switches=(0, 1)
    )
