"""Micro-benchmark: one CHWBL pick on the prefix-routing ring.

8 backends x 150 virtual nodes (1,200 points), random prefix digests, and in-flight
counts that put some backends at the load cap so bounded lookups really walk clockwise
past them (``overflow``). Baseline: a bare ``bisect.bisect_left`` on the same sorted
point list, which every ring lookup pays; the ratio is what the bounded walk adds.
Target: at most 5 us per bounded pick (median).

Run: ``.venv/bin/python -m bench.ring_bench [--backends 8] [--vnodes 150] [--json F]``
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import random
import sys
from bisect import bisect_left
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from router.selection.ring import HashRing, key_position, point_position
from router.selection.strategies import PrefixAwareHash, SelectionContext

from ._table import fmt_float, median, paired_ratio, render_table, time_interleaved, verdict

TARGET_US = 5.0
EPSILON = 0.25


@dataclass(slots=True)
class Member:
    """What the ring needs of a backend (``RingMember``)."""

    name: str
    index: int
    in_flight: int = 0


def _cap(loads: Sequence[int]) -> int:
    return math.ceil((1 + EPSILON) * (sum(loads) + 1) / len(loads))


def _with_hot(rest: list[int], k: int) -> list[int] | None:
    """``rest`` with ``k`` evenly spread backends raised to the load cap (None: impossible)."""
    n = len(rest)
    hot = [i * n // k for i in range(k)]
    for c in range(1, 100_000):
        loads = [c if i in hot else f for i, f in enumerate(rest)]
        if c >= _cap(loads):
            return loads
    return None


def load_profiles(n: int) -> dict[str, list[int]]:
    """In-flight counts per backend for ``n`` backends.

    * ``balanced``: everyone below the cap, so the owner always wins (no walk).
    * ``hot``: a quarter of the backends (at least one) at the cap
      ``ceil((1 + eps) * (total + 1) / n)``, the rest moderately loaded.
    * ``saturated``: as many backends at the cap as the formula allows (fewer than
      ``n / (1 + eps)``), the rest nearly idle: the longest clockwise walks.
    """
    balanced = [8 + (i % 3) for i in range(n)]
    hot = _with_hot([6 + (i % 4) for i in range(n)], max(1, n // 4))
    assert hot is not None
    saturated = None
    for k in range(n - 1, 0, -1):
        saturated = _with_hot([1] * n, k)
        if saturated is not None:
            break
    assert saturated is not None
    return {"balanced": balanced, "hot": hot, "saturated": saturated}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.ring_bench", description=__doc__)
    p.add_argument("--backends", type=int, default=8)
    p.add_argument("--vnodes", type=int, default=150)
    p.add_argument("--keys", type=int, default=4096, help="distinct random prefix digests")
    p.add_argument("--loops", type=int, default=50_000, help="calls per repeat")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    args = p.parse_args(argv)

    rng = random.Random(args.seed)
    profiles = load_profiles(args.backends)
    # One member set and ring per load profile (rings are built from names alone, so they
    # are identical): the in-flight counts never change while timing, nothing is shared.
    fleets: dict[str, tuple[list[Member], HashRing]] = {}
    for prof, loads in profiles.items():
        ms = [Member(f"backend-{i}", i, f) for i, f in enumerate(loads)]
        fleets[prof] = (ms, HashRing(ms, args.vnodes))
    members, ring = fleets["balanced"]
    # The same sorted point list, built independently (no private attribute access).
    points = sorted(point_position(m.name, i) for m in members for i in range(args.vnodes))
    assert len(points) == len(ring)
    digests = [rng.randbytes(32) for _ in range(args.keys)]
    positions = [key_position(d) for d in digests]
    all_mask = (1 << args.backends) - 1
    hot_members, hot_ring = fleets["hot"]
    # Two backends out (unhealthy / other model): their points are skipped by the walk.
    excluded = (1, 5) if args.backends > 5 else ()
    subset = [m for m in hot_members if m.index not in excluded]
    subset_mask = sum(1 << m.index for m in subset)

    def cycle(seq: list[Any]) -> Callable[[], Any]:
        return itertools.cycle(seq).__next__

    # Decision mix per profile (over every key once), reported beside the timings.
    mixes: dict[str, Counter[str]] = {
        prof: Counter(r.bounded(pos, ms, all_mask, EPSILON)[1] for pos in positions)
        for prof, (ms, r) in fleets.items()
    }

    strategy = PrefixAwareHash(hot_ring, EPSILON)
    contexts = [SelectionContext("m", d) for d in digests]

    # Factories, so every callable cycles its own iterator and pays one call level only.
    def f_bisect() -> Callable[[], Any]:
        nxt = cycle(positions)
        return lambda: bisect_left(points, nxt())

    def f_key_position() -> Callable[[], Any]:
        nxt = cycle(digests)
        return lambda: key_position(nxt())

    def f_owner() -> Callable[[], Any]:
        nxt = cycle(positions)
        return lambda: ring.owner(nxt(), all_mask)

    def f_bounded(r: HashRing, cands: list[Member], mask: int) -> Callable[[], Any]:
        nxt = cycle(positions)
        return lambda: r.bounded(nxt(), cands, mask, EPSILON)

    def f_key_bounded() -> Callable[[], Any]:
        nxt = cycle(digests)
        return lambda: hot_ring.bounded(key_position(nxt()), hot_members, all_mask, EPSILON)

    def f_select() -> Callable[[], Any]:
        nxt = cycle(contexts)
        return lambda: strategy.select(hot_members, all_mask, nxt())  # type: ignore[arg-type]

    # (label, callable, judged against the target)
    cases: list[tuple[str, Callable[[], Any], bool]] = [
        ("baseline: bisect_left(points, pos)", f_bisect(), False),
        ("key_position(digest)", f_key_position(), False),
        ("owner(pos, mask) unbounded", f_owner(), False),
        *(
            (f"bounded, {prof} loads", f_bounded(r, ms, all_mask), True)
            for prof, (ms, r) in fleets.items()
        ),
        (
            f"bounded, hot loads, {len(subset)}/{args.backends} candidates",
            f_bounded(hot_ring, subset, subset_mask),
            True,
        ),
        ("key_position + bounded, hot loads", f_key_bounded(), True),
        ("PrefixAwareHash.select, hot loads", f_select(), True),
    ]

    timings = time_interleaved([fn for _, fn, _ in cases], loops=args.loops, repeats=args.repeats)
    base = timings[0]
    results: list[dict[str, Any]] = []
    for (label, _, judged), per in zip(cases, timings, strict=True):
        med = median(per) * 1e6
        results.append(
            {
                "case": label,
                "median_us": med,
                "min_us": min(per) * 1e6,
                "max_us": max(per) * 1e6,
                "ratio": paired_ratio(per, base),
                "pass": (med <= TARGET_US) if judged else None,
            }
        )

    print(
        f"CHWBL ring: {args.backends} backends x {args.vnodes} vnodes = {len(ring)} points, "
        f"epsilon {EPSILON}, {args.keys} random digests; thread CPU time, median of "
        f"{args.repeats} interleaved repeats x {args.loops} calls; target <= {TARGET_US:g} us/pick"
    )
    for prof, loads in profiles.items():
        mix = mixes[prof]
        total = sum(mix.values())
        cap = _cap(loads)
        print(
            f"  {prof:<9} in_flight={loads} cap={cap}: "
            f"prefix_hash {mix['prefix_hash'] / total:.0%}, overflow {mix['overflow'] / total:.0%}"
        )
    print()
    rows = [
        [
            r["case"],
            fmt_float(r["median_us"], 3),
            fmt_float(r["min_us"], 3),
            fmt_float(r["max_us"], 3),
            fmt_float(r["ratio"], 2) + "x",
            verdict(r["pass"]),
        ]
        for r in results
    ]
    print(render_table(["case", "us/call", "min", "max", "vs bisect", f"<={TARGET_US:g}us"], rows))
    judged_rows = [r for r in results if r["pass"] is not None]
    worst = max(judged_rows, key=lambda r: r["median_us"])
    print(
        f"\nworst judged case: {worst['case']}: {worst['median_us']:.3f} us/pick "
        f"({worst['ratio']:.2f}x bisect) -> {verdict(all(r['pass'] for r in judged_rows))}"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "target_us": TARGET_US,
                    "backends": args.backends,
                    "vnodes": args.vnodes,
                    "profiles": profiles,
                    "decision_mix": {k: dict(v) for k, v in mixes.items()},
                    "results": results,
                },
                f,
                indent=2,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
