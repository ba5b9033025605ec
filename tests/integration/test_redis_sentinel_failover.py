"""Redis Sentinel failover under traffic, through the real router process.

A primary, a replica and three sentinels (``tests.redis_fixture.SentinelSet``; passwords
on the data nodes and on the sentinels), two simulated engines publishing KV events to the
real listener, and a router whose response cache and KV index both use Redis in
``mode: sentinel``. The primary is SIGKILLed while clients keep sending requests and the
engines keep producing KV events. Asserted: no client request fails (the memory fallbacks
answer during the failover window, and the switches are counted in /metrics), the router
finds the new primary by itself (both fallbacks end), and afterwards the KV index in Redis
holds exactly the listener's state, entry by entry.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

from .conftest import StartRouter
from .redis_failover import engines, kv_failover_under_traffic  # noqa: F401 (the fixture)
from .test_tier4_e2e import Listener

if TYPE_CHECKING:
    from tests.redis_fixture import SentinelSet

pytest.importorskip("tokenizers")

pytest_plugins = ("tests.redis_fixture",)


async def test_primary_killed_under_traffic(
    engines: tuple[Any, Listener],  # noqa: F811 (the imported fixture)
    sentinel_set: SentinelSet,
    start_router: StartRouter,
) -> None:
    fleet, listener = engines
    s = sentinel_set

    def kill() -> None:
        s.wait_failover(s.kill_primary())

    await kv_failover_under_traffic(start_router, fleet, listener, s.config(), kill)
