"""Token types and request features of a chat request, as an engine rendering it sees them.

An engine with an eviction advisor reports each cached block's token type (the type of
its first token: system, user, assistant, reasoning, tool definitions, tool calls and
results) and, at a request's start, what it knows of the request (``RequestFeatures`` of
``listener.saecache.classify``). The simulator knows which message each token came from
only through the chat template, so :func:`token_types` renders the conversation's
prefixes (``messages[:k]``, k = 0..n, each followed by an empty user turn) with the
engine's own renderer and tokenizer and takes, for each, the length of the common token
prefix with the whole prompt: tokens between boundary k and k+1 belong to message k.
Boundaries are exact up to the few tokens where a prefix's rendering or a BPE merge
differs from the full prompt. Tokens before the first message's boundary are the
template's preamble (tool definitions when the request declares tools, else system),
after the last one the generation prompt (typed like the last message). Cost: one render
and one tokenization per message, paid only by an engine that talks to an advisor.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from listener.saecache.classify import RequestFeatures, parse_features
from listener.saecache.types import TokenType

__all__ = ["request_features", "token_types"]


def _role_type(message: Any) -> TokenType:
    if not isinstance(message, dict):
        return TokenType.USER
    role = message.get("role")
    if role in ("system", "developer"):
        return TokenType.SYSTEM
    if role == "tool":
        return TokenType.TOOL_IO
    if role == "assistant":
        return TokenType.TOOL_IO if message.get("tool_calls") else TokenType.ASSISTANT
    return TokenType.USER


_PROBE = {"role": "user", "content": ""}


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def token_types(
    render: Callable[[list[dict[str, Any]]], str],
    encode: Callable[[str], list[int]],
    messages: list[dict[str, Any]],
    tokens: Sequence[int],
    tools: bool,
) -> list[int]:
    """The token type of each of the prompt's ``tokens`` (see the module docstring).

    ``render`` renders a message list (the request's tools and template arguments bound);
    each prefix is rendered followed by an empty user message (so its last message is not
    rendered as the final turn, and an empty prefix is a valid conversation); a prefix
    that still cannot be rendered counts as the previous boundary.
    """
    n = len(messages)
    bounds: list[int] = []
    for k in range(n + 1):
        # a probe turn after the prefix keeps its last message from being rendered as the
        # final turn (templates render that one differently, e.g. with an empty <think>)
        attempts = [messages] if k == n else [[*messages[:k], _PROBE], messages[:k]]
        b = 0
        for msgs in attempts:
            try:
                b = _common(encode(render(msgs)), tokens)
                break
            except Exception:
                continue
        bounds.append(max(b, bounds[-1] if bounds else 0))
    out = [int(TokenType.TOOL_DEF if tools else TokenType.SYSTEM)] * bounds[0]
    for k, m in enumerate(messages):
        out += [int(_role_type(m))] * (bounds[k + 1] - bounds[k])
    out += [int(TokenType.USER)] * (len(tokens) - len(out))
    return out[: len(tokens)]


def request_features(
    body: dict[str, Any],
    messages: list[dict[str, Any]],
    max_tokens: int | None,
) -> RequestFeatures:
    """What the engine knows of a chat request, for the advisor's session class
    (reasoning: thinking enabled in the template arguments, or reasoning content in the
    prompt's messages)."""
    tools = body.get("tools")
    kwargs = body.get("chat_template_kwargs")
    thinking = isinstance(kwargs, dict) and kwargs.get("enable_thinking") is True
    turns = [m for m in messages if isinstance(m, dict) and m.get("role") != "system"]
    calls = sum(len(m["tool_calls"]) for m in turns if isinstance(m.get("tool_calls"), list))
    return parse_features(
        {
            "tools": len(tools) if isinstance(tools, list) else 0,
            "turns": len(turns),
            "tool_calls": calls,
            "tool_results": sum(m.get("role") == "tool" for m in turns),
            "reasoning": thinking or any(m.get("reasoning_content") for m in turns),
            "temperature": body.get("temperature"),
            "max_tokens": max_tokens,
        }
    )
