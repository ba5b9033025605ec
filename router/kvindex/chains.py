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

from collections.abc import Collection, Sequence

from .base import IndexEntry, StorageTier

__all__ = ["Held", "deepest_held"]


class Held:
    """A backend's deepest key of one chain: ``depth`` keys held (index + 1), and the entry
    of that key (its tokens, tier and expiry)."""

    __slots__ = ("depth", "entry")

    def __init__(self, depth: int, entry: IndexEntry) -> None:
        self.depth = depth
        self.entry = entry

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
    sample of this prompt's tokens per byte). Backends holding nothing are absent."""
    pending = set(names)
    found: dict[str, Held] = {}
    deepest: Held | None = None
    depth = len(rows)
    for row in reversed(rows):
        if row:
            if deepest is None:
                deepest = Held(depth, row[0])
            if len(row) == 1:  # the common case: one holder (no inner loop)
                e = row[0]
                if e.backend in pending:
                    pending.discard(e.backend)
                    found[e.backend] = Held(depth, e)
            else:
                for e in row:
                    if e.backend in pending:
                        pending.discard(e.backend)
                        found[e.backend] = Held(depth, e)
            if not pending:
                break
        depth -= 1
    return found, deepest
