"""Conversation-depth routing end to end: engines -> listener chain keys -> router -> route.

Real processes: two simulated engines with Qwen2's tokenizer and chat template publish
vLLM KV events (prompt and answer blocks) over ZMQ; the real listener, in conversation
mode with Qwen2's ``tokenizer.json``, turns stored blocks into ``chain_created`` events;
the real router, in conversation mode with the same chat template, renders each request
into its prompt chain and routes on the chain index those events fill.

What a user relies on:

* turn 2 of a conversation goes to the engine that served turn 1 even though both hold
  the shared system prompt's keys and the strategy alone would alternate, because only
  that engine holds the conversation (the listener's keys, not a prediction: the
  prediction TTL here is 0);
* the cached tokens the router predicted for that engine match what the engine reports
  (``usage.prompt_tokens_details.cached_tokens``) to within one chunk of text;
* a turn of a fresh conversation under the same system prompt still lands on an engine
  holding that prompt.

The router has its render cache on: turns 2 to 4 render only their new messages, so the
keys the engine's events confirm are those the cache's chain states give.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from harness.procs import Service
from harness.sim.fleet import SimFleet

from .conftest import RouterLauncher, RouterProc, http, wait_until
from .qwen_stack import qwen2_templates, qwen_fleet

pytest.importorskip("tokenizers")

MODEL = "qwen-sim"
NAMES = ("sim-1", "sim-2")
SYSTEM = "You are the assistant of the product team. Follow the style guide. " * 40


def turn_body(history: list[dict[str, Any]], question: str) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": SYSTEM},
            *history,
            {"role": "user", "content": question},
        ],
        "max_tokens": 24,
    }


class Listener(Service):
    def __init__(self, config: dict[str, Any], path: Path) -> None:
        super().__init__("listener", ["listener"], config, path)

    async def stats(self) -> dict[str, Any]:
        r = await http("GET", self.url + "/stats", total_s=5)
        assert r.status == 200, r
        data: dict[str, Any] = r.json()
        return data


async def direct(url: str, body: dict[str, Any]) -> None:
    r = await http("POST", url + "/v1/chat/completions", json=body)
    assert r.status == 200, r


@pytest_asyncio.fixture(loop_scope="session")
async def stack(
    module_router_launcher: RouterLauncher, tmp_path: Path
) -> AsyncIterator[tuple[SimFleet, Listener, RouterProc]]:
    engines, listener_config = qwen_fleet(NAMES, MODEL)
    async with engines as fleet:
        listener = Listener(
            listener_config,
            tmp_path / "listener.yaml",
        )
        await listener.start()
        try:
            # ZMQ's slow joiner: until the listener has a frame from each engine, a batch
            # can be lost to the live path. Each warm-up is its own prompt from the first
            # token on: a lost batch of the shared system prompt would leave the engine
            # holding blocks the listener never saw, and every later block of the
            # conversation an orphan without a key.
            for i, name in enumerate(NAMES):
                n = 0

                async def got_frame(i: int = i, name: str = name) -> bool:
                    nonlocal n
                    n += 1
                    await direct(
                        fleet.urls[i],
                        {
                            "model": MODEL,
                            "messages": [{"role": "user", "content": f"{n} warm-up " * 40}],
                            "max_tokens": 4,
                        },
                    )
                    return bool((await listener.stats())["sources"][name]["frames"] > 0)

                await wait_until(got_frame, within=15, interval=0.05, what=f"a frame from {name}")
            router = await module_router_launcher.start(
                {
                    "selection_strategy": "RoundRobin",
                    "prefix_routing": {"enabled": True},
                    "backends": [
                        {"name": name, "url": url, "type": "vllm", "models": [MODEL]}
                        for name, url in zip(NAMES, fleet.urls, strict=True)
                    ],
                    "kv_cache_index": {
                        "enabled": True,
                        "event_sources": [
                            {
                                "backend_name": name,
                                "endpoint": f"{listener.url}/events/{name}",
                                "reconnect_interval_ms": 100,
                            }
                            for name in NAMES
                        ],
                        "conversation": {
                            "enabled": True,
                            "predict_ttl_seconds": 0,  # only the engines' own events count
                            # on, but plain chats are concatenated before it (below)
                            "render_cache_bytes": 1 << 20,
                            "templates": qwen2_templates(MODEL),
                        },
                    },
                }
            )
            yield fleet, listener, router
        finally:
            if listener.running:
                assert await listener.stop() == 0, listener.log()


async def _conversation(router: RouterProc) -> dict[str, Any]:
    r = await router.stats_of("/admin/kv-index/stats")
    conv: dict[str, Any] = r["conversation"]
    return conv


async def test_turn_two_follows_the_engine_that_holds_turn_one(
    stack: tuple[SimFleet, Listener, RouterProc],
) -> None:
    _, _, router = stack
    history: list[dict[str, Any]] = []
    first = await router.chat(turn_body(history, "How do I rotate the keys? " * 20))
    assert first.status == 200, first.body
    home = first.headers["x-continuum-backend"]
    answer = first.json()["choices"][0]["message"]["content"]
    history += [
        {"role": "user", "content": "How do I rotate the keys? " * 20},
        {"role": "assistant", "content": answer},
    ]

    async def turn_one_indexed() -> bool:
        # Turn one renders to about 3.4 KB: three whole chunks, each a key on its engine.
        conv = await _conversation(router)
        return bool(conv["index"]["entry_count"] >= 3)

    await wait_until(turn_one_indexed, within=10, what="the listener's chain keys of turn 1")
    # The other engine holds the shared system prompt too.
    other = NAMES[1 - NAMES.index(home)]
    await direct(stack[0].urls[NAMES.index(other)], turn_body([], "Unrelated question. " * 20))

    for k in range(2, 5):
        before = (await _conversation(router))["index"]["entry_count"]
        r = await router.chat(turn_body(history, f"And step {k}? " * 100))
        assert r.status == 200, r.body
        assert r.headers["x-continuum-backend"] == home, (k, r.headers)
        doc = r.json()
        history += [
            {"role": "user", "content": f"And step {k}? " * 100},
            {"role": "assistant", "content": doc["choices"][0]["message"]["content"]},
        ]
        reported = doc["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert reported > 0

        async def grew(before: int = before) -> bool:
            return bool((await _conversation(router))["index"]["entry_count"] > before)

        await wait_until(grew, within=10, what=f"turn {k}'s chain keys")
    # Each turn is a shape seen for the first time (one more question and answer), so
    # jinja rendered it; another session at the same turn, here the last turn again,
    # is rendered by concatenation (its shape learned from probe renders and checked
    # against jinja once), and its keys are still the ones the listener announced.
    again = await router.chat(turn_body(history[:-2], "And step 4? " * 100))
    assert again.status == 200, again.body
    assert again.headers["x-continuum-backend"] == home, again.headers
    conv = await _conversation(router)
    assert conv["routing_decisions"]["chosen"] >= 4, conv
    segments = conv["rendering"]["segments"][MODEL]
    assert segments["first_seen"] >= 4 and segments["hits"] >= 1, conv["rendering"]
    assert segments["opaque"] == 0 and segments["mismatched"] == 0, conv["rendering"]
    cached = conv["cached_tokens"]
    assert cached["requests"] >= 3, cached
    # Predicted and delivered agree to within one chunk (about 1 KiB of text) a request.
    assert abs(cached["predicted_tokens"] - cached["reported_tokens"]) <= 300 * cached["requests"]
