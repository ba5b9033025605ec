"""The simulator's ``POST /v1/completions`` wire format, as vLLM answers it.

Non-streamed::

    {"id": "cmpl-...", "object": "text_completion", "created", "model",
     "choices": [{"index", "text", "logprobs": null, "finish_reason", "stop_reason": null,
                  "prompt_logprobs": null}],
     "usage": {"prompt_tokens", "total_tokens", "completion_tokens",
               "prompt_tokens_details": {"cached_tokens"}}}

Streamed: one ``data:`` chunk per generated word (``choices: [{index, text, logprobs:
null, finish_reason: null, stop_reason: null}]``, no ``usage`` key), a chunk with the
choice's ``finish_reason``, with ``stream_options.include_usage`` a last chunk with
``choices: []`` and the usage, then ``data: [DONE]``. A batch (several prompts) has one
choice per prompt, ``index`` in prompt order, streamed one prompt after the other.

The engine side (prefill, the cache, KV events) is :class:`harness.sim.engine.SimEngine`'s;
this module only validates the prompt and shapes the answer.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .httpserver import dumps

__all__ = ["DEFAULT_MAX_TOKENS", "Choice", "completion", "completion_stream", "prompts_of"]

DEFAULT_MAX_TOKENS = 16
"""vLLM's default ``max_tokens`` for text completions."""

Pace = Callable[[int, int, int], Awaitable[None]]
"""Awaited before streaming piece ``j`` of ``n`` of choice ``i``: ``(i, j, n)``."""


def _ids(value: Any) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value)
    )


def prompts_of(prompt: Any) -> list[str | list[int]]:
    """The prompts of a request's ``prompt`` field; ``ValueError`` with vLLM-like text."""
    if isinstance(prompt, str):
        return [prompt]
    if _ids(prompt):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return list(prompt)
        if all(_ids(p) for p in prompt):
            return list(prompt)
    raise ValueError(
        "'prompt' must be a string, array of strings, array of tokens, or array of token arrays"
    )


@dataclass
class Choice:
    """One prompt's answer: its streamed pieces and why it ended."""

    pieces: list[str]
    finish_reason: str

    @property
    def text(self) -> str:
        return "".join(self.pieces)


def completion(
    rid: str, created: int, model: str, choices: Sequence[Choice], usage: dict[str, Any]
) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": i,
                "text": c.text,
                "logprobs": None,
                "finish_reason": c.finish_reason,
                "stop_reason": None,
                "prompt_logprobs": None,
            }
            for i, c in enumerate(choices)
        ],
        "usage": usage,
    }


async def completion_stream(
    rid: str,
    created: int,
    model: str,
    choices: Sequence[Choice],
    usage: dict[str, Any] | None,
    pace: Pace,
) -> AsyncIterator[bytes]:
    """The SSE bytes of a streamed completion; ``usage`` None: no usage chunk."""

    def chunk(index: int, text: str, finish: str | None) -> bytes:
        obj = {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": model,
            "choices": [
                {
                    "index": index,
                    "text": text,
                    "logprobs": None,
                    "finish_reason": finish,
                    "stop_reason": None,
                }
            ],
        }
        return b"data: " + dumps(obj) + b"\n\n"

    for i, choice in enumerate(choices):
        n = len(choice.pieces)
        for j, piece in enumerate(choice.pieces):
            await pace(i, j, n)
            yield chunk(i, piece, None)
        yield chunk(i, "", choice.finish_reason)
    if usage is not None:
        tail = {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": model,
            "choices": [],
            "usage": usage,
        }
        yield b"data: " + dumps(tail) + b"\n\n"
    yield b"data: [DONE]\n\n"
