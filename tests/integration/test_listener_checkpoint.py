"""A listener SIGKILLed and restarted beside a running engine keeps what the engine holds.

Real processes: a simulated vLLM engine (KV events over ZMQ, a replay buffer of 8
batches or no replay socket at all), the KV listener with ``checkpoint_dir``, and the
router pulling its events, on the fault matrix's stack (``tests.faults.stack``). The
engine stores each tenant's system prompt once; afterwards those prefixes are cache hits
that store nothing, so a listener that restarts empty never learns them again and the
router's index loses them. With checkpoints the restarted listener resumes from its file:
the index must keep every (key, backend) pair the engine holds, and nothing stale.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from listener.checkpoint import read_checkpoint
from tests.faults.stack import FaultStack, StackOptions
from tests.faults.traffic import tenant_body, tenant_key
from tests.integration.conftest import http, wait_until

pytestmark = pytest.mark.timeout(180)

TENANTS = 4


async def ask(stack: FaultStack, tenant: int, n: int) -> None:
    assert stack.router is not None
    r = await http("POST", stack.router.url + "/v1/chat/completions", json=tenant_body(tenant, n))
    assert r.status == 200, r


async def source_stats(stack: FaultStack) -> dict[str, Any]:
    assert stack.listener is not None
    r = await http("GET", stack.listener.url + "/stats", total_s=5)
    assert r.status == 200, r
    stats: dict[str, Any] = r.json()["sources"]["sim-1"]
    return stats


@pytest.mark.parametrize("replay", [True, False], ids=["short-replay", "no-replay"])
async def test_a_restarted_listener_keeps_what_the_engine_holds(
    tmp_path: Path, replay: bool
) -> None:
    stack = FaultStack(StackOptions(engines=1, replay=replay, buffer_steps=8, checkpoint=True),
                       tmp_path)  # fmt: skip
    try:
        await stack.start()
        keys = {tenant_key(t) for t in range(TENANTS)}
        for t in range(TENANTS):
            await ask(stack, t, 0)

        async def indexed() -> bool:
            c = await stack.compare(keys)
            return c.clean and c.held == TENANTS

        await wait_until(indexed, within=30, what="the router's index of every tenant")
        path = tmp_path / "checkpoints" / "sim-1.ckpt"

        async def checkpointed() -> bool:
            try:
                cp = read_checkpoint(path)
            except ValueError:
                return False
            return cp is not None and {p[0].hex() for p in cp.state["prefixes"]} >= keys

        await wait_until(checkpointed, within=15, what="a checkpoint holding every tenant")

        await stack.kill_listener()
        for n in range(1, 6):  # served from cache while the listener is down: many batches
            await asyncio.gather(*(ask(stack, t, n) for t in range(TENANTS)))
        await stack.start_listener()
        await stack.wait_connected()

        async def kept() -> bool:
            return (await stack.compare(keys)).clean

        await wait_until(kept, within=30, what="the index to match the engine")
        for n in range(6, 8):  # traffic after the restart changes nothing of that
            await asyncio.gather(*(ask(stack, t, n) for t in range(TENANTS)))
        await wait_until(kept, within=30, what="the index to match the engine")
        final = await stack.compare(keys)
        assert final.held == TENANTS and final.lost_count == 0 and final.stale_count == 0

        st = await source_stats(stack)
        assert (st["checkpoint_loaded"], st["checkpoint_rejected"], st["restarts"]) == (1, 0, 0)
        assert st["gap_batches"] > 0  # the buffer (or no replay) could not cover the outage
        assert st["view_incomplete"] == 1
        assert any(b["view_incomplete"] for b in await stack.kv_backends())

        assert stack.listener is not None
        before = time.time()
        assert await stack.listener.stop() == 0  # SIGTERM: the last state is written
        cp = read_checkpoint(path)
        assert cp is not None and cp.written_at >= before
        assert {p[0].hex() for p in cp.state["prefixes"]} >= keys
    finally:
        await stack.close()
