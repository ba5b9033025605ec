"""Shared helpers for the micro- and proxy benchmarks: timing, medians and a plain table.

Benchmarks on a small, shared machine are noisy, so every figure is a median over repeats
and every target is judged against a baseline measured in the same run.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from math import comb
from typing import Any

__all__ = [
    "fmt_float",
    "median",
    "median_interval",
    "paired_ratio",
    "render_table",
    "time_interleaved",
    "verdict",
]


def median(values: Iterable[float]) -> float:
    """Median of ``values``; NaN for an empty sequence (a cell that never ran)."""
    vals = [v for v in values if v == v]  # drop NaN
    if not vals:
        return float("nan")
    return float(statistics.median(vals))


def time_interleaved(
    fns: Sequence[Callable[[], Any]],
    *,
    loops: int,
    repeats: int = 7,
    warmup: int = 1000,
    clock: Callable[[], float] = time.thread_time,
) -> list[list[float]]:
    """Seconds per call of every ``fn``: ``repeats`` batches of ``loops`` calls each.

    timeit-style (garbage collector off while timing; the loop and call overhead is *not*
    subtracted, so a baseline measured the same way carries the same overhead), with two
    changes for a shared, noisy machine:

    * the repeats are interleaved: round ``r`` times every function once, so a burst of
      load from elsewhere hits all of them alike and per-round ratios stay paired;
    * the default clock is this thread's CPU time, which does not advance while the
      process is descheduled (wall time would add other tenants' timeslices).

    Returns one list of ``repeats`` timings per function, in the order given.
    """
    for fn in fns:
        for _ in range(warmup):
            fn()
    out: list[list[float]] = [[] for _ in fns]
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        for _ in range(repeats):
            for i, fn in enumerate(fns):
                rng = range(loops)
                t0 = clock()
                for _ in rng:
                    fn()
                out[i].append((clock() - t0) / loops)
    finally:
        if gc_was_enabled:
            gc.enable()
    return out


def paired_ratio(values: Sequence[float], baseline: Sequence[float]) -> float:
    """Median over rounds of ``values[r] / baseline[r]``."""
    return median(v / b for v, b in zip(values, baseline, strict=True) if b > 0)


def median_interval(values: Iterable[float], level: float = 0.95) -> tuple[float, float]:
    """Distribution-free confidence interval of the median: the order statistics
    ``x(k)`` and ``x(n+1-k)`` with ``k`` the largest for which ``P(Binomial(n, 1/2) < k)``
    is at most ``(1 - level) / 2``. Assumes nothing of the distribution (noise on a
    shared machine is skewed). NaNs when there are too few values for ``level``."""
    xs = sorted(values)
    n = len(xs)
    tail = (1.0 - level) / 2
    k = cdf = 0
    while k < n:
        p = comb(n, k) / 2**n
        if cdf + p > tail:
            break
        cdf += p
        k += 1
    if k == 0:
        return float("nan"), float("nan")
    return xs[k - 1], xs[n - k]


def fmt_float(value: float, digits: int = 2) -> str:
    if value != value:  # NaN
        return "-"
    return f"{value:.{digits}f}"


def verdict(ok: bool | None) -> str:
    if ok is None:
        return "-"
    return "PASS" if ok else "MISS"


def render_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], left: int = 1) -> str:
    """Fixed-width table: the first ``left`` columns left-aligned, the others right-aligned."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(row: Sequence[str]) -> str:
        parts = [
            row[i].ljust(widths[i]) if i < left else row[i].rjust(widths[i])
            for i in range(len(row))
        ]
        return "  ".join(parts).rstrip()

    sep = "  ".join("-" * w for w in widths)
    return "\n".join([line(cells[0]), sep, *(line(r) for r in cells[1:])])


def print_results(
    results: Sequence[dict[str, Any]], digits: dict[str, int], json_path: str | None = None
) -> None:
    """The judged-results table shared by the store benchmarks, its verdict line and the
    optional ``--json`` dump. Each result has case, value, unit, min, max, ratio (NaN when
    it has no baseline), target (or None) and pass (None when not judged)."""
    import json

    rows = [
        [
            r["case"],
            fmt_float(r["value"], digits.get(r["unit"], 3)),
            r["unit"],
            fmt_float(r["min"], digits.get(r["unit"], 3)),
            fmt_float(r["max"], digits.get(r["unit"], 3)),
            fmt_float(r["ratio"], 2) + ("x" if r["ratio"] == r["ratio"] else ""),
            r["target"] or "-",
            verdict(r["pass"]),
        ]
        for r in results
    ]
    print(render_table(["case", "median", "unit", "min", "max", "ratio", "target", ""], rows))
    judged = [r for r in results if r["pass"] is not None]
    print(f"\nall targets: {verdict(all(r['pass'] for r in judged))} ({len(judged)} judged)")
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"results": list(results)}, f, indent=2)
