"""The per-request hooks of gemini chat completions, without a network."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from router.config import BackendConfig, GeminiContextCacheConfig, RouterConfig
from router.dialects import ChatCompletions
from router.dialects.base import openai_errors
from router.forward_spec import ForwardSpec
from router.gemini.chat import GeminiService
from router.gemini.entries import CacheEntry
from router.gemini.usage import UsageRecord
from router.pool import Backend
from router.selection import SelectionContext

MODEL = "gemini-2.5-flash"
GEM = Backend(BackendConfig(name="g", url="http://g", type="gemini", models=[MODEL]), 0)
VLLM = Backend(BackendConfig(name="v", url="http://v", type="vllm", models=[MODEL]), 1)
BASE = ChatCompletions(
    config=RouterConfig,
    pool=None,  # type: ignore[arg-type]
    forwarder=None,  # type: ignore[arg-type]
    observe=lambda *a: None,
)
"""The chat dialect, the adapter's base on the OpenAI-compatible path (only path/headers)."""


def service(records: list[UsageRecord], **cfg: Any) -> GeminiService:
    config = GeminiContextCacheConfig(enabled=True, min_prefix_bytes=1024, **cfg)
    return GeminiService(config, None, records.append)  # type: ignore[arg-type]


def body(**extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": "s" * 2000},
            {"role": "user", "content": "hi"},
        ],
        **extra,
    }


async def _chunks(parts: list[bytes]) -> AsyncIterator[bytes]:
    for p in parts:
        yield p


async def _collect(it: AsyncIterator[bytes]) -> bytes:
    return b"".join([c async for c in it])


def spec_of(parsed: dict[str, Any], raw: bytes = b"raw", gemini: Any = None) -> ForwardSpec:
    return ForwardSpec(
        endpoint="chat",
        body=raw,
        parsed=parsed,
        stream=False,
        ctx=SelectionContext(MODEL),
        forwarded={},
        format=BASE,
        error=openai_errors,
        gemini=gemini,
    )


def test_other_backends_keep_the_dialect_format() -> None:
    """The forwarder uses the adapter for gemini backends only; others pass through."""
    for native in (False, True):
        chat = service([], prefer_native_api=native).chat(body(), MODEL, False, BASE)
        spec = spec_of(body(), gemini=chat)
        assert spec.format_for(GEM) is chat
        fmt = spec.format_for(VLLM)
        assert fmt is BASE
        assert fmt.path(VLLM) == "/v1/chat/completions"
        assert fmt.headers(VLLM, {"x-trace": "1"})["x-trace"] == "1"
        assert fmt.body(VLLM, spec) == b"raw"
        assert fmt.transform(VLLM, 200, b"{not json") == b"{not json"
        assert not fmt.retry(VLLM, 404, b"")
        it = _chunks([b"x"])
        assert fmt.stream(VLLM, it) is it


def test_gemini_paths_and_headers() -> None:
    compat = service([]).chat(body(), MODEL, True, BASE)
    assert compat.path(GEM) == "/v1beta/openai/chat/completions"
    native = service([], prefer_native_api=True).chat(body(), "models/" + MODEL, True, BASE)
    assert native.path(GEM) == (f"/v1beta/models/{MODEL}:streamGenerateContent?alt=sse")
    h = native.headers(GEM, {"authorization": "Bearer k", "x-trace": "1"})
    assert "authorization" not in h and h["x-trace"] == "1"


def _hit(chat: Any) -> CacheEntry:
    entry = CacheEntry("g", b"d" * 32, "cachedContents/abc", 1e12, 600.0, 500)
    chat._used["g"] = entry
    return entry


def test_compat_body_fills_cached_tokens_and_records_usage() -> None:
    records: list[UsageRecord] = []
    chat = service(records).chat(body(), MODEL, False, BASE)
    _hit(chat)
    answer = {"choices": [], "usage": {"prompt_tokens": 510, "completion_tokens": 3}}
    out = orjson.loads(chat.transform(GEM, 200, orjson.dumps(answer)))
    assert out["usage"]["prompt_tokens_details"] == {"cached_tokens": 500}
    assert records[0].input_tokens == 10 and records[0].cached_input_tokens == 500
    assert records[0].cache_hit
    # Errors and garbage are left for the proxy to judge.
    assert chat.transform(GEM, 200, b"<html>") == b"<html>"
    assert chat.transform(GEM, 500, b'{"error": {}}') == b'{"error": {}}'


def _compat_stream_bytes() -> bytes:
    events = [
        {"id": "c", "choices": [{"index": 0, "delta": {"content": "a"}}]},
        {"id": "c", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
        {"id": "c", "choices": [], "usage": {"prompt_tokens": 520, "completion_tokens": 1}},
    ]
    return b"".join(b"data: " + orjson.dumps(e) + b"\n\n" for e in events) + b"data: [DONE]\n\n"


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 120), max_size=6))
async def test_compat_stream_patch_independent_of_chunking(cuts: list[int]) -> None:
    data = _compat_stream_bytes()
    parts, pos = [], 0
    for c in cuts:
        parts.append(data[pos : pos + c])
        pos += c
    parts.append(data[pos:])
    records: list[UsageRecord] = []
    chat = service(records).chat(body(stream=True), MODEL, True, BASE)
    _hit(chat)
    out = await _collect(chat.stream(GEM, _chunks([p for p in parts if p])))
    blocks = [b for b in out.split(b"\n\n") if b]
    assert blocks[-1] == b"data: [DONE]"
    usage = orjson.loads(blocks[-2][6:])["usage"]
    assert usage["prompt_tokens_details"] == {"cached_tokens": 500}
    assert blocks[:2] == data.split(b"\n\n")[:2]  # other events byte for byte
    assert len(records) == 1 and records[0].cached_input_tokens == 500


async def test_compat_stream_without_boundaries_is_bounded() -> None:
    chat = service([]).chat(body(stream=True), MODEL, True, BASE)
    blob = b"x" * ((1 << 20) + 10)
    out = [c async for c in chat.stream(GEM, _chunks([blob, b"tail"]))]
    assert out[0] == blob and b"".join(out) == blob + b"tail"


def test_cache_reference_rewrite() -> None:
    chat = service([]).chat(body(extra_body={"google": {"x": 1}}), MODEL, False, BASE)
    # No entry yet: the original bytes (the create runs in the background, not here).
    chat._entry_for = lambda b: _hit(chat)  # type: ignore[method-assign]
    out = orjson.loads(chat.body(GEM, spec_of(body(extra_body={"google": {"x": 1}}))))
    assert out["messages"] == [{"role": "user", "content": "hi"}]
    assert out["extra_body"] == {"google": {"x": 1, "cached_content": "cachedContents/abc"}}
    native = service([], prefer_native_api=True).chat(body(), MODEL, False, BASE)
    native._entry_for = lambda b: _hit(native)  # type: ignore[method-assign]
    doc = orjson.loads(native.body(GEM, spec_of(body())))
    assert doc["cachedContent"] == "cachedContents/abc" and "systemInstruction" not in doc


def test_stale_reference_retries_once() -> None:
    chat = service([]).chat(body(), MODEL, False, BASE)
    assert chat.service.cache is not None
    _hit(chat)
    assert not chat.retry(GEM, 400, b'{"error": {"message": "bad"}}')  # not about the cache
    _hit(chat)
    assert chat.retry(GEM, 404, b"{}")
    _hit(chat)
    assert not chat.retry(GEM, 404, b"{}")  # only once
