"""The official ``anthropic`` SDK through the router's /anthropic endpoint.

Backends of ``type: anthropic`` are sims (they serve /v1/messages). Besides plain and
streamed messages, the router's prompt-caching marker injection is checked on the body
the engine actually received (``GET /sim/last-request``).
"""

from __future__ import annotations

from typing import Any

import anthropic
import orjson
import pytest

from harness.sim.fleet import SimFleet

from .conftest import StartRouter, assert_openai_error, http, sim_json

MODEL = "claude-sim"
EPHEMERAL = {"type": "ephemeral"}


def anthropic_config(url: str, **backend_extra: Any) -> dict[str, Any]:
    return {
        "backends": [
            {"name": "claude", "url": url, "type": "anthropic", "models": [MODEL], **backend_extra}
        ]
    }


def client(url: str) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=url + "/anthropic", api_key="x", max_retries=0)


def find_cache_control(obj: Any, path: str = "") -> list[str]:
    """JSON paths of every ``cache_control`` key in ``obj``."""
    found: list[str] = []
    if isinstance(obj, dict):
        for k, v in obj.items():
            if k == "cache_control":
                found.append(f"{path}.{k}")
            found += find_cache_control(v, f"{path}.{k}")
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            found += find_cache_control(v, f"{path}[{i}]")
    return found


async def last_request(sims: SimFleet) -> dict[str, Any]:
    data: dict[str, Any] = await sim_json(sims[0].url, "/sim/last-request")
    return data


SYSTEM_BLOCKS: Any = [
    {"type": "text", "text": "You are a contract lawyer."},
    {"type": "text", "text": "Here is the contract: " + "clause " * 50},
]
MESSAGES: Any = [{"role": "user", "content": "Summarise the contract."}]


async def test_messages_non_streaming_and_streaming(
    start_router: StartRouter, sims: SimFleet
) -> None:
    router = await start_router(anthropic_config(sims[0].url))
    async with client(router.url) as c:
        raw = await c.messages.with_raw_response.create(
            model=MODEL, max_tokens=10, system="Be brief.", messages=MESSAGES
        )
        assert raw.headers["x-continuum-backend"] == "claude"
        msg = await raw.parse()
        assert msg.type == "message" and msg.role == "assistant"
        assert msg.model == MODEL
        assert msg.stop_reason == "end_turn"
        text = msg.content[0].text  # type: ignore[union-attr]
        assert text == "[sim-1] echo: Summarise the contract. lorem ipsum dolor sit amet"
        assert msg.usage.output_tokens == 10

        pieces: list[str] = []
        async with c.messages.stream(
            model=MODEL, max_tokens=10, system="Be brief.", messages=MESSAGES
        ) as stream:
            async for piece in stream.text_stream:
                pieces.append(piece)
            final = await stream.get_final_message()
        assert len(pieces) == 10, "one text delta per word: the stream is relayed, not buffered"
        assert "".join(pieces) == text
        assert final.content[0].text == text  # type: ignore[union-attr]
        assert final.stop_reason == "end_turn"
        assert final.usage.output_tokens == 10


async def test_cache_control_injected_on_last_system_block_by_default(
    start_router: StartRouter, sims: SimFleet
) -> None:
    router = await start_router(anthropic_config(sims[0].url))
    async with client(router.url) as c:
        await c.messages.create(model=MODEL, max_tokens=4, system=SYSTEM_BLOCKS, messages=MESSAGES)
        seen = await last_request(sims)
        assert seen["system"] == [
            SYSTEM_BLOCKS[0],
            {**SYSTEM_BLOCKS[1], "cache_control": EPHEMERAL},
        ]
        assert find_cache_control(seen) == [".system[1].cache_control"], "last block only"
        assert seen["messages"] == MESSAGES

        # A plain-string system prompt becomes one marked text block.
        await c.messages.create(
            model=MODEL, max_tokens=4, system="Plain system prompt.", messages=MESSAGES
        )
        seen = await last_request(sims)
        assert seen["system"] == [
            {"type": "text", "text": "Plain system prompt.", "cache_control": EPHEMERAL}
        ]
        assert find_cache_control(seen) == [".system[0].cache_control"]


async def test_no_injection_when_the_backend_disables_it(
    start_router: StartRouter, sims: SimFleet
) -> None:
    router = await start_router(anthropic_config(sims[0].url, anthropic_auto_cache_control=False))
    async with client(router.url) as c:
        await c.messages.create(model=MODEL, max_tokens=4, system=SYSTEM_BLOCKS, messages=MESSAGES)
    seen = await last_request(sims)
    assert find_cache_control(seen) == []
    assert seen["system"] == SYSTEM_BLOCKS


async def test_global_injection_overrides_the_backend_setting(
    start_router: StartRouter, sims: SimFleet
) -> None:
    cfg = anthropic_config(sims[0].url, anthropic_auto_cache_control=False)
    cfg["prefix_routing"] = {"anthropic_cache_control_injection": True}
    router = await start_router(cfg)
    async with client(router.url) as c:
        await c.messages.create(model=MODEL, max_tokens=4, system=SYSTEM_BLOCKS, messages=MESSAGES)
    seen = await last_request(sims)
    assert find_cache_control(seen) == [".system[1].cache_control"]
    assert seen["system"][1]["cache_control"] == EPHEMERAL


async def test_callers_own_cache_control_is_left_untouched(
    start_router: StartRouter, sims: SimFleet
) -> None:
    router = await start_router(anthropic_config(sims[0].url))
    messages: Any = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "A long document...", "cache_control": EPHEMERAL},
                {"type": "text", "text": "Question about it?"},
            ],
        }
    ]
    async with client(router.url) as c:
        await c.messages.create(
            model=MODEL, max_tokens=4, system="Caller-managed caching.", messages=messages
        )
    seen = await last_request(sims)
    assert seen["system"] == "Caller-managed caching.", "system must not be rewritten"
    assert seen["messages"] == messages
    assert find_cache_control(seen) == [".messages[0].content[0].cache_control"]


async def test_anthropic_errors_use_the_anthropic_shape(
    start_router: StartRouter, sims: SimFleet
) -> None:
    router = await start_router(anthropic_config(sims[0].url))
    r = await http("POST", router.url + "/anthropic/v1/messages", data=b"{nope")
    assert r.status == 400
    body = r.json()
    assert body["type"] == "error"
    assert body["error"]["type"] == "invalid_request_error"
    assert "JSON" in body["error"]["message"]

    async with client(router.url) as c:
        with pytest.raises(anthropic.NotFoundError) as exc:
            await c.messages.create(model="unknown-claude", max_tokens=4, messages=MESSAGES)
    assert "unknown-claude" in str(exc.value)

    # The OpenAI endpoint does not route to anthropic backends.
    r = await http(
        "POST",
        router.url + "/v1/chat/completions",
        data=orjson.dumps({"model": MODEL, "messages": MESSAGES}),
    )
    assert_openai_error(r, 404)
