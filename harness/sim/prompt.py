"""Prompt rendering: request messages -> the text the engine tokenizes.

The sim's own layout (``render_chat_prompt`` / ``render_anthropic_prompt``:
``<|role|>\n{content}\n`` turns) goes with the cheap ``simple`` tokenizer and is what the
benchmarks that only need cache behaviour measure. ``--tokenizer qwen2`` renders with the
model's real chat template instead (:mod:`harness.sim.chat_template`).

Message content is flattened by :func:`content_text`: a string as is, a content-part array
with its parts joined by ``"\n"`` (text parts verbatim, media as ``<kind>`` placeholders,
tool results/uses as their text or compact JSON). ``cache_control`` markers never reach
the prompt.
"""

from __future__ import annotations

from typing import Any

from .httpserver import dumps

__all__ = ["content_text", "render_anthropic_prompt", "render_chat_prompt"]


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
