"""The reconnect loop every long-lived connection of Continuum runs under.

A source (a ZeroMQ subscriber, a trtllm poller, the listener's event-bus session, the
router's event consumer) splits into two parts, the shape of llm-d's ``zmq_subscriber.go``
(``Start`` loops, ``runSubscriber`` holds one connection) with the verdict of redis-py's
``Retry(supported_errors=...)``:

* ``run_once()`` holds one connection for its lifetime: it returns when the connection
  ended cleanly (reconnect) and raises when it failed;
* :class:`Supervisor` loops over connections and, after each, asks ``classify(error)``
  (``None`` after a clean end) what comes next:

  - :attr:`Verdict.RETRY`: one more consecutive failure; wait
    ``backoff.compute(failures)``, then reconnect;
  - :attr:`Verdict.RETRY_FLAT`: nothing went wrong with a peer (say, nobody offers the
    source yet): wait ``backoff.compute(1)`` without counting a failure, then reconnect;
  - :attr:`Verdict.FATAL`: stop, re-raising the error (returning after a clean end), for
    what retrying cannot fix (a publisher outside the allowlist).

Health: a connection calls :meth:`Supervisor.healthy` once it has proved itself (the
first good frame, a Welcome, a successful poll, an applied event). The first call of a
connection sets the failure count back to 0 and calls ``backoff.reset()``; later calls of
the same connection do nothing, so a hot path may call it freely (or guard it with
``if supervisor.failures``, to reset only after an outage). A healthy connection that then
ends with RETRY is failure 1 again: the wait after a long good stream is the first step.

One round, in order: ``should_stop()`` -> ``run_once()`` -> ``classify`` -> (FATAL: end)
-> ``should_stop()`` -> count -> ``on_retry(attempt)`` -> ``sleep(delay)``. ``classify``
runs inside the ``except`` block of the error, so it may ``log.exception``; ``on_retry`` is
where a caller logs and counts the ending, with everything it needs in :class:`Attempt`.
``should_stop`` is checked before each connection and again after each one ends, so a
draining client neither waits nor reports the session its drain ended.

``asyncio.CancelledError`` (a ``BaseException``) is never classified: from ``run_once`` and
from ``sleep`` alike it propagates, as does anything else that is not an ``Exception``.
``sleep`` is injected, so tests drive the loop without waiting on a timer.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from .backoff import Backoff

__all__ = ["Attempt", "Classifier", "Supervisor", "Verdict"]


class Verdict(enum.Enum):
    """What follows the end of one connection (module docstring)."""

    RETRY = "retry"
    RETRY_FLAT = "retry_flat"
    FATAL = "fatal"


Classifier = Callable[[Exception | None], Verdict]
"""``classify(error)``: the verdict on a connection that raised ``error`` (``None``: it
returned)."""


@dataclass(frozen=True, slots=True)
class Attempt:
    """How one connection ended and what the supervisor does next (``on_retry``'s argument)."""

    number: int
    """1 for the first connection, then one more per reconnect."""
    error: Exception | None
    """What the connection raised; ``None`` when it returned."""
    verdict: Verdict
    """RETRY or RETRY_FLAT (FATAL ends the loop without ``on_retry``)."""
    healthy: bool
    """The connection called :meth:`Supervisor.healthy`."""
    failures: int
    """Consecutive failures, this one included (unchanged by RETRY_FLAT)."""
    delay: float
    """Seconds the supervisor is about to wait."""


def _never() -> bool:
    return False


class Supervisor:
    """Runs ``run_once`` again and again, with backoff between connections.

    Args:
        run_once: Holds one connection; returns on a clean end, raises on a failure.
        classify: The verdict on each ending (module docstring). May log and count.
        backoff: Delay strategy; ``reset()`` when a connection proves healthy.
        sleep: Awaited with each delay (default ``asyncio.sleep``).
        on_retry: Called before each wait with the :class:`Attempt` (logs, counters).
        should_stop: Checked before each connection and after each ending; True ends
            :meth:`run` (it returns).
    """

    __slots__ = (
        "_backoff",
        "_classify",
        "_healthy",
        "_on_retry",
        "_run_once",
        "_should_stop",
        "_sleep",
        "attempts",
        "failures",
    )

    def __init__(
        self,
        run_once: Callable[[], Awaitable[None]],
        classify: Classifier,
        *,
        backoff: Backoff,
        sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
        on_retry: Callable[[Attempt], None] | None = None,
        should_stop: Callable[[], bool] = _never,
    ) -> None:
        self._run_once = run_once
        self._classify = classify
        self._backoff = backoff
        self._sleep = sleep
        self._on_retry = on_retry
        self._should_stop = should_stop
        self._healthy = False
        self.failures = 0
        """Consecutive failures so far (a plain attribute: hot paths read it)."""
        self.attempts = 0
        """Connections started, the current one included."""

    def healthy(self) -> None:
        """The current connection has proved itself: failures back to 0, backoff reset.

        Only the first call of a connection has an effect.
        """
        if self._healthy:
            return
        self._healthy = True
        self.failures = 0
        self._backoff.reset()

    async def run(self) -> None:
        """Supervise until ``should_stop``, a FATAL verdict, or cancellation.

        Raises:
            Exception: whatever ``run_once`` raised that ``classify`` found FATAL.
            asyncio.CancelledError: always propagated.
        """
        while not self._should_stop():
            self.attempts += 1
            self._healthy = False
            error: Exception | None = None
            try:
                await self._run_once()
            except Exception as exc:
                error = exc
                verdict = self._classify(exc)
                if verdict is Verdict.FATAL:
                    raise
            else:
                verdict = self._classify(None)
                if verdict is Verdict.FATAL:
                    return
            if self._should_stop():
                return
            if verdict is Verdict.RETRY:
                self.failures += 1
                delay = self._backoff.compute(self.failures)
            else:
                delay = self._backoff.compute(1)
            if self._on_retry is not None:
                self._on_retry(
                    Attempt(self.attempts, error, verdict, self._healthy, self.failures, delay)
                )
            error = None  # do not keep its traceback (and frames) alive through the wait
            await self._sleep(delay)
