"""Conversation keys: every stored block's place in its prompt's key chain, announced.

With conversation mode on, each tracked block is a ``ChainBlock``: besides what the tracker
keeps, it holds its *node*, the state of the prompt key chain (``bus.prompt_chain``) after
the block's bytes, which it derives from its parent's (``extend``), plus the keys whose
chunk it completed. The bytes of a block are its tokens' raw bytes
(``listener.token_bytes``), so the chain over a path of blocks is the chain of the prompt
text the engine tokenized, and key ``i`` is the router's key ``i`` of the same rendered
prompt.

**What a key means.** A node *holds* the keys it completed while it and every ancestor
are stored: then every token up to the end of key ``i``'s chunk is in stored blocks. A
key's ``token_count`` is the number of tokens lying wholly within its first ``(i+1) *
chunk_bytes`` bytes (tokens before the block, plus the block's own that end at or before
the chunk's end). A node's tier is gpu when it and every ancestor are GPU blocks, storage
otherwise. Keys are counted per tier (``ChainRef``): two paths that share text (a GPU
block and its CPU copy, a conversation and its sibling, two tokenizations of one text)
share keys, and a key is announced once while any reference holds it:

* ``chain_created`` (tier gpu) when a GPU node first holds it, or again after it was
  storage only;
* ``chain_offloaded`` (tier storage) while only non-GPU nodes hold it;
* ``chain_evicted`` when the last reference goes.

Every flush announces withdrawals first, deepest first, then new keys shallowest first,
so a subscriber applying the records in order never sees a key held without its
predecessors (a backend's keys stay prefix-closed).

**Copies.** A copy of a block in another medium (CPU, disk) has its own node with the
same state and keys, placed beside the original (under the same parent): vLLM's
offloading connector announces copies without parent or tokens, so the original is how
the listener knows where a copy stands.

**Removal.** When a block goes (the engine removed it, or the tracker pruned it) and a
copy of it remains, its children move under the copy (and count as storage from there);
otherwise its node and every descendant's are withdrawn: the text in front of them is no
longer whole. A withdrawn block has no node any more: nothing is derived from it again,
even if the engine stores the missing ancestor once more. So a node's ancestors always
spell the text in front of it, and a backend's keys stay prefix-closed.

**No keys.** A block gets no node (``chain_key`` stays None), and nothing under it gets
one, when its chain's root is unknown (no ``model`` configured, a LoRA adapter without a
name), when its token ids are missing, do not split into the engine's block size, or do
not map through the table. Each kind is counted in ``stats`` and warned about once.

**Cost.** This runs for every stored block on the ingestion path, so the node lives in
the block object itself (slots of ``ChainBlock``, no second object per block) and keeps
its chain state (``bus.prompt_chain.ChainState``: the last full chunk's key, the bytes
after it, the length) as a rope: the key (shared with the parent until a chunk completes),
the length, and only the bytes the block itself adds after the last chunk boundary
(``chain_data``, one ``bytes.join`` over the table); the partial chunk is the
``chain_data`` of the nodes from the one that crossed the boundary down to this one.
``extend`` runs only for a block that completes a chunk (then the partial chunk is
gathered, at most one chunk of bytes); any other block costs its own bytes and a few slot
stores, never a copy of the partial chunk.

**Memory.** Nodes exist only for tracked blocks (``max_tracked_blocks`` bounds them). Each
node keeps fewer than ``chunk_bytes`` bytes of ``chain_data``; those count against
``max_retained_bytes``, and beyond it nodes lose them, oldest first with a second chance
for those extended since (a clock over the nodes with bytes, linked through their blocks):
such a node keeps its keys, but nothing that needs the bytes derives from it or from below
it within the chunk.
Hence at all times, per source::

    retained chain bytes <= min(max_retained_bytes, max_tracked_blocks * (chunk_bytes - 1))
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from operator import itemgetter

from bus.events import KvEvent
from bus.prompt_chain import ChainKey, chain_root, extend_pieces
from bus.salt import caller_salt
from listener.token_bytes import TokenBytes, UnmappedToken

from .blocks import TrackedBlock

__all__ = ["ChainBlock", "ChainRef", "ConversationLedger", "ConversationSettings"]

_NO_KEYS: tuple[ChainRef, ...] = ()


@dataclass(frozen=True, slots=True)
class ConversationSettings:
    """What a source's tracker needs to compute conversation keys."""

    table: TokenBytes
    """Token id -> bytes of the source's tokenizer (shared by sources naming one file)."""
    model: str | None
    """The source's served model name, the root of every chain (None: no keys at all)."""
    chunk_bytes: int = 1024
    """Must equal the router's ``kv_cache_index.conversation.chunk_bytes``."""
    max_retained_bytes: int = 64 << 20


class ChainRef:
    """One chain key of the backend: who holds it, per tier, and what was announced."""

    __slots__ = ("gpu_refs", "hex", "key", "sent_tier", "storage_refs", "token_count")

    def __init__(self, key: bytes, token_count: int) -> None:
        self.key, self.hex, self.token_count = key, key.hex(), token_count
        self.gpu_refs = self.storage_refs = 0
        self.sent_tier: str | None = None


class ChainBlock(TrackedBlock):
    """A tracked block with its node in the conversation key chain (module docstring).

    The node is live while ``chain_key`` (``TrackedBlock``'s slot) is set: the chain's
    state after the block is ``chain_key`` (the last full chunk's key) and
    ``chain_length`` (every byte so far); ``chain_data`` the bytes it adds after the last
    chunk boundary (the rope), None once the byte bound took them. ``chain_after`` is the
    tokenizer's leading-space flag after the block (``TokenBytes.convert``),
    ``chain_tier`` the node's tier (storage below any non-GPU ancestor), ``chain_keys``
    the keys it completed. The node tree is ``chain_parent`` and a doubly linked sibling
    list (``chain_child``, ``chain_next``, ``chain_prev``): O(1) to link and unlink,
    whatever the fan-out under a shared system prompt. ``chain_used``: a child derived
    from it since the byte bound's clock last passed (a second chance); ``chain_older``
    and ``chain_newer`` link the nodes that keep bytes, oldest first, for that clock.

    The ledger sets every ``chain_*`` slot when it gives the block a node, and clears the
    references when it withdraws it; a block that never had one leaves them unset (no
    cost on the ingestion path), so only a block with ``chain_key`` set is read.
    """

    __slots__ = (
        "chain_after",
        "chain_child",
        "chain_data",
        "chain_keys",
        "chain_length",
        "chain_newer",
        "chain_next",
        "chain_older",
        "chain_parent",
        "chain_prev",
        "chain_tier",
        "chain_used",
    )

    chain_after: bool
    chain_child: ChainBlock | None
    chain_data: bytes | None
    chain_keys: tuple[ChainRef, ...]
    chain_length: int
    chain_newer: ChainBlock | None
    chain_next: ChainBlock | None
    chain_older: ChainBlock | None
    chain_parent: ChainBlock | None
    chain_prev: ChainBlock | None
    chain_tier: str
    chain_used: bool

    def chain_children(self) -> Iterator[ChainBlock]:
        c = self.chain_child
        while c is not None:
            yield c
            c = c.chain_next


class ConversationLedger:
    """The chain nodes and keys of one source's blocks, and what subscribers were told.

    Args:
        backend: the source's backend name (events carry it).
        emit: called synchronously with every ``KvEvent``.
        settings: table, model, chunk size and byte bound.
        warn_once: logs a warning the first time per kind.
    """

    def __init__(
        self,
        backend: str,
        emit: Callable[[KvEvent], None],
        settings: ConversationSettings,
        warn_once: Callable[[str, str], None],
    ) -> None:
        if not 1 <= settings.chunk_bytes or settings.max_retained_bytes < 1:
            raise ValueError("chunk_bytes and max_retained_bytes must be positive")
        self.backend, self._emit, self._warn_once = backend, emit, warn_once
        self.table, self.model = settings.table, settings.model
        self.chunk_bytes = settings.chunk_bytes
        self.max_retained_bytes = settings.max_retained_bytes
        self._stateless = settings.table.stateless
        self._join = settings.table.join
        self._pieces = settings.table.table
        self.refs: dict[bytes, ChainRef] = {}
        self.touched: dict[ChainRef, None] = {}
        self._oldest: ChainBlock | None = None
        self._newest: ChainBlock | None = None
        """The byte bound's clock: the nodes with bytes (non-empty ``chain_data``), oldest
        first, linked through the blocks themselves (``chain_older``/``chain_newer``), so a
        withdrawn node leaves it at once. A queue of its own kept the blocks of withdrawn
        nodes alive until it was compacted, which cost the cyclic GC about 1 us per event
        at 100,000 blocks."""
        self.retained = 0
        """Bytes kept by all nodes (their ``chain_data``)."""
        self.live = 0
        self.counts = {
            "no_root": 0,
            "missing_tokens": 0,
            "mismatched_tokens": 0,
            "unmapped_tokens": 0,
            "bytes_pruned": 0,
        }

    # -- building nodes -----------------------------------------------------------------

    def start(
        self,
        b: ChainBlock,
        ids: Sequence[int] | None,
        cache_salt: str | None,
        lora_name: str | None,
        lora_id: int | None,
    ) -> None:
        """Give ``b``, a chain's first block (no parent), its node, or none (counted)."""
        if self.model is None or (lora_id is not None and lora_name is None):
            self.counts["no_root"] += 1
            self._warn_once(
                "chain_root",
                "conversation keys need the source's model (and a LoRA adapter's name); "
                "chains without them get none",
            )
            return
        root = chain_root(self.model, caller_salt(cache_salt), lora_name)
        self._derive(b, None, root, 0, True, ids, b.tier, 0)

    def child(self, parent: ChainBlock, b: ChainBlock, ids: Sequence[int] | None) -> None:
        """Give ``b``, stored under ``parent``'s block (which has a node), its node, or none.

        ``ids`` must not be negative (the decoders' contract: a negative id would index the
        table from its end); the caller checks ids of unknown origin (``unmapped``).

        This is the ingestion path's one per-block step, so the common case (a stateless
        table, no chunk completed) is written out in full here; ``_derive`` is the same
        for every case.
        """
        if parent.chain_data is None:
            return
        tier = b.tier if parent.chain_tier == "gpu" else "storage"
        if not self._stateless or not ids or len(ids) == 1:
            key = parent.chain_key
            assert key is not None
            if self._derive(b, parent, key, parent.chain_length, parent.chain_after, ids, tier,
                            b.start):  # fmt: skip
                parent.chain_used = True
            return
        try:
            data = b"".join(itemgetter(*ids)(self._pieces))
        except (IndexError, TypeError):
            self.unmapped()
            return
        length, size, c = parent.chain_length, len(data), self.chunk_bytes
        if length % c + size < c:
            b.chain_key = parent.chain_key
            b.chain_keys = _NO_KEYS
            b.chain_data = data
            b.chain_length = length + size
        else:
            key = parent.chain_key
            assert key is not None
            if not self._completing(b, parent, key, length, data, ids, False, tier, b.start):
                return
        b.chain_tier, b.chain_after, b.chain_used = tier, False, False
        b.chain_parent, b.chain_child, b.chain_prev = parent, None, None
        first = b.chain_next = parent.chain_child
        parent.chain_child = b
        if first is not None:
            first.chain_prev = b
        parent.chain_used = True
        self.live += 1
        self._hold(b)

    def copy(self, twin: ChainBlock, b: ChainBlock) -> None:
        """Give ``b``, a copy of ``twin``'s block (announced without its parent), the same
        state and keys as ``twin``'s node, placed under the same parent."""
        if twin.chain_key is None:
            return
        parent = twin.chain_parent
        tier = b.tier if parent is None or parent.chain_tier == "gpu" else "storage"
        b.chain_key, b.chain_length = twin.chain_key, twin.chain_length
        b.chain_after = twin.chain_after
        b.chain_data, b.chain_keys = twin.chain_data, twin.chain_keys
        self._place(b, parent, tier)
        if b.chain_keys:
            self._count(b, 1)
        if b.chain_data is not None:
            self._hold(b)

    def unmapped(self) -> None:
        """A block with a token id outside the table: no node."""
        self.counts["unmapped_tokens"] += 1
        self._warn_once("chain_unmapped", "token ids outside the tokenizer's table")

    def mismatch(self) -> None:
        """A block whose token ids do not split into its engine's block size: no node."""
        self.counts["mismatched_tokens"] += 1
        self._warn_once("chain_mismatch", "token ids do not fit the block size; no chain keys")

    def _place(self, b: ChainBlock, parent: ChainBlock | None, tier: str) -> None:
        """Make ``b``'s node (its state set) live, under ``parent``."""
        b.chain_tier, b.chain_used, b.chain_child = tier, False, None
        self.live += 1
        if parent is None:
            b.chain_parent = b.chain_next = b.chain_prev = None
        else:
            self._link(parent, b)

    def _derive(
        self,
        b: ChainBlock,
        parent: ChainBlock | None,
        key: bytes,
        length: int,
        at_start: bool,
        ids: Sequence[int] | None,
        tier: str,
        start_tokens: int,
    ) -> bool:
        """Give ``b`` its node, its chain standing at ``key`` and ``length`` after
        ``parent`` (None: the chain's start), ``tier`` already the node's; False: none
        (counted)."""
        if not ids:
            self.counts["missing_tokens"] += 1
            self._warn_once("chain_tokens", "stored blocks without token ids get no chain keys")
            return False
        try:
            if self._stateless:
                data, after = self._join(ids), False
            else:
                data, after = self.table.convert(ids, at_start)
        except UnmappedToken:
            self.unmapped()
            return False
        if length % self.chunk_bytes + len(data) < self.chunk_bytes:
            b.chain_key, b.chain_keys = key, _NO_KEYS
            b.chain_data, b.chain_length = data, length + len(data)
        elif not self._completing(b, parent, key, length, data, ids, at_start, tier, start_tokens):
            return False
        b.chain_after = after
        self._place(b, parent, tier)
        self._hold(b)
        return True

    def _completing(
        self,
        b: ChainBlock,
        parent: ChainBlock | None,
        key: bytes,
        length: int,
        data: bytes,
        ids: Sequence[int],
        at_start: bool,
        tier: str,
        start_tokens: int,
    ) -> bool:
        """Set the state of ``b``, whose block completes one chunk or more, with its keys
        counted (in ``tier``); False, having set nothing, when the partial chunk in front
        of it is lost.

        The partial chunk is the ``chain_data`` of the ancestors back to the one that
        crossed the last boundary (the rope), gathered here and hashed with the block's
        bytes in one join (``extend_pieces``)."""
        need = length % self.chunk_bytes
        pieces = [data]
        n = parent
        while need:  # newest piece first
            if n is None or n.chain_data is None:
                return False
            piece = n.chain_data
            pieces.append(piece)
            need -= len(piece)
            n = n.chain_parent
        assert need == 0
        pieces.reverse()
        keys, rest = extend_pieces(ChainKey(key), pieces, self.chunk_bytes)
        b.chain_key, b.chain_data, b.chain_length = keys[-1], rest, length + len(data)
        b.chain_keys = refs = self._refs(keys, length, ids, at_start, start_tokens)
        touched = self.touched
        if tier == "gpu":
            for r in refs:
                r.gpu_refs += 1
                touched[r] = None
        else:
            for r in refs:
                r.storage_refs += 1
                touched[r] = None
        return True

    def _refs(
        self,
        keys: Sequence[ChainKey],
        length: int,
        ids: Sequence[int],
        at_start: bool,
        start_tokens: int,
    ) -> tuple[ChainRef, ...]:
        """The refs of ``keys``, completed by a block whose bytes start at ``length``.

        A key another path holds already has its ref (and token count): the block's token
        ends are computed only for a new one."""
        c = self.chunk_bytes
        ends: list[int] | None = None
        boundary = (length // c + 1) * c - length  # first chunk end, within the block
        out: list[ChainRef] = []
        refs = self.refs
        for k in keys:
            r = refs.get(k)
            if r is None:
                if ends is None:
                    ends = self.table.ends(ids, at_start)
                r = refs[k] = ChainRef(k, start_tokens + bisect_right(ends, boundary))
            out.append(r)
            boundary += c
        return tuple(out)

    def _hold(self, b: ChainBlock) -> None:
        """Count ``b``'s bytes and put it on the clock (a node whose chunk just ended has
        none: it costs nothing, and its children derive from it whatever the bound)."""
        data = b.chain_data
        assert data is not None
        if not data:
            return
        last = self._newest
        b.chain_older, b.chain_newer = last, None
        if last is None:
            self._oldest = b
        else:
            last.chain_newer = b
        self._newest = b
        self.retained += len(data)
        if self.retained > self.max_retained_bytes:
            self._enforce()

    def _off_clock(self, b: ChainBlock) -> None:
        older, newer = b.chain_older, b.chain_newer
        if older is None:
            self._oldest = newer
        else:
            older.chain_newer = newer
        if newer is None:
            self._newest = older
        else:
            newer.chain_older = older
        b.chain_older = b.chain_newer = None

    def _enforce(self) -> None:
        """Over the byte bound: nodes lose their bytes, oldest first; one extended since
        it was put on the clock gets a second chance (back to the newest end, its
        ``chain_used`` cleared), so the loop ends within two turns of the clock."""
        counts = self.counts
        while self.retained > self.max_retained_bytes and self._oldest is not None:
            victim = self._oldest
            self._off_clock(victim)
            if victim.chain_used:
                victim.chain_used = False
                last = self._newest
                victim.chain_older = last
                if last is None:
                    self._oldest = victim
                else:
                    last.chain_newer = victim
                self._newest = victim
                continue
            self.retained -= len(victim.chain_data)  # type: ignore[arg-type]
            victim.chain_data = None
            counts["bytes_pruned"] += 1

    def _count(self, b: ChainBlock, sign: int) -> None:
        touched = self.touched
        if b.chain_tier == "gpu":
            for r in b.chain_keys:
                r.gpu_refs += sign
                touched[r] = None
        else:
            for r in b.chain_keys:
                r.storage_refs += sign
                touched[r] = None

    @staticmethod
    def _link(parent: ChainBlock, b: ChainBlock) -> None:
        b.chain_parent, b.chain_prev = parent, None
        first = parent.chain_child
        b.chain_next = first
        if first is not None:
            first.chain_prev = b
        parent.chain_child = b

    @staticmethod
    def _unlink(b: ChainBlock) -> None:
        parent = b.chain_parent
        if parent is not None:
            if b.chain_prev is None:
                parent.chain_child = b.chain_next
            else:
                b.chain_prev.chain_next = b.chain_next
            if b.chain_next is not None:
                b.chain_next.chain_prev = b.chain_prev
        b.chain_parent = b.chain_next = b.chain_prev = None

    # -- removal ------------------------------------------------------------------------

    def drop(self, b: ChainBlock, copy: ChainBlock | None = None) -> None:
        """``b``'s block is gone: its children move under ``copy`` (a live copy of the
        block in another medium), or it is withdrawn with every descendant."""
        if b.chain_key is None:
            return
        self._unlink(b)
        if copy is not None and copy.chain_key is not None:
            c = b.chain_child
            b.chain_child = None
            while c is not None:
                nxt = c.chain_next
                self._link(copy, c)
                if copy.chain_tier != "gpu" and c.chain_tier == "gpu":
                    self._demote(c)
                c = nxt
        stack = [b]
        while stack:
            n = stack.pop()
            c = n.chain_child
            while c is not None:
                stack.append(c)
                c = c.chain_next
            if n.chain_keys:
                self._count(n, -1)
                n.chain_keys = _NO_KEYS
            if n.chain_data:  # on the clock
                self.retained -= len(n.chain_data)
                self._off_clock(n)
            n.chain_data = None
            n.chain_key = None
            n.chain_parent = n.chain_child = n.chain_next = n.chain_prev = None
            self.live -= 1

    def _demote(self, top: ChainBlock) -> None:
        """``top`` now has a non-GPU ancestor: it and its GPU descendants count as storage."""
        stack = [top]
        while stack:
            n = stack.pop()
            if n.chain_tier == "gpu":
                if n.chain_keys:
                    self._count(n, -1)
                    n.chain_tier = "storage"
                    self._count(n, 1)
                else:
                    n.chain_tier = "storage"
                stack.extend(n.chain_children())

    def clear(self) -> None:
        """Forget every node and key without events (the source resyncs or was cleared).
        Blocks that still have a node are left as they are: they are gone too."""
        self.refs.clear()
        self.touched.clear()
        self._oldest = self._newest = None
        self.retained = self.live = 0

    # -- announcing ---------------------------------------------------------------------

    def flush(self) -> None:
        """Announce what changed since the last announcement (module docstring's order)."""
        touched = self.touched
        if not touched:
            return
        changed = list(touched)
        touched.clear()
        refs, emit, backend = self.refs, self._emit, self.backend
        announce: list[ChainRef] = []
        for r in reversed(changed):
            if r.gpu_refs + r.storage_refs == 0:
                if refs.get(r.key) is r:
                    del refs[r.key]
                if r.sent_tier is not None:
                    r.sent_tier = None
                    emit(KvEvent("chain_evicted", backend, chain_key=r.hex))
            else:
                announce.append(r)
        for r in reversed(announce):
            tier = "gpu" if r.gpu_refs else "storage"
            if tier != r.sent_tier:
                r.sent_tier = tier
                emit(self._announce(r))

    def _announce(self, r: ChainRef) -> KvEvent:
        if r.sent_tier == "gpu":
            return KvEvent("chain_created", self.backend, None, r.token_count, "gpu", None, r.hex)
        return KvEvent("chain_offloaded", self.backend, None, r.token_count, "storage", None, r.hex)

    def snapshot(self) -> list[KvEvent]:
        """The announced state of every held key, shallowest first within each chain."""
        return [self._announce(r) for r in self.refs.values() if r.sent_tier is not None]

    def stats(self) -> dict[str, int]:
        out = {
            "chain_keys": sum(1 for r in self.refs.values() if r.sent_tier is not None),
            "chain_nodes": self.live,
            "chain_retained_bytes": self.retained,
        }
        out.update({f"chain_{k}": v for k, v in self.counts.items()})
        return out

    # -- testing aid --------------------------------------------------------------------

    def check_invariants(self, blocks: Iterable[ChainBlock], max_nodes: int) -> None:
        """``blocks``: every tracked block. Recomputes refs, bytes and links."""
        refs: dict[bytes, list[int]] = {}
        retained = live = 0
        holders = set()
        for n in blocks:
            assert isinstance(n, ChainBlock)
            if n.chain_key is None:  # no node (never, or withdrawn): no references left
                assert getattr(n, "chain_data", None) is None
                assert not getattr(n, "chain_keys", ())
                assert getattr(n, "chain_parent", None) is None
                assert getattr(n, "chain_child", None) is None
                continue
            live += 1
            if n.chain_parent is not None:
                assert n.chain_parent.chain_key is not None
                assert n in set(n.chain_parent.chain_children())
            for c in n.chain_children():
                assert c.chain_parent is n and c.chain_key is not None
                assert n.chain_tier == "gpu" or c.chain_tier != "gpu"
            if n.chain_data is not None:
                c_len = n.chain_length % self.chunk_bytes
                assert len(n.chain_data) <= c_len < self.chunk_bytes or (
                    not n.chain_data and c_len == 0
                )
                retained += len(n.chain_data)
                if n.chain_data:
                    holders.add(n)
            for r in n.chain_keys:
                assert self.refs.get(r.key) is r
                refs.setdefault(r.key, [0, 0])[n.chain_tier != "gpu"] += 1
        assert live == self.live and retained == self.retained
        clock: list[ChainBlock] = []
        node, prev = self._oldest, None
        while node is not None:
            assert node.chain_older is prev
            clock.append(node)
            node, prev = node.chain_newer, node
        assert self._newest is prev
        assert len(clock) == len(holders) and set(clock) == holders
        bound = min(self.max_retained_bytes, max_nodes * (self.chunk_bytes - 1))
        assert retained <= bound
        for key, r in self.refs.items():
            if key in refs:
                assert (r.gpu_refs, r.storage_refs) == tuple(refs[key])
            else:  # released since the last flush, not announced gone yet
                assert r.gpu_refs + r.storage_refs == 0 and r in self.touched
        if not self.touched:
            for r in self.refs.values():
                assert r.sent_tier == ("gpu" if r.gpu_refs else "storage")
