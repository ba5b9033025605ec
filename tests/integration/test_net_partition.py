"""A listener<->router path that goes silent for good (a NAT that lost its state: no FIN,
no RST, ever) is noticed within the configured bound and the stream resumes over a new
connection, in pull (the router's SSE ``read_timeout_ms`` against the listener's
heartbeats) and in push (HTTP/2 keepalive on both ends of the event bus).

Real processes (engines, listener, router) with a ``harness.netproxy.BlackholeProxy`` on
the path, the fault matrix's own stack (``tests.faults.stack``) with short timeouts.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.faults.stack import FaultStack, StackOptions
from tests.faults.traffic import tenant_body, tenant_key
from tests.integration.conftest import http, wait_until

pytestmark = pytest.mark.slow

PULL = StackOptions(
    engines=1,
    net_proxy=True,
    listener_extra={"heartbeat_interval_ms": 200},
    event_source_extra=(("read_timeout_ms", 1000),),
)
PUSH = StackOptions(
    engines=1,
    transport="push",
    net_proxy=True,
    listener_bus_extra=(("keepalive_time", "1s"), ("keepalive_timeout", "1s")),
    router_bus_extra=(
        ("keepalive_time_ms", 1000),
        ("keepalive_timeout_ms", 1000),
        ("min_client_ping_interval_ms", 500),
    ),
)


async def _served(stack: FaultStack, tenant: int) -> str:
    assert stack.router is not None
    r = await http("POST", stack.router.url + "/v1/chat/completions", json=tenant_body(tenant, 1))
    assert r.status == 200, r
    return tenant_key(tenant)


async def _index_follows_a_clear_behind_a_stranded_path(stack: FaultStack) -> None:
    """Entries are indexed, the path's connections go silent for good, the engine drops
    its cache: the router's index must follow over a new connection."""
    keys = {await _served(stack, t) for t in range(2)}

    async def indexed() -> bool:
        return (await stack.compare(keys)).clean and (await stack.index(keys))[0] != set()

    await wait_until(indexed, within=20, what="the tenants' keys indexed")
    accepted = stack.net.accepted if stack.net is not None else 0
    await stack.strand_path()
    await stack.clear_engine(0)

    async def cleared() -> bool:
        return (await stack.index(keys))[0] == set()

    # Without a dead-stream bound the router waits on the stranded stream for ever (pull:
    # 60 s of read timeout; push: 30 s of keepalive): well past this.
    await wait_until(cleared, within=15, interval=0.2, what="the clear reaching the index")
    assert stack.net is not None and stack.net.accepted > accepted  # a new connection
    assert (await stack.compare(keys)).clean


async def test_pull_a_silent_dead_sse_stream_is_dropped_after_read_timeout(
    tmp_path: Path,
) -> None:
    stack = FaultStack(PULL, tmp_path)
    try:
        await stack.start()
        await _index_follows_a_clear_behind_a_stranded_path(stack)
        (backend,) = await stack.kv_backends()
        assert backend["connection"]["connected"]
    finally:
        await stack.close()


async def test_push_a_silent_dead_bus_connection_is_redialled_after_keepalive(
    tmp_path: Path,
) -> None:
    stack = FaultStack(PUSH, tmp_path)
    try:
        await stack.start()
        await _index_follows_a_clear_behind_a_stranded_path(stack)
    finally:
        await stack.close()
