"""What a fault row measures, how it is compared with the oracle, and the table it prints.

Pure code (no processes), so its arithmetic is unit-tested on its own
(``tests/unit/test_faults_record.py``).

The comparison is over (prefix key, backend) pairs. ``truth`` is what the engines report
they hold (``GET /sim/held-prefixes``), ``index`` what the router's KV index answers for
the same keys (``KvIndex.Query``, a read-only peek):

* **lost**: held by the engine, absent from the index (the router will not route there);
* **stale**: in the index, not held by the engine (the router routes to a cold backend);
  entries the index counts beyond the keys asked about (``entry_count`` minus the pairs
  seen) are stale too: no engine served such a key.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence, Set
from dataclasses import dataclass, field

__all__ = ["Comparison", "RowResult", "combine", "compare", "kinds_note", "p99", "render_table"]

Pairs = Set[tuple[str, str]]


@dataclass(frozen=True, slots=True)
class Comparison:
    lost: frozenset[tuple[str, str]]
    stale: frozenset[tuple[str, str]]
    unexplained: int
    """Index entries outside the keys asked about (counted as stale)."""
    held: int
    indexed: int

    @property
    def lost_count(self) -> int:
        return len(self.lost)

    @property
    def stale_count(self) -> int:
        return len(self.stale) + self.unexplained

    @property
    def clean(self) -> bool:
        return not self.lost and self.stale_count == 0


def compare(truth: Pairs, index: Pairs, index_entry_count: int | None = None) -> Comparison:
    """``truth`` and ``index`` as (key hex, backend) pairs; ``index_entry_count`` the
    index's own total (None: not known)."""
    extra = 0 if index_entry_count is None else max(0, index_entry_count - len(index))
    return Comparison(
        lost=frozenset(truth - index),
        stale=frozenset(index - truth),
        unexplained=extra,
        held=len(truth),
        indexed=len(index),
    )


def combine(kinds: Mapping[str, Comparison]) -> Comparison:
    """One comparison over every kind of key (prefix keys are 64 hex characters, chain
    keys 32: their pairs never collide): the table's columns are the totals."""
    parts = list(kinds.values())
    return Comparison(
        lost=frozenset().union(*(c.lost for c in parts)),
        stale=frozenset().union(*(c.stale for c in parts)),
        unexplained=sum(c.unexplained for c in parts),
        held=sum(c.held for c in parts),
        indexed=sum(c.indexed for c in parts),
    )


def kinds_note(kinds: Mapping[str, Comparison]) -> str:
    """Lost and stale per kind of key, for a row's notes."""
    return "; ".join(
        f"{kind} keys: lost {c.lost_count}, stale {c.stale_count} "
        f"({c.held} pairs held, {c.indexed} indexed)"
        for kind, c in kinds.items()
    )


def pairs(by_backend: Mapping[str, Iterable[str]]) -> set[tuple[str, str]]:
    """``{backend: keys}`` -> (key, backend) pairs."""
    return {(k, b) for b, keys in by_backend.items() for k in keys}


def p99(samples: Sequence[float]) -> float | None:
    """Nearest-rank 99th percentile (None for no samples)."""
    if not samples:
        return None
    ordered = sorted(samples)
    rank = max(1, math.ceil(0.99 * len(ordered)))
    return ordered[rank - 1]


@dataclass
class RowResult:
    """One row of the matrix: the six figures, and what the row honestly measured."""

    row: str
    fault: str
    events_lost: int | None = None
    entries_stale: int | None = None
    duplicates: int | None = None
    requests_failed: int | None = None
    requests_total: int = 0
    #: Failures where no other backend could have served (the router itself was down).
    failed_unavoidable: bool = False
    recover_s: float | None = None
    #: The index matched the oracle only after traffic stopped (not while it ran).
    recovered_after_traffic: bool = False
    p99_added_ms: float | None = None
    #: Lost pairs the row expects (``Row.outage_loss``), not in ``events_lost``.
    lost_expected: int = 0
    notes: list[str] = field(default_factory=list)
    error: str | None = None

    @property
    def verdict(self) -> str:
        """``ok`` when the targets hold (lost 0, stale 0, failures 0 where avoidable)."""
        if self.error is not None:
            return "error"
        bad = []
        if self.events_lost:
            bad.append("lost")
        if self.entries_stale:
            bad.append("stale")
        if self.requests_failed and not self.failed_unavoidable:
            bad.append("failed")
        if self.recover_s is None:
            bad.append("no recovery")
        return "ok" if not bad else "DEFECT: " + ", ".join(bad)


def _n(v: int | None) -> str:
    return "-" if v is None else str(v)


def _lost(r: RowResult) -> str:
    if not r.lost_expected:
        return _n(r.events_lost)
    return f"{(r.events_lost or 0) + r.lost_expected} ({r.lost_expected} expected)"


def _failed(r: RowResult) -> str:
    if r.requests_failed is None:
        return "-"
    s = f"{r.requests_failed}/{r.requests_total}"
    return s + " (no other)" if r.requests_failed and r.failed_unavoidable else s


def _recover(r: RowResult) -> str:
    if r.recover_s is None:
        return "never"
    s = f"{r.recover_s:.2f} s"
    return s + " (idle)" if r.recovered_after_traffic else s


def _p99(r: RowResult) -> str:
    return "-" if r.p99_added_ms is None else f"{r.p99_added_ms:+.0f} ms"


HEADER = (
    "row",
    "fault",
    "lost",
    "stale",
    "dup",
    "failed",
    "recover",
    "p99 added",
    "verdict",
)


def render_table(results: Sequence[RowResult]) -> str:
    """A Markdown table (readable as plain text too), then each row's notes."""
    rows = [
        (
            r.row,
            r.fault,
            _lost(r),
            _n(r.entries_stale),
            _n(r.duplicates),
            _failed(r),
            _recover(r),
            _p99(r),
            r.verdict,
        )
        for r in results
    ]
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(HEADER)]

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"

    out = [line(HEADER), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    out += [line(row) for row in rows]
    notes = [(r.row, n) for r in results for n in ([r.error] if r.error else []) + r.notes]
    if notes:
        out.append("")
        out += [f"* {row}: {note}" for row, note in notes]
    return "\n".join(out) + "\n"
