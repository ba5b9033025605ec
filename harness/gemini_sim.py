"""A Gemini (Generative Language API v1beta) simulator, faithful to the wire JSON.

Serves what the router's Gemini support touches:

* ``POST/GET /v1beta/cachedContents``, ``GET/PATCH/DELETE /v1beta/cachedContents/{id}`` —
  CachedContent resources with ``ttl``/``expireTime``, ``usageMetadata.totalTokenCount``,
  a per-model minimum token count enforced with 400 INVALID_ARGUMENT, expiry (an expired
  resource answers 404 NOT_FOUND), ``updateMask`` on PATCH;
* ``POST /v1beta/models/{model}:generateContent`` and ``:streamGenerateContent?alt=sse``
  — ``contents``/``systemInstruction``/``tools``/``generationConfig``/``cachedContent``,
  answers with ``candidates`` and ``usageMetadata`` (``promptTokenCount`` includes the
  cached tokens, ``cachedContentTokenCount``), SSE records ending in CRLF CRLF; a cache
  reference beside ``systemInstruction``/``tools``/``toolConfig`` is a 400, as on Google;
  implicit caching: a system instruction seen before reports its tokens as cached;
* ``POST /v1beta/openai/chat/completions`` — the OpenAI-compatible endpoint, honouring
  ``"extra_body": {"google": {"cached_content": ...}}`` (a system message beside it is a
  400), streaming with ``stream_options.include_usage``.

Tokens are counted as UTF-8 bytes / 4, rounded up. Errors use Google's body
``{"error": {"code", "message", "status"}}``. Test hooks under ``/_sim/``: the request
log, holding creates (to observe single flight), forcing a resource to expire, and
turning cachedContents off (an endpoint that imitates the API without it).

Run standalone: ``python -m harness.gemini_sim --port 8090``.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import math
import secrets
import time
from datetime import UTC, datetime
from typing import Any

import orjson
from aiohttp import web

__all__ = ["GeminiSim", "count_tokens"]

_STATUS = {400: "INVALID_ARGUMENT", 403: "PERMISSION_DENIED", 404: "NOT_FOUND"}


def count_tokens(text: str) -> int:
    return math.ceil(len(text.encode("utf-8")) / 4)


def _ts(t: float) -> str:
    dt = datetime.fromtimestamp(t, UTC)
    return dt.strftime("%Y-%m-%dT%H:%M:%S.") + f"{dt.microsecond:06d}Z"


def _error(code: int, message: str) -> web.Response:
    body = {"error": {"code": code, "message": message, "status": _STATUS.get(code, "UNKNOWN")}}
    return web.Response(status=code, body=orjson.dumps(body), content_type="application/json")


def _json(doc: Any) -> web.Response:
    return web.Response(body=orjson.dumps(doc), content_type="application/json")


def _parts_text(content: Any) -> str:
    parts = content.get("parts") if isinstance(content, dict) else None
    return "\n".join(
        p["text"] for p in parts or [] if isinstance(p, dict) and isinstance(p.get("text"), str)
    )


class _Resource:
    def __init__(
        self, name: str, model: str, system: str, tokens: int, now: float, expire: float
    ) -> None:
        self.name = name
        self.model = model
        self.system = system
        self.tokens = tokens
        self.expire = expire
        self.created = now
        self.updated = now

    def doc(self, display_name: str = "") -> dict[str, Any]:
        d = {
            "name": self.name,
            "model": self.model,
            "createTime": _ts(self.created),
            "updateTime": _ts(self.updated),
            "expireTime": _ts(self.expire),
            "usageMetadata": {"totalTokenCount": self.tokens},
        }
        if display_name:
            d["displayName"] = display_name
        return d


class GeminiSim:
    """One simulated API endpoint; ``async with GeminiSim() as sim: sim.url``."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        min_cache_tokens: int = 1024,
        api_key: str | None = None,
        cached_contents: bool = True,
    ) -> None:
        self.host = host
        self.port = port
        self.min_cache_tokens = min_cache_tokens
        self.api_key = api_key
        self.cached_contents = cached_contents
        self.resources: dict[str, _Resource] = {}
        self.log: list[dict[str, Any]] = []
        self.time_offset = 0.0
        """Seconds added to the wall clock (tests age resources without waiting)."""
        self.seen_systems: set[bytes] = set()
        self._hold: asyncio.Event | None = None
        self.create_arrived: asyncio.Event | None = None
        """Set when a create arrives (tests: the create is in flight)."""
        self._runner: web.AppRunner | None = None
        self.url = ""

    # -- lifecycle -------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 << 20)
        r = app.router
        r.add_post("/v1beta/cachedContents", self.create)
        r.add_get("/v1beta/cachedContents", self.list_caches)
        r.add_get("/v1beta/cachedContents/{id}", self.get)
        r.add_patch("/v1beta/cachedContents/{id}", self.patch)
        r.add_delete("/v1beta/cachedContents/{id}", self.delete)
        r.add_post("/v1beta/models/{call}", self.generate)
        r.add_post("/v1beta/openai/chat/completions", self.openai_chat)
        r.add_get("/_sim/requests", self.sim_requests)
        r.add_post("/_sim/control", self.sim_control)
        return app

    async def start(self) -> GeminiSim:
        self.create_arrived = asyncio.Event()
        self._runner = web.AppRunner(self.app(), access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        server = site._server
        assert isinstance(server, asyncio.Server)  # loop.create_server's, typed AbstractServer
        port = server.sockets[0].getsockname()[1]
        self.url = f"http://{self.host}:{port}"
        return self

    async def close(self) -> None:
        if self._hold is not None:
            self._hold.set()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> GeminiSim:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- helpers ---------------------------------------------------------------------

    def now(self) -> float:
        return time.time() + self.time_offset

    def _record(self, request: web.Request, body: Any) -> None:
        auth = {
            k: request.headers[k]
            for k in ("authorization", "x-goog-api-key")
            if k in request.headers
        }
        self.log.append(
            {"method": request.method, "path": request.path_qs, "body": body, "auth": auth}
        )

    def _authorized(self, request: web.Request, bearer: bool = False) -> bool:
        if self.api_key is None:
            return True
        if request.headers.get("x-goog-api-key") == self.api_key:
            return True
        if request.query.get("key") == self.api_key:
            return True
        return bearer and request.headers.get("authorization") == f"Bearer {self.api_key}"

    async def _body(self, request: web.Request) -> Any:
        try:
            return orjson.loads(await request.read())
        except orjson.JSONDecodeError:
            return None

    def _live(self, rid: str) -> _Resource | None:
        res = self.resources.get("cachedContents/" + rid)
        if res is not None and res.expire <= self.now():
            del self.resources[res.name]
            return None
        return res

    @staticmethod
    def _duration(value: Any) -> float | None:
        if isinstance(value, str) and value.endswith("s"):
            try:
                return float(value[:-1])
            except ValueError:
                return None
        return None

    # -- cachedContents ----------------------------------------------------------------

    async def create(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        self._record(request, body)
        if not self._authorized(request):
            return _error(403, "Method doesn't allow unregistered callers.")
        if not self.cached_contents:
            return _error(404, "Requested entity was not found.")
        if self.create_arrived is not None:
            self.create_arrived.set()
        if self._hold is not None:
            await self._hold.wait()
        if not isinstance(body, dict):
            return _error(400, "Invalid JSON payload received.")
        model = body.get("model")
        if not isinstance(model, str) or not model.startswith("models/"):
            return _error(400, "* CreateCachedContentRequest.cached_content.model: required")
        ttl = self._duration(body.get("ttl"))
        if "expireTime" in body and ttl is None:
            ttl = 3600.0  # not used by the router; accept it
        if ttl is None:
            ttl = 3600.0
        if ttl <= 0:
            return _error(400, "ttl must be positive")
        system = _parts_text(body.get("systemInstruction"))
        contents = body.get("contents") or []
        tokens = count_tokens(system) + sum(count_tokens(_parts_text(c)) for c in contents)
        if tokens < self.min_cache_tokens:
            return _error(
                400,
                f"Cached content is too small. total_token_count={tokens}, "
                f"min_total_token_count={self.min_cache_tokens}",
            )
        name = "cachedContents/" + secrets.token_hex(8)
        now = self.now()
        res = _Resource(name, model, system, tokens, now, now + ttl)
        self.resources[name] = res
        return _json(res.doc(str(body.get("displayName") or "")))

    async def list_caches(self, request: web.Request) -> web.Response:
        now = self.now()
        live = [r.doc() for r in self.resources.values() if r.expire > now]
        return _json({"cachedContents": live} if live else {})

    async def get(self, request: web.Request) -> web.Response:
        self._record(request, None)
        res = self._live(request.match_info["id"])
        if res is None:
            return _error(404, "CachedContent not found")
        return _json(res.doc())

    async def patch(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        self._record(request, body)
        if not self._authorized(request):
            return _error(403, "Method doesn't allow unregistered callers.")
        res = self._live(request.match_info["id"])
        if res is None:
            return _error(404, "CachedContent not found")
        mask = request.query.get("updateMask", "")
        if not isinstance(body, dict) or not (
            {"ttl", "expireTime", "expire_time"} & set(mask.split(","))
        ):
            return _error(400, "update_mask must name ttl or expire_time")
        ttl = self._duration(body.get("ttl"))
        if ttl is None:
            return _error(400, "ttl is required")
        res.expire = self.now() + ttl
        res.updated = self.now()
        return _json(res.doc())

    async def delete(self, request: web.Request) -> web.Response:
        self._record(request, None)
        if not self._authorized(request):
            return _error(403, "Method doesn't allow unregistered callers.")
        res = self._live(request.match_info["id"])
        if res is None:
            return _error(404, "CachedContent not found")
        del self.resources[res.name]
        return _json({})

    # -- generateContent ---------------------------------------------------------------

    def _cache_ref(self, ref: Any, model: str) -> tuple[_Resource | None, web.Response | None]:
        if ref is None:
            return None, None
        if not isinstance(ref, str) or not ref.startswith("cachedContents/"):
            return None, _error(400, "cachedContent must be cachedContents/{id}")
        res = self._live(ref.removeprefix("cachedContents/"))
        if res is None:
            return None, _error(404, f"CachedContent not found: {ref}")
        if res.model != "models/" + model.removeprefix("models/"):
            return None, _error(
                400, "Model used by GenerateContent request and CachedContent differ"
            )
        return res, None

    def _answer(self, contents: list[Any], tools: Any) -> list[dict[str, Any]]:
        last = contents[-1]
        parts = last.get("parts") or []
        responses = [p["functionResponse"] for p in parts if "functionResponse" in p]
        if responses:
            text = "tool said: " + orjson.dumps(responses[0].get("response")).decode()
            return [{"text": text}]
        text = _parts_text(last)
        decls = [d for t in tools or [] for d in t.get("functionDeclarations", [])]
        if decls and text.startswith("call "):
            return [{"functionCall": {"name": decls[0]["name"], "args": {"q": text[5:]}}}]
        return [{"text": f"[gemini-sim] {text}"}]

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        self._record(request, body)
        if not self._authorized(request):
            return _error(403, "Method doesn't allow unregistered callers.")
        model, _, method = request.match_info["call"].partition(":")
        if method not in ("generateContent", "streamGenerateContent"):
            return _error(404, f"method {method} not found")
        if not isinstance(body, dict):
            return _error(400, "Invalid JSON payload received.")
        contents = body.get("contents")
        if not isinstance(contents, list) or not contents:
            return _error(400, "* GenerateContentRequest.contents: contents is not specified")
        for i, c in enumerate(contents):
            if not isinstance(c, dict) or c.get("role") not in ("user", "model"):
                return _error(400, f"* GenerateContentRequest.contents[{i}].role: invalid")
            if not isinstance(c.get("parts"), list) or not c["parts"]:
                return _error(400, f"* GenerateContentRequest.contents[{i}].parts: required")
        ref = body.get("cachedContent")
        if ref is not None and any(k in body for k in ("systemInstruction", "tools", "toolConfig")):
            return _error(
                400,
                "CachedContent can not be used with GenerateContent request setting "
                "system_instruction, tools or tool_config.\n\nProposed fix: move those "
                "values to CachedContent from GenerateContent request.",
            )
        res, err = self._cache_ref(ref, model)
        if err is not None:
            return err
        system = _parts_text(body.get("systemInstruction"))
        cached = res.tokens if res is not None else self._implicit(system)
        prompt = (res.tokens if res is not None else count_tokens(system)) + sum(
            count_tokens(_parts_text(c)) for c in contents
        )
        parts = self._answer(contents, body.get("tools"))
        out_tokens = sum(count_tokens(p.get("text", "")) or 1 for p in parts)
        usage: dict[str, Any] = {
            "promptTokenCount": prompt,
            "candidatesTokenCount": out_tokens,
            "totalTokenCount": prompt + out_tokens,
        }
        if cached:
            usage["cachedContentTokenCount"] = cached
        rid = secrets.token_hex(8)
        if method == "generateContent":
            return _json(
                {
                    "candidates": [
                        {
                            "content": {"role": "model", "parts": parts},
                            "finishReason": "STOP",
                            "index": 0,
                        }
                    ],
                    "usageMetadata": usage,
                    "modelVersion": model,
                    "responseId": rid,
                }
            )
        if request.query.get("alt") != "sse":
            return _error(400, "this simulator streams only with alt=sse")
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        pieces = self._pieces(parts)
        for i, piece in enumerate(pieces):
            cand: dict[str, Any] = {"content": {"role": "model", "parts": [piece]}, "index": 0}
            if i == len(pieces) - 1:
                cand["finishReason"] = "STOP"
            doc = {
                "candidates": [cand],
                "usageMetadata": usage
                if i == len(pieces) - 1
                else {"promptTokenCount": prompt, "totalTokenCount": prompt},
                "modelVersion": model,
                "responseId": rid,
            }
            await resp.write(b"data: " + orjson.dumps(doc) + b"\r\n\r\n")
        await resp.write_eof()
        return resp

    @staticmethod
    def _pieces(parts: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if len(parts) != 1 or "text" not in parts[0]:
            return parts
        text = parts[0]["text"]
        n = max(1, len(text) // 3)
        return [{"text": text[i : i + n]} for i in range(0, len(text), n)]

    def _implicit(self, system: str) -> int:
        """Gemini 2.5+ implicit caching: a repeated large prefix is reported as cached."""
        tokens = count_tokens(system)
        if tokens < self.min_cache_tokens:
            return 0
        digest = hashlib.sha256(system.encode()).digest()
        if digest in self.seen_systems:
            return tokens
        self.seen_systems.add(digest)
        return 0

    # -- OpenAI-compatible -------------------------------------------------------------

    async def openai_chat(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        self._record(request, body)
        if not self._authorized(request, bearer=True):
            return _error(403, "Method doesn't allow unregistered callers.")
        if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
            return _error(400, "Invalid JSON payload received.")
        model = str(body.get("model", ""))
        messages = body["messages"]
        google = (body.get("extra_body") or {}).get("google") or {}
        ref = google.get("cached_content")
        system_msgs = [m for m in messages if m.get("role") in ("system", "developer")]
        if ref is not None and (system_msgs or body.get("tools")):
            return _error(
                400,
                "CachedContent can not be used with GenerateContent request setting "
                "system_instruction, tools or tool_config.",
            )
        res, err = self._cache_ref(ref, model)
        if err is not None:
            return err
        if res is not None:
            prompt = res.tokens
        else:
            prompt = sum(count_tokens(str(m.get("content") or "")) for m in system_msgs)
        users = [m for m in messages if m.get("role") not in ("system", "developer")]
        prompt += sum(count_tokens(str(m.get("content") or "")) for m in users)
        last = str(users[-1].get("content") if users else "")
        text = f"[gemini-sim] {last}"
        completion = count_tokens(text)
        usage = {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }
        cid = "chatcmpl-" + secrets.token_hex(8)
        created = int(self.now())
        if not body.get("stream"):
            return _json(
                {
                    "id": cid,
                    "object": "chat.completion",
                    "created": created,
                    "model": model,
                    "choices": [
                        {
                            "index": 0,
                            "message": {"role": "assistant", "content": text},
                            "finish_reason": "stop",
                        }
                    ],
                    "usage": usage,
                }
            )
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)

        def chunk(choices: list[Any], u: Any = None) -> bytes:
            doc: dict[str, Any] = {
                "id": cid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model,
                "choices": choices,
            }
            if u is not None:
                doc["usage"] = u
            return b"data: " + orjson.dumps(doc) + b"\n\n"

        await resp.write(chunk([{"index": 0, "delta": {"role": "assistant", "content": text}}]))
        await resp.write(chunk([{"index": 0, "delta": {}, "finish_reason": "stop"}]))
        if (body.get("stream_options") or {}).get("include_usage"):
            await resp.write(chunk([], usage))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    # -- test hooks --------------------------------------------------------------------

    async def sim_requests(self, request: web.Request) -> web.Response:
        return _json({"requests": self.log, "resources": sorted(self.resources)})

    async def sim_control(self, request: web.Request) -> web.Response:
        """``{"hold_creates": bool}``, ``{"expire": name}``, ``{"cached_contents": bool}``,
        ``{"reset": true}``."""
        body = await self._body(request) or {}
        if "hold_creates" in body:
            if body["hold_creates"]:
                self._hold = asyncio.Event()
            elif self._hold is not None:
                self._hold.set()
                self._hold = None
        if "expire" in body:
            res = self.resources.get(body["expire"])
            if res is not None:
                res.expire = self.now() - 1
        if "cached_contents" in body:
            self.cached_contents = bool(body["cached_contents"])
        if body.get("reset"):
            self.log.clear()
            self.resources.clear()
            self.seen_systems.clear()
        return _json({"ok": True})


async def _main(port: int, min_tokens: int) -> None:
    async with GeminiSim(port=port, min_cache_tokens=min_tokens) as sim:
        print(f"READY {sim.url}", flush=True)
        await asyncio.Event().wait()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="Gemini API simulator")
    ap.add_argument("--port", type=int, default=8090)
    ap.add_argument("--min-cache-tokens", type=int, default=1024)
    args = ap.parse_args()
    asyncio.run(_main(args.port, args.min_cache_tokens))
