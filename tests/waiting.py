"""Waiting for a condition in a test: poll it, never sleep a fixed time.

Polling is deliberate: most conditions are counters or another process's state, with no
notification hook (and they should not grow one for tests).
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any

__all__ = ["eventually"]


async def eventually(
    predicate: Callable[[], Any | Awaitable[Any]],
    within: float = 10.0,
    interval: float = 0.01,
    what: str = "condition",
) -> Any:
    """Call ``predicate`` (awaiting what it returns, if awaitable) until it is truthy and
    return that value; fail with ``AssertionError`` after ``within`` seconds."""
    deadline = time.monotonic() + within
    while True:
        last = predicate()
        if inspect.isawaitable(last):
            last = await last
        if last:
            return last
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {within}s waiting for {what} (last: {last!r})")
        await asyncio.sleep(interval)
