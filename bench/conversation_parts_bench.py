"""Where the conversation path's router CPU goes, part by part, inside one router.

``conversation_cost_bench`` measures the whole router process under ``wrk``; this bench
splits the difference between its two rows. One ``Router`` in this process (its
``handle``, no HTTP server) in front of 3 ``harness.sim --trivial`` engines, the same
64 multi-turn chats per size, 16 concurrent requests; per mode and round the CPU time of
this thread (the router's event loop: the engines are other processes) per request. The
modes swap one collaborator of the same router object each, interleaved per round:

* ``prefix``: no prompt chain (the chat dialect's renderer off): the prefix-key path;
* ``+ index query``: the chain (``chain()`` memoised per body: rendering left out) and the
  chain index's ``query_many`` + deepest-held scan, the strategy choosing;
* ``+ decide``: and the cost model's choice;
* ``+ predictions``: and predict on route (the chain's keys written as held);
* ``+ feedback``: and the forwarder's ``RoutingFeedback`` (prefill ledger, predicted
  against reported cached tokens, their metrics): all of conversation routing but
  rendering;
* ``conversation``: ``chain()`` per request as well: the full path.

Each row's ``vs prefix`` is paired per round, so a part's cost is the step between two
rows. Thread CPU in a loop shared with the engines' I/O is not the process's whole CPU
(no HTTP server here), so the absolute figures sit below ``conversation_cost_bench``'s.

Run: ``.venv/bin/python -m bench.conversation_parts_bench [--tokens 2000 8000 32000]
[--requests 800] [--rounds 7]``
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Sequence
from typing import Any

import uvloop

from bus.collector import tune_collector
from router.app import Router
from router.kvindex.cost import ChainView, RequestChain
from router.pool import Backend

from ._inproc import CLIENTS, in_process_router, send
from ._table import fmt_float, median, render_table
from .conversation_cost_bench import conversation_bodies

MODES = (
    "prefix",
    "+ index query",
    "+ decide",
    "+ predictions",
    "+ feedback",
    "conversation",
)
_HEADERS = {"content-type": "application/json"}


class _Memo:
    """The chat dialect's renderer with each body's chain computed once."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.chains: dict[str, RequestChain | None] = {}

    def chain(self, body: dict[str, Any], model: str) -> RequestChain | None:
        key = body["messages"][-1]["content"]  # unique per conversation in these bodies
        if key not in self.chains:
            self.chains[key] = self.inner.chain(body, model)
        return self.chains[key]


class _Partial:
    """The conversation scorer with only its first steps: later ones do nothing."""

    def __init__(self, inner: Any, decide: bool) -> None:
        self.inner = inner
        self.decides = decide

    async def assess(self, chain: RequestChain, candidates: Sequence[Backend]) -> ChainView:
        return await self.inner.assess(chain, candidates)

    def decide(self, view: ChainView, candidates: Sequence[Backend]) -> Backend | None:
        return self.inner.decide(view, candidates) if self.decides else None

    async def routed(self, view: ChainView, backend: Backend) -> int:
        return 0


class _Modes:
    """Sets one router up for each mode by swapping collaborators of its objects."""

    def __init__(self, router: Router) -> None:
        self.chat: Any = router._routes[("POST", "/v1/chat/completions")].__self__  # type: ignore[attr-defined]
        self.renderer = self.chat._conversation
        self.memo = _Memo(self.renderer)
        self.selector = router.selector
        self.scorer = self.selector.conversation
        self.forwarder = self.chat._forwarder
        self.feedback = self.forwarder._feedback

    def set(self, mode: str) -> None:
        i = MODES.index(mode)
        self.chat._conversation = (
            None if mode == "prefix" else self.renderer if mode == "conversation" else self.memo
        )
        self.selector.conversation = (
            _Partial(self.scorer, decide=i >= 2) if i in (1, 2) else self.scorer
        )
        self.forwarder._feedback = self.feedback if i >= 4 else None


async def measure(tokens: int, requests: int, rounds: int) -> dict[str, list[float]]:
    bodies = conversation_bodies(tokens)
    what = f"{tokens} tokens"
    async with in_process_router(True) as router:
        modes = _Modes(router)
        per = max(1, requests // CLIENTS)
        for mode in MODES:  # warm-up: every chain held, every path's code run
            modes.set(mode)
            await send(router, bodies, 40, what)
        # the collector as the router process sets it once started (router/serve.py);
        # with CPython's default threshold its passes over the requests in flight cost
        # more than the parts measured (8k chats: the prefix path 144 against 93 us a
        # request, the whole conversation path 321 against 216)
        tune_collector()
        out: dict[str, list[float]] = {m: [] for m in MODES}
        for rnd in range(rounds):
            for mode in MODES if rnd % 2 == 0 else MODES[::-1]:
                modes.set(mode)
                t0 = time.thread_time()
                await send(router, bodies, per, what)
                out[mode].append((time.thread_time() - t0) / (per * CLIENTS) * 1e6)
        modes.set("conversation")
        return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.conversation_parts_bench", description=__doc__
    )
    p.add_argument("--tokens", type=int, nargs="+", default=[2000, 8000, 32000])
    p.add_argument("--requests", type=int, default=800, help="requests per mode and round")
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args(argv)
    uvloop.install()
    for tokens in args.tokens:
        res = asyncio.run(measure(tokens, args.requests, args.rounds))
        base = res["prefix"]
        rows = []
        prev = 0.0
        for mode in MODES:
            step = median([a - b for a, b in zip(res[mode], base, strict=True)])
            rows.append(
                [
                    mode,
                    fmt_float(median(res[mode]), 1),
                    fmt_float(step, 1),
                    "-" if mode == "prefix" else fmt_float(step - prev, 1),
                ]
            )
            prev = step
        print(
            f"\n{tokens} prompt tokens: router loop CPU per request, {args.rounds} rounds x "
            f"{args.requests} requests a mode, medians; vs prefix paired per round"
        )
        print(render_table(["mode", "us/req", "vs prefix", "step"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
