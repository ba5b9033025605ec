"""Render a request's prompt exactly as the engine does: vLLM's preparation, then
``transformers``' ``apply_chat_template(tokenize=False)``.

On top of :func:`.messages.prepare_chat` (vLLM's part), ``transformers``
(``tokenization_utils_base.apply_chat_template`` and ``chat_template_utils.
render_jinja_template``, version 5) does, in this order:

* an empty conversation is an error; keys whose value is ``None`` are dropped from each
  message (``content: null``, ``tool_call_id: null``, a developer's absent ``tools``);
* every tool and every document must be an object;
* a message with reasoning under ``reasoning_content``, ``thinking`` or ``reasoning``
  gets it under all of ``thinking`` (first) and ``reasoning_content`` (last);
* ``continue_final_message`` (incompatible with ``add_generation_prompt``) tags the last
  message's content (its last text part for a list), renders, and cuts the prompt at
  the tag (before any whitespace the template trimmed after it);
* the template sees ``messages``, ``tools`` and ``documents`` (``None`` when absent),
  ``add_generation_prompt``, the tokenizer's named special tokens and the other keyword
  arguments, which win over a special token of the same name.

Keyword arguments that ``apply_chat_template`` consumes itself never reach the template
(``tokenize``, ``return_dict``, ``padding``, ...); ``messages`` or ``conversation`` among
them is a conflict vLLM answers with 400, so ``invalid`` here.

Every failure is a :class:`RenderError`; nothing else escapes :func:`render_prompt`
(``asyncio.CancelledError`` is not an ``Exception`` and still propagates).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jinja2

from .errors import RenderError
from .messages import AgentSlots, PlainChat, PreparedChat, agent_slots, prepare_chat
from .template import ChatTemplate

__all__ = ["RenderInputs", "render_inputs", "render_prompt"]

_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_CONSUMED = frozenset(
    (
        "tokenize",
        "chat_template",
        "return_dict",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "tokenizer_kwargs",
    )
)
_REFUSED = ("return_assistant_tokens_mask", "sanitize_control_tokens")
_CONFLICTS = ("messages", "conversation")
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def _for_template(message: dict[str, Any]) -> dict[str, Any]:
    """``message`` without its ``None`` values, reasoning aliased (a copy only if either
    changes it: the prepared messages are the request's own)."""
    if None in message.values():  # JSON values: == None only for None itself
        message = {k: v for k, v in message.items() if v is not None}
    if "reasoning_content" in message or "thinking" in message or "reasoning" in message:
        for field in _REASONING_FIELDS:
            reasoning = message.get(field)
            if reasoning is not None:
                return {"thinking": reasoning, **message, "reasoning_content": reasoning}
    return message


def _tag_final(chat: list[dict[str, Any]], source: str) -> str:
    """Tag the last message for ``continue_final_message``; returns the text tagged."""
    last = chat[-1]
    final = last.get("content")
    if final is None:
        raise RenderError("invalid", "continue_final_message: the last message has no content")
    if "content" not in source:
        raise RenderError("invalid", "continue_final_message: the template reads no content")
    if isinstance(final, list):
        blocks = list(final)
        for i in range(len(blocks) - 1, -1, -1):
            block = blocks[i]
            if isinstance(block, dict) and "text" in block:
                text = block["text"]
                blocks[i] = {**block, "text": text + _CONTINUE_TAG}
                chat[-1] = {**last, "content": blocks}
                return str(text)
        raise RenderError("invalid", "continue_final_message: no text to continue")
    if not isinstance(final, str):
        raise RenderError("invalid", "continue_final_message: content is not text")
    chat[-1] = {**last, "content": final + _CONTINUE_TAG}
    return final


def _cut_at_tag(rendered: str, final: str) -> str:
    tag = _CONTINUE_TAG.strip()
    if final.strip() not in rendered or tag not in rendered:
        raise RenderError(
            "template", "continue_final_message: the template drops part of the last message"
        )
    at = rendered.rindex(tag)
    if rendered[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return rendered[:at]
    return rendered[:at].rstrip()


def render_prompt(
    chat_template: ChatTemplate,
    body: Mapping[str, Any],
    *,
    plain: bool = False,
    found_plain: PlainChat | None = None,
) -> str:
    """The prompt text the engine renders for the chat completion ``body``; ``plain``:
    with the template compiled in jinja's plain sandbox (no shortcuts: the reference
    the fast path is tested and measured against); ``found_plain``: the caller's
    :func:`.messages.plain_chat` of ``body``'s messages, if it has one.

    Raises:
        RenderError: the request cannot be rendered (see :mod:`.errors` for the reasons).
    """
    try:
        return _render(chat_template, body, plain, found_plain)
    except RenderError:
        raise
    except jinja2.TemplateError as exc:
        if type(exc) is jinja2.TemplateError:  # the template's own raise_exception
            raise RenderError("template", str(exc.message)) from None
        raise RenderError("error", f"{type(exc).__name__}: {exc.message}") from None
    except Exception as exc:
        raise RenderError("error", f"{type(exc).__name__}: {exc}") from None


@dataclass(slots=True)  # not frozen: a frozen __init__ costs 5x (one per request)
class RenderInputs:
    """What the template is rendered with for one request (before any render)."""

    prepared: PreparedChat
    chat: list[dict[str, Any]]
    """The prepared messages as the template sees them (the final one tagged for
    ``continue_final_message``)."""
    variables: dict[str, Any]
    """Every other template variable (``tools``, ``add_generation_prompt``, ...)."""
    final: str | None
    """``continue_final_message``'s text tagged, or None."""
    plain: tuple[tuple[str, ...], list[str]] | None
    """The roles and contents of ``chat`` when every message is a plain ``{"role",
    "content": text}`` (``PreparedChat.plain``) and none is tagged, else None."""


def render_inputs(
    chat_template: ChatTemplate,
    body: Mapping[str, Any],
    known: Sequence[dict[str, Any]] = (),
    found_plain: PlainChat | None = None,
) -> RenderInputs:
    """The template's inputs for ``body``; ``known``: the template's messages (``chat``) of
    an earlier request whose messages began as ``body``'s (not prepared again);
    ``found_plain``: as :func:`.messages.prepare_chat`'s.

    Raises:
        RenderError: a request that cannot be rendered (before rendering it).
    """
    prepared = prepare_chat(body, chat_template, known, found_plain)
    if not prepared.conversation:
        raise RenderError("invalid", "empty conversation")
    if prepared.continue_final_message and prepared.add_generation_prompt:
        raise RenderError(
            "invalid", "continue_final_message and add_generation_prompt are exclusive"
        )
    kwargs = prepared.kwargs
    for name in _CONFLICTS:
        if name in kwargs:
            raise RenderError("invalid", f"chat_template_kwargs may not set {name!r}")
    for name in _REFUSED:
        if kwargs.get(name):
            raise RenderError("invalid", f"chat_template_kwargs.{name} needs tokenization")
    tools = prepared.tools
    if tools is not None and not all(isinstance(t, dict) for t in tools):
        raise RenderError("invalid", "a tool is not an object")
    documents = prepared.documents
    if documents is not None and not (
        isinstance(documents, list) and all(isinstance(d, dict) for d in documents)
    ):
        raise RenderError("invalid", "documents is not a list of objects")
    # a prepared message of two keys is {"role": str, "content": str or parts}: nothing
    # to drop or alias
    skip = len(known)
    if prepared.plain is not None:
        chat = prepared.conversation  # the request's plain messages, as they are
    else:
        chat = [m if len(m) == 2 else _for_template(m) for m in prepared.conversation[skip:]]
        if skip:
            chat[:0] = known
    final = None
    plain = prepared.plain
    if prepared.continue_final_message:
        if plain is not None:
            chat = list(chat)  # tagged below: not the prepared list itself
        final = _tag_final(chat, prepared.template.source)
        plain = None
    variables = _variables(chat_template, kwargs, tools, documents, prepared.add_generation_prompt)
    return RenderInputs(prepared, chat, variables, final, plain)


def _variables(
    chat_template: ChatTemplate,
    kwargs: Mapping[str, Any],
    tools: list[Any] | None,
    documents: Any,
    add_generation_prompt: bool,
) -> dict[str, Any]:
    """Every template variable but ``messages``, in the order the segment renderer's
    shapes are keyed by: the special tokens, the other keyword arguments, then ``tools``,
    ``documents`` and ``add_generation_prompt``."""
    variables: dict[str, Any] = dict(chat_template.special_tokens)
    variables.update((k, v) for k, v in kwargs.items() if k not in _CONSUMED and k not in _REFUSED)
    variables["tools"] = tools
    variables["documents"] = documents
    variables["add_generation_prompt"] = add_generation_prompt
    return variables


def _by_slots(
    chat_template: ChatTemplate, body: Mapping[str, Any], slots: AgentSlots
) -> str | None:
    """An agent loop's prompt by concatenation from its slots (read from the request in
    one pass, :func:`.messages.agent_slots`), or None: render it with jinja."""
    segments = slots.template.segments
    assert segments is not None
    # what render_inputs gives such a request: no template arguments but the defaults
    variables = _variables(chat_template, {}, slots.tools, None, True)
    return segments.render_slots(
        slots.signature,
        slots.values,
        variables,
        lambda: render_inputs(chat_template, body).chat,
    )


def _render(
    chat_template: ChatTemplate,
    body: Mapping[str, Any],
    plain: bool,
    found_plain: PlainChat | None = None,
) -> str:
    decided = False  # the segment renderer has had its say for this request
    if not plain and body.get("tools") is not None:
        tooled = chat_template.select(True).segments
        if tooled is not None and not tooled.trying(True):
            decided = True  # agent loops are opaque to this template lately: jinja
        else:
            slots = agent_slots(body, chat_template)
            if slots is not None:
                # not served: read again from vLLM's messages it would be the same shape
                decided = True
                text = _by_slots(chat_template, body, slots)
                if text is not None:
                    return text
    inputs = render_inputs(chat_template, body, (), found_plain)
    template = inputs.prepared.template
    segments = template.segments
    if not plain and not decided and segments is not None and inputs.final is None:
        # by concatenation (the template's output learned per shape): the common chat
        # from its roles and contents, anything else with strings and tool calls (an
        # agent loop, tools declared) from its messages' slots
        if inputs.plain is not None and inputs.prepared.tools is None:
            text = segments.render(*inputs.plain, inputs.variables)
        else:
            text = segments.render_chat(inputs.chat, inputs.variables)
        if text is not None:
            return text
    compiled = template.plain if plain else template.template
    rendered = compiled.render(messages=inputs.chat, **inputs.variables)
    if inputs.final is not None:
        rendered = _cut_at_tag(rendered, inputs.final)
    return rendered
