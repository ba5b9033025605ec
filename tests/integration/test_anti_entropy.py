"""Anti-entropy end to end: the router's divergence metric against a real listener.

Real processes (the fault matrix's stack: two simulated engines with Qwen2's tokenizer,
the listener in conversation mode, the router pulling both streams into its prefix and
conversation indexes, ``kv_cache_index.anti_entropy`` every 0.2 s). Multi-turn chat
traffic fills both kinds of keys; then:

* on the healthy stack, settled checks read ``continuum_kv_index_divergence`` 0 for every
  backend, missing and extra;
* after the entries of one backend are removed behind the router's back (gRPC
  ``KvIndex.Clear``, which no event reports), the metric reads exactly the number
  removed, of both kinds, as missing, and the other backend still 0;
* with ``repair: true`` the stream of that backend is resynced after two divergent
  checks and its entries are back (the index matches the engines' truth again);
* in push mode (the listener dials the router's event bus; the router cannot reach its
  HTTP port) the same figures come from snapshots asked for on the bus session.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from bus._gen.continuum.kvindex.v1 import kvindex_pb2 as pb
from tests.faults.stack import FaultStack, StackOptions
from tests.faults.traffic import Traffic

from .conftest import metric_value, wait_until

pytest.importorskip("tokenizers")

DIVERGENCE = "continuum_kv_index_divergence"
CHECKS = "continuum_kv_anti_entropy_checks_total"
REPAIRS = "continuum_kv_anti_entropy_repairs_total"


async def _stack(tmp: Path, repair: bool, transport: str = "pull") -> FaultStack:
    opts = StackOptions(anti_entropy_s=0.2, anti_entropy_repair=repair, transport=transport)
    stack = FaultStack(opts, tmp)
    await stack.start()
    assert stack.router is not None
    router = stack.router
    traffic = Traffic(url=lambda: router.url, turns=3, tenants=4, clients=2)
    traffic.start()
    try:

        async def both_kinds_held() -> bool:
            conv = await stack.truth_conversation()
            return all(len(conv[n]) >= 4 for n in stack.names) and all(
                (await stack.truth()).values()
            )

        await wait_until(both_kinds_held, within=60, what="prefix and conversation keys")
    finally:
        await traffic.stop()

    async def matches() -> bool:
        kinds = await stack.compare_kinds(set())
        return all(c.clean for c in kinds.values())

    await wait_until(matches, within=30, what="the index to match the engines' truth")
    return stack


@pytest_asyncio.fixture(loop_scope="session", params=["pull", "push"])
async def stack(tmp_path: Path, request: pytest.FixtureRequest) -> AsyncIterator[FaultStack]:
    s = await _stack(tmp_path, repair=False, transport=request.param)
    try:
        yield s
    finally:
        await s.close()


async def _metrics(stack: FaultStack) -> str:
    assert stack.router is not None
    return await stack.router.metrics()


async def _settled_twice_more(stack: FaultStack, backend: str) -> None:
    before = metric_value(await _metrics(stack), CHECKS, backend=backend, outcome="settled")

    async def more() -> bool:
        now = metric_value(await _metrics(stack), CHECKS, backend=backend, outcome="settled")
        return now >= before + 2

    await wait_until(more, within=30, what=f"two more settled checks of {backend}")


async def test_divergence_is_zero_then_the_count_removed_behind_the_routers_back(
    stack: FaultStack,
) -> None:
    for name in stack.names:
        await _settled_twice_more(stack, name)
    text = await _metrics(stack)
    for name in stack.names:
        assert metric_value(text, DIVERGENCE, backend=name, kind="missing") == 0, text
        assert metric_value(text, DIVERGENCE, backend=name, kind="extra") == 0, text
    assert stack.stub is not None
    cleared = await stack.stub.Clear(pb.ClearRequest(backend="sim-1"), timeout=5)
    assert cleared.removed > 0 and cleared.chain_removed > 0, cleared
    removed = cleared.removed + cleared.chain_removed
    await _settled_twice_more(stack, "sim-1")
    text = await _metrics(stack)
    assert metric_value(text, DIVERGENCE, backend="sim-1", kind="missing") == removed, text
    assert metric_value(text, DIVERGENCE, backend="sim-1", kind="extra") == 0, text
    assert metric_value(text, DIVERGENCE, backend="sim-2", kind="missing") == 0, text
    assert metric_value(text, REPAIRS, backend="sim-1") == 0  # repair is off
    doc = (await stack.kv_stats())["anti_entropy"]["backends"]["sim-1"]
    div = doc["divergence"]
    assert div["missing"]["prefix"] == cleared.removed
    assert div["missing"]["conversation"] == cleared.chain_removed
    if stack.opts.transport == "push":  # every snapshot was asked for on the bus session
        bus = (await stack.kv_stats())["event_bus"]
        assert bus["snapshot_requests"] >= 6 and bus["snapshot_failures"] == 0, bus


async def test_repair_resyncs_a_backend_divergent_twice(tmp_path: Path) -> None:
    stack = await _stack(tmp_path, repair=True)
    try:
        assert stack.stub is not None
        cleared = await stack.stub.Clear(pb.ClearRequest(backend="sim-2"), timeout=5)
        assert cleared.removed + cleared.chain_removed > 0

        async def repaired() -> bool:
            text = await _metrics(stack)
            return metric_value(text, REPAIRS, backend="sim-2") >= 1

        await wait_until(repaired, within=30, what="a repair of sim-2")

        async def matches() -> bool:
            kinds = await stack.compare_kinds(set())
            return all(c.clean for c in kinds.values())

        await wait_until(matches, within=30, what="sim-2's entries back from the resync")
        await _settled_twice_more(stack, "sim-2")
        text = await _metrics(stack)
        assert metric_value(text, DIVERGENCE, backend="sim-2", kind="missing") == 0, text
        assert metric_value(text, REPAIRS, backend="sim-1") == 0
    finally:
        await stack.close()
