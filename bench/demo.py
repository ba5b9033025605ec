"""``make run``: the router on its embedded default config, in front of simulated engines.

Starts a fleet of simulated engines (Qwen2 tokenizer and ChatML template, block-level
prefix caches, modelled prefill time, KV events published over ZMQ in vLLM's format)
and the real ``continuum-kv-listener`` subscribed to all of them, then for each
selection strategy starts the real router process on ``deploy/demo.yaml``
with the fleet as its backends, drives the same multi-tenant multi-turn workload through
it, and prints how requests were distributed and what prefix-cache hit rate the engines
saw. Each engine's cache holds only a share of all tenants' prompts, so a strategy that
scatters a tenant over the fleet makes every engine thrash, while prefix-aware routing
keeps each tenant's prefix warm on one engine. After each run the listener's view of
the fleet (prefix keys recovered from the engines' KV events) is printed too.

The listener reaches the routers in push mode by default, the way a cross-network
deployment runs: it dials each router's event bus over TLS with an mTLS client
certificate (a CA, server and client certificates are made on the fly into the temporary
folder with ``certs``), and the routers' KV index sources use ``transport: event_bus``.
``--transport pull`` makes the routers pull ``GET /events/{backend}`` instead.

Afterwards the PrefixAwareHash router keeps serving on http://127.0.0.1:8080 until Ctrl-C
(``--once`` exits instead).

``--routers N`` (``make run-multi``: 2) runs N routers sharing one Redis instead
(``bench/demo_multi.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import os
import random
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from bench._fleet import (
    MODEL,
    ListenerProcess,
    PushMode,
    RouterProcess,
    demo_fleet,
    kv_consumers_connected,
    listener_cleared,
    listener_config,
    listener_connected,
    listener_conversation,
    router_config,
    router_conversation,
    routes_conversation,
)
from bench._plot import bar_chart_svg
from bench.demo_multi import run_multi
from bus.events import KvEvent
from bus.sse import SseParser
from harness.procs import Service, free_port
from harness.sim.fleet import SimFleet

ROOT = Path(__file__).resolve().parents[1]
DEMO_CONFIG = ROOT / "deploy" / "demo.yaml"
# (label, selection_strategy, index): "kv" rows route with Tier 4, fed by the listener
# from the engines' real KV events, ahead of the strategy; the "conv" row with the
# conversation-depth index as well (shown when the listener and router support it).
STRATEGIES: tuple[tuple[str, str, str], ...] = (
    ("RoundRobin", "RoundRobin", ""),
    ("LeastLatency", "LeastLatency", ""),
    ("Random", "Random", ""),
    ("ConsistentHash", "ConsistentHash", ""),
    ("PrefixAwareHash", "PrefixAwareHash", ""),
    ("RoundRobin+KV", "RoundRobin", "kv"),
    ("PrefixAware+KV", "PrefixAwareHash", "kv"),
    ("PrefixAware+Conv", "PrefixAwareHash", "conv"),
)

_TOPICS = (
    "billing", "travel", "law", "medicine", "chemistry", "poetry", "cooking", "finance",
    "gardening", "astronomy", "history", "music", "sports", "security", "databases", "retail",
    "insurance", "logistics", "gaming", "robotics", "education", "weather", "fitness", "art",
)  # fmt: skip


@dataclass
class Tenant:
    name: str
    system: str


def make_tenants(n: int, rng: random.Random) -> list[Tenant]:
    """Each tenant has a long, distinct system prompt (~300 words, ~25 KV blocks)."""
    out = []
    for i in range(n):
        topic = _TOPICS[i % len(_TOPICS)]
        words = [f"{topic}-{rng.randrange(10_000)}" for _ in range(300)]
        system = f"You are the {topic} assistant of tenant {i}. Policies: " + " ".join(words)
        out.append(Tenant(f"tenant-{i}", system))
    return out


def conversation(tenant: Tenant, session: int, turns: int) -> list[list[dict[str, str]]]:
    """The message lists of one multi-turn session: each turn extends the previous one."""
    msgs: list[dict[str, str]] = [{"role": "system", "content": tenant.system}]
    out = []
    for t in range(turns):
        msgs = [*msgs, {"role": "user", "content": f"session {session} question {t} please"}]
        out.append(msgs)
        msgs = [*msgs, {"role": "assistant", "content": f"answer {t} for session {session}"}]
    return out


def workload(tenants: list[Tenant], sessions: int, turns: int, seed: int) -> list[list[dict]]:
    rng = random.Random(seed)
    convs = [conversation(rng.choice(tenants), s, turns) for s in range(sessions)]
    # Interleave sessions the way concurrent users do, keeping each session's order.
    order: list[list[dict]] = []
    cursors = [0] * len(convs)
    live = list(range(len(convs)))
    while live:
        i = rng.choice(live)
        order.append(convs[i][cursors[i]])
        cursors[i] += 1
        if cursors[i] == len(convs[i]):
            live.remove(i)
    return order


async def listener_view(listener: Service, names: list[str]) -> dict[str, set[str]]:
    """Prefix keys the listener currently attributes to each engine (its SSE snapshot)."""
    view: dict[str, set[str]] = {}
    async with aiohttp.ClientSession() as session:
        for name in names:
            keys: set[str] = set()
            parser = SseParser()
            async with session.get(f"{listener.url}/events/{name}") as resp:
                try:
                    while True:
                        chunk = await asyncio.wait_for(resp.content.readany(), 0.3)
                        if not chunk:
                            break
                        for rec in parser.feed(chunk):
                            if rec.event == "cache_created":
                                keys.add(KvEvent.from_json(rec.data).prefix_hash or "")
                except TimeoutError:
                    pass
            view[name] = keys
    return view


async def drive(url: str, requests: list[list[dict]], concurrency: int) -> collections.Counter:
    """Send every request (sessions in order), return requests per backend."""
    per_backend: collections.Counter[str] = collections.Counter()
    queue: asyncio.Queue[list[dict]] = asyncio.Queue()
    for r in requests:
        queue.put_nowait(r)
    done = 0

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal done
        while not queue.empty():
            messages = queue.get_nowait()
            body = {"model": MODEL, "messages": messages, "max_tokens": 16}
            async with session.post(url + "/v1/chat/completions", json=body) as resp:
                await resp.read()
                per_backend[resp.headers.get("x-continuum-backend", f"HTTP {resp.status}")] += 1
            done += 1
            if done % 100 == 0:
                print(".", end="", flush=True)

    async with aiohttp.ClientSession() as session:
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
    print(" ", end="")
    return per_backend


async def overflow_rate(url: str) -> str:
    async with aiohttp.ClientSession() as session:
        async with session.get(url + "/admin/prefix-routing/stats") as resp:
            stats = await resp.json()
    return (
        stats["routing_decisions"]["overflow_rate"] if stats["routing_decisions"]["total"] else "-"
    )


async def kv_stats(router: Service) -> dict[str, Any]:
    """The router's ``/admin/kv-index/stats`` document."""
    async with aiohttp.ClientSession() as session:
        async with session.get(router.url + "/admin/kv-index/stats") as resp:
            doc: dict[str, Any] = await resp.json()
    return doc


def capped_rate(stats: dict[str, Any]) -> str:
    """The conversation scorer's share of decisions where every backend holding the most
    of the chain was at the load cap, so one holding less took the request (its
    ``overflow``), from ``kv_stats``."""
    d = stats.get("conversation", {}).get("routing_decisions", {})
    return f"{d['capped'] / d['total']:.4f}" if d.get("total") else "-"


def prompt_kinds(stats: dict[str, Any]) -> str | None:
    """How the conversation scorer judged the prompts it saw (``conversation.prompts``
    from ``kv_stats``): one-shot and small-turn prompts stay on their home engine."""
    p = stats.get("conversation", {}).get("prompts")
    if not p:
        return None
    return (
        f"{p['tracked']} prompts seen, {p['small_turns']} of small turns and "
        f"{p['one_shot']} one-shot (kept on their home engine while under the wider cap)"
    )


def kv_split(stats: dict[str, Any]) -> str:
    """Tier 4's kv_aware/fallback decisions, from ``kv_stats``."""
    if not stats.get("enabled"):
        return "-"
    d = stats["routing_decisions"]
    return f"{d['kv_aware']}/{d['fallback']}"


async def main(args: argparse.Namespace) -> int:
    base = yaml.safe_load(DEMO_CONFIG.read_text())
    rng = random.Random(args.seed)
    tenants = make_tenants(args.tenants, rng)
    requests = workload(tenants, args.sessions, args.turns, args.seed)
    if args.routers > 1:
        return await run_multi(args, requests, requests[:120])
    print(
        f"Continuum demo: {args.engines} simulated engines "
        f"(prefix cache {args.capacity_blocks} blocks each), {args.tenants} tenants, "
        f"{args.sessions} sessions x {args.turns} turns = {len(requests)} requests\n"
    )
    rows = []
    views: list[tuple[str, dict[str, set[str]]]] = []
    kinds: str | None = None
    zmq_ports = [free_port() for _ in range(args.engines)]
    async with (
        demo_fleet(args.engines, args.capacity_blocks, zmq_ports) as fleet,
        contextlib.AsyncExitStack() as stack,
    ):
        tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="continuum-demo-"))
        push = PushMode.make(Path(tmp)) if args.transport == "push" else None
        print(
            "  KV events: listener -> router "
            + (
                f"push over the event bus (TLS + mTLS, port {push.bus_port})\n"
                if push is not None
                else "pull (SSE GET /events/{backend})\n"
            )
        )
        # Conversation-depth routing where this tree's listener and router support it.
        conv_listener = listener_config(fleet, zmq_ports, push, conversation=True)
        why_not = await listener_conversation(conv_listener)
        probe = router_config(base, fleet, "PrefixAwareHash", 0, "http://127.0.0.1:1", push, True)
        why_not_router = await router_conversation(probe)
        listener = await stack.enter_async_context(
            ListenerProcess(
                conv_listener if why_not is None else listener_config(fleet, zmq_ports, push),
                Path(tmp),
            )
        )
        why_not = why_not or why_not_router
        await listener_connected(listener, fleet)
        for label, strategy, index in STRATEGIES:
            print(f"  {label:<16} ", end="", flush=True)
            if index == "conv" and why_not is not None:
                print(f"not available ({why_not})")
                continue
            await fleet.reset()
            await listener_cleared(listener, fleet.names)
            cfg = router_config(
                base, fleet, strategy, 0, listener.url if index else None, push, index == "conv"
            )
            t0 = time.perf_counter()
            async with RouterProcess(cfg, Path(tmp)) as router:
                if index:
                    await kv_consumers_connected(router, fleet.names)
                if index == "conv" and (reason := await routes_conversation(router)) is not None:
                    print(f"not available ({reason})")
                    continue
                dist = await drive(router.url, requests, args.concurrency)
                kv = await kv_stats(router)
                if index == "conv":
                    overflow = capped_rate(kv)
                    kinds = prompt_kinds(kv)
                else:
                    overflow = await overflow_rate(router.url)
                split = kv_split(kv)
            elapsed = time.perf_counter() - t0
            stats = await fleet.stats()
            prompt = sum(s["prompt_tokens"] for s in stats)
            cached = sum(s["cached_tokens"] for s in stats)
            prefill = sum(s["prefill_seconds_modelled"] for s in stats)
            view = await listener_view(listener, fleet.names)
            rows.append(
                (label, dist, cached / prompt if prompt else 0.0, prefill, elapsed, overflow, split)
            )
            views.append((label, view))
            print(f"done in {elapsed:.1f}s")
        print_table(rows, fleet.names, len(requests))
        if kinds is not None:
            print(f"  PrefixAware+Conv: {kinds}.")
        print_listener_table(views, fleet.names, len(tenants))
        base_prefill = rows[0][3] or 1.0
        svg = bar_chart_svg(
            ROOT / "bench" / "out" / "demo_hit_rate.svg",
            "Simulated fleet: prefix-cache token hit rate and modelled prefill (vs RoundRobin)",
            [
                ("token hit rate", [r[2] for r in rows]),
                ("prefill time / RoundRobin", [r[3] / base_prefill for r in rows]),
            ],
            [r[0] for r in rows],
        )
        print(f"\n  plot: {svg.relative_to(ROOT)}")
        await response_cache_demo(base, fleet, Path(tmp), requests[:120], args.concurrency)
        await gemini_cache_demo(Path(tmp), args.concurrency)
        if args.once:
            return 0
        cfg = router_config(base, fleet, "PrefixAwareHash", args.port, listener.url, push)
        async with RouterProcess(cfg, Path(tmp)) as router:
            print(
                f"\nThe router is serving on {router.url} (PrefixAwareHash + KV index, "
                f"{args.engines} simulated engines). Try:\n"
                f"  curl -s {router.url}/v1/chat/completions -H 'content-type: "
                f'application/json\' -d \'{{"model":"{MODEL}","messages":'
                f'[{{"role":"user","content":"hi"}}]}}\'\n'
                f"  curl -s {router.url}/admin/prefix-routing/stats\n"
                f"  curl -s {router.url}/admin/kv-index/stats\n"
                f"  curl -s {listener.url}/stats   # the listener\n"
                f"  curl -s {router.url}/metrics\n"
                "Press Ctrl-C to stop."
            )
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, stop.set)
            await stop.wait()
    return 0


def print_table(rows: list[tuple], names: list[str], total: int) -> None:
    print()
    head = f"  {'strategy':<16} {'prefix-cache hit rate':>22} {'modelled prefill':>17} "
    head += f"{'overflow':>9} {'kv_aware/fallback':>18}  "
    head += "  ".join(f"{n:>9}" for n in names)
    print(head)
    print("  " + "-" * (len(head) - 2))
    base_prefill = rows[0][3] or 1.0
    for strategy, dist, hit, prefill, _, overflow, split in rows:
        shares = "  ".join(f"{100 * dist.get(n, 0) / total:>8.1f}%" for n in names)
        print(
            f"  {strategy:<16} {100 * hit:>21.1f}% {prefill:>10.2f}s "
            f"({prefill / base_prefill:>4.2f}x) {overflow:>9} {split:>18}  {shares}"
        )
    print(
        "\n  hit rate = cached prompt tokens / prompt tokens over all engines; prefill time "
        "is the engines' modelled GPU prefill\n  (ratio vs RoundRobin); overflow = share of "
        "PrefixAwareHash picks sent past a loaded owner (+Conv: of the conversation scorer's\n"
        "  decisions, those where the engines holding the most were all at the load cap);\n"
        "  kv_aware/fallback = requests the "
        "KV index scorer routed / left to the strategy (+KV rows: Tier 4 fed by the listener);"
        "\n  the right-hand columns are each engine's share of requests."
    )


async def x_cache_counts(
    url: str, requests: list[list[dict]], concurrency: int, extra: dict[str, Any]
) -> collections.Counter[str]:
    """Send every request once; count the X-Cache header values."""
    counts: collections.Counter[str] = collections.Counter()
    queue: asyncio.Queue[list[dict]] = asyncio.Queue()
    for r in requests:
        queue.put_nowait(r)

    async def worker(session: aiohttp.ClientSession) -> None:
        while not queue.empty():
            messages = queue.get_nowait()
            body = {"model": MODEL, "messages": messages, "max_tokens": 16, **extra}
            async with session.post(url + "/v1/chat/completions", json=body) as resp:
                await resp.read()
                counts[resp.headers.get("x-cache", "none")] += 1

    async with aiohttp.ClientSession(headers={"authorization": "Bearer demo-tenant"}) as s:
        await asyncio.gather(*(worker(s) for _ in range(concurrency)))
    return counts


async def response_cache_demo(
    base: dict[str, Any],
    fleet: SimFleet,
    tmp: Path,
    requests: list[list[dict]],
    concurrency: int,
) -> None:
    """Tier 2 (and Tier 3 with REDIS_URL): deterministic requests repeated.

    Without REDIS_URL one router caches in memory; with it, two router processes share
    one Redis cache, and the second pass goes to the other router.
    """
    redis_url = os.environ.get("REDIS_URL")
    rc: dict[str, Any] = {"enabled": True, "capacity": 10_000, "ttl": "10m"}
    if redis_url:
        rc |= {"backend": "redis", "redis": {"url": redis_url, "key_prefix": "cr:demo:"}}
    cfg = router_config(base, fleet, "PrefixAwareHash", 0)
    cfg["response_cache"] = rc
    mode = "Redis shared by two routers" if redis_url else "memory, one router"
    print(f"\n  Response cache ({mode}): {len(requests)} deterministic requests, twice;")
    print("  then the same requests at temperature 0.7 (not cacheable).")
    for sub in ("a", "b"):
        (tmp / sub).mkdir(exist_ok=True)
    async with contextlib.AsyncExitStack() as stack:
        first = await stack.enter_async_context(RouterProcess(cfg, tmp / "a"))
        second = first
        if redis_url:
            second = await stack.enter_async_context(RouterProcess(cfg, tmp / "b"))
        passes = [
            ("first pass", first.url, {}),
            ("second pass" + (" (other router)" if redis_url else ""), second.url, {}),
            ("temperature 0.7", first.url, {"temperature": 0.7}),
        ]
        for i, (label, url, extra) in enumerate(passes):
            if i == 1:
                await asyncio.sleep(0.2)  # write-backs are asynchronous
            c = await x_cache_counts(url, requests, concurrency, extra)
            print(
                f"    {label:<28} HIT {c.get('HIT', 0):>4}   MISS {c.get('MISS', 0):>4}   "
                f"BYPASS {c.get('BYPASS', 0):>4}"
            )
        if redis_url:
            async with aiohttp.ClientSession() as session:
                await session.post(
                    first.url + "/admin/response-cache/invalidate", json={"clear_all": True}
                )


GEMINI = "gemini-2.5-flash"


async def gemini_cache_demo(tmp: Path, concurrency: int) -> None:
    """Gemini context cache against the API simulator: large system prompts reused.

    The same 60 chat completions (3 system prompts of about 32 KiB, 20 questions each)
    through a router with the cache off, then on: what is sent upstream, and how the
    prompt tokens split into fresh and cached input. Cached tokens are billed as storage
    per token-hour instead; the last column is the most the created resources can hold.
    """
    import orjson

    from harness.gemini_sim import GeminiSim

    prompts = [
        f"You are the {topic} desk of a large company. " + f"Policy clause on {topic}. " * 1200
        for topic in ("billing", "travel", "security")
    ]
    work = [(prompts[i % 3], f"question {i}") for i in range(60)]
    print(f"\n  Gemini context cache (API simulator): {len(work)} requests, 3 system prompts")
    print(
        f"    {'':<10} {'hits':>5} {'creates':>8} {'upstream MiB':>13} {'prompt tok':>11} "
        f"{'cached tok':>11} {'fresh input':>12} {'token-hours':>12}"
    )
    async with GeminiSim(min_cache_tokens=2048) as sim:
        for label, enabled in (("cache off", False), ("cache on", True)):
            sim.log.clear()
            backend = {"name": "gemini", "url": sim.url, "type": "gemini", "models": [GEMINI]}
            cfg = {
                "server": {"listen": "127.0.0.1:0"},
                "backends": [backend],
                "gemini_context_cache": {"enabled": enabled, "ttl": "5m"},
            }
            workdir = tmp / f"gemini-{enabled}"
            workdir.mkdir(exist_ok=True)
            async with RouterProcess(cfg, workdir) as router:
                prompt, cached = await _gemini_pass(router.url, work, concurrency)
                async with (
                    aiohttp.ClientSession() as s,
                    s.get(router.url + "/admin/gemini-context-cache/stats") as resp,
                ):
                    counters = (await resp.json())["counters"]
            sent = sum(
                len(orjson.dumps(r["body"]))
                for r in sim.log
                if r["path"].startswith("/v1beta/openai/")
            )
            held = sum(res.tokens for res in sim.resources.values()) * 300 / 3600
            print(
                f"    {label:<10} {counters['hit']:>5} {counters['creates']:>8} "
                f"{sent / 2**20:>13.2f} {prompt:>11} {cached:>11} {prompt - cached:>12} "
                f"{held:>12.0f}"
            )
            sim.resources.clear()


async def _gemini_pass(url: str, work: list[tuple[str, str]], concurrency: int) -> tuple[int, int]:
    """Send every (system, question) once; sum the prompt and cached tokens of the usage."""
    queue = list(work)
    totals = [0, 0]

    async def worker(session: aiohttp.ClientSession) -> None:
        while queue:
            system, question = queue.pop(0)
            body = {
                "model": GEMINI,
                "messages": [
                    {"role": "system", "content": system},
                    {"role": "user", "content": question},
                ],
            }
            async with session.post(url + "/v1/chat/completions", json=body) as resp:
                usage = (await resp.json())["usage"]
            totals[0] += usage["prompt_tokens"]
            totals[1] += (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)

    async with aiohttp.ClientSession() as session:
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
    return totals[0], totals[1]


def print_listener_table(
    views: list[tuple[str, dict[str, set[str]]]], names: list[str], tenants: int
) -> None:
    """What continuum-kv-listener attributed from the engines' real KV events."""
    print(
        "\n  The listener's view (prefix keys recovered from the engines' KV events, after "
        "each run):"
    )
    head = f"  {'strategy':<16} {'distinct prefixes':>18} {'engines per prefix':>19}  "
    head += "  ".join(f"{n:>9}" for n in names)
    print(head)
    print("  " + "-" * (len(head) - 2))
    for strategy, view in views:
        distinct = set().union(*view.values()) if view else set()
        copies = sum(len(v) for v in view.values())
        per = copies / len(distinct) if distinct else 0.0
        cols = "  ".join(f"{len(view.get(n, ())):>9}" for n in names)
        print(f"  {strategy:<16} {len(distinct):>18} {per:>19.2f}  {cols}")
    print(
        f"\n  {tenants} tenants share system prompts; 'engines per prefix' is how many engines "
        "hold a copy of the same prefix\n  (1.0 = each prefix cached once in the fleet). The "
        "per-engine columns count the prefixes each engine holds."
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--engines", type=int, default=4)
    p.add_argument("--tenants", type=int, default=24)
    p.add_argument("--sessions", type=int, default=160)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--capacity-blocks", type=int, default=700)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--port", type=int, default=int(os.environ.get("CONTINUUM_DEMO_PORT", "8080")))
    p.add_argument("--once", action="store_true", help="exit after the comparison")
    p.add_argument(
        "--transport",
        choices=("push", "pull"),
        default="push",
        help="listener -> router: push over the TLS+mTLS event bus (default) or SSE pull",
    )
    p.add_argument(
        "--routers",
        type=int,
        default=1,
        choices=range(1, 9),
        metavar="N",
        help="N > 1: N routers sharing one Redis (cache and KV index) instead of the "
        "strategy comparison (bench/demo_multi.py); make run-multi is --routers 2",
    )
    p.add_argument(
        "--redis-url",
        default=None,
        help="with --routers: the Redis to share (e.g. redis://127.0.0.1:6379/0); "
        "default: a redis-server the demo starts",
    )
    return p.parse_args(argv)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(asyncio.run(main(parse_args())))
