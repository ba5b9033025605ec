"""``/v1/completions`` and ``/v1/responses`` in the router: what each request is keyed by.

A user relies on: malformed bodies answered 400 with an OpenAI error naming the field;
the prefix anchor (a completion's leading text under its own tag; Responses
``instructions``, else the first input message); the response cache keying each API
apart; Responses continuations pinned to the backend that stored the response; the
engine's cached tokens read from either usage shape. Parsers get property tests.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bus.prefix_key import compute_prefix_key, extract_prefix_key
from bus.prompt_chain import chain_keys, chain_root
from router.app import Router
from router.cache.response import cache_key
from router.config.loader import parse_config
from router.conversation import ConversationKeys
from router.dialects.completions import prompt_of
from router.dialects.responses_input import InputError, chat_body, check_request
from router.forwarder import _usage_of, openai_usage
from router.http.types import Request, Response

from .conversation_support import qwen_template


@pytest.fixture
def router() -> Router:
    cfg, issues = parse_config(
        {
            "backends": [
                {"name": "a", "url": "http://127.0.0.1:9", "type": "vllm", "models": ["m"]},
                {"name": "b", "url": "http://127.0.0.1:9", "type": "vllm", "models": ["m"]},
            ],
            "prefix_routing": {"enabled": True},
            "response_cache": {"enabled": True},
        }
    )
    assert not [i for i in issues if i.severity == "error"], issues
    return Router(cfg)


async def post(router: Router, path: str, body: Any) -> Response:
    raw = body if isinstance(body, bytes) else orjson.dumps(body)
    resp = await router.handle(Request("POST", path, "", {}, raw))
    assert isinstance(resp, Response)
    return resp


def error_of(resp: Response, status: int = 400) -> dict[str, Any]:
    assert resp.status == status, resp
    err = orjson.loads(resp.body)["error"]
    assert err["type"] == "invalid_request_error"
    return dict(err)


# -- /v1/completions: validation -----------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "x"}, "model"),
        ({"model": 3, "prompt": "x"}, "model"),
        ({"model": "m"}, "prompt"),
        ({"model": "m", "prompt": None}, "prompt"),
        ({"model": "m", "prompt": []}, "prompt"),
        ({"model": "m", "prompt": ["a", 1]}, "prompt"),
        ({"model": "m", "prompt": [[1], "a"]}, "prompt"),
        ({"model": "m", "prompt": [-1]}, "prompt"),
        ({"model": "m", "prompt": [True]}, "prompt"),
        ({"model": "m", "prompt": [[]]}, "prompt"),
        ({"model": "m", "prompt": {"text": "x"}}, "prompt"),
        ({"model": "m", "prompt": "x", "stream": "yes"}, "stream"),
        ({"model": "m", "prompt": "x", "cache_salt": ""}, "cache_salt"),
    ],
)
async def test_completions_malformed_body_names_the_field(
    router: Router, body: dict[str, Any], param: str
) -> None:
    err = error_of(await post(router, "/v1/completions", body))
    assert err["param"] == param
    assert param in err["message"]


@pytest.mark.parametrize("raw", [b"{", b"[1, 2]", b'"prompt"'])
async def test_completions_body_not_an_object(router: Router, raw: bytes) -> None:
    assert error_of(await post(router, "/v1/completions", raw))["code"] == "invalid_json"


async def test_unknown_model_is_404_in_both_apis(router: Router) -> None:
    for path, body in (
        ("/v1/completions", {"model": "nope", "prompt": "hi"}),
        ("/v1/responses", {"model": "nope", "input": "hi"}),
    ):
        resp = await post(router, path, body)
        assert resp.status == 404
        assert orjson.loads(resp.body)["error"]["code"] == "model_not_found"
        assert ("x-cache", "MISS") in resp.headers  # deterministic: the cache was asked


# -- /v1/completions: what a request is keyed by --------------------------------------------


def test_completion_anchor_is_the_first_prompt_under_its_own_tag(router: Router) -> None:
    dialect = router._completions
    one = dialect.prepare({"model": "m", "prompt": "Once upon a time"})
    batch = dialect.prepare({"model": "m", "prompt": ["Once upon a time", "other"]})
    assert not isinstance(one, Response) and not isinstance(batch, Response)
    assert one.anchor == batch.anchor == ("P", "Once upon a time")
    chat = {"model": "m", "messages": [{"role": "user", "content": "Once upon a time"}]}
    # the engine renders a chat turn with its template, so the blocks differ: so do keys
    assert compute_prefix_key("m", "P", "Once upon a time", 1024) != extract_prefix_key(chat)


@pytest.mark.parametrize("prompt", [[1, 2, 3], [[1, 2], [3]]])
def test_token_id_prompts_have_no_anchor_and_bypass_the_cache(router: Router, prompt: Any) -> None:
    prepared = router._completions.prepare({"model": "m", "prompt": prompt})
    assert not isinstance(prepared, Response)
    assert prepared.anchor is None and prepared.chain is None and prepared.cache_view is None


@pytest.mark.parametrize(
    "extra",
    [{"temperature": 0.7}, {"seed": 1}, {"echo": True}, {"best_of": 2}, {"suffix": "x"}, {"n": 2}],
)
def test_completions_cache_bypass_for_unkeyed_fields(router: Router, extra: Any) -> None:
    prepared = router._completions.prepare({"model": "m", "prompt": "p", **extra})
    assert not isinstance(prepared, Response) and prepared.cache_view is None


def test_the_three_apis_never_share_a_cache_entry(router: Router) -> None:
    text = "same words"
    comp = router._completions.prepare({"model": "m", "prompt": text, "max_tokens": 5})
    resp = router._responses.prepare({"model": "m", "input": text, "max_output_tokens": 5})
    chat = {"model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": 5}
    assert not isinstance(comp, Response) and not isinstance(resp, Response)
    assert comp.cache_view is not None and resp.cache_view is not None
    keys = {
        cache_key(comp.cache_view, None),
        cache_key(resp.cache_view, None),
        cache_key(chat, None),
    }
    assert len(keys) == 3
    other = router._completions.prepare({"model": "m", "prompt": text, "max_tokens": 6})
    assert not isinstance(other, Response) and other.cache_view is not None
    assert cache_key(other.cache_view, None) != cache_key(comp.cache_view, None)


def test_salt_binds_a_single_text_prompt_only(router: Router) -> None:
    d = router._completions
    assert d.saltable({"prompt": "x"}) and d.saltable({"prompt": ["x"]})
    assert not d.saltable({"prompt": ["x", "y"]}) and not d.saltable({"prompt": [1, 2]})


def test_prompt_chain_is_the_prompt_as_it_is() -> None:
    keys = ConversationKeys({"qwen": qwen_template()}, chunk_bytes=16)
    prompt = "<|im_start|>user\nA prompt rendered by the client itself, long enough."
    chain = keys.prompt_chain(prompt, "qwen", "tenant")
    assert chain is not None and chain.prompt_bytes == len(prompt.encode())
    assert chain.keys == chain_keys(prompt.encode(), chain_root("qwen", "tenant"), 16)
    assert keys.prompt_chain(prompt, "no-template") is None


@given(st.recursive(st.none() | st.booleans() | st.integers() | st.text(), st.lists, max_leaves=8))
@settings(max_examples=300, deadline=None)
def test_prompt_of_accepts_exactly_the_four_shapes(prompt: Any) -> None:
    first = prompt_of({"prompt": prompt})
    if first is None:
        return
    if isinstance(first, str):
        assert prompt == first or prompt[0] == first
    else:
        assert all(type(t) is int and t >= 0 for t in first) and first
        assert prompt == first or prompt[0] == first


# -- /v1/responses: validation and mapping --------------------------------------------------


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "x"}, "model"),
        ({"model": "m"}, "input"),
        ({"model": "m", "input": 5}, "input"),
        ({"model": "m", "input": []}, "input"),
        ({"model": "m", "input": ["x"]}, "input[0]"),
        ({"model": "m", "input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
        ({"model": "m", "input": [{"role": "user", "content": 3}]}, "input[0].content"),
        (
            {"model": "m", "input": [{"role": "user", "content": [{"type": "input_text"}]}]},
            "input[0].content[0].text",
        ),
        ({"model": "m", "input": [{"role": "user", "content": ["x"]}]}, "input[0].content[0]"),
        (
            {"model": "m", "input": ["ok", {"type": "function_call", "name": "f"}][1:]},
            "input[0].call_id",
        ),
        (
            {"model": "m", "input": [{"type": "function_call_output", "call_id": "c"}]},
            "input[0].output",
        ),
        ({"model": "m", "input": "x", "instructions": ["a"]}, "instructions"),
        ({"model": "m", "input": "x", "previous_response_id": 7}, "previous_response_id"),
        ({"model": "m", "input": "x", "tools": [1]}, "tools"),
        ({"model": "m", "input": "x", "stream": 1}, "stream"),
    ],
)
async def test_responses_malformed_body_names_the_field(
    router: Router, body: dict[str, Any], param: str
) -> None:
    err = error_of(await post(router, "/v1/responses", body))
    assert err["param"] == param
    assert param in err["message"]


def test_items_map_to_the_chat_conversation_the_engine_renders() -> None:
    body = {
        "model": "m",
        "instructions": "Be brief.",
        "tools": [{"type": "function", "name": "f", "parameters": {}}, {"type": "web_search"}],
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "?"}],
            },
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "42"},
        ],
    }
    check_request(body)
    assert chat_body(body) == {
        "model": "m",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "hi"}]},
            {
                "role": "assistant",
                "content": "?",
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
                ],
            },
            {"role": "tool", "content": "42", "tool_call_id": "c1"},
        ],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
    }
    assert chat_body({**body, "previous_response_id": "resp_1"}) is None
    assert chat_body({**body, "input": [{"type": "mcp_call"}]}) is None


@pytest.mark.parametrize(
    ("body", "anchor"),
    [
        ({"instructions": "Sys", "input": "hello"}, ("S", "Sys")),
        ({"input": "hello"}, ("M", "hello")),
        (
            {"input": [{"role": "developer", "content": "Dev"}, {"role": "user", "content": "u"}]},
            ("S", "Dev"),
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_text", "text": "u"}]}]},
            ("M", "u"),
        ),
        ({"instructions": "Sys", "input": "hello", "previous_response_id": "r"}, ("S", "Sys")),
        ({"input": "hello", "previous_response_id": "r"}, None),
    ],
)
def test_responses_anchor(router: Router, body: dict[str, Any], anchor: Any) -> None:
    prepared = router._responses.prepare({"model": "m", **body})
    assert not isinstance(prepared, Response)
    assert prepared.anchor == anchor


def test_responses_cache_keys_instructions_and_bypasses_state(router: Router) -> None:
    d = router._responses
    a = d.prepare({"model": "m", "input": "q", "instructions": "A"})
    b = d.prepare({"model": "m", "input": "q", "instructions": "B"})
    assert not isinstance(a, Response) and not isinstance(b, Response)
    assert a.cache_view is not None and b.cache_view is not None
    assert cache_key(a.cache_view, None) != cache_key(b.cache_view, None)
    unkeyed: list[dict[str, Any]] = [
        {"previous_response_id": "r"},
        {"tools": [{"type": "function"}]},
        {"text": {"format": {"type": "json_object"}}},
    ]
    for extra in unkeyed:
        p = d.prepare({"model": "m", "input": "q", **extra})
        assert not isinstance(p, Response) and p.cache_view is None


async def test_continuations_pin_the_backend_that_produced_the_response(router: Router) -> None:
    d = router._responses
    b = router.pool.get("b")
    assert b is not None
    d.transform(b, 200, orjson.dumps({"id": "resp_whole", "object": "response"}))

    async def chunks() -> AsyncIterator[bytes]:
        data = orjson.dumps({"type": "response.created", "response": {"id": "resp_stream"}})
        record = b"event: response.created\ndata: " + data + b"\n\n"
        for i in range(0, len(record), 7):  # split anywhere
            yield record[i : i + 7]
        yield b"event: response.completed\ndata: {}\n\n"

    relayed = b"".join([c async for c in d.stream(b, chunks())])
    assert relayed.startswith(b"event: response.created")
    for rid in ("resp_whole", "resp_stream"):
        p = d.prepare({"model": "m", "input": "go on", "previous_response_id": rid})
        assert not isinstance(p, Response) and p.pinned == "b"
    p = d.prepare({"model": "m", "input": "go on", "previous_response_id": "resp_unknown"})
    assert not isinstance(p, Response) and p.pinned is None


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=5),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
items = st.fixed_dictionaries(
    {},
    optional={
        "type": st.sampled_from(
            ["message", "function_call", "function_call_output", "reasoning", "x"]
        ),
        "role": st.sampled_from(["user", "assistant", "system", "developer", "robot"]),
        "content": json_values,
        "call_id": json_values,
        "name": json_values,
        "arguments": json_values,
        "output": json_values,
    },
)


@given(
    st.fixed_dictionaries(
        {
            "model": st.just("m"),
            "input": st.text(max_size=5) | st.lists(items | json_values, max_size=4),
        },
        optional={
            "instructions": json_values,
            "tools": json_values,
            "previous_response_id": json_values,
        },
    )
)
@settings(max_examples=400, deadline=None)
def test_responses_parser_never_crashes(body: dict[str, Any]) -> None:
    try:
        check_request(body)
    except InputError as exc:
        assert exc.param.split("[")[0].split(".")[0] in body or exc.param in ("model", "input")
        return
    chat = chat_body(body)
    if chat is not None:
        assert all(isinstance(m, dict) and isinstance(m["role"], str) for m in chat["messages"])
        extract_prefix_key(chat)


# -- usage: the engine's cached tokens in either shape -------------------------------------


def test_openai_usage_reads_both_shapes() -> None:
    chat = {"usage": {"prompt_tokens": 9, "prompt_tokens_details": {"cached_tokens": 4}}}
    assert openai_usage(chat) == chat["usage"]
    whole = {"usage": {"input_tokens": 9, "input_tokens_details": {"cached_tokens": 4}}}
    event = {"type": "response.completed", "response": whole}
    expected = {"prompt_tokens": 9, "prompt_tokens_details": {"cached_tokens": 4}}
    assert openai_usage(whole) == openai_usage(event) == expected
    assert openai_usage({"type": "response.created", "response": {"usage": None}}) is None


async def test_stream_usage_found_after_an_event_line() -> None:
    usage = {"input_tokens": 9, "input_tokens_details": {"cached_tokens": 4}}
    data = orjson.dumps({"type": "response.completed", "response": {"usage": usage}})
    record = b"event: response.completed\ndata: " + data + b"\n\n"

    async def chunks() -> AsyncIterator[bytes]:
        yield b'event: response.created\ndata: {"response": {"usage": null}}\n\n'
        yield record[:20]
        yield record[20:]

    seen: list[dict[str, Any]] = []
    out = [c async for c in _usage_of(chunks(), seen.append)]
    assert b"".join(out).endswith(record)
    assert seen == [{"prompt_tokens": 9, "prompt_tokens_details": {"cached_tokens": 4}}]
