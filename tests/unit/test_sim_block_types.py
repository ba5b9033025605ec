"""The simulated engine types its prompt tokens from the chat template it renders, and
describes each chat request to the eviction advisor."""

from __future__ import annotations

from typing import Any

from harness.sim.block_types import request_features, token_types
from harness.sim.tokenizer import Qwen2Tokenizer, SimpleTokenizer
from listener.saecache.classify import RequestFeatures
from listener.saecache.types import TokenType

SYS, USR, AST, TDEF, TIO = (
    TokenType.SYSTEM,
    TokenType.USER,
    TokenType.ASSISTANT,
    TokenType.TOOL_DEF,
    TokenType.TOOL_IO,
)

_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "the weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


def _types(tok: Any, messages: list[dict[str, Any]], tools: Any = None) -> list[int]:
    prompt = tok.render_chat(messages, tools)
    tokens = tok.encode(prompt)
    got = token_types(
        lambda m: tok.render_chat(m, tools), tok.encode, messages, tokens, bool(tools)
    )
    assert len(got) == len(tokens)
    return got


def _runs(types: list[int]) -> list[int]:
    """The sequence of types with repeats collapsed."""
    out: list[int] = []
    for t in types:
        if not out or out[-1] != t:
            out.append(t)
    return out


def test_qwen_template_types_each_message_by_role() -> None:
    tok = Qwen2Tokenizer()
    messages = [
        {"role": "system", "content": "You are a helpful assistant. " * 5},
        {"role": "user", "content": "What is the capital of France? " * 4},
        {"role": "assistant", "content": "Paris is the capital of France. " * 4},
        {"role": "user", "content": "And of Italy?"},
    ]
    types = _types(tok, messages)
    assert _runs(types) == [SYS, USR, AST, USR]
    n_sys = types.count(SYS)
    system_tokens = len(tok.encode("You are a helpful assistant. " * 5))
    assert system_tokens <= n_sys <= system_tokens + 8  # the template's framing tokens


def test_tools_calls_and_results_are_typed_as_such() -> None:
    tok = Qwen2Tokenizer()
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "Weather in Paris, please."},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny, 21 C"},
    ]
    types = _types(tok, messages, _TOOLS)
    assert _runs(types)[0] == TDEF  # the tool definitions are the template's preamble
    assert USR in types and TIO in types
    assert types[-1] in (TIO, USR)


def test_a_template_that_fails_on_prefixes_still_types_what_it_can() -> None:
    def render(msgs: list[dict[str, Any]]) -> str:
        if not msgs or not msgs[-1]["content"]:
            raise ValueError("needs a message, and no empty one")
        return "|".join(m["content"] for m in msgs)

    def encode(text: str) -> list[int]:
        return [ord(c) for c in text]

    messages = [{"role": "system", "content": "ab"}, {"role": "user", "content": "cd"}]
    tokens = encode(render(messages))
    assert token_types(render, encode, messages, tokens, False) == [SYS, SYS, USR, USR, USR]
    simple = SimpleTokenizer()
    assert set(_types(simple, messages)) <= {SYS, USR, AST}


def test_request_features_are_what_the_engine_knows() -> None:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "u"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "1"}, {"id": "2"}]},
        {"role": "tool", "content": "r"},
        {"role": "tool", "content": "r"},
    ]
    body = {"tools": _TOOLS, "temperature": 0.2}
    f = request_features(body, messages, 512)
    assert f == RequestFeatures(
        tools=1, turns=4, tool_calls=2, tool_results=2, reasoning=False, temperature=0.2,
        max_tokens=512,
    )  # fmt: skip
    g = request_features(
        {"temperature": "hot", "chat_template_kwargs": {"enable_thinking": True}},
        [{"role": "user", "content": "u"}],
        None,
    )
    assert g.temperature is None and g.reasoning is True and g.turns == 1 and g.tools == 0
