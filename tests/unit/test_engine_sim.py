"""The simulated engine must be indistinguishable from a real one to the official SDKs.

Everything router-side (tests, benchmarks, the demo) trusts this sim, so these tests pin the
wire formats against the real ``openai``/``anthropic`` clients, the prefix-cache accounting,
the fault-injection knobs and the HTTP server edge cases (pipelining, chunked bodies,
disconnects). One sim subprocess pair is shared by the module to keep the run fast.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import anthropic
import openai
import pytest
import pytest_asyncio

from harness.sim.engine import SimConfig, SimEngine
from harness.sim.fleet import SimFleet, sim_args
from harness.sim.httpserver import (
    Request,
    Response,
    StreamResponse,
    bound_port,
    dumps,
    serve,
    shutdown,
)
from harness.sim.prefix_cache import PrefixCache, StoredBlock, tokenize

module_loop = pytest.mark.asyncio(loop_scope="module")


def long_context(tag: str) -> str:
    """~190 tokens starting with ``tag``: tests share one sim, so prefixes must not collide."""
    clauses = " ".join(
        f"Clause {i}: the tenant shall keep the premises in good repair and condition."
        for i in range(12)
    )
    return f"[{tag}] {clauses}"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def fleet() -> AsyncIterator[SimFleet]:
    async with SimFleet(
        n=2, model="demo-model", overrides={1: {"unhealthy": True, "trivial": True}}
    ) as f:
        yield f


@pytest.fixture
def url(fleet: SimFleet) -> str:
    return fleet.urls[0]


def oai(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="sk-sim", max_retries=0)


def claude(url: str) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=url, api_key="sk-ant-sim", max_retries=0)


async def get_json(url: str) -> Any:
    async with aiohttp.ClientSession() as s, s.get(url) as r:
        return await r.json()


# -- OpenAI chat ---------------------------------------------------------------------------


@module_loop
async def test_chat_non_streaming(url: str) -> None:
    raw = await oai(url).chat.completions.with_raw_response.create(
        model="demo-model",
        messages=[
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": [{"type": "text", "text": "What is the capital?"}]},
        ],
        max_tokens=8,
    )
    resp = raw.parse()
    assert raw.headers["x-sim-backend"] == "sim-1"
    assert raw.headers["x-sim-cached-tokens"] == "0"
    assert resp.object == "chat.completion"
    assert resp.model == "demo-model"
    choice = resp.choices[0]
    assert choice.message.role == "assistant"
    assert choice.finish_reason == "stop"
    assert choice.message.content == "[sim-1] echo: What is the capital? lorem ipsum"
    assert resp.usage is not None
    assert resp.usage.completion_tokens == 8
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + 8
    assert resp.usage.prompt_tokens_details is not None
    assert resp.usage.prompt_tokens_details.cached_tokens == 0


@module_loop
async def test_chat_streaming_matches_non_streaming(url: str) -> None:
    client = oai(url)
    messages: Any = [{"role": "user", "content": "stream me something please"}]
    plain = await client.chat.completions.create(
        model="demo-model", messages=messages, max_tokens=10
    )
    stream = await client.chat.completions.create(
        model="demo-model",
        messages=messages,
        max_tokens=10,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [c async for c in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "stop" and finishes.count("stop") == 1
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 10
    assert all(c.usage is None for c in chunks[:-1])


@module_loop
async def test_max_tokens_below_answer_length_truncates(url: str) -> None:
    resp = await oai(url).chat.completions.create(
        model="demo-model", messages=[{"role": "user", "content": "a b c d e f"}], max_tokens=3
    )
    assert resp.choices[0].finish_reason == "length"
    assert resp.choices[0].message.content == "[sim-1] echo: a"


@module_loop
async def test_second_identical_request_reports_cached_tokens(url: str) -> None:
    client = oai(url)
    messages: Any = [
        {"role": "system", "content": long_context("chat")},
        {"role": "user", "content": "Who pays for repairs? (chat cache test)"},
    ]
    first = await client.chat.completions.with_raw_response.create(
        model="demo-model", messages=messages
    )
    second = await client.chat.completions.with_raw_response.create(
        model="demo-model", messages=messages
    )
    u1, u2 = first.parse().usage, second.parse().usage
    assert u1 is not None and u2 is not None
    assert u1.prompt_tokens_details is not None and u2.prompt_tokens_details is not None
    assert u1.prompt_tokens_details.cached_tokens == 0
    # Full hit, minus the last token vLLM always recomputes, rounded down to whole blocks.
    assert u2.prompt_tokens_details.cached_tokens == (u2.prompt_tokens - 1) // 16 * 16 > 0
    assert second.headers["x-sim-cached-tokens"] == str(u2.prompt_tokens_details.cached_tokens)


# -- embeddings, models, health ------------------------------------------------------------


@module_loop
async def test_embeddings_base64_and_float_agree(url: str) -> None:
    client = oai(url)
    default = await client.embeddings.create(model="demo-model", input=["alpha", "beta"])
    floats = await client.embeddings.create(
        model="demo-model", input="alpha", encoding_format="float"
    )
    assert default.object == "list" and len(default.data) == 2
    assert [d.index for d in default.data] == [0, 1]
    vec = default.data[0].embedding
    assert len(vec) == 8
    assert math.isclose(sum(v * v for v in vec), 1.0, rel_tol=1e-5)
    assert vec == floats.data[0].embedding
    assert default.data[1].embedding != vec
    assert default.usage.prompt_tokens == 2


@module_loop
async def test_models_health_and_stats(url: str) -> None:
    models = await oai(url).models.list()
    assert [m.id for m in models.data] == ["demo-model"]
    assert await get_json(f"{url}/health") == {"status": "ok"}
    stats = await get_json(f"{url}/sim/stats")
    keys = {"name", "requests", "prompt_tokens", "cached_tokens", "hit_rate", "in_flight"}
    assert keys | {"prefill_seconds_modelled"} <= stats.keys()
    assert stats["name"] == "sim-1"


# -- Anthropic messages --------------------------------------------------------------------


@module_loop
async def test_anthropic_message_caching_and_last_request(url: str) -> None:
    client = claude(url)
    system: Any = [
        {"type": "text", "text": long_context("anthropic"), "cache_control": {"type": "ephemeral"}}
    ]
    messages: Any = [{"role": "user", "content": "Who pays for repairs? (anthropic test)"}]
    first = await client.messages.create(
        model="claude-sim", max_tokens=12, system=system, messages=messages
    )
    assert first.type == "message" and first.role == "assistant"
    assert first.stop_reason == "end_turn" and first.stop_sequence is None
    assert first.content[0].type == "text"
    assert first.content[0].text.startswith("[sim-1] echo: Who pays")
    assert first.usage.output_tokens == 12
    assert first.usage.cache_read_input_tokens == 0
    assert first.usage.cache_creation_input_tokens and first.usage.cache_creation_input_tokens > 0

    second = await client.messages.create(
        model="claude-sim", max_tokens=12, system=system, messages=messages
    )
    assert second.usage.cache_read_input_tokens and second.usage.cache_read_input_tokens > 0
    assert second.usage.cache_creation_input_tokens == 0

    last = await get_json(f"{url}/sim/last-request")
    assert last["system"][0]["cache_control"] == {"type": "ephemeral"}
    assert last["messages"] == messages


@module_loop
async def test_anthropic_cache_control_does_not_change_prompt(url: str) -> None:
    client = claude(url)
    text = long_context("neutrality")
    plain = await client.messages.create(
        model="claude-sim",
        max_tokens=4,
        system=text,
        messages=[{"role": "user", "content": "hi"}],
    )
    marked = await client.messages.create(
        model="claude-sim",
        max_tokens=4,
        system=[{"type": "text", "text": text, "cache_control": {"type": "ephemeral"}}],
        messages=[{"role": "user", "content": "hi"}],
    )
    assert plain.usage.cache_read_input_tokens == 0
    assert marked.usage.cache_read_input_tokens and marked.usage.cache_read_input_tokens > 0


@module_loop
async def test_anthropic_streaming_event_sequence(url: str) -> None:
    client = claude(url)
    messages: Any = [{"role": "user", "content": "stream please"}]
    stream = await client.messages.create(
        model="claude-sim", max_tokens=5, messages=messages, stream=True
    )
    types = [event.type async for event in stream]
    assert types == [
        "message_start",
        "content_block_start",
        *["content_block_delta"] * 5,
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    async with client.messages.stream(
        model="claude-sim", max_tokens=5, messages=messages
    ) as helper:
        final = await helper.get_final_message()
    plain = await client.messages.create(model="claude-sim", max_tokens=5, messages=messages)
    assert final.content[0].type == "text" and plain.content[0].type == "text"
    assert final.content[0].text == plain.content[0].text
    assert final.stop_reason == "end_turn"
    assert final.usage.output_tokens == 5


@module_loop
async def test_raw_anthropic_stream_has_ping_and_event_lines(url: str) -> None:
    body = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]}
    async with (
        aiohttp.ClientSession() as s,
        s.post(f"{url}/v1/messages", json={**body, "stream": True}) as r,
    ):
        assert r.headers["content-type"] == "text/event-stream"
        assert r.headers["transfer-encoding"] == "chunked"
        raw = (await r.read()).decode()
    assert raw.startswith("event: message_start\ndata: {")
    assert 'event: ping\ndata: {"type":"ping"}\n\n' in raw
    assert raw.endswith('event: message_stop\ndata: {"type":"message_stop"}\n\n')


# -- errors and fault injection ------------------------------------------------------------


@module_loop
async def test_malformed_json_is_400_in_each_dialect(url: str) -> None:
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{url}/v1/chat/completions", data=b"{nope") as r:
            assert r.status == 400
            assert (await r.json())["error"]["type"] == "invalid_request_error"
        async with s.post(f"{url}/v1/messages", data=b"[1,") as r:
            assert r.status == 400
            body = await r.json()
            assert body["type"] == "error"
            assert body["error"]["type"] == "invalid_request_error"
        async with s.post(f"{url}/v1/chat/completions", json={"messages": []}) as r:
            assert r.status == 400
    with pytest.raises(anthropic.BadRequestError):
        await claude(url).messages.create(
            model="m",
            max_tokens=0,
            messages=[{"role": "user", "content": "x"}],
        )


@module_loop
async def test_fault_status_header(url: str) -> None:
    with pytest.raises(openai.InternalServerError) as oerr:
        await oai(url).chat.completions.create(
            model="demo-model",
            messages=[{"role": "user", "content": "x"}],
            extra_headers={"x-sim-status": "500"},
        )
    assert oerr.value.status_code == 500
    with pytest.raises(openai.RateLimitError):
        await oai(url).embeddings.create(
            model="demo-model", input="x", extra_headers={"x-sim-status": "429"}
        )
    with pytest.raises(anthropic.APIStatusError) as aerr:
        await claude(url).messages.create(
            model="m",
            max_tokens=3,
            messages=[{"role": "user", "content": "x"}],
            extra_headers={"x-sim-status": "529"},
        )
    assert aerr.value.status_code == 529
    assert aerr.value.body == {
        "type": "error",
        "error": {"type": "overloaded_error", "message": "simulated failure (x-sim-status: 529)"},
    }


@module_loop
async def test_fault_garbage_header(url: str) -> None:
    async with (
        aiohttp.ClientSession() as s,
        s.post(f"{url}/v1/chat/completions", json={}, headers={"x-sim-garbage": "1"}) as r,
    ):
        assert r.status == 200
        assert await r.read() == b"not json at all"
    # The SDK trusts content-type and surfaces the decode failure as-is.
    with pytest.raises((openai.APIError, ValueError)):
        await oai(url).chat.completions.create(
            model="demo-model",
            messages=[{"role": "user", "content": "x"}],
            extra_headers={"x-sim-garbage": "1"},
        )


@module_loop
async def test_fault_delays(url: str) -> None:
    client = oai(url)
    t0 = time.perf_counter()
    await client.chat.completions.create(
        model="demo-model",
        messages=[{"role": "user", "content": "slow"}],
        extra_headers={"x-sim-delay-ms": "200"},
    )
    assert time.perf_counter() - t0 >= 0.2
    t0 = time.perf_counter()
    stream = await client.chat.completions.create(
        model="demo-model",
        messages=[{"role": "user", "content": "slow"}],
        max_tokens=5,
        stream=True,
        extra_headers={"x-sim-stream-delay-ms": "40"},
    )
    pieces = [c async for c in stream]
    assert len(pieces) == 7  # role chunk, 5 words, finish chunk
    assert time.perf_counter() - t0 >= 5 * 0.04


@module_loop
async def test_client_disconnect_mid_stream_cancels_generator(url: str) -> None:
    body = {
        "model": "demo-model",
        "messages": [{"role": "user", "content": "long stream"}],
        "max_tokens": 60,
        "stream": True,
    }
    # 60 chunks x 100 ms = 6 s if nobody cancelled it.
    async with aiohttp.ClientSession() as s:
        r = await s.post(
            f"{url}/v1/chat/completions", json=body, headers={"x-sim-stream-delay-ms": "100"}
        )
        await r.content.readline()
        assert (await get_json(f"{url}/sim/stats"))["in_flight"] == 1
        r.close()
    deadline = time.monotonic() + 3  # well under the 6 s an uncancelled stream would take
    while time.monotonic() < deadline:
        if (await get_json(f"{url}/sim/stats"))["in_flight"] == 0:
            break
        await asyncio.sleep(0.02)
    assert (await get_json(f"{url}/sim/stats"))["in_flight"] == 0


@module_loop
async def test_stream_abort_cuts_the_body(url: str) -> None:
    body = {
        "model": "demo-model",
        "messages": [{"role": "user", "content": "x"}],
        "max_tokens": 10,
        "stream": True,
    }
    async with aiohttp.ClientSession() as s:
        r = await s.post(
            f"{url}/v1/chat/completions", json=body, headers={"x-sim-stream-abort-after": "2"}
        )
        assert r.status == 200
        with pytest.raises(aiohttp.ClientPayloadError):
            await r.read()
        r.close()


@module_loop
async def test_unhealthy_and_trivial_sim(fleet: SimFleet) -> None:
    url = fleet.urls[1]
    async with aiohttp.ClientSession() as s, s.get(f"{url}/health") as r:
        assert r.status == 503
    resp = await oai(url).chat.completions.create(
        model="demo-model", messages=[{"role": "user", "content": "anything"}]
    )
    assert resp.choices[0].message.content == "ok"
    stream = await oai(url).chat.completions.create(
        model="demo-model", messages=[{"role": "user", "content": "x"}], stream=True
    )
    assert "".join([c.choices[0].delta.content or "" async for c in stream]) == "ok"
    stats = (await fleet.stats())[1]
    assert stats["name"] == "sim-2" and stats["requests"] == 2 and stats["prompt_tokens"] == 0


@module_loop
async def test_reset_clears_cache_and_counters(fleet: SimFleet) -> None:
    url = fleet.urls[1]
    await oai(url).chat.completions.create(
        model="demo-model", messages=[{"role": "user", "content": "count me"}]
    )
    await fleet.reset()
    stats = (await fleet.stats())[1]
    assert stats["requests"] == 0 and stats["cache_blocks"] == 0
    async with aiohttp.ClientSession() as s, s.get(f"{url}/sim/last-request") as r:
        assert r.status == 404


# -- HTTP server edge cases (in-process) ---------------------------------------------------


async def _echo(req: Request) -> Response | StreamResponse:
    if req.path == "/stream":

        async def gen() -> AsyncIterator[bytes]:
            for part in (b"one,", b"", b"two,", b"three"):
                yield part

        return StreamResponse(gen(), content_type="text/plain")
    return Response(f"{req.method} {req.path}?{req.query} {len(req.body)} {req.body!r}")


@module_loop
async def test_http_pipelining_chunked_bodies_and_streams() -> None:
    server = await serve(_echo, "127.0.0.1", 0)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", bound_port(server))
        writer.write(
            b"POST /a?x=1 HTTP/1.1\r\nHost: t\r\nContent-Length: 5\r\n\r\nhello"
            b"POST /b HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n"
            b"GET /stream HTTP/1.1\r\nHost: t\r\n\r\n"
            b"GET /c HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n"
        )
        await writer.drain()
        data = await asyncio.wait_for(reader.read(), 5)
        writer.close()
    finally:
        await shutdown(server)
    text = data.decode()
    # In order, and the last one closes the connection (read() returned at EOF).
    i_a = text.index("POST /a?x=1 5 b'hello'")
    i_b = text.index("POST /b? 5 b'abcde'")
    i_s = text.index("4\r\none,\r\n4\r\ntwo,\r\n5\r\nthree\r\n0\r\n\r\n")
    i_c = text.index("GET /c? 0 b''")
    assert i_a < i_b < i_s < i_c
    assert text.count("HTTP/1.1 200 OK") == 4
    assert "transfer-encoding: chunked" in text
    assert text.count("connection: close") == 1


@module_loop
async def test_http_garbage_request_gets_400_and_close() -> None:
    server = await serve(_echo, "127.0.0.1", 0)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", bound_port(server))
        writer.write(b"GET /ok HTTP/1.1\r\nHost: t\r\n\r\nthis is not http\r\n\r\n")
        data = await asyncio.wait_for(reader.read(), 5)
        writer.close()
    finally:
        await shutdown(server)
    assert data.startswith(b"HTTP/1.1 200 OK")
    assert b"HTTP/1.1 400 Bad Request" in data


# -- prefix cache model --------------------------------------------------------------------


def test_tokenizer_is_deterministic_and_word_level() -> None:
    assert tokenize("Hello, world!") == tokenize("Hello,   world !")
    assert len(tokenize("Hello, world!")) == 4
    assert tokenize("a b") != tokenize("b a")


def test_prefix_cache_hits_evicts_and_reports_events() -> None:
    events: list[tuple[list[StoredBlock], list[int]]] = []
    cache = PrefixCache(
        block_size=4, capacity_blocks=4, on_change=lambda s, r: events.append((s, r))
    )
    a = list(range(12))  # 3 full blocks
    assert cache.lookup_and_insert(a) == (0, 12)
    stored, removed = events[-1]
    assert [b.token_ids for b in stored] == [(0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10, 11)]
    assert stored[0].parent_hash is None
    assert stored[1].parent_hash == stored[0].block_hash and removed == []
    # Whole prompt cached: the last token is recomputed, so only 2 blocks count.
    assert cache.lookup_and_insert(a) == (8, 12)
    assert cache.lookup_and_insert([*a, 99]) == (12, 13)
    # Shares the first block only; storing 2 new blocks evicts a's tail first.
    b = [*range(4), 50, 51, 52, 53, 60, 61, 62, 63]
    assert cache.lookup_and_insert(b) == (4, 12)
    stored, removed = events[-1]
    assert len(stored) == 2 and stored[0].parent_hash == events[0][0][0].block_hash
    assert removed == [events[0][0][2].block_hash]
    assert len(cache) == 4
    assert cache.peek(a) == 8
    assert cache.stats.requests == 4
    assert cache.stats.cached_tokens == 8 + 12 + 4
    expected = (12 + 4 + 1 + 8) * 50e-6 + 4 * 1e-3
    assert math.isclose(cache.stats.prefill_seconds_modelled, expected)
    cache.clear()
    assert len(cache) == 0 and sorted(events[-1][1]) == sorted(
        [events[0][0][0].block_hash, events[0][0][1].block_hash, *(s.block_hash for s in stored)]
    )


def test_fleet_option_flags() -> None:
    assert sim_args({"block_size": 8, "latency": True, "trivial": False, "model": ["a", "b"]}) == [
        "--block-size",
        "8",
        "--latency",
        "--model",
        "a",
        "--model",
        "b",
    ]


@module_loop
async def test_latency_flag_sleeps_modelled_prefill_and_events_fire() -> None:
    events: list[tuple[list[StoredBlock], list[int]]] = []
    engine = SimEngine(
        SimConfig(latency=True, prefill_us_per_token=1000, prefill_overhead_us=0),
        on_kv_event=lambda stored, removed: events.append((stored, removed)),
    )
    body = dumps({"messages": [{"role": "user", "content": long_context("latency")}]})
    req = Request("POST", "/v1/chat/completions", "", {}, body)
    t0 = time.perf_counter()
    first = await engine(req)
    cold = time.perf_counter() - t0
    assert isinstance(first, Response)
    total = int(first.headers["x-sim-prompt-tokens"]) if first.headers else 0
    assert cold >= total * 1e-3 * 0.9
    assert sum(len(s) for s, _ in events) == total // 16
    t0 = time.perf_counter()
    second = await engine(req)
    warm = time.perf_counter() - t0
    assert isinstance(second, Response) and second.headers is not None
    cached = int(second.headers["x-sim-cached-tokens"])
    assert cached == (total - 1) // 16 * 16
    assert warm < cold / 4
    assert engine.stats()["prefill_seconds_modelled"] == pytest.approx((2 * total - cached) * 1e-3)


@module_loop
async def test_anthropic_count_tokens(url: str) -> None:
    count = await claude(url).messages.count_tokens(
        model="claude-sim", messages=[{"role": "user", "content": "Hello, world!"}]
    )
    assert count.input_tokens == len(tokenize("<|user|>\nHello, world!\n<|assistant|>\n"))
