"""``POST /v1/completions``: OpenAI's legacy text completions, as vLLM and SGLang serve it.

The prompt is already the text the engine tokenizes (no chat template), so:

* ``prompt`` is a string, an array of strings (a batch), an array of token ids, or an
  array of token id arrays. A batch is routed as one request, on its first prompt: the
  engine prefills every prompt where the batch lands.
* the prefix anchor is the first prompt's leading text, tag ``P`` (``bus.prefix_key``:
  ``SHA256(model 0x00 "P" prompt[:max_prefix_length])``); token-id prompts have no text,
  hence no prefix key, no chain and no salt: the strategy alone decides (PrefixAwareHash
  falls back to the model's hash);
* with conversation-depth routing the chain is the first prompt as it is (the model's
  normalizer, its configured base model and LoRA adapters; no template render,
  :meth:`router.conversation.ConversationKeys.prompt_chain`);
* the cache-salt step binds a single text prompt only: a batch's other prompts would be
  announced by the engine under the first prompt's key;
* the response cache keys deterministic requests like chat completions, on the prompt
  (``echo``, ``suffix``, ``best_of`` and vLLM's sampling extras bypass it);
* the engine's ``usage.prompt_tokens_details.cached_tokens`` is recorded against the
  prediction, as for chat (``router.forwarder``).

Upstream: ``/v1/completions`` with the backend's bearer key (types ``openai``, ``vllm``,
``sglang``, ``trtllm``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import openai_error
from ..http.types import Response
from .generation import GenerationDialect, Prepared, cache_view

__all__ = ["COMPLETIONS_UNKEYED", "Completions", "prompt_of"]

COMPLETIONS_UNKEYED = (
    "echo",
    "suffix",
    "best_of",
    "top_k",
    "min_p",
    "repetition_penalty",
    "min_tokens",
    "ignore_eos",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "prompt_embeds",
)
"""Output-shaping fields of a completion request that the cache key does not cover."""

_PROMPT_SHAPE = (
    "'prompt' must be a string, an array of strings, an array of token ids or an array "
    "of token id arrays"
)


def _token_ids(value: Any) -> bool:
    return type(value) is list and bool(value) and all(type(t) is int and t >= 0 for t in value)


def prompt_of(body: Mapping[str, Any]) -> str | list[int] | None:
    """The first prompt of a valid ``prompt`` field: its text, its token ids, or None when
    the field is malformed."""
    prompt = body.get("prompt")
    if type(prompt) is str:
        return prompt
    if type(prompt) is not list or not prompt:
        return None
    if _token_ids(prompt):
        return prompt
    if all(type(p) is str for p in prompt):
        return str(prompt[0])
    if all(_token_ids(p) for p in prompt):
        return list(prompt[0])
    return None


class Completions(GenerationDialect):
    """The text completions handler and its upstream format."""

    endpoint = "completions"
    upstream_path = "/v1/completions"

    def prepare(self, body: dict[str, Any]) -> Prepared | Response:
        model = body.get("model")
        if not isinstance(model, str) or not model:
            return openai_error(400, "'model' is required and must be a string", param="model")
        if "prompt" not in body:
            return openai_error(400, "'prompt' is required", param="prompt")
        first = prompt_of(body)
        if first is None:
            return openai_error(400, _PROMPT_SHAPE, param="prompt")
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            return openai_error(400, "'stream' must be a boolean", param="stream")
        salt = body.get("cache_salt")
        if salt is not None and (not isinstance(salt, str) or not salt):
            return openai_error(400, "'cache_salt' must be a non-empty string", param="cache_salt")
        if not isinstance(first, str):
            return Prepared(model, stream, None)
        chain = None
        if self._conversation is not None:
            keys = self._conversation
            chain = lambda: keys.prompt_chain(first, model, salt)  # noqa: E731
        view = cache_view(body, "completions", body["prompt"], COMPLETIONS_UNKEYED)
        return Prepared(model, stream, ("P", first) if first else None, chain, view)

    def saltable(self, body: Mapping[str, Any]) -> bool:
        prompt = body.get("prompt")
        return type(prompt) is str or (
            type(prompt) is list and len(prompt) == 1 and type(prompt[0]) is str
        )
