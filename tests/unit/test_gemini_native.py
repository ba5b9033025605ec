"""OpenAI chat completions to Gemini's native API and back, and usage accounting."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.gemini.native import (
    NativeStream,
    TranslationError,
    chat_completion,
    openai_error_body,
    to_generate_request,
)
from router.gemini.usage import (
    UsageRecord,
    anthropic_usage,
    fill_cached_tokens,
    openai_usage,
)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look up.",
            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
        },
    }
]


def test_request_translation_golden() -> None:
    body = {
        "model": "gemini-2.5-flash",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "developer", "content": [{"type": "text", "text": "No emoji."}]},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "What is this?"},
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                ],
            },
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "lookup", "arguments": '{"q": "png"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": '{"kind": "image"}'},
            {"role": "tool", "tool_call_id": "call_1", "content": "plain text"},
        ],
        "temperature": 0,
        "top_p": 0.9,
        "max_completion_tokens": 10,
        "stop": "END",
        "seed": 7,
        "response_format": {"type": "json_object"},
        "tools": TOOLS,
        "tool_choice": {"type": "function", "function": {"name": "lookup"}},
    }
    assert to_generate_request(body) == {
        "contents": [
            {
                "role": "user",
                "parts": [
                    {"text": "What is this?"},
                    {"inlineData": {"mimeType": "image/png", "data": "AAAA"}},
                ],
            },
            {
                "role": "model",
                "parts": [{"functionCall": {"name": "lookup", "args": {"q": "png"}}}],
            },
            {
                "role": "user",
                "parts": [
                    {"functionResponse": {"name": "lookup", "response": {"kind": "image"}}},
                    {"functionResponse": {"name": "lookup", "response": {"content": "plain text"}}},
                ],
            },
        ],
        "systemInstruction": {"parts": [{"text": "Be brief."}, {"text": "No emoji."}]},
        "tools": [{"functionDeclarations": [TOOLS[0]["function"]]}],
        "toolConfig": {
            "functionCallingConfig": {"mode": "ANY", "allowedFunctionNames": ["lookup"]}
        },
        "generationConfig": {
            "temperature": 0,
            "topP": 0.9,
            "seed": 7,
            "maxOutputTokens": 10,
            "stopSequences": ["END"],
            "responseMimeType": "application/json",
        },
    }


def test_request_with_cache_reference_drops_system() -> None:
    body = {
        "model": "m",
        "messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "u"}],
    }
    assert to_generate_request(body, cached_content="cachedContents/x") == {
        "contents": [{"role": "user", "parts": [{"text": "u"}]}],
        "cachedContent": "cachedContents/x",
    }


@pytest.mark.parametrize(
    ("messages", "extra", "needle"),
    [
        ([{"role": "system", "content": "s"}], {}, "at least one user turn"),
        ([{"role": "user", "content": 5}], {}, "content must be"),
        ([{"role": "robot", "content": "x"}], {}, "not supported"),
        ([{"role": "tool", "tool_call_id": "c", "content": "x"}], {}, "tool_call_id"),
        (
            [
                {
                    "role": "assistant",
                    "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}],
                }
            ],
            {},
            "not valid JSON",
        ),
        (
            [
                {
                    "role": "assistant",
                    "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}],
                }
            ],
            {},
            "JSON object",
        ),
        ([{"role": "user", "content": [{"type": "audio"}]}], {}, "unsupported type"),
        ([{"role": "user", "content": "x"}], {"tools": "no"}, "'tools' must be"),
        ([{"role": "user", "content": "x"}], {"tool_choice": 3}, "tool_choice"),
    ],
)
def test_request_translation_errors(
    messages: list[dict[str, Any]], extra: dict[str, Any], needle: str
) -> None:
    with pytest.raises(TranslationError, match=needle):
        to_generate_request({"model": "m", "messages": messages, **extra})


def test_response_translation() -> None:
    resp = {
        "candidates": [
            {
                "content": {
                    "role": "model",
                    "parts": [
                        {"text": "thinking...", "thought": True},
                        {"text": "Hello"},
                        {"functionCall": {"name": "lookup", "args": {"q": 1}}},
                    ],
                },
                "finishReason": "STOP",
                "index": 0,
            }
        ],
        "usageMetadata": {
            "promptTokenCount": 100,
            "cachedContentTokenCount": 80,
            "candidatesTokenCount": 5,
            "thoughtsTokenCount": 3,
            "totalTokenCount": 108,
        },
        "responseId": "r1",
    }
    out = chat_completion(resp, "gemini-x")
    assert out["id"] == "chatcmpl-r1" and out["object"] == "chat.completion"
    (choice,) = out["choices"]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Hello"
    call = choice["message"]["tool_calls"][0]
    assert call["function"] == {"name": "lookup", "arguments": '{"q":1}'}
    assert call["id"].startswith("call_")
    assert out["usage"] == {
        "prompt_tokens": 100,
        "completion_tokens": 8,
        "total_tokens": 108,
        "prompt_tokens_details": {"cached_tokens": 80},
        "completion_tokens_details": {"reasoning_tokens": 3},
    }
    blocked = chat_completion({"promptFeedback": {"blockReason": "SAFETY"}}, "m")
    assert blocked["choices"][0]["finish_reason"] == "content_filter"
    maxed = chat_completion({"candidates": [{"finishReason": "MAX_TOKENS"}]}, "m")
    assert maxed["choices"][0]["finish_reason"] == "length"


def test_error_translation() -> None:
    body = b'{"error": {"code": 400, "message": "bad thing", "status": "INVALID_ARGUMENT"}}'
    assert orjson.loads(openai_error_body(400, body)) == {
        "error": {
            "message": "bad thing",
            "type": "invalid_request_error",
            "param": None,
            "code": "invalid_argument",
        }
    }
    garbage = orjson.loads(openai_error_body(503, b"<html>"))
    assert garbage["error"]["type"] == "api_error" and "503" in garbage["error"]["message"]


def _gemini_sse() -> bytes:
    events = [
        {"candidates": [{"content": {"role": "model", "parts": [{"text": "Hel"}]}, "index": 0}]},
        {
            "candidates": [
                {
                    "content": {"role": "model", "parts": [{"text": "lo"}]},
                    "finishReason": "STOP",
                    "index": 0,
                }
            ],
            "usageMetadata": {
                "promptTokenCount": 10,
                "cachedContentTokenCount": 6,
                "candidatesTokenCount": 2,
                "totalTokenCount": 12,
            },
        },
    ]
    return b"".join(b"data: " + orjson.dumps(e) + b"\r\n\r\n" for e in events)


def _decode(out: bytes) -> list[Any]:
    return [
        orjson.loads(block[6:]) if block != b"data: [DONE]" else "[DONE]"
        for block in out.split(b"\n\n")
        if block
    ]


def _strip(events: list[Any]) -> list[Any]:
    return [
        {k: v for k, v in e.items() if k not in ("id", "created")} if isinstance(e, dict) else e
        for e in events
    ]


def test_stream_translation() -> None:
    seen: list[dict[str, Any]] = []
    conv = NativeStream("m", include_usage=True, on_usage=seen.append)
    events = _decode(conv.feed(_gemini_sse()) + conv.finish())
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert {c["id"] for c in chunks} == {conv.id}
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert deltas == [{"role": "assistant", "content": "Hel"}, {"content": "lo"}, {}]
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 6}
    assert seen == [chunks[-1]["usage"]]
    no_usage = NativeStream("m", include_usage=False)
    assert all(
        "usage" not in c for c in _decode(no_usage.feed(_gemini_sse()) + no_usage.finish())[:-1]
    )


@settings(max_examples=50)
@given(st.lists(st.integers(1, 400), max_size=8))
def test_stream_translation_independent_of_chunking(cuts: list[int]) -> None:
    data = _gemini_sse()
    whole = NativeStream("m", include_usage=True)
    expected = _strip(_decode(whole.feed(data) + whole.finish()))
    conv = NativeStream("m", include_usage=True)
    out, pos = b"", 0
    for c in cuts:
        out += conv.feed(data[pos : pos + c])
        pos += c
    out += conv.feed(data[pos:]) + conv.finish()
    assert _strip(_decode(out)) == expected


@given(st.binary(max_size=300))
def test_stream_translation_survives_garbage(data: bytes) -> None:
    conv = NativeStream("m", include_usage=True)
    out = conv.feed(data) + conv.finish()
    assert out.endswith(b"data: [DONE]\n\n")
    for event in _decode(out)[:-1]:
        assert isinstance(event, dict)


def test_stream_error_event_is_relayed() -> None:
    conv = NativeStream("m", include_usage=False)
    out = conv.feed(b'data: {"error": {"code": 500, "message": "boom", "status": "INTERNAL"}}\n\n')
    assert orjson.loads(out[6:])["error"]["message"] == "boom"


# -- usage -------------------------------------------------------------------------------


def test_usage_conventions() -> None:
    u = openai_usage(
        {"promptTokenCount": 1000, "cachedContentTokenCount": 800, "candidatesTokenCount": 10}
    )
    assert u["prompt_tokens"] == 1000 and u["total_tokens"] == 1010
    assert u["prompt_tokens_details"] == {"cached_tokens": 800}
    assert anthropic_usage(1000, 10, 800) == {
        "input_tokens": 200,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 800,
        "output_tokens": 10,
    }
    rec = UsageRecord.from_openai("g", "m", u)
    assert rec.as_dict() == {
        "backend": "g",
        "model": "m",
        "prompt_tokens": 1000,
        "input_tokens": 200,
        "cached_input_tokens": 800,
        "output_tokens": 10,
        "cache_hit": True,
    }
    miss = UsageRecord.from_openai("g", "m", {"prompt_tokens": 5, "completion_tokens": 1})
    assert miss.cache_hit is False and miss.input_tokens == 5


def test_fill_cached_tokens() -> None:
    u: dict[str, Any] = {"prompt_tokens": 100}
    fill_cached_tokens(u, 80)
    assert u["prompt_tokens_details"] == {"cached_tokens": 80}
    reported: dict[str, Any] = {
        "prompt_tokens": 100,
        "prompt_tokens_details": {"cached_tokens": 90},
    }
    fill_cached_tokens(reported, 80)
    assert reported["prompt_tokens_details"]["cached_tokens"] == 90  # the backend's count wins
    capped: dict[str, Any] = {"prompt_tokens": 50, "prompt_tokens_details": None}
    fill_cached_tokens(capped, 80)
    assert capped["prompt_tokens_details"]["cached_tokens"] == 50


@given(
    st.dictionaries(
        st.sampled_from(
            ["promptTokenCount", "cachedContentTokenCount", "candidatesTokenCount", "x"]
        ),
        st.one_of(st.integers(-5, 10_000), st.text(max_size=3), st.none(), st.booleans()),
    )
)
def test_openai_usage_is_total(meta: dict[str, Any]) -> None:
    u = openai_usage(meta)
    assert 0 <= u["prompt_tokens_details"]["cached_tokens"] <= u["prompt_tokens"]
    rec = UsageRecord.from_openai("g", "m", u)
    assert rec.input_tokens + rec.cached_input_tokens == rec.prompt_tokens


_json = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-3, 3), st.text(max_size=5)),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=12,
)
_message_st = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "developer", "user", "assistant", "tool", "x"])},
    optional={
        "content": _json,
        "tool_calls": _json,
        "tool_call_id": st.one_of(st.text(max_size=3), _json),
    },
)


@settings(max_examples=150)
@given(st.lists(_message_st, min_size=1, max_size=5), _json, _json)
def test_translation_rejects_cleanly(messages: list[Any], tools: Any, choice: Any) -> None:
    """Any client input either translates or raises TranslationError (a 400), nothing else."""
    from router.gemini.manager import eligible_prefix

    body = {"model": "m", "messages": messages, "tools": tools, "tool_choice": choice}
    try:
        out = to_generate_request(body)
    except TranslationError:
        pass
    else:
        orjson.dumps(out)
    eligible_prefix(body, "m", 1024)


@settings(max_examples=150)
@given(st.dictionaries(st.sampled_from(["candidates", "usageMetadata", "responseId"]), _json))
def test_response_translation_total(resp: dict[str, Any]) -> None:
    out = chat_completion(resp, "m")
    assert out["choices"] and all(isinstance(c["index"], int) for c in out["choices"])
    orjson.dumps(out)
