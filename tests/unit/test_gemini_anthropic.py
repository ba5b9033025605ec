"""Anthropic Messages to Gemini's native API and back."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bus.prefix_key import compute_prefix_key
from router.gemini.anthropic import (
    AnthropicStream,
    anthropic_error_body,
    message_response,
    to_generate_request,
)
from router.gemini.manager import eligible_anthropic_prefix, eligible_prefix
from router.gemini.native import TranslationError


def test_request_translation_golden() -> None:
    body = {
        "model": "gemini-2.5-flash",
        "system": [{"type": "text", "text": "A"}, {"type": "text", "text": "B"}],
        "max_tokens": 100,
        "temperature": 0.5,
        "top_k": 4,
        "stop_sequences": ["X"],
        "tools": [{"name": "f", "description": "d", "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "tool", "name": "f"},
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "look"},
                    {
                        "type": "image",
                        "source": {"type": "base64", "media_type": "image/png", "data": "AA"},
                    },
                ],
            },
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "hm", "signature": "s"},
                    {"type": "tool_use", "id": "t1", "name": "f", "input": {"a": 1}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "t1",
                        "content": [{"type": "text", "text": "done"}],
                    }
                ],
            },
        ],
    }
    assert to_generate_request(body) == {
        "contents": [
            {
                "role": "user",
                "parts": [
                    {"text": "look"},
                    {"inlineData": {"mimeType": "image/png", "data": "AA"}},
                ],
            },
            {"role": "model", "parts": [{"functionCall": {"name": "f", "args": {"a": 1}}}]},
            {
                "role": "user",
                "parts": [{"functionResponse": {"name": "f", "response": {"content": "done"}}}],
            },
        ],
        "systemInstruction": {"parts": [{"text": "A\nB"}]},
        "tools": [
            {
                "functionDeclarations": [
                    {"name": "f", "description": "d", "parameters": {"type": "object"}}
                ]
            }
        ],
        "toolConfig": {"functionCallingConfig": {"mode": "ANY", "allowedFunctionNames": ["f"]}},
        "generationConfig": {
            "maxOutputTokens": 100,
            "temperature": 0.5,
            "topK": 4,
            "stopSequences": ["X"],
        },
    }
    cached = to_generate_request(body | {"tools": None, "tool_choice": None}, "cachedContents/c")
    assert "systemInstruction" not in cached and cached["cachedContent"] == "cachedContents/c"


@pytest.mark.parametrize(
    "body",
    [
        {"messages": [{"role": "system", "content": "x"}]},
        {"messages": [{"role": "user", "content": 3}]},
        {"messages": [{"role": "user", "content": [{"type": "video"}]}]},
        {"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "x"}]}]},
        {"messages": [{"role": "user", "content": "x"}], "system": 5},
        {"messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "sometimes"}},
        {"messages": [{"role": "user", "content": []}]},
    ],
)
def test_request_translation_errors(body: dict[str, Any]) -> None:
    with pytest.raises(TranslationError):
        to_generate_request(body)


def test_same_digest_as_openai_form() -> None:
    system = "s" * 5000
    a = eligible_anthropic_prefix(
        {"system": system, "messages": [{"role": "user", "content": "q"}]}, "m", 4096
    )
    o = eligible_prefix(
        {
            "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": "q"},
            ]
        },
        "m",
        4096,
    )
    assert a is not None and o is not None and a.digest == o.digest
    assert a.digest == compute_prefix_key("m", "S", system, None)
    assert (
        eligible_anthropic_prefix({"messages": [{"role": "user", "content": "q"}]}, "m", 1) is None
    )
    assert (
        eligible_anthropic_prefix(
            {"system": system, "tools": [{"name": "f"}], "messages": []}, "m", 4096
        )
        is None
    )


def test_response_translation() -> None:
    resp = {
        "candidates": [
            {
                "content": {
                    "parts": [{"text": "a"}, {"text": "b"}, {"functionCall": {"name": "f"}}]
                },
                "finishReason": "STOP",
            }
        ],
        "usageMetadata": {
            "promptTokenCount": 100,
            "cachedContentTokenCount": 90,
            "candidatesTokenCount": 4,
        },
        "responseId": "r",
    }
    msg = message_response(resp, "m")
    assert msg["id"] == "msg_r" and msg["stop_reason"] == "tool_use"
    assert msg["content"][0] == {"type": "text", "text": "ab"}
    assert msg["content"][1]["type"] == "tool_use" and msg["content"][1]["input"] == {}
    assert msg["usage"] == {
        "input_tokens": 10,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 90,
        "output_tokens": 4,
    }
    assert (
        message_response({"candidates": [{"finishReason": "MAX_TOKENS"}]}, "m")["stop_reason"]
        == "max_tokens"
    )
    assert message_response({}, "m")["stop_reason"] == "refusal"
    err = orjson.loads(anthropic_error_body(404, b'{"error": {"message": "gone"}}'))
    assert err == {"type": "error", "error": {"type": "not_found_error", "message": "gone"}}


def _sse(events: list[dict[str, Any]]) -> bytes:
    return b"".join(b"data: " + orjson.dumps(e) + b"\r\n\r\n" for e in events)


def _events(out: bytes) -> list[tuple[str, dict[str, Any]]]:
    got = []
    for block in out.split(b"\n\n"):
        if not block:
            continue
        name, data = block.split(b"\n", 1)
        got.append((name.removeprefix(b"event: ").decode(), orjson.loads(data[6:])))
    return got


STREAM = _sse(
    [
        {"candidates": [{"content": {"parts": [{"text": "Hi "}]}}]},
        {"candidates": [{"content": {"parts": [{"text": "there"}]}}]},
        {
            "candidates": [
                {
                    "content": {"parts": [{"functionCall": {"name": "f", "args": {"x": 1}}}]},
                    "finishReason": "STOP",
                }
            ],
            "usageMetadata": {
                "promptTokenCount": 50,
                "cachedContentTokenCount": 40,
                "candidatesTokenCount": 7,
            },
        },
    ]
)


def test_stream_event_sequence() -> None:
    seen: list[dict[str, Any]] = []
    conv = AnthropicStream("m", seen.append)
    events = _events(conv.feed(STREAM) + conv.finish())
    assert [n for n, _ in events] == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert all(d["type"] == n for n, d in events)
    assert events[5][1]["content_block"]["name"] == "f"
    assert events[6][1]["delta"] == {"type": "input_json_delta", "partial_json": '{"x":1}'}
    delta = events[8][1]
    assert delta["delta"]["stop_reason"] == "tool_use"
    assert delta["usage"]["input_tokens"] == 10 and delta["usage"]["cache_read_input_tokens"] == 40
    assert seen[0]["prompt_tokens_details"] == {"cached_tokens": 40}


@settings(max_examples=50)
@given(st.lists(st.integers(1, 200), max_size=6))
def test_stream_independent_of_chunking(cuts: list[int]) -> None:
    def strip(events: list[tuple[str, dict[str, Any]]]) -> list[Any]:
        out = []
        for n, d in events:
            d = dict(d)
            if n == "message_start":
                d["message"] = {k: v for k, v in d["message"].items() if k != "id"}
            if n == "content_block_start":
                d["content_block"] = {k: v for k, v in d["content_block"].items() if k != "id"}
            out.append((n, d))
        return out

    whole = AnthropicStream("m")
    expected = strip(_events(whole.feed(STREAM) + whole.finish()))
    conv = AnthropicStream("m")
    out, pos = b"", 0
    for c in cuts:
        out += conv.feed(STREAM[pos : pos + c])
        pos += c
    out += conv.feed(STREAM[pos:]) + conv.finish()
    assert strip(_events(out)) == expected


@given(st.binary(max_size=300))
def test_stream_survives_garbage(data: bytes) -> None:
    conv = AnthropicStream("m")
    events = _events(conv.feed(data) + conv.finish())
    assert events[-1][0] == "message_stop" and events[0][0] in ("message_start", "error")
