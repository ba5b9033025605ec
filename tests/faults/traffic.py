"""Client traffic through the router while a fault happens: a few tenants, each with its
own long system prompt (one prefix key each), and fresh questions, from a few concurrent
clients on keep-alive connections, every outcome recorded with its start time.

With ``turns`` (conversation keys on), each tenant has ``chats`` chats that go on for
``turns`` turns and then start over: a request carries its chat's history (the questions
and the answers the router returned) and the next question. The questions are fixed, so
a chat started over renders the prompts it rendered before (the answers name the engine
that gave them: at most one variant per engine), and the keys the oracle tracks stay a
bounded set.

A request is *failed* when it did not end in a 200 with a complete body (refused,
reset, timed out, or an error status): what a client would have seen.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
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
    #: The answer's body, read by the traffic (a chat's next turn) and dropped before the
    #: outcome is kept.
    body: bytes | None = field(default=None, compare=False, repr=False)


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
    #: Turns of a chat before it starts over (0: every request a single turn).
    turns: int = 0
    chats: int = 2
    _histories: dict[tuple[int, int], list[dict[str, Any]]] = field(default_factory=dict)

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
                body, chat = self._body(n)
                outcome = await self._request(session, body)
                if outcome.ok and chat is not None and outcome.body is not None:
                    self._answered(chat, body, outcome.body)
                self.outcomes.append(replace(outcome, body=None))
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
                raw = await resp.read()
                ok = resp.status == 200
                return Outcome(
                    t0,
                    time.monotonic() - t0,
                    ok,
                    resp.headers.get("x-continuum-backend"),
                    None if ok else f"HTTP {resp.status}",
                    raw if ok else None,
                )
        except (TimeoutError, aiohttp.ClientError, OSError) as e:
            return Outcome(t0, time.monotonic() - t0, False, None, type(e).__name__)

    def _body(self, n: int) -> tuple[dict[str, Any], tuple[int, int] | None]:
        tenant = n % self.tenants
        if not self.turns:
            return tenant_body(tenant, n), None
        chat = (tenant, (n // self.tenants) % self.chats)
        history = self._histories.get(chat, [])
        turn = len(history) // 2
        if turn >= self.turns:
            history, turn = [], 0
        body = tenant_body(tenant, 0)
        question = f"{QUESTION} chat {chat[1]}, turn {turn}. " * 2
        body["messages"] = [
            body["messages"][0],
            *history,
            {"role": "user", "content": question},
        ]
        return body, chat

    def _answered(self, chat: tuple[int, int], body: dict[str, Any], raw: bytes) -> None:
        try:
            answer = json.loads(raw)["choices"][0]["message"]["content"]
        except (ValueError, LookupError, TypeError):
            return
        self._histories[chat] = [*body["messages"][1:], {"role": "assistant", "content": answer}]

    def window(self, start: float, end: float) -> list[Outcome]:
        return [o for o in self.outcomes if start <= o.start < end]
