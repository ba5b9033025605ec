"""The simulator's ``POST /v1/responses`` (OpenAI Responses API) as vLLM serves it.

vLLM answers a Responses request by building a chat conversation and rendering it with
the model's chat template; the simulator does the same (:func:`conversation`):
``instructions`` first as a system message, then the stored conversation of
``previous_response_id`` without its system messages (unknown id: 404), then ``input``
(a string: one user message; items: messages with ``input_text``/``output_text`` parts,
``function_call`` as an assistant tool call joined to the assistant message before it,
``function_call_output`` as a tool message). Function tools become chat tools, a named
``tool_choice`` a chat one.

Answers (:func:`response_object`) carry ``id: resp_...``, ``object: "response"``,
``status``, ``output`` (a ``message`` item with one ``output_text`` part, or
``function_call`` items) and ``usage`` with ``input_tokens_details.cached_tokens`` (the
prefill's cache hit) and ``output_tokens_details.reasoning_tokens``. Streams
(:func:`response_stream`) are ``event: <type>`` / ``data: <json>`` records with
increasing ``sequence_number``: ``response.created``, ``response.in_progress``, per item
``response.output_item.added``, for text ``response.content_part.added``, one
``response.output_text.delta`` per word, ``response.output_text.done``,
``response.content_part.done`` (for a call ``response.function_call_arguments.delta`` and
``.done``), ``response.output_item.done``, and ``response.completed`` with the usage.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any

from .httpserver import dumps

__all__ = ["UnknownResponse", "conversation", "output_items", "response_object", "response_stream"]

Pace = Callable[[int, int], Awaitable[None]]
"""Awaited before streaming text piece ``j`` of ``n``: ``(j, n)``."""

_TEXT = frozenset(("input_text", "output_text", "text"))


class UnknownResponse(LookupError):
    """``previous_response_id`` names no stored response."""


def _parts(content: Any, where: str) -> Any:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"{where}.content: expected a string or a list of parts")
    out = []
    for part in content:
        if not isinstance(part, dict):
            raise ValueError(f"{where}.content: a part is not an object")
        if part.get("type") in _TEXT:
            out.append({"type": "text", "text": str(part.get("text", ""))})
        elif part.get("type") == "input_image":
            out.append({"type": "input_image"})
        else:
            raise ValueError(f"{where}.content: unsupported part type {part.get('type')!r}")
    return out


def _append_call(chat: list[dict[str, Any]], call: dict[str, Any]) -> None:
    last = chat[-1] if chat else None
    if last is not None and last["role"] == "assistant":
        last.setdefault("tool_calls", []).append(call)
    else:
        chat.append({"role": "assistant", "content": None, "tool_calls": [call]})


def _items(items: list[Any]) -> list[dict[str, Any]]:
    chat: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise ValueError(f"{where}: expected an object")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise ValueError(f"{where}.role: invalid role {role!r}")
            content = _parts(item.get("content"), where)
            if role == "assistant" and isinstance(content, list):
                content = content[0]["text"] if content else ""
            chat.append({"role": role, "content": content})
        elif kind == "function_call":
            args = item.get("arguments")
            name = item.get("name")
            if not isinstance(name, str) or not isinstance(args, str):
                raise ValueError(f"{where}: function_call needs a string name and arguments")
            fn = {"name": name, "arguments": args}
            _append_call(chat, {"id": item.get("call_id"), "type": "function", "function": fn})
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else dumps(output).decode()
            chat.append({"role": "tool", "content": text, "tool_call_id": item.get("call_id")})
        else:
            raise ValueError(f"{where}.type: unsupported item type {kind!r}")
    return chat


def conversation(
    body: Mapping[str, Any], stored: Mapping[str, list[dict[str, Any]]]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None, Any]:
    """(chat messages, chat tools, chat tool_choice) of a Responses request.

    Raises:
        UnknownResponse: ``previous_response_id`` is not stored.
        ValueError: a malformed ``input``, ``instructions`` or ``tools``.
    """
    chat: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise ValueError("instructions: expected a string")
    if instructions:
        chat.append({"role": "system", "content": instructions})
    previous = body.get("previous_response_id")
    if previous is not None:
        history = stored.get(previous) if isinstance(previous, str) else None
        if history is None:
            raise UnknownResponse(f"Response with id '{previous}' not found.")
        chat.extend(dict(m) for m in history if m.get("role") != "system")
    raw = body.get("input")
    if isinstance(raw, str):
        chat.append({"role": "user", "content": raw})
    elif isinstance(raw, list) and raw:
        chat.extend(_items(raw))
    else:
        raise ValueError("input: expected a string or a non-empty list of items")
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise ValueError("tools: expected a list")
    chat_tools = [
        {"type": "function", "function": {k: v for k, v in t.items() if k != "type"}}
        for t in tools or ()
        if isinstance(t, dict) and t.get("type") == "function"
    ]
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "function":
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    return chat, chat_tools or None, choice


def output_items(message: Mapping[str, Any], item_id: str) -> list[dict[str, Any]]:
    """The answer's ``output``: its text as one message item, or its tool calls."""
    calls = message.get("tool_calls")
    if calls:
        return [
            {
                "id": f"fc_{c['id']}",
                "type": "function_call",
                "call_id": c["id"],
                "name": c["function"]["name"],
                "arguments": c["function"]["arguments"],
                "status": "completed",
            }
            for c in calls
        ]
    return [
        {
            "id": item_id,
            "type": "message",
            "role": "assistant",
            "status": "completed",
            "content": [
                {
                    "type": "output_text",
                    "text": message.get("content") or "",
                    "annotations": [],
                    "logprobs": [],
                }
            ],
        }
    ]


def response_object(
    rid: str,
    created: int,
    model: str,
    body: Mapping[str, Any],
    output: list[dict[str, Any]],
    usage: dict[str, Any] | None,
    status: str = "completed",
) -> dict[str, Any]:
    """A whole response (also the ``response`` of the stream's lifecycle events)."""
    truncated = status == "incomplete"
    return {
        "id": rid,
        "object": "response",
        "created_at": created,
        "status": status,
        "background": False,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if truncated else None,
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "max_tool_calls": None,
        "metadata": body.get("metadata") or {},
        "model": model,
        "output": output,
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "previous_response_id": body.get("previous_response_id"),
        "reasoning": None,
        "service_tier": "auto",
        "store": body.get("store", True),
        "temperature": body.get("temperature", 1.0),
        "text": {"format": {"type": "text"}},
        "tool_choice": body.get("tool_choice", "auto"),
        "tools": body.get("tools") or [],
        "top_logprobs": 0,
        "top_p": body.get("top_p", 1.0),
        "truncation": "disabled",
        "usage": usage,
        "user": None,
    }


async def response_stream(
    done: dict[str, Any], pieces: Sequence[str], pace: Pace
) -> AsyncIterator[bytes]:
    """The SSE records of ``done`` (the completed response) generated piece by piece."""
    seq = 0

    def event(kind: str, data: dict[str, Any]) -> bytes:
        nonlocal seq
        record = {"type": kind, "sequence_number": seq, **data}
        seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + dumps(record) + b"\n\n"

    started = {**done, "status": "in_progress", "output": [], "usage": None}
    started["incomplete_details"] = None
    yield event("response.created", {"response": started})
    yield event("response.in_progress", {"response": started})
    for index, item in enumerate(done["output"]):
        where = {"output_index": index, "item_id": item["id"]}
        if item["type"] == "message":
            part = item["content"][0]
            yield event(
                "response.output_item.added",
                {"output_index": index, "item": {**item, "status": "in_progress", "content": []}},
            )
            empty = {**part, "text": ""}
            yield event("response.content_part.added", {**where, "content_index": 0, "part": empty})
            for j, piece in enumerate(pieces):
                await pace(j, len(pieces))
                yield event(
                    "response.output_text.delta",
                    {**where, "content_index": 0, "delta": piece, "logprobs": []},
                )
            yield event(
                "response.output_text.done",
                {**where, "content_index": 0, "text": part["text"], "logprobs": []},
            )
            yield event("response.content_part.done", {**where, "content_index": 0, "part": part})
        else:
            yield event(
                "response.output_item.added",
                {"output_index": index, "item": {**item, "status": "in_progress", "arguments": ""}},
            )
            yield event(
                "response.function_call_arguments.delta", {**where, "delta": item["arguments"]}
            )
            yield event(
                "response.function_call_arguments.done",
                {**where, "name": item["name"], "arguments": item["arguments"]},
            )
        yield event("response.output_item.done", {"output_index": index, "item": item})
    kind = "response.completed" if done["status"] == "completed" else "response.incomplete"
    yield event(kind, {"response": done})
