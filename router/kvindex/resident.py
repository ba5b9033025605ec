"""LiveConversations: how many prompt tokens of live conversations each backend keeps.

The chain index says what a backend holds now, and the load terms what it is computing
now; neither says how much its cache is *asked to keep*. Sessions are sticky, so the
engine a conversation starts on keeps every later turn of it, and an engine that took
more sessions than the others runs out of cache first and starts evicting histories that
will come back (``bench/fleet_bench.py`` (a): the engines with 27-31 of 96 sessions lost
2-4 points of token hit rate to evicted histories, the one with 16 none). A new session
of a shared system prompt ties on what is held (every holder has the prompt) and goes to
the prompt's home until the load cap moves it, so the big prompts' homes fill up.

What is kept here: each conversation routed in the last ``window`` seconds, found by the
key of its latest request's last chunk, with that request's prompt tokens, per backend.
The next turn of a conversation renders the previous prompt and more, so the previous
request's last key is one of its keys: :meth:`find` looks for it among the keys some
backend holds (the previous request's keys were predicted held where it went), and
:meth:`placed` moves the conversation to its new last key and backend. A conversation
whose turns stop counting after ``window`` seconds; the table is bounded (oldest out).
Each router replica keeps its own view of the conversations it routed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

__all__ = ["LiveConversations"]

_MAX_CONVERSATIONS = 1 << 16


class LiveConversations:
    """Live conversations per backend, weighed by their prompt tokens (module docstring)."""

    __slots__ = ("_by_key", "_clock", "_tokens", "max_conversations", "window")

    def __init__(
        self,
        window: float,
        clock: Callable[[], float],
        max_conversations: int = _MAX_CONVERSATIONS,
    ) -> None:
        self.window = window
        self._clock = clock
        self.max_conversations = max_conversations
        self._by_key: dict[bytes, tuple[str, int, float]] = {}
        """A conversation's latest last key -> (backend, prompt tokens, time routed);
        insertion order is routing order (a conversation routed again is re-inserted)."""
        self._tokens: dict[str, int] = {}
        """Per backend, the sum of its live conversations' prompt tokens."""

    def __len__(self) -> int:
        return len(self._by_key)

    def find(self, keys: Sequence[bytes], depth: int) -> bytes | None:
        """The key, among ``keys[:depth]`` (deepest first), under which this request's
        conversation was last routed, or None (a new conversation, or one idle for longer
        than the window)."""
        by_key = self._by_key
        if not by_key:
            return None
        for i in range(min(depth, len(keys)) - 1, -1, -1):
            key = keys[i]
            if key in by_key:
                return bytes(key)
        return None

    def owner(self, key: bytes | None) -> tuple[str, int] | None:
        """The backend and tokens the conversation last routed under ``key`` counts on."""
        if key is None:
            return None
        entry = self._by_key.get(key)
        return None if entry is None else (entry[0], entry[1])

    def tokens(self, name: str) -> int:
        """Prompt tokens of the conversations routed to ``name`` in the last window."""
        return self._tokens.get(name, 0)

    def expire(self) -> None:
        """Drop the conversations not routed within the window (oldest first)."""
        by_key = self._by_key
        if not by_key:
            return
        horizon = self._clock() - self.window
        while by_key:
            key = next(iter(by_key))
            if by_key[key][2] >= horizon:
                return
            self._drop(key)

    def placed(self, previous: bytes | None, last_key: bytes, backend: str, tokens: int) -> None:
        """The request whose conversation was last routed under ``previous`` (None: new)
        went to ``backend`` with ``tokens`` prompt tokens; ``last_key`` is its last key."""
        if previous is not None:
            self._drop(previous)
        self._drop(last_key)  # (the same prompt sent again)
        by_key = self._by_key
        by_key[last_key] = (backend, tokens, self._clock())
        self._tokens[backend] = self._tokens.get(backend, 0) + tokens
        if len(by_key) > self.max_conversations:
            self._drop(next(iter(by_key)))
        self.expire()

    def _drop(self, key: bytes) -> None:
        entry = self._by_key.pop(key, None)
        if entry is None:
            return
        name, tokens, _ = entry
        left = self._tokens[name] - tokens
        if left:
            self._tokens[name] = left
        else:
            del self._tokens[name]
