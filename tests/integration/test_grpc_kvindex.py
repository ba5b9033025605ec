"""``continuum.kvindex.v1.KvIndex`` on the real router process, called with grpcio.

The router runs with Tier 4 on (memory index), ``server.grpc_listen: 127.0.0.1:0`` and an
admin token. Its event sources point at a tiny in-test SSE server that serves fixed
``cache_created`` records, so the index content is known exactly:

* ``b-1`` holds ``PREFIX`` with 2048 tokens and ``LOW`` with 4096 tokens (GPU);
* ``b-2`` holds ``PREFIX`` with 1024 tokens, ``OTHER`` with 256 and ``LOW`` with 512
  (GPU; 512/4096 is under ``min_overlap_threshold``);
* ``b-3`` has no event source and holds nothing.

The expectations follow ``proto/continuum/kvindex/v1/kvindex.proto``. One router is
shared by the module; the tests that clear the index run last.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
import orjson
import pytest
import pytest_asyncio
from aiohttp import web
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from bus._gen.continuum.kvindex.v1 import kvindex_pb2 as pb
from bus._gen.continuum.kvindex.v1 import kvindex_pb2_grpc as pb_grpc
from bus.events import KvEvent
from bus.prefix_key import extract_prefix_key
from bus.sse import encode_record

from .conftest import RouterLauncher, RouterProc, authed_channel, http, wait_until

SERVICE = "continuum.kvindex.v1.KvIndex"
MODEL = "demo-model"
TOKEN_ENV = "CONTINUUM_TEST_KVINDEX_ADMIN_TOKEN"
TOKEN = "kvindex-grpc-admin-token"
TTL_S = 600
ENTRIES = 5  # (prefix, backend) entries the fixed events create

REQUEST: dict[str, Any] = {
    "model": MODEL,
    "messages": [
        {"role": "system", "content": "You are the KvIndex gRPC test assistant."},
        {"role": "user", "content": "Which backend holds my prefix?"},
    ],
}
_key = extract_prefix_key(REQUEST)
assert _key is not None
PREFIX = _key.hex()
OTHER = extract_prefix_key({**REQUEST, "messages": [{"role": "system", "content": "other"}]})
assert OTHER is not None
OTHER_PREFIX = OTHER.hex()
LOW = extract_prefix_key({**REQUEST, "messages": [{"role": "system", "content": "low"}]})
assert LOW is not None
LOW_PREFIX = LOW.hex()

EVENTS: dict[str, list[KvEvent]] = {
    "b-1": [
        KvEvent("cache_created", "b-1", PREFIX, 2048, "gpu"),
        KvEvent("cache_created", "b-1", LOW_PREFIX, 4096, "gpu"),
    ],
    "b-2": [
        KvEvent("cache_created", "b-2", PREFIX, 1024, "gpu"),
        KvEvent("cache_created", "b-2", OTHER_PREFIX, 256, "gpu"),
        KvEvent("cache_created", "b-2", LOW_PREFIX, 512, "gpu"),
    ],
}


class FixedSse:
    """``GET /events/{backend}``: the backend's fixed records, then an open, idle stream."""

    def __init__(self) -> None:
        self._runner: web.AppRunner | None = None
        self._closing = asyncio.Event()
        self.url = ""
        self.connections: dict[str, int] = {}

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
        self.connections[backend] = self.connections.get(backend, 0) + 1
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i, ev in enumerate(EVENTS[backend], 1):
            await resp.write(encode_record(ev.to_json(), event=ev.event, id=f"fixed-{i}"))
        await self._closing.wait()
        return resp


class Rig:
    def __init__(self, router: RouterProc, sse: FixedSse, channel: grpc.aio.Channel) -> None:
        self.router = router
        self.sse = sse
        self.channel = channel
        self.stub = pb_grpc.KvIndexStub(channel)


AUTH = (("authorization", f"Bearer {TOKEN}"),)


def admin() -> dict[str, str]:
    return {"authorization": f"Bearer {TOKEN}"}


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
                    "entry_ttl_seconds": TTL_S,
                    "event_sources": [
                        {"backend_name": n, "endpoint": f"{sse.url}/events/{n}"}
                        for n in ("b-1", "b-2")
                    ],
                },
            },
            env={TOKEN_ENV: TOKEN},
        )
        assert router.grpc_target is not None, "READY must announce the gRPC port"
        async with authed_channel(router.grpc_target, TOKEN) as channel:
            rig = Rig(router, sse, channel)

            async def indexed() -> bool:
                st = await rig.stub.Stats(pb.StatsRequest(), timeout=5)
                return st.total_entries == ENTRIES

            await wait_until(indexed, within=10, what="the fixed events in the router's index")
            yield rig
    finally:
        await sse.close()


async def rpc_error(call: Any) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call
    return err.value


# -- Query -------------------------------------------------------------------------------


async def test_query_returns_the_entries_with_their_tier(rig: Rig) -> None:
    before = time.time()
    reply = await rig.stub.Query(pb.QueryRequest(prefix_hash=PREFIX), timeout=5)
    assert reply.prefix_hash == PREFIX
    got = [(e.backend, e.token_count, e.tier) for e in reply.entries]
    assert got == [("b-1", 2048, pb.TIER_GPU_HOT), ("b-2", 1024, pb.TIER_GPU_HOT)]
    for e in reply.entries:  # the TTL from the last event, as wall-clock ms
        assert (before + TTL_S - 60) * 1000 < e.expires_at_unix_ms <= (time.time() + TTL_S) * 1000

    other = await rig.stub.Query(pb.QueryRequest(prefix_hash=OTHER_PREFIX), timeout=5)
    assert [(e.backend, e.token_count) for e in other.entries] == [("b-2", 256)]
    unknown = await rig.stub.Query(pb.QueryRequest(prefix_hash="0" * 64), timeout=5)
    assert unknown.prefix_hash == "0" * 64 and list(unknown.entries) == []


@pytest.mark.parametrize("bad", ["", "abc123", "g" * 64, "0" * 63, "0" * 65, PREFIX + " "])
async def test_query_rejects_a_malformed_prefix_hash(rig: Rig, bad: str) -> None:
    err = await rpc_error(rig.stub.Query(pb.QueryRequest(prefix_hash=bad), timeout=5))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err
    assert "prefix_hash" in (err.details() or ""), err.details()


async def test_query_accepts_uppercase_hex_and_normalises_it(rig: Rig) -> None:
    """kvindex.proto: "Input hashes are accepted in either case and normalised to
    lowercase" (QueryResponse.prefix_hash: "The queried hash, normalised to lowercase")."""
    reply = await rig.stub.Query(pb.QueryRequest(prefix_hash=PREFIX.upper()), timeout=5)
    assert reply.prefix_hash == PREFIX
    assert [e.backend for e in reply.entries] == ["b-1", "b-2"]


# -- Score -------------------------------------------------------------------------------


def _by_backend(reply: pb.ScoreResponse) -> dict[str, pb.BackendScore]:
    return {s.backend: s for s in reply.scores}


async def test_score_by_prefix_hash_and_by_request_json(rig: Rig) -> None:
    by_hash = await rig.stub.Score(pb.ScoreRequest(prefix_hash=PREFIX), timeout=5)
    by_request = await rig.stub.Score(
        pb.ScoreRequest(request=pb.ChatRequest(request_json=orjson.dumps(REQUEST))), timeout=5
    )
    with_model = await rig.stub.Score(
        pb.ScoreRequest(
            request=pb.ChatRequest(
                model=MODEL, request_json=orjson.dumps({"messages": REQUEST["messages"]})
            )
        ),
        timeout=5,
    )
    for reply in (by_hash, by_request, with_model):
        assert reply.prefix_hash == PREFIX
        assert reply.threshold == pytest.approx(0.3)
        assert reply.selected_backend == "b-1"
        scores = _by_backend(reply)
        # All idle, all healthy: b-1 = 0.6 * 2048/2048 + 0.3 + 0.1 = 1.0;
        # b-2 = 0.6 * 1024/2048 + 0.3 + 0.1 = 0.7.
        assert scores["b-1"].final_score == pytest.approx(1.0)
        assert scores["b-1"].overlap == pytest.approx(1.0)
        assert scores["b-1"].health == pytest.approx(1.0)
        assert (scores["b-1"].tier, scores["b-1"].token_count) == (pb.TIER_GPU_HOT, 2048)
        assert scores["b-2"].final_score == pytest.approx(0.7)
        assert scores["b-2"].overlap == pytest.approx(0.5)
        assert (scores["b-2"].tier, scores["b-2"].token_count) == (pb.TIER_GPU_HOT, 1024)
        if "b-3" in scores:  # no entry: takes no part
            assert scores["b-3"].final_score == 0.0

    # An unknown prefix: nobody scores, nothing is selected (the strategy would decide).
    none = await rig.stub.Score(pb.ScoreRequest(prefix_hash="f" * 64), timeout=5)
    assert none.selected_backend == ""
    assert all(s.final_score == 0.0 for s in none.scores)
    # The OTHER prefix: b-2 alone holds it, so it is b-2's whatever the token count.
    other = await rig.stub.Score(pb.ScoreRequest(prefix_hash=OTHER_PREFIX), timeout=5)
    assert other.selected_backend == "b-2"
    assert _by_backend(other)["b-2"].final_score == pytest.approx(1.0)
    # LOW: b-2's 512/4096 = 0.125 is under min_overlap_threshold (0.3): it scores 0.
    low = await rig.stub.Score(pb.ScoreRequest(prefix_hash=LOW_PREFIX), timeout=5)
    assert low.selected_backend == "b-1"
    assert _by_backend(low)["b-1"].final_score == pytest.approx(1.0)
    assert _by_backend(low)["b-2"].final_score == 0.0


async def test_score_reply_follows_the_proto_contract(rig: Rig) -> None:
    """kvindex.proto, ScoreResponse.scores: "One score per backend that holds the prefix;
    backends without an entry ... are not listed. Ordered by final_score descending";
    BackendScore.load: "Load ratio in [0, 1]: this backend's in-flight requests / the
    maximum in-flight across backends (0 when all are idle)"; BackendScore.overlap: "A
    backend under `min_overlap_threshold` has overlap 0 and final_score 0"."""
    reply = await rig.stub.Score(pb.ScoreRequest(prefix_hash=PREFIX), timeout=5)
    got = [(s.backend, s.load, round(s.final_score, 6)) for s in reply.scores]
    problems = []
    if [b for b, _, _ in got] != ["b-1", "b-2"]:
        problems.append("scores must list the holders only, final_score descending")
    if any(load != 0.0 for b, load, _ in got if b in ("b-1", "b-2")):
        problems.append("load must be the load ratio (0.0 when all are idle), not 1 - ratio")
    low = _by_backend(await rig.stub.Score(pb.ScoreRequest(prefix_hash=LOW_PREFIX), timeout=5))
    if low["b-2"].overlap != 0.0:
        problems.append(f"overlap under the threshold must be 0, got {low['b-2'].overlap}")
    assert not problems, f"{problems}: got (backend, load, final) {got}"


async def test_score_rejects_bad_input(rig: Rig) -> None:
    cases = [
        pb.ScoreRequest(),
        pb.ScoreRequest(prefix_hash="xyz"),
        pb.ScoreRequest(request=pb.ChatRequest(request_json=b"{not json")),
        pb.ScoreRequest(request=pb.ChatRequest(request_json=b"[1, 2]")),
        pb.ScoreRequest(
            request=pb.ChatRequest(request_json=orjson.dumps({"messages": REQUEST["messages"]}))
        ),
        pb.ScoreRequest(
            request=pb.ChatRequest(request_json=orjson.dumps({"model": MODEL, "messages": []}))
        ),
    ]
    for req in cases:
        err = await rpc_error(rig.stub.Score(req, timeout=5))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (req, err)
        assert err.details(), req


# -- Backends and Stats ------------------------------------------------------------------


async def test_backends_and_stats(rig: Rig) -> None:
    backends = (await rig.stub.Backends(pb.BackendsRequest(), timeout=5)).backends
    assert [b.name for b in backends] == ["b-1", "b-2"]
    by_name = {b.name: b for b in backends}
    for name, n in (("b-1", 2), ("b-2", 3)):
        b = by_name[name]
        assert b.transport == "sse" and b.connected, b
        assert b.events_received == n and b.events_processed == n, b
        assert b.index_created == n and b.events_dropped == 0 and b.index_evicted == 0, b
        assert b.last_event_id == f"fixed-{n}", b
        assert abs(b.last_event_at_unix_ms / 1000 - time.time()) < 120, b
        assert b.reconnects == 0, b

    st = await rig.stub.Stats(pb.StatsRequest(), timeout=5)
    assert (st.total_entries, st.prefix_count) == (ENTRIES, 3)
    assert st.index_backend == "memory" and not st.fallback_active
    assert st.evictions == 0

    # The HTTP admin view agrees.
    r = await http("GET", rig.router.url + "/admin/kv-index/stats", headers=admin())
    assert r.status == 200, r
    index = r.json()["index"]
    assert (index["entry_count"], index["prefix_count"]) == (ENTRIES, 3)


async def test_read_rpcs_are_not_counted_as_routing_lookups(rig: Rig) -> None:
    """kvindex.proto, Query: "Read-only: ... not counted in StatsResponse.queries or
    StatsResponse.hits (those count routing lookups)"; Score: "Read-only like Query"."""
    before = await rig.stub.Stats(pb.StatsRequest(), timeout=5)
    for _ in range(3):
        await rig.stub.Query(pb.QueryRequest(prefix_hash=PREFIX), timeout=5)
        await rig.stub.Score(pb.ScoreRequest(prefix_hash=PREFIX), timeout=5)
    after = await rig.stub.Stats(pb.StatsRequest(), timeout=5)
    assert (after.queries, after.hits) == (before.queries, before.hits)
    # No request was routed in this module at all.
    assert (after.queries, after.hits) == (0, 0)


async def test_stats_and_backends_count_entries_per_backend(rig: Rig) -> None:
    """kvindex.proto: StatsResponse.backend_counts ("Entries per backend, ordered by
    backend") and BackendStatus.entries ("Index entries this backend holds now")."""
    st = await rig.stub.Stats(pb.StatsRequest(), timeout=5)
    assert [(c.backend, c.entries) for c in st.backend_counts] == [("b-1", 2), ("b-2", 3)]
    backends = (await rig.stub.Backends(pb.BackendsRequest(), timeout=5)).backends
    assert {b.name: b.entries for b in backends} == {"b-1": 2, "b-2": 3}


async def test_the_conversation_index_needs_conversation_routing(rig: Rig) -> None:
    """kvindex.proto: a chain key or chain while conversation routing is disabled is
    FAILED_PRECONDITION; Stats has no chain part and Backends no chain entries."""
    for call in (
        rig.stub.Query(pb.QueryRequest(chain_key="0" * 32), timeout=5),
        rig.stub.Score(pb.ScoreRequest(chain=pb.PromptChain(keys=["0" * 32])), timeout=5),
    ):
        err = await rpc_error(call)
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION, err
        assert "conversation" in (err.details() or ""), err.details()
    st = await rig.stub.Stats(pb.StatsRequest(), timeout=5)
    assert not st.HasField("chain")
    backends = (await rig.stub.Backends(pb.BackendsRequest(), timeout=5)).backends
    assert all(b.chain_entries == 0 for b in backends)
    # A request is scored on its prefix alone.
    reply = await rig.stub.Score(
        pb.ScoreRequest(request=pb.ChatRequest(request_json=orjson.dumps(REQUEST))), timeout=5
    )
    assert reply.selected_backend == "b-1" and not reply.HasField("conversation")


# -- reflection and health ---------------------------------------------------------------


async def test_reflection_lists_the_service_and_its_health_is_serving(rig: Rig) -> None:
    stub = reflection_pb2_grpc.ServerReflectionStub(rig.channel)
    call = stub.ServerReflectionInfo(
        iter(
            [
                reflection_pb2.ServerReflectionRequest(list_services=""),
                reflection_pb2.ServerReflectionRequest(file_containing_symbol=SERVICE),
            ]
        ),
        timeout=5,
    )
    replies = [r async for r in call]
    assert len(replies) == 2
    names = {s.name for s in replies[0].list_services_response.service}
    assert SERVICE in names and "grpc.health.v1.Health" in names, names
    files = replies[1].file_descriptor_response.file_descriptor_proto
    assert files, replies[1]

    health = health_pb2_grpc.HealthStub(rig.channel)
    reply = await health.Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=5)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


# -- Clear (changes the index: keep these last) ------------------------------------------


async def test_clear_needs_the_admin_token(rig: Rig) -> None:
    async with grpc.aio.insecure_channel(rig.router.grpc_address) as bare:
        stub = pb_grpc.KvIndexStub(bare)
        for metadata in (
            None,
            (("authorization", "Bearer wrong-token"),),
            (("authorization", TOKEN),),
        ):
            err = await rpc_error(stub.Clear(pb.ClearRequest(), metadata=metadata, timeout=5))
            assert err.code() == grpc.StatusCode.UNAUTHENTICATED, err
            assert "authorization" in (err.details() or ""), err.details()
    assert (await rig.stub.Stats(pb.StatsRequest(), timeout=5)).total_entries == ENTRIES

    one = await rig.stub.Clear(pb.ClearRequest(backend="b-2"), metadata=AUTH, timeout=5)
    assert one.removed == 3
    left = await rig.stub.Query(pb.QueryRequest(prefix_hash=PREFIX), timeout=5)
    assert [e.backend for e in left.entries] == ["b-1"]
    rest = await rig.stub.Clear(pb.ClearRequest(), metadata=AUTH, timeout=5)
    assert rest.removed == 2
    gone = await rig.stub.Query(pb.QueryRequest(prefix_hash=PREFIX), timeout=5)
    assert list(gone.entries) == []
    assert (await rig.stub.Stats(pb.StatsRequest(), timeout=5)).total_entries == 0
    again = await rig.stub.Clear(pb.ClearRequest(), metadata=AUTH, timeout=5)
    assert again.removed == 0  # idempotent


async def test_clear_of_an_unknown_backend_removes_nothing(rig: Rig) -> None:
    """kvindex.proto, ClearRequest.backend: "An unknown backend name is not an error (it
    removes 0 entries)"."""
    reply = await rig.stub.Clear(pb.ClearRequest(backend="no-such-backend"), metadata=AUTH)
    assert reply.removed == 0
