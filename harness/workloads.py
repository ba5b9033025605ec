"""Multi-turn chat workloads and the client that drives them through a router.

Conversation-depth routing is judged on traffic where turn k+1 of a session repeats
turns 1..k, so these workloads are sessions, not independent requests, and the client
behaves like a real one: it sends a session's next turn only after the previous answer
arrived, with that answer (the engine's own text or tool calls) appended to the history.

Three shapes (all deterministic for a seed; only the interleaving of concurrent sessions
depends on timing):

* :func:`shared_prompt_chat`: several system prompts, each shared by many sessions (one
  product prompt, many users); the user turns are the sessions' own.
* :func:`agent_tool_loops`: agents on a few shared tool suites (tools in the request, a
  system prompt per suite); each session is a task: the user's request, then tool calls
  the engine is forced to make (``tool_choice: "required"``) answered with long tool
  results, then a final text answer. Prompts grow to several thousand tokens.
* :func:`unique_prompt_chat`: every session with its own system prompt (nothing shared
  across sessions: routing cannot win anything there, only lose).

Every request carries the session id as the OpenAI ``user`` field (what ConsistentHash's
session affinity reads, and what real clients send).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

__all__ = [
    "Progress",
    "Record",
    "Send",
    "Session",
    "Turn",
    "Workload",
    "agent_tool_loops",
    "paragraph",
    "question",
    "replay_session",
    "run_workload",
    "shared_prompt_chat",
    "stickiness",
    "unique_prompt_chat",
]

_WORDS = (
    "account", "address", "answer", "balance", "battery", "billing", "button", "cable",
    "change", "charge", "check", "client", "contract", "cover", "credit", "customer",
    "damage", "data", "delivery", "device", "display", "document", "driver", "error",
    "export", "filter", "firmware", "invoice", "issue", "label", "light", "limit", "manual",
    "message", "model", "network", "notice", "number", "option", "order", "owner", "paper",
    "payment", "period", "policy", "power", "printer", "profile", "refund", "region",
    "repair", "report", "request", "reset", "return", "review", "screen", "service",
    "setting", "signal", "status", "storage", "support", "system", "ticket", "update",
    "user", "version", "warranty", "window",
)  # fmt: skip
_VERBS = (
    "check", "confirm", "explain", "describe", "list", "compare", "find", "verify",
    "summarize", "update", "cancel", "restore",
)  # fmt: skip


@dataclass(frozen=True)
class Turn:
    """One request of a session: what the client appends to the history, then sends.

    ``user``: a user message; ``tool_result``: the result of every tool call of the
    previous answer (one ``tool`` message per call, with its ``tool_call_id``).
    """

    user: str | None = None
    tool_result: str | None = None
    tool_choice: Any = None
    max_tokens: int = 48


@dataclass(frozen=True)
class Session:
    id: str
    #: Which shared prompt (or tool suite) the session uses; its own id when none is shared.
    group: str
    system: str
    turns: tuple[Turn, ...]
    tools: tuple[dict[str, Any], ...] | None = None


@dataclass(frozen=True)
class Workload:
    name: str
    description: str
    sessions: tuple[Session, ...]

    @property
    def requests(self) -> int:
        return sum(len(s.turns) for s in self.sessions)


@dataclass
class Record:
    """One request as the client saw it."""

    session: str
    turn: int
    status: int
    backend: str | None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    seconds: float = 0.0


def sentence(rng: random.Random, words: int) -> str:
    """A deterministic English-like sentence (about one Qwen token per word)."""
    picked = [rng.choice(_WORDS) for _ in range(words)]
    return " ".join(picked).capitalize() + "."


def paragraph(rng: random.Random, words: int) -> str:
    """Sentences of 8 to 16 words, ``words`` in all."""
    out: list[str] = []
    while words > 0:
        n = min(words, rng.randint(8, 16))
        out.append(sentence(rng, n))
        words -= n
    return " ".join(out)


def question(rng: random.Random, words: int) -> str:
    """A user request of about ``words`` words."""
    return f"Please {rng.choice(_VERBS)} this: {paragraph(rng, words)}"


def shared_prompt_chat(
    prompts: int = 8,
    sessions_per_prompt: int = 8,
    turns: int = 6,
    *,
    popularity: Sequence[int] = (),
    system_words: int = 700,
    user_words: int = 60,
    max_tokens: int = 48,
    seed: int = 1,
) -> Workload:
    """(a): ``prompts`` system prompts, each shared by ``sessions_per_prompt`` sessions
    times its ``popularity`` weight (1 for prompts past the list): a few popular prompts
    carry more load than one backend can take."""
    rng = random.Random(seed)
    systems = [
        f"You are assistant {p} of product line {rng.randrange(10_000)}. "
        + paragraph(rng, system_words)
        for p in range(prompts)
    ]
    sessions = []
    for p, system in enumerate(systems):
        weight = popularity[p] if p < len(popularity) else 1
        for s in range(sessions_per_prompt * weight):
            ts = tuple(
                Turn(user=question(rng, user_words), max_tokens=max_tokens) for _ in range(turns)
            )
            sessions.append(Session(f"chat-p{p}-s{s}", f"prompt-{p}", system, ts))
    rng.shuffle(sessions)
    per = "/".join(str(sessions_per_prompt * (popularity[p] if p < len(popularity) else 1))
                   for p in range(prompts))  # fmt: skip
    return Workload(
        "shared-prompt chat",
        f"{prompts} system prompts x {per} sessions x {turns} turns",
        tuple(sessions),
    )


def _tool(rng: random.Random, suite: int, i: int, words: int) -> dict[str, Any]:
    props = {
        f"{rng.choice(_WORDS)}_{k}": {"type": "string", "description": sentence(rng, 10)}
        for k in range(4)
    }
    return {
        "type": "function",
        "function": {
            "name": f"suite{suite}_{rng.choice(_VERBS)}_{rng.choice(_WORDS)}_{i}",
            "description": paragraph(rng, words),
            "parameters": {"type": "object", "properties": props, "required": list(props)[:1]},
        },
    }


def agent_tool_loops(
    suites: int = 3,
    sessions_per_suite: int = 8,
    steps: int = 7,
    *,
    tools_per_suite: int = 10,
    tool_words: int = 110,
    result_words: int = 260,
    max_tokens: int = 48,
    seed: int = 2,
) -> Workload:
    """(b): agents on ``suites`` shared tool suites; each session is a task of ``steps``
    requests: the user's task, tool calls answered with long results, a final answer."""
    rng = random.Random(seed)
    kits = []
    for k in range(suites):
        system = f"You are agent {k}. Work step by step and call tools. " + paragraph(rng, 120)
        tools = tuple(_tool(rng, k, i, tool_words) for i in range(tools_per_suite))
        kits.append((system, tools))
    sessions = []
    for k, (system, tools) in enumerate(kits):
        for s in range(sessions_per_suite):
            ts = [Turn(user=question(rng, 50), tool_choice="required", max_tokens=max_tokens)]
            for step in range(1, steps):
                last = step == steps - 1
                ts.append(
                    Turn(
                        tool_result=json.dumps(
                            {"step": step, "result": paragraph(rng, result_words)}
                        ),
                        tool_choice="auto" if last else "required",
                        max_tokens=max_tokens,
                    )
                )
            sessions.append(Session(f"agent-k{k}-s{s}", f"suite-{k}", system, tuple(ts), tools))
    rng.shuffle(sessions)
    return Workload(
        "agent tool loops",
        f"{suites} tool suites x {sessions_per_suite} sessions x {steps} steps",
        tuple(sessions),
    )


def unique_prompt_chat(
    sessions: int = 48,
    turns: int = 4,
    *,
    system_words: int = 300,
    user_words: int = 60,
    max_tokens: int = 48,
    seed: int = 3,
) -> Workload:
    """(c): every session with its own system prompt."""
    rng = random.Random(seed)
    out = []
    for s in range(sessions):
        system = f"You are the private assistant of customer {s}. " + paragraph(rng, system_words)
        ts = tuple(
            Turn(user=question(rng, user_words), max_tokens=max_tokens) for _ in range(turns)
        )
        out.append(Session(f"own-s{s}", f"own-s{s}", system, ts))
    return Workload(
        "own system prompts", f"{sessions} sessions x {turns} turns, no prompt shared", tuple(out)
    )


# -- the client ----------------------------------------------------------------------------


def _append(history: list[dict[str, Any]], turn: Turn, answer: dict[str, Any] | None) -> None:
    if turn.tool_result is not None:
        calls = (answer or {}).get("tool_calls") or []
        for call in calls:
            history.append(
                {"role": "tool", "tool_call_id": call.get("id"), "content": turn.tool_result}
            )
        if not calls:  # the engine answered in text: the task goes on as a user turn
            history.append({"role": "user", "content": turn.tool_result})
    if turn.user is not None:
        history.append({"role": "user", "content": turn.user})


#: ``send(turn index, request body)``: the assistant message of the answer (``content``,
#: ``tool_calls``), or None to end the session (the request failed).
Send = Callable[[int, dict[str, Any]], Awaitable[dict[str, Any] | None]]


async def replay_session(session: Session, model: str, send: Send, stream: bool = False) -> None:
    """Run one session through ``send``, turn by turn, as a client does: each request is
    the history so far plus the turn's messages; each answer joins the history."""
    history: list[dict[str, Any]] = [{"role": "system", "content": session.system}]
    answer: dict[str, Any] | None = None
    for i, turn in enumerate(session.turns):
        _append(history, turn, answer)
        body: dict[str, Any] = {
            "model": model,
            "messages": history,
            "max_tokens": turn.max_tokens,
            "user": session.id,
        }
        if session.tools is not None:
            body["tools"] = list(session.tools)
            body["tool_choice"] = turn.tool_choice or "auto"
        if stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        message = await send(i, body)
        if message is None:
            return
        answer = {"role": "assistant", "content": message.get("content")}
        if message.get("tool_calls"):
            answer["tool_calls"] = message["tool_calls"]
        history.append(answer)


async def _session(
    http: aiohttp.ClientSession,
    url: str,
    model: str,
    session: Session,
    records: list[Record],
    on_record: Callable[[Record], None] | None,
    stream: bool,
) -> None:
    def record(rec: Record) -> None:
        records.append(rec)
        if on_record is not None:
            on_record(rec)

    async def send(i: int, body: dict[str, Any]) -> dict[str, Any] | None:
        t0 = time.perf_counter()
        async with http.post(url + "/v1/chat/completions", json=body) as resp:
            backend = resp.headers.get("x-continuum-backend") or resp.headers.get("x-sim-backend")
            if resp.status != 200:
                await resp.read()
                record(
                    Record(session.id, i, resp.status, backend, seconds=time.perf_counter() - t0)
                )
                return None
            message, usage = await (_read_stream(resp) if stream else _read_json(resp))
        details = usage.get("prompt_tokens_details") or {}
        prompt, cached = int(usage.get("prompt_tokens", 0)), int(details.get("cached_tokens") or 0)
        record(Record(session.id, i, 200, backend, prompt, cached, time.perf_counter() - t0))
        return message

    await replay_session(session, model, send, stream)


async def _read_json(resp: aiohttp.ClientResponse) -> tuple[dict[str, Any], dict[str, Any]]:
    data = await resp.json(content_type=None)
    return data["choices"][0]["message"], data.get("usage") or {}


async def _read_stream(resp: aiohttp.ClientResponse) -> tuple[dict[str, Any], dict[str, Any]]:
    """Accumulate an SSE chat stream into the message a client would keep."""
    text: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    usage: dict[str, Any] = {}
    async for raw in resp.content:
        line = raw.strip()
        if not line.startswith(b"data: {"):
            continue
        chunk = json.loads(line[6:])
        usage = chunk.get("usage") or usage
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("content"):
                text.append(delta["content"])
            for c in delta.get("tool_calls") or []:
                cur = calls.setdefault(
                    c.get("index", 0),
                    {"id": None, "type": "function", "function": {"name": "", "arguments": ""}},
                )
                cur["id"] = c.get("id") or cur["id"]
                fn = c.get("function") or {}
                cur["function"]["name"] += fn.get("name") or ""
                cur["function"]["arguments"] += fn.get("arguments") or ""
    message: dict[str, Any] = {"content": "".join(text) if text or not calls else None}
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return message, usage


async def run_workload(
    url: str,
    workload: Workload,
    *,
    model: str,
    concurrency: int,
    on_record: Callable[[Record], None] | None = None,
    stream: bool = False,
    request_timeout: float = 120.0,
) -> list[Record]:
    """Drive every session of ``workload`` through ``url``: ``concurrency`` sessions at a
    time (closed loop; the next session starts when one ends), each turn after the
    previous answer. Returns one record per request sent, in completion order."""
    records: list[Record] = []
    queue = list(workload.sessions)
    queue.reverse()
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(
        connector=conn, timeout=aiohttp.ClientTimeout(total=request_timeout)
    ) as http:

        async def worker() -> None:
            while queue:
                session = queue.pop()
                await _session(http, url, model, session, records, on_record, stream)

        await asyncio.gather(*(worker() for _ in range(max(1, concurrency))))
    return records


def stickiness(records: Sequence[Record]) -> float:
    """Share of turns (after a session's first) served by the backend of its previous turn."""
    by_session: dict[str, list[Record]] = {}
    for r in records:
        by_session.setdefault(r.session, []).append(r)
    same = total = 0
    for recs in by_session.values():
        recs.sort(key=lambda r: r.turn)
        for prev, cur in itertools.pairwise(recs):
            if cur.turn == prev.turn + 1 and cur.backend is not None:
                total += 1
                same += cur.backend == prev.backend
    return same / total if total else float("nan")


@dataclass
class Progress:
    """A one-line progress counter for long runs (``on_record`` callback)."""

    total: int
    label: str = ""
    every: float = 1.0
    done: int = 0
    errors: int = 0
    _last: float = field(default=0.0, repr=False)

    def __call__(self, rec: Record) -> None:
        self.done += 1
        self.errors += rec.status != 200
        err = f", {self.errors} errors" if self.errors else ""
        line = f"    {self.label}{self.done}/{self.total} requests{err}"
        if sys.stdout.isatty():  # one line, rewritten at most every `every` seconds
            now = time.monotonic()
            if now - self._last >= self.every or self.done == self.total:
                self._last = now
                print(f"\r{line}", end="" if self.done < self.total else "\n", flush=True)
        elif self.done * 4 // self.total > (self.done - 1) * 4 // self.total:
            print(line, flush=True)  # a log: a line per quarter
