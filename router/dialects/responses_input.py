"""A Responses API request as the chat messages the engine renders it from (vLLM's mapping).

vLLM serves ``/v1/responses`` by turning the request into a chat conversation and
rendering that with the model's chat template, so the router predicts the engine's prompt
(conversation keys, the prefix anchor) from the same conversation:

* ``instructions`` -> a first ``system`` message;
* ``input`` as a string -> one ``user`` message;
* a message item (``type: "message"`` or no type, with a ``role``) -> a message of that
  role; its content a string, or parts: ``input_text``/``output_text`` (and ``text``) as
  text parts, ``input_image`` as an image part (which no conversation key covers),
  ``refusal`` as text; an assistant's parts become its first part's text;
* an assistant message right after an assistant message that has no content yet fills
  it (the engine merges them, as it does for the items below);
* ``function_call`` -> an ``assistant`` message with one ``tool_calls`` entry
  ``{id: call_id, type: function, function: {name, arguments}}``, merged into the
  assistant message just before it when there is one;
* ``function_call_output`` -> a ``tool`` message ``{content: output, tool_call_id:
  call_id}``;
* ``reasoning`` items -> the assistant's ``reasoning`` (their first content text);
* ``tools`` (``{type: function, name, description, parameters}``) -> chat tools
  ``{type: function, function: {name, description, parameters}}``; other tool types
  (built-in tools) are not rendered by the chat template and are left out.

An item of another type leaves the request without conversation keys (``None``); a
request continuing a stored response (``previous_response_id``) too, since the engine
puts that response's conversation, which the router never saw whole, before the input.

:func:`check_request` validates exactly the fields this mapping and the router read and
names the first bad one (``input[2].call_id``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["InputError", "chat_body", "check_request", "part_text"]

_ROLES = frozenset(("user", "assistant", "system", "developer"))
_TEXT_PARTS = frozenset(("input_text", "output_text", "text", "refusal"))


class InputError(ValueError):
    """A malformed Responses request; ``param`` names the field (OpenAI's error body)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def _check_item(i: int, item: Any) -> None:
    where = f"input[{i}]"
    if type(item) is not dict:
        raise InputError(where, f"'{where}' must be an object")
    kind = item.get("type", "message")
    if type(kind) is not str:
        raise InputError(f"{where}.type", f"'{where}.type' must be a string")
    if kind == "message":
        role = item.get("role")
        if role not in _ROLES:
            raise InputError(
                f"{where}.role", f"'{where}.role' must be one of user, assistant, system, developer"
            )
        content = item.get("content")
        if type(content) is str:
            return
        if type(content) is not list:
            raise InputError(
                f"{where}.content", f"'{where}.content' must be a string or an array of parts"
            )
        for j, part in enumerate(content):
            if type(part) is not dict or type(part.get("type")) is not str:
                raise InputError(
                    f"{where}.content[{j}]",
                    f"'{where}.content[{j}]' must be an object with a string 'type'",
                )
            if part["type"] in _TEXT_PARTS and type(part_text(part)) is not str:
                raise InputError(
                    f"{where}.content[{j}].text", f"'{where}.content[{j}].text' must be a string"
                )
    elif kind == "function_call":
        for name in ("call_id", "name", "arguments"):
            if type(item.get(name)) is not str:
                raise InputError(f"{where}.{name}", f"'{where}.{name}' must be a string")
    elif kind == "function_call_output":
        if type(item.get("call_id")) is not str:
            raise InputError(f"{where}.call_id", f"'{where}.call_id' must be a string")
        if type(item.get("output")) not in (str, list):
            raise InputError(
                f"{where}.output", f"'{where}.output' must be a string or an array of parts"
            )


def check_request(body: Mapping[str, Any]) -> None:
    """Raises :class:`InputError` for the first malformed field the router reads."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InputError("model", "'model' is required and must be a string")
    if "input" not in body:
        raise InputError("input", "'input' is required")
    raw = body["input"]
    if type(raw) is list:
        if not raw:
            raise InputError("input", "'input' must not be an empty array")
        for i, item in enumerate(raw):
            _check_item(i, item)
    elif type(raw) is not str:
        raise InputError("input", "'input' must be a string or an array of input items")
    for name in ("instructions", "previous_response_id"):
        value = body.get(name)
        if value is not None and type(value) is not str:
            raise InputError(name, f"'{name}' must be a string")
    tools = body.get("tools")
    if tools is not None:
        if type(tools) is not list or not all(type(t) is dict for t in tools):
            raise InputError("tools", "'tools' must be an array of objects")
    if not isinstance(body.get("stream", False), bool):
        raise InputError("stream", "'stream' must be a boolean")
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise InputError("cache_salt", "'cache_salt' must be a non-empty string")


def part_text(part: Mapping[str, Any]) -> Any:
    """A text part's text (``refusal`` parts carry it under ``refusal``)."""
    return part.get("refusal") if part.get("type") == "refusal" else part.get("text")


def _content(content: Any) -> Any:
    if type(content) is not list:
        return content
    parts: list[dict[str, Any]] = []
    for part in content:
        kind = part.get("type")
        if kind in _TEXT_PARTS:
            parts.append({"type": "text", "text": part_text(part)})
        elif kind == "input_image":
            parts.append({"type": "image_url", "image_url": {"url": part.get("image_url")}})
        else:
            parts.append(part)  # unknown to the template: the render fails, no keys
    return parts


def _merge_into(prev: dict[str, Any] | None, field: str, value: Any) -> bool:
    """Set ``field`` on the previous assistant message when it has none yet."""
    if prev is None or prev.get("role") != "assistant":
        return False
    if field == "tool_calls":
        prev.setdefault("tool_calls", []).append(value)
        return True
    if prev.get(field) is None:
        prev[field] = value
        return True
    return False


def _messages(items: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
    out: list[dict[str, Any]] = []
    for item in items:
        prev = out[-1] if out else None
        kind = item.get("type", "message")
        if kind == "message":
            content = item.get("content")
            if item["role"] == "assistant":
                if type(content) is list:  # the engine keeps the first part's text
                    content = part_text(content[0]) if content else None
                if _merge_into(prev, "content", content):
                    continue
            else:
                content = _content(content)
            out.append({"role": item["role"], "content": content})
        elif kind == "function_call":
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            if not _merge_into(prev, "tool_calls", call):
                out.append({"role": "assistant", "tool_calls": [call]})
        elif kind == "function_call_output":
            out.append(
                {
                    "role": "tool",
                    "content": _content(item["output"]),
                    "tool_call_id": item["call_id"],
                }
            )
        elif kind == "reasoning":
            texts = item.get("content")
            first = texts[0] if type(texts) is list and texts else None
            reasoning = first.get("text", "") if type(first) is dict else ""
            if not _merge_into(prev, "reasoning", reasoning):
                out.append({"role": "assistant", "reasoning": reasoning})
        else:
            return None
    return out


def _tools(tools: Any) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    chat = [
        {
            "type": "function",
            "function": {
                k: t[k] for k in ("name", "description", "parameters", "strict") if k in t
            },
        }
        for t in tools
        if t.get("type") == "function"
    ]
    return chat or None


def chat_body(body: Mapping[str, Any], *, history: bool = True) -> dict[str, Any] | None:
    """The chat completion the engine renders for a checked Responses ``body``, or None
    when it cannot be predicted (an unknown item type; a ``previous_response_id`` unless
    ``history`` is False, which maps the request's own part only)."""
    if history and body.get("previous_response_id") is not None:
        return None
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions:
        messages.append({"role": "system", "content": instructions})
    raw = body["input"]
    if type(raw) is str:
        messages.append({"role": "user", "content": raw})
    else:
        mapped = _messages(raw)
        if mapped is None:
            return None
        messages.extend(mapped)
    chat: dict[str, Any] = {"model": body["model"], "messages": messages}
    tools = _tools(body.get("tools"))
    if tools is not None:
        chat["tools"] = tools
    if body.get("cache_salt") is not None:
        chat["cache_salt"] = body["cache_salt"]
    return chat
