"""Client traffic through a router while a test breaks something under it.

Two loops send requests one after another until the test is done; every answer that is
not a 200 is kept, so a failover test asserts "no client request failed" on all of them,
and ``served(n)`` lets it wait for traffic before and after the fault."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Callable
from types import TracebackType
from typing import Any

from .conftest import RouterProc, wait_until

__all__ = ["ClientLoad"]


class ClientLoad:
    def __init__(
        self, router: RouterProc, body: Callable[[int], dict[str, Any]], clients: int = 2
    ) -> None:
        self.router = router
        self.body = body
        self.clients = clients
        self.failures: list[Any] = []
        self.count = 0
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    async def _client(self) -> None:
        for i in itertools.count():
            if self._stop.is_set():
                return
            r = await self.router.chat(self.body(i))
            if r.status != 200:
                self.failures.append(r)
            self.count += 1

    async def served(self, n: int, what: str) -> None:
        """Until ``n`` requests were answered (one way or the other) since the start."""

        async def enough() -> bool:
            return self.count >= n

        await wait_until(enough, within=20, what=what)

    async def __aenter__(self) -> ClientLoad:
        self._tasks = [asyncio.create_task(self._client()) for _ in range(self.clients)]
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
