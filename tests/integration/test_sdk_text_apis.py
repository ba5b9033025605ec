"""``/v1/completions`` and ``/v1/responses`` through a real router, driven by the ``openai`` SDK.

What a user relies on: ``client.completions.create`` and ``client.responses.create``
work unmodified through the router, streamed or not, with every selection strategy; the
same prompt lead (completions) or the same instructions (Responses) land on one backend
under PrefixAwareHash; a ``previous_response_id`` continuation reaches the engine that
stored the response; deterministic requests are answered from the response cache on a
repeat; malformed bodies come back as 400s naming the field; and the engine's cached
tokens are recorded against the router's prediction for both APIs.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest
import pytest_asyncio

from harness.sim.fleet import SimFleet
from harness.sim.tokenizer import bundled_qwen2_config, bundled_qwen2_json
from router.selection import STRATEGY_CLASSES

from .conftest import RouterLauncher, RouterProc, StartRouter, backend, served_by, sim_json

STRATEGIES = tuple(STRATEGY_CLASSES)


def fleet_config(sims: SimFleet, strategy: str = "PrefixAwareHash", **extra: Any) -> dict[str, Any]:
    return {
        "selection_strategy": strategy,
        "prefix_routing": {"enabled": True},
        "backends": [backend(s.name, s.url, models=[]) for s in sims],
        **extra,
    }


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def router(sims: SimFleet, module_router_launcher: RouterLauncher) -> RouterProc:
    return await module_router_launcher.start(fleet_config(sims, response_cache={"enabled": True}))


@pytest_asyncio.fixture(loop_scope="session")
async def oai(router: RouterProc) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="k", max_retries=0) as c:
        yield c


async def requests_of(sims: SimFleet) -> int:
    return sum([(await sim_json(url, "/sim/stats"))["requests"] for url in sims.urls])


# -- /v1/completions -----------------------------------------------------------------------


async def test_completion_whole_and_streamed(oai: openai.AsyncOpenAI) -> None:
    prompt = "Q: What is the capital of France?\nA:"
    raw = await oai.completions.with_raw_response.create(
        model="demo-model", prompt=prompt, max_tokens=12
    )
    whole = raw.parse()
    assert whole.object == "text_completion" and whole.id.startswith("cmpl-")
    assert served_by(whole.choices[0].text) == raw.headers["x-continuum-backend"]
    assert whole.usage is not None and whole.usage.completion_tokens == 12
    stream = await oai.completions.create(
        model="demo-model",
        prompt=prompt,
        max_tokens=12,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [c async for c in stream]
    assert len(chunks) > 12, "one chunk per word: the stream must not be buffered"
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12


async def test_completion_batches_and_token_ids_pass_through(oai: openai.AsyncOpenAI) -> None:
    batch = await oai.completions.create(
        model="demo-model", prompt=["batch one", "batch two"], max_tokens=4
    )
    assert [c.index for c in batch.choices] == [0, 1]
    assert served_by(batch.choices[0].text) == served_by(batch.choices[1].text)
    ids = await oai.completions.create(model="demo-model", prompt=[11, 12, 13], max_tokens=4)
    assert ids.usage is not None and ids.usage.prompt_tokens == 3


async def test_completion_prompt_lead_sticks_to_one_backend(oai: openai.AsyncOpenAI) -> None:
    async def landed(prompt: str) -> str:
        raw = await oai.completions.with_raw_response.create(
            model="demo-model", prompt=prompt, max_tokens=2
        )
        return raw.headers["x-continuum-backend"]

    for lead in range(3):
        context = f"Document {lead}: " + "the lease terms follow. " * 60  # > 1 KiB: the anchor
        homes = {await landed(f"{context}\nQuestion {q}:") for q in range(5)}
        assert len(homes) == 1, (lead, homes)
    spread = {await landed(f"Unrelated document {i}. Summarize:") for i in range(20)}
    assert len(spread) >= 2, spread


# -- /v1/responses -------------------------------------------------------------------------


async def test_response_whole_and_streamed(oai: openai.AsyncOpenAI) -> None:
    raw = await oai.responses.with_raw_response.create(
        model="demo-model",
        instructions="You are terse.",
        input=[{"role": "user", "content": [{"type": "input_text", "text": "Hello there"}]}],
        max_output_tokens=10,
    )
    whole = raw.parse()
    assert whole.object == "response" and whole.status == "completed"
    assert served_by(whole.output_text) == raw.headers["x-continuum-backend"]
    stream = await oai.responses.create(
        model="demo-model",
        instructions="You are terse.",
        input=[{"role": "user", "content": [{"type": "input_text", "text": "Hello there"}]}],
        max_output_tokens=10,
        stream=True,
    )
    events = [e async for e in stream]
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text  # same instructions: same backend, same answer
    final = events[-1].response
    assert final.usage is not None and final.usage.output_tokens == 10


async def test_same_instructions_land_on_one_backend(oai: openai.AsyncOpenAI) -> None:
    async def landed(instructions: str, question: str) -> str:
        raw = await oai.responses.with_raw_response.create(
            model="demo-model", instructions=instructions, input=question, max_output_tokens=3
        )
        return raw.headers["x-continuum-backend"]

    for tenant in range(3):
        instructions = f"You are the support agent of tenant {tenant}. Policy text follows."
        homes = {await landed(instructions, f"question {q}") for q in range(5)}
        assert len(homes) == 1, (tenant, homes)
    spread = {await landed(f"instructions number {i}", "hi") for i in range(20)}
    assert len(spread) >= 2, spread


async def test_continuations_reach_the_engine_that_stored_the_response(
    start_router: StartRouter, sims: SimFleet
) -> None:
    # RoundRobin would send each turn elsewhere, where the engine knows no such response.
    router = await start_router(fleet_config(sims, "RoundRobin"))
    async with openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="k", max_retries=0) as c:
        first = await c.responses.with_raw_response.create(model="demo-model", input="turn 0")
        home = first.headers["x-continuum-backend"]
        previous = first.parse().id
        for turn in range(1, 4):
            stream = await c.responses.with_raw_response.create(
                model="demo-model", input=f"turn {turn}", previous_response_id=previous, stream=True
            )
            assert stream.headers["x-continuum-backend"] == home
            events = [e async for e in stream.parse()]
            assert events[-1].type == "response.completed", events[-1]
            previous = events[0].response.id  # type: ignore[union-attr]
        follow = await c.responses.with_raw_response.create(
            model="demo-model", input="last", previous_response_id=previous
        )
        assert follow.headers["x-continuum-backend"] == home
        # An id the router never relayed goes where the strategy says (and the engine says no).
        with pytest.raises(openai.NotFoundError):
            for _ in range(3):
                await c.responses.create(
                    model="demo-model", input="x", previous_response_id="resp_never_seen"
                )


# -- every strategy, the response cache, errors ----------------------------------------------


async def test_every_strategy_serves_both_apis(start_router: StartRouter, sims: SimFleet) -> None:
    for strategy in STRATEGIES:
        router = await start_router(fleet_config(sims, strategy))
        async with openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="k", max_retries=0) as c:
            comp = await c.completions.create(model="demo-model", prompt="ping", max_tokens=3)
            served_by(comp.choices[0].text)
            chunks = [
                x
                async for x in await c.completions.create(
                    model="demo-model", prompt="ping", max_tokens=3, stream=True
                )
            ]
            served_by("".join(x.choices[0].text for x in chunks))
            resp = await c.responses.create(model="demo-model", input="ping", user="u1")
            served_by(resp.output_text)
            events = [
                e
                async for e in await c.responses.create(
                    model="demo-model", input="ping", stream=True
                )
            ]
            assert events[-1].type == "response.completed", strategy


async def test_deterministic_repeats_are_answered_from_the_cache(
    oai: openai.AsyncOpenAI, sims: SimFleet
) -> None:
    first = await oai.completions.with_raw_response.create(
        model="demo-model", prompt="cache this completion", temperature=0, max_tokens=5
    )
    assert first.headers["x-cache"] == "MISS"
    before = await requests_of(sims)
    again = await oai.completions.with_raw_response.create(
        model="demo-model", prompt="cache this completion", temperature=0, max_tokens=5
    )
    assert again.headers["x-cache"] == "HIT"
    assert again.parse().choices[0].text == first.parse().choices[0].text
    r1 = await oai.responses.with_raw_response.create(
        model="demo-model", instructions="Cache me.", input="q", temperature=0
    )
    assert r1.headers["x-cache"] == "MISS"
    before = await requests_of(sims)
    r2 = await oai.responses.with_raw_response.create(
        model="demo-model", instructions="Cache me.", input="q", temperature=0
    )
    assert r2.headers["x-cache"] == "HIT"
    assert r2.parse().output_text == r1.parse().output_text
    # A stream is stored whole and replayed to the SDK.
    for _ in range(2):
        s = await oai.responses.with_raw_response.create(
            model="demo-model", input="stream cache", temperature=0, stream=True
        )
        events = [e async for e in s.parse()]
        assert events[-1].type == "response.completed"
    assert s.headers["x-cache"] == "HIT"
    assert await requests_of(sims) == before + 1  # the stream's first request only
    other = await oai.responses.with_raw_response.create(
        model="demo-model", instructions="Cache me.", input="q", temperature=0.5
    )
    assert other.headers["x-cache"] == "BYPASS"


async def test_malformed_bodies_are_400s_naming_the_field(oai: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        await oai.completions.create(model="demo-model", prompt=[1, "x"])  # type: ignore[arg-type]
    assert isinstance(bad.value.body, dict) and bad.value.body["param"] == "prompt"
    with pytest.raises(openai.BadRequestError) as bad:
        await oai.responses.create(
            model="demo-model",
            input=[{"type": "function_call_output", "output": "x"}],
        )
    assert isinstance(bad.value.body, dict) and bad.value.body["param"] == "input[0].call_id"


# -- conversation-depth routing: predicted against delivered cached tokens -------------------


async def test_cached_tokens_are_recorded_for_both_apis(start_router: StartRouter) -> None:
    pytest.importorskip("tokenizers")
    model = "qwen-sim"
    async with SimFleet(n=2, model=model, tokenizer="qwen2") as qsims:
        config = fleet_config(qsims)
        config["backends"] = [backend(s.name, s.url) for s in qsims]
        config["kv_cache_index"] = {
            "enabled": True,
            "conversation": {
                "enabled": True,
                "templates": [
                    {
                        "model": model,
                        "tokenizer_config": str(bundled_qwen2_config()),
                        "tokenizer": str(bundled_qwen2_json()),
                    }
                ],
            },
        }
        router = await start_router(config)
        context = "You are the assistant of the archive. Answer from the records. " * 40
        async with openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="k", max_retries=0) as c:
            for q in range(3):
                await c.completions.create(model=model, prompt=f"{context}\nQ{q}:", max_tokens=3)
                await c.responses.create(
                    model=model, instructions=context, input=f"question {q}", max_output_tokens=3
                )
            events = [
                e
                async for e in await c.responses.create(
                    model=model, instructions=context, input="streamed", stream=True
                )
            ]
            assert events[-1].type == "response.completed"
        stats = await router.stats_of("/admin/kv-index/stats")
        cached = stats["conversation"]["cached_tokens"]
        assert cached["requests"] >= 7, cached  # every request but nothing skipped
        assert cached["reported_tokens"] > 0 and cached["predicted_tokens"] > 0, cached
