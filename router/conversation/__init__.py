"""Conversation keys: a chat request's rendered prompt as a ``bus.prompt_chain`` chain.

The router never tokenizes. It renders each chat completion with the model's own chat
template exactly as the engine does (vLLM's message preparation, then ``transformers``'
``apply_chat_template`` semantics), applies the tokenizer's normalizer, and hashes the
UTF-8 bytes into the same chain the listener builds from the engine's KV blocks.

The API the router uses (everything else is internal)::

    keys = ConversationKeys.from_specs(cfg.kv_cache_index.conversation.templates,
                                       chunk_bytes=cfg.kv_cache_index.conversation.chunk_bytes,
                                       render_cache_bytes=...)
    chain = keys.chain(body)          # RequestChain | None; never raises
    chain.keys, chain.prompt_bytes    # the request's keys; its length for the scorer
    keys.stats()                      # counters for metrics and /admin

``from_specs`` raises :class:`TemplateLoadError` for a file that does not load;
``router.config.loader.check_config`` reports the same failures with their YAML path
(``check_conversation``), so a config that validates always builds. ``chain`` returns
None for a model without a template and for a request it cannot render (media parts,
a template's ``raise_exception``, ...): those are routed on their prefix key.

Modules: :mod:`.template` (loading, compiling), :mod:`.environment` (the jinja
environment), :mod:`.content_format` (vLLM's "string"/"openai" detection),
:mod:`.messages` (vLLM's message preparation), :mod:`.render` (``apply_chat_template``),
:mod:`.normalizer` (``tokenizer.json`` normalizers), :mod:`.chain` (the request chain);
:mod:`.segments` (plain chats by concatenation, learned per shape);
the render cache (``render_cache_bytes``): :mod:`.incremental` (a template's message loop
instrumented, and what reuse must check), :mod:`.render_cache` (the bounded cache and the
message digests), :mod:`.incremental_chain` (a request's chain from an earlier turn's
state).
"""

from .chain import ConversationKeys, RequestChain, TemplateSpec
from .errors import RENDER_REASONS, RenderError, RenderReason, TemplateLoadError
from .render import render_prompt
from .template import ChatTemplate, load_chat_template

__all__ = [
    "RENDER_REASONS",
    "ChatTemplate",
    "ConversationKeys",
    "RenderError",
    "RenderReason",
    "RequestChain",
    "TemplateLoadError",
    "TemplateSpec",
    "load_chat_template",
    "render_prompt",
]
