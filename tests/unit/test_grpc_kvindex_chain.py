"""KvIndex.Score of a request by conversation depth, through a real grpc.aio server.

The servicer gets the request -> prompt chain computation as a callable (the router's
renderer, ``router.conversation``); here a fake renders ``messages`` by joining their
contents, which is all the servicer may rely on: keys in order and the prompt's size. The
router side is a real ``KvRuntime`` (memory indexes) with events applied as its consumers
apply them.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc
import orjson
import pytest_asyncio

from bus._gen.continuum.kvindex.v1 import kvindex_pb2 as pb
from bus._gen.continuum.kvindex.v1 import kvindex_pb2_grpc as pb_grpc
from bus.events import KvEvent
from bus.grpc_server import generated, start_server
from bus.prompt_chain import ChainKey, chain_keys, chain_root
from router.admin_auth import AdminToken
from router.config import parse_config
from router.grpc_kvindex import SERVICE_NAME, KvIndexServicer
from router.kv_runtime import KvRuntime
from router.kvindex import apply_events
from router.pool import BackendPool

MODEL = "m"


@dataclass(frozen=True)
class Chain:
    keys: list[ChainKey]
    prompt_bytes: int
    conversation: bytes | None = None


def render(body: dict[str, Any]) -> bytes:
    return "\n".join(str(m.get("content", "")) for m in body["messages"]).encode()


def chain_of(body: dict[str, Any], model: str) -> Chain | None:
    """The fake renderer: None for a request it cannot render (as a template that raises)."""
    if any(m.get("role") == "tool" for m in body["messages"]):
        return None
    text = render(body)
    return Chain(chain_keys(text, chain_root(model), 1024), len(text))


SYSTEM = "s" * 3000
BODY = {
    "model": MODEL,
    "messages": [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "u" * 2000},
    ],
}


@dataclass
class Rig:
    kv: KvRuntime
    pool: BackendPool
    stub: pb_grpc.KvIndexStub


@pytest_asyncio.fixture
async def rig() -> AsyncIterator[Rig]:
    cfg, _ = parse_config(
        {
            "prefix_routing": {"enabled": True},
            "backends": [
                {"name": n, "url": f"http://h:{i + 1}", "type": "vllm", "models": [MODEL]}
                for i, n in enumerate(("a", "b"))
            ],
            # Instantaneous in-flight counts (no averaging window): hand-worked costs.
            "kv_cache_index": {
                "enabled": True,
                "conversation": {"enabled": True, "scoring": {"load_window_seconds": 0}},
            },
        }
    )
    pool = BackendPool(cfg.backends, cfg.health_check)
    kv = KvRuntime(cfg)
    assert kv.chain_index is not None
    chain = chain_of(BODY, MODEL)
    assert chain is not None and len(chain.keys) == 4  # 5001 bytes
    events = [
        KvEvent("chain_created", "a", None, 250 * (i + 1), "gpu", chain_key=k.hex())
        for i, k in enumerate(chain.keys[:2])  # the system prompt's 2 full chunks
    ] + [
        KvEvent("chain_created", "b", None, 250 * (i + 1), "gpu", chain_key=k.hex())
        for i, k in enumerate(chain.keys)  # the whole conversation so far
    ]
    await apply_events(kv.index, events, cfg.kv_cache_index.storage_offloading, kv.chain_index)
    servicer = KvIndexServicer(kv, pool, lambda: 256, AdminToken(None), chain_of=chain_of)
    started = await start_server(
        "127.0.0.1:0",
        [generated(pb_grpc.add_KvIndexServicer_to_server, servicer, SERVICE_NAME)],
    )
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{started.port}") as channel:
            yield Rig(kv, pool, pb_grpc.KvIndexStub(channel))
    finally:
        await started.server.stop(None)
        await kv.stop()


async def score(rig: Rig, body: dict[str, Any]) -> pb.ScoreResponse:
    req = pb.ScoreRequest(request=pb.ChatRequest(request_json=orjson.dumps(body)))
    return await rig.stub.Score(req, timeout=5)


async def test_a_request_is_scored_by_prefix_and_by_conversation_depth(rig: Rig) -> None:
    reply = await score(rig, BODY)
    assert len(reply.prefix_hash) == 64  # the prefix part, as without conversation routing
    conv = reply.conversation
    # 5001 bytes at b's 1000 tokens / 4096 bytes: 1221 tokens.
    assert (conv.chain_length, conv.prompt_bytes, conv.prompt_tokens) == (4, 5001, 1221)
    assert (conv.selected_backend, conv.outcome) == ("b", "chosen")
    assert [(s.backend, s.held_tokens, s.chain_depth, s.cost) for s in conv.scores] == [
        ("b", 1000, 4, 221.0),
        ("a", 500, 2, 721.0),
    ]
    # Load shows in the costs (the default weights: 0.1 a prefill token, 32 a request): b
    # busy with 2 requests and 300 prefill tokens; at the load cap (ceil(1.25 * 3 / 2) =
    # 2), so a is chosen however much b holds.
    b = rig.pool.get("b")
    assert b is not None
    b.in_flight = 2
    ticket = rig.kv.prefill_load.started("b", 300)
    conv = (await score(rig, BODY)).conversation
    by = {s.backend: s for s in conv.scores}
    assert (by["b"].in_flight_requests, by["b"].in_flight_prefill_tokens) == (2, 300)
    assert by["b"].cost == 221 + 0.1 * 300 + 2 * 32
    assert conv.selected_backend == "a"
    rig.kv.prefill_load.finished(ticket)
    b.in_flight = 0
    # Read-only: no routing lookup, no decision, no prediction.
    assert rig.kv.chain_index is not None and rig.kv.chain_index.queries == 0
    assert rig.kv.conversation is not None
    assert rig.kv.conversation.decisions == {"chosen": 0, "tie": 0, "none_held": 0}
    assert rig.kv.conversation.predicted_keys == 0


async def test_a_request_that_does_not_render_is_scored_on_its_prefix(rig: Rig) -> None:
    body = {**BODY, "messages": [*BODY["messages"], {"role": "tool", "content": "x"}]}
    reply = await score(rig, body)
    assert len(reply.prefix_hash) == 64
    assert not reply.HasField("conversation")
