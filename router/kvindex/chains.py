"""How much of a request's prompt chain each backend holds: its deepest key, by one scan.

A request's chain is ``keys[0..n-1]`` (``bus.prompt_chain``: key ``i`` names every byte of
the rendered prompt up to the end of chunk ``i``). The listener announces a key for a
backend when every token up to its chunk's end is in stored blocks, and withdraws it when
a block at or before that goes, so each backend's keys are prefix-closed: holding key
``i`` means holding the first ``i + 1`` chunks, and that key's ``token_count`` is how many
prompt tokens the backend can reuse.

The query: ONE ``query_many`` of all ``n`` keys (one Redis round trip), then a scan from
the deepest key down, taking for each candidate the first (deepest) key it appears at.
The scan stops as soon as every candidate is found. Measured against a binary search per
backend with memoised per-key lookups (``bench/kvindex_bench.py``, 64 keys, 8 candidates,
3 holders): the search takes about twice as long on the memory index (~7 dependent
lookups per backend, each a coroutine; on Redis as many round trips, where the scan makes
one). The scan is also right where prefix closure is momentarily broken: events refresh
the TTL only of the keys they name, so an old shallow key can expire before a deeper one;
the deepest key present still says how many tokens are held (a key is only ever announced
when everything before it is stored), where a search would stop at the gap.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence

from .base import IndexEntry, StorageTier

__all__ = ["Held", "deepest_held"]


class Held:
    """A backend's deepest key of one chain: ``depth`` keys held (index + 1), and the entry
    of that key (its tokens, tier and expiry).

    From a scan that read every row (:func:`deepest_held` does unless every candidate is
    found before the first row) also ``keys_held``, how many of the chain's keys the
    backend holds, and ``expires_first``, the earliest expiry among them: ``keys_held ==
    depth`` says it holds every key up to its deepest, and then whether any of them
    needs renewing is one comparison (predict on route). Both None when not known."""

    __slots__ = ("depth", "entry", "expires_first", "keys_held")

    def __init__(
        self,
        depth: int,
        entry: IndexEntry,
        keys_held: int | None = None,
        expires_first: float | None = None,
    ) -> None:
        self.depth = depth
        self.entry = entry
        self.keys_held = keys_held
        self.expires_first = expires_first

    @property
    def token_count(self) -> int:
        return self.entry.token_count

    @property
    def tier(self) -> StorageTier:
        return self.entry.tier

    def __repr__(self) -> str:
        return f"Held(depth={self.depth}, {self.entry!r})"


def deepest_held(
    rows: Sequence[Sequence[IndexEntry]], names: Collection[str]
) -> tuple[dict[str, Held], Held | None]:
    """Each of ``names``' deepest key in ``rows`` (``query_many`` of a chain's keys, in
    order), and the deepest key any backend holds (its largest ``token_count``: the best
    sample of this prompt's tokens per byte). Backends holding nothing are absent.

    The same pass counts each found backend's keys below its deepest and their earliest
    expiry (``Held.keys_held``, ``expires_first``): when some candidate holds nothing (the
    common case: a conversation lives on one backend) the scan reads every row anyway.
    When every candidate is found before the first row it stops there, and those stay
    None."""
    pending = set(names)
    found: dict[str, Held] = {}
    deepest: Held | None = None
    # The current run of consecutive single-holder rows of one found backend, counted in
    # locals and added to its Held when the run ends (most rows: no dict lookup).
    run: Held | None = None
    run_backend: str | None = None
    run_keys = 0
    run_first = math.inf
    depth = len(rows)
    for row in reversed(rows):
        if row:
            if deepest is None:
                deepest = Held(depth, row[0])
            if len(row) == 1 and row[0].backend is run_backend:
                run_keys += 1
                if row[0].expires_at < run_first:
                    run_first = row[0].expires_at
                depth -= 1
                continue
            if run is not None:
                _add(run, run_keys, run_first)
                run = run_backend = None
            for e in row:
                h = found.get(e.backend)
                if h is None:
                    if e.backend not in pending:
                        continue
                    pending.discard(e.backend)
                    h = found[e.backend] = Held(depth, e, 0, math.inf)
                if len(row) == 1:  # a run starts
                    run, run_backend, run_keys, run_first = h, e.backend, 1, e.expires_at
                else:
                    _add(h, 1, e.expires_at)
            if not pending and run is None:
                break
        depth -= 1
    if run is not None:
        _add(run, run_keys, run_first)
    if depth > 1:  # stopped early: every candidate found before the first row
        for h in found.values():
            h.keys_held = h.expires_first = None
    return found, deepest


def _add(h: Held, keys: int, first: float) -> None:
    h.keys_held += keys  # type: ignore[operator]
    if first < h.expires_first:  # type: ignore[operator]
        h.expires_first = first
