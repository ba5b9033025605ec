"""OpenAI chat completions to Gemini's native ``generateContent`` and back.

Used when ``gemini_context_cache.prefer_native_api`` is on. The request side maps
messages to ``contents`` (``user``/``model`` turns; consecutive turns of one role merged,
so parallel tool results travel together), system and developer messages to
``systemInstruction`` (or, with a cache reference, to nothing: the cache holds them),
sampling parameters to ``generationConfig``, tools to ``functionDeclarations`` and
``tool_choice`` to ``functionCallingConfig``. Assistant ``tool_calls`` become
``functionCall`` parts and ``tool`` messages ``functionResponse`` parts named after the
call they answer. The response side builds ``chat.completion`` objects and, for streams,
``chat.completion.chunk`` SSE records ending in ``data: [DONE]``, which the official
``openai`` SDK consumes unmodified.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import orjson

from bus.sse import SseOverflow, SseParser

from .usage import openai_usage

__all__ = [
    "NativeStream",
    "TranslationError",
    "chat_completion",
    "openai_error_body",
    "to_generate_request",
]

_FINISH = {
    "STOP": "stop",
    "MAX_TOKENS": "length",
    "SAFETY": "content_filter",
    "RECITATION": "content_filter",
    "BLOCKLIST": "content_filter",
    "PROHIBITED_CONTENT": "content_filter",
    "SPII": "content_filter",
    "IMAGE_SAFETY": "content_filter",
}
_SYSTEM_ROLES = frozenset(("system", "developer"))


class TranslationError(ValueError):
    """The chat request cannot be expressed for generateContent; becomes a 400."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def _text_of(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for part in content:
            if isinstance(part, dict) and part.get("type", "text") == "text":
                text = part.get("text")
                if isinstance(text, str):
                    out.append(text)
        return "\n".join(out)
    raise TranslationError(f"{where}.content must be a string or an array of parts", where)


def _user_parts(content: Any, where: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"text": content}]
    if not isinstance(content, list):
        raise TranslationError(f"{where}.content must be a string or an array of parts", where)
    parts: list[dict[str, Any]] = []
    for i, part in enumerate(content):
        if not isinstance(part, dict):
            raise TranslationError(f"{where}.content[{i}] must be an object", where)
        kind = part.get("type", "text")
        if kind == "text" and isinstance(part.get("text"), str):
            parts.append({"text": part["text"]})
        elif kind == "image_url":
            url = part.get("image_url")
            url = url.get("url") if isinstance(url, dict) else url
            if not isinstance(url, str):
                raise TranslationError(f"{where}.content[{i}].image_url.url is required", where)
            if url.startswith("data:") and ";base64," in url:
                mime, _, data = url[5:].partition(";base64,")
                parts.append({"inlineData": {"mimeType": mime, "data": data}})
            else:
                parts.append({"fileData": {"fileUri": url}})
        else:
            raise TranslationError(f"{where}.content[{i}] has an unsupported type {kind!r}", where)
    return parts


def _args(raw: Any, where: str) -> dict[str, Any]:
    if isinstance(raw, dict):
        return raw
    if not isinstance(raw, str):
        raise TranslationError(f"{where}.function.arguments must be a JSON string", where)
    try:
        value = orjson.loads(raw) if raw.strip() else {}
    except orjson.JSONDecodeError:
        raise TranslationError(f"{where}.function.arguments is not valid JSON", where) from None
    if not isinstance(value, dict):
        raise TranslationError(f"{where}.function.arguments must be a JSON object", where)
    return value


def _contents(
    messages: list[Any], keep_system: bool
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    system: list[dict[str, Any]] = []
    contents: list[dict[str, Any]] = []
    call_names: dict[str, str] = {}

    def add(role: str, parts: list[dict[str, Any]]) -> None:
        if contents and contents[-1]["role"] == role:
            contents[-1]["parts"].extend(parts)
        else:
            contents.append({"role": role, "parts": parts})

    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        role = msg.get("role")
        if role in _SYSTEM_ROLES:
            text = _text_of(msg.get("content"), where)
            if keep_system and text:
                system.append({"text": text})
        elif role == "user":
            add("user", _user_parts(msg.get("content"), where))
        elif role == "assistant":
            parts: list[dict[str, Any]] = []
            text = _text_of(msg.get("content"), where)
            if text:
                parts.append({"text": text})
            calls = msg.get("tool_calls") or []
            if not isinstance(calls, list):
                raise TranslationError(f"{where}.tool_calls must be an array", where)
            for j, call in enumerate(calls):
                fn = call.get("function") if isinstance(call, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise TranslationError(f"{where}.tool_calls[{j}].function.name is required")
                fc: dict[str, Any] = {"name": fn["name"], "args": _args(fn.get("arguments"), where)}
                if isinstance(call.get("id"), str):
                    call_names[call["id"]] = fn["name"]
                parts.append({"functionCall": fc})
            if parts:
                add("model", parts)
        elif role == "tool":
            answered = msg.get("tool_call_id")
            name = call_names.get(answered) if isinstance(answered, str) else None
            if name is None:
                raise TranslationError(
                    f"{where}.tool_call_id does not name an earlier assistant tool call", where
                )
            text = _text_of(msg.get("content"), where)
            try:
                value = orjson.loads(text)
            except orjson.JSONDecodeError:
                value = None
            response = value if isinstance(value, dict) else {"content": text}
            add("user", [{"functionResponse": {"name": name, "response": response}}])
        else:
            raise TranslationError(f"{where}.role {role!r} is not supported", where)
    if not contents:
        raise TranslationError("messages need at least one user turn", "messages")
    return system, contents


def _generation_config(body: Mapping[str, Any]) -> dict[str, Any]:
    cfg: dict[str, Any] = {}
    for src, dst in (
        ("temperature", "temperature"),
        ("top_p", "topP"),
        ("presence_penalty", "presencePenalty"),
        ("frequency_penalty", "frequencyPenalty"),
        ("seed", "seed"),
        ("n", "candidateCount"),
    ):
        if body.get(src) is not None:
            cfg[dst] = body[src]
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None:
        cfg["maxOutputTokens"] = max_tokens
    stop = body.get("stop")
    if isinstance(stop, str):
        cfg["stopSequences"] = [stop]
    elif isinstance(stop, list):
        cfg["stopSequences"] = stop
    fmt = body.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") in ("json_object", "json_schema"):
        cfg["responseMimeType"] = "application/json"
        schema = fmt.get("json_schema")
        if isinstance(schema, dict) and isinstance(schema.get("schema"), dict):
            cfg["responseJsonSchema"] = schema["schema"]
    return cfg


def _tools(body: Mapping[str, Any]) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    tools = body.get("tools")
    decls: list[dict[str, Any]] = []
    if tools is not None:
        if not isinstance(tools, list):
            raise TranslationError("'tools' must be an array", "tools")
        for i, tool in enumerate(tools):
            fn = tool.get("function") if isinstance(tool, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise TranslationError(f"tools[{i}].function.name is required", "tools")
            decl: dict[str, Any] = {"name": fn["name"]}
            if isinstance(fn.get("description"), str):
                decl["description"] = fn["description"]
            if isinstance(fn.get("parameters"), dict):
                decl["parameters"] = fn["parameters"]
            decls.append(decl)
    choice = body.get("tool_choice")
    config: dict[str, Any] | None = None
    if choice == "none":
        config = {"functionCallingConfig": {"mode": "NONE"}}
    elif choice == "required":
        config = {"functionCallingConfig": {"mode": "ANY"}}
    elif choice == "auto":
        config = {"functionCallingConfig": {"mode": "AUTO"}}
    elif isinstance(choice, dict):
        fn = choice.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise TranslationError("tool_choice.function.name is required", "tool_choice")
        config = {"functionCallingConfig": {"mode": "ANY", "allowedFunctionNames": [fn["name"]]}}
    elif choice is not None:
        raise TranslationError("'tool_choice' is not valid", "tool_choice")
    return ([{"functionDeclarations": decls}] if decls else []), config


def to_generate_request(
    body: Mapping[str, Any], cached_content: str | None = None
) -> dict[str, Any]:
    """A GenerateContentRequest for an (already validated) chat completion body.

    With ``cached_content`` the system messages are left out: the cache holds them.
    Raises TranslationError.
    """
    system, contents = _contents(body["messages"], keep_system=cached_content is None)
    req: dict[str, Any] = {"contents": contents}
    if system:
        req["systemInstruction"] = {"parts": system}
    tools, tool_config = _tools(body)
    if tools:
        req["tools"] = tools
    if tool_config is not None:
        req["toolConfig"] = tool_config
    cfg = _generation_config(body)
    if cfg:
        req["generationConfig"] = cfg
    if cached_content is not None:
        req["cachedContent"] = cached_content
    return req


def answer_parts(candidate: Any) -> Iterator[tuple[str, Any]]:
    """A Gemini candidate's answer in order: ``("text", str)`` and ``("call", functionCall)``
    (a dict whose ``name`` is a string). Thought parts and malformed parts are skipped.
    The OpenAI and the Anthropic translations, whole and streamed, all read it this way."""
    content = candidate.get("content") if isinstance(candidate, dict) else None
    parts = content.get("parts") if isinstance(content, dict) else None
    for part in parts if isinstance(parts, list) else []:
        if not isinstance(part, dict) or part.get("thought"):
            continue
        if isinstance(part.get("text"), str):
            yield "text", part["text"]
        fc = part.get("functionCall")
        if isinstance(fc, dict) and isinstance(fc.get("name"), str):
            yield "call", fc


def call_id(fc: Mapping[str, Any], prefix: str = "call_") -> str:
    """The functionCall's own id, or a fresh one with ``prefix`` (Gemini may send none)."""
    cid = fc.get("id")
    return cid if isinstance(cid, str) and cid else prefix + secrets.token_hex(12)


def _message(candidate: Mapping[str, Any]) -> tuple[dict[str, Any], str]:
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for kind, value in answer_parts(candidate):
        if kind == "text":
            texts.append(value)
        else:
            fc = value
            calls.append(
                {
                    "id": call_id(fc),
                    "type": "function",
                    "function": {
                        "name": fc["name"],
                        "arguments": orjson.dumps(fc.get("args") or {}).decode(),
                    },
                }
            )
    msg: dict[str, Any] = {"role": "assistant", "content": "".join(texts) if texts else None}
    if calls:
        msg["tool_calls"] = calls
    finish = _FINISH.get(str(candidate.get("finishReason")), "stop")
    if calls and finish == "stop":
        finish = "tool_calls"
    return msg, finish


def chat_completion(resp: Mapping[str, Any], model: str) -> dict[str, Any]:
    """A ``chat.completion`` from a GenerateContentResponse."""
    candidates = resp.get("candidates")
    choices = []
    for i, cand in enumerate(candidates if isinstance(candidates, list) else []):
        if not isinstance(cand, dict):
            continue
        msg, finish = _message(cand)
        index = cand.get("index", i)
        if not isinstance(index, int) or isinstance(index, bool):
            index = i
        choices.append({"index": index, "message": msg, "finish_reason": finish, "logprobs": None})
    if not choices:  # the prompt itself was blocked (promptFeedback.blockReason)
        choices.append(
            {
                "index": 0,
                "message": {"role": "assistant", "content": ""},
                "finish_reason": "content_filter",
                "logprobs": None,
            }
        )
    meta = resp.get("usageMetadata")
    rid = resp.get("responseId")
    return {
        "id": "chatcmpl-" + (rid if isinstance(rid, str) and rid else secrets.token_hex(12)),
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": openai_usage(meta if isinstance(meta, dict) else {}),
    }


def openai_error_body(status: int, data: bytes) -> bytes:
    """A Google error body (``{"error": {code, message, status}}``) in OpenAI's shape."""
    message, code = f"backend answered HTTP {status}", None
    try:
        doc = orjson.loads(data)
    except orjson.JSONDecodeError:
        doc = None
    if isinstance(doc, list) and doc:
        doc = doc[0]
    err = doc.get("error") if isinstance(doc, dict) else None
    if isinstance(err, dict):
        if isinstance(err.get("message"), str):
            message = err["message"]
        if isinstance(err.get("status"), str):
            code = err["status"].lower()
    etype = "invalid_request_error" if status < 500 else "api_error"
    return orjson.dumps({"error": {"message": message, "type": etype, "param": None, "code": code}})


class NativeStream:
    """Turns a ``streamGenerateContent?alt=sse`` byte stream into OpenAI chunk SSE.

    ``feed`` takes upstream bytes as they arrive and returns the SSE bytes to send (maybe
    empty); ``finish`` returns the closing chunks: the finish reason, the usage chunk when
    the client asked for it (``stream_options.include_usage``) and ``data: [DONE]``.
    ``on_usage`` receives the final OpenAI usage object.
    """

    def __init__(
        self,
        model: str,
        include_usage: bool,
        on_usage: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        self.model = model
        self.include_usage = include_usage
        self.on_usage = on_usage
        self.id = "chatcmpl-" + secrets.token_hex(12)
        self.created = int(time.time())
        self._parser = SseParser()
        self._started: set[int] = set()
        self._tool_index: dict[int, int] = {}
        self._finish: dict[int, str] = {}
        self._usage: dict[str, Any] | None = None
        self._failed = False

    def _chunk(self, choices: list[dict[str, Any]], usage: Any = None) -> bytes:
        doc: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if usage is not None:
            doc["usage"] = usage
        return b"data: " + orjson.dumps(doc) + b"\n\n"

    def feed(self, data: bytes) -> bytes:
        if self._failed:
            return b""
        try:
            records = self._parser.feed(data)
        except SseOverflow:
            self._failed = True
            err = {"error": {"message": "backend stream record too large", "type": "api_error"}}
            return b"data: " + orjson.dumps(err) + b"\n\n"
        out = []
        for rec in records:
            try:
                doc = orjson.loads(rec.data)
            except orjson.JSONDecodeError:
                continue
            if not isinstance(doc, dict):
                continue
            if isinstance(doc.get("error"), dict):
                out.append(b"data: " + openai_error_body(500, rec.data) + b"\n\n")
                continue
            out.extend(self._event(doc))
        return b"".join(out)

    def _event(self, doc: dict[str, Any]) -> list[bytes]:
        out: list[bytes] = []
        meta = doc.get("usageMetadata")
        if isinstance(meta, dict):
            self._usage = openai_usage(meta)
        candidates = doc.get("candidates")
        for i, cand in enumerate(candidates if isinstance(candidates, list) else []):
            if not isinstance(cand, dict):
                continue
            index = cand.get("index", i) if isinstance(cand.get("index", i), int) else i
            delta: dict[str, Any] = {}
            if index not in self._started:
                self._started.add(index)
                delta["role"] = "assistant"
            texts: list[str] = []
            calls: list[dict[str, Any]] = []
            for kind, value in answer_parts(cand):
                if kind == "text":
                    texts.append(value)
                else:
                    fc = value
                    k = self._tool_index.get(index, 0)
                    self._tool_index[index] = k + 1
                    calls.append(
                        {
                            "index": k,
                            "id": call_id(fc),
                            "type": "function",
                            "function": {
                                "name": fc["name"],
                                "arguments": orjson.dumps(fc.get("args") or {}).decode(),
                            },
                        }
                    )
            if texts:
                delta["content"] = "".join(texts)
            if calls:
                delta["tool_calls"] = calls
            reason = cand.get("finishReason")
            if isinstance(reason, str):
                self._finish[index] = _FINISH.get(reason, "stop")
            if delta:
                out.append(
                    self._chunk(
                        [{"index": index, "delta": delta, "finish_reason": None, "logprobs": None}]
                    )
                )
        return out

    def finish(self) -> bytes:
        if self._failed:
            return b""
        out = []
        indexes = sorted(self._started | set(self._finish)) or [0]
        for index in indexes:
            reason = self._finish.get(index, "stop")
            if reason == "stop" and self._tool_index.get(index):
                reason = "tool_calls"
            out.append(
                self._chunk(
                    [{"index": index, "delta": {}, "finish_reason": reason, "logprobs": None}]
                )
            )
        usage = self._usage or openai_usage({})
        if self.on_usage is not None:
            self.on_usage(usage)
        if self.include_usage:
            out.append(self._chunk([], usage))
        out.append(b"data: [DONE]\n\n")
        return b"".join(out)
