"""Engine -> listener -> SSE, end to end with real processes and real ZMQ sockets.

A simulated engine with Qwen2's real tokenizer and ChatML template publishes vLLM
KV events; the real ``continuum-kv-listener`` process recovers prefix keys through the
engine's ``/detokenize`` and serves them on ``GET /events/{backend}``. The keys must be
exactly what the router computes for the same request (``bus.prefix_key``).
"""

from __future__ import annotations

import asyncio
import secrets
import unicodedata
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from bus.events import KvEvent
from bus.prefix_key import extract_prefix_key
from bus.salt import encode_salt
from bus.sse import SseParser, SseRecord
from harness.procs import Service, free_port
from harness.sim.fleet import SimFleet

from .conftest import wait_until

pytest.importorskip("tokenizers")

MODEL = "demo-model"
SECRET = "e2e-salt-secret-" + "x" * 16
SALT_ENV = "CONTINUUM_SALT_SECRET"


def key_hex(req: Mapping[str, Any]) -> str:
    """The request's prefix key in hex (every request here has one)."""
    key = extract_prefix_key(req)
    assert key is not None, req
    return key.hex()


class ListenerProc(Service):
    def __init__(self, config: dict[str, Any], path: Path) -> None:
        super().__init__("listener", ["listener"], config, path, env={SALT_ENV: SECRET})

    async def stats(self) -> dict[str, Any]:
        async with aiohttp.ClientSession() as s, s.get(self.url + "/stats") as r:
            return await r.json()


class SseClient:
    """Reads GET /events/{backend} with the project's own parser."""

    def __init__(self, url: str, last_event_id: str | None = None) -> None:
        self.url = url
        self.last_event_id = last_event_id
        self.records: list[SseRecord] = []
        self._task: asyncio.Task[None] | None = None
        self._session: aiohttp.ClientSession | None = None
        self.connected = asyncio.Event()

    async def __aenter__(self) -> SseClient:
        self._session = aiohttp.ClientSession()
        self._task = asyncio.get_running_loop().create_task(self._run())
        await asyncio.wait_for(self.connected.wait(), 10)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None and self._session is not None
        self._task.cancel()
        try:
            await self._task
        except (asyncio.CancelledError, Exception):
            pass
        await self._session.close()

    async def _run(self) -> None:
        assert self._session is not None
        headers = {"Last-Event-ID": self.last_event_id} if self.last_event_id else {}
        parser = SseParser(last_id=self.last_event_id)
        async with self._session.get(self.url, headers=headers) as resp:
            assert resp.status == 200
            self.connected.set()
            async for chunk in resp.content.iter_any():
                self.records.extend(parser.feed(chunk))

    def events(self) -> list[KvEvent]:
        return [
            KvEvent.from_json(r.data, event_field=r.event)
            for r in self.records
            if r.event != "error"
        ]

    def created_keys(self) -> set[str]:
        return {
            e.prefix_hash
            for e in self.events()
            if e.event == "cache_created" and e.prefix_hash is not None
        }


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stack(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[dict[str, Any]]:
    """One listener (binding the ZMQ port) and one qwen2 engine publishing to it."""
    tmp = tmp_path_factory.mktemp("listener")
    zmq_port = free_port()
    # The engine's replay socket lets the listener recover the batches it missed while
    # its SUB was still connecting (ZMQ's slow joiner) or across a listener restart.
    replay_port = free_port()
    async with SimFleet(
        n=1,
        model=MODEL,
        names=["engine-1"],
        tokenizer="qwen2",
        # The engine binds (vLLM's default, tcp://*:5557) and the listener connects. The
        # other way round, an engine started first keeps reconnecting to an ephemeral
        # loopback port and can connect to itself (TCP simultaneous open).
        kv_events=f"tcp://*:{zmq_port}",
        kv_events_format="vllm-0.33",
        kv_events_replay=f"tcp://*:{replay_port}",
    ) as fleet:
        config = {
            "listen": "127.0.0.1:0",
            "salt_secret_env": "CONTINUUM_SALT_SECRET",
            "history_size": 64,
            "sources": [
                {
                    "backend_name": "engine-1",
                    "engine": "vllm",
                    "zmq_endpoint": f"tcp://127.0.0.1:{zmq_port}",
                    "zmq_mode": "connect",
                    "replay_endpoint": f"tcp://127.0.0.1:{replay_port}",
                    "allowed_publishers": ["127.0.0.1"],
                    "detokenize_endpoint": f"{fleet.urls[0]}/detokenize",
                    "model": MODEL,
                    "chat_template": "chatml",
                }
            ],
        }
        listener = await ListenerProc(config, tmp / "listener.yaml").start()
        # ZMQ's slow joiner: batches published before the connection is up are lost (as
        # with the real engines). Warm up until the listener has received a frame.
        n = 0

        async def connected() -> bool:
            nonlocal n
            n += 1
            await post(
                fleet.urls[0] + "/v1/chat/completions",
                {"model": MODEL, "messages": [{"role": "user", "content": long_system(f"w{n}")}]},
            )
            return (await listener.stats())["sources"]["engine-1"]["frames"] > 0

        await wait_until(connected, within=15, interval=0.1, what="the engine's first frame")
        try:
            yield {
                "fleet": fleet,
                "listener": listener,
                "tmp": tmp,
                "zmq_port": zmq_port,
                "replay_port": replay_port,
            }
        finally:
            assert await listener.stop() == 0, listener.log()


async def post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    async with aiohttp.ClientSession() as s, s.post(url, json=body) as r:
        assert r.status == 200, await r.text()
        return await r.json()


def long_system(tag: str) -> str:
    return f"You are assistant {tag}. " + " ".join(f"rule-{tag}-{i}" for i in range(60))


# Long enough that the system turn's end marker lands in a full block, not in the
# trailing partial block the engine never publishes.
LONG_QUESTION = "Please explain, step by step and with examples, " * 6


def sys_req(tag: str) -> dict[str, Any]:
    """A system prompt followed by a user turn: the chain holds the system turn's end.

    (The engine publishes only full blocks of the prompt, so an anchor is complete once
    a later turn starts, or once it is longer than max_prefix_length.)
    """
    return {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": long_system(tag)},
            {"role": "user", "content": LONG_QUESTION},
        ],
    }


async def test_listener_keys_equal_the_routers_for_openai_and_anthropic(stack) -> None:
    fleet, listener = stack["fleet"], stack["listener"]
    events_url = f"{listener.url}/events/engine-1"
    openai_req = {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": long_system("oa")},
            {"role": "user", "content": LONG_QUESTION},
        ],
    }
    parts_req = {
        "model": MODEL,
        "messages": [
            {
                "role": "system",
                "content": [
                    {"type": "text", "text": long_system("p1")},
                    {"type": "text", "text": "Second part, ünïcödé 한국어."},
                ],
            },
            {"role": "user", "content": LONG_QUESTION},
        ],
    }
    # No system prompt: the first message is the anchor; longer than max_prefix_length
    # (1024 bytes), so its first 1024 bytes decide the key even without the turn's end.
    no_system_req = {
        "model": MODEL,
        "messages": [{"role": "user", "content": long_system("user-only") * 3}],
    }
    anthropic_req = {
        "model": MODEL,
        "max_tokens": 8,
        "system": [{"type": "text", "text": long_system("an")}],
        "messages": [{"role": "user", "content": LONG_QUESTION}],
    }
    expected = {key_hex(r) for r in (openai_req, parts_req, no_system_req, anthropic_req)}
    async with SseClient(events_url) as sse:
        await post(fleet.urls[0] + "/v1/chat/completions", openai_req)
        await post(fleet.urls[0] + "/v1/chat/completions", parts_req)
        await post(fleet.urls[0] + "/v1/chat/completions", no_system_req)
        await post(fleet.urls[0] + "/v1/messages", anthropic_req)

        async def all_seen() -> bool:
            return expected <= sse.created_keys()

        try:
            await wait_until(all_seen, within=20, what="cache_created for every request's key")
        except AssertionError:
            names = ["openai", "parts", "no_system", "anthropic"]
            reqs: tuple[dict[str, Any], ...] = (openai_req, parts_req, no_system_req, anthropic_req)
            missing = [
                n for n, r in zip(names, reqs, strict=True) if key_hex(r) not in sse.created_keys()
            ]
            raise AssertionError(f"missing keys for {missing}: {await listener.stats()}") from None
    # The stream starts with resync (+ snapshot) for a consumer without an event ID.
    assert sse.records[0].event == "resync"


async def test_salt_echo_attributes_without_detokenizing_and_rejects_forgeries(stack) -> None:
    fleet, listener = stack["fleet"], stack["listener"]
    req = {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": long_system("salted")},
            {"role": "user", "content": LONG_QUESTION},
        ],
    }
    key = extract_prefix_key(req)
    assert key is not None
    good = encode_salt(SECRET.encode(), "engine-1", key, "tenant-a")
    other_key = bytes(32)
    forged = encode_salt(b"not-the-secret-" + b"y" * 16, "engine-1", other_key)
    async with SseClient(f"{listener.url}/events/engine-1") as sse:
        await post(fleet.urls[0] + "/v1/chat/completions", {**req, "cache_salt": good})
        forged_req = {
            "model": MODEL,
            "messages": [
                {"role": "system", "content": long_system("forged")},
                {"role": "user", "content": LONG_QUESTION},
            ],
            "cache_salt": forged,
        }
        await post(fleet.urls[0] + "/v1/chat/completions", forged_req)

        async def salted_seen() -> bool:
            return key.hex() in sse.created_keys()

        await wait_until(salted_seen, within=15, what="the salted prefix")

        async def forged_discarded() -> bool:
            stats = (await listener.stats())["sources"]["engine-1"]
            return stats.get("salt_failures", 0) >= 1

        await wait_until(forged_discarded, within=10, what="the forged salt to be counted")
        forged_key = key_hex(forged_req)
        assert forged_key not in sse.created_keys()
        assert other_key.hex() not in sse.created_keys()


async def test_reconnect_with_last_event_id_has_no_duplicate_and_no_gap(stack) -> None:
    fleet, listener = stack["fleet"], stack["listener"]
    url = f"{listener.url}/events/engine-1"
    async with SseClient(url) as first:
        await post(fleet.urls[0] + "/v1/chat/completions", sys_req("r1"))

        async def got_live() -> bool:
            return any(r.event == "cache_created" and "-" in (r.id or "") for r in first.records)

        await wait_until(got_live, within=15, what="a live event")
    last_id = first.records[-1].id
    assert last_id is not None
    await post(fleet.urls[0] + "/v1/chat/completions", sys_req("r2"))
    expected_key = key_hex(sys_req("r2"))

    async with SseClient(url, last_event_id=last_id) as second:

        async def caught_up() -> bool:
            return expected_key in second.created_keys()

        await wait_until(caught_up, within=15, what="the missed event after reconnect")
    epoch, _, seq = last_id.partition("-")
    resumed = [r for r in second.records if r.id]
    assert resumed[0].event != "resync"  # replayed from the ring, not re-synchronised
    ids = [r.id for r in resumed if r.id]
    seqs = [int(i.partition("-")[2]) for i in ids if i.startswith(epoch + "-")]
    assert seqs == list(range(int(seq) + 1, int(seq) + 1 + len(seqs)))  # no gap, no duplicate


async def test_listener_restart_gives_resync_and_snapshot(stack) -> None:
    fleet, listener = stack["fleet"], stack["listener"]
    url = f"{listener.url}/events/engine-1"
    req = sys_req("restart")
    key = key_hex(req)
    async with SseClient(url) as sse:
        await post(fleet.urls[0] + "/v1/chat/completions", req)

        async def seen() -> bool:
            return key in sse.created_keys()

        await wait_until(seen, within=15, what="the prefix before restart")
    old_id = sse.records[-1].id
    assert await listener.stop() == 0
    listener.config["listen"] = listener.url.removeprefix("http://")
    await listener.start()
    # The restarted listener learns the engine's blocks again through replay.
    async with SseClient(listener.url + "/events/engine-1", last_event_id=old_id) as after:

        async def resynced() -> bool:
            return bool(after.records) and after.records[0].event == "resync"

        await wait_until(resynced, within=15, what="resync for an ID from the old epoch")

        async def relearned() -> bool:
            # Nothing new was published: only the engine's replay buffer can teach the
            # restarted listener the blocks stored before it started.
            await post(fleet.urls[0] + "/v1/chat/completions", sys_req("after-restart"))
            return key in after.created_keys()

        await wait_until(relearned, within=15, what="the pre-restart prefix, via replay")
    assert after.records[0].id is not None and not after.records[0].id.startswith(
        (old_id or "").partition("-")[0] + "-"
    )


async def test_unknown_backend_is_404(stack) -> None:
    listener = stack["listener"]
    async with aiohttp.ClientSession() as s, s.get(listener.url + "/events/nope") as r:
        assert r.status == 404


def test_secret_is_long_enough() -> None:
    assert len(SECRET) >= 16 and secrets.compare_digest(SECRET, SECRET)


async def test_trtllm_source_takes_keys_from_router_salts(tmp_path: Path) -> None:
    """trtllm-serve has no public /detokenize: only router-issued salts attribute chains."""
    async with SimFleet(n=1, model=MODEL, names=["trt-1"], kv_events_trtllm=True) as fleet:
        config = {
            "listen": "127.0.0.1:0",
            "salt_secret_env": "CONTINUUM_SALT_SECRET",
            "sources": [
                {
                    "backend_name": "trt-1",
                    "engine": "trtllm",
                    "trtllm_endpoint": f"{fleet.urls[0]}/kv_cache_events",
                    "allowed_publishers": ["127.0.0.1"],
                    "poll_interval_ms": 20,
                }
            ],
        }
        listener = await ListenerProc(config, tmp_path / "listener.yaml").start()
        try:
            req = sys_req("trt")
            key = extract_prefix_key(req)
            assert key is not None
            salt = encode_salt(SECRET.encode(), "trt-1", key)
            async with SseClient(f"{listener.url}/events/trt-1") as sse:
                await post(fleet.urls[0] + "/v1/chat/completions", {**req, "cache_salt": salt})
                unsalted = sys_req("trt-unsalted")
                await post(fleet.urls[0] + "/v1/chat/completions", unsalted)

                async def seen() -> bool:
                    return key.hex() in sse.created_keys()

                await wait_until(seen, within=15, what="the salted trtllm prefix")
                unsalted_key = key_hex(unsalted)
                assert unsalted_key not in sse.created_keys()
            stats = (await listener.stats())["sources"]["trt-1"]
            assert stats["polls"] > 0 and stats["attributed_prefixes"] >= 1
        finally:
            assert await listener.stop() == 0, listener.log()
        # Salts never appear in the listener's logs.
        assert listener.log_path is not None  # beside its config: Service's default
        assert salt not in listener.log_path.read_text()


async def test_conversation_keys_are_the_routers_over_the_rendered_prompt(stack) -> None:
    """A second listener on the same engine, in conversation mode with the model's
    tokenizer.json: its chain keys are the router's keys over the rendered prompt (the
    chunks that full blocks cover), with no /detokenize call."""
    from tokenizers import Tokenizer

    from bus.prompt_chain import chain_keys, chain_root
    from harness.sim.tokenizer import Qwen2Tokenizer, bundled_qwen2_json

    fleet, tmp = stack["fleet"], stack["tmp"]
    zmq_port, replay_port = stack["zmq_port"], stack["replay_port"]
    chunk = 256
    config = {
        "listen": "127.0.0.1:0",
        "conversation": {"enabled": True, "chunk_bytes": chunk},
        "sources": [
            {
                "backend_name": "engine-1",
                "engine": "vllm",
                "zmq_endpoint": f"tcp://127.0.0.1:{zmq_port}",
                "replay_endpoint": f"tcp://127.0.0.1:{replay_port}",
                "allowed_publishers": ["127.0.0.1"],
                "model": MODEL,
                "tokenizer": str(bundled_qwen2_json()),
            }
        ],
    }
    listener = await ListenerProc(config, tmp / "conversation.yaml").start()
    try:
        n = 0

        async def connected() -> bool:
            nonlocal n
            n += 1
            body = {"model": MODEL, "messages": [{"role": "user", "content": long_system(f"c{n}")}]}
            await post(fleet.urls[0] + "/v1/chat/completions", body)
            return (await listener.stats())["sources"]["engine-1"]["frames"] > 0

        await wait_until(connected, within=15, interval=0.1, what="the engine's first frame")
        messages = [
            {"role": "system", "content": long_system("conv") + " Réponds en français. 東京 😀"},
            {"role": "user", "content": LONG_QUESTION + " e\u0301t\u00e9"},
        ]
        text = Qwen2Tokenizer().render_chat(messages)  # what the engine renders
        enc = Tokenizer.from_file(str(bundled_qwen2_json())).encode(text, add_special_tokens=False)
        full = len(enc.ids) // 16 * 16  # the engine publishes full blocks only
        normalized = unicodedata.normalize("NFC", text)
        covered = len(unicodedata.normalize("NFC", text[: enc.offsets[full - 1][1]]).encode())
        want = [k.hex() for k in chain_keys(normalized.encode(), chain_root(MODEL), chunk)]
        want = want[: covered // chunk]
        assert len(want) >= 3
        async with SseClient(f"{listener.url}/events/engine-1") as sse:
            await post(
                fleet.urls[0] + "/v1/chat/completions", {"model": MODEL, "messages": messages}
            )

            async def all_seen() -> bool:
                seen = {e.chain_key for e in sse.events() if e.event == "chain_created"}
                return set(want) <= seen

            await wait_until(all_seen, within=20, what="chain_created for every covered chunk")
        stats = (await listener.stats())["sources"]["engine-1"]
        assert stats["chain_unmapped_tokens"] == stats["chain_mismatched_tokens"] == 0
    finally:
        assert await listener.stop() == 0, listener.log()
