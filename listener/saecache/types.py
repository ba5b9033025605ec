"""Token types, queues, session classes and the rule that routes a block to a queue.

The four queues separate the reuse mechanisms the SAECache paper identifies: structural
reuse across sessions (shared instructions, tool definitions), local temporal reuse within
a conversation or an agent loop (whose inter-turn gaps follow different distributions),
and blocks that are almost never reused (chain of thought that is not re-sent, decode
output and template-less prefill of single-turn requests).

Routing rule (``route``), first match wins:

1. ``REASONING`` -> ``EVICT_FIRST`` (chain of thought is stripped from the next prompt).
2. a block known to be *shared* (accessed by a second session) -> ``STRUCTURE``.
3. session class ``CHAT`` -> ``CHAT``; ``AGENT`` -> ``AGENT``: a multi-turn session's
   blocks, its own system prompt and tool definitions too until a second session uses
   them (rule 2 then moves them). A prompt only one conversation has sent is reused only
   when that conversation goes on, which is what its queue's timing prices; in
   ``STRUCTURE`` it was ranked by recency alone and outlived the conversation it belongs
   to (bench/RESULTS.md, "saecache": on the tuning grid the worst cell went from -0.8
   to -0.3 points against the better of LRU and LFU, on the evaluation grid from -2.3 to
   -2.0).
4. ``SYSTEM`` and ``TOOL_DEF`` -> ``STRUCTURE`` (shared prompt structure by construction:
   a single-turn or not yet classified request's prompt is worth keeping only for the
   requests that share it).
5. session class ``SINGLE`` (predicted not to continue) -> ``EVICT_FIRST`` (``SaeCache``
   with ``soft_single`` ranks these in ``CHAT`` by their learned continuation instead).
6. ``UNKNOWN`` (first request, no predictor) -> ``CHAT``: its timing decay evicts it soon
   enough if the session never continues, and losing a continuing session's first turn
   costs a whole prefill.
"""

from __future__ import annotations

from enum import IntEnum

__all__ = [
    "QUEUE_NAMES",
    "SESSION_NAMES",
    "TOKEN_TYPE_NAMES",
    "Queue",
    "SessionClass",
    "TokenType",
    "route",
]


class TokenType(IntEnum):
    """What a block's tokens are (the type of its first token)."""

    SYSTEM = 0
    USER = 1
    ASSISTANT = 2
    REASONING = 3
    TOOL_DEF = 4
    TOOL_IO = 5  # tool calls and tool results


class Queue(IntEnum):
    EVICT_FIRST = 0
    STRUCTURE = 1
    CHAT = 2
    AGENT = 3


class SessionClass(IntEnum):
    UNKNOWN = 0
    CHAT = 1
    AGENT = 2
    SINGLE = 3


TOKEN_TYPE_NAMES: dict[str, TokenType] = {
    "system": TokenType.SYSTEM,
    "user": TokenType.USER,
    "assistant": TokenType.ASSISTANT,
    "reasoning": TokenType.REASONING,
    "tool_def": TokenType.TOOL_DEF,
    "tool_io": TokenType.TOOL_IO,
}
QUEUE_NAMES: dict[str, Queue] = {q.name.lower(): q for q in Queue}
SESSION_NAMES: dict[str, SessionClass] = {s.name.lower(): s for s in SessionClass}

_MULTI: dict[int, Queue] = {SessionClass.CHAT: Queue.CHAT, SessionClass.AGENT: Queue.AGENT}


def route(ttype: int, sclass: int, shared: bool = False) -> Queue:
    """The queue of a block (see the module docstring for the rule)."""
    if ttype == TokenType.REASONING:
        return Queue.EVICT_FIRST
    if shared:
        return Queue.STRUCTURE
    q = _MULTI.get(sclass)
    if q is not None:
        return q
    if ttype == TokenType.SYSTEM or ttype == TokenType.TOOL_DEF:
        return Queue.STRUCTURE
    if sclass == SessionClass.SINGLE:
        return Queue.EVICT_FIRST
    return Queue.CHAT
