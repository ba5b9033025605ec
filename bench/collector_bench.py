"""What the cyclic garbage collector costs the router per request, at CPython's default
youngest-generation threshold against ``bus.collector``'s.

One ``Router`` in this process (its ``handle``, no HTTP server) in front of 3
``harness.sim --trivial`` engines, 16 requests in flight, the bodies of
``conversation_cost_bench`` (``agent``: agent loops, ``single``: chats), prefix-key and
conversation rows. Both settings freeze the objects alive after start-up, as the router
does; they differ only in the youngest generation's threshold (700: CPython's default;
``YOUNG_THRESHOLD``). Per cell: thread CPU per request and the collector's own time
per request (``gc.callbacks``), medians of interleaved rounds.

Run: ``.venv/bin/python -m bench.collector_bench [--tokens 8000 32000] [--rounds 3]``
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import sys
import time
from collections.abc import Sequence

import uvloop

from bus.collector import YOUNG_THRESHOLD

from ._inproc import CLIENTS, in_process_router, send
from ._table import fmt_float, median, render_table
from .conversation_cost_bench import agent_bodies, conversation_bodies

_HEADERS = {"content-type": "application/json"}


class _CollectorClock:
    def __init__(self) -> None:
        self.seconds = 0.0
        self._start = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._start


async def measure(
    workload: str, tokens: int, conversation: bool, requests: int, rounds: int
) -> dict[int, list[tuple[float, float]]]:
    bodies = (agent_bodies if workload == "agent" else conversation_bodies)(tokens)
    what = f"{workload} {tokens}"
    clock = _CollectorClock()
    out: dict[int, list[tuple[float, float]]] = {700: [], YOUNG_THRESHOLD: []}
    async with in_process_router(conversation) as router:
        _, older, oldest = gc.get_threshold()
        gc.collect()
        gc.freeze()
        gc.callbacks.append(clock)
        try:
            await send(router, bodies, 20, what)
            per = max(1, requests // CLIENTS)
            for rnd in range(rounds):
                order = list(out) if rnd % 2 == 0 else list(out)[::-1]
                for threshold in order:
                    gc.set_threshold(threshold, older, oldest)
                    gc.collect()
                    clock.seconds = 0.0
                    t0 = time.thread_time()
                    await send(router, bodies, per, what)
                    n = per * CLIENTS
                    out[threshold].append(
                        ((time.thread_time() - t0) / n * 1e6, clock.seconds / n * 1e6)
                    )
        finally:
            gc.callbacks.remove(clock)
            gc.unfreeze()
            gc.set_threshold(700, older, oldest)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.collector_bench", description=__doc__)
    p.add_argument("--tokens", type=int, nargs="+", default=[8000, 32000])
    p.add_argument("--workloads", nargs="+", default=["agent", "single"])
    p.add_argument("--requests", type=int, default=640, help="per cell and round")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    uvloop.install()
    rows = []
    for workload in args.workloads:
        for tokens in args.tokens:
            for conversation in (False, True):
                res = asyncio.run(
                    measure(workload, tokens, conversation, args.requests, args.rounds)
                )
                base, tuned = res[700], res[YOUNG_THRESHOLD]
                ratio = median([t[0] / b[0] for b, t in zip(base, tuned, strict=True)])
                rows.append(
                    [
                        workload,
                        str(tokens),
                        "conversation" if conversation else "prefix",
                        fmt_float(median([c for c, _ in base]), 0),
                        fmt_float(median([g for _, g in base]), 1),
                        fmt_float(median([c for c, _ in tuned]), 0),
                        fmt_float(median([g for _, g in tuned]), 1),
                        fmt_float(ratio, 2),
                    ]
                )
                print(f"  {workload} {tokens} {rows[-1][2]}: done", flush=True)
    print(
        f"\nrouter loop CPU per request, {args.rounds} interleaved rounds x {args.requests} "
        f"requests, medians; threshold 700 (CPython) against {YOUNG_THRESHOLD}"
    )
    print(
        render_table(
            [
                "workload",
                "tokens",
                "path",
                "us/req @700",
                "gc us @700",
                f"us/req @{YOUNG_THRESHOLD}",
                f"gc us @{YOUNG_THRESHOLD}",
                "ratio",
            ],
            rows,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
