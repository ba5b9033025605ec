"""Client traffic through the router while a fault happens: a few tenants, each with its
own long system prompt (one prefix key each), and fresh questions, from a few concurrent
clients on keep-alive connections, every outcome recorded with its start time.

A request is *failed* when it did not end in a 200 with a complete body (refused,
reset, timed out, or an error status): what a client would have seen.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from bus.prefix_key import extract_prefix_key

__all__ = ["Outcome", "Traffic", "tenant_body"]

MODEL = "demo-model"
QUESTION = "Please explain, step by step and with examples, "


def tenant_system(tenant: int) -> str:
    # Long enough that the system turn spans several full blocks.
    return f"You are assistant {tenant}. " + " ".join(f"rule-{tenant}-{i}" for i in range(60))


def tenant_body(tenant: int, n: int) -> dict[str, Any]:
    return {
        "model": MODEL,
        "max_tokens": 8,
        "messages": [
            {"role": "system", "content": tenant_system(tenant)},
            {"role": "user", "content": f"{QUESTION} question {n}. " * 3},
        ],
    }


def tenant_key(tenant: int) -> str:
    key = extract_prefix_key(tenant_body(tenant, 0))
    assert key is not None
    return key.hex()


@dataclass(frozen=True, slots=True)
class Outcome:
    start: float
    latency: float
    ok: bool
    backend: str | None
    error: str | None = None


@dataclass
class Traffic:
    """``clients`` loops sending requests to ``url()`` (read per request: a restarted
    router may move) until :meth:`stop`."""

    url: Callable[[], str]
    tenants: int = 8
    clients: int = 3
    #: Pause between a client's requests (keeps the 2-core box from saturating).
    think_s: float = 0.02
    timeout_s: float = 10.0
    outcomes: list[Outcome] = field(default_factory=list)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    _stop: asyncio.Event = field(default_factory=asyncio.Event)
    _seq: itertools.count[int] = field(default_factory=itertools.count)

    @property
    def keys(self) -> set[str]:
        return {tenant_key(t) for t in range(self.tenants)}

    def start(self) -> None:
        self._stop.clear()
        self._tasks = [asyncio.create_task(self._client(c)) for c in range(self.clients)]

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)
        self._tasks = []

    async def _client(self, c: int) -> None:
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while not self._stop.is_set():
                n = next(self._seq)
                outcome = await self._request(session, tenant_body(n % self.tenants, n))
                self.outcomes.append(outcome)
                if outcome.error is not None and not outcome.error.startswith("HTTP "):
                    await asyncio.sleep(0.05)  # a refused connection fails at once
                await asyncio.sleep(self.think_s)

    async def _request(self, session: aiohttp.ClientSession, body: dict[str, Any]) -> Outcome:
        """One client request (a subclass may spread it over several routers)."""
        return await self._post(session, self.url(), body, time.monotonic())

    async def _post(
        self, session: aiohttp.ClientSession, url: str, body: dict[str, Any], t0: float
    ) -> Outcome:
        """One POST to ``url``; its outcome timed from ``t0``."""
        try:
            async with session.post(url + "/v1/chat/completions", json=body) as resp:
                await resp.read()
                ok = resp.status == 200
                return Outcome(
                    t0,
                    time.monotonic() - t0,
                    ok,
                    resp.headers.get("x-continuum-backend"),
                    None if ok else f"HTTP {resp.status}",
                )
        except (TimeoutError, aiohttp.ClientError, OSError) as e:
            return Outcome(t0, time.monotonic() - t0, False, None, type(e).__name__)

    def window(self, start: float, end: float) -> list[Outcome]:
        return [o for o in self.outcomes if start <= o.start < end]
