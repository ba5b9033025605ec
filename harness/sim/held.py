"""The engine's own account of which router keys it truly holds: the fault oracle.

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

Conversation keys (``GET /sim/held-conversation``, :class:`HeldConversation`): for every
request served, the engine computes the chain keys (``bus.prompt_chain``) of the text its
sequence's full blocks spell (prompt, then output: the listener keys the blocks it is told
of, and a reply's blocks spell the start of the next turn's history), from the root of
(model, the caller's cache salt, no LoRA), and remembers for key ``i`` the blocks from the
first up to the one that completes chunk ``i``. A key is held while every one of those
blocks is in the cache, on any path that spells it (the same text can be two block chains:
the reply's tokens are encoded apart from the prompt, the next turn's prompt encodes them
together). That is when the listener holds it: it announces a key when the block
completing its chunk is stored under a keyed parent, and withdraws it when any block at
or before that goes. Its ``token_count`` is the tokens wholly within the key's bytes, as
the listener counts them. Bounded like ``HeldPrefixes``: at most ``max_keys`` keys (least
recently served forgotten first) and ``max_paths_per_key`` paths each; paths not wholly in
the cache are dropped when the record grows past twice the cache's capacity (a request
still decoding has output blocks not committed yet: such a prune forgets its keys past
the prompt until it is served again; the fault stack's cache never gets there).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections import OrderedDict
from collections.abc import Container, Hashable, Mapping, Sequence
from itertools import accumulate
from typing import Any

from bus.prefix_key import DEFAULT_MAX_PREFIX_LENGTH, extract_prefix_key
from bus.prompt_chain import DEFAULT_CHUNK_BYTES, chain_keys, chain_root
from bus.salt import caller_salt

__all__ = ["HeldConversation", "HeldPrefixes"]


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


class HeldConversation:
    """Served requests' conversation keys and the blocks each needs, checked when asked."""

    def __init__(
        self,
        cache: Container[Any],
        capacity_blocks: int,
        *,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        max_keys: int = 65_536,
        max_paths_per_key: int = 8,
    ) -> None:
        if max_keys < 1 or max_paths_per_key < 1 or chunk_bytes < 1:
            raise ValueError("chunk_bytes, max_keys and max_paths_per_key must be >= 1")
        self._cache = cache
        self._prune_at = max(1, 2 * capacity_blocks)
        self.chunk_bytes = chunk_bytes
        self.max_keys = max_keys
        self.max_paths_per_key = max_paths_per_key
        # key -> {last block's hash: (the request's block hashes, blocks needed)}, and
        # the key's token count
        self._keys: OrderedDict[bytes, tuple[dict[Hashable, tuple[Sequence[Hashable], int]], int]]
        self._keys = OrderedDict()
        self._paths = 0
        self.forgotten_keys = 0
        self.unkeyed_requests = 0

    def served(
        self,
        model: str,
        cache_salt: str | None,
        pieces: Sequence[bytes] | None,
        block_size: int,
        hashes: Sequence[Hashable],
    ) -> None:
        """A request of ``model`` with ``cache_salt`` was prefilled; ``pieces`` are the
        bytes of its sequence's tokens (None: the tokenizer cannot spell them), ``hashes``
        its full blocks (the output's too, cached as decode fills them)."""
        if pieces is None:
            self.unkeyed_requests += 1
            return
        c = self.chunk_bytes
        covered = pieces[: len(hashes) * block_size]
        ends = list(accumulate(map(len, covered)))
        if not ends or ends[-1] < c:
            return
        keys = chain_keys(b"".join(covered), chain_root(model, caller_salt(cache_salt)), c)
        path = tuple(hashes)
        for i, key in enumerate(keys):
            end = (i + 1) * c
            need = bisect_left(ends, end) // block_size + 1
            record = self._keys.get(key)
            if record is None:
                record = self._keys[key] = ({}, bisect_right(ends, end))
                if len(self._keys) > self.max_keys:
                    _, (dropped, _) = self._keys.popitem(last=False)
                    self._paths -= len(dropped)
                    self.forgotten_keys += 1
            else:
                self._keys.move_to_end(key)
            paths = record[0]
            last = path[need - 1]
            if paths.pop(last, None) is None:
                self._paths += 1
            paths[last] = (path, need)
            if len(paths) > self.max_paths_per_key:
                del paths[next(iter(paths))]
                self._paths -= 1
        if self._paths > self._prune_at:
            self._prune()

    def _whole(self, path: Sequence[Hashable], need: int) -> bool:
        cache = self._cache
        return all(path[j] in cache for j in range(need - 1, -1, -1))

    def _prune(self) -> None:
        total = 0
        for paths, _ in self._keys.values():
            for last in [h for h, (p, n) in paths.items() if not self._whole(p, n)]:
                del paths[last]
            total += len(paths)
        self._paths = total

    def held(self) -> dict[str, int]:
        """``{chain key hex: its token count}`` for every key a path still holds."""
        return {
            key.hex(): tokens
            for key, (paths, tokens) in self._keys.items()
            if any(self._whole(p, n) for p, n in paths.values())
        }

    def report(self) -> dict[str, Any]:
        """The document of ``GET /sim/held-conversation``: the fields of
        ``GET /sim/held-prefixes`` (``held`` maps a key to its token count here), and the
        chunk size."""
        held = self.held()
        counts = (len(held), len(self._keys), self.forgotten_keys, self.unkeyed_requests)
        names = ("held_keys", "served_keys", "forgotten_keys", "unkeyed_requests")
        doc: dict[str, Any] = {"held": held, **dict(zip(names, counts, strict=True))}
        doc["chunk_bytes"] = self.chunk_bytes
        return doc
