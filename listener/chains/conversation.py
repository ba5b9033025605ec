"""Conversation keys: every stored block's place in its prompt's key chain, announced.

With conversation mode on, each tracked block also gets a ``ChainNode``: the state of the
prompt key chain (``bus.prompt_chain``) after the block's bytes, which it derives from its
parent's (``extend``), plus the keys whose chunk it completed. The bytes of a block are its
tokens' raw bytes (``listener.token_bytes``), so the chain over a path of blocks is the
chain of the prompt text the engine tokenized, and key ``i`` is the router's key ``i`` of
the same rendered prompt.

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
longer whole. A withdrawn node stays attached to its block as inert: nothing is derived
from it again, even if the engine stores the missing ancestor once more. So a node's
ancestors always spell the text in front of it, and a backend's keys stay prefix-closed.

**No keys.** A block gets no node, and nothing under it gets one, when its chain's root is
unknown (no ``model`` configured, a LoRA adapter without a name), when its token ids are
missing, do not split into the engine's block size, or do not map through the table. Each
kind is counted in ``stats`` and warned about once.

**Cost.** This runs for every stored block on the ingestion path, so a node keeps its
chain state (``bus.prompt_chain.ChainState``: the last full chunk's key, the bytes after
it, the length) as a rope: the key, the length, and only the bytes the block itself adds
after the last chunk boundary (``data``); the partial chunk is the ``data`` of the nodes
from the one that crossed the boundary down to this one. ``extend`` runs only for a block
that completes a chunk (then the partial chunk is gathered, at most one chunk of bytes);
any other block costs its own bytes and one node, never a copy of the partial chunk.

**Memory.** Nodes exist only for tracked blocks (``max_tracked_blocks`` bounds them). Each
node keeps fewer than ``chunk_bytes`` bytes of ``data``; those count against
``max_retained_bytes``, and beyond it nodes lose them, oldest first with a second chance
for those extended since (a clock): such a node keeps its keys, but nothing that needs the
bytes derives from it or from below it within the chunk.
Hence at all times, per source::

    retained chain bytes <= min(max_retained_bytes, max_tracked_blocks * (chunk_bytes - 1))
"""

from __future__ import annotations

from bisect import bisect_right
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from operator import itemgetter

from bus.events import KvEvent
from bus.prompt_chain import ChainKey, ChainState, chain_root, extend
from bus.salt import caller_salt
from listener.token_bytes import TokenBytes, UnmappedToken

__all__ = ["ChainNode", "ChainRef", "ConversationLedger", "ConversationSettings"]

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


class ChainNode:
    """A tracked block's place in its chain (see the module docstring).

    ``key`` and ``length`` are the chain's state after the block (the last full chunk's
    key, every byte so far); ``data`` the bytes it adds after the last chunk boundary (the
    module docstring's rope), None once the byte bound took them (or the node was
    withdrawn). ``at_start`` is the tokenizer's
    leading-space flag after the block (``TokenBytes.convert``). Children are a doubly
    linked sibling list (``child``, ``next``, ``prev``): O(1) to link and unlink, whatever
    the fan-out under a shared system prompt.
    """

    __slots__ = (
        "at_start",
        "child",
        "data",
        "key",
        "keys",
        "length",
        "live",
        "next",
        "parent",
        "prev",
        "tier",
        "used",
    )

    def __init__(
        self,
        key: bytes,
        data: bytes | None,
        length: int,
        tier: str,
        at_start: bool,
        parent: ChainNode | None = None,
        next: ChainNode | None = None,
    ) -> None:
        self.key, self.data, self.length = key, data, length
        self.tier, self.at_start = tier, at_start
        self.keys = _NO_KEYS
        self.live = True
        self.parent = parent
        self.child: ChainNode | None = None
        self.next = next
        self.prev: ChainNode | None = None
        self.used = False

    def partial(self, chunk_bytes: int) -> bytes | None:
        """The bytes after the last full chunk (None when a node they come from lost them)."""
        need = self.length % chunk_bytes
        pieces: list[bytes] = []
        n: ChainNode | None = self
        while need:
            if n is None or n.data is None:
                return None
            data = n.data
            pieces.append(data)
            need -= len(data)
            n = n.parent
        assert need == 0
        pieces.reverse()
        return b"".join(pieces)

    def state(self, chunk_bytes: int) -> ChainState | None:
        """The chain state after the block, as ``bus.prompt_chain`` spells it."""
        partial = self.partial(chunk_bytes)
        if partial is None:
            return None
        return ChainState(ChainKey(self.key), partial, self.length)

    def children(self) -> Iterator[ChainNode]:
        c = self.child
        while c is not None:
            yield c
            c = c.next


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
        self._holders: deque[ChainNode] = deque()
        """Nodes with ``data``, oldest first, for the byte bound: a clock (second chance)
        over creation order, ``used`` set when a child derives from a node; entries of
        nodes that lost their data are skipped, and compacted away once they are half."""
        self.retained = 0
        """Bytes kept by all nodes (their ``data``)."""
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
        ids: Sequence[int] | None,
        tier: str,
        cache_salt: str | None,
        lora_name: str | None,
        lora_id: int | None,
    ) -> ChainNode | None:
        """The node of a chain's first block (no parent), or None (counted)."""
        if self.model is None or (lora_id is not None and lora_name is None):
            self.counts["no_root"] += 1
            self._warn_once(
                "chain_root",
                "conversation keys need the source's model (and a LoRA adapter's name); "
                "chains without them get none",
            )
            return None
        root = chain_root(self.model, caller_salt(cache_salt), lora_name)
        return self._derive(None, root, 0, True, ids, tier, 0)

    def child(
        self, parent: ChainNode, ids: Sequence[int] | None, tier: str, start_tokens: int
    ) -> ChainNode | None:
        """The node of a block stored under ``parent``'s block, or None.

        ``start_tokens`` is the number of tokens in front of the block (its parent's depth).
        ``ids`` must not be negative (the decoders' contract: a negative id would index the
        table from its end); the caller checks ids of unknown origin (``unmapped``).

        This is the ingestion path's one per-block step, so the common case (a stateless
        table, no chunk completed) is written out in full here; ``_derive`` is the same
        for every case.
        """
        if parent.data is None:
            return None
        if not self._stateless or not ids or len(ids) == 1:
            node = self._derive(parent, parent.key, parent.length, parent.at_start, ids, tier,
                                start_tokens)  # fmt: skip
        else:
            try:
                data = b"".join(itemgetter(*ids)(self._pieces))
            except (IndexError, TypeError):
                self.unmapped()
                return None
            length = parent.length
            if parent.tier != "gpu":
                tier = "storage"
            if length % self.chunk_bytes + len(data) < self.chunk_bytes:
                node = ChainNode(parent.key, data, length + len(data), tier, False, parent)
            else:
                node = self._completing(parent, parent.key, length, data, ids, False, tier,
                                        start_tokens)  # fmt: skip
                if node is None:
                    return None
                node.parent = parent
                data = node.data  # type: ignore[assignment]
            first = node.next = parent.child
            parent.child = node
            if first is not None:
                first.prev = node
            self.live += 1
            self._holders.append(node)
            self.retained += len(data)
            if self.retained > self.max_retained_bytes:
                self._enforce()
        if node is not None:
            parent.used = True
        return node

    def copy(self, twin: ChainNode, tier: str) -> ChainNode | None:
        """A copy of ``twin``'s block in ``tier`` (announced without its parent): the same
        state and keys, placed under the same parent."""
        if not twin.live:
            return None
        parent = twin.parent
        if parent is not None and parent.tier != "gpu":
            tier = "storage"
        node = ChainNode(twin.key, twin.data, twin.length, tier, twin.at_start)
        self.live += 1
        if parent is not None:
            self._link(parent, node)
        if twin.keys:
            node.keys = twin.keys
            self._count(node, 1)
        if node.data is not None:
            self._hold(node)
        return node

    def unmapped(self) -> None:
        """A block with a token id outside the table: no node."""
        self.counts["unmapped_tokens"] += 1
        self._warn_once("chain_unmapped", "token ids outside the tokenizer's table")

    def mismatch(self) -> None:
        """A block whose token ids do not split into its engine's block size: no node."""
        self.counts["mismatched_tokens"] += 1
        self._warn_once("chain_mismatch", "token ids do not fit the block size; no chain keys")

    def _derive(
        self,
        parent: ChainNode | None,
        key: bytes,
        length: int,
        at_start: bool,
        ids: Sequence[int] | None,
        tier: str,
        start_tokens: int,
    ) -> ChainNode | None:
        """The node of a block whose chain stands at ``key`` and ``length`` after
        ``parent`` (None: the chain's start)."""
        if not ids:
            self.counts["missing_tokens"] += 1
            self._warn_once("chain_tokens", "stored blocks without token ids get no chain keys")
            return None
        try:
            if self._stateless:
                data, after = self._join(ids), False
            else:
                data, after = self.table.convert(ids, at_start)
        except UnmappedToken:
            self.unmapped()
            return None
        if parent is not None and parent.tier != "gpu":
            tier = "storage"
        node: ChainNode | None
        if length % self.chunk_bytes + len(data) < self.chunk_bytes:
            node = ChainNode(key, data, length + len(data), tier, after)
        else:
            node = self._completing(parent, key, length, data, ids, at_start, tier, start_tokens)
            if node is None:
                return None
            node.at_start = after
        self.live += 1
        if parent is not None:
            self._link(parent, node)
        self._hold(node)
        return node

    def _completing(
        self,
        parent: ChainNode | None,
        key: bytes,
        length: int,
        data: bytes,
        ids: Sequence[int],
        at_start: bool,
        tier: str,
        start_tokens: int,
    ) -> ChainNode | None:
        """The node (not linked) of a block that completes one chunk or more, with its
        keys counted; None when the partial chunk in front of it is lost."""
        partial = b"" if parent is None else parent.partial(self.chunk_bytes)
        if partial is None:
            return None
        state = ChainState(ChainKey(key), partial, length)
        new, keys = extend(state, data, self.chunk_bytes)
        node = ChainNode(new.key, new.partial, new.length, tier, False)
        node.keys = self._refs(keys, length, ids, at_start, start_tokens)
        self._count(node, 1)
        return node

    def _refs(
        self,
        keys: Sequence[ChainKey],
        length: int,
        ids: Sequence[int],
        at_start: bool,
        start_tokens: int,
    ) -> tuple[ChainRef, ...]:
        """The refs of ``keys``, completed by a block whose bytes start at ``length``."""
        c = self.chunk_bytes
        ends = self.table.ends(ids, at_start)
        boundary = (length // c + 1) * c - length  # first chunk end, within the block
        out: list[ChainRef] = []
        refs = self.refs
        for k in keys:
            r = refs.get(k)
            if r is None:
                r = refs[k] = ChainRef(k, start_tokens + bisect_right(ends, boundary))
            out.append(r)
            boundary += c
        return tuple(out)

    def _hold(self, node: ChainNode) -> None:
        assert node.data is not None
        self._holders.append(node)
        self.retained += len(node.data)
        if self.retained > self.max_retained_bytes:
            self._enforce()

    def _enforce(self) -> None:
        holders = self._holders
        while self.retained > self.max_retained_bytes and holders:
            victim = holders.popleft()
            if victim.data is None:
                continue  # withdrawn since
            if victim.used:  # extended since it was queued: a second chance
                victim.used = False
                holders.append(victim)
                continue
            self.retained -= len(victim.data)
            victim.data = None
            self.counts["bytes_pruned"] += 1

    def _count(self, node: ChainNode, sign: int) -> None:
        touched = self.touched
        if node.tier == "gpu":
            for r in node.keys:
                r.gpu_refs += sign
                touched[r] = None
        else:
            for r in node.keys:
                r.storage_refs += sign
                touched[r] = None

    @staticmethod
    def _link(parent: ChainNode, node: ChainNode) -> None:
        node.parent, node.prev = parent, None
        first = parent.child
        node.next = first
        if first is not None:
            first.prev = node
        parent.child = node

    @staticmethod
    def _unlink(node: ChainNode) -> None:
        parent = node.parent
        if parent is not None:
            if node.prev is None:
                parent.child = node.next
            else:
                node.prev.next = node.next
            if node.next is not None:
                node.next.prev = node.prev
        node.parent = node.next = node.prev = None

    # -- removal ------------------------------------------------------------------------

    def drop(self, node: ChainNode, copy: ChainNode | None = None) -> None:
        """``node``'s block is gone: its children move under ``copy`` (a live copy of the
        block in another medium), or it is withdrawn with every descendant."""
        if not node.live:
            return
        self._unlink(node)
        if copy is not None and copy.live:
            c = node.child
            node.child = None
            while c is not None:
                nxt = c.next
                self._link(copy, c)
                if copy.tier != "gpu" and c.tier == "gpu":
                    self._demote(c)
                c = nxt
        stack = [node]
        while stack:
            n = stack.pop()
            c = n.child
            while c is not None:
                stack.append(c)
                c = c.next
            if n.keys:
                self._count(n, -1)
                n.keys = _NO_KEYS
            if n.data is not None:
                self.retained -= len(n.data)
                n.data = None
            n.live = False
            n.parent = n.child = n.next = n.prev = None
            self.live -= 1
        if len(self._holders) > 2 * self.live + 64:  # mostly entries of lost data
            self._holders = deque(n for n in self._holders if n.data is not None)

    def _demote(self, top: ChainNode) -> None:
        """``top`` now has a non-GPU ancestor: it and its GPU descendants count as storage."""
        stack = [top]
        while stack:
            n = stack.pop()
            if n.tier == "gpu":
                if n.keys:
                    self._count(n, -1)
                    n.tier = "storage"
                    self._count(n, 1)
                else:
                    n.tier = "storage"
                stack.extend(n.children())

    def clear(self) -> None:
        """Forget every node and key without events (the source resyncs or was cleared).
        Nodes still attached to blocks are left as they are: their blocks are gone too."""
        self.refs.clear()
        self.touched.clear()
        self._holders.clear()
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

    def check_invariants(self, nodes: Mapping[object, ChainNode | None], max_nodes: int) -> None:
        """``nodes``: every tracked block's node. Recomputes refs, bytes and links."""
        refs: dict[bytes, list[int]] = {}
        retained = live = 0
        holders = set()
        for n in nodes.values():
            if n is None or not n.live:
                if n is not None:
                    assert n.data is None and not n.keys and n.parent is None
                    assert n.child is None
                continue
            live += 1
            if n.parent is not None:
                assert n.parent.live and n in set(n.parent.children())
            for c in n.children():
                assert c.parent is n and c.live
                assert n.tier == "gpu" or c.tier != "gpu"
            if n.data is not None:
                assert len(n.data) <= n.length % self.chunk_bytes < self.chunk_bytes or (
                    not n.data and n.length % self.chunk_bytes == 0
                )
                retained += len(n.data)
                holders.add(n)
            for r in n.keys:
                assert self.refs.get(r.key) is r
                refs.setdefault(r.key, [0, 0])[n.tier != "gpu"] += 1
        assert live == self.live and retained == self.retained
        assert holders == {n for n in self._holders if n.data is not None}
        assert len(set(self._holders)) == len(self._holders) <= 2 * live + 64
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
