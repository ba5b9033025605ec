"""The official ``openai`` SDK against a running router in front of three simulated engines.

What a user relies on: every SDK call works unmodified through the router, answers say
which backend served them, and PrefixAwareHash keeps a system prompt on one backend
(so its KV cache is reused) while spreading different prompts over the fleet.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest_asyncio

from harness.sim.fleet import SimFleet

from .conftest import (
    SIM_MODELS,
    RouterLauncher,
    RouterProc,
    StartRouter,
    backend,
    http,
    metric_samples,
    metric_value,
    served_by,
)


def discovery_config(sims: SimFleet, strategy: str = "PrefixAwareHash") -> dict[str, Any]:
    """Backends with ``models: []``: the router discovers them from each sim's /v1/models."""
    return {
        "selection_strategy": strategy,
        "prefix_routing": {"enabled": True},
        "backends": [backend(s.name, s.url, models=[]) for s in sims],
    }


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def router(sims: SimFleet, module_router_launcher: RouterLauncher) -> RouterProc:
    return await module_router_launcher.start(discovery_config(sims))


def client(router: RouterProc) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0)


@pytest_asyncio.fixture(loop_scope="session")
async def oai(router: RouterProc) -> AsyncIterator[openai.AsyncOpenAI]:
    async with client(router) as c:
        yield c


async def test_chat_completion_non_streaming(oai: openai.AsyncOpenAI) -> None:
    resp = await oai.chat.completions.create(
        model="demo-model",
        messages=[
            {"role": "system", "content": "You are a terse assistant."},
            {"role": "user", "content": "What is the capital of France?"},
        ],
        max_tokens=12,
    )
    assert resp.object == "chat.completion"
    assert resp.model == "demo-model"
    choice = resp.choices[0]
    assert choice.message.role == "assistant"
    assert choice.finish_reason == "stop"
    content = choice.message.content
    name = served_by(content)
    assert name in SIM_MODELS
    assert content == f"[{name}] echo: What is the capital of France? lorem ipsum dolor sit"
    assert resp.usage is not None and resp.usage.completion_tokens == 12
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + 12


async def test_streaming_assembles_to_the_non_streaming_answer(oai: openai.AsyncOpenAI) -> None:
    # Same system prompt -> same backend under PrefixAwareHash, so the answers are equal.
    messages: Any = [
        {"role": "system", "content": "stream-test system prompt"},
        {"role": "user", "content": "Tell me a long story about routers"},
    ]
    plain = await oai.chat.completions.create(model="demo-model", messages=messages, max_tokens=20)
    stream = await oai.chat.completions.create(
        model="demo-model",
        messages=messages,
        max_tokens=20,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [c async for c in stream]
    assert len(chunks) > 20, "one chunk per word: the stream must not be buffered into one"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "stop"
    assert all(f is None for f in finishes[:-1])
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 20


async def test_raw_response_names_the_backend(oai: openai.AsyncOpenAI) -> None:
    raw = await oai.chat.completions.with_raw_response.create(
        model="demo-model", messages=[{"role": "user", "content": "who answers?"}]
    )
    resp = raw.parse()
    name = raw.headers["x-continuum-backend"]
    assert name in SIM_MODELS
    assert served_by(resp.choices[0].message.content) == name

    raw_stream = await oai.chat.completions.with_raw_response.create(
        model="demo-model", messages=[{"role": "user", "content": "who streams?"}], stream=True
    )
    stream_name = raw_stream.headers["x-continuum-backend"]
    assert raw_stream.headers["content-type"].startswith("text/event-stream")
    text = "".join([c.choices[0].delta.content or "" async for c in raw_stream.parse()])
    assert served_by(text) == stream_name


async def test_embeddings(oai: openai.AsyncOpenAI, sims: SimFleet) -> None:
    raw = await oai.embeddings.with_raw_response.create(
        model="demo-model", input=["first text", "second text"], dimensions=16
    )
    resp = raw.parse()
    name = raw.headers["x-continuum-backend"]
    assert name in SIM_MODELS
    assert [d.index for d in resp.data] == [0, 1]
    assert all(len(d.embedding) == 16 for d in resp.data)
    assert resp.data[0].embedding != resp.data[1].embedding
    assert resp.usage.prompt_tokens > 0
    # The body reached the engine unchanged: the sim's own answer is identical.
    sim = next(s for s in sims if s.name == name)
    async with openai.AsyncOpenAI(base_url=sim.url + "/v1", api_key="x", max_retries=0) as d:
        direct = await d.embeddings.create(
            model="demo-model", input=["first text", "second text"], dimensions=16
        )
    assert [d.embedding for d in resp.data] == [d.embedding for d in direct.data]


async def test_models_list_is_the_union_of_the_backends(oai: openai.AsyncOpenAI) -> None:
    page = await oai.models.list()
    ids = [m.id for m in page.data]
    expected = {m for models in SIM_MODELS.values() for m in models}
    assert sorted(ids) == sorted(expected), "each model once, from every backend"
    assert all(m.object == "model" for m in page.data)
    # A model only one backend serves is routed to that backend.
    for model, owner in (("alpha", "sim-1"), ("beta", "sim-2")):
        raw = await oai.chat.completions.with_raw_response.create(
            model=model, messages=[{"role": "user", "content": f"{model} please"}]
        )
        assert raw.headers["x-continuum-backend"] == owner


async def _send(oai: openai.AsyncOpenAI, system: str, user: str) -> str:
    raw = await oai.chat.completions.with_raw_response.create(
        model="demo-model",
        messages=[{"role": "system", "content": system}, {"role": "user", "content": user}],
        max_tokens=4,
    )
    return raw.headers["x-continuum-backend"]


async def test_prefix_aware_hash_keeps_a_system_prompt_on_one_backend(
    oai: openai.AsyncOpenAI,
) -> None:
    for tenant in range(3):
        system = f"You are the support agent of tenant {tenant}. Policy text follows."
        landed = {await _send(oai, system, f"question {i}") for i in range(6)}
        assert len(landed) == 1, f"tenant {tenant} spread over {landed}"

    spread = {await _send(oai, f"system prompt number {i}", "hi") for i in range(20)}
    assert len(spread) >= 2, f"20 different system prompts all went to {spread}"


_STATS_KEYS = {
    "enabled",
    "config",
    "routing_decisions",
    "backend_distribution",
    "unique_prefixes",
}
_CONFIG_KEYS = {
    "max_prefix_length",
    "load_factor_epsilon",
    "virtual_nodes",
    "anthropic_cache_control_injection",
}
_DECISION_KEYS = {"total", "prefix_hash", "overflow", "fallback", "overflow_rate"}


async def test_prefix_stats_and_metrics_add_up(start_router: StartRouter, sims: SimFleet) -> None:
    cfg = discovery_config(sims)
    cfg["prefix_routing"] = {"enabled": True, "virtual_nodes": 64, "max_prefix_length": 512}
    router = await start_router(cfg)

    empty = await router.stats()
    assert empty["routing_decisions"] == {
        "total": 0,
        "prefix_hash": 0,
        "overflow": 0,
        "fallback": 0,
        "overflow_rate": "0.0000",
    }
    assert empty["unique_prefixes"] == 0

    landed: Counter[str] = Counter()
    async with client(router) as oai:
        for p in range(5):
            for i in range(3):
                landed[await _send(oai, f"stats prompt {p}", f"turn {i}")] += 1
    sent = sum(landed.values())
    assert sent == 15

    stats = await router.stats()
    assert set(stats) == _STATS_KEYS
    assert stats["enabled"] is True
    assert stats["config"] == {
        "max_prefix_length": 512,
        "load_factor_epsilon": 0.25,
        "virtual_nodes": 64,
        "anthropic_cache_control_injection": False,
    }
    assert set(stats["config"]) == _CONFIG_KEYS
    decisions = stats["routing_decisions"]
    assert set(decisions) == _DECISION_KEYS
    assert isinstance(decisions["overflow_rate"], str)
    # Sequential requests never exceed the load bound: every decision is the ring owner.
    assert decisions == {
        "total": sent,
        "prefix_hash": sent,
        "overflow": 0,
        "fallback": 0,
        "overflow_rate": "0.0000",
    }
    assert (
        decisions["total"]
        == decisions["prefix_hash"] + decisions["overflow"] + (decisions["fallback"])
    )
    assert stats["unique_prefixes"] == 5
    dist = stats["backend_distribution"]
    assert all(set(d) == {"backend", "in_flight_requests"} for d in dist)
    assert [d["backend"] for d in dist] == [s.name for s in sims]
    assert all(d["in_flight_requests"] == 0 for d in dist)

    text = await router.metrics()
    assert f'continuum_prefix_routing_requests_total{{strategy="prefix_hash"}} {sent}.0' in text
    assert metric_value(text, "continuum_prefix_routing_requests_total", strategy="overflow") == 0
    for name in SIM_MODELS:
        got = metric_value(text, "continuum_requests_total", backend=name, endpoint="chat")
        assert got == landed[name], (name, got, landed)
    assert sum(v for _, v in metric_samples(text, "continuum_requests_total")) == sent


async def test_round_robin_never_counts_prefix_decisions(
    start_router: StartRouter, sims: SimFleet
) -> None:
    router = await start_router(discovery_config(sims, strategy="RoundRobin"))
    landed: Counter[str] = Counter()
    async with client(router) as oai:
        for i in range(9):
            landed[await _send(oai, "one shared system prompt", f"q{i}")] += 1
    assert landed == {"sim-1": 3, "sim-2": 3, "sim-3": 3}, "RoundRobin ignores the prefix"

    text = await router.metrics()
    assert 'continuum_prefix_routing_requests_total{strategy="prefix_hash"} 0.0' in text
    assert sum(v for _, v in metric_samples(text, "continuum_prefix_routing_requests_total")) == 0
    assert (await router.stats())["routing_decisions"]["total"] == 0
    for name in SIM_MODELS:
        assert metric_value(text, "continuum_requests_total", backend=name, status="200") == 3


async def test_router_health_endpoint(router: RouterProc) -> None:
    r = await http("GET", router.url + "/health")
    assert r.status == 200
    assert r.json() == {"status": "ok", "backends": {"healthy": 3, "total": 3}}
