"""A resync on the shared Redis index is a generation swap: no reader ever sees it half done.

Two index instances on one real redis-server (and, the same tests, on a real 3-primary
Redis Cluster with its per-backend layout) stand for two routers sharing the index.
While one rebuilds a backend from a snapshot (slowed down on purpose), the other's queries
see the whole old state until the swap and the whole new one after it, never an empty or
partial backend; two resyncing at once converge on one of the snapshots; a router killed
mid-resync (a real process, SIGKILLed) leaves the old state serving and nothing visible of
what it had written.
"""

from __future__ import annotations

import asyncio
import os
import sys
import textwrap
from collections.abc import AsyncIterator

import pytest

from bus.events import KvEvent
from router.config.models import RedisConfig, StorageOffloadingConfig
from router.kvindex import RedisKvIndex, apply_events, end_resync
from router.kvindex.base import Change
from router.redis import RedisClient, build_client, close_client
from tests.unit.kvindex_support import GPU, P, delete_prefix, new_key_prefix

pytest_plugins = ("tests.redis_fixture",)

B = "vllm-1"
OTHER = "vllm-2"
KEYS = [P(i) for i in range(300)]


@pytest.fixture(params=["standalone", "cluster"])
def redis_config(request: pytest.FixtureRequest) -> RedisConfig:
    if request.param == "cluster":
        return RedisConfig.model_validate(request.getfixturevalue("shared_cluster").config())
    return RedisConfig(url=request.getfixturevalue("redis_url"))


@pytest.fixture
async def client(redis_config: RedisConfig) -> AsyncIterator[RedisClient]:
    c = build_client(redis_config)
    try:
        yield c
    finally:
        await close_client(c)


@pytest.fixture
async def prefix(client: RedisClient) -> AsyncIterator[str]:
    kp = new_key_prefix()
    yield kp
    await delete_prefix(client, kp)


def snapshot(lo: int, hi: int, backend: str = B, tokens: int = 16) -> list[Change]:
    return [(P(i), backend, tokens, GPU) for i in range(lo, hi)]


async def holders(idx: RedisKvIndex, backend: str = B) -> dict[int, int]:
    """``{key number: token_count}`` of ``backend`` over ``KEYS``, in one query."""
    found = await idx.query_many(KEYS)
    out: dict[int, int] = {}
    for i, entries in enumerate(found):
        for e in entries:
            if e.backend == backend:
                out[i] = e.token_count
    return out


async def slow_resync(idx: RedisKvIndex, changes: list[Change], step: int = 10) -> None:
    await idx.begin_resync(B)
    for start in range(0, len(changes), step):
        await idx.write_many(changes[start : start + step])
        await asyncio.sleep(0.005)
    await idx.end_resync(B)


async def test_readers_see_the_old_state_until_the_swap_then_the_new(
    client: RedisClient, prefix: str
) -> None:
    writer = RedisKvIndex(client, 600, prefix)
    reader = RedisKvIndex(client, 600, prefix)
    await writer.write_many(snapshot(0, 200) + snapshot(0, 50, OTHER))
    old = {i: 16 for i in range(200)}
    new = {i: 32 for i in range(100, 300)}
    seen: list[dict[int, int]] = []
    task = asyncio.create_task(slow_resync(writer, snapshot(100, 300, tokens=32)))
    while not task.done():
        seen.append(await holders(reader))
        await asyncio.sleep(0)
    await task
    seen.append(await holders(reader))
    assert len(seen) > 20, "the resync was too fast to observe"
    # Every observation is exactly one of the two states, and they never go back.
    kinds = ["old" if s == old else "new" if s == new else repr(s) for s in seen]
    assert set(kinds) <= {"old", "new"}, kinds
    assert kinds[0] == "old" and kinds[-1] == "new"
    assert kinds.index("new") == len(kinds) - kinds[::-1].index("old")
    assert await holders(reader, OTHER) == {i: 16 for i in range(50)}  # untouched
    # The replaced generation is reclaimed: the counts are the new state's own.
    assert await reader.backend_counts() == {B: 200, OTHER: 50}
    assert (await reader.stats()).entry_count == 250


async def test_live_writes_of_other_routers_land_in_the_current_state(
    client: RedisClient, prefix: str
) -> None:
    """During A's resync, B keeps applying live events; they are visible at once (and A
    applies the same events after its snapshot, so the swapped-in state has them too)."""
    a = RedisKvIndex(client, 600, prefix)
    b = RedisKvIndex(client, 600, prefix)
    await a.write_many(snapshot(0, 10))
    await a.begin_resync(B)
    await a.write_many(snapshot(0, 5))
    await b.upsert(P(250), B, 7, GPU)
    await b.remove(P(9), B)
    assert await holders(b) == {**{i: 16 for i in range(9)}, 250: 7}
    await a.end_resync(B)
    assert await holders(b) == {i: 16 for i in range(5)}
    await b.upsert(P(250), B, 7, GPU)  # written after the swap: to the new state
    assert await holders(a) == {**{i: 16 for i in range(5)}, 250: 7}


async def test_two_routers_resyncing_at_once_converge(client: RedisClient, prefix: str) -> None:
    a = RedisKvIndex(client, 600, prefix)
    b = RedisKvIndex(client, 600, prefix)
    await a.write_many(snapshot(0, 300))
    await a.begin_resync(B)
    await b.begin_resync(B)  # the newer generation
    await asyncio.gather(
        slow_resync_rest(a, snapshot(0, 100, tokens=1)),
        slow_resync_rest(b, snapshot(200, 300, tokens=2)),
    )
    want = {i: 2 for i in range(200, 300)}
    assert await holders(a) == want and await holders(b) == want
    assert await a.backend_counts() == {B: 100}
    assert (await a.stats()).entry_count == 100  # the loser's entries are gone too
    # Now the other order of the swaps: the newer one still wins.
    await b.begin_resync(B)
    await a.begin_resync(B)
    await slow_resync_rest(a, snapshot(0, 10, tokens=3))
    await slow_resync_rest(b, snapshot(10, 20, tokens=4))
    assert await holders(b) == {i: 3 for i in range(10)}
    assert (await b.stats()).entry_count == 10


async def slow_resync_rest(idx: RedisKvIndex, changes: list[Change]) -> None:
    for start in range(0, len(changes), 10):
        await idx.write_many(changes[start : start + 10])
        await asyncio.sleep(0.002)
    await idx.end_resync(B)


async def test_remove_backend_empties_it_for_everyone_at_once(
    client: RedisClient, prefix: str
) -> None:
    a = RedisKvIndex(client, 600, prefix)
    b = RedisKvIndex(client, 600, prefix)
    await a.write_many(snapshot(0, 100) + snapshot(0, 100, OTHER))
    assert await a.remove_backend(B) == 100
    assert await holders(b) == {}
    assert len(await holders(b, OTHER)) == 100
    await b.upsert(P(1), B, 5, GPU)  # the next event lands in the new, empty state
    assert await holders(a) == {1: 5}
    assert await a.backend_counts() == {B: 1, OTHER: 100}


async def test_a_resync_restarted_mid_snapshot_reclaims_the_first_attempt(
    client: RedisClient, prefix: str
) -> None:
    idx = RedisKvIndex(client, 600, prefix)
    await idx.write_many(snapshot(0, 10))
    await idx.begin_resync(B)
    await idx.write_many(snapshot(100, 200))  # the stream dropped here
    await idx.begin_resync(B)  # a fresh resync block
    await idx.write_many(snapshot(50, 60))
    assert await holders(idx) == {i: 16 for i in range(10)}
    await idx.end_resync(B)
    assert await holders(idx) == {i: 16 for i in range(50, 60)}
    assert (await idx.stats()).entry_count == 10


_KILLED = textwrap.dedent(
    """
    import asyncio, sys
    from router.config.models import RedisConfig
    from router.kvindex import RedisKvIndex
    from router.kvindex.base import StorageTier
    from router.redis import build_client

    async def main():
        cfg = RedisConfig.model_validate_json(sys.argv[1])
        idx = RedisKvIndex(build_client(cfg), 600, sys.argv[2])
        await idx.begin_resync("vllm-1")
        await idx.write_many(
            [(f"{i:064x}", "vllm-1", 99, StorageTier.GPU_HOT) for i in range(150, 300)]
        )
        print("STAGED", flush=True)
        await asyncio.sleep(3600)

    asyncio.run(main())
    """
)


async def test_a_router_killed_mid_resync_leaves_a_consistent_index(
    client: RedisClient, prefix: str, redis_config: RedisConfig
) -> None:
    reader = RedisKvIndex(client, 600, prefix)
    await reader.write_many(snapshot(0, 200))
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        _KILLED,
        redis_config.model_dump_json(),
        prefix,
        stdout=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 30)
        assert line.strip() == b"STAGED"
    finally:
        proc.kill()  # SIGKILL: no end_resync, no cleanup
        await proc.wait()
    assert await holders(reader) == {i: 16 for i in range(200)}
    assert await reader.backend_counts() == {B: 200}
    # The next resync (this router's, or the restarted one's) replaces the state whole.
    await slow_resync(reader, snapshot(0, 20, tokens=5))
    assert await holders(reader) == {i: 5 for i in range(20)}
    assert await reader.backend_counts() == {B: 20}


async def test_apply_events_swaps_a_sized_resync_in_and_drops_an_unsized_one(
    client: RedisClient, prefix: str
) -> None:
    idx = RedisKvIndex(client, 600, prefix)
    reader = RedisKvIndex(client, 600, prefix)
    off = StorageOffloadingConfig()
    await idx.write_many(snapshot(0, 3))
    snap = [KvEvent("cache_created", B, P(i), 8, "gpu") for i in (5, 6)]
    await apply_events(idx, [KvEvent("resync", B, snapshot_size=2), *snap], off)
    assert await holders(reader) == {0: 16, 1: 16, 2: 16}  # not swapped in yet
    await end_resync(idx, None, B)
    assert await holders(reader) == {5: 8, 6: 8}
    await apply_events(idx, [KvEvent("resync", B, reason="gap")], off)  # size unsaid
    assert await holders(reader) == {}
