"""The engine's held-prefix oracle (``GET /sim/held-prefixes``): the truth fault tests
compare the router's KV index with, so it must name keys exactly as the router does and
follow the cache through hits, evictions, resets and anchorless requests, in bounded memory.
"""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest

from bus.prefix_key import extract_prefix_key
from harness.sim.engine import SimConfig, SimEngine
from harness.sim.fleet import SimFleet
from harness.sim.held import HeldPrefixes
from harness.sim.httpserver import Request, Response, dumps, loads


def body(system: str, user: str = "question", **extra: Any) -> dict[str, Any]:
    return {
        "model": "demo-model",
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": user},
        ],
        **extra,
    }


def long_system(tag: str) -> str:
    return f"[{tag}] " + " ".join(f"rule {tag} number {i} applies." for i in range(40))


def key_hex(b: dict[str, Any]) -> str:
    key = extract_prefix_key(b)
    assert key is not None
    return key.hex()


async def call(engine: SimEngine, method: str, path: str, b: Any = None) -> Any:
    raw = b"" if b is None else dumps(b)
    resp = await engine(Request(method, path, "", {}, raw))
    assert isinstance(resp, Response), resp
    assert resp.status == 200, resp.body
    return loads(resp.body) if resp.body else None


async def held(engine: SimEngine) -> dict[str, Any]:
    doc: dict[str, Any] = await call(engine, "GET", "/sim/held-prefixes")
    return doc


async def test_served_prefix_is_held_under_the_routers_key() -> None:
    engine = SimEngine(SimConfig(name="sim-x"))
    b = body(long_system("a"))
    await call(engine, "POST", "/v1/chat/completions", b)
    doc = await held(engine)
    assert doc["backend"] == "sim-x"
    assert set(doc["held"]) == {key_hex(b)}
    assert doc["held"][key_hex(b)] >= 1
    assert doc["held_keys"] == doc["served_keys"] == 1


async def test_anthropic_messages_use_the_same_key_function() -> None:
    engine = SimEngine(SimConfig())
    b = {
        "model": "demo-model",
        "max_tokens": 8,
        "system": long_system("anthropic"),
        "messages": [{"role": "user", "content": "hello"}],
    }
    await call(engine, "POST", "/v1/messages", b)
    assert set((await held(engine))["held"]) == {key_hex(b)}


async def test_two_conversations_under_one_system_prompt_are_one_key() -> None:
    engine = SimEngine(SimConfig())
    s = long_system("shared")
    await call(engine, "POST", "/v1/chat/completions", body(s, "first"))
    await call(engine, "POST", "/v1/chat/completions", body(s, "second"))
    await call(engine, "POST", "/v1/chat/completions", body(long_system("other")))
    doc = await held(engine)
    assert set(doc["held"]) == {key_hex(body(s)), key_hex(body(long_system("other")))}


async def test_eviction_of_every_block_of_a_key_drops_it() -> None:
    # A cache small enough that the second prompt evicts every block of the first.
    engine = SimEngine(SimConfig(capacity_blocks=8, block_size=16))
    first, second = body(long_system("old")), body(long_system("new"))
    await call(engine, "POST", "/v1/chat/completions", first)
    assert key_hex(first) in (await held(engine))["held"]
    await call(engine, "POST", "/v1/chat/completions", second)
    doc = await held(engine)
    assert key_hex(first) not in doc["held"]
    assert key_hex(second) in doc["held"]
    assert doc["served_keys"] == 2


async def test_reset_leaves_nothing_held() -> None:
    engine = SimEngine(SimConfig())
    await call(engine, "POST", "/v1/chat/completions", body(long_system("r")))
    await call(engine, "POST", "/reset_prefix_cache")
    assert (await held(engine))["held"] == {}


async def test_short_prompt_fills_no_block_and_is_not_held() -> None:
    engine = SimEngine(SimConfig(block_size=64))
    await call(engine, "POST", "/v1/chat/completions", body("hi", "yo"))
    doc = await held(engine)
    assert doc["held"] == {} and doc["served_keys"] == 1


async def test_anchorless_request_is_counted_not_keyed() -> None:
    engine = SimEngine(SimConfig())
    await call(
        engine,
        "POST",
        "/v1/chat/completions",
        {"model": "demo-model", "messages": [{"role": "user", "content": ""}]},
    )
    doc = await held(engine)
    assert doc["served_keys"] == 0 and doc["unkeyed_requests"] == 1


async def test_router_salt_in_the_body_does_not_change_the_key() -> None:
    # The router adds cache_salt to the body it forwards; the key is of the messages.
    engine = SimEngine(SimConfig())
    b = body(long_system("salted"))
    await call(engine, "POST", "/v1/chat/completions", dict(b, cache_salt="ctm1.x.y"))
    assert set((await held(engine))["held"]) == {key_hex(b)}


def test_memory_is_bounded_by_keys_and_blocks_per_key() -> None:
    cache: set[int] = set(range(1000))
    h = HeldPrefixes(cache, capacity_blocks=2, max_keys=3, max_blocks_per_key=4)
    for k in range(5):
        h.served(bytes([k]) * 32, list(range(k * 10, k * 10 + 10)))
    assert h.report()["served_keys"] == 3
    assert h.forgotten_keys == 2
    assert all(n <= 4 for n in h.held().values())
    # Blocks gone from the cache are pruned once the record passes twice the capacity.
    cache.clear()
    h.served(b"\x09" * 32, list(range(500, 530)))
    assert h.held() == {}
    assert h._recorded == 0


def test_rejects_empty_bounds() -> None:
    with pytest.raises(ValueError):
        HeldPrefixes(set(), 1, max_keys=0)


async def test_fleet_restart_comes_back_on_the_same_port_and_empty() -> None:
    """What the fault matrix's engine rows rely on: a killed sim restarts where the
    router and the listener look for it, holding nothing."""

    async def held_at(url: str) -> dict[str, int]:
        async with aiohttp.ClientSession() as s, s.get(url + "/sim/held-prefixes") as r:
            doc: dict[str, int] = (await r.json())["held"]
            return doc

    async with SimFleet(n=1) as fleet:
        url = fleet.urls[0]
        b = body(long_system("restart"))
        async with aiohttp.ClientSession() as s, s.post(url + "/v1/chat/completions", json=b) as r:
            assert r.status == 200
        assert key_hex(b) in await held_at(url)
        with pytest.raises(RuntimeError):
            await fleet.restart(0)  # still running
        await fleet.kill(0)
        await fleet.restart(0)
        assert fleet.urls[0] == url
        assert await held_at(url) == {}
