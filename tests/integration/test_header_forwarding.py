"""Which client headers reach a backend. When the router authenticates with the operator's
key for a backend, the caller's account-scoping headers (``OpenAI-Organization``,
``OpenAI-Project``, ``anthropic-beta``, ``x-goog-user-project``) are dropped: they would bill
or scope the operator's account as the caller chose. A backend the router sends no key to
gets them as the caller sent them. Other end-to-end headers pass either way.

The backends are one in-test HTTP server recording each request's headers."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest_asyncio
from aiohttp import web

from .conftest import StartRouter, chat_body, http

KEY_ENV = "CONTINUUM_TEST_BACKEND_KEY"
ACCOUNT = {
    "OpenAI-Organization": "org-caller",
    "OpenAI-Project": "proj-caller",
    "anthropic-beta": "caller-beta-2099",
    "x-goog-user-project": "caller-project",
}
OTHER = {"x-request-id": "req-42", "traceparent": "00-" + "a" * 32 + "-" + "b" * 16 + "-01"}


class Recorder:
    """Answers chat completions and Anthropic messages; keeps each request's headers."""

    def __init__(self) -> None:
        self.seen: list[dict[str, str]] = []
        self._runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> Recorder:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/messages", self._messages)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"
        return self

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    def _record(self, request: web.Request) -> None:
        self.seen.append({k.lower(): v for k, v in request.headers.items()})

    async def _chat(self, request: web.Request) -> web.Response:
        self._record(request)
        return web.json_response(
            {
                "id": "c",
                "object": "chat.completion",
                "created": 0,
                "model": "m",
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": "ok"},
                        "finish_reason": "stop",
                    }
                ],
            }
        )

    async def _messages(self, request: web.Request) -> web.Response:
        self._record(request)
        return web.json_response(
            {
                "id": "m",
                "type": "message",
                "role": "assistant",
                "model": "claude",
                "content": [{"type": "text", "text": "ok"}],
                "stop_reason": "end_turn",
                "usage": {"input_tokens": 1, "output_tokens": 1},
            }
        )


@pytest_asyncio.fixture(loop_scope="session")
async def recorder() -> AsyncIterator[Recorder]:
    r = await Recorder().start()
    try:
        yield r
    finally:
        await r.close()


def lower(headers: dict[str, str]) -> dict[str, str]:
    return {k.lower(): v for k, v in headers.items()}


async def test_account_headers_are_dropped_only_with_the_operators_key(
    start_router: StartRouter, recorder: Recorder
) -> None:
    def b(name: str, btype: str, model: str, keyed: bool) -> dict[str, Any]:
        cfg: dict[str, Any] = {"name": name, "url": recorder.url, "type": btype, "models": [model]}
        if keyed:
            cfg["api_key_env"] = KEY_ENV
        return cfg

    router = await start_router(
        {
            "health_check": {"enabled": False},
            "backends": [
                b("openai-keyed", "openai", "keyed-model", True),
                b("openai-open", "openai", "open-model", False),
                b("claude-keyed", "anthropic", "claude-keyed", True),
                b("claude-open", "anthropic", "claude-open", False),
            ],
        },
        env={KEY_ENV: "operator-key"},
    )
    sent = {**ACCOUNT, **OTHER, "authorization": "Bearer caller-key"}
    anthropic_body = {
        "max_tokens": 8,
        "messages": [{"role": "user", "content": "hi"}],
    }

    cases = [
        ("/v1/chat/completions", chat_body(model="keyed-model"), True),
        ("/v1/chat/completions", chat_body(model="open-model"), False),
        ("/anthropic/v1/messages", {**anthropic_body, "model": "claude-keyed"}, True),
        ("/anthropic/v1/messages", {**anthropic_body, "model": "claude-open"}, False),
    ]
    for path, body, keyed in cases:
        recorder.seen.clear()
        r = await http("POST", router.url + path, json=body, headers=sent)
        assert r.status == 200, (path, body["model"], r)
        (got,) = recorder.seen
        for k, v in OTHER.items():
            assert got.get(k) == v, (body["model"], k)
        account = {k: got.get(k) for k in lower(ACCOUNT)}
        if keyed:
            assert account == dict.fromkeys(lower(ACCOUNT)), (body["model"], account)
            key = got.get("authorization") or got.get("x-api-key")
            assert key in ("Bearer operator-key", "operator-key"), got
        else:
            assert account == lower(ACCOUNT), (body["model"], account)
        assert "caller-key" not in str(got), "the caller's own credentials never pass"
