"""Tier 2/3 through real router processes: X-Cache, hits that never reach a backend,
streams cached and replayed to the official SDK, tenant isolation, Redis shared by two
routers."""

from __future__ import annotations

import uuid
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from tests.redis_fixture import redis_url  # noqa: F401 - fixture

from .conftest import backend, sim_json


def cache_config(sims: Any, **rc: Any) -> dict[str, Any]:
    return {
        "backends": [backend("sim-1", sims.urls[0])],
        "response_cache": {"enabled": True, **rc},
    }


def chat(content: str, **extra: Any) -> dict[str, Any]:
    return {"model": "demo-model", "messages": [{"role": "user", "content": content}], **extra}


async def sim_requests(sims: Any) -> int:
    return (await sim_json(sims.urls[0], "/sim/stats"))["requests"]


async def test_miss_then_hit_never_reaches_the_backend(start_router, sims) -> None:
    router = await start_router(cache_config(sims))
    client = openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="tenant-a")
    q = f"cache me {uuid.uuid4()}"
    first = await client.chat.completions.with_raw_response.create(
        model="demo-model", messages=[{"role": "user", "content": q}], temperature=0
    )
    assert first.headers["x-cache"] == "MISS"
    before = await sim_requests(sims)
    second = await client.chat.completions.with_raw_response.create(
        model="demo-model", messages=[{"role": "user", "content": q}], temperature=0
    )
    assert second.headers["x-cache"] == "HIT"
    assert second.parse().choices[0].message.content == first.parse().choices[0].message.content
    assert await sim_requests(sims) == before  # the hit never reached a backend
    stats = await router.stats_of("/admin/response-cache/stats")
    assert stats["requests"]["hit"] >= 1 and stats["requests"]["miss"] >= 1
    metrics = await router.metrics()
    assert 'continuum_response_cache_requests_total{result="hit"}' in metrics


async def test_bypass_for_non_deterministic_or_unkeyed_requests(start_router, sims) -> None:
    router = await start_router(cache_config(sims))
    client = openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="k")
    for extra in ({"temperature": 0.7}, {"seed": 3}, {"stop": ["x"]}):
        r = await client.chat.completions.with_raw_response.create(
            model="demo-model", messages=[{"role": "user", "content": "hi"}], **extra
        )
        assert r.headers["x-cache"] == "BYPASS", extra


async def test_tenants_never_share_entries(start_router, sims) -> None:
    router = await start_router(cache_config(sims))
    q = f"tenant question {uuid.uuid4()}"
    a = openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="tenant-a")
    b = openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="tenant-b")
    msgs: list[ChatCompletionMessageParam] = [{"role": "user", "content": q}]
    await a.chat.completions.create(model="demo-model", messages=msgs)
    rb = await b.chat.completions.with_raw_response.create(model="demo-model", messages=msgs)
    assert rb.headers["x-cache"] == "MISS"
    ra = await a.chat.completions.with_raw_response.create(model="demo-model", messages=msgs)
    assert ra.headers["x-cache"] == "HIT"


async def test_stream_is_cached_and_replayed_to_the_sdk(start_router, sims) -> None:
    router = await start_router(cache_config(sims))
    client = openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="s")
    msgs: list[ChatCompletionMessageParam] = [
        {"role": "user", "content": f"stream me {uuid.uuid4()}"}
    ]

    async def collect() -> tuple[str, str]:
        raw = await client.chat.completions.with_raw_response.create(
            model="demo-model", messages=msgs, stream=True
        )
        text = ""
        stream = raw.parse()
        assert isinstance(stream, openai.AsyncStream)  # with_raw_response loses the stream overload
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                text += chunk.choices[0].delta.content
        return raw.headers["x-cache"], text

    first_state, first_text = await collect()
    assert first_state == "MISS" and first_text
    before = await sim_requests(sims)

    async def cached() -> tuple[str, str]:
        return await collect()

    state, text = await cached()
    if state != "HIT":  # the write-back is asynchronous: one more try
        state, text = await cached()
    assert state == "HIT" and text == first_text
    assert await sim_requests(sims) == before
    # a non-streaming request with the same messages is not answered with SSE bytes
    r = await client.chat.completions.with_raw_response.create(model="demo-model", messages=msgs)
    assert r.headers["x-cache"] == "MISS"


async def test_a_stream_cut_in_the_middle_is_never_stored(start_router, sims) -> None:
    """The engine drops the connection after two content chunks: the client sees the
    stream fail, nothing is stored, and the same request later is a MISS that reaches the
    engine and completes (then, once stored, a HIT)."""
    router = await start_router(cache_config(sims))
    client = openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="c", max_retries=0)
    msgs: list[ChatCompletionMessageParam] = [
        {"role": "user", "content": f"cut me {uuid.uuid4()} " + "word " * 40}
    ]

    async def collect(**headers: str) -> tuple[str, str]:
        raw = await client.chat.completions.with_raw_response.create(
            model="demo-model", messages=msgs, stream=True, max_tokens=64, extra_headers=headers
        )
        text = ""
        stream = raw.parse()
        assert isinstance(stream, openai.AsyncStream)  # with_raw_response loses the stream overload
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                text += chunk.choices[0].delta.content
        return raw.headers["x-cache"], text

    with pytest.raises(Exception):  # noqa: B017 - the SDK surfaces the cut as an error
        await collect(**{"x-sim-stream-abort-after": "2"})
    before = await sim_requests(sims)
    state, text = await collect()
    assert state == "MISS" and text  # not answered from a partial stream
    assert await sim_requests(sims) == before + 1
    for _ in range(2):  # the write-back is asynchronous: at most one more try
        state, again = await collect()
        if state == "HIT":
            break
    assert state == "HIT" and again == text


async def test_a_stream_over_the_buffer_limit_is_passed_through_not_stored(
    start_router, sims
) -> None:
    router = await start_router(cache_config(sims, max_stream_buffer_size=64))
    client = openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="b")
    msgs: list[ChatCompletionMessageParam] = [
        {"role": "user", "content": f"long stream {uuid.uuid4()}"}
    ]
    for _ in range(2):
        raw = await client.chat.completions.with_raw_response.create(
            model="demo-model", messages=msgs, stream=True
        )
        stream = raw.parse()
        assert isinstance(stream, openai.AsyncStream)  # with_raw_response loses the stream overload
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        assert raw.headers["x-cache"] == "MISS" and text  # complete, never cached


async def test_oversized_response_is_not_stored(start_router, sims) -> None:
    router = await start_router(cache_config(sims, max_response_size=10))
    client = openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="o")
    msgs: list[ChatCompletionMessageParam] = [{"role": "user", "content": f"big {uuid.uuid4()}"}]
    for _ in range(2):
        r = await client.chat.completions.with_raw_response.create(
            model="demo-model", messages=msgs
        )
        assert r.headers["x-cache"] == "MISS"


async def test_invalidate(start_router, sims) -> None:
    router = await start_router(cache_config(sims))
    client = openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="i")
    msgs: list[ChatCompletionMessageParam] = [{"role": "user", "content": f"inv {uuid.uuid4()}"}]
    await client.chat.completions.create(model="demo-model", messages=msgs)
    res = await router.post_json("/admin/response-cache/invalidate", {"clear_all": True})
    assert res["success"] is True and res["action"] == "clear_all"
    r = await client.chat.completions.with_raw_response.create(model="demo-model", messages=msgs)
    assert r.headers["x-cache"] == "MISS"
    bad = await router.post_raw("/admin/response-cache/invalidate", {"nonsense": 1})
    assert bad.status == 400


@pytest.mark.redis
async def test_two_routers_share_hits_through_redis(start_router, sims, redis_url) -> None:  # noqa: F811
    prefix = f"cr:test:{uuid.uuid4().hex[:8]}:"
    rc = {"backend": "redis", "redis": {"url": redis_url, "key_prefix": prefix}}
    a = await start_router(cache_config(sims, **rc))
    b = await start_router(cache_config(sims, **rc))
    msgs: list[ChatCompletionMessageParam] = [{"role": "user", "content": f"shared {uuid.uuid4()}"}]
    ca = openai.AsyncOpenAI(base_url=a.url + "/v1", api_key="t")
    cb = openai.AsyncOpenAI(base_url=b.url + "/v1", api_key="t")
    first = await ca.chat.completions.with_raw_response.create(model="demo-model", messages=msgs)
    assert first.headers["x-cache"] == "MISS"
    state = ""
    for _ in range(20):  # the write-back is asynchronous
        r = await cb.chat.completions.with_raw_response.create(model="demo-model", messages=msgs)
        state = r.headers["x-cache"]
        if state == "HIT":
            break
    assert state == "HIT"
    await b.post_json("/admin/response-cache/invalidate", {"clear_all": True})


@pytest.mark.redis
async def test_redis_killed_mid_traffic_never_fails_a_request(start_router, sims, tmp_path) -> None:
    """Kill Redis under traffic: every request still succeeds, fallback metric goes to 1,
    and after Redis returns the router switches back within the monitor interval."""
    from tests.redis_fixture import RedisServer, _executable

    exe = _executable()
    if exe is None:
        pytest.skip("redis-server not on PATH")
    server = RedisServer(exe)
    server.start()
    try:
        rc = {
            "backend": "redis",
            "redis": {
                "url": server.url,
                "health_check_interval_ms": 200,
                "command_timeout_ms": 300,
                "connect_timeout_ms": 300,
            },
        }
        router = await start_router(cache_config(sims, **rc))
        client = openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="k", max_retries=0)

        async def fallback_gauge() -> float:
            for line in (await router.metrics()).splitlines():
                if line.startswith("continuum_cache_fallback_active "):
                    return float(line.split()[1])
            return 0.0

        async def burst(tag: str) -> None:
            for i in range(10):
                r = await client.chat.completions.with_raw_response.create(
                    model="demo-model", messages=[{"role": "user", "content": f"{tag} {i % 3}"}]
                )
                assert r.http_response.status_code == 200

        def series(metrics: str, name: str) -> dict[str, float]:
            return {
                line.split(" ")[0]: float(line.split(" ")[1])
                for line in metrics.splitlines()
                if line.startswith(name + "{")
            }

        await burst("before")
        latency = series(await router.metrics(), "continuum_cache_redis_latency_seconds_count")
        assert latency.get('continuum_cache_redis_latency_seconds_count{operation="get"}', 0) > 0
        assert latency.get('continuum_cache_redis_latency_seconds_count{operation="set"}', 0) > 0
        server.kill()
        await burst("during")  # no request fails while Redis is gone
        assert await fallback_gauge() == 1.0
        errors = series(await router.metrics(), "continuum_cache_redis_errors_total")
        assert errors and sum(errors.values()) >= 1, errors
        server.start()
        for _ in range(100):
            await burst("after")
            if await fallback_gauge() == 0.0:
                break
        assert await fallback_gauge() == 0.0
    finally:
        server.close()
