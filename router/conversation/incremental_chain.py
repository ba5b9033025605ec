"""A request's chain from the render cache: render the new messages only, extend the
chain state the conversation's earlier turn left (:mod:`.incremental`, :mod:`.render_cache`).

:func:`incremental_chain` returns None whenever it cannot give exactly what the full
pass (:meth:`.chain.ConversationKeys.chain`) gives, and the caller then takes the full
pass: no plan for the template, ``continue_final_message``, a render that raises, a
message that is not JSON, a prompt the normalizer changes where the pieces meet. The
chain is the full pass's byte for byte: what is reused is checked (the text before the
loop, the loop-start values, the message digests) and the pieces are joined only where
the tokenizer's normalizer cannot tell them from the whole (:attr:`.normalizer.Normalizer.
splits_at_ascii`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from bus.prompt_chain import ChainKey, ChainState, extend

from .incremental import IncrementalPlan, Tracker, same_value
from .render import render_inputs
from .render_cache import CacheEntry, MessageDigests, RenderCache, entry_size
from .template import ChatTemplate

__all__ = ["CacheCounters", "incremental_chain"]

PROBES = 8
"""Boundaries tried per request, from the last message back (a turn adds a few)."""


@dataclass(slots=True)
class CacheCounters:
    """Plain ints (one event loop), read by ``ConversationKeys.stats``."""

    hits: int = 0
    """Requests that reused an earlier turn's state."""
    misses: int = 0
    """Requests rendered whole (no state for any of their prefixes)."""
    rejected: int = 0
    """Requests whose state was found but could not be reused (rendered whole, and
    counted in ``misses`` too)."""
    bypassed: int = 0
    """Requests the cache cannot serve (no plan, continue_final_message, ...)."""
    messages_reused: int = 0
    messages_rendered: int = 0
    stores: int = 0


def _ascii_start(pieces: list[str]) -> bool:
    for p in pieces:
        if p:
            return p[0] < "\x80"
    return True


def _agrees(
    plan: IncrementalPlan, entry: CacheEntry, head: str, values: tuple[Any, ...], upto: int
) -> bool:
    if head != entry.head:
        return False
    k = len(plan.snapshot_names)
    before, now = entry.values, values
    if len(before) != len(now):
        return False
    for i in range(k):
        if not same_value(before[i], now[i]):
            return False
    for g, guard in enumerate(plan.guards):
        b, v = before[k + g], now[k + g]
        if not (same_value(b, v) or guard.agree(b, v, upto)):
            return False
    return True


def _boundary(needs: dict[int, int], start: int, n: int) -> int:
    """The last message boundary in ``(start, n]`` whose earlier messages' texts can be
    reused there (0 if none)."""
    best, worst = 0, 0
    for j in range(start + 1, n + 1):
        worst = max(worst, needs.get(j - 1, 0))
        if worst <= j:
            best = j
    return best


def incremental_chain(
    template: ChatTemplate,
    body: Mapping[str, Any],
    root: ChainKey,
    chunk_bytes: int,
    cache: RenderCache,
    counters: CacheCounters,
) -> tuple[list[ChainKey], int] | None:
    """The keys and prompt bytes of ``body``'s chain, or None (take the full pass)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not template.normalizer.splits_at_ascii:
        counters.bypassed += 1
        return None
    prefix = (id(template), root)
    try:
        digests = MessageDigests(messages)
        start, found = cache.find(prefix, digests, PROBES)
    except (TypeError, ValueError):
        counters.bypassed += 1
        return None
    entry = cache.get((*prefix, found)) if found is not None else None
    result = None
    if entry is not None:
        result = _attempt(template, body, entry, start, chunk_bytes)
        if result is None:
            counters.rejected += 1
            start, entry = 0, None
    if result is None:
        result = _attempt(template, body, None, 0, chunk_bytes, root)
        if result is None:
            counters.bypassed += 1
            return None
        counters.misses += 1
    else:
        counters.hits += 1
    keys, total, stored, n = result
    counters.messages_reused += start
    counters.messages_rendered += n - start
    if stored is not None:
        j, new_entry = stored
        try:
            d = digests.digest(j)
        except (TypeError, ValueError):
            return keys, total
        if found is not None and start and j > start:
            # the conversation moved on: its shorter state is not asked for again (a
            # retry or a regenerated answer asks for the longer one)
            cache.drop((*prefix, found))
        cache.put((*prefix, d), new_entry)
        counters.stores += 1
    return keys, total


def _attempt(
    template: ChatTemplate,
    body: Mapping[str, Any],
    entry: CacheEntry | None,
    start: int,
    chunk_bytes: int,
    root: ChainKey | None = None,
) -> tuple[list[ChainKey], int, tuple[int, CacheEntry] | None, int] | None:
    try:
        inputs = render_inputs(template, body, entry.chat if entry is not None else ())
    except Exception:
        return None
    plan = inputs.prepared.template.incremental
    if plan is None or inputs.final is not None:
        return None
    if entry is not None and entry.plan is not plan:
        return None
    tracker = Tracker(plan.template.environment)
    try:
        out = plan.template.render(
            messages=inputs.chat,
            **inputs.variables,
            **tracker.variables(inputs.chat, start, plan.marker),
        )
    except Exception:
        return None
    n = len(inputs.chat)
    parts = out.split(plan.marker)
    # the head, "" (between the loop's start and its first message), each message, the rest
    if len(parts) != n - start + 3 or parts[1]:
        return None
    head, values = parts[0], tracker.values
    if entry is not None and not _agrees(plan, entry, head, values, start):
        return None
    bodies, post = parts[2:-1], parts[-1]
    pieces = [head, *bodies, post] if entry is None else [*bodies, post]
    if entry is not None and not _ascii_start(pieces):
        return None
    text = "".join(pieces)
    if template.normalizer(text) != text:
        return None
    j = _boundary(tracker.needs, start, n)
    if j and not _ascii_start([*bodies[j - start :], post]):
        j = 0
    if entry is not None:
        state, keys = entry.state, list(entry.keys)
    else:
        assert root is not None
        state, keys = ChainState.start(root), []
    try:
        stored = None
        if j:
            cut = j - start + (1 if entry is None else 0)
            before = "".join(pieces[:cut]).encode()
            after = "".join(pieces[cut:]).encode()
            state, done = extend(state, before, chunk_bytes)
            keys.extend(done)
            size = entry_size(head, state, len(keys), values, state.length)
            kept = CacheEntry(head, values, state, tuple(keys), plan, tuple(inputs.chat[:j]), size)
            stored = (j, kept)
        else:
            after = text.encode()
    except UnicodeEncodeError:
        return None
    state, done = extend(state, after, chunk_bytes)
    keys.extend(done)
    return keys, state.length, stored, n
