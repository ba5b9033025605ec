"""``continuum.kvindex.v1.KvIndex`` over the conversation index, on the real router process.

The router runs with Tier 4 and conversation routing on (memory indexes, storage
offloading tracked) and ``server.grpc_listen: 127.0.0.1:0``. Its event sources point at
an in-test SSE server that serves fixed records, so both indexes' content is known
exactly. ``KEYS`` is a real ``bus.prompt_chain`` chain (6 keys of 1024 bytes):

* ``b-1`` holds ``KEYS[0..3]`` (256 tokens a chunk: 1024 at the deepest, GPU) and the
  prefix ``PREFIX`` (one prefix entry);
* ``b-2`` holds ``KEYS[0..1]`` on the GPU and ``KEYS[2]`` offloaded (760 tokens);
* ``b-3`` has no event source and holds nothing.

The expectations follow ``proto/continuum/kvindex/v1/kvindex.proto``: a chain of
``KEYS`` with 6244 prompt bytes is 1561 tokens at b-1's 0.25 tokens per byte, so the costs
are b-1 1561 - 1024 = 537, b-2 1561 - 0.5 * 760 = 1181, b-3 1561. One router is shared by
the module; the test that clears runs last.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest
import pytest_asyncio
from aiohttp import web

from bus._gen.continuum.kvindex.v1 import kvindex_pb2 as pb
from bus._gen.continuum.kvindex.v1 import kvindex_pb2_grpc as pb_grpc
from bus.events import KvEvent
from bus.prompt_chain import chain_keys, chain_root
from bus.sse import encode_record

from .conftest import RouterLauncher, RouterProc, authed_channel, http, wait_until

MODEL = "demo-model"
TOKEN_ENV = "CONTINUUM_TEST_KVCHAIN_ADMIN_TOKEN"
TOKEN = "kvchain-grpc-admin-token"
AUTH = (("authorization", f"Bearer {TOKEN}"),)
KEYS = [k.hex() for k in chain_keys(bytes(range(256)) * 24, chain_root(MODEL), 1024)]
assert len(KEYS) == 6
PREFIX = "ab" * 32
PROMPT_BYTES = 6 * 1024 + 100


def created(backend: str, i: int, tokens: int) -> KvEvent:
    return KvEvent("chain_created", backend, None, tokens, "gpu", chain_key=KEYS[i])


EVENTS: dict[str, list[KvEvent]] = {
    "b-1": [
        KvEvent("cache_created", "b-1", PREFIX, 300, "gpu"),
        *(created("b-1", i, 256 * (i + 1)) for i in range(4)),
    ],
    "b-2": [
        created("b-2", 0, 256),
        created("b-2", 1, 512),
        KvEvent("chain_offloaded", "b-2", None, 760, "storage", chain_key=KEYS[2]),
    ],
}


class FixedSse:
    """``GET /events/{backend}``: the backend's fixed records, then an open, idle stream."""

    def __init__(self) -> None:
        self._runner: web.AppRunner | None = None
        self._closing = asyncio.Event()
        self.url = ""

    async def start(self) -> FixedSse:
        app = web.Application()
        app.router.add_get("/events/{backend}", self._events)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"
        return self

    async def close(self) -> None:
        self._closing.set()
        if self._runner is not None:
            await self._runner.cleanup()

    async def _events(self, request: web.Request) -> web.StreamResponse:
        backend = request.match_info["backend"]
        if backend not in EVENTS:
            raise web.HTTPNotFound()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i, ev in enumerate(EVENTS[backend], 1):
            await resp.write(encode_record(ev.to_json(), event=ev.event, id=f"fixed-{i}"))
        await self._closing.wait()
        return resp


class Rig:
    def __init__(self, router: RouterProc, channel: grpc.aio.Channel) -> None:
        self.router = router
        self.stub = pb_grpc.KvIndexStub(channel)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def rig(module_router_launcher: RouterLauncher) -> AsyncIterator[Rig]:
    sse = await FixedSse().start()
    try:
        router = await module_router_launcher.start(
            {
                "server": {"grpc_listen": "127.0.0.1:0", "admin_token_env": TOKEN_ENV},
                "health_check": {"enabled": False},
                "prefix_routing": {"enabled": True},
                "selection_strategy": "RoundRobin",
                "backends": [
                    {"name": n, "url": f"http://127.0.0.1:{9 + i}", "models": [MODEL]}
                    for i, n in enumerate(("b-1", "b-2", "b-3"))
                ],
                "kv_cache_index": {
                    "enabled": True,
                    "storage_offloading": {"enabled": True},
                    "conversation": {"enabled": True, "max_entries": 1000},
                    "event_sources": [
                        {"backend_name": n, "endpoint": f"{sse.url}/events/{n}"}
                        for n in ("b-1", "b-2")
                    ],
                },
            },
            env={TOKEN_ENV: TOKEN},
        )
        assert router.grpc_target is not None
        async with authed_channel(router.grpc_target, TOKEN) as channel:
            rig = Rig(router, channel)

            async def indexed() -> bool:
                st = await rig.stub.Stats(pb.StatsRequest(), timeout=5)
                return st.total_entries == 1 and st.chain.total_entries == 7

            await wait_until(indexed, within=10, what="the fixed events in both indexes")
            yield rig
    finally:
        await sse.close()


async def rpc_error(call: object) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call  # type: ignore[misc]
    return err.value


# -- Query -------------------------------------------------------------------------------


async def test_query_by_chain_key(rig: Rig) -> None:
    reply = await rig.stub.Query(pb.QueryRequest(chain_key=KEYS[2].upper()), timeout=5)
    assert (reply.chain_key, reply.prefix_hash) == (KEYS[2], "")
    assert [(e.backend, e.token_count, e.tier) for e in reply.entries] == [
        ("b-1", 768, pb.TIER_GPU_HOT),
        ("b-2", 760, pb.TIER_STORAGE_WARM),
    ]
    assert all(e.expires_at_unix_ms > 0 for e in reply.entries)
    deep = await rig.stub.Query(pb.QueryRequest(chain_key=KEYS[3]), timeout=5)
    assert [(e.backend, e.token_count) for e in deep.entries] == [("b-1", 1024)]
    unknown = await rig.stub.Query(pb.QueryRequest(chain_key=KEYS[5]), timeout=5)
    assert list(unknown.entries) == []
    # The prefix index is the same as without conversation routing.
    prefix = await rig.stub.Query(pb.QueryRequest(prefix_hash=PREFIX), timeout=5)
    assert [(e.backend, e.token_count) for e in prefix.entries] == [("b-1", 300)]


@pytest.mark.parametrize(
    "req",
    [
        pb.QueryRequest(chain_key="abc"),
        pb.QueryRequest(chain_key="g" * 32),
        pb.QueryRequest(chain_key="0" * 64),
        pb.QueryRequest(chain_key="0" * 32, prefix_hash=PREFIX),
    ],
    ids=["short", "not-hex", "a-prefix-hash", "both"],
)
async def test_query_rejects_a_bad_chain_key(rig: Rig, req: pb.QueryRequest) -> None:
    err = await rpc_error(rig.stub.Query(req, timeout=5))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err
    assert "chain_key" in (err.details() or ""), err.details()


# -- Score -------------------------------------------------------------------------------


async def test_score_a_chain_by_conversation_depth(rig: Rig) -> None:
    reply = await rig.stub.Score(
        pb.ScoreRequest(chain=pb.PromptChain(keys=KEYS, prompt_bytes=PROMPT_BYTES)), timeout=5
    )
    assert (reply.prefix_hash, list(reply.scores), reply.selected_backend) == ("", [], "")
    conv = reply.conversation
    assert (conv.chain_length, conv.prompt_bytes, conv.prompt_tokens) == (6, PROMPT_BYTES, 1561)
    assert (conv.selected_backend, conv.outcome) == ("b-1", "chosen")
    got = [
        (s.backend, s.held_tokens, s.chain_depth, s.tier, s.cost, s.in_flight_requests)
        for s in conv.scores
    ]
    assert got == [
        ("b-1", 1024, 4, pb.TIER_GPU_HOT, 537.0, 0),
        ("b-2", 760, 3, pb.TIER_STORAGE_WARM, 1181.0, 0),
        ("b-3", 0, 0, pb.TIER_UNSPECIFIED, 1561.0, 0),
    ]
    # A chain nobody holds: every cost is the whole prompt; the least loaded would take
    # it (all idle: the prompt's own hash picks one).
    other = [k.hex() for k in chain_keys(b"z" * 3000, chain_root(MODEL), 1024)]
    none = await rig.stub.Score(
        pb.ScoreRequest(chain=pb.PromptChain(keys=other, prompt_bytes=3000)), timeout=5
    )
    assert none.conversation.outcome == "none_held"
    assert none.conversation.selected_backend in ("b-1", "b-2", "b-3")
    assert none.conversation.prompt_tokens == 750  # 3000 bytes / bytes_per_token 4
    # Two keys of the chain: b-1 and b-2 hold both on the GPU, 512 tokens: an exact tie.
    tie = await rig.stub.Score(
        pb.ScoreRequest(chain=pb.PromptChain(keys=KEYS[:2], prompt_bytes=2048)), timeout=5
    )
    assert tie.conversation.outcome == "tie"
    assert tie.conversation.selected_backend in ("b-1", "b-2")
    again = await rig.stub.Score(
        pb.ScoreRequest(chain=pb.PromptChain(keys=KEYS[:2], prompt_bytes=2048)), timeout=5
    )
    assert again.conversation.selected_backend == tie.conversation.selected_backend


async def test_score_rejects_a_bad_chain(rig: Rig) -> None:
    err = await rpc_error(
        rig.stub.Score(pb.ScoreRequest(chain=pb.PromptChain(keys=[KEYS[0], "xyz"])), timeout=5)
    )
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err
    assert "chain.keys[1]" in (err.details() or ""), err.details()


async def test_reads_are_not_routing_lookups_nor_predictions(rig: Rig) -> None:
    before = (await rig.stub.Stats(pb.StatsRequest(), timeout=5)).chain
    for _ in range(3):
        await rig.stub.Query(pb.QueryRequest(chain_key=KEYS[0]), timeout=5)
        await rig.stub.Score(pb.ScoreRequest(chain=pb.PromptChain(keys=KEYS)), timeout=5)
    after = (await rig.stub.Stats(pb.StatsRequest(), timeout=5)).chain
    assert (after.queries, after.hits, after.predicted_keys) == (0, 0, 0)
    assert after.total_entries == before.total_entries == 7


# -- Stats and Backends ------------------------------------------------------------------


async def test_stats_and_backends_cover_the_chain_index(rig: Rig) -> None:
    st = await rig.stub.Stats(pb.StatsRequest(), timeout=5)
    assert (st.total_entries, st.prefix_count) == (1, 1)
    assert st.HasField("chain")
    assert (st.chain.total_entries, st.chain.key_count, st.chain.evictions) == (7, 4, 0)
    assert [(c.backend, c.entries) for c in st.chain.backend_counts] == [("b-1", 4), ("b-2", 3)]
    assert not st.chain.fallback_active
    backends = (await rig.stub.Backends(pb.BackendsRequest(), timeout=5)).backends
    assert {b.name: (b.entries, b.chain_entries) for b in backends} == {
        "b-1": (1, 4),
        "b-2": (0, 3),
    }
    assert {b.name: b.index_created for b in backends} == {"b-1": 5, "b-2": 2}

    r = await http(
        "GET",
        rig.router.url + "/admin/kv-index/stats",
        headers={"authorization": f"Bearer {TOKEN}"},
    )
    assert r.status == 200, r
    conv = r.json()["conversation"]
    assert (conv["index"]["key_count"], conv["index"]["entry_count"]) == (4, 7)
    assert conv["config"]["max_entries"] == 1000


# -- Clear (changes the index: keep it last) ---------------------------------------------


async def test_clear_covers_the_chain_index(rig: Rig) -> None:
    one = await rig.stub.Clear(pb.ClearRequest(backend="b-2"), metadata=AUTH, timeout=5)
    assert (one.removed, one.chain_removed) == (0, 3)
    left = await rig.stub.Query(pb.QueryRequest(chain_key=KEYS[0]), timeout=5)
    assert [e.backend for e in left.entries] == ["b-1"]
    rest = await rig.stub.Clear(pb.ClearRequest(), metadata=AUTH, timeout=5)
    assert (rest.removed, rest.chain_removed) == (1, 4)
    st = await rig.stub.Stats(pb.StatsRequest(), timeout=5)
    assert (st.total_entries, st.chain.total_entries) == (0, 0)
