"""The Gemini context cache and native API through a real router process.

The router runs as its own process in front of the Gemini API simulator
(``harness/gemini_sim.py``, in this process). What a user relies on: the first request is
never delayed (forwarded whole) and one cachedContents resource is created however many
identical requests arrive together; later requests reference it instead of resending the
system prompt; usage says how many prompt tokens were cached; an expired resource costs
one retry, not an error; the official ``openai`` SDK works unchanged over the native API,
streaming and tool calls included.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any, cast

import openai
import orjson
import pytest_asyncio
from anthropic.types import ToolParam, ToolUseBlockParam
from openai.types.chat import (
    ChatCompletionFunctionToolParam,
    ChatCompletionMessageFunctionToolCall,
)

from harness.gemini_sim import GeminiSim

from .conftest import RouterLauncher, RouterProc, http, metric_value, wait_until

MODEL = "gemini-2.5-flash"
KEY = "sim-key"
STATS = "/admin/gemini-context-cache/stats"


def big_system(tag: str, n: int = 6000) -> str:
    """A system prompt of ``n`` bytes (1500 simulated tokens: above the sim's minimum)."""
    head = f"You are the {tag} assistant. "
    return head + "x" * (n - len(head))


def chat(system: str | None, user: str, **extra: Any) -> dict[str, Any]:
    messages: list[dict[str, Any]] = []
    if system is not None:
        messages.append({"role": "system", "content": system})
    messages.append({"role": "user", "content": user})
    return {"model": MODEL, "messages": messages, **extra}


def gemini_backend(sim: GeminiSim, name: str = "gem-1") -> dict[str, Any]:
    return {
        "name": name,
        "url": sim.url,
        "type": "gemini",
        "models": [MODEL],
        "api_key_env": "GEMINI_SIM_KEY",
    }


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def sim() -> AsyncIterator[GeminiSim]:
    async with GeminiSim(min_cache_tokens=1024, api_key=KEY) as s:
        yield s


async def _launch(launcher: RouterLauncher, sim: GeminiSim, **cache: Any) -> RouterProc:
    config = {
        "backends": [gemini_backend(sim)],
        "gemini_context_cache": {"enabled": True, "min_prefix_bytes": 4096, **cache},
    }
    return await launcher.start(config, env={"GEMINI_SIM_KEY": KEY})


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def router(sim: GeminiSim, module_router_launcher: RouterLauncher) -> RouterProc:
    return await _launch(module_router_launcher, sim)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def native_router(sim: GeminiSim, module_router_launcher: RouterLauncher) -> RouterProc:
    return await _launch(module_router_launcher, sim, prefer_native_api=True)


def requests_to(sim: GeminiSim, path: str, since: int = 0) -> list[dict[str, Any]]:
    return [r for r in sim.log[since:] if r["path"].startswith(path)]


async def stats(router: RouterProc) -> dict[str, Any]:
    return await router.stats_of(STATS)


async def cached(router: RouterProc, sim: GeminiSim, system: str) -> str:
    """Wait until ``system`` has a resource and the router has recorded it; its name."""

    async def ready() -> bool:
        if not any(res.system == system for res in sim.resources.values()):
            return False
        return (await stats(router))["in_flight"] == 0

    await wait_until(ready, 10, what="the cache entry of a system prompt")
    return _resource_for(sim, system)


async def entries_at_least(router: RouterProc, n: int) -> None:
    async def ready() -> bool:
        s = await stats(router)
        return s["entries"] >= n and s["in_flight"] == 0

    await wait_until(ready, 10, what=f"{n} gemini cache entries")


async def test_single_flight_then_reference(router: RouterProc, sim: GeminiSim) -> None:
    system = big_system("single-flight")
    before = (await stats(router))["counters"]
    start = len(sim.log)
    await _control(sim, hold_creates=True)
    try:
        results = await asyncio.gather(*(router.chat(chat(system, f"q{i}")) for i in range(20)))
        assert all(r.status == 200 for r in results), results[0]
        # Every one of them went out whole, at once, while the create was held.
        sent = requests_to(sim, "/v1beta/openai/chat/completions", start)
        assert len(sent) == 20
        for req in sent:
            assert req["body"]["messages"][0] == {"role": "system", "content": system}
            assert "extra_body" not in req["body"]
        s = await stats(router)
        assert s["in_flight"] == 1
        assert s["counters"]["miss"] - before["miss"] == 20
        assert s["counters"]["hit"] == before["hit"]
    finally:
        await _control(sim, hold_creates=False)
    await cached(router, sim, system)
    creates = [
        r for r in requests_to(sim, "/v1beta/cachedContents", start) if r["method"] == "POST"
    ]
    assert len(creates) == 1
    body = creates[0]["body"]
    assert body["model"] == "models/" + MODEL
    assert body["systemInstruction"] == {"parts": [{"text": system}]}
    assert body["ttl"] == "600s"

    # The next request carries the reference and not the system prompt.
    mark = len(sim.log)
    r = await router.chat(chat(system, "after", extra_body={"google": {"thinking": 1}}))
    assert r.status == 200, r
    (sent_after,) = requests_to(sim, "/v1beta/openai/chat/completions", mark)
    name = _resource_for(sim, system)
    assert sent_after["body"]["messages"] == [{"role": "user", "content": "after"}]
    google = sent_after["body"]["extra_body"]["google"]
    assert google == {"thinking": 1, "cached_content": name}
    usage = r.json()["usage"]
    assert usage["prompt_tokens"] == 1500 + 2  # the whole prompt, cached part included
    assert usage["prompt_tokens_details"]["cached_tokens"] == 1500

    # Streaming: the last usage chunk says the same.
    events = await _sse(
        router, chat(system, "stream", stream=True, stream_options={"include_usage": True})
    )
    usage_chunks = [e for e in events if e.get("usage")]
    assert usage_chunks and usage_chunks[-1]["usage"]["prompt_tokens_details"] == {
        "cached_tokens": 1500
    }
    s = await stats(router)
    assert s["counters"]["hit"] - before["hit"] == 2
    assert s["counters"]["creates"] - before["creates"] == 1
    assert s["counters"]["cached_tokens"] - before["cached_tokens"] == 3000
    assert s["backends"]["gem-1"]["entries"] == 1
    text = await router.metrics()
    assert metric_value(text, "continuum_gemini_context_cache_hit_total", backend="gem-1") >= 2
    assert metric_value(text, "continuum_gemini_context_cache_entries") == 1
    assert metric_value(text, "continuum_gemini_usage_tokens_total", kind="cached_input") >= 3000


async def test_credentials(router: RouterProc, native_router: RouterProc, sim: GeminiSim) -> None:
    """The backend's own key, in each path's scheme; the client's key never travels."""
    leak = {"x-goog-api-key": "client-key", "authorization": "Bearer client-key"}
    mark = len(sim.log)
    assert (await router.chat(chat(None, "k"), headers=leak)).status == 200
    assert (await native_router.chat(chat(None, "k"), headers=leak)).status == 200
    compat, native = sim.log[mark:]
    assert compat["auth"] == {"authorization": f"Bearer {KEY}"}
    assert native["auth"] == {"x-goog-api-key": KEY}
    creates = [r for r in sim.log if r["method"] == "POST" and r["path"].endswith("cachedContents")]
    assert creates and all(r["auth"] == {"x-goog-api-key": KEY} for r in creates)


async def test_expired_resource_is_retried_without_it(router: RouterProc, sim: GeminiSim) -> None:
    system = big_system("expiring")
    assert (await router.chat(chat(system, "one"))).status == 200
    name = await cached(router, sim, system)
    await _control(sim, expire=name)  # Google dropped it before the router's ttl ran out
    mark = len(sim.log)
    r = await router.chat(chat(system, "two"))
    assert r.status == 200, r
    first, second = requests_to(sim, "/v1beta/openai/chat/completions", mark)
    assert first["body"]["extra_body"]["google"]["cached_content"] == name
    assert second["body"]["messages"][0]["content"] == system
    assert "extra_body" not in second["body"]
    stale = (await stats(router))["counters"]["stale"]
    assert stale >= 1
    # The next request is a miss that creates a fresh resource; streams recover alike.
    assert (await router.chat(chat(system, "three"))).status == 200
    fresh = await cached(router, sim, system)
    assert fresh != name
    await _control(sim, expire=fresh)
    mark = len(sim.log)
    events = await _sse(router, chat(system, "four", stream=True))
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"])
    first, second = requests_to(sim, "/v1beta/openai/chat/completions", mark)
    assert first["body"]["extra_body"]["google"]["cached_content"] == fresh
    assert "extra_body" not in second["body"]
    assert (await stats(router))["counters"]["stale"] == stale + 1


async def test_small_prompts_and_rejections(router: RouterProc, sim: GeminiSim) -> None:
    before = (await stats(router))["counters"]
    # Under min_prefix_bytes: never considered.
    assert (await router.chat(chat("short system", "hi"))).status == 200
    # Above min_prefix_bytes but under the model's token minimum: Google says 400 once.
    small = big_system("too-small", 4100)  # 1025 tokens of system...
    await _control(sim, min_cache_tokens=5000)
    try:
        assert (await router.chat(chat(small, "a"))).status == 200

        async def rejected() -> bool:
            return (await stats(router))["negative_entries"] >= 1

        await wait_until(rejected, 10, what="a negative entry")
        mark = len(sim.log)
        assert (await router.chat(chat(small, "b"))).status == 200
        assert not [r for r in requests_to(sim, "/v1beta/cachedContents", mark)]
    finally:
        await _control(sim, min_cache_tokens=1024)
    after = (await stats(router))["counters"]
    assert after["ineligible"] == before["ineligible"] + 1
    assert after["create_failures"] == before["create_failures"] + 1
    assert after["negative"] == before["negative"] + 1


async def test_admin_clear_deletes_remote_resources(
    sim: GeminiSim, module_router_launcher: RouterLauncher
) -> None:
    rp = await _launch(module_router_launcher, sim)
    for i in range(3):
        assert (await rp.chat(chat(big_system(f"clear-{i}"), "x"))).status == 200
    await entries_at_least(rp, 3)
    names = {_resource_for(sim, big_system(f"clear-{i}")) for i in range(3)}
    mark = len(sim.log)
    assert await rp.post_json("/admin/gemini-context-cache/clear", {}) == {
        "success": True,
        "cleared_entries": 3,
    }
    deleted = {
        r["path"].removeprefix("/v1beta/") for r in sim.log[mark:] if r["method"] == "DELETE"
    }
    assert deleted == names
    assert not names & set(sim.resources)
    assert (await stats(rp))["entries"] == 0


async def test_lru_eviction_deletes(sim: GeminiSim, module_router_launcher: RouterLauncher) -> None:
    rp = await _launch(module_router_launcher, sim, max_entries=10)
    for i in range(10):
        assert (await rp.chat(chat(big_system(f"lru-{i}"), "x"))).status == 200
        await entries_at_least(rp, i + 1)
    oldest = _resource_for(sim, big_system("lru-0"))
    mark = len(sim.log)
    assert (await rp.chat(chat(big_system("lru-10"), "x"))).status == 200

    async def deleted() -> bool:
        return any(
            r["method"] == "DELETE" and r["path"] == "/v1beta/" + oldest for r in sim.log[mark:]
        )

    await wait_until(deleted, 10, what="the LRU entry's DELETE")
    s = await stats(rp)
    assert s["entries"] == 10 and s["counters"]["evictions"] == 1


async def test_endpoint_without_cached_contents(
    sim: GeminiSim, module_router_launcher: RouterLauncher
) -> None:
    rp = await _launch(module_router_launcher, sim)
    await _control(sim, cached_contents=False)
    try:
        for i in range(3):
            for _ in range(2):
                assert (await rp.chat(chat(big_system(f"proxy-{i}"), "x"))).status == 200

        async def settled() -> bool:
            s = await stats(rp)
            return s["in_flight"] == 0 and s["negative_entries"] == 3

        await wait_until(settled, 10, what="three negative entries")
    finally:
        await _control(sim, cached_contents=True)
    s = await stats(rp)
    assert s["entries"] == 0 and s["counters"]["create_failures"] == 3


async def test_disabled(sim: GeminiSim, module_router_launcher: RouterLauncher) -> None:
    rp = await module_router_launcher.start(
        {"backends": [gemini_backend(sim)]}, env={"GEMINI_SIM_KEY": KEY}
    )
    mark = len(sim.log)
    system = big_system("disabled")
    for _ in range(2):
        assert (await rp.chat(chat(system, "x"))).status == 200
    assert not requests_to(sim, "/v1beta/cachedContents", mark)
    s = await stats(rp)
    assert s["enabled"] is False and s["entries"] == 0
    assert s["config"]["min_prefix_bytes"] == 16384
    assert await rp.post_json("/admin/gemini-context-cache/clear", {}) == {
        "success": False,
        "error": "Gemini context cache is not enabled",
    }
    assert "continuum_gemini_context_cache" not in await rp.metrics()


# -- native API through the official SDK ---------------------------------------------------


def sdk(router: RouterProc) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="client-key", max_retries=0)


async def test_native_round_trip_with_sdk(native_router: RouterProc, sim: GeminiSim) -> None:
    system = big_system("native")
    tools: list[ChatCompletionFunctionToolParam] = [
        {
            "type": "function",
            "function": {
                "name": "lookup",
                "description": "Look something up.",
                "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
            },
        }
    ]
    async with sdk(native_router) as client:
        mark = len(sim.log)
        resp = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "system", "content": system}, {"role": "user", "content": "hi"}],
            temperature=0.2,
            max_tokens=64,
            stop=["END"],
        )
        assert resp.choices[0].message.content == "[gemini-sim] hi"
        assert resp.choices[0].finish_reason == "stop"
        assert resp.usage is not None and resp.usage.prompt_tokens == 1500 + 1
        (sent,) = requests_to(sim, "/v1beta/models/", mark)
        assert sent["path"] == f"/v1beta/models/{MODEL}:generateContent"
        assert sent["body"]["systemInstruction"] == {"parts": [{"text": system}]}
        assert sent["body"]["contents"] == [{"role": "user", "parts": [{"text": "hi"}]}]
        assert sent["body"]["generationConfig"] == {
            "temperature": 0.2,
            "maxOutputTokens": 64,
            "stopSequences": ["END"],
        }
        await cached(native_router, sim, system)

        # A hit: cachedContent set, systemInstruction gone; usage reports the cached part.
        mark = len(sim.log)
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "system", "content": system}, {"role": "user", "content": "again"}],
            stream=True,
            stream_options={"include_usage": True},
        )
        text, finish, usage = "", None, None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage is not None:
                usage = chunk.usage
        assert text == "[gemini-sim] again" and finish == "stop"
        assert usage is not None and usage.prompt_tokens_details is not None
        assert usage.prompt_tokens_details.cached_tokens == 1500
        (sent,) = requests_to(sim, "/v1beta/models/", mark)
        assert sent["path"] == f"/v1beta/models/{MODEL}:streamGenerateContent?alt=sse"
        assert sent["body"]["cachedContent"] == _resource_for(sim, system)
        assert "systemInstruction" not in sent["body"]

        # Tool calls, both directions, with no cache (tools are not cacheable here).
        first = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "call weather"}],
            tools=tools,
            tool_choice="auto",
        )
        msg = first.choices[0].message
        assert first.choices[0].finish_reason == "tool_calls"
        assert msg.tool_calls
        call = msg.tool_calls[0]
        assert isinstance(call, ChatCompletionMessageFunctionToolCall)  # not a custom tool's
        assert call.function.name == "lookup"
        assert orjson.loads(call.function.arguments) == {"q": "weather"}
        second = await client.chat.completions.create(
            model=MODEL,
            messages=[
                {"role": "user", "content": "call weather"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": call.id,
                            "type": "function",
                            "function": {"name": "lookup", "arguments": call.function.arguments},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'},
            ],
            tools=tools,
        )
        assert second.choices[0].message.content == 'tool said: {"temp":21}'

        # Streaming tool calls.
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "call news"}],
            tools=tools,
            stream=True,
        )
        calls, finish = [], None
        async for chunk in stream:
            if chunk.choices:
                calls.extend(chunk.choices[0].delta.tool_calls or [])
                finish = chunk.choices[0].finish_reason or finish
        assert finish == "tool_calls"
        assert [c.function.name for c in calls if c.function] == ["lookup"]


async def test_native_implicit_cache_and_errors(native_router: RouterProc, sim: GeminiSim) -> None:
    # A system prompt under min_prefix_bytes is not router-cached, but Gemini's implicit
    # caching reports it once seen: the same cached_tokens field carries it.
    system = "y" * 4200  # 1050 tokens: over the sim's implicit minimum
    for _ in range(2):
        r = await native_router.chat(chat(system, "z"))
        assert r.status == 200, r
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 1050
    # Translation errors are the client's: 400 in OpenAI's shape, nothing sent upstream.
    mark = len(sim.log)
    bad = chat(None, "x")
    bad["messages"].append({"role": "tool", "tool_call_id": "nope", "content": "1"})
    r = await native_router.chat(bad)
    assert r.status == 400 and "tool_call_id" in r.json()["error"]["message"]
    # Google's own errors come back in OpenAI's shape.
    r = await native_router.chat({"model": MODEL, "messages": [{"role": "system", "content": "s"}]})
    assert r.status == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert len(requests_to(sim, "/v1beta/models/", mark)) == 0


# -- helpers --------------------------------------------------------------------------------


async def _control(sim: GeminiSim, **body: Any) -> None:
    if "min_cache_tokens" in body:
        sim.min_cache_tokens = body.pop("min_cache_tokens")
    if body:
        r = await http("POST", sim.url + "/_sim/control", json=body)
        assert r.status == 200, r


def _resource_for(sim: GeminiSim, system: str) -> str:
    names = [n for n, res in sim.resources.items() if res.system == system]
    assert len(names) == 1, names
    return names[0]


async def _sse(router: RouterProc, body: dict[str, Any]) -> list[dict[str, Any]]:
    r = await http("POST", router.url + "/v1/chat/completions", json=body)
    assert r.status == 200, r
    events = []
    for block in r.body.split(b"\n\n"):
        if block.startswith(b"data: {"):
            events.append(orjson.loads(block[6:]))
    return events


# -- Anthropic Messages through the official SDK --------------------------------------------


async def test_anthropic_messages_via_gemini(router: RouterProc, sim: GeminiSim) -> None:
    """``/anthropic/v1/messages`` for a gemini-only model: native API, Anthropic's usage
    split (cache reads out of input_tokens), and the same cache entry as the OpenAI form."""
    import anthropic

    system = big_system("anthropic")
    async with anthropic.AsyncAnthropic(
        base_url=router.url + "/anthropic", api_key="client-key", max_retries=0
    ) as client:
        mark = len(sim.log)
        first = await client.messages.create(
            model=MODEL,
            system=system,
            max_tokens=32,
            messages=[{"role": "user", "content": "hello"}],
        )
        assert first.content[0].type == "text" and first.content[0].text == "[gemini-sim] hello"
        assert first.stop_reason == "end_turn"
        assert first.usage.input_tokens == 1500 + 2 and not first.usage.cache_read_input_tokens
        (sent,) = requests_to(sim, "/v1beta/models/", mark)
        assert sent["path"] == f"/v1beta/models/{MODEL}:generateContent"
        assert sent["auth"] == {"x-goog-api-key": KEY}
        assert sent["body"]["systemInstruction"] == {"parts": [{"text": system}]}
        assert sent["body"]["generationConfig"] == {"maxOutputTokens": 32}
        await cached(router, sim, system)

        # The OpenAI form of the same system prompt hits the same resource.
        r = await router.chat(chat(system, "openai side"))
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 1500

        mark = len(sim.log)
        async with client.messages.stream(
            model=MODEL,
            system=system,
            max_tokens=32,
            messages=[{"role": "user", "content": "streamed"}],
        ) as stream:
            text = "".join([t async for t in stream.text_stream])
            final = await stream.get_final_message()
        assert text == "[gemini-sim] streamed"
        assert final.usage.cache_read_input_tokens == 1500
        assert final.usage.input_tokens == 2  # fresh input only ("streamed": 2 tokens)
        (sent,) = requests_to(sim, "/v1beta/models/", mark)
        assert sent["body"]["cachedContent"] == _resource_for(sim, system)
        assert "systemInstruction" not in sent["body"]

        # Tool use round trip.
        tools: list[ToolParam] = [{"name": "lookup", "input_schema": {"type": "object"}}]
        msg = await client.messages.create(
            model=MODEL,
            max_tokens=32,
            tools=tools,
            messages=[{"role": "user", "content": "call forecast"}],
        )
        assert msg.stop_reason == "tool_use"
        use = next(b for b in msg.content if b.type == "tool_use")
        assert use.name == "lookup" and use.input == {"q": "forecast"}
        reply = await client.messages.create(
            model=MODEL,
            max_tokens=32,
            tools=tools,
            messages=[
                {"role": "user", "content": "call forecast"},
                # The response block goes back as it came (model_dump has the param's keys).
                {"role": "assistant", "content": [cast("ToolUseBlockParam", use.model_dump())]},
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": use.id, "content": '{"rain": 0}'}
                    ],
                },
            ],
        )
        assert reply.content[0].type == "text"
        assert reply.content[0].text == 'tool said: {"rain":0}'

        bad = await http(
            "POST",
            router.url + "/anthropic/v1/messages",
            json={"model": MODEL, "max_tokens": 5, "messages": [{"role": "robot", "content": "x"}]},
        )
        assert bad.status == 400 and bad.json()["type"] == "error"
