"""The simulated engine types its prompt tokens from the chat template it renders, and
describes each chat request to the eviction advisor."""

from __future__ import annotations

from types import SimpleNamespace
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


async def test_the_advised_engine_reports_typed_blocks_and_the_request_features(
    monkeypatch: Any,
) -> None:
    """A chat request through the engine simulator: REQUEST_STARTED carries what the
    engine saw, and the system prompt's blocks are reported as SYSTEM, the rest USER."""
    from bus._gen.continuum.listener.v1 import eviction_advisor_pb2 as pb
    from harness.sim import advisor_client
    from harness.sim.engine import SimConfig, SimEngine

    sent: list[Any] = []

    class Recording(advisor_client.AdvisedEviction):
        def _kick(self) -> None:  # no listener: keep the queued events
            sent.extend(self._events)
            self._events.clear()

    monkeypatch.setattr(advisor_client, "AdvisedEviction", Recording)
    engine = SimEngine(SimConfig(name="e", eviction_advisor="127.0.0.1:1"))
    body = {
        "model": "m",
        "messages": [
            {"role": "system", "content": "You are a helpful assistant. " * 20},
            {"role": "user", "content": "hello there " * 30},
        ],
        "temperature": 0.0,
        "max_tokens": 8,
    }

    monkeypatch.setattr(engine, "_json_body", lambda req: body)
    await engine._chat(SimpleNamespace(headers={"x-session-id": "s1"}))  # type: ignore[arg-type]
    start = sent[0]
    assert start.kind == pb.BLOCK_EVENT_KIND_REQUEST_STARTED and start.session_id == "s1"
    assert start.request.turns == 1 and start.request.max_tokens == 8
    assert start.request.HasField("temperature") and start.request.temperature == 0.0
    types = [e.token_type for e in sent if e.kind == pb.BLOCK_EVENT_KIND_INSERTED]
    assert types[0] == pb.TOKEN_TYPE_SYSTEM and types[-1] == pb.TOKEN_TYPE_USER
    assert set(types) == {pb.TOKEN_TYPE_SYSTEM, pb.TOKEN_TYPE_USER}
