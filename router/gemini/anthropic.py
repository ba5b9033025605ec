"""Anthropic Messages to Gemini's native ``generateContent`` and back.

With the Gemini support configured, ``/anthropic/v1/messages`` for a model that no
``type: anthropic`` backend serves goes to the model's gemini backends over the native
API. The top-level ``system`` becomes ``systemInstruction`` (or, with a cache reference,
nothing: the digest is the same as the OpenAI form's, so both APIs share one cache
entry); ``text``/``image``/``tool_use``/``tool_result`` blocks map to ``text``/
``inlineData``/``functionCall``/``functionResponse`` parts. Answers follow Anthropic's
usage convention: ``input_tokens`` excludes cache reads, which are
``cache_read_input_tokens``. Streams are Anthropic's event sequence (``message_start``,
``content_block_*``, ``message_delta`` with the final usage, ``message_stop``).
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Mapping
from typing import Any

import orjson

from bus.sse import SseOverflow, SseParser

from .native import TranslationError, answer_parts, call_id
from .usage import anthropic_usage, openai_usage

__all__ = ["AnthropicStream", "anthropic_error_body", "message_response", "to_generate_request"]

_STOP = {"STOP": "end_turn", "MAX_TOKENS": "max_tokens"}


def _system_parts(system: Any) -> list[dict[str, Any]]:
    if system is None:
        return []
    if isinstance(system, str):
        return [{"text": system}] if system else []
    if isinstance(system, list):
        texts = []
        for i, block in enumerate(system):
            if not isinstance(block, dict) or block.get("type") != "text":
                raise TranslationError(f"system[{i}] must be a text block", "system")
            if not isinstance(block.get("text"), str):
                raise TranslationError(f"system[{i}].text must be a string", "system")
            texts.append(block["text"])
        # One part, joined as the prefix digest joins them: what a cache would hold.
        return [{"text": "\n".join(texts)}] if texts else []
    raise TranslationError("'system' must be a string or an array of text blocks", "system")


def _tool_result_text(content: Any, where: str) -> Any:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        return "\n".join(
            b["text"]
            for b in content
            if isinstance(b, dict) and b.get("type") == "text" and isinstance(b.get("text"), str)
        )
    raise TranslationError(f"{where}.content must be a string or an array of blocks")


def _blocks(content: Any, where: str, names: dict[str, str]) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"text": content}]
    if not isinstance(content, list):
        raise TranslationError(f"{where}.content must be a string or an array of blocks")
    parts: list[dict[str, Any]] = []
    for i, block in enumerate(content):
        at = f"{where}.content[{i}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            parts.append({"text": block["text"]})
        elif kind == "image":
            src = block.get("source")
            if not isinstance(src, dict):
                raise TranslationError(f"{at}.source is required")
            if src.get("type") == "base64":
                parts.append(
                    {"inlineData": {"mimeType": src.get("media_type"), "data": src.get("data")}}
                )
            elif src.get("type") == "url" and isinstance(src.get("url"), str):
                parts.append({"fileData": {"fileUri": src["url"]}})
            else:
                raise TranslationError(f"{at}.source must be base64 or url")
        elif kind == "tool_use":
            name, tid, args = block.get("name"), block.get("id"), block.get("input", {})
            if not isinstance(name, str) or not isinstance(args, dict):
                raise TranslationError(f"{at} needs a string name and an object input")
            if isinstance(tid, str):
                names[tid] = name
            parts.append({"functionCall": {"name": name, "args": args}})
        elif kind == "tool_result":
            tid = block.get("tool_use_id")
            name = names.get(tid) if isinstance(tid, str) else None
            if name is None:
                raise TranslationError(f"{at}.tool_use_id does not name an earlier tool_use")
            text = _tool_result_text(block.get("content"), at)
            try:
                value = orjson.loads(text)
            except orjson.JSONDecodeError:
                value = None
            response = value if isinstance(value, dict) else {"content": text}
            parts.append({"functionResponse": {"name": name, "response": response}})
        elif kind in ("thinking", "redacted_thinking"):
            continue
        else:
            raise TranslationError(f"{at} has an unsupported type {kind!r}")
    return parts


def to_generate_request(
    body: Mapping[str, Any], cached_content: str | None = None
) -> dict[str, Any]:
    """A GenerateContentRequest for an Anthropic Messages body; TranslationError if not."""
    names: dict[str, str] = {}
    contents: list[dict[str, Any]] = []
    for i, msg in enumerate(body["messages"]):
        where = f"messages[{i}]"
        if not isinstance(msg, dict) or msg.get("role") not in ("user", "assistant"):
            raise TranslationError(f"{where}.role must be user or assistant")
        role = "user" if msg["role"] == "user" else "model"
        parts = _blocks(msg.get("content"), where, names)
        if not parts:
            continue
        if contents and contents[-1]["role"] == role:
            contents[-1]["parts"].extend(parts)
        else:
            contents.append({"role": role, "parts": parts})
    if not contents:
        raise TranslationError("messages need at least one non-empty turn")
    req: dict[str, Any] = {"contents": contents}
    system = _system_parts(body.get("system"))
    if system and cached_content is None:
        req["systemInstruction"] = {"parts": system}
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise TranslationError("'tools' must be an array")
        decls = []
        for i, tool in enumerate(tools):
            if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
                raise TranslationError(f"tools[{i}].name is required")
            decl: dict[str, Any] = {"name": tool["name"]}
            if isinstance(tool.get("description"), str):
                decl["description"] = tool["description"]
            if isinstance(tool.get("input_schema"), dict):
                decl["parameters"] = tool["input_schema"]
            decls.append(decl)
        if decls:
            req["tools"] = [{"functionDeclarations": decls}]
    choice = body.get("tool_choice")
    if choice is not None:
        kind = choice.get("type") if isinstance(choice, dict) else None
        modes = {"auto": "AUTO", "any": "ANY", "none": "NONE", "tool": "ANY"}
        if kind not in modes:
            raise TranslationError("tool_choice.type must be auto, any, tool or none")
        fcc: dict[str, Any] = {"mode": modes[kind]}
        if kind == "tool":
            if not isinstance(choice.get("name"), str):
                raise TranslationError("tool_choice.name is required for type tool")
            fcc["allowedFunctionNames"] = [choice["name"]]
        req["toolConfig"] = {"functionCallingConfig": fcc}
    cfg: dict[str, Any] = {}
    for src, dst in (
        ("max_tokens", "maxOutputTokens"),
        ("temperature", "temperature"),
        ("top_p", "topP"),
        ("top_k", "topK"),
    ):
        if body.get(src) is not None:
            cfg[dst] = body[src]
    if isinstance(body.get("stop_sequences"), list):
        cfg["stopSequences"] = body["stop_sequences"]
    if cfg:
        req["generationConfig"] = cfg
    if cached_content is not None:
        req["cachedContent"] = cached_content
    return req


def _usage(meta: Any) -> dict[str, int]:
    u = openai_usage(meta if isinstance(meta, dict) else {})
    return anthropic_usage(
        u["prompt_tokens"], u["completion_tokens"], u["prompt_tokens_details"]["cached_tokens"]
    )


def message_response(resp: Mapping[str, Any], model: str) -> dict[str, Any]:
    """An Anthropic ``message`` from a GenerateContentResponse (first candidate)."""
    cands = resp.get("candidates")
    cand = cands[0] if isinstance(cands, list) and cands and isinstance(cands[0], dict) else {}
    blocks: list[dict[str, Any]] = []
    for kind, value in answer_parts(cand):
        if kind == "text":
            if blocks and blocks[-1]["type"] == "text":
                blocks[-1]["text"] += value
            else:
                blocks.append({"type": "text", "text": value})
        else:
            fc = value
            args = fc.get("args")
            blocks.append(
                {
                    "type": "tool_use",
                    "id": call_id(fc, "toolu_"),
                    "name": fc["name"],
                    "input": args if isinstance(args, dict) else {},
                }
            )
    reason = cand.get("finishReason")
    stop = _STOP.get(reason, "refusal") if isinstance(reason, str) else "end_turn"
    if reason == "STOP" and any(b["type"] == "tool_use" for b in blocks):
        stop = "tool_use"
    if not cand:
        stop = "refusal"
    rid = resp.get("responseId")
    return {
        "id": "msg_" + (rid if isinstance(rid, str) and rid else secrets.token_hex(12)),
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": blocks,
        "stop_reason": stop,
        "stop_sequence": None,
        "usage": _usage(resp.get("usageMetadata")),
    }


def anthropic_error_body(status: int, data: bytes) -> bytes:
    """A Google error body in Anthropic's shape."""
    message = f"backend answered HTTP {status}"
    try:
        doc = orjson.loads(data)
    except orjson.JSONDecodeError:
        doc = None
    if isinstance(doc, list) and doc:
        doc = doc[0]
    err = doc.get("error") if isinstance(doc, dict) else None
    if isinstance(err, dict) and isinstance(err.get("message"), str):
        message = err["message"]
    etype = {401: "authentication_error", 403: "permission_error", 404: "not_found_error"}.get(
        status, "invalid_request_error" if status < 500 else "api_error"
    )
    return orjson.dumps({"type": "error", "error": {"type": etype, "message": message}})


def _event(name: str, doc: dict[str, Any]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(doc) + b"\n\n"


class AnthropicStream:
    """``streamGenerateContent?alt=sse`` bytes to Anthropic Messages stream events.

    ``feed`` returns the events for the bytes given (maybe none); ``finish`` closes the
    open block and sends ``message_delta`` (stop reason and the final usage) and
    ``message_stop``. ``on_usage`` gets the final usage in OpenAI form (for accounting).
    """

    def __init__(
        self, model: str, on_usage: Callable[[dict[str, Any]], None] | None = None
    ) -> None:
        self.model = model
        self.on_usage = on_usage
        self.id = "msg_" + secrets.token_hex(12)
        self._parser = SseParser()
        self._started = False
        self._block: str | None = None
        self._index = -1
        self._meta: dict[str, Any] = {}
        self._reason: str | None = None
        self._tools = False
        self._failed = False

    def _start(self, out: list[bytes]) -> None:
        if self._started:
            return
        self._started = True
        usage = _usage(self._meta)
        usage["output_tokens"] = 0
        message: dict[str, Any] = {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": usage,
        }
        out.append(_event("message_start", {"type": "message_start", "message": message}))

    def _open(self, kind: str, block: dict[str, Any], out: list[bytes]) -> None:
        self._close(out)
        self._index += 1
        self._block = kind
        out.append(
            _event(
                "content_block_start",
                {"type": "content_block_start", "index": self._index, "content_block": block},
            )
        )

    def _close(self, out: list[bytes]) -> None:
        if self._block is not None:
            out.append(
                _event("content_block_stop", {"type": "content_block_stop", "index": self._index})
            )
            self._block = None

    def _delta(self, delta: dict[str, Any], out: list[bytes]) -> None:
        out.append(
            _event(
                "content_block_delta",
                {"type": "content_block_delta", "index": self._index, "delta": delta},
            )
        )

    def feed(self, data: bytes) -> bytes:
        if self._failed:
            return b""
        try:
            records = self._parser.feed(data)
        except SseOverflow:
            self._failed = True
            return _event(
                "error",
                {"type": "error", "error": {"type": "api_error", "message": "record too large"}},
            )
        out: list[bytes] = []
        for rec in records:
            try:
                doc = orjson.loads(rec.data)
            except orjson.JSONDecodeError:
                continue
            if not isinstance(doc, dict):
                continue
            if isinstance(doc.get("error"), dict):
                out.append(_event("error", orjson.loads(anthropic_error_body(500, rec.data))))
                continue
            if isinstance(doc.get("usageMetadata"), dict):
                self._meta = doc["usageMetadata"]
            self._start(out)
            cands = doc.get("candidates")
            cand = cands[0] if isinstance(cands, list) and cands else None
            if not isinstance(cand, dict):
                continue
            for kind, value in answer_parts(cand):
                if kind == "text":
                    if value:
                        if self._block != "text":
                            self._open("text", {"type": "text", "text": ""}, out)
                        self._delta({"type": "text_delta", "text": value}, out)
                else:
                    fc = value
                    self._tools = True
                    block = {
                        "type": "tool_use",
                        "id": call_id(fc, "toolu_"),
                        "name": fc["name"],
                        "input": {},
                    }
                    self._open("tool_use", block, out)
                    args = orjson.dumps(fc.get("args") or {}).decode()
                    self._delta({"type": "input_json_delta", "partial_json": args}, out)
            reason = cand.get("finishReason")
            if isinstance(reason, str):
                self._reason = reason
        return b"".join(out)

    def finish(self) -> bytes:
        if self._failed:
            return b""
        out: list[bytes] = []
        self._start(out)
        self._close(out)
        reason = self._reason
        stop = _STOP.get(reason, "refusal") if reason is not None else "end_turn"
        if stop == "end_turn" and self._tools:
            stop = "tool_use"
        usage = _usage(self._meta)
        if self.on_usage is not None:
            self.on_usage(openai_usage(self._meta))
        out.append(
            _event(
                "message_delta",
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": stop, "stop_sequence": None},
                    "usage": usage,
                },
            )
        )
        out.append(_event("message_stop", {"type": "message_stop"}))
        return b"".join(out)
