"""The engine's own account of which router prefix keys it truly holds: the fault oracle.

A fault test must not judge the router's KV index by what the listener said (the listener
is one of the parts under test): it needs the truth, and only the engine has it. For every
request it serves, the engine computes the request's prefix key with the router's own
function (``bus.prefix_key.extract_prefix_key`` on the body it received) and remembers the
block hashes of the sequence (prompt, then output) under that key. A key is *held* while at
least one of those blocks is still in the prefix cache: that is when the listener keeps
the prefix too (it announces ``cache_evicted`` only when the prefix's last block goes), so
with router-issued salts, where every block of a chain is keyed from its first block on,
the oracle and an exact listener agree block for block. Without salts the listener keys a
chain only from the block that completes the anchor text on, so a key whose deciding
block is gone while its first blocks remain reads held here and evicted there; fault rows
run with salts for that reason.

Bounded memory: a key's blocks not in the cache any more are dropped when the record grows
past twice the cache's capacity (a block only comes back by being stored again, which is a
request served, which records it again), at most ``max_keys`` keys are kept (least
recently served forgotten first, counted in ``forgotten_keys``) and at most
``max_blocks_per_key`` blocks per key (a key's oldest blocks forgotten first).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Hashable, Mapping, Sequence
from typing import Any

from bus.prefix_key import DEFAULT_MAX_PREFIX_LENGTH, extract_prefix_key

__all__ = ["HeldPrefixes"]


class HeldPrefixes:
    """Served prefix keys and their blocks, checked against the cache when asked."""

    def __init__(
        self,
        cache: Container[Any],
        capacity_blocks: int,
        *,
        max_prefix_length: int | None = DEFAULT_MAX_PREFIX_LENGTH,
        max_keys: int = 65_536,
        max_blocks_per_key: int = 65_536,
    ) -> None:
        if max_keys < 1 or max_blocks_per_key < 1:
            raise ValueError("max_keys and max_blocks_per_key must be >= 1")
        self._cache = cache
        self._prune_at = max(1, 2 * capacity_blocks)
        self.max_prefix_length = max_prefix_length
        self.max_keys = max_keys
        self.max_blocks_per_key = max_blocks_per_key
        self._keys: OrderedDict[bytes, dict[Hashable, None]] = OrderedDict()
        self._recorded = 0
        self.forgotten_keys = 0
        self.unkeyed_requests = 0

    def key_of(self, body: Mapping[str, Any]) -> bytes | None:
        """The router's prefix key of a request body (None: the body has no anchor)."""
        key = extract_prefix_key(body, max_prefix_length=self.max_prefix_length)
        return None if key is None else bytes(key)

    def served(self, key: bytes | None, hashes: Sequence[Hashable]) -> None:
        """A request with ``key`` was prefilled; ``hashes`` are its sequence's full blocks
        (the output's too: they enter the cache as decode fills them)."""
        if key is None:
            self.unkeyed_requests += 1
            return
        blocks = self._keys.get(key)
        if blocks is None:
            blocks = self._keys[key] = {}
            if len(self._keys) > self.max_keys:
                _, dropped = self._keys.popitem(last=False)
                self._recorded -= len(dropped)
                self.forgotten_keys += 1
        else:
            self._keys.move_to_end(key)
        before = len(blocks)
        for h in hashes:
            blocks.pop(h, None)
            blocks[h] = None
        while len(blocks) > self.max_blocks_per_key:
            del blocks[next(iter(blocks))]
        self._recorded += len(blocks) - before
        if self._recorded > self._prune_at:
            self._prune()

    def _prune(self) -> None:
        cache = self._cache
        total = 0
        for blocks in self._keys.values():
            gone = [h for h in blocks if h not in cache]
            for h in gone:
                del blocks[h]
            total += len(blocks)
        self._recorded = total

    def held(self) -> dict[str, int]:
        """``{prefix key hex: blocks of it in the cache}`` for every key still held."""
        cache = self._cache
        out: dict[str, int] = {}
        for key, blocks in self._keys.items():
            n = sum(1 for h in blocks if h in cache)
            if n:
                out[key.hex()] = n
        return out

    def report(self) -> dict[str, Any]:
        """The document of ``GET /sim/held-prefixes``."""
        held = self.held()
        return {
            "held": held,
            "held_keys": len(held),
            "served_keys": len(self._keys),
            "forgotten_keys": self.forgotten_keys,
            "unkeyed_requests": self.unkeyed_requests,
            "max_prefix_length": self.max_prefix_length,
        }
