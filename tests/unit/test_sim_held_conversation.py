"""The engine's conversation-key oracle (``GET /sim/held-conversation``) against the
listener's own computation on the same requests.

The fault matrix judges the router's conversation index by this oracle, so it must name
exactly the keys the listener announces, with the same token counts, block for block: the
engine's stored and removed blocks are fed, as the engine events they are, into a real
``ChainTracker`` in conversation mode with Qwen2's ``tokenizer.json``, and after every
request the tracker's held keys must equal the oracle's, through multi-turn conversations
under a shared system prompt, non-ASCII text split across blocks, router-issued salts, and
evictions of a small cache.
"""

from __future__ import annotations

from typing import Any

import pytest

from bus.events import KvEvent
from bus.prompt_chain import chain_keys, chain_root
from bus.salt import encode_salt
from harness.sim.engine import SimConfig, SimEngine
from harness.sim.held import HeldConversation
from harness.sim.httpserver import Request, Response, dumps, loads
from harness.sim.prefix_cache import StoredBlock
from harness.sim.tokenizer import bundled_qwen2_json
from listener.chains import ChainTracker
from listener.chains.conversation import ConversationSettings
from listener.engine_events import BlockHash, BlockRemoved, BlockStored, EventBatch
from listener.recovery import Attributor
from listener.templates import CHATML
from listener.token_bytes import load_token_bytes

pytest.importorskip("tokenizers")

MODEL = "demo-model"
CHUNK = 128
BS = 16
SECRET = b"0123456789abcdef-secret"
SYSTEM = "You are the release assistant. Keep answers short. " * 6


class Pair:
    """One engine and a listener tracker fed the engine's own cache changes."""

    def __init__(self, capacity_blocks: int = 4096) -> None:
        self.events: list[KvEvent] = []
        att = Attributor(model=MODEL, template=CHATML, backend="sim-x", salt_secret=SECRET)
        conv = ConversationSettings(load_token_bytes(bundled_qwen2_json()), MODEL, CHUNK)
        self.tracker = ChainTracker(
            "sim-x", self.events.append, att, engine="vllm", conversation=conv
        )
        cfg = SimConfig(
            name="sim-x",
            tokenizer="qwen2",
            block_size=BS,
            capacity_blocks=capacity_blocks,
            conversation_chunk_bytes=CHUNK,
        )
        self.engine = SimEngine(cfg, on_kv_event=self._changed)
        self.removed = 0

    def _changed(self, stored: list[StoredBlock], removed: list[Any]) -> None:
        events: list[Any] = []
        if removed:
            self.removed += len(removed)
            events.append(BlockRemoved([BlockHash(h) for h in removed]))
        for b in stored:
            parent = None if b.parent_hash is None else BlockHash(b.parent_hash)
            salt = self.engine._salt if parent is None else None
            hashes = [BlockHash(b.block_hash)]
            events.append(BlockStored(hashes, parent, list(b.token_ids), BS, cache_salt=salt))
        self.tracker.apply(EventBatch(0.0, events, 0))

    async def chat(self, body: dict[str, Any]) -> str:
        raw = dumps({"model": MODEL, "max_tokens": 12, **body})
        resp = await self.engine(Request("POST", "/v1/chat/completions", "", {}, raw))
        assert isinstance(resp, Response) and resp.status == 200, resp
        content: str = loads(resp.body)["choices"][0]["message"]["content"]
        return content

    def listener_keys(self) -> dict[str, int]:
        return {
            e.chain_key: int(e.token_count or 0)
            for e in self.tracker.snapshot()
            if e.chain_key is not None
        }

    async def oracle_keys(self) -> dict[str, int]:
        resp = await self.engine(Request("GET", "/sim/held-conversation", "", {}, b""))
        assert isinstance(resp, Response) and resp.status == 200
        doc = loads(resp.body)
        assert doc["backend"] == "sim-x" and doc["chunk_bytes"] == CHUNK
        held: dict[str, int] = doc["held"]
        return held

    async def agree(self) -> dict[str, int]:
        oracle = await self.oracle_keys()
        assert oracle == self.listener_keys()
        return oracle


async def conversation(pair: Pair, first: str, turns: int, **extra: Any) -> None:
    history: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    for t in range(turns):
        history.append({"role": "user", "content": f"{first} turn {t}: " + "why? " * (5 + t)})
        answer = await pair.chat({"messages": history, **extra})
        history.append({"role": "assistant", "content": answer})
        await pair.agree()


async def test_multi_turn_conversations_agree_block_for_block_without_evictions() -> None:
    pair = Pair()
    await conversation(pair, "Deploy the service", 4)
    await conversation(pair, "Roll back the release", 3)  # same system prompt, new branch
    held = await pair.agree()
    assert pair.removed == 0
    # Two conversations of several chunks each, sharing the system prompt's first keys.
    assert len(held) >= 12
    render = pair.engine.tokenizer.render_chat(
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "x"}]
    )
    first = chain_keys(render.encode(), chain_root(MODEL), CHUNK)[0]
    assert first.hex() in held  # the router's own key of the rendered prompt


async def test_non_ascii_text_split_across_blocks_agrees() -> None:
    pair = Pair()
    await conversation(pair, "Überprüfe die Änderungen 🚀 für café", 3)
    assert len(await pair.agree()) >= 4


async def test_router_salt_roots_the_chain_at_the_callers_salt() -> None:
    pair = Pair()
    salt = encode_salt(SECRET, "sim-x", b"\x01" * 32, "tenant-a")
    await conversation(pair, "Salted", 2, cache_salt=salt)
    held = await pair.agree()
    render = pair.engine.tokenizer.render_chat(
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "x"}]
    )
    first = chain_keys(render.encode(), chain_root(MODEL, "tenant-a"), CHUNK)[0]
    assert first.hex() in held
    assert chain_keys(render.encode(), chain_root(MODEL), CHUNK)[0].hex() not in held


async def test_agree_after_evictions_of_a_small_cache() -> None:
    # 40 blocks: each conversation's later turns evict the others' blocks, tails first.
    pair = Pair(capacity_blocks=40)
    for k in range(4):
        await conversation(pair, f"Topic {k}", 3)
    assert pair.removed > 0
    await pair.agree()
    # and a conversation whose blocks were all evicted comes back when served again
    await conversation(pair, "Topic 0", 2)
    assert await pair.agree()


async def test_reset_leaves_no_conversation_key_held() -> None:
    pair = Pair()
    await conversation(pair, "Reset me", 2)
    assert await pair.oracle_keys()
    await pair.engine(Request("POST", "/reset_prefix_cache", "", {}, b""))
    assert await pair.oracle_keys() == {}


async def test_simple_tokenizer_cannot_spell_text_and_keys_nothing() -> None:
    engine = SimEngine(SimConfig())
    raw = dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi " * 400}]})
    await engine(Request("POST", "/v1/chat/completions", "", {}, raw))
    doc = engine.held_conversation.report()
    assert doc["held"] == {} and doc["unkeyed_requests"] == 1


def test_memory_is_bounded_by_keys_and_paths() -> None:
    cache: set[int] = set(range(10_000))
    h = HeldConversation(cache, 4, chunk_bytes=4, max_keys=5, max_paths_per_key=2)
    pieces = [b"ab"] * 40  # 20 keys of 4 bytes, 2 tokens each
    h.served(MODEL, None, pieces, 2, list(range(20)))
    assert h.report()["served_keys"] == 5 and h.forgotten_keys == 15
    for k in range(3):  # one text, three block chains: two paths kept
        h.served(MODEL, None, pieces[:2], 2, [100 + k])
    (paths, tokens), *_ = [v for v in h._keys.values() if len(v[0]) > 1]
    assert len(paths) == 2 and tokens == 2
    # paths no longer in the cache are dropped once the record passes twice the capacity
    cache.clear()
    h.served(MODEL, None, pieces, 2, list(range(200, 220)))
    assert h.held() == {}
    with pytest.raises(ValueError):
        HeldConversation(cache, 1, max_keys=0)
