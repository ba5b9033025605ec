"""Chain tracking: engine block events in, prefix-level ``KvEvent``s out, in bounded memory.

One ``ChainTracker`` per source (backend). ``apply`` runs on the ingestion path: it is
synchronous, does O(blocks in the event) work and never waits for I/O.

**Blocks.** Each stored block becomes a ``TrackedBlock`` keyed by
``(dp_rank, group_idx, medium, hash)``: engine hashes are only unique per engine instance,
dp rank and KV-cache group, and a GPU block and its CPU/disk copy share a hash. A block
keeps its *own* token segment (``array('I')``), a parent reference and its depth (tokens
from the root), never a copy of the whole chain, and only while that is useful:

* ``PENDING``      prefix unknown yet. Keeps its segment while the path from the root is
                   fully known and ends within ``max_chain_tokens``; otherwise it is
                   *blocked* (no tokens) and waits on its ``frontier``, the deepest
                   ancestor that still has text.
* ``KEYED``        prefix known. Holds a reference to its ``_Prefix`` and nothing else:
                   no tokens, no parent (descendants inherit the key when stored).
* ``UNATTRIBUTED`` can never be keyed (no anchor, text lost, mismatched segment under
                   an unkeyed chain...). Length only; descendants inherit the state.

**Attribution.** The key depends only on the anchor text near the start of a chain. A
root whose first block carries a router salt is keyed at once (``from_salt``; a bad MAC
discards the chain). Otherwise the leaf of each stored event is queued under its root;
a few worker tasks detokenize root..leaf (``recover_many``). NEED_MORE marks the leaf's
text *insufficient* (its blocked descendants can never get more text and become
unattributed; others wait for more blocks). A key is attached to the *shallowest* block
whose text already decides it, found by probing a few ancestors (first guess interpolated
from where the anchor ended in the text, then a k-ary search); that block and all its
pending descendants become ``KEYED``, and blocks stored under it later inherit the key
for free. Attaching at the decision block (not at the root, not at the leaf) is what
lets two system prompts that share a first block get different keys, while every
conversation under one system prompt costs no further detokenize call. Detokenize
failures are retried with backoff; a chain removed meanwhile is simply forgotten.

**Engine block sizes** (``_segments``). SGLang: ``len(token_ids) == block_size * n``.
vLLM, full-block path: tokens are contiguous but null blocks (sliding window, Mamba
align mode) are left out of ``block_hashes``, so ``len(token_ids)`` may be a larger
multiple of ``block_size``; null blocks are the oldest (out-of-window) ones, so the first
hash's segment absorbs the extra spans and the path text stays exact. A single hash with
one ``block_size`` segment is the partial-block path. TensorRT-LLM gives per-block counts.
Anything else is a mismatch: tracked as length only, counted per event, warned once.

**Memory.** ``max_tracked_blocks`` bounds entries and ``max_retained_tokens`` bounds
retained token IDs; only PENDING blocks retain tokens, each at most ``max_chain_tokens``
(a block retains tokens only if it ends within the cap). When a bound is exceeded, single
entries are pruned in the ``PruningPolicy``'s order (LRU by default: insertion order,
refreshed when a block is re-stored or gains a child): for the block bound the victim is
removed, for the token bound the oldest token holder loses its text (it and its pending
descendants become unattributed). Never a whole backend; a prefix goes (``cache_evicted``)
only when its last block goes. Hence at all times, per source::

    retained token IDs <= min(max_retained_tokens, max_tracked_blocks * max_chain_tokens)

**Events.** Per prefix the tracker counts GPU and non-GPU blocks and the deepest of each,
and after every engine event (or attribution) emits the difference from what it last
announced: ``cache_created`` (tier gpu) when a prefix gains GPU blocks or its chain grows,
``cache_offloaded`` (tier storage) while only non-GPU copies exist, ``cache_evicted`` when
its last block is gone. ``snapshot`` replays exactly the announced state.
"""

from __future__ import annotations

import asyncio
import logging
from array import array
from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Literal, Protocol, cast

from bus.backoff import Backoff, ExponentialBackoff
from bus.events import KvEvent
from bus.prefix_key import PrefixKey
from bus.salt import SaltError
from listener.engine_events import (
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    EventBatch,
)
from listener.recovery import NEED_MORE, DetokenizeError, NeedMore, Recovered

__all__ = [
    "KEYED",
    "PENDING",
    "UNATTRIBUTED",
    "ChainAttributor",
    "ChainTracker",
    "LruPolicy",
    "PruningPolicy",
    "TrackedBlock",
]

log = logging.getLogger(__name__)

PENDING, KEYED, UNATTRIBUTED = 0, 1, 2
_GPU = "GPU"
BlockKey = tuple[int, int, str, BlockHash]
"""(dp_rank, group_idx, medium, engine hash)."""


class TrackedBlock:
    """One engine block as the tracker sees it (see the module docstring for states)."""

    __slots__ = (
        "alive",
        "children",
        "depth",
        "dirty",
        "frontier",
        "insufficient",
        "key",
        "parent",
        "prefix",
        "root",
        "start",
        "state",
        "tier",
        "tokens",
    )

    def __init__(
        self,
        key: BlockKey,
        start: int,
        depth: int,
        tier: str,
        state: int = UNATTRIBUTED,
        prefix: _Prefix | None = None,
    ) -> None:
        self.key, self.start, self.depth, self.tier = key, start, depth, tier
        self.state, self.prefix = state, prefix
        self.alive = True
        self.tokens: array[int] | None = None
        self.parent: TrackedBlock | None = None
        self.children: set[TrackedBlock] | None = None
        self.root: TrackedBlock | None = None
        self.frontier: TrackedBlock | None = None
        self.insufficient = False
        self.dirty: dict[TrackedBlock, None] | None = None


class PruningPolicy(Protocol):
    """Ranks entries for pruning; a SAECache policy can replace the LRU default."""

    def added(self, block: TrackedBlock) -> None: ...
    def touched(self, block: TrackedBlock) -> None: ...
    def released(self, block: TrackedBlock) -> None:
        """``block`` no longer holds tokens."""

    def removed(self, block: TrackedBlock) -> None: ...
    def victim(self, *, holding_tokens: bool = False) -> TrackedBlock | None:
        """The next entry to prune (among token holders when asked)."""

    def clear(self) -> None: ...


class LruPolicy:
    """Oldest first: insertion order, refreshed on ``touched``. O(1) per call.

    ``OrderedDict`` rather than ``dict``: finding the first key of a plain dict after many
    deletions at its front walks over the deleted slots.
    """

    def __init__(self) -> None:
        self._all: OrderedDict[TrackedBlock, None] = OrderedDict()
        self._holders: OrderedDict[TrackedBlock, None] = OrderedDict()

    def added(self, block: TrackedBlock) -> None:
        self._all[block] = None
        if block.tokens is not None:
            self._holders[block] = None

    def touched(self, block: TrackedBlock) -> None:
        # ``_holders`` holds exactly the added blocks whose ``tokens`` are set (``released``
        # is called when they go), so most calls need one dict operation.
        try:
            self._all.move_to_end(block)
        except KeyError:
            return
        if block.tokens is not None and block in self._holders:
            self._holders.move_to_end(block)

    def released(self, block: TrackedBlock) -> None:
        self._holders.pop(block, None)

    def removed(self, block: TrackedBlock) -> None:
        self._all.pop(block, None)
        if block.tokens is not None:
            self._holders.pop(block, None)

    def victim(self, *, holding_tokens: bool = False) -> TrackedBlock | None:
        return next(iter(self._holders if holding_tokens else self._all), None)

    def clear(self) -> None:
        self._all.clear()
        self._holders.clear()


class ChainAttributor(Protocol):
    """What the tracker needs from ``listener.recovery.Attributor``."""

    @property
    def can_detokenize(self) -> bool: ...
    def from_salt(self, salt: str) -> PrefixKey | None: ...
    async def recover_many(
        self, seqs: Sequence[Sequence[int]]
    ) -> list[Recovered | NeedMore | None]: ...


class _Prefix:
    """Per-prefix block counts and what was last announced for it."""

    __slots__ = (
        "gpu_hw",
        "gpu_refs",
        "hex",
        "key",
        "sent_count",
        "sent_tier",
        "storage_hw",
        "storage_refs",
    )

    def __init__(self, key: bytes) -> None:
        self.key, self.hex = key, key.hex()
        self.gpu_refs = self.gpu_hw = self.storage_refs = self.storage_hw = 0
        self.sent_tier: str | None = None
        self.sent_count = 0


class ChainTracker:
    """Engine block chains of one source -> prefix ``KvEvent``s (see module docstring).

    Args:
        backend: the source's backend name (events carry it).
        emit: called synchronously with every ``KvEvent``.
        attributor: salt verification and detokenize-based recovery.
        engine: ``vllm``, ``sglang`` or ``trtllm``: selects the block-size rules.
        max_chain_tokens: longest chain reconstructed for /detokenize (tokens).
        max_tracked_blocks: entries kept; the oldest single entries are pruned beyond.
        max_retained_tokens: token IDs kept; the oldest holders lose theirs beyond.
        policy: pruning order (LRU when None).
        concurrency: attribution worker tasks.
        backoff: delay strategy after detokenize failures.
        probe_fanout, max_probe_rounds: search for the block that decides the anchor.
    """

    def __init__(
        self,
        backend: str,
        emit: Callable[[KvEvent], None],
        attributor: ChainAttributor,
        *,
        engine: Literal["vllm", "sglang", "trtllm"] = "vllm",
        max_chain_tokens: int = 16384,
        max_tracked_blocks: int = 100_000,
        max_retained_tokens: int = 16_777_216,
        policy: PruningPolicy | None = None,
        concurrency: int = 2,
        backoff: Backoff | None = None,
        probe_fanout: int = 4,
        max_probe_rounds: int = 4,
    ) -> None:
        if min(max_chain_tokens, max_tracked_blocks, max_retained_tokens, concurrency) < 1:
            raise ValueError("limits and concurrency must be positive")
        self.backend, self.engine = backend, engine
        self._emit, self._attributor = emit, attributor
        self.max_chain_tokens = max_chain_tokens
        self.max_tracked_blocks = max_tracked_blocks
        self.max_retained_tokens = max_retained_tokens
        self._policy: PruningPolicy = policy if policy is not None else LruPolicy()
        self._lru = cast(LruPolicy, self._policy) if type(self._policy) is LruPolicy else None
        """The default policy, whose bookkeeping ``_extend`` inlines."""
        self._concurrency = concurrency
        self._backoff = backoff if backoff is not None else ExponentialBackoff()
        self._fanout, self._rounds = max(1, probe_fanout), max(0, max_probe_rounds)
        self._nodes: dict[BlockKey, TrackedBlock] = {}
        self._media: dict[tuple[int, int], set[str]] = {}
        self._mixed_media = False
        """Some (dp rank, group) has blocks in more than one medium (twins possible)."""
        self._prefixes: dict[bytes, _Prefix] = {}
        self._touched: dict[_Prefix, None] = {}
        self._queue: dict[TrackedBlock, None] = {}
        self._active: set[TrackedBlock] = set()
        self._counts = [0, 0, 0]
        self._retained = 0
        self._gen = 0
        self._workers: list[asyncio.Task[None]] = []
        self._wake: asyncio.Event | None = None
        self._idle: asyncio.Event | None = None
        self._busy = 0
        self._failures = 0
        self._warned: set[str] = set()
        self.mismatches = self.salt_failures = self.detokenize_failures = 0
        self.pruned = self.orphans = self.discarded = self.unattributed_chains = 0

    # -- ingestion ---------------------------------------------------------------------

    def apply(self, batch: EventBatch, *, flush: bool = True) -> None:
        """Apply one decoded engine batch; emits events synchronously. Never blocks.

        ``flush=False`` leaves the prefix events of this batch to the next ``flush`` (or
        flushing ``apply``): a source draining a backlog of batches that are all already
        there announces their end state once, not every intermediate one.
        """
        dp = batch.dp_rank or 0
        for ev in batch.events:
            kind = type(ev)
            if kind is BlockStored:
                if not self._extend(dp, ev):  # type: ignore[arg-type]
                    self._stored(dp, ev)  # type: ignore[arg-type]
            elif kind is BlockRemoved:
                medium = (ev.medium or _GPU).upper()
                for h in ev.block_hashes:
                    b = self._nodes.get((dp, ev.group_idx, medium, h))
                    if b is not None:
                        self._drop(b)
            elif kind is AllBlocksCleared:
                self._flush()
                self.reset()
                self._emit(KvEvent("cache_cleared", self.backend))
        # Once per batch, not per event: a batch is one scheduler step, and subscribers
        # need its outcome, not every intermediate state (the final state is the same).
        if flush:
            self._flush()

    def flush(self) -> None:
        """Announce what changed since the last announcement (see ``apply``)."""
        self._flush()

    def reset(self) -> None:
        """Forget everything without per-prefix events (the source sends ``resync``)."""
        self._gen += 1
        for b in self._nodes.values():
            b.alive = False  # in-flight jobs hold references: make them see it is gone
        self._nodes.clear()
        self._media.clear()
        self._mixed_media = False
        self._prefixes.clear()
        self._touched.clear()
        self._queue.clear()
        self._policy.clear()
        self._counts = [0, 0, 0]
        self._retained = 0

    def _segments(self, ev: BlockStored) -> tuple[list[int], bool]:
        """Per-block token counts, and whether ``token_ids`` splits into them exactly."""
        n, bs, total = len(ev.block_hashes), ev.block_size, len(ev.token_ids)
        counts = ev.block_token_counts
        if counts is not None:
            if len(counts) == n and min(counts) > 0 and total in (0, sum(counts)):
                return list(counts), total > 0
        elif bs > 0 and total == 0:
            return [bs] * n, False
        elif bs > 0 and total == bs * n:
            return [bs] * n, True
        elif bs > 0 and self.engine == "vllm" and total % bs == 0 and total > bs * n:
            return [total - bs * (n - 1)] + [bs] * (n - 1), True
        self.mismatches += 1
        self._warn_once("mismatch", "token count does not match block_size; tracking length only")
        total = total or max(bs, 0) * n
        return [(i + 1) * total // n - i * total // n for i in range(n)], False

    def _extend(self, dp: int, ev: BlockStored) -> bool:
        """The common case on its own short path: one new block under a parent that is
        already keyed (or unattributed), so it inherits the parent's state and needs no
        tokens. Returns False, having changed nothing, for anything else (``_stored``).

        Equivalent to ``_stored`` for the cases it takes: no twin can exist (one medium
        seen for the group), the segment is exactly one ``block_size`` (or no tokens).
        """
        hashes = ev.block_hashes
        parent_hash = ev.parent_block_hash
        if len(hashes) != 1 or parent_hash is None or ev.block_token_counts is not None:
            return False
        bs = ev.block_size
        total = len(ev.token_ids)
        if bs <= 0 or (total != bs and total != 0):
            return False
        medium = ev.medium
        if medium is None or medium == _GPU:
            medium = _GPU
        else:
            medium = medium.upper()
        group = ev.group_idx
        nodes = self._nodes
        prev = nodes.get((dp, group, medium, parent_hash))
        if prev is None:
            return False
        state = prev.state
        if state == PENDING:
            return False
        if self._mixed_media:  # a twin may exist
            return False
        key: BlockKey = (dp, group, medium, hashes[0])
        if key in nodes:
            return False
        start = prev.depth
        depth = start + bs
        tier = "gpu" if medium == _GPU else "storage"
        p = prev.prefix
        b = TrackedBlock(key, start, depth, tier, state, p)
        nodes[key] = b
        self._counts[state] += 1
        lru = self._lru
        if lru is not None:  # LruPolicy.touched(prev) + added(b); neither holds tokens
            order = lru._all
            order.move_to_end(prev)
            order[b] = None
        else:
            self._policy.touched(prev)
            self._policy.added(b)
        if p is not None:  # KEYED: _account(b, 1), inlined
            if tier == "gpu":
                p.gpu_refs += 1
                if depth > p.gpu_hw:
                    p.gpu_hw = depth
            else:
                p.storage_refs += 1
                if depth > p.storage_hw:
                    p.storage_hw = depth
            self._touched[p] = None
        if len(nodes) > self.max_tracked_blocks:
            victim = self._policy.victim()  # one in, one out
            if victim is not None:
                self.pruned += 1
                self._drop(victim)
        return True

    def _stored(self, dp: int, ev: BlockStored) -> None:
        hashes = ev.block_hashes
        if not hashes:
            return
        medium = (ev.medium or _GPU).upper()
        tier = "gpu" if medium == _GPU else "storage"
        group = ev.group_idx
        media = self._media.get((dp, group))
        if media is None:
            self._media[(dp, group)] = {medium}
        elif medium not in media:
            media.add(medium)
            self._mixed_media = True
        parent_hash = ev.parent_block_hash
        root_event = parent_hash is None
        prev: TrackedBlock | None = None
        if parent_hash is not None:
            prev = self._nodes.get((dp, group, medium, parent_hash))
            if prev is None and medium != _GPU:  # an offloaded copy of a GPU chain
                prev = self._nodes.get((dp, group, _GPU, parent_hash))
        salt_key: PrefixKey | None = None
        if root_event and (dp, group, medium, hashes[0]) not in self._nodes:
            if ev.cache_salt:
                try:
                    salt_key = self._attributor.from_salt(ev.cache_salt)
                except SaltError:
                    self.salt_failures += 1
                    self._warn_once("salt", "cache salt MAC does not verify; chain discarded")
                    return
            if salt_key is None and not self._attributor.can_detokenize:
                self.discarded += 1
                return
        lengths, exact = self._segments(ev)
        tokens: array[int] | None = None
        text_wanted = root_event or (
            prev is not None and prev.state == PENDING and prev.tokens is not None
        )
        if exact and salt_key is None and text_wanted and self._attributor.can_detokenize:
            try:
                tokens = array("I", ev.token_ids)
            except (OverflowError, TypeError):
                self.mismatches += 1
                self._warn_once("tokens", "token IDs are not plain integers; length only")
        offset = 0
        last: TrackedBlock | None = None
        for i, h in enumerate(hashes):
            seg = None if tokens is None else tokens[offset : offset + lengths[i]]
            offset += lengths[i]
            if prev is not None and not prev.alive:
                prev = None
            key: BlockKey = (dp, group, medium, h)
            existing = self._nodes.get(key)
            if existing is not None:
                self._policy.touched(existing)
                prev = existing
                continue
            twin = self._twin(key)
            if twin is None and prev is None and not (root_event and i == 0):
                self.orphans += len(hashes) - i
                break
            prev = last = self._new_block(
                key, prev, lengths[i], seg, tier, salt_key if i == 0 else None, twin
            )
        if last is not None and last.alive and last.state == PENDING:
            self._mark_dirty(last)

    def _twin(self, key: BlockKey) -> TrackedBlock | None:
        """A keyed copy of the same block in another medium (its key is this one's)."""
        dp, group, medium, h = key
        for m in self._media.get((dp, group), ()):
            if m != medium:
                t = self._nodes.get((dp, group, m, h))
                if t is not None and t.state == KEYED:
                    return t
        return None

    def _new_block(
        self,
        key: BlockKey,
        parent: TrackedBlock | None,
        length: int,
        seg: array[int] | None,
        tier: str,
        salt_key: PrefixKey | None,
        twin: TrackedBlock | None,
    ) -> TrackedBlock:
        start = parent.depth if parent is not None else 0
        b = TrackedBlock(key, start, start + length, tier)
        if twin is not None:
            b.start, b.depth, b.state, b.prefix = twin.start, twin.depth, KEYED, twin.prefix
        elif salt_key is not None:
            b.state, b.prefix = KEYED, self._prefix(salt_key)
        elif parent is not None and parent.state != PENDING:
            b.state, b.prefix = parent.state, parent.prefix
        else:
            text_ok = parent is None or parent.tokens is not None
            if (
                text_ok
                and seg is not None
                and b.depth <= self.max_chain_tokens
                and len(seg) <= self.max_retained_tokens
            ):
                b.tokens = seg
            if parent is None:
                b.state, b.root = (PENDING, b) if b.tokens is not None else (UNATTRIBUTED, None)
            else:
                b.frontier = (
                    None
                    if b.tokens is not None
                    else (parent if parent.tokens is not None else parent.frontier)
                )
                if b.frontier is not None and b.frontier.insufficient:
                    b.frontier = None
                else:
                    b.state, b.parent, b.root = PENDING, parent, parent.root
                    if parent.children is None:
                        parent.children = set()
                    parent.children.add(b)
            if b.state == UNATTRIBUTED:
                self.unattributed_chains += 1
        if parent is not None:
            self._policy.touched(parent)
        self._nodes[key] = b
        self._counts[b.state] += 1
        if b.tokens is not None:
            self._retained += len(b.tokens)
        self._policy.added(b)
        if b.state == KEYED:
            self._account(b, 1)
        self._enforce()
        return b

    # -- removal and pruning -----------------------------------------------------------

    def _enforce(self) -> None:
        while len(self._nodes) > self.max_tracked_blocks:
            victim = self._policy.victim()
            if victim is None:
                break
            self.pruned += 1
            self._drop(victim)
        while self._retained > self.max_retained_tokens:
            victim = self._policy.victim(holding_tokens=True)
            if victim is None:
                break
            self.pruned += 1
            self._unattribute(victim)

    def _drop(self, b: TrackedBlock) -> None:
        """Remove one entry (engine removal or pruning); its pending subtree loses text."""
        del self._nodes[b.key]
        b.alive = False
        self._policy.removed(b)
        state = b.state
        self._counts[state] -= 1
        if state == KEYED:  # no tokens, parent or children (see _settle): only the counts
            p = b.prefix
            assert p is not None
            if b.tier == "gpu":  # _account(b, -1), inlined
                p.gpu_refs -= 1
                if not p.gpu_refs:
                    p.gpu_hw = 0
            else:
                p.storage_refs -= 1
                if not p.storage_refs:
                    p.storage_hw = 0
            self._touched[p] = None
            return
        self._release(b)
        self._detach(b)
        if state == PENDING:
            for child in list(b.children or ()):
                self._settle(child, UNATTRIBUTED, None, count=False)
            if b.root is b:
                self._queue.pop(b, None)
        b.children = b.dirty = b.root = b.frontier = None

    def _release(self, b: TrackedBlock) -> None:
        if b.tokens is not None:
            self._retained -= len(b.tokens)
            b.tokens = None
            self._policy.released(b)

    def _detach(self, b: TrackedBlock) -> None:
        if b.parent is not None:
            if b.parent.children is not None:
                b.parent.children.discard(b)
            b.parent = None

    def _settle(
        self, top: TrackedBlock, state: int, prefix: _Prefix | None, *, count: bool = True
    ) -> None:
        """Move ``top`` and its pending subtree to KEYED or UNATTRIBUTED."""
        if state == UNATTRIBUTED and count:
            self.unattributed_chains += 1
        self._detach(top)
        stack = [top]
        while stack:
            b = stack.pop()
            if b.state != PENDING or not b.alive:
                continue
            self._counts[PENDING] -= 1
            self._counts[state] += 1
            b.state, b.prefix = state, prefix
            self._release(b)
            if state == KEYED:
                self._account(b, 1)
            if b.children:
                stack.extend(b.children)
            if b.root is b:
                self._queue.pop(b, None)
            b.children = b.dirty = b.root = b.frontier = b.parent = None

    def _unattribute(self, top: TrackedBlock) -> None:
        self._settle(top, UNATTRIBUTED, None)

    def _kill_blocked(self, f: TrackedBlock) -> None:
        """``f``'s text is insufficient: children without text can never be keyed."""
        for child in list(f.children or ()):
            if child.tokens is None:
                self._unattribute(child)

    # -- prefixes and events -----------------------------------------------------------

    def _prefix(self, key: bytes) -> _Prefix:
        p = self._prefixes.get(key)
        if p is None:
            p = self._prefixes[key] = _Prefix(key)
        return p

    def _account(self, b: TrackedBlock, sign: int) -> None:
        p = b.prefix
        assert p is not None
        if b.tier == "gpu":
            p.gpu_refs += sign
            p.gpu_hw = max(p.gpu_hw, b.depth) if p.gpu_refs else 0
        else:
            p.storage_refs += sign
            p.storage_hw = max(p.storage_hw, b.depth) if p.storage_refs else 0
        self._touched[p] = None

    def _flush(self) -> None:
        touched, self._touched = self._touched, {}
        for p in touched:
            if p.gpu_refs + p.storage_refs == 0:
                if self._prefixes.get(p.key) is p:
                    del self._prefixes[p.key]
                if p.sent_tier is not None:
                    self._emit(KvEvent("cache_evicted", self.backend, p.hex))
                continue
            tier, count = ("gpu", p.gpu_hw) if p.gpu_refs else ("storage", p.storage_hw)
            if tier != p.sent_tier or count > p.sent_count:
                p.sent_tier, p.sent_count = tier, count
                self._emit(self._announce(p))

    def _announce(self, p: _Prefix) -> KvEvent:
        kind = "cache_created" if p.sent_tier == "gpu" else "cache_offloaded"
        return KvEvent(kind, self.backend, p.hex, p.sent_count, p.sent_tier)  # type: ignore[arg-type]

    def snapshot(self) -> list[KvEvent]:
        """The announced state of every live prefix, as created/offloaded events."""
        return [self._announce(p) for p in self._prefixes.values() if p.sent_tier is not None]

    def stats(self) -> dict[str, int]:
        """Gauges (tracked/pending/... now) and counters (since start)."""
        return {
            "tracked_blocks": len(self._nodes),
            "retained_tokens": self._retained,
            "attributed_prefixes": len(self._prefixes),
            "keyed_blocks": self._counts[KEYED],
            "pending_blocks": self._counts[PENDING],
            "unattributed_blocks": self._counts[UNATTRIBUTED],
            "unattributed_chains": self.unattributed_chains,
            "mismatches": self.mismatches,
            "salt_failures": self.salt_failures,
            "detokenize_failures": self.detokenize_failures,
            "pruned_entries": self.pruned,
            "orphan_blocks": self.orphans,
            "discarded_chains": self.discarded,
            "queued_roots": len(self._queue) + len(self._active),
        }

    def _warn_once(self, kind: str, message: str) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            log.warning("source %s: %s (further occurrences only counted)", self.backend, message)

    # -- attribution jobs --------------------------------------------------------------

    def _mark_dirty(self, leaf: TrackedBlock) -> None:
        root = leaf.root
        if root is None or not root.alive:
            return
        if root.dirty is None:
            root.dirty = {}
        if leaf.parent is not None:
            root.dirty.pop(leaf.parent, None)
        root.dirty[leaf] = None
        if root not in self._active:
            self._queue[root] = None
        self._kick()

    def _kick(self) -> None:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return  # no loop yet: ``idle``/the next apply inside a loop starts the workers
        if self._wake is None or self._idle is None:
            self._wake, self._idle = asyncio.Event(), asyncio.Event()
        self._workers = [t for t in self._workers if not t.done()]
        while len(self._workers) < self._concurrency:
            self._workers.append(asyncio.create_task(self._worker()))
        self._idle.clear()
        self._wake.set()

    async def idle(self) -> None:
        """Wait until no attribution work is queued or running."""
        while self._queue or self._busy:
            self._kick()
            assert self._idle is not None
            await self._idle.wait()

    async def aclose(self) -> None:
        """Stop the workers; the tracker can still ``apply`` (work queues up)."""
        workers, self._workers = self._workers, []
        for t in workers:
            t.cancel()
        await asyncio.gather(*workers, return_exceptions=True)

    async def _worker(self) -> None:
        assert self._wake is not None and self._idle is not None
        while True:
            if not self._queue:
                if not self._busy:
                    self._idle.set()
                self._wake.clear()
                await self._wake.wait()
                continue
            root = next(iter(self._queue))
            del self._queue[root]
            if not root.alive or not root.dirty:
                continue
            self._busy += 1
            self._active.add(root)
            try:
                await self._process(root)
            except Exception:
                log.exception("source %s: attribution job failed", self.backend)
            finally:
                self._busy -= 1
                self._active.discard(root)
                if root.alive and root.dirty and root.root is root:
                    self._queue[root] = None

    async def _process(self, root: TrackedBlock) -> None:
        gen = self._gen
        while root.alive and root.dirty and gen == self._gen:
            leaves = list(root.dirty)
            root.dirty.clear()
            for i, leaf in enumerate(leaves):
                if not leaf.alive or leaf.state != PENDING:
                    continue
                try:
                    await self._evaluate(leaf, gen)
                except DetokenizeError as exc:
                    self.detokenize_failures += 1
                    if gen != self._gen:
                        return
                    if not exc.retryable:
                        if leaf.alive and leaf.state == PENDING:
                            self._unattribute(leaf)
                        continue
                    self._failures += 1
                    if root.dirty is not None:
                        for again in leaves[i:]:
                            root.dirty[again] = None
                    delay = self._backoff.compute(self._failures)
                    self._warn_once("detokenize", f"detokenize failed ({exc}); retrying")
                    await asyncio.sleep(delay)
                    return
                if self._failures:
                    self._failures = 0
                    self._backoff.reset()

    async def _evaluate(self, leaf: TrackedBlock, gen: int) -> None:
        f = leaf if leaf.tokens is not None else leaf.frontier
        if f is None or not f.alive or f.state != PENDING:
            return
        if f.insufficient:
            self._kill_blocked(f)
            return
        path = self._path(f)
        if path is None:
            self._unattribute(leaf)
            return
        buf: array[int] = array("I")
        cum: list[int] = []
        for b in path:
            assert b.tokens is not None
            buf.extend(b.tokens)
            cum.append(len(buf))
        (res,) = await self._attributor.recover_many([buf])
        if gen != self._gen or not f.alive or f.state != PENDING:
            return
        if res is NEED_MORE:
            f.insufficient = True
            if f.depth >= self.max_chain_tokens:  # no child can add text: give it up
                self._unattribute(f)
            else:
                self._kill_blocked(f)
        elif not isinstance(res, Recovered):
            self._unattribute(f)
        else:
            d = await self._decision(path, cum, buf, res, gen)
            if d is not None and d.alive and d.state == PENDING:
                self._settle(d, KEYED, self._prefix(res.key))
                self._flush()

    def _path(self, f: TrackedBlock) -> list[TrackedBlock] | None:
        """root..f, all alive, pending and holding their tokens; None if broken."""
        path = []
        b: TrackedBlock | None = f
        while b is not None:
            if not b.alive or b.state != PENDING or b.tokens is None:
                return None
            path.append(b)
            if b.root is b:
                path.reverse()
                return path
            b = b.parent
        return None

    async def _decision(
        self,
        path: list[TrackedBlock],
        cum: list[int],
        buf: array[int],
        found: Recovered,
        gen: int,
    ) -> TrackedBlock | None:
        """The shallowest block on ``path`` whose text already yields ``found.key``.

        Decidability is monotone along a path, so this is a search between the deepest
        block known insufficient (``lo``) and the leaf (``hi``). The first round probes
        around the block where the anchor ended (interpolated from ``decided_at``), later
        rounds split the interval ``probe_fanout`` ways; each round is one batched call.
        """
        hi = len(path) - 1
        lo = next((i for i in range(hi - 1, -1, -1) if path[i].insufficient), -1)
        guess = bisect_left(cum, found.decided_at * cum[hi])
        for round_no in range(self._rounds):
            if hi - lo <= 1:
                break
            cands = [c for c in (guess - 1, guess) if lo < c < hi] if round_no == 0 else []
            if not cands:
                k = min(self._fanout, hi - lo - 1)
                cands = sorted({lo + (j + 1) * (hi - lo) // (k + 1) for j in range(k)})
                cands = [c for c in cands if lo < c < hi]
            results = await self._attributor.recover_many([buf[: cum[c]] for c in cands])
            if gen != self._gen:
                return None
            for c, r in zip(cands, results, strict=True):
                if isinstance(r, Recovered) and r.key == found.key:
                    hi = c
                    break
                lo = c
                if r is NEED_MORE:
                    path[c].insufficient = True
        return path[hi]

    # -- testing aid -------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Recompute every derived count from scratch and assert it (tests call this)."""
        retained = 0
        counts = [0, 0, 0]
        refs: dict[bytes, list[int]] = {}
        for key, b in self._nodes.items():
            assert b.key == key and b.alive
            counts[b.state] += 1
            if b.tokens is not None:
                assert b.state == PENDING and b.depth <= self.max_chain_tokens
                retained += len(b.tokens)
            if b.state == KEYED:
                assert b.prefix is not None and self._prefixes.get(b.prefix.key) is b.prefix
                r = refs.setdefault(b.prefix.key, [0, 0])
                r[b.tier != "gpu"] += 1
            else:
                assert b.prefix is None
            if b.state == PENDING:
                assert b.root is not None and b.root.alive and b.root.state == PENDING
                if b.parent is not None:
                    assert b.parent.alive and b in (b.parent.children or ())
                    assert b.tokens is None or b.parent.tokens is not None
                if b.tokens is None:  # blocked: waits on a live, undecided frontier
                    f = b.frontier
                    assert f is not None and f.alive and f.state == PENDING
                    assert f.tokens is not None and not f.insufficient
            else:
                assert b.parent is None and not b.children and b.tokens is None
        assert retained == self._retained and counts == self._counts
        bound = min(self.max_retained_tokens, self.max_tracked_blocks * self.max_chain_tokens)
        assert retained <= bound and len(self._nodes) <= self.max_tracked_blocks
        assert set(refs) == set(self._prefixes)
        for k, (gpu, storage) in refs.items():
            p = self._prefixes[k]
            assert (p.gpu_refs, p.storage_refs) == (gpu, storage)
