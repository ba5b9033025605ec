"""In-flight prefill tokens per backend: the load term of the conversation cost model.

A backend's in-flight request count says how busy its decode is; what delays the next
request's first token is the prompt tokens it is still prefilling. The forwarder tells the
ledger both ends of that window::

    ticket = load.started(backend.name, tokens)  # when the request is sent
    ...
    load.finished(ticket)                        # first response byte, or the request failed

``tokens`` is what the backend must compute for the request (its prompt minus what it
already holds: ``ConversationScorer.prefill_tokens``). ``finished`` is idempotent, so a
forwarder may call it both on the first byte and in its ``finally``. Plain integers on the
event loop: no lock; a backend whose load drops to 0 leaves the map.
"""

from __future__ import annotations

__all__ = ["PrefillLoad", "PrefillTicket"]


class PrefillTicket:
    """One request's share of a backend's prefill load, until ``finished``."""

    __slots__ = ("backend", "tokens")

    def __init__(self, backend: str, tokens: int) -> None:
        self.backend = backend
        self.tokens = tokens
        """What this request still adds to the backend's load (0 once finished)."""


class PrefillLoad:
    """Prompt tokens each backend is prefilling for requests in flight."""

    def __init__(self) -> None:
        self._tokens: dict[str, int] = {}

    def started(self, backend: str, tokens: int) -> PrefillTicket:
        """Count ``tokens`` (clamped at 0) on ``backend`` until the ticket is finished."""
        tokens = max(0, int(tokens))
        if tokens:
            self._tokens[backend] = self._tokens.get(backend, 0) + tokens
        return PrefillTicket(backend, tokens)

    def finished(self, ticket: PrefillTicket) -> None:
        """The request's prefill is over (or it failed): its tokens no longer count.
        A second call for the same ticket does nothing."""
        tokens = ticket.tokens
        if not tokens:
            return
        ticket.tokens = 0
        left = self._tokens.get(ticket.backend, 0) - tokens
        if left > 0:
            self._tokens[ticket.backend] = left
        else:
            self._tokens.pop(ticket.backend, None)

    def tokens(self, backend: str) -> int:
        """Prefill tokens in flight on ``backend`` now."""
        return self._tokens.get(backend, 0)

    def snapshot(self) -> dict[str, int]:
        """Every backend with prefill tokens in flight (for metrics and admin)."""
        return dict(self._tokens)
