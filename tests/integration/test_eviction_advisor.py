"""EvictionAdvisor over a real gRPC connection to a real ``continuum-kv-listener`` process."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import pytest_asyncio

from bus._gen.continuum.listener.v1 import eviction_advisor_pb2 as pb
from bus._gen.continuum.listener.v1 import eviction_advisor_pb2_grpc as pb_grpc
from bus._gen.continuum.listener.v1 import listener_pb2, listener_pb2_grpc
from harness.procs import free_port

from .test_listener_e2e import ListenerProc


@pytest_asyncio.fixture(loop_scope="session")
async def advisor(
    tmp_path: Path,
) -> AsyncIterator[tuple[pb_grpc.EvictionAdvisorStub, Any, str]]:
    target = f"127.0.0.1:{free_port()}"
    config = {
        "listen": "127.0.0.1:0",
        "grpc_listen": target,
        "salt_secret_env": "CONTINUUM_SALT_SECRET",
        "sources": [
            {
                "backend_name": "engine-1",
                "engine": "vllm",
                "zmq_endpoint": f"tcp://127.0.0.1:{free_port()}",
            }
        ],
    }
    listener = await ListenerProc(config, tmp_path / "listener.yaml").start()
    try:
        async with grpc.aio.insecure_channel(target) as channel:
            yield pb_grpc.EvictionAdvisorStub(channel), channel, target
    finally:
        assert await listener.stop() == 0, listener.log()


def _ev(kind: pb.BlockEventKind, h: bytes = b"", **kw: Any) -> pb.BlockEvent:
    return pb.BlockEvent(kind=kind, block_hash=h, **kw)


def _request(session: str, chain: list[bytes], t: float, ttype: int) -> list[pb.BlockEvent]:
    evs = [_ev(pb.BLOCK_EVENT_KIND_REQUEST_STARTED, session_id=session, timestamp=t)]
    parent = b""
    for i, h in enumerate(chain):
        evs.append(
            _ev(
                pb.BLOCK_EVENT_KIND_INSERTED,
                h,
                parent_hash=parent,
                session_id=session,
                token_type=ttype,
                offset=i,
                timestamp=t,
            )
        )
        parent = h
    evs += [_ev(pb.BLOCK_EVENT_KIND_RELEASED, h, timestamp=t) for h in reversed(chain)]
    return evs


async def _observe(stub: pb_grpc.EvictionAdvisorStub, *batches: list[pb.BlockEvent]) -> Any:
    async def gen() -> AsyncIterator[pb.ObserveRequest]:
        for b in batches:
            yield pb.ObserveRequest(backend="engine-1", events=b)

    return await stub.Observe(gen(), timeout=10)


async def test_observe_then_rank(advisor) -> None:
    stub, _, _ = advisor
    chat = _request("s1", [b"a", b"b", b"c"], 1.0, pb.TOKEN_TYPE_USER)
    cot = _request("s2", [b"cot"], 2.0, pb.TOKEN_TYPE_REASONING)
    reply = await _observe(stub, chat, cot)
    assert reply.events_applied == len(chat) + len(cot)
    ranked = await stub.RankVictims(
        pb.RankVictimsRequest(
            backend="engine-1",
            candidate_hashes=[b"a", b"b", b"c", b"cot", b"never-seen"],
            n=5,
            timestamp=3.0,
        ),
        timeout=10,
    )
    # unknown first, then chain of thought (evict-first), then the chain tail first
    assert list(ranked.block_hashes) == [b"never-seen", b"cot", b"c", b"b", b"a"]
    top = await stub.RankVictims(
        pb.RankVictimsRequest(backend="engine-1", candidate_hashes=[b"b", b"c"], n=1), timeout=10
    )
    assert list(top.block_hashes) == [b"c"]
    # b's cached child c is not a candidate: b cannot go first, so nothing is ranked
    blocked = await stub.RankVictims(
        pb.RankVictimsRequest(backend="engine-1", candidate_hashes=[b"a", b"b"], n=2), timeout=10
    )
    assert list(blocked.block_hashes) == []


async def _code(call: Any) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call
    return err.value.code(), err.value.details() or ""


async def test_bad_input_gets_clear_status_codes(advisor) -> None:
    stub, channel, _ = advisor
    rank = stub.RankVictims
    code, detail = await _code(
        rank(pb.RankVictimsRequest(backend="nope", candidate_hashes=[b"a"], n=1), timeout=10)
    )
    assert code == grpc.StatusCode.NOT_FOUND and 'unknown backend "nope"' in detail
    assert "engine-1" in detail
    code, detail = await _code(rank(pb.RankVictimsRequest(backend="engine-1", n=1), timeout=10))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "candidate_hashes is empty" in detail
    code, detail = await _code(
        rank(pb.RankVictimsRequest(backend="engine-1", candidate_hashes=[b"a"]), timeout=10)
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "n must be at least 1" in detail
    code, detail = await _code(
        rank(
            pb.RankVictimsRequest(backend="engine-1", candidate_hashes=[b"x" * 65], n=1),
            timeout=10,
        )
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "candidate_hashes[0]" in detail
    many = [i.to_bytes(4, "big") for i in range(65_537)]
    code, detail = await _code(
        rank(pb.RankVictimsRequest(backend="engine-1", candidate_hashes=many, n=1), timeout=10)
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "at most 65536" in detail
    huge = [i.to_bytes(4, "big") * 16 for i in range(70_000)]  # > 4 MiB message
    code, _ = await _code(
        rank(pb.RankVictimsRequest(backend="engine-1", candidate_hashes=huge, n=1), timeout=10)
    )
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED

    # Observe: an unknown backend, and a batch with one bad event applied not at all
    async def unknown() -> AsyncIterator[pb.ObserveRequest]:
        yield pb.ObserveRequest(backend="nope", events=[_ev(pb.BLOCK_EVENT_KIND_HIT, b"a")])

    code, detail = await _code(stub.Observe(unknown(), timeout=10))
    assert code == grpc.StatusCode.NOT_FOUND
    await _observe(stub, _request("s", [b"a"], 1.0, pb.TOKEN_TYPE_SYSTEM))
    bad = [_ev(pb.BLOCK_EVENT_KIND_REMOVED, b"a"), _ev(pb.BLOCK_EVENT_KIND_UNSPECIFIED, b"b")]
    code, detail = await _code(_observe(stub, bad))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "events[1]" in detail
    code, detail = await _code(_observe(stub, [_ev(pb.BLOCK_EVENT_KIND_HIT, b"")]))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "block_hash has 0 bytes" in detail
    # "a" was not removed by the rejected batch: a known block ranks after an unknown one
    ranked = await rank(
        pb.RankVictimsRequest(backend="engine-1", candidate_hashes=[b"a", b"zz"], n=2),
        timeout=10,
    )
    assert list(ranked.block_hashes) == [b"zz", b"a"]
    # the process is still serving its other service
    sources = await listener_pb2_grpc.ListenerStub(channel).Sources(
        listener_pb2.SourcesRequest(), timeout=10
    )
    assert [s.backend_name for s in sources.sources] == ["engine-1"]


async def test_request_features_cross_the_wire_and_bad_ones_are_ignored(advisor) -> None:
    """REQUEST_STARTED ``request`` (the engine-visible features the advisor derives the
    session class from) is accepted over gRPC; implausible values are ignored, not an
    error, and the advice still comes."""
    stub, _, _ = advisor
    good = _request("tmpl", [b"T1", b"T2"], 10.0, pb.TOKEN_TYPE_USER)
    good[0].request.CopyFrom(pb.RequestFeatures(turns=1, temperature=0.0, max_tokens=256))
    bad = _request("odd", [b"O1"], 10.0, pb.TOKEN_TYPE_USER)
    bad[0].request.CopyFrom(pb.RequestFeatures(temperature=float("nan"), tools=1 << 31))
    reply = await _observe(stub, good, bad)
    assert reply.events_applied == len(good) + len(bad)
    ranked = await stub.RankVictims(
        pb.RankVictimsRequest(backend="engine-1", candidate_hashes=[b"T2", b"O1"], n=2),
        timeout=10,
    )
    assert sorted(ranked.block_hashes) == [b"O1", b"T2"]


async def test_a_listener_with_a_session_predictor_classifies_over_grpc(tmp_path: Path) -> None:
    """``session_predictor`` in the config: the listener process loads the model file at
    start and its advisor takes REQUEST_STARTED ``features``; a vector of the wrong size is
    INVALID_ARGUMENT with the expected size."""
    torch = pytest.importorskip("torch")
    from listener.saecache.predictor import FEATURES, HIDDEN, build_mlp, text_features

    model = tmp_path / "predictor.pt"
    mlp = build_mlp(FEATURES, HIDDEN)
    torch.save({"input_dim": FEATURES, "hidden": HIDDEN, "state_dict": mlp.state_dict()}, model)
    target = f"127.0.0.1:{free_port()}"
    config = {
        "listen": "127.0.0.1:0",
        "grpc_listen": target,
        "session_predictor": str(model),
        "sources": [
            {
                "backend_name": "engine-1",
                "engine": "vllm",
                "zmq_endpoint": f"tcp://127.0.0.1:{free_port()}",
            }
        ],
    }
    listener = await ListenerProc(config, tmp_path / "listener.yaml").start()
    try:
        assert listener.log_path is not None  # beside its config: Service's default
        assert "session predictor" in listener.log_path.read_text()
        async with grpc.aio.insecure_channel(target) as channel:
            stub = pb_grpc.EvictionAdvisorStub(channel)
            features = text_features("sys", "hello there", 2, False)
            started = _ev(
                pb.BLOCK_EVENT_KIND_REQUEST_STARTED, session_id="s", timestamp=1.0,
                features=features,
            )  # fmt: skip
            reply = await _observe(stub, [started])
            assert reply.events_applied == 1
            short = _ev(pb.BLOCK_EVENT_KIND_REQUEST_STARTED, session_id="t", features=features[:10])
            code, detail = await _code(_observe(stub, [short]))
            assert code == grpc.StatusCode.INVALID_ARGUMENT
            assert "10 features; the session predictor takes 72" in detail
    finally:
        assert await listener.stop() == 0, listener.log()


async def test_the_engine_simulator_evicts_through_the_advisor(advisor) -> None:
    """``harness.sim --eviction-advisor``'s client against the real listener: the engine's
    cache events reach the advisor, and its LRU head is reordered by the advisor's ranking
    (a chain's deepest block first, never a parent before its cached child)."""
    from harness.sim.advisor_client import AdvisedEviction, _h
    from harness.sim.prefix_cache import PrefixCache

    stub, _, target = advisor
    cache = PrefixCache(block_size=4, capacity_blocks=8)
    client = AdvisedEviction(target, "engine-1", window=8)
    client.attach(cache)
    try:
        tokens = list(range(24))  # 6 blocks, one chain: more than half the capacity
        cached, _ = cache.lookup_and_insert(tokens)
        client.prefilled(tokens, None, cached, "sess-1")
        async with asyncio.timeout(10):
            while client.ranked == 0:  # noqa: ASYNC110 - the client has no completion hook
                await asyncio.sleep(0.01)
        chain = [_h(h) for h in cache.block_hashes(tokens)]
        assert client.moved >= 1
        assert _h(next(iter(cache._blocks))) == chain[-1]  # evicted first: the chain's tail
        ranked = await stub.RankVictims(
            pb.RankVictimsRequest(backend="engine-1", candidate_hashes=chain, n=len(chain)),
            timeout=10,
        )
        assert list(ranked.block_hashes) == chain[::-1]  # what the advisor observed
    finally:
        client.close()
