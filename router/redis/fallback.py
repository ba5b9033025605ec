"""Redis with an in-memory fallback: the supervision every Redis-backed store shares.

The response cache (``router.cache.fallback``) and the KV index
(``router.kvindex.fallback``) each put a memory store behind Redis, so that a request
never fails because Redis did. A :class:`FallbackSupervisor` decides which of the two
serves and owns the way back; the store owns everything specific to it: which errors mean
an outage, what it remembers while Redis is away, and how that reaches Redis again.

States (``active``):

* **Redis** (False): the store talks to Redis. When an operation fails in a way that means
  Redis is unusable, the store calls ``engage(operation, cause)`` and answers from memory.
  The first call of an outage switches: ``active`` turns True, ``wait_recovered()`` blocks,
  ``count`` goes up, one warning is logged, ``on_state_change(True)`` is called and the
  monitor task is started. Later calls during the same outage do nothing, so a burst of
  failing requests counts, logs and notifies once.
* **Fallback** (True): the store serves from memory and leaves Redis alone; the monitor
  sleeps ``interval_s``, then makes a recovery attempt, until one succeeds.

A recovery attempt (``try_recover``: the monitor's, or anyone's) runs under a lock, so two
never overlap: ``ping()``, then ``replay()``, in which the store pushes what changed during
the outage and answers whether all of it is in Redis now. An exception listed in
``unavailable``, from either, means Redis is still down: False, try later; so does a
``replay()`` that could not catch up (writes arriving faster than it replays them). Any
other exception propagates to the caller; the monitor logs it and tries again next tick.
On success, with no ``await`` between the end of ``replay()`` and the flag (so no operation
lands between the two stores), ``active`` turns False, ``switch_back()`` runs (synchronous:
the store empties its memory), ``wait_recovered()`` returns, a warning is logged and
``on_state_change(False)`` is called.

Back on Redis, the monitor calls ``settle()`` (when the store has one) while it returns
True: work that must reach Redis but must not hold up the switch back (the cache's outage
deletes, which could otherwise arrive faster than they are applied). A new outage meanwhile
takes over at once. Then the monitor ends, and the next outage starts a new one.
``close()`` cancels it. ``asyncio.CancelledError`` always propagates: a cancelled attempt
leaves the state as it was, the lock released, and what was not replayed still pending
(the store's ``replay()`` must put back what it took out before a failed await).

Hooks must not block; an exception from ``on_state_change`` is logged and swallowed (a
metrics callback must not break the store).

A store holds its supervisor as ``_supervisor`` and inherits :class:`SupervisedStore`,
which gives it the public face callers, metrics and tests use: ``fallback_active``,
``fallback_count``, ``monitor_interval_s``, ``wait_recovered()`` and ``try_recover()``.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable

__all__ = ["FallbackSupervisor", "SupervisedStore"]

_log = logging.getLogger(__name__)


class FallbackSupervisor:
    """Which of Redis and memory serves a store, and the monitor that switches back."""

    def __init__(
        self,
        name: str,
        *,
        ping: Callable[[], Awaitable[object]],
        replay: Callable[[], Awaitable[bool]],
        switch_back: Callable[[], str],
        unavailable: tuple[type[BaseException], ...],
        interval_s: float,
        settle: Callable[[], Awaitable[bool]] | None = None,
        on_state_change: Callable[[bool], None] | None = None,
        serving: str = "serving from memory",
        logger: logging.Logger = _log,
    ) -> None:
        """
        Args:
            name: what the logs call the store (``Redis <name> unavailable ...``).
            ping: raises one of ``unavailable`` while Redis is down.
            replay: push the outage's changes to Redis; True once nothing is left.
            switch_back: run at the switch back, without awaiting; returns a note for the
                recovery log line.
            unavailable: the exceptions that mean Redis is (still) down.
            interval_s: the monitor's period while the fallback is active.
            settle: one step of the work left for after the switch back; False when there
                was none.
            on_state_change: ``(active)`` on every switch.
            serving: what the store does during an outage, for the engage log line.
            logger: where to log (the store's own logger).
        """
        self.name = name
        self._ping = ping
        self._replay = replay
        self._switch_back = switch_back
        self._unavailable = unavailable
        self.interval_s = interval_s
        self._settle = settle
        self._on_state_change = on_state_change
        self._serving = serving
        self._log = logger
        self._active = False
        self._recovered = asyncio.Event()
        self._recovered.set()
        self._lock = asyncio.Lock()
        self._monitor: asyncio.Task[None] | None = None
        self._count = 0

    # ---- state ---------------------------------------------------------------------------

    @property
    def active(self) -> bool:
        """True while the fallback serves and Redis is left alone."""
        return self._active

    @property
    def count(self) -> int:
        """Switches to the fallback since start (outages, not failed operations)."""
        return self._count

    @property
    def interval_s(self) -> float:
        """The monitor's period while the fallback is active."""
        return self._interval_s

    @interval_s.setter
    def interval_s(self, value: float) -> None:
        if not (value > 0 and math.isfinite(value)):
            raise ValueError(f"monitor_interval_s must be positive and finite, not {value!r}")
        self._interval_s = value

    async def wait_recovered(self) -> None:
        """Return once Redis serves again (at once if it never stopped)."""
        await self._recovered.wait()

    # ---- switching -----------------------------------------------------------------------

    def engage(self, operation: str, cause: BaseException) -> None:
        """Switch to the fallback, once per outage, and make sure the monitor runs.

        ``operation`` and ``cause`` (the failure that revealed the outage) are for the log.
        Needs a running loop."""
        if self._active:
            return
        self._active = True
        self._recovered.clear()
        self._count += 1
        self._log.warning(
            "Redis %s unavailable during %s (%s: %s); %s, checking Redis every %gs",
            self.name,
            operation,
            type(cause).__name__,
            cause,
            self._serving,
            self._interval_s,
        )
        self._notify(True)
        self.start_monitor()

    async def try_recover(self) -> bool:
        """One recovery attempt: PING, replay the outage's changes, switch back.

        Returns whether Redis serves again. Safe to call at any time (the monitor does)."""
        if not self._active:
            return True
        async with self._lock:
            if not self._active:
                return True
            try:
                await self._ping()
                caught_up = await self._replay()
            except self._unavailable as exc:
                self._log.debug("Redis %s still unavailable: %r", self.name, exc)
                return False
            if not caught_up:
                return False  # changes keep arriving faster than they are replayed; next tick
            # No await from the end of the replay to here: nothing lands in between.
            self._active = False
            note = self._switch_back()
            self._recovered.set()
            self._log.warning("Redis %s available again (%s)", self.name, note)
            self._notify(False)
            return True

    def _notify(self, active: bool) -> None:
        if self._on_state_change is None:
            return
        try:
            self._on_state_change(active)
        except Exception:  # a metrics callback must not break the store
            self._log.exception("%s on_state_change(%s) callback failed", self.name, active)

    # ---- monitor -------------------------------------------------------------------------

    def start_monitor(self, interval_s: float | None = None) -> None:
        """Start the monitor unless it runs (``engage`` does); it ends once there is
        nothing left to do. ``interval_s`` replaces the period. Needs a running loop."""
        if interval_s is not None:
            self.interval_s = interval_s
        if self._monitor is None or self._monitor.done():
            self._monitor = asyncio.get_running_loop().create_task(
                self._monitor_loop(), name=f"redis-fallback-monitor[{self.name}]"
            )

    async def _monitor_loop(self) -> None:
        while True:
            if self._active:
                await asyncio.sleep(self._interval_s)
                try:
                    await self.try_recover()
                except Exception:
                    self._log.exception(
                        "Redis %s recovery failed; retrying in %gs", self.name, self._interval_s
                    )
            elif self._settle is None:
                return
            else:
                try:
                    if not await self._settle():
                        return
                except Exception:
                    self._log.exception(
                        "Redis %s: applying outage changes failed; retrying in %gs",
                        self.name,
                        self._interval_s,
                    )
                    await asyncio.sleep(self._interval_s)

    async def close(self) -> None:
        """Stop the monitor (if it runs). Idempotent; the state stays as it is."""
        task, self._monitor = self._monitor, None
        if task is not None and not task.done():
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                current = asyncio.current_task()
                if current is not None and current.cancelling():
                    raise


class SupervisedStore:
    """The fallback surface of a store whose ``_supervisor`` decides where it serves from."""

    _supervisor: FallbackSupervisor

    @property
    def fallback_active(self) -> bool:
        """True while Redis is bypassed and the store serves from its fallback."""
        return self._supervisor.active

    @property
    def fallback_count(self) -> int:
        """Switches to the fallback since start."""
        return self._supervisor.count

    @property
    def monitor_interval_s(self) -> float:
        """PING period while the fallback is active."""
        return self._supervisor.interval_s

    @monitor_interval_s.setter
    def monitor_interval_s(self, value: float) -> None:
        self._supervisor.interval_s = value

    async def wait_recovered(self) -> None:
        """Return once Redis serves again (at once if it never stopped)."""
        await self._supervisor.wait_recovered()

    async def try_recover(self) -> bool:
        """One recovery attempt: PING, replay the outage's changes, switch back.

        Returns whether Redis serves again. Safe to call at any time (the monitor does)."""
        return await self._supervisor.try_recover()
