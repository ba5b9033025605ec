"""Fleet benchmark: an engine evicting through the listener's EvictionAdvisor vs its own LRU.

Real processes: one ``continuum-kv-listener`` (gRPC on a free port; its ``sources`` name
the engines, which is all the advisor needs) and two simulated engines with the same
capacity, ``sim-lru`` (its own LRU order) and ``sim-sae`` (``--eviction-advisor``). Every
request of the workload goes to both, in the same order, so the two caches see exactly
the same traffic; the table compares their token hit rates and modelled prefill time.

Workload (seeded): ShareGPT conversations as multi-turn chat sessions under four shared
system prompts (the whole history re-sent every turn), interleaved with single-turn
requests that share one of eight long instructions and carry a unique query (greedy, a
short output cap; chats keep a default temperature and no cap). Requests are sent back to
back, so the timing the advisor learns is compressed. ``--agents F`` turns that share of
the multi-turn sessions into agent loops (tools declared, 2-6 steps of tool call and
tool result, short gaps). The advised engine types the blocks
it reports from the chat template it renders and sends each request's engine-visible
features (``harness.sim.block_types``), so the advisor routes system prompts to its
structure queue and derives each session's class.

``python -m bench.saecache.fleet [--sessions 300] [--capacity-blocks 1500]``
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp

from bench._table import fmt_float, render_table
from harness.procs import Service
from harness.procs import free_port as _free_port
from harness.sim.fleet import SimFleet

from .trace import read_sharegpt

__all__ = ["main"]

_SYSTEMS = [
    "You are a helpful assistant. Answer precisely and briefly. " * 4,
    "You are a senior engineer. Give working code with short explanations. " * 6,
    "You are a writing tutor. Improve clarity and tone, keep the author's voice. " * 5,
    "You are a careful analyst. State assumptions, then reason step by step. " * 6,
]


# Sampling parameters as each kind of client sends them (what the advisor derives the
# session class from, with the turns in the prompt): a chat UI its default temperature and
# no output cap (the simulator's answers are short without one), a templated batch job
# greedy decoding and a short cap.
_CHAT: dict[str, Any] = {"temperature": 0.7}
_TEMPLATED: dict[str, Any] = {"temperature": 0.0, "max_tokens": 8}


_AGENT: dict[str, Any] = {"temperature": 0.2, "max_tokens": 1024}
_VERBS = "search fetch read write list create update delete query run convert parse".split()
_NOUNS = "file page database record calendar email ticket issue repository order".split()


def _toolset(rng: random.Random, k: int) -> list[dict[str, Any]]:
    return [
        {
            "type": "function",
            "function": {
                "name": f"{rng.choice(_VERBS)}_{rng.choice(_NOUNS)}_{k}_{i}",
                "description": " ".join(rng.choice(_NOUNS + _VERBS) for _ in range(16)),
                "parameters": {
                    "type": "object",
                    "properties": {
                        f"{rng.choice(_NOUNS)}_{j}": {"type": "string"} for j in range(3)
                    },
                },
            },
        }
        for i in range(rng.randint(6, 12))
    ]


def _agent(
    arng: random.Random, sid: int, t: float, task: str, toolsets: list[list[dict[str, Any]]]
) -> list[tuple[float, int, str, dict[str, Any]]]:
    """An agent loop: tools declared, then 2-6 steps of tool call and tool result."""
    tools = arng.choice(toolsets)
    msgs: list[dict[str, Any]] = [
        {"role": "system", "content": "You are an autonomous agent. Use the tools."},
        {"role": "user", "content": task[:2000]},
    ]
    out = []
    for step in range(arng.randint(2, 6)):
        body = {"model": "demo-model", "messages": msgs, "tools": tools, **_AGENT}
        out.append((t, sid, f"s{sid}", body))
        fn = arng.choice(tools)["function"]["name"]
        call = {
            "id": f"c{sid}_{step}",
            "type": "function",
            "function": {"name": fn, "arguments": "{}"},
        }
        result = " ".join(arng.choice(_NOUNS + _VERBS) for _ in range(arng.randint(40, 200)))
        msgs = [
            *msgs,
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call["id"], "content": result},
        ]
        t += arng.lognormvariate(1.0, 0.8)
    return out


def workload(sessions: int, seed: int, agents: float = 0.0) -> list[tuple[str, dict[str, Any]]]:
    """``(session id, chat body)`` in send order; ``agents``: the share of the multi-turn
    sessions that are agent loops instead of chats (0: the workload of earlier runs)."""
    rng = random.Random(seed)
    arng = random.Random(seed * 31 + 7)
    toolsets = [_toolset(arng, k) for k in range(3)]
    convs = read_sharegpt(sessions)
    instructions = [
        f"Instruction {k}: " + " ".join(rng.choice(_SYSTEMS).split()[:40]) * 3 for k in range(8)
    ]
    timeline: list[tuple[float, int, str, dict[str, Any]]] = []
    t = 0.0
    for sid, conv in enumerate(convs):
        t += rng.expovariate(1.0)
        if rng.random() < 0.3:
            query = conv[0][1][:2000]
            body = {
                "model": "demo-model",
                "messages": [{"role": "user", "content": rng.choice(instructions) + "\n" + query}],
                **_TEMPLATED,
            }
            timeline.append((t, sid, f"s{sid}", body))
            continue
        if arng.random() < agents:
            timeline += _agent(arng, sid, t, conv[0][1], toolsets)
            continue
        system = rng.choice(_SYSTEMS)
        msgs: list[dict[str, Any]] = [{"role": "system", "content": system}]
        tt = t
        for i in range(0, len(conv) - 1, 2):
            msgs = [*msgs, {"role": "user", "content": conv[i][1][:4000]}]
            body = {"model": "demo-model", "messages": msgs, **_CHAT}
            timeline.append((tt, sid, f"s{sid}", body))
            msgs = [*msgs, {"role": "assistant", "content": conv[i + 1][1][:4000]}]
            tt += rng.lognormvariate(3.0, 1.0)
    timeline.sort(key=lambda x: (x[0], x[1]))
    return [(s, b) for _, _, s, b in timeline]


async def run(args: argparse.Namespace) -> int:
    work = workload(args.sessions, args.seed, args.agents)
    grpc_port = _free_port()
    with tempfile.TemporaryDirectory(prefix="saecache-fleet-") as tmp:
        listener = Service(
            "listener",
            ["listener"],
            {
                "listen": "127.0.0.1:0",
                "grpc_listen": f"127.0.0.1:{grpc_port}",
                "sources": [
                    {
                        "backend_name": name,
                        "engine": "vllm",
                        "zmq_endpoint": f"tcp://127.0.0.1:{_free_port()}",
                    }
                    for name in ("sim-lru", "sim-sae")
                ],
            },
            Path(tmp) / "listener.yaml",
        )
        async with listener:
            async with SimFleet(
                2,
                names=["sim-lru", "sim-sae"],
                capacity_blocks=args.capacity_blocks,
                overrides={1: {"eviction_advisor": f"127.0.0.1:{grpc_port}"}},
            ) as fleet:
                urls = [s.url for s in fleet.sims]
                async with aiohttp.ClientSession() as http:
                    for i, (sid, body) in enumerate(work):
                        for url in urls:
                            async with http.post(
                                url + "/v1/chat/completions",
                                json={**body, "user": sid},
                            ) as r:
                                r.raise_for_status()
                                await r.read()
                        if i % 50 == 0:
                            sys.stderr.write(f"\r{i + 1}/{len(work)} requests")
                            sys.stderr.flush()
                    sys.stderr.write("\n")
                    stats = []
                    for url in urls:
                        async with http.get(url + "/sim/stats") as r:
                            stats.append(await r.json())
    rows = [
        [
            s["name"],
            "advisor (SAECache)" if s["name"] == "sim-sae" else "own LRU",
            s["requests"],
            fmt_float(100 * s["hit_rate"], 1),
            fmt_float(s["prefill_seconds_modelled"], 2),
        ]
        for s in stats
    ]
    print(f"\n{len(work)} requests, capacity {args.capacity_blocks} blocks per engine")
    print(
        render_table(
            ["engine", "eviction", "requests", "hit %", "prefill s (modelled)"], rows, left=2
        )
    )
    lru, sae = stats[0]["hit_rate"], stats[1]["hit_rate"]
    print(f"advisor - LRU: {100 * (sae - lru):+.1f} points of token hit rate")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.saecache.fleet", description=__doc__)
    ap.add_argument("--sessions", type=int, default=300)
    ap.add_argument("--capacity-blocks", type=int, default=1500)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument(
        "--agents", type=float, default=0.0, help="share of multi-turn sessions that are agents"
    )
    return asyncio.run(run(ap.parse_args(argv)))


if __name__ == "__main__":
    raise SystemExit(main())
