"""A request's key chain: render, normalize, encode, hash (the router's whole pass).

For a chat completion whose model has a template, :meth:`ConversationKeys.chain` renders
the prompt as the engine does (:mod:`.render`), applies the tokenizer's normalizer,
encodes it as UTF-8 and computes :func:`bus.prompt_chain.chain_keys` from
``chain_root(base model, caller's cache_salt, LoRA adapter)``:

* the base model is the template's ``model``; a request for one of its
  ``lora_adapters`` is rendered with the base model's template and rooted with the
  adapter's name as ``lora`` (the engine's block hashes separate adapters the same way);
* the caller's salt is the body's ``cache_salt`` as the client sent it: compute the
  chain before the router binds its own salt into the body.

No template, or a request that cannot be rendered: no chain (``None``), and the request
is routed on its prefix key. Failures are counted per (model, reason) and logged once
per pair with the first detail. The counters are plain ints (one event loop), read by
:meth:`ConversationKeys.stats`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from bus.prompt_chain import ChainKey, chain_keys, chain_root

from .errors import RenderError, RenderReason
from .identity import conversation_id
from .incremental_chain import CacheCounters, incremental_chain
from .messages import PlainChat, plain_chat
from .render import render_prompt
from .render_cache import RenderCache
from .template import ChatTemplate, load_chat_template

__all__ = ["ConversationKeys", "RequestChain", "TemplateSpec"]

log = logging.getLogger("continuum.conversation")


class TemplateSpec(Protocol):
    """One ``kv_cache_index.conversation.templates`` entry (``ChatTemplateConfig``)."""

    @property
    def model(self) -> str: ...
    @property
    def tokenizer_config(self) -> str | None: ...
    @property
    def chat_template(self) -> str | None: ...
    @property
    def tokenizer(self) -> str | None: ...
    @property
    def lora_adapters(self) -> list[str]: ...


@dataclass(slots=True)  # not frozen: a frozen __init__ costs 5x (one per request)
class RequestChain:
    """The keys of one request's rendered prompt, and what the scorer needs besides."""

    keys: list[ChainKey]
    """One per full ``chunk_bytes`` of the prompt, in order (empty for a short prompt)."""
    prompt_bytes: int
    """UTF-8 length of the whole normalized prompt (the tail past the last key included):
    the scorer's estimate of the prompt's tokens is this over ``bytes_per_token``."""
    model: str
    """The base model (the template's), the root's model."""
    lora: str | None
    """The LoRA adapter the request names, or None."""
    conversation: bytes | None = None
    """The conversation the request belongs to (:mod:`.identity`; None: a prompt with no
    user message, or a raw completion)."""


@dataclass(frozen=True, slots=True)
class _Route:
    base: str
    lora: str | None
    template: ChatTemplate
    unsalted: ChainKey
    """``chain_root(base, None, lora)``: the root of every request without a cache_salt."""

    @classmethod
    def of(cls, base: str, lora: str | None, template: ChatTemplate) -> _Route:
        return cls(base, lora, template, chain_root(base, None, lora))


def _concatenated(template: ChatTemplate, body: Mapping[str, Any]) -> PlainChat | bool:
    """Whether ``body`` is a request the template's segment renderer serves (no jinja
    at all: cheaper than the render cache's reuse, which renders the new messages): a
    plain chat (its :func:`.messages.plain_chat`, so that rendering need not read the
    messages again), or an agent loop (tools declared: read in one pass, ``agent_slots``)."""
    if body.get("tools") is not None:
        return template.select(True).segments is not None
    compiled = template.select(False)
    messages = body.get("messages")
    if (
        compiled.segments is None
        or compiled.content_format != "string"
        or not isinstance(messages, list)
    ):
        return False
    return plain_chat(messages) or False


class ConversationKeys:
    """Served model name -> template, and the chain of each request."""

    def __init__(
        self,
        templates: Mapping[str, ChatTemplate],
        *,
        chunk_bytes: int,
        lora_adapters: Mapping[str, str] | None = None,
        render_cache_bytes: int = 0,
    ) -> None:
        """``templates`` by base model name; ``lora_adapters``: adapter name -> base name;
        ``render_cache_bytes``: the render cache's bound (0: no cache, every request
        rendered whole)."""
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
        if render_cache_bytes < 0:
            raise ValueError(f"render_cache_bytes must be >= 0, got {render_cache_bytes}")
        self._chunk = chunk_bytes
        self._cache = RenderCache(render_cache_bytes) if render_cache_bytes else None
        self._cache_counters = CacheCounters()
        self._routes: dict[str, _Route] = {m: _Route.of(m, None, t) for m, t in templates.items()}
        for adapter, base in (lora_adapters or {}).items():
            if base not in templates:
                raise ValueError(f"LoRA adapter {adapter!r}: no template for its model {base!r}")
            self._routes.setdefault(adapter, _Route.of(base, adapter, templates[base]))
        self._rendered: dict[str, int] = {}
        self._failures: dict[tuple[str, RenderReason], int] = {}
        self._no_template = 0

    @classmethod
    def from_specs(
        cls, specs: Iterable[TemplateSpec], *, chunk_bytes: int, render_cache_bytes: int = 0
    ) -> ConversationKeys:
        """Load every configured template (``ConversationConfig.templates``).

        Raises:
            TemplateLoadError: a file that does not load (``check_config`` reports these
                with their YAML path before the runtime is built).
        """
        templates: dict[str, ChatTemplate] = {}
        adapters: dict[str, str] = {}
        for spec in specs:
            templates[spec.model] = load_chat_template(
                spec.tokenizer_config, spec.chat_template, spec.tokenizer
            )
            adapters.update((a, spec.model) for a in spec.lora_adapters)
        return cls(
            templates,
            chunk_bytes=chunk_bytes,
            lora_adapters=adapters,
            render_cache_bytes=render_cache_bytes,
        )

    @property
    def chunk_bytes(self) -> int:
        return self._chunk

    def has_template(self, model: str) -> bool:
        """Whether requests for ``model`` (a base model or an adapter) get chains."""
        return model in self._routes

    def chain(self, body: Mapping[str, Any], model: str | None = None) -> RequestChain | None:
        """The chain of the chat completion ``body`` (never mutated), or None.

        ``model`` defaults to the body's ``model``. None when the model has no template or
        the request cannot be rendered (counted, logged once per model and reason).
        """
        if model is None:
            model = body.get("model")
            if not isinstance(model, str):
                return None
        route = self._routes.get(model)
        if route is None:
            self._no_template += 1
            return None
        salt = body.get("cache_salt")
        found: PlainChat | bool = False
        if (
            self._cache is not None
            and (salt is None or isinstance(salt, str))
            and not (found := _concatenated(route.template, body))
        ):
            root = route.unsalted if salt is None else chain_root(route.base, salt, route.lora)
            done = incremental_chain(
                route.template, body, root, self._chunk, self._cache, self._cache_counters
            )
            if done is not None:
                self._rendered[model] = self._rendered.get(model, 0) + 1
                return RequestChain(
                    done[0], done[1], route.base, route.lora, conversation_id(body, root)
                )
        try:
            if salt is not None and not isinstance(salt, str):
                raise RenderError("invalid", "cache_salt is not a string")
            plain = found if type(found) is tuple else None
            text = route.template.normalizer(render_prompt(route.template, body, found_plain=plain))
            try:
                data = text.encode()
            except UnicodeEncodeError:
                raise RenderError("invalid", "the prompt holds a lone surrogate") from None
        except RenderError as exc:
            self._failed(model, exc)
            return None
        root = route.unsalted if salt is None else chain_root(route.base, salt, route.lora)
        self._rendered[model] = self._rendered.get(model, 0) + 1
        return RequestChain(
            chain_keys(data, root, self._chunk),
            len(data),
            route.base,
            route.lora,
            conversation_id(body, root),
        )

    def prompt_chain(
        self, prompt: str, model: str, cache_salt: str | None = None
    ) -> RequestChain | None:
        """The chain of a prompt the engine tokenizes as it is (``/v1/completions``: no
        chat template, but the tokenizer's own leading special tokens such as a BOS:
        :mod:`.raw_prompt`), or None for a model without a template entry (its normalizer,
        base model and LoRA adapters are configured there) or a prompt that is not UTF-8.
        """
        route = self._routes.get(model)
        if route is None:
            self._no_template += 1
            return None
        template = route.template
        try:
            data = (template.raw_prompt_prefix + template.normalizer(prompt)).encode()
        except UnicodeEncodeError:
            self._failed(model, RenderError("invalid", "the prompt holds a lone surrogate"))
            return None
        root = (
            route.unsalted if cache_salt is None else chain_root(route.base, cache_salt, route.lora)
        )
        self._rendered[model] = self._rendered.get(model, 0) + 1
        return RequestChain(chain_keys(data, root, self._chunk), len(data), route.base, route.lora)

    def _failed(self, model: str, exc: RenderError) -> None:
        key = (model, exc.reason)
        count = self._failures.get(key, 0)
        self._failures[key] = count + 1
        if not count:
            log.warning(
                "conversation keys: model %r: cannot render a request (%s): %s; such "
                "requests are routed on their prefix key (logged once per model and reason)",
                model,
                exc.reason,
                exc.detail,
            )

    def stats(self) -> dict[str, Any]:
        """Counters for metrics and admin: chains made and failures, per model."""
        failures: dict[str, dict[str, int]] = {}
        for (model, reason), n in sorted(self._failures.items()):
            failures.setdefault(model, {})[reason] = n
        return {
            "models": sorted(self._routes),
            "chunk_bytes": self._chunk,
            "rendered": dict(sorted(self._rendered.items())),
            "failures": failures,
            "no_template": self._no_template,
            "render_cache": self._cache_stats(),
            "segments": self._segment_stats(),
        }

    def _segment_stats(self) -> dict[str, dict[str, int]]:
        """Per base model and template name (``default``, ``tool_use``): the segment
        renderer's counters (:mod:`.segments`)."""
        out: dict[str, dict[str, int]] = {}
        for model, route in sorted(self._routes.items()):
            if route.lora is not None:
                continue
            for name, compiled in route.template.templates.items():
                if compiled.segments is not None:
                    key = model if name == "default" else f"{model}:{name}"
                    out[key] = compiled.segments.stats()
        return out

    def _cache_stats(self) -> dict[str, Any] | None:
        cache, c = self._cache, self._cache_counters
        if cache is None:
            return None
        return {
            "max_bytes": cache.max_bytes,
            "bytes": cache.nbytes,
            "entries": len(cache),
            "evictions": cache.evictions,
            "hits": c.hits,
            "misses": c.misses,
            "rejected": c.rejected,
            "bypassed": c.bypassed,
            "stores": c.stores,
            "messages_reused": c.messages_reused,
            "messages_rendered": c.messages_rendered,
        }
