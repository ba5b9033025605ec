"""Prompt rendering: request messages -> the text the engine tokenizes.

Two layouts. The sim's own (``render_chat_prompt`` / ``render_anthropic_prompt``:
``<|role|>\n{content}\n`` turns) goes with the cheap ``simple`` tokenizer and is what every
existing benchmark and test measures. ChatML (``render_chatml`` / ``render_anthropic_chatml``)
is Qwen2's template as vLLM applies it, used with ``--tokenizer qwen2``; see
:mod:`harness.sim.tokenizer` for the exact rules.

Message content is flattened by :func:`content_text`: a string as is, a content-part array
with its parts joined by ``"\n"`` (text parts verbatim, media as ``<kind>`` placeholders,
tool results/uses as their text or compact JSON). ``cache_control`` markers never reach
the prompt.
"""

from __future__ import annotations

import json
from typing import Any

from .httpserver import dumps

__all__ = [
    "content_text",
    "render_anthropic_chatml",
    "render_anthropic_prompt",
    "render_chat_prompt",
    "render_chatml",
]


def _strip_cache_control(obj: Any) -> Any:
    # cache_control is a caching hint, not prompt content: a router injecting it must not
    # change the prompt tokens, or the injection would destroy the very cache it asks for.
    if isinstance(obj, dict):
        return {k: _strip_cache_control(v) for k, v in obj.items() if k != "cache_control"}
    if isinstance(obj, list):
        return [_strip_cache_control(v) for v in obj]
    return obj


def _dump_text(obj: Any) -> str:
    return dumps(_strip_cache_control(obj)).decode()


def _part_text(part: Any) -> str:
    if isinstance(part, str):
        return part
    if not isinstance(part, dict):
        return str(part)
    kind = part.get("type")
    if kind in ("text", "input_text", "output_text"):
        return str(part.get("text", ""))
    if kind in ("image_url", "image", "input_image", "input_audio", "document", "file"):
        return f"<{kind}>"
    if kind == "tool_result":
        return content_text(part.get("content"))
    if kind == "tool_use":
        return _dump_text({"name": part.get("name"), "input": part.get("input")})
    if kind == "thinking":
        return str(part.get("thinking", ""))
    return _dump_text(part)


def content_text(content: Any) -> str:
    """Text of a message ``content``: a string or an array of content parts (both APIs)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(_part_text(p) for p in content)
    return _dump_text(content)


def render_chat_prompt(messages: list[dict[str, Any]], tools: Any = None) -> str:
    """Flatten a chat request the way a chat template would, so equal prefixes tokenise equal."""
    parts: list[str] = []
    if tools:
        parts.append(f"<|tools|>\n{_dump_text(tools)}\n")
    for m in messages:
        text = content_text(m.get("content"))
        if m.get("tool_calls"):
            text += _dump_text(m["tool_calls"])
        parts.append(f"<|{m['role']}|>\n{text}\n")
    parts.append("<|assistant|>\n")
    return "".join(parts)


def render_anthropic_prompt(system: Any, messages: list[dict[str, Any]], tools: Any = None) -> str:
    """Anthropic prompt order is tools, system, messages: the order its prompt cache uses."""
    parts: list[str] = []
    if tools:
        parts.append(f"<|tools|>\n{_dump_text(tools)}\n")
    if system:
        parts.append(f"<|system|>\n{content_text(system)}\n")
    for m in messages:
        parts.append(f"<|{m['role']}|>\n{content_text(m.get('content'))}\n")
    parts.append("<|assistant|>\n")
    return "".join(parts)


# -- ChatML (Qwen2.5 template without the default system prompt) ---------------------------

_TOOLS_HEAD = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
_TOOLS_TAIL = (
    "\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
)


def _tojson(obj: Any) -> str:
    # Jinja's tojson as HF chat templates define it.
    return json.dumps(obj, ensure_ascii=False)


def _tool_call_text(call: Any) -> str:
    fn = call.get("function", call) if isinstance(call, dict) else {}
    args = fn.get("arguments") if isinstance(fn, dict) else None
    if isinstance(args, str):
        # vLLM parses the arguments string before templating; keep it if it is not JSON.
        try:
            args = json.loads(args)
        except ValueError:
            pass
    name = fn.get("name") if isinstance(fn, dict) else None
    return f'<tool_call>\n{{"name": "{name}", "arguments": {_tojson(args)}}}\n</tool_call>'


def render_chatml(messages: list[dict[str, Any]], tools: Any = None) -> str:
    """A chat as Qwen2/vLLM renders it, with the generation prompt and no default system."""
    out: list[str] = []
    msgs = list(messages)
    if tools:
        out.append("<|im_start|>system\n")
        if msgs and msgs[0].get("role") == "system":
            out.append(content_text(msgs[0].get("content")) + "\n\n")
            msgs = msgs[1:]
        out.append(_TOOLS_HEAD)
        for tool in tools if isinstance(tools, list) else [tools]:
            out.append("\n" + _tojson(tool))
        out.append(_TOOLS_TAIL)
    n = len(msgs)
    for i, m in enumerate(msgs):
        role = m["role"]
        content = content_text(m.get("content"))
        calls = m.get("tool_calls")
        if role == "assistant" and calls:
            out.append("<|im_start|>assistant")
            if content:
                out.append("\n" + content)
            for call in calls if isinstance(calls, list) else [calls]:
                out.append("\n" + _tool_call_text(call))
            out.append("<|im_end|>\n")
        elif role == "tool":
            if i == 0 or msgs[i - 1].get("role") != "tool":
                out.append("<|im_start|>user")
            out.append(f"\n<tool_response>\n{content}\n</tool_response>")
            if i == n - 1 or msgs[i + 1].get("role") != "tool":
                out.append("<|im_end|>\n")
        else:
            out.append(f"<|im_start|>{role}\n{content}<|im_end|>\n")
    out.append("<|im_start|>assistant\n")
    return "".join(out)


def render_anthropic_chatml(system: Any, messages: list[dict[str, Any]], tools: Any = None) -> str:
    """Anthropic request in ChatML: the top-level ``system`` (string or blocks) is the system
    turn (omitted when empty), then the messages."""
    text = content_text(system) if system is not None else ""
    msgs = [{"role": "system", "content": text}, *messages] if text else messages
    return render_chatml(msgs, tools)
