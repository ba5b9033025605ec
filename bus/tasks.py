"""Stopping background tasks without swallowing the caller's own cancellation.

The pattern this replaces::

    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task

cannot tell the task's CancelledError (expected: we cancelled it) from the caller's (its
own task is being cancelled while it waits): it swallows both, and a cancelled shutdown
carries on as if nothing happened. :func:`cancel_and_wait` never catches a CancelledError
at all: it waits with ``asyncio.wait``, which reports the tasks' endings without raising
them, so the only CancelledError that can come out of it is the caller's, and that one
propagates. A task that ended with an exception is not re-raised (a stop path is no place
to fail); it is logged when the caller passes a logger.

A caller stopping tasks in a ``finally`` while its own task is being cancelled still gets
them stopped: the cancellation was already delivered, so the wait is not interrupted
unless the caller is cancelled once more.

A cancellation can be lost inside the task: on Python 3.11 ``asyncio.wait_for`` returns
its operation's result when the cancellation arrives in the same loop iteration as that
result, and the task carries on (redis-py wraps every socket write in it). A stopper that
waits once then waits forever, and whatever it was doing (a resync that starts a stream
over) never happens. So a task still running ``RECANCEL_SECONDS`` after its cancellation
is cancelled again, until it ends, with one warning per task. (A stop-time cleanup that
takes longer than that is interrupted once more; one that must take long belongs before
the cancellation, as ``grace``.)
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

__all__ = ["RECANCEL_SECONDS", "cancel_and_wait"]

RECANCEL_SECONDS = 1.0
_log = logging.getLogger("continuum.tasks")


async def cancel_and_wait(
    *tasks: asyncio.Future[Any] | None,
    grace: float | None = None,
    log: logging.Logger | None = None,
) -> None:
    """Cancel ``tasks`` and wait until each has ended; ``None`` entries are skipped.

    Args:
        tasks: Tasks (or other futures, e.g. a ``gather``) to stop.
        grace: Seconds to let them finish on their own first; None or 0: cancel at once.
        log: Where an exception a task ended with is logged (with its traceback); None:
            it is dropped silently.

    Raises:
        asyncio.CancelledError: the caller itself was cancelled while waiting (the tasks
            are cancelled then, but not waited for).
    """
    pending = {t for t in tasks if t is not None}
    if not pending:
        return
    if grace:
        try:
            _done, pending = await asyncio.wait(pending, timeout=grace)
        except asyncio.CancelledError:
            for t in pending:
                t.cancel()
            raise
    warned: set[asyncio.Future[Any]] = set()
    while pending:
        for t in pending:
            t.cancel()
        _done, pending = await asyncio.wait(pending, timeout=RECANCEL_SECONDS)
        for t in pending - warned:
            _log.warning("task %s still runs after its cancellation; cancelling it again", _name(t))
            warned.add(t)
    for fut in tasks:
        if fut is None or fut.cancelled():
            continue
        exc = fut.exception()  # retrieved, so asyncio does not report it at collection
        if exc is not None and log is not None:
            log.error("task %s ended with an error while stopping", _name(fut), exc_info=exc)


def _name(fut: asyncio.Future[Any]) -> str:
    return fut.get_name() if isinstance(fut, asyncio.Task) else repr(fut)
