"""The simulator's ``/v1/completions`` and ``/v1/responses``, pinned with the official SDK.

The router's tests of both APIs trust these answers, so the SDK must parse them
unmodified (vLLM's shapes: ``cmpl-`` ids, ``text_completion``, ``prompt_tokens_details``;
``resp_`` ids, the Responses event sequence, ``input_tokens_details``), the prefix cache
must see the prompt (cached tokens on a repeat, KV events for its blocks), and a stored
response must continue under ``previous_response_id``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest
import pytest_asyncio

from bus.prefix_key import compute_prefix_key
from harness.sim.engine import SimConfig, SimEngine
from harness.sim.fleet import SimFleet
from harness.sim.httpserver import Request, Response, dumps, loads
from harness.sim.prefix_cache import StoredBlock

module_loop = pytest.mark.asyncio(loop_scope="module")

LONG = " ".join(f"Clause {i}: keep the premises in good repair." for i in range(20))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def url() -> AsyncIterator[str]:
    async with SimFleet(n=1, model="demo-model") as fleet:
        yield fleet.urls[0]


def oai(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="sk-sim", max_retries=0)


# -- /v1/completions -----------------------------------------------------------------------


@module_loop
async def test_completion_shape_and_cached_tokens_on_repeat(url: str) -> None:
    client = oai(url)
    prompt = f"[shape] {LONG}"
    first = await client.completions.create(model="demo-model", prompt=prompt, max_tokens=6)
    assert first.id.startswith("cmpl-")
    assert first.object == "text_completion"
    assert first.model == "demo-model"
    (choice,) = first.choices
    assert choice.index == 0 and choice.logprobs is None
    assert choice.text.startswith("[sim-1] echo: [shape] Clause 0")
    assert choice.finish_reason == "length"
    usage = first.usage
    assert usage is not None and usage.completion_tokens == 6
    assert usage.total_tokens == usage.prompt_tokens + 6
    assert usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == 0
    again = await client.completions.create(model="demo-model", prompt=prompt, max_tokens=6)
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    assert (again.usage.prompt_tokens_details.cached_tokens or 0) >= 16  # blocks reused


@module_loop
async def test_completion_batch_and_token_ids(url: str) -> None:
    client = oai(url)
    batch = await client.completions.create(
        model="demo-model", prompt=["first prompt", "second prompt"], max_tokens=4
    )
    assert [c.index for c in batch.choices] == [0, 1]
    assert batch.choices[1].text.startswith("[sim-1] echo: second prompt")
    ids = await client.completions.create(model="demo-model", prompt=[1, 2, 3, 4], max_tokens=3)
    assert ids.usage is not None and ids.usage.prompt_tokens == 4
    nested = await client.completions.create(
        model="demo-model", prompt=[[5, 6], [7, 8, 9]], max_tokens=3
    )
    assert len(nested.choices) == 2
    assert nested.usage is not None and nested.usage.prompt_tokens == 5


@module_loop
async def test_completion_stream_matches_whole_answer(url: str) -> None:
    client = oai(url)
    whole = await client.completions.create(model="demo-model", prompt="stream it", max_tokens=7)
    stream = await client.completions.create(
        model="demo-model",
        prompt="stream it",
        max_tokens=7,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [c async for c in stream]
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "stop" and finishes.count("stop") == 1
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 7


@pytest.mark.parametrize(
    "prompt", [None, 3, [], [1, "a"], [[1], "x"], [-1], [True], {"text": "x"}, [[]]]
)
@module_loop
async def test_completion_rejects_malformed_prompts(url: str, prompt: Any) -> None:
    with pytest.raises(openai.BadRequestError, match="prompt"):
        await oai(url).completions.create(model="demo-model", prompt=prompt)


async def test_completion_publishes_the_prompt_blocks_and_its_prefix_key() -> None:
    events: list[list[StoredBlock]] = []
    engine = SimEngine(
        SimConfig(name="kv", block_size=4), on_kv_event=lambda s, r: events.append(s)
    )
    body = {"model": "demo-model", "prompt": LONG, "max_tokens": 2}
    resp = await engine(Request("POST", "/v1/completions", "", {}, dumps(body)))
    assert isinstance(resp, Response) and resp.status == 200
    prompt_tokens = loads(resp.body)["usage"]["prompt_tokens"]
    stored = [b for batch in events for b in batch]
    assert len(stored) >= prompt_tokens // 4  # every full prompt block announced
    held = await engine(Request("GET", "/sim/held-prefixes", "", {}, b""))
    assert isinstance(held, Response)
    key = compute_prefix_key("demo-model", "P", LONG, 1024).hex()
    assert key in loads(held.body)["held"]


# -- /v1/responses -------------------------------------------------------------------------


@module_loop
async def test_response_shape_and_cached_tokens(url: str) -> None:
    client = oai(url)
    first = await client.responses.create(
        model="demo-model", instructions=f"[resp] {LONG}", input="What is up?", max_output_tokens=40
    )
    assert first.id.startswith("resp_")
    assert first.object == "response" and first.status == "completed"
    assert first.output_text.startswith("[sim-1] echo: What is up?")
    assert first.output[0].type == "message"
    usage = first.usage
    assert usage is not None and usage.input_tokens_details.cached_tokens == 0
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    again = await client.responses.create(
        model="demo-model", instructions=f"[resp] {LONG}", input="And now?", max_output_tokens=40
    )
    assert again.usage is not None and again.usage.input_tokens_details.cached_tokens >= 16


@module_loop
async def test_response_items_function_calls_and_previous_response(url: str) -> None:
    client = oai(url)
    tools: Any = [
        {
            "type": "function",
            "name": "lookup",
            "description": "Looks a word up.",
            "parameters": {"type": "object", "properties": {"query": {"type": "string"}}},
        }
    ]
    call = await client.responses.create(
        model="demo-model",
        input=[{"role": "user", "content": [{"type": "input_text", "text": "find cats"}]}],
        tools=tools,
        tool_choice="required",
    )
    (item,) = call.output
    assert item.type == "function_call" and item.name == "lookup"
    follow = await client.responses.create(
        model="demo-model",
        previous_response_id=call.id,
        input=[
            {"type": "function_call_output", "call_id": item.call_id, "output": "cats: felines"}
        ],
        tools=tools,
    )
    assert follow.previous_response_id == call.id
    assert follow.output_text.startswith("[sim-1] echo: find cats")  # history came along
    with pytest.raises(openai.NotFoundError, match="resp_missing"):
        await client.responses.create(
            model="demo-model", previous_response_id="resp_missing", input="hi"
        )


@module_loop
async def test_response_stream_event_sequence(url: str) -> None:
    client = oai(url)
    stream = await client.responses.create(
        model="demo-model", input="stream a response", max_output_tokens=6, stream=True
    )
    events = [e async for e in stream]
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response  # type: ignore[union-attr]
    assert deltas == final.output_text
    assert final.usage is not None and final.usage.output_tokens == 6


@pytest.mark.parametrize(
    "body",
    [
        {"input": 5},
        {"input": []},
        {"input": [{"role": "robot", "content": "x"}]},
        {"input": [{"type": "function_call", "call_id": "c", "name": 3, "arguments": "{}"}]},
        {"input": "x", "instructions": ["not", "text"]},
    ],
)
@module_loop
async def test_response_rejects_malformed_input(url: str, body: dict[str, Any]) -> None:
    with pytest.raises(openai.BadRequestError):
        await oai(url).responses.create(model="demo-model", **body)
