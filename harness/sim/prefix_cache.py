"""Block-level prefix-cache model shaped like vLLM's automatic prefix caching.

The router's whole reason to exist is to land requests where their prefix is already cached,
so the sim has to make "where did this prefix go before" observable and costly to get wrong:
a hit skips modelled prefill time, a miss pays for it.

Tokenisation: the text is UTF-8 encoded and split by the bytes regex ``\\w+|[^\\w\\s]`` (ASCII
words, and every other non-space byte on its own), and each piece becomes ``crc32(piece)``.
That is deterministic across processes and machines (unlike ``hash()``), needs no vocabulary,
runs at C speed, and gives token counts in the same ballpark as a real BPE tokenizer for
English/code (~1.2-1.4 tokens per word). Whitespace is dropped, so prompts differing only in
spacing share cache; that is an accepted simplification. Token ids are 32-bit, not a real vocab.

Block hashing follows vLLM: only *full* blocks are cached, and each block's hash chains the
parent block's hash with the block's token ids, so a block is only reusable after the exact
same prefix. Like vLLM, when the entire prompt is cached the last token is still recomputed
(a prefill needs at least one token to produce logits), so at most
``(n - 1) // block_size`` blocks count as hits.

A request's ``cache_salt`` is folded into its first block's hash (vLLM's extra keys), so
requests with different salts never share a block. The default hash is a fast 64-bit
blake2b chain; with KV events on, the engine plugs in the hash its published format uses
(a :class:`BlockHasher` from :mod:`harness.sim.block_hash`), so cache keys *are* the hashes
on the wire.

Generated tokens are cached too, as vLLM does: a request's computed sequence is its prompt
then its output, and every block of it that fills during decode is stored (``commit``),
so the next turn of a conversation, whose prompt repeats the answer, hits them. The last
sampled token is never computed, so it is not part of the sequence.

Eviction is LRU over blocks. A request touches its blocks tail-first, so within one sequence
the tail is least recently used and is evicted before the shared root — again like vLLM, whose
free queue receives a finished request's blocks in reverse order.
"""

from __future__ import annotations

import hashlib
import re
import zlib
from array import array
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

__all__ = [
    "BlockHasher",
    "BlockSequence",
    "CacheStats",
    "KVEventCallback",
    "PrefixCache",
    "StoredBlock",
    "tokenize",
]

_PIECE = re.compile(rb"\w+|[^\w\s]")
# Parent of the first block. vLLM seeds this too (NONE_HASH); events report None instead.
_ROOT_SEED = 0x636F6E74696E7575  # b"continuu"
_crc32 = zlib.crc32


def tokenize(text: str) -> list[int]:
    """Deterministic cheap tokenizer; see the module docstring for why this shape."""
    return [_crc32(p) for p in _PIECE.findall(text.encode("utf-8", "surrogatepass"))]


def chain_hash(parent: int, token_ids: Sequence[int]) -> int:
    """64-bit block hash of (parent hash, token ids); stable across processes."""
    h = hashlib.blake2b(parent.to_bytes(8, "little"), digest_size=8)
    h.update(array("Q", token_ids).tobytes())
    return int.from_bytes(h.digest(), "little")


def salted_root(salt: str | None) -> int:
    """Parent seed of a request's first block: the salt is part of that block's hash."""
    if not salt:
        return _ROOT_SEED
    h = hashlib.blake2b(b"cache_salt\x00" + salt.encode("utf-8", "surrogatepass"), digest_size=8)
    return int.from_bytes(h.digest(), "little")


class BlockHasher(Protocol):
    """Chain hashes of the full blocks of a prompt; keys are ints or bytes, never mixed."""

    def chain(self, tokens: Sequence[int], block_size: int, salt: str | None) -> list[Any]: ...


@dataclass(slots=True, frozen=True)
class StoredBlock:
    """A block that entered the cache, with what a vLLM ``BlockStored`` event would carry."""

    block_hash: Any
    #: ``None`` for the first block of a sequence (vLLM's ``parent_block_hash=None``).
    parent_hash: Any
    token_ids: tuple[int, ...]


#: ``callback(stored, removed)``. ``stored`` is in chain order (each block's parent is the
#: previous one, or already cached); ``removed`` lists evicted/cleared hashes. Removals happen
#: before the stores of the same call (room is made first), so emit them in that order.
#: During the call, ``PrefixCache.last_removed_parents[i]`` is the parent of ``removed[i]``.
#: Hashes are ints with the default hasher (a :class:`BlockHasher` may use bytes).
KVEventCallback = Callable[[list[StoredBlock], list[Any]], None]


@dataclass(slots=True)
class BlockSequence:
    """One request's computed tokens and their chain hashes (see ``PrefixCache.sequence``)."""

    tokens: list[int]
    salt: str | None
    #: Chain hash of every full block of ``tokens``.
    hashes: list[Any]
    #: How many of ``tokens`` are the prompt (the rest is generated output).
    prompt_tokens: int


@dataclass(slots=True)
class CacheStats:
    """Counters the engine reports at /sim/stats; tokens are prompt tokens only."""

    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    prefill_seconds_modelled: float = 0.0

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass(slots=True)
class _Block:
    parent_hash: Hashable | None
    token_ids: tuple[int, ...]


@dataclass
class PrefixCache:
    """LRU block cache; not thread-safe (the sim is single-threaded asyncio)."""

    block_size: int = 16
    capacity_blocks: int = 4096
    prefill_us_per_token: float = 50.0
    #: Fixed per-request prefill cost (scheduling, the recomputed last token, sampling).
    prefill_overhead_us: float = 1000.0
    on_change: KVEventCallback | None = None
    #: Block hash function; ``None`` = the fast 64-bit blake2b chain (:func:`chain_hash`).
    hasher: BlockHasher | None = None
    stats: CacheStats = field(default_factory=CacheStats)
    #: Tokens newly written by the last ``lookup_and_insert`` (Anthropic's cache_creation).
    last_stored_tokens: int = field(default=0, init=False)
    #: Parents of the hashes removed by the current ``on_change`` call, index for index.
    last_removed_parents: list[Any] = field(default_factory=list, init=False, repr=False)
    _blocks: OrderedDict[Any, _Block] = field(default_factory=OrderedDict, repr=False)

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError("block_size must be >= 1")
        if self.capacity_blocks < 1:
            raise ValueError("capacity_blocks must be >= 1")

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._blocks

    def block_hashes(self, tokens: Sequence[int], salt: str | None = None) -> list[Any]:
        """Chain hashes of the full blocks of ``tokens`` (what a KV-aware router would index)."""
        bs = self.block_size
        if self.hasher is not None:
            return self.hasher.chain(tokens, bs, salt)
        parent = salted_root(salt) if salt else _ROOT_SEED
        out: list[int] = []
        for start in range(0, len(tokens) - bs + 1, bs):
            parent = chain_hash(parent, tokens[start : start + bs])
            out.append(parent)
        return out

    def prefill_seconds(self, uncached_tokens: int) -> float:
        """Modelled prefill latency: linear in uncached tokens plus a fixed overhead."""
        return (uncached_tokens * self.prefill_us_per_token + self.prefill_overhead_us) / 1e6

    def peek(self, tokens: Sequence[int], salt: str | None = None) -> int:
        """Cached-token count ``lookup_and_insert`` would report, without touching LRU/stats."""
        hashes = self.block_hashes(tokens, salt)
        hits = 0
        for h in hashes[: self._max_hit_blocks(len(tokens))]:
            if h not in self._blocks:
                break
            hits += 1
        return hits * self.block_size

    def sequence(
        self, tokens: Sequence[int], salt: str | None = None, prompt_tokens: int | None = None
    ) -> BlockSequence:
        """A request's computed tokens (its prompt, then what it generated) with their
        block-hash chain, hashed once for :meth:`prefill` and every :meth:`commit`."""
        n = len(tokens) if prompt_tokens is None else prompt_tokens
        if not 0 <= n <= len(tokens):
            raise ValueError("prompt_tokens must be within the sequence")
        return BlockSequence(list(tokens), salt, self.block_hashes(tokens, salt), n)

    def lookup_and_insert(self, tokens: Sequence[int], salt: str | None = None) -> tuple[int, int]:
        """Account one prefill: count the cached prefix, cache the rest, update stats.

        ``salt`` is the request's ``cache_salt`` (folded into the first block's hash).
        Returns ``(cached_tokens, total_tokens)``.
        """
        return self.prefill(self.sequence(tokens, salt))

    def prefill(self, seq: BlockSequence) -> tuple[int, int]:
        """:meth:`lookup_and_insert` for the prompt of ``seq``: its generated tokens stay
        out of the cache until :meth:`commit` (they do not exist yet)."""
        total = seq.prompt_tokens
        bs = self.block_size
        blocks = self._blocks
        hashes = seq.hashes[: total // bs]
        max_hits = self._max_hit_blocks(total)
        hits = 0
        for h in hashes:
            if hits >= max_hits or h not in blocks:
                break
            hits += 1
        stored = self._store(hashes, seq.tokens)
        cached = hits * bs
        self.last_stored_tokens = stored * bs
        st = self.stats
        st.requests += 1
        st.prompt_tokens += total
        st.cached_tokens += cached
        st.prefill_seconds_modelled += self.prefill_seconds(total - cached)
        return cached, total

    def commit(self, seq: BlockSequence, computed_tokens: int) -> int:
        """Cache every full block within the first ``computed_tokens`` of ``seq`` (decode
        filled them), as vLLM caches a running request's blocks as they fill; blocks of
        the chain evicted meanwhile are stored again. Returns the blocks newly stored."""
        n = min(computed_tokens, len(seq.tokens)) // self.block_size
        return self._store(seq.hashes[:n], seq.tokens)

    def _store(self, hashes: list[Any], tokens: Sequence[int]) -> int:
        """Make the chain ``hashes`` (full blocks of ``tokens``) resident, most recently
        used root first; report the change. Returns how many blocks were new."""
        bs = self.block_size
        blocks = self._blocks
        # A request cannot hold more blocks than the cache has; the excess tail is not stored.
        mine = hashes[: self.capacity_blocks]
        # Protect this request's already-cached blocks, then make room, then store the rest.
        # (After the first miss everything is normally new, but a block whose ancestor was
        # evicted can still be present, hence the membership test.)
        new: list[int] = []
        for i, h in enumerate(mine):
            if h in blocks:
                blocks.move_to_end(h)
            else:
                new.append(i)
        removed: list[Any] = []
        removed_parents: list[Any] = []
        overflow = len(blocks) + len(new) - self.capacity_blocks
        while overflow > 0:
            h, old = blocks.popitem(last=False)
            removed.append(h)
            removed_parents.append(old.parent_hash)
            overflow -= 1
        stored: list[StoredBlock] = []
        for i in new:
            parent = hashes[i - 1] if i > 0 else None
            token_ids = tuple(tokens[i * bs : (i + 1) * bs])
            blocks[hashes[i]] = _Block(parent, token_ids)
            if self.on_change is not None:
                stored.append(StoredBlock(hashes[i], parent, token_ids))
        # Final LRU order, oldest first: tail ... root, so the shared root outlives the tail.
        for h in reversed(mine):
            blocks.move_to_end(h)
        if self.on_change is not None and (stored or removed):
            self.last_removed_parents = removed_parents
            self.on_change(stored, removed)
        return len(new)

    def clear(self) -> None:
        """Drop every block; ``on_change`` gets them all as removals (in LRU order)."""
        removed = list(self._blocks)
        parents = [b.parent_hash for b in self._blocks.values()]
        self._blocks.clear()
        if self.on_change is not None and removed:
            self.last_removed_parents = parents
            self.on_change([], removed)

    def reset_stats(self) -> None:
        self.stats = CacheStats()

    def _max_hit_blocks(self, total: int) -> int:
        # The last prompt token is always recomputed, so a full-prompt hit stops one short.
        return max(0, (total - 1) // self.block_size)
