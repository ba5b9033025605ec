"""A tracker's whole state as plain data, and back: what a listener checkpoint holds.

``export_state`` turns one ``ChainTracker`` into nested lists of ints, bytes, strings
and bools (msgpack-able); ``import_state`` rebuilds an empty tracker from it so that
exporting again gives the same data (the property the tests check). The data is exactly
what the tracker holds, so it is bounded as the tracker is (``max_tracked_blocks``
entries, ``max_retained_tokens`` token IDs, ``max_retained_bytes`` chain bytes).

What is kept: every tracked block with its state, prefix, token segment and pending
links (parent, root, frontier, the dirty leaves a root waits to attribute), in the
pruning policy's order; every prefix's high-water marks and what was last announced for
it; the media seen per (dp rank, group); with conversation mode, every chain node with
its links (tree and byte-bound clock) and every key's token count and announced tier.
Reference counts are recomputed from the blocks. What is not kept: counters (they count
since the process started) and work in flight (a pending root with dirty leaves is queued
again on import, so attribution resumes where it stood).

Blocks are referred to by their place in the exported list (``-1``: none); a block that is
not pending has a short row (its key, extent, state and prefix: nothing else is set). Import
validates as it goes and finally runs the tracker's own invariant check, so data that is
well formed but inconsistent is refused (``StateError``) like data that is not; the
tracker is then reset, never half loaded.
"""

from __future__ import annotations

import sys
from array import array
from typing import Any

from .blocks import LruPolicy, TrackedBlock
from .conversation import ChainBlock, ChainRef, ConversationLedger
from .prefixes import Prefix
from .states import KEYED, PENDING, BlockState
from .tracker import ChainTracker

__all__ = ["StateError", "export_state", "import_state"]

_TIERS = ("gpu", "storage")
_NONE = -1


class StateError(ValueError):
    """Exported state that cannot be imported (malformed or inconsistent)."""


def _tokens_out(tokens: array[int] | None) -> bytes | None:
    if tokens is None:
        return None
    if sys.byteorder == "little":
        return tokens.tobytes()
    copy = array("I", tokens)
    copy.byteswap()
    return copy.tobytes()


def _tokens_in(data: object) -> array[int] | None:
    if data is None:
        return None
    if type(data) is not bytes or len(data) % 4:
        raise StateError("token segment is not a whole number of uint32")
    tokens = array("I")
    tokens.frombytes(data)
    if sys.byteorder != "little":
        tokens.byteswap()
    return tokens


def _order(tracker: ChainTracker) -> list[TrackedBlock]:
    """Blocks in pruning order (the LRU's own order; the tracked order otherwise)."""
    policy = tracker._policy
    if isinstance(policy, LruPolicy):
        return list(policy._all)
    return list(tracker._nodes.values())


def _dirty(b: TrackedBlock, index: dict[int, int]) -> list[int] | None:
    """The leaves ``b`` (a pending root) waits to attribute; removed ones drop out (the
    jobs skip them too)."""
    if not b.dirty:
        return None
    return [index[id(leaf)] for leaf in b.dirty if id(leaf) in index] or None


def export_state(tracker: ChainTracker) -> dict[str, Any]:
    """The tracker's state as plain data. Flushes first: nothing is left unannounced, so
    the announced state and the counts agree and no ``touched`` set needs keeping."""
    tracker.flush()
    blocks = _order(tracker)
    index = {id(b): i for i, b in enumerate(blocks)}

    def ix(b: TrackedBlock | None) -> int:
        return _NONE if b is None else index[id(b)]

    ledger = tracker._ledger
    prefix_ix = {id(p): i for i, p in enumerate(ledger.prefixes.values())}
    prefixes = [
        [p.key, p.gpu_hw, p.storage_hw, p.sent_tier, p.sent_count] for p in ledger.prefixes.values()
    ]
    out_blocks: list[list[Any]] = []
    append = out_blocks.append
    for b in blocks:
        dp, group, medium, h = b.key
        prefix = b.prefix
        row = [dp, group, medium, h, b.start, b.depth, b.tier, int(b.state),
               _NONE if prefix is None else prefix_ix[id(prefix)]]  # fmt: skip
        if b.state == PENDING:  # the rest is only ever set while pending (``states``)
            row += (_tokens_out(b.tokens), ix(b.parent), ix(b.root), ix(b.frontier),
                    b.insufficient, _dirty(b, index))  # fmt: skip
        append(row)
    state: dict[str, Any] = {
        "blocks": out_blocks,
        "prefixes": prefixes,
        "media": [[dp, g, sorted(m)] for (dp, g), m in tracker._media.items()],
        "mixed_media": tracker._mixed_media,
        "conversation": None,
    }
    conv = tracker._conv
    if conv is not None:
        state["conversation"] = _export_conversation(conv, blocks, ix)
    return state


def _export_conversation(
    conv: ConversationLedger, blocks: list[TrackedBlock], ix: Any
) -> dict[str, Any]:
    ref_ix = {id(r): i for i, r in enumerate(conv.refs.values())}
    nodes = []
    for i, b in enumerate(blocks):
        assert isinstance(b, ChainBlock)
        if b.chain_key is None:
            continue
        nodes.append(
            [
                i,
                b.chain_key,
                b.chain_length,
                b.chain_data,
                b.chain_after,
                b.chain_tier,
                b.chain_used,
                [ref_ix[id(r)] for r in b.chain_keys],
                ix(b.chain_parent),
                ix(b.chain_child),
                ix(b.chain_next),
                ix(b.chain_prev),
                ix(getattr(b, "chain_older", None)),  # unset: never on the byte clock
                ix(getattr(b, "chain_newer", None)),
            ]
        )
    return {
        "refs": [[r.key, r.token_count, r.sent_tier] for r in conv.refs.values()],
        "nodes": nodes,
        "oldest": ix(conv._oldest),
        "newest": ix(conv._newest),
        "chunk_bytes": conv.chunk_bytes,
    }


def import_state(tracker: ChainTracker, state: object) -> None:
    """Rebuild ``tracker`` (which must be empty) from ``export_state`` data.

    Raises ``StateError`` (the tracker reset to empty) when the data is malformed or
    inconsistent with the tracker's bounds and settings.
    """
    if tracker._nodes or tracker._ledger.prefixes:
        raise RuntimeError("import_state needs an empty tracker")
    try:
        _import(tracker, state)
        tracker.check_invariants()
    except StateError:
        tracker.reset()
        raise
    except (AssertionError, AttributeError, IndexError, KeyError, TypeError, ValueError) as e:
        tracker.reset()
        raise StateError(f"inconsistent state: {type(e).__name__}: {e}") from None


def _get(state: dict[str, Any], key: str, kind: type) -> Any:
    v = state.get(key)
    if type(v) is not kind:
        raise StateError(f"{key!r} is missing or not a {kind.__name__}")
    return v


def _int(v: object) -> int:
    if type(v) is not int:
        raise StateError(f"expected an integer, got {type(v).__name__}")
    return v


def _import(tracker: ChainTracker, state: object) -> None:
    if type(state) is not dict:
        raise StateError("state is not a map")
    rows = _get(state, "blocks", list)
    if len(rows) > tracker.max_tracked_blocks:
        raise StateError(f"{len(rows)} blocks exceed max_tracked_blocks")
    conv_state = state.get("conversation")
    if (conv_state is None) != (tracker._conv is None):
        raise StateError("conversation mode differs from the checkpoint's")
    ledger = tracker._ledger
    prefixes: list[Prefix] = []
    for row in _get(state, "prefixes", list):
        key, gpu_hw, storage_hw, sent_tier, sent_count = row
        if type(key) is not bytes or key in ledger.prefixes:
            raise StateError("prefix key is not bytes, or repeated")
        if sent_tier is not None and sent_tier not in _TIERS:
            raise StateError(f"unknown tier {sent_tier!r}")
        p = ledger.prefix(key)
        p.gpu_hw, p.storage_hw = _int(gpu_hw), _int(storage_hw)
        p.sent_tier, p.sent_count = sent_tier, _int(sent_count)
        prefixes.append(p)
    cls = tracker._block
    blocks: list[TrackedBlock] = []
    n = len(rows)

    def at(i: object) -> TrackedBlock | None:
        i = _int(i)
        if i == _NONE:
            return None
        if not 0 <= i < n:
            raise StateError(f"block reference {i} out of range")
        return blocks[i]

    store = tracker._blocks
    nodes, counts, policy = store.nodes, store.counts, store.policy
    for row in rows:
        dp, group, medium, h, start, depth, tier, state_v, p_ix = row[:9]
        if type(medium) is not str or tier not in _TIERS or type(h) not in (int, bytes):
            raise StateError("block key or tier malformed")
        if not 0 <= _int(start) <= _int(depth):
            raise StateError("block start and depth out of order")
        key = (_int(dp), _int(group), medium, h)
        if key in nodes:
            raise StateError("block key repeated")
        st = BlockState(_int(state_v))
        prefix = None if _int(p_ix) == _NONE else prefixes[p_ix]
        b = cls(key, _int(start), _int(depth), tier, st, prefix)
        tokens = None
        if st == PENDING:
            if len(row) != 15:
                raise StateError("a pending block without its links")
            b.tokens = tokens = _tokens_in(row[9])
            b.insufficient = bool(row[13])
        elif len(row) != 9:
            raise StateError("a settled block with pending links")
        blocks.append(b)
        nodes[key] = b
        counts[st] += 1
        if tokens is not None:
            store.retained += len(tokens)
        if st == KEYED:
            assert prefix is not None
            if tier == "gpu":
                prefix.gpu_refs += 1
            else:
                prefix.storage_refs += 1
    for b, row in zip(blocks, rows, strict=True):
        if b.state != PENDING:
            continue
        b.parent, b.root, b.frontier = at(row[10]), at(row[11]), at(row[12])
        if b.parent is not None:
            if b.parent.children is None:
                b.parent.children = set()
            b.parent.children.add(b)
        dirty = row[14]
        if dirty is not None:
            b.dirty = {}
            for leaf in dirty:
                d = at(leaf)
                if d is None:
                    raise StateError("dirty leaf missing")
                b.dirty[d] = None
    for b in blocks:
        policy.added(b)
    for dp, group, media in _get(state, "media", list):
        if type(media) is not list or not all(type(m) is str for m in media):
            raise StateError("media malformed")
        tracker._media[(_int(dp), _int(group))] = set(media)
    tracker._mixed_media = bool(state.get("mixed_media"))
    if tracker._conv is not None:
        if type(conv_state) is not dict:
            raise StateError("conversation state is not a map")
        _import_conversation(tracker._conv, conv_state, at)
    ledger.touched.clear()
    for b in blocks:
        if b.state == PENDING and b.root is b and b.dirty:
            tracker._jobs.requeue(b)


def _import_conversation(conv: ConversationLedger, state: dict[str, Any], at: Any) -> None:
    if state.get("chunk_bytes") != conv.chunk_bytes:
        raise StateError("chunk_bytes differs from the checkpoint's")
    refs: list[ChainRef] = []
    for key, token_count, sent_tier in _get(state, "refs", list):
        if type(key) is not bytes or key in conv.refs or sent_tier not in (*_TIERS, None):
            raise StateError("chain key malformed or repeated")
        r = conv.refs[key] = ChainRef(key, _int(token_count))
        r.sent_tier = sent_tier
        refs.append(r)
    for row in _get(state, "nodes", list):
        b = at(row[0])
        if not isinstance(b, ChainBlock):
            raise StateError("chain node without its block")
        key, length, data, after, tier, used, keys = row[1:8]
        if type(key) is not bytes or (data is not None and type(data) is not bytes):
            raise StateError("chain node malformed")
        if tier not in _TIERS:
            raise StateError(f"unknown tier {tier!r}")
        b.chain_key, b.chain_length, b.chain_data = key, _int(length), data
        b.chain_after, b.chain_tier, b.chain_used = bool(after), tier, bool(used)
        b.chain_keys = tuple(refs[_int(k)] for k in keys)
        b.chain_parent, b.chain_child = at(row[8]), at(row[9])
        b.chain_next, b.chain_prev = at(row[10]), at(row[11])
        b.chain_older, b.chain_newer = at(row[12]), at(row[13])
        conv.live += 1
        if data:
            conv.retained += len(data)
        for r in b.chain_keys:
            if tier == "gpu":
                r.gpu_refs += 1
            else:
                r.storage_refs += 1
    conv._oldest = at(state.get("oldest", _NONE))
    conv._newest = at(state.get("newest", _NONE))
    conv.touched.clear()
