"""Routing quality without KV events: how well one shared prompt stays on one backend.

8 system prompts shared by all requests, 2 simulated engines (modelled prefill time, so
a cold prompt costs more), ``--concurrency`` 32 requests in flight, no listener: the
router knows nothing but what it routed. A good policy sends a
new prompt to the cheaper backend, then keeps it there (its cache is warm there), while
the prompts split evenly between the backends. Rows, real processes, one run:

* ``PrefixAwareHash``: the prefix key on a bounded-load hash ring (the load bound moves
  requests of a busy prompt to the other backend, and they scatter);
* ``Conversation``: PrefixAwareHash with the conversation-depth index and predict on
  route (each routed request's prompt keys count as held by its backend for
  ``predict_ttl_seconds``), and no event source at all.

Figures: per prompt, the share of its requests on its most used backend (the table
shows the lowest and the mean over prompts) and the busiest backend's share of all
requests. Targets (the conversation row): every prompt >= 95 % on one backend, max share
<= 0.55. The conversation row is "not available" while this tree's router does not
support conversation mode (see :mod:`bench._fleet`).

    .venv/bin/python -m bench.affinity_bench        # ~30 s
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import random
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import yaml

from bench._fleet import (
    MODEL,
    RouterProcess,
    router_config,
    router_conversation,
    routes_conversation,
    scoring_arg,
)
from bench._table import render_table, verdict
from harness.procs import ROOT, ChildExited, ChildTimeout
from harness.sim.fleet import SimFleet
from harness.workloads import paragraph, question

BASE_CONFIG = ROOT / "deploy" / "demo.yaml"


@dataclass
class Result:
    row: str
    available: str | None = None
    requests: int = 0
    errors: int = 0
    #: prompt -> backend -> requests
    counts: dict[int, collections.Counter[str]] | None = None

    def shares(self) -> list[float]:
        """Per prompt: the share of its requests on its most used backend."""
        out = []
        for c in (self.counts or {}).values():
            total = sum(c.values())
            out.append(max(c.values()) / total if total else float("nan"))
        return out

    def max_share(self) -> float:
        per: collections.Counter[str] = collections.Counter()
        for c in (self.counts or {}).values():
            per.update(c)
        total = sum(per.values())
        return max(per.values()) / total if total else float("nan")


def requests(prompts: int, n: int, seed: int) -> list[tuple[int, list[dict[str, str]]]]:
    rng = random.Random(seed)
    systems = [f"You are desk {p}. " + paragraph(rng, 400) for p in range(prompts)]
    return [
        (p, [{"role": "system", "content": systems[p]}, {"role": "user", "content": q}])
        for p, q in ((rng.randrange(prompts), question(rng, 20)) for _ in range(n))
    ]


async def drive(url: str, work: list[tuple[int, list[dict[str, str]]]], concurrency: int) -> Result:
    res = Result("", counts=collections.defaultdict(collections.Counter))
    queue = list(reversed(work))

    async def worker(http: aiohttp.ClientSession) -> None:
        while queue:
            prompt, messages = queue.pop()
            body = {"model": MODEL, "messages": messages, "max_tokens": 8}
            async with http.post(url + "/v1/chat/completions", json=body) as resp:
                await resp.read()
                res.requests += 1
                if resp.status != 200:
                    res.errors += 1
                    continue
                assert res.counts is not None
                res.counts[prompt][resp.headers.get("x-continuum-backend", "?")] += 1

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        await asyncio.gather(*(worker(http) for _ in range(concurrency)))
    return res


async def measure(args: argparse.Namespace) -> list[Result]:
    base = yaml.safe_load(BASE_CONFIG.read_text())
    work = requests(args.prompts, args.requests, args.seed)
    results: list[Result] = []
    async with (
        SimFleet(n=2, model=MODEL, names=["backend-a", "backend-b"], latency=True) as fleet,
        contextlib.AsyncExitStack() as stack,
    ):
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="affinity-bench-")))
        rows = (
            ("PrefixAwareHash", router_config(base, fleet, "PrefixAwareHash", 0)),
            # Tier 4 on without any event source: only what the router predicts on route.
            (
                "Conversation",
                router_config(base, fleet, args.strategy, 0, conversation=True),
            ),
        )
        if args.scoring:
            rows[1][1]["kv_cache_index"]["conversation"]["scoring"] = dict(args.scoring)
        for label, cfg in rows:
            print(f"  {label:<16} ", end="", flush=True)
            conv = label == "Conversation"
            if conv and (why := await router_conversation(cfg)) is not None:
                print(f"not available ({why})")
                results.append(Result(label, why))
                continue
            try:
                async with RouterProcess(cfg, tmp, log=tmp / f"{label}.log") as router:
                    if conv and (why := await routes_conversation(router)) is not None:
                        print(f"not available ({why})")
                        results.append(Result(label, why))
                        continue
                    res = await drive(router.url, work, args.concurrency)
            except (ChildExited, ChildTimeout) as exc:
                why = f"router failed: {exc}".splitlines()[0]
                print(why)
                results.append(Result(label, why))
                continue
            res.row = label
            results.append(res)
            print(f"{res.requests} requests" + (f", {res.errors} errors" if res.errors else ""))
    return results


def report(results: Sequence[Result]) -> None:
    rows = []
    for r in results:
        if r.available is not None:
            rows.append([r.row, "not available", "", "", ""])
            continue
        shares = r.shares()
        rows.append(
            [
                r.row,
                f"{100 * min(shares):.1f}%",
                f"{100 * sum(shares) / len(shares):.1f}%",
                f"{r.max_share():.2f}",
                f"{r.requests}" + (f" ({r.errors} err)" if r.errors else ""),
            ]
        )
    headers = ["row", "on one backend (worst prompt)", "(mean)", "max share", "requests"]
    print()
    print(render_table(headers, rows))
    conv = next((r for r in results if r.row == "Conversation" and r.available is None), None)
    ok_share = ok_split = None
    if conv is not None:
        ok_share = min(conv.shares()) >= 0.95
        ok_split = conv.max_share() <= 0.55
    print("\ntargets (Conversation row):")
    print(
        render_table(
            ["target", ""],
            [
                ["every prompt >= 95 % on one backend", verdict(ok_share)],
                ["max backend share <= 0.55", verdict(ok_split)],
            ],
        )
    )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--requests", type=int, default=1600)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument(
        "--strategy",
        default="PrefixAwareHash",
        help="the conversation row's selection_strategy (what places a prompt nobody holds)",
    )
    p.add_argument("--seed", type=int, default=1)
    p.add_argument(
        "--scoring",
        type=scoring_arg,
        default={},
        help="the conversation row's kv_cache_index.conversation.scoring, as k=v,k=v "
        "(e.g. load_factor_epsilon=0.1)",
    )
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    print(
        f"affinity_bench: {args.prompts} shared system prompts, 2 backends, "
        f"{args.requests} requests, concurrency {args.concurrency}, no listener"
    )
    report(asyncio.run(measure(args)))
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
