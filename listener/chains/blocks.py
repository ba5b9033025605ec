"""Tracked blocks, the bounds on how many there are and what they retain, and pruning.

**Blocks.** Each stored engine block becomes a ``TrackedBlock`` keyed by
``(dp_rank, group_idx, medium, hash)``: engine hashes are only unique per engine instance,
dp rank and KV-cache group, and a GPU block and its CPU/disk copy share a hash. A block
keeps its *own* token segment (``array('I')``), a parent reference and its depth (tokens
from the root), never a copy of the whole chain, and only while that is useful: what it
holds depends on its state (``states``), and every state change goes through
``TrackedBlock.transition``.

**Memory.** ``max_tracked_blocks`` bounds entries and ``max_retained_tokens`` bounds
retained token IDs; only PENDING blocks retain tokens, each at most ``max_chain_tokens``
(a block retains tokens only if it ends within the cap). When a bound is exceeded, single
entries are pruned in the ``PruningPolicy``'s order (LRU by default: insertion order,
refreshed when a block is re-stored or gains a child): for the block bound the victim is
removed, for the token bound the oldest token holder loses its text (it and its pending
descendants become unattributed). Never a whole backend; a prefix goes (``cache_evicted``)
only when its last block goes. Hence at all times, per source::

    retained token IDs <= min(max_retained_tokens, max_tracked_blocks * max_chain_tokens)

With conversation mode on, every block is a ``conversation.ChainBlock``, whose node in the
conversation key chain keeps at most one partial chunk of bytes, bounded by that module's
``max_retained_bytes``; dropping a block withdraws its node there.

``BlockStore`` owns the entries and these mechanics: adding a block, removing one (its
pending subtree loses the text above it), moving a pending subtree out of PENDING
(``settle``), and the per-state counts ``stats`` reports.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Protocol

from listener.engine_events import BlockHash

from .prefixes import Prefix, PrefixLedger
from .states import KEYED, PENDING, TRANSITIONS, UNATTRIBUTED, BlockState, Cause, IllegalTransition

__all__ = ["BlockKey", "BlockStore", "ChainNodes", "LruPolicy", "PruningPolicy", "TrackedBlock"]

BlockKey = tuple[int, int, str, BlockHash]
"""(dp_rank, group_idx, medium, engine hash)."""


class TrackedBlock:
    """One engine block as the tracker sees it (see ``states`` for what each state holds).

    ``state`` is set at birth and afterwards only by ``transition``.
    """

    __slots__ = (
        "alive",
        "chain_key",
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
        state: BlockState = UNATTRIBUTED,
        prefix: Prefix | None = None,
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
        self.chain_key: bytes | None = None
        """Conversation mode: the last full chunk's key of the block's node in its key
        chain (``conversation.ChainBlock``); None while it has none."""

    def transition(self, cause: Cause, prefix: Prefix | None = None) -> BlockState:
        """Change state for ``cause`` as ``TRANSITIONS`` says; returns the new state.

        ``prefix`` is the key's counts when the new state is KEYED (None otherwise).
        Raises ``IllegalTransition``, leaving the block as it was, when the table has no
        such change from the current state.
        """
        try:
            to = TRANSITIONS[self.state][cause]
        except KeyError:
            raise IllegalTransition(self.state, cause) from None
        self.state, self.prefix = to, prefix
        return to


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


class ChainNodes(Protocol):
    """The conversation keys' side of the store (``conversation.ConversationLedger``, whose
    blocks are its ``ChainBlock``s): told when a block with a chain node goes."""

    def drop(self, b: TrackedBlock, copy: TrackedBlock | None) -> None: ...
    def clear(self) -> None: ...
    def check_invariants(self, blocks: Iterable[TrackedBlock], max_nodes: int) -> None: ...


class BlockStore:
    """The tracked blocks of one source, within the entry and token bounds.

    Args:
        ledger: the prefix counts that keyed blocks add to (and remove from).
        queue: the roots waiting for an attribution job (shared with the jobs); a root
            leaves it when its chain is settled or removed.
        policy: pruning order.
        max_chain_tokens, max_tracked_blocks, max_retained_tokens: see the module docstring.

    ``nodes``, ``counts`` (per ``BlockState``) and ``policy`` keep their identity for the
    store's lifetime, so the tracker's fast path may hold them.
    """

    def __init__(
        self,
        ledger: PrefixLedger,
        queue: dict[TrackedBlock, None],
        policy: PruningPolicy,
        *,
        max_chain_tokens: int,
        max_tracked_blocks: int,
        max_retained_tokens: int,
    ) -> None:
        self._ledger = ledger
        self._touched = ledger.touched
        self._queue = queue
        self.policy = policy
        self.max_chain_tokens = max_chain_tokens
        self.max_tracked_blocks = max_tracked_blocks
        self.max_retained_tokens = max_retained_tokens
        self.nodes: dict[BlockKey, TrackedBlock] = {}
        self.counts = [0, 0, 0]
        self.retained = 0
        """Token IDs held by all blocks."""
        self.pruned = 0
        """Entries removed or stripped of their text by the bounds (since start)."""
        self.unattributed_chains = 0
        """Chains given up since start: one per ``unattribute``, and one per block born
        UNATTRIBUTED that does not extend an unattributed chain."""
        self.chains: ChainNodes | None = None
        """Conversation keys (when on): a dropped block's node is withdrawn there."""
        self.chain_copy: Callable[[BlockKey], TrackedBlock | None] = lambda key: None
        """A copy of the block ``key`` in another medium that has a live chain node."""

    def add(self, b: TrackedBlock) -> None:
        """Track the new block ``b`` (its state, links and tokens set), then the bounds."""
        self.nodes[b.key] = b
        self.counts[b.state] += 1
        if b.tokens is not None:
            self.retained += len(b.tokens)
        self.policy.added(b)
        if b.state == KEYED:
            self._ledger.account(b, 1)
        self.enforce()

    def enforce(self) -> None:
        """Prune single entries in policy order until both bounds hold again."""
        while len(self.nodes) > self.max_tracked_blocks:
            victim = self.policy.victim()
            if victim is None:
                break
            self.pruned += 1
            self.drop(victim)
        while self.retained > self.max_retained_tokens:
            victim = self.policy.victim(holding_tokens=True)
            if victim is None:
                break
            self.pruned += 1
            self.unattribute(victim, Cause.TEXT_PRUNED)

    def drop(self, b: TrackedBlock) -> None:
        """Remove one entry (engine removal or pruning); its pending subtree loses text."""
        del self.nodes[b.key]
        b.alive = False
        self.policy.removed(b)
        if b.chain_key is not None:  # conversation mode: b is a ChainBlock
            self.chains.drop(b, self.chain_copy(b.key))  # type: ignore[union-attr]
        state = b.state
        self.counts[state] -= 1
        if state == KEYED:  # no tokens, parent or children (see settle): only the counts
            p = b.prefix
            assert p is not None
            if b.tier == "gpu":  # PrefixLedger.account(b, -1), inlined
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
                self.settle(child, Cause.ANCESTOR_REMOVED)
            if b.root is b:
                self._queue.pop(b, None)
        b.children = b.dirty = b.root = b.frontier = None

    def _release(self, b: TrackedBlock) -> None:
        if b.tokens is not None:
            self.retained -= len(b.tokens)
            b.tokens = None
            self.policy.released(b)

    @staticmethod
    def _detach(b: TrackedBlock) -> None:
        if b.parent is not None:
            if b.parent.children is not None:
                b.parent.children.discard(b)
            b.parent = None

    def settle(self, top: TrackedBlock, cause: Cause, prefix: Prefix | None = None) -> None:
        """Move ``top`` and its pending subtree out of PENDING for ``cause`` (to KEYED with
        ``prefix``, or to UNATTRIBUTED); blocks no longer pending are left alone."""
        self._detach(top)
        counts = self.counts
        stack = [top]
        while stack:
            b = stack.pop()
            if b.state != PENDING or not b.alive:
                continue
            state = b.transition(cause, prefix)
            counts[PENDING] -= 1
            counts[state] += 1
            self._release(b)
            if state == KEYED:
                self._ledger.account(b, 1)
            if b.children:
                stack.extend(b.children)
            if b.root is b:
                self._queue.pop(b, None)
            b.children = b.dirty = b.root = b.frontier = b.parent = None

    def unattribute(self, top: TrackedBlock, cause: Cause) -> None:
        """Give ``top``'s chain up for ``cause``: it and its pending subtree can never be
        keyed (one more unattributed chain)."""
        self.unattributed_chains += 1
        self.settle(top, cause)

    def kill_blocked(self, f: TrackedBlock) -> None:
        """``f``'s text is insufficient: children without text can never be keyed."""
        for child in list(f.children or ()):
            if child.tokens is None:
                self.unattribute(child, Cause.TEXT_INSUFFICIENT)

    def clear(self) -> None:
        """Forget every entry; jobs still holding one see that it is gone."""
        for b in self.nodes.values():
            b.alive = False
        self.nodes.clear()
        self.policy.clear()
        if self.chains is not None:
            self.chains.clear()
        self.counts[:] = (0, 0, 0)
        self.retained = 0

    def check_invariants(self) -> None:
        """Recompute every derived count from scratch and assert it, and the state
        invariants of ``states``, and the ledger's counts."""
        retained = 0
        counts = [0, 0, 0]
        refs: dict[bytes, list[int]] = {}
        prefixes = self._ledger.prefixes
        for key, b in self.nodes.items():
            assert b.key == key and b.alive
            counts[b.state] += 1
            if b.tokens is not None:
                assert b.state == PENDING and b.depth <= self.max_chain_tokens
                retained += len(b.tokens)
            if b.state == KEYED:
                assert b.prefix is not None and prefixes.get(b.prefix.key) is b.prefix
                r = refs.setdefault(b.prefix.key, [0, 0])
                r[b.tier != "gpu"] += 1
            else:
                assert b.prefix is None
            if b.state == PENDING:
                assert b.root is not None and b.root.alive and b.root.state == PENDING
                if b.parent is not None:
                    assert b.parent.alive and b in (b.parent.children or ())
                    assert b.parent.state == PENDING
                    assert b.tokens is None or b.parent.tokens is not None
                if b.tokens is None:  # blocked: waits on a live, undecided frontier
                    f = b.frontier
                    assert f is not None and f.alive and f.state == PENDING
                    assert f.tokens is not None and not f.insufficient
            else:
                assert b.parent is None and not b.children and b.tokens is None
        assert retained == self.retained and counts == self.counts
        bound = min(self.max_retained_tokens, self.max_tracked_blocks * self.max_chain_tokens)
        assert retained <= bound and len(self.nodes) <= self.max_tracked_blocks
        self._ledger.check_invariants(refs)
        if self.chains is not None:
            self.chains.check_invariants(self.nodes.values(), self.max_tracked_blocks)
        else:
            assert all(b.chain_key is None for b in self.nodes.values())
