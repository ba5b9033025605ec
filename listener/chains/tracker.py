"""``ChainTracker``: one source's engine block events in, prefix-level ``KvEvent``s out.

The facade over the package's parts: ``apply`` turns each engine event into changes of
the ``BlockStore`` (``blocks``), queues pending chains for the ``AttributionJobs``
(``attribution``) and has the ``PrefixLedger`` (``prefixes``) announce the outcome once
per batch. ``apply`` runs on the ingestion path: it is synchronous, does O(blocks in the
event) work and never waits for I/O. Most stored events are one block under a parent that
is already keyed (or unattributed); ``_extend`` takes those on a short path of its own.

**Engine block sizes** (``_segments``). SGLang: ``len(token_ids) == block_size * n``.
vLLM, full-block path: tokens are contiguous but null blocks (sliding window, Mamba
align mode) are left out of ``block_hashes``, so ``len(token_ids)`` may be a larger
multiple of ``block_size``; null blocks are the oldest (out-of-window) ones, so the first
hash's segment absorbs the extra spans and the path text stays exact. A single hash with
one ``block_size`` segment is the partial-block path. TensorRT-LLM gives per-block counts.
Anything else is a mismatch: tracked as length only, counted per event, warned once.

**Salts.** A root whose first block carries a router salt is keyed at once (``from_salt``);
a bad MAC discards the chain (and its later blocks are orphans).

**Conversation keys** (``conversation``, when ``conversation`` settings are given): every
new block also gets its chain node from its parent's, on the same pass (the fast path
included), and every flush announces the chain keys that changed after the prefixes. A
chain with neither a salt nor a detokenizer is then tracked (for its chain keys) instead
of discarded.
"""

from __future__ import annotations

import logging
from array import array
from collections.abc import Callable, Iterator
from typing import Literal, cast

from bus.backoff import Backoff, ExponentialBackoff
from bus.events import KvEvent
from bus.prefix_key import PrefixKey
from bus.salt import SaltError
from listener.engine_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineEvent,
    EventBatch,
)

from .attribution import AttributionJobs, ChainAttributor
from .blocks import BlockKey, BlockStore, LruPolicy, PruningPolicy, TrackedBlock
from .conversation import ChainBlock, ConversationLedger, ConversationSettings
from .prefixes import PrefixLedger
from .states import KEYED, PENDING, UNATTRIBUTED

__all__ = ["ChainTracker"]

log = logging.getLogger("listener.chains")  # the package's logger, one for all its parts

_GPU = "GPU"


class ChainTracker:
    """Engine block chains of one source -> prefix ``KvEvent``s (see ``listener.chains``).

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
        conversation: compute and announce conversation keys (None: prefix keys only).
        on_fault: called with ``"tracker_error"`` after an event raised (it is dropped and
            counted in ``failed_events``): the owner resyncs the backend (``reset``, then
            ``resync`` and the snapshot to subscribers). None: the tracker resets and emits
            the ``resync`` itself.
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
        conversation: ConversationSettings | None = None,
        on_fault: Callable[[str], None] | None = None,
    ) -> None:
        if min(max_chain_tokens, max_tracked_blocks, max_retained_tokens, concurrency) < 1:
            raise ValueError("limits and concurrency must be positive")
        self.backend, self.engine = backend, engine
        self._emit, self._attributor = emit, attributor
        self.max_chain_tokens = max_chain_tokens
        self.max_tracked_blocks = max_tracked_blocks
        self.max_retained_tokens = max_retained_tokens
        self._ledger = PrefixLedger(backend, emit)
        queue: dict[TrackedBlock, None] = {}
        self._blocks = BlockStore(
            self._ledger,
            queue,
            policy if policy is not None else LruPolicy(),
            max_chain_tokens=max_chain_tokens,
            max_tracked_blocks=max_tracked_blocks,
            max_retained_tokens=max_retained_tokens,
        )
        self._jobs = AttributionJobs(
            backend,
            attributor,
            self._blocks,
            self._ledger,
            queue,
            self._warn_once,
            concurrency=concurrency,
            backoff=backoff if backoff is not None else ExponentialBackoff(),
            probe_fanout=probe_fanout,
            max_probe_rounds=max_probe_rounds,
        )
        # The parts' tables the ingestion path uses on every event, held directly (they
        # keep their identity): one attribute load each instead of two.
        self._nodes = self._blocks.nodes
        self._counts = self._blocks.counts
        self._touched = self._ledger.touched
        self._policy: PruningPolicy = self._blocks.policy
        self._lru = cast(LruPolicy, self._policy) if type(self._policy) is LruPolicy else None
        """The default policy, whose bookkeeping ``_extend`` inlines."""
        self._media: dict[tuple[int, int], set[str]] = {}
        self._mixed_media = False
        """Some (dp rank, group) has blocks in more than one medium (twins possible)."""
        self._warned: set[str] = set()
        self.mismatches = self.salt_failures = self.orphans = self.discarded = 0
        self.failed_events = 0
        self._on_fault = on_fault
        self._conv: ConversationLedger | None = None
        self._block: type[TrackedBlock] = TrackedBlock
        """The class of new blocks: ``ChainBlock`` (a block with its chain node) in
        conversation mode."""
        if conversation is not None:
            self._block = ChainBlock
            self._conv = ConversationLedger(backend, emit, conversation, self._warn_once)
            self._blocks.chains = self._conv  # type: ignore[assignment]  # its blocks are ChainBlocks
            self._blocks.chain_copy = self._chain_twin

    # Counters kept by the parts, readable here as before the split.

    @property
    def pruned(self) -> int:
        return self._blocks.pruned

    @property
    def unattributed_chains(self) -> int:
        return self._blocks.unattributed_chains

    @property
    def detokenize_failures(self) -> int:
        return self._jobs.detokenize_failures

    # -- ingestion ---------------------------------------------------------------------

    def apply(self, batch: EventBatch, *, flush: bool = True) -> None:
        """Apply one decoded engine batch; emits events synchronously. Never blocks.

        ``flush=False`` leaves the prefix events of this batch to the next ``flush`` (or
        flushing ``apply``): a source draining a backlog of batches that are all already
        there announces their end state once, not every intermediate one.
        """
        # One event that raises (a bug, a value no check foresaw) costs that event and a
        # resync of the backend, not the rest of the batch: the loop goes on from the
        # next event, on the state the resync left.
        events = iter(batch.events)
        while True:
            try:
                self._apply(batch.dp_rank or 0, events)
            except Exception:
                self._event_failed()
            else:
                break
        # Once per batch, not per event: a batch is one scheduler step, and subscribers
        # need its outcome, not every intermediate state (the final state is the same).
        if flush:
            self.flush()

    def _apply(self, dp: int, events: Iterator[EngineEvent]) -> None:
        """``apply``'s loop: consumes ``events`` up to the end or to the event that raises."""
        for ev in events:
            kind = type(ev)
            if kind is BlockStored:
                if not self._extend(dp, ev):  # type: ignore[arg-type]
                    self._stored(dp, ev)  # type: ignore[arg-type]
            elif kind is BlockRemoved:
                medium = (ev.medium or _GPU).upper()  # type: ignore[union-attr]
                for h in ev.block_hashes:  # type: ignore[union-attr]
                    b = self._nodes.get((dp, ev.group_idx, medium, h))  # type: ignore[union-attr]
                    if b is not None:
                        self._blocks.drop(b)
            elif kind is AllBlocksCleared:
                self.flush()
                self.reset()
                self._emit(KvEvent("cache_cleared", self.backend))

    def _event_failed(self) -> None:
        """Count the event that raised, then resync: the parts may be half updated."""
        self.failed_events += 1
        if "event" not in self._warned:
            self._warned.add("event")
            log.exception(
                "source %s: an engine event failed; dropped and resynced"
                " (further failures only counted)",
                self.backend,
            )
        if self._on_fault is not None:
            self._on_fault("tracker_error")
        else:
            self.reset()
            self._emit(KvEvent("resync", self.backend, reason="tracker_error"))

    def flush(self) -> None:
        """Announce what changed since the last announcement (see ``apply``)."""
        self._ledger.flush()
        if self._conv is not None:
            self._conv.flush()

    def reset(self) -> None:
        """Forget everything without per-prefix events (the source sends ``resync``)."""
        self._jobs.reset()
        self._blocks.clear()
        self._media.clear()
        self._mixed_media = False
        self._ledger.clear()

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
        b = self._block(key, start, depth, tier, state, p)  # born in the parent's state
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
        if p is not None:  # KEYED: PrefixLedger.account(b, 1), inlined
            if tier == "gpu":
                p.gpu_refs += 1
                if depth > p.gpu_hw:
                    p.gpu_hw = depth
            else:
                p.storage_refs += 1
                if depth > p.storage_hw:
                    p.storage_hw = depth
            self._touched[p] = None
        conv = self._conv
        if conv is not None and prev.chain_key is not None:
            conv.child(prev, b, ev.token_ids)  # type: ignore[arg-type]
        if len(nodes) > self.max_tracked_blocks:
            blocks = self._blocks
            victim = self._policy.victim()  # one in, one out
            if victim is not None:
                blocks.pruned += 1
                blocks.drop(victim)
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
            if salt_key is None and not self._attributor.can_detokenize and self._conv is None:
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
            begin = offset
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
            parent = prev
            prev = last = self._new_block(
                key, prev, lengths[i], seg, tier, salt_key if i == 0 else None, twin
            )
            if self._conv is not None and last.alive:
                ids = ev.token_ids[begin:offset] if exact else None
                self._chain_of(last, parent, ev, ids, root_event and i == 0)  # type: ignore[arg-type]
        if last is not None and last.alive and last.state == PENDING:
            self._jobs.mark_dirty(last)

    def _chain_of(
        self,
        b: ChainBlock,
        parent: ChainBlock | None,
        ev: BlockStored,
        ids: list[int] | None,
        first: bool,
    ) -> None:
        """Give the new block ``b`` its chain node (see ``conversation``), if it can have one."""
        conv = self._conv
        assert conv is not None
        if ids is None:
            if ev.token_ids:
                conv.mismatch()
                return
            twin = self._chain_twin(b.key)  # no tokens: a copy of a block we know?
            if twin is not None:
                conv.copy(twin, b)
                return
        if ids and min(ids) < 0:  # the ZMQ decoders refuse these; trtllm's JSON may not
            conv.unmapped()
            return
        if parent is not None:
            if parent.chain_key is not None:
                conv.child(parent, b, ids)
            return
        if first:
            conv.start(b, ids, ev.cache_salt, ev.lora_name, ev.lora_id)
            return
        twin = self._chain_twin(b.key)
        if twin is not None:
            conv.copy(twin, b)

    def _chain_twin(self, key: BlockKey) -> ChainBlock | None:
        """The same block in another medium, if it has a live chain node."""
        dp, group, medium, h = key
        for m in self._media.get((dp, group), ()):
            if m != medium:
                t = self._nodes.get((dp, group, m, h))
                if t is not None and t.chain_key is not None:
                    return t  # type: ignore[return-value]
        return None

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
        """Create and track the block ``key``, born in the state its position decides."""
        start = parent.depth if parent is not None else 0
        depth = start + length
        prefix = None
        tokens = frontier = None
        if twin is not None:
            start, depth, state, prefix = twin.start, twin.depth, KEYED, twin.prefix
        elif salt_key is not None:
            state, prefix = KEYED, self._ledger.prefix(salt_key)
        elif parent is not None and parent.state != PENDING:
            state, prefix = parent.state, parent.prefix
        else:
            if (
                (parent is None or parent.tokens is not None)
                and seg is not None
                and depth <= self.max_chain_tokens
                and len(seg) <= self.max_retained_tokens
            ):
                tokens = seg
            if parent is None:
                state = PENDING if tokens is not None else UNATTRIBUTED
            elif tokens is not None:
                state = PENDING
            else:  # blocked: waits on the deepest ancestor with text, unless that gave up
                frontier = parent if parent.tokens is not None else parent.frontier
                state = UNATTRIBUTED if frontier is not None and frontier.insufficient else PENDING
            if state == UNATTRIBUTED:
                self._blocks.unattributed_chains += 1
        b = self._block(key, start, depth, tier, state, prefix)
        if state == PENDING:
            b.tokens, b.frontier = tokens, frontier
            if parent is None:
                b.root = b
            else:
                b.parent, b.root = parent, parent.root
                if parent.children is None:
                    parent.children = set()
                parent.children.add(b)
        if parent is not None:
            self._policy.touched(parent)
        self._blocks.add(b)
        return b

    # -- what the listener reads ---------------------------------------------------------

    def snapshot(self) -> list[KvEvent]:
        """The announced state of every live prefix (and chain key), as created/offloaded
        events."""
        if self._conv is None:
            return self._ledger.snapshot()
        return self._ledger.snapshot() + self._conv.snapshot()

    def stats(self) -> dict[str, int]:
        """Gauges (tracked/pending/... now) and counters (since start)."""
        blocks, counts = self._blocks, self._counts
        return {
            "tracked_blocks": len(self._nodes),
            "retained_tokens": blocks.retained,
            "attributed_prefixes": len(self._ledger.prefixes),
            "keyed_blocks": counts[KEYED],
            "pending_blocks": counts[PENDING],
            "unattributed_blocks": counts[UNATTRIBUTED],
            "unattributed_chains": blocks.unattributed_chains,
            "mismatches": self.mismatches,
            "salt_failures": self.salt_failures,
            "detokenize_failures": self._jobs.detokenize_failures,
            "pruned_entries": blocks.pruned,
            "orphan_blocks": self.orphans,
            "discarded_chains": self.discarded,
            "failed_events": self.failed_events,
            "queued_roots": self._jobs.queued,
        } | ({} if self._conv is None else self._conv.stats())

    def _warn_once(self, kind: str, message: str) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            log.warning("source %s: %s (further occurrences only counted)", self.backend, message)

    # -- attribution -------------------------------------------------------------------

    async def idle(self) -> None:
        """Wait until no attribution work is queued or running."""
        await self._jobs.idle()

    async def aclose(self) -> None:
        """Stop the workers; the tracker can still ``apply`` (work queues up)."""
        await self._jobs.aclose()

    # -- testing aid -------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Recompute every derived count from scratch and assert it (tests call this)."""
        self._blocks.check_invariants()
