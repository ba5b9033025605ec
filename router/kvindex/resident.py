"""LiveConversations: how many prompt tokens of live conversations each backend keeps.

The chain index says what a backend holds now, and the load terms what it is computing
now; neither says how much its cache is *asked to keep*. Sessions are sticky, so the
engine a conversation starts on keeps every later turn of it, and an engine that took
more sessions than the others runs out of cache first and starts evicting histories that
will come back (``bench/fleet_bench.py`` (a): the engines with 27-31 of 96 sessions lost
2-4 points of token hit rate to evicted histories, the one with 16 none). A new session
of a shared system prompt ties on what is held (every holder has the prompt) and goes to
the prompt's home until the load cap moves it, so the big prompts' homes fill up.

What is kept here: each conversation routed in the last ``window`` seconds, by its
identity (``router.conversation.identity``: the digest of its messages up to the first
user one, the same in every turn), with its latest request's prompt tokens and backend.
A conversation whose turns stop counting after ``window`` seconds; the table is bounded
(oldest out). Each router replica keeps its own view of the conversations it routed.

**A first request counts by how often its prompt's conversations go on.** Most single
requests never come back, and an engine is not asked to keep them: counting them in full
turns the term into a balance of all recent traffic (``bench/affinity_bench.py``, 8 shared
prompts and single requests, weight 0.1: the worst prompt fell from 88-93 % to 79-82 % on
one backend, each request's question weighed as if it would be asked again). Not counting
them at all leaves a burst of new sessions unbalanced until their second turns. So per
prompt (its first chain key) the share of its conversations that sent a second request is
kept, ``(continued + 1) / (started + 2)``, both halved past ``2 * _PROMPT_HALFLIFE``
starts, and a first request counts that share of its tokens; from its second request on a
conversation counts in full.

**How much a prompt's turns add.** Per prompt the bytes of its conversations' first
requests and what each later request added to its conversation's prompt are kept too
(:meth:`LiveConversations.small_turns`): a prompt whose turns add a small share of it each
(a long system prompt and short exchanges) is worth only its shared prefix to the scorer,
as a one-shot prompt is (``router.kvindex.cost``), unless the prompt has more than one
backend's share of the recent requests (:meth:`LiveConversations.share`: each prompt's
requests weighed down by half per 2,048 requests of all prompts since).
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["LiveConversations"]

_MAX_CONVERSATIONS = 1 << 16
_MAX_PROMPTS = 1 << 14
_PROMPT_HALFLIFE = 64
_SHARE_HALFLIFE = 2048
_SHARE_DECAY = 2.0 ** (-1.0 / _SHARE_HALFLIFE)


class _Prompt:
    """What is known of one prompt's conversations (halved as they accumulate, so a prompt
    whose use changes is judged by its recent conversations)."""

    __slots__ = ("added", "continued", "first_bytes", "later", "recent", "seen_at", "started")

    def __init__(self) -> None:
        self.started = 0.0
        """Conversations started."""
        self.continued = 0.0
        """Of them, those that sent a second request."""
        self.first_bytes = 0.0
        """Prompt bytes of the started conversations' first requests."""
        self.later = 0.0
        """Requests after a conversation's first."""
        self.added = 0.0
        """Bytes those requests added to their conversation's previous prompt."""
        self.recent = 0.0
        """Its requests, each weighed down by half per ``_SHARE_HALFLIFE`` requests of all
        prompts since (:meth:`LiveConversations.share`)..."""
        self.seen_at = 0
        """... as of this request of all prompts."""


class LiveConversations:
    """Live conversations per backend, weighed by their prompt tokens (module docstring)."""

    __slots__ = (
        "_by_id",
        "_clock",
        "_prompts",
        "_requests",
        "_tokens",
        "_weight",
        "max_conversations",
        "window",
    )

    def __init__(
        self,
        window: float,
        clock: Callable[[], float],
        max_conversations: int = _MAX_CONVERSATIONS,
    ) -> None:
        self.window = window
        self._clock = clock
        self.max_conversations = max_conversations
        self._by_id: dict[bytes, tuple[str, int, float, _Prompt, int, bool]] = {}
        """A conversation's identity -> (backend, prompt tokens counted, time routed, its
        prompt's statistics, its latest request's prompt bytes, whether it sent more than
        one request); insertion order is routing order (a conversation routed again is
        re-inserted)."""
        self._tokens: dict[str, int] = {}
        """Per backend, the sum of its live conversations' counted prompt tokens."""
        self._prompts: dict[bytes, _Prompt] = {}
        """A prompt's first key -> what is known of its conversations."""
        self._requests = 0
        """Requests placed, of all prompts."""
        self._weight = 0.0
        """Their sum, each weighed as :attr:`_Prompt.recent` weighs a prompt's own."""

    def __len__(self) -> int:
        return len(self._by_id)

    def owner(self, conversation: bytes | None) -> tuple[str, int] | None:
        """The backend the conversation was last routed to and the tokens it counts there
        (None: not live)."""
        if conversation is None:
            return None
        entry = self._by_id.get(conversation)
        return None if entry is None else (entry[0], entry[1])

    def tokens(self, name: str) -> int:
        """Counted prompt tokens of the conversations routed to ``name`` in the window."""
        return self._tokens.get(name, 0)

    def continuing(self, first_key: bytes) -> float:
        """The share of the conversations of the prompt starting with ``first_key`` that
        sent a second request (1/2 for a prompt not seen)."""
        stats = self._prompts.get(first_key)
        if stats is None:
            return 0.5
        return (stats.continued + 1.0) / (stats.started + 2.0)

    def one_shot(self, first_key: bytes, share: float, evidence: int) -> bool:
        """Whether at least ``evidence`` conversations of the prompt starting with
        ``first_key`` started and fewer than ``share`` of them sent a second request."""
        stats = self._prompts.get(first_key)
        if stats is None or stats.started < evidence:
            return False
        return (stats.continued + 1.0) / (stats.started + 2.0) < share

    def small_turns(self, first_key: bytes, share: float, evidence: int) -> bool:
        """Whether, over at least ``evidence`` requests after their conversation's first,
        the conversations of the prompt starting with ``first_key`` grew on average by
        less than ``share`` of their first request's prompt bytes per request."""
        stats = self._prompts.get(first_key)
        if stats is None or stats.later < evidence or not stats.started:
            return False
        return stats.added * stats.started < share * stats.first_bytes * stats.later

    def judged(self, first_key: bytes, started: int, later: int) -> bool:
        """Whether enough is known of the prompt starting with ``first_key`` to judge it:
        ``started`` of its conversations started, or ``later`` requests after their first
        (:meth:`one_shot` and :meth:`small_turns` need as much)."""
        stats = self._prompts.get(first_key)
        return stats is not None and (stats.started >= started or stats.later >= later)

    def share(self, first_key: bytes) -> float:
        """The share of recent requests (the last few thousand, of all prompts) that were
        the prompt starting with ``first_key``'s (0 for a prompt not seen)."""
        stats = self._prompts.get(first_key)
        if stats is None or not self._weight:
            return 0.0
        gap = self._requests - stats.seen_at
        return stats.recent * _SHARE_DECAY**gap / self._weight

    def prompts(self) -> list[bytes]:
        """The first keys of the prompts whose conversations are known (at most
        ``_MAX_PROMPTS``, in the order they were first seen)."""
        return list(self._prompts)

    def expire(self) -> None:
        """Drop the conversations not routed within the window (oldest first)."""
        by_id = self._by_id
        if not by_id:
            return
        horizon = self._clock() - self.window
        while by_id:
            conversation = next(iter(by_id))
            if by_id[conversation][2] >= horizon:
                return
            self._drop(conversation)

    def placed(
        self, conversation: bytes, first_key: bytes, backend: str, tokens: int, *, size: int
    ) -> None:
        """A request of ``conversation`` (its prompt's first chain key ``first_key``) went
        to ``backend`` with ``tokens`` prompt tokens (estimated) and ``size`` prompt bytes
        (exact: what :meth:`small_turns` compares)."""
        entry = self._by_id.get(conversation)
        stats = entry[3] if entry is not None else self._prompt(first_key)
        self._requests += 1
        self._weight = self._weight * _SHARE_DECAY + 1.0
        stats.recent = stats.recent * _SHARE_DECAY ** (self._requests - stats.seen_at) + 1.0
        stats.seen_at = self._requests
        if entry is not None:
            if not entry[5]:
                stats.continued += 1.0  # its second request
            stats.later += 1.0
            stats.added += max(0, size - entry[4])
            if stats.later > 2 * _PROMPT_HALFLIFE:
                stats.later *= 0.5
                stats.added *= 0.5
            self._drop(conversation)
        else:
            counted = round(tokens * self.continuing(first_key))
            stats.started += 1.0
            stats.first_bytes += size
            if stats.started > 2 * _PROMPT_HALFLIFE:
                stats.started *= 0.5
                stats.continued *= 0.5
                stats.first_bytes *= 0.5
            tokens = counted
        by_id = self._by_id
        by_id[conversation] = (backend, tokens, self._clock(), stats, size, entry is not None)
        if tokens:
            self._tokens[backend] = self._tokens.get(backend, 0) + tokens
        if len(by_id) > self.max_conversations:
            self._drop(next(iter(by_id)))
        self.expire()

    def _prompt(self, first_key: bytes) -> _Prompt:
        prompts = self._prompts
        stats = prompts.get(first_key)
        if stats is None:
            stats = prompts[first_key] = _Prompt()
            if len(prompts) > _MAX_PROMPTS:
                del prompts[next(iter(prompts))]
        return stats

    def _drop(self, conversation: bytes) -> None:
        entry = self._by_id.pop(conversation, None)
        if entry is None or not entry[1]:
            return
        name, tokens = entry[0], entry[1]
        left = self._tokens[name] - tokens
        if left:
            self._tokens[name] = left
        else:
            del self._tokens[name]
