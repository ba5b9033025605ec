"""Conversation-depth routing in a real router process, with predict on route and no listener.

Two simulated engines render with Qwen2's real chat template; the router renders the same
requests with the same template (``kv_cache_index.conversation``) and routes on their
prompt chains. With no listener the chain index only holds predictions, so what a user
relies on here is the approximate conversation-aware mode: a new system prompt goes where
the strategy sends it, every later request that shares it follows, and the prompts spread
over both backends. A request the router cannot render (an image part) is routed on its
prefix key and counted, never failed.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import pytest

from harness.sim.fleet import SimFleet

from .conftest import StartRouter, backend
from .qwen_stack import qwen2_templates

pytest.importorskip("tokenizers")

MODEL = "qwen-sim"
PROMPTS = 8


def _system(p: int) -> str:
    # Over one chunk (1 KiB) of rendered prompt, so every prompt has keys of its own.
    line = f"You are assistant number {p} of the product team. Follow house style {p}. "
    return line * 30


def _body(p: int, q: int) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": _system(p)},
            {"role": "user", "content": f"question {q} about prompt {p}"},
        ],
        "max_tokens": 4,
    }


def _router_config(sims: SimFleet, **conversation: Any) -> dict[str, Any]:
    return {
        "selection_strategy": "RoundRobin",
        "prefix_routing": {"enabled": True},
        "backends": [backend(f"b{i}", url, type="vllm") for i, url in enumerate(sims.urls)],
        "kv_cache_index": {
            "enabled": True,
            "conversation": {
                "enabled": True,
                "templates": qwen2_templates(MODEL),
                **conversation,
            },
        },
    }


async def test_predict_on_route_keeps_each_prompt_on_one_backend(
    start_router: StartRouter,
) -> None:
    async with SimFleet(n=2, model=MODEL, tokenizer="qwen2") as sims:
        router = await start_router(_router_config(sims))
        placed: dict[int, Counter[str]] = {p: Counter() for p in range(PROMPTS)}
        for q in range(6):
            results = await asyncio.gather(*(router.chat(_body(p, q)) for p in range(PROMPTS)))
            for p, r in enumerate(results):
                assert r.status == 200, r.body
                placed[p][r.headers["x-continuum-backend"]] += 1
        assert all(len(c) == 1 for c in placed.values()), placed
        homes = Counter(next(iter(c)) for c in placed.values())
        assert set(homes) == {"b0", "b1"}, homes  # a new prompt went where RoundRobin sent it
        stats = await router.stats_of("/admin/kv-index/stats")
        conv = stats["conversation"]
        assert conv["routing_decisions"]["chosen"] >= PROMPTS * 5, conv
        assert conv["predictions"]["keys_written"] > 0, conv


async def test_a_request_it_cannot_render_is_routed_on_its_prefix_key(
    start_router: StartRouter,
) -> None:
    async with SimFleet(n=2, model=[MODEL, "other-model"], tokenizer="qwen2") as sims:
        router = await start_router(_router_config(sims))
        body = _body(0, 0)
        body["messages"][1]["content"] = [
            {"type": "text", "text": "what is in this picture?"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
        ]
        r = await router.chat(body)
        assert r.status == 200, r.body
        stats = await router.stats_of("/admin/kv-index/stats")
        failures = stats["conversation"]["rendering"]["failures"]
        assert failures == {MODEL: {"non_text": 1}}, failures
        # A model without a template is routed on its prefix key too, counted apart.
        r = await router.chat({**_body(1, 0), "model": "other-model"})
        assert r.status == 200, r.body
        rendering = (await router.stats_of("/admin/kv-index/stats"))["conversation"]["rendering"]
        assert rendering["no_template"] == 1 and rendering["failures"] == failures, rendering
