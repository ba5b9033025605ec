"""The simulated engine's chat template: a request's messages rendered as vLLM renders them.

This is the simulator's own implementation of what a vLLM server does between the JSON
body and the tokenizer, written from vLLM's and Hugging Face's behaviour and checked
against ``transformers``' ``apply_chat_template`` in the tests. It is deliberately
independent of the router's renderer: the router and the engine must agree because both
follow the same published semantics, not because they call one function.

Steps, in vLLM's order:

1. **Messages -> conversation** (vLLM's ``parse_chat_messages``). Each message keeps its
   ``role``; its ``content`` is normalized for the template's *content format*:

   * ``"string"`` (templates that use ``message.content`` as a string, like Qwen's):
     ``None`` -> ``""``, a string as is, a content-part array -> its text parts
     (``text``/``input_text``/``output_text``: ``text``; ``refusal``: ``refusal``;
     ``thinking``: ``thinking``; a bare string part as is; parts whose text is null are
     skipped) joined with ``"\\n"``;
   * ``"openai"`` (templates that loop over ``message.content``): a list of
     ``{"type": "text", "text": ...}`` parts.

   Media parts have no text a real engine would show the template (vLLM inserts the
   model's placeholder tokens); the simulator renders ``<kind>`` in their place. Then an
   assistant message keeps ``tool_calls`` (when not null; an empty list is dropped, and
   each call's ``function.arguments`` JSON string is parsed into an object, ``{}`` when
   empty, vLLM's ``_postprocess_messages``) and ``reasoning``/``reasoning_content``; a
   ``tool`` message keeps ``tool_call_id``; any message keeps a string ``name``. No other
   key reaches the template (``cache_control`` included).
2. **Tools** are what vLLM's pydantic models dump: ``{"type": "function", "function":
   {"name", "description": null, "parameters": null, ...extra keys}, ...extra keys}``
   with the declared keys first, in that order, then the client's other keys.
3. **Render** with Hugging Face ``apply_chat_template`` semantics: jinja2's
   ``ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)`` with the
   ``loopcontrols`` extension and a ``{% generation %}`` tag that renders its body;
   ``tojson`` as HF defines it (``json.dumps``, ``ensure_ascii=False``, options
   ``indent``/``separators``/``sort_keys``); globals ``raise_exception`` (a
   ``TemplateError``), ``strftime_now``, ``dict`` and ``namespace``; variables
   ``messages`` (message keys whose value is null dropped), ``tools``, ``documents``,
   ``add_generation_prompt`` (vLLM's default: true), the special tokens of
   ``tokenizer_config.json`` (``bos_token``, ``eos_token``, ``unk_token``,
   ``pad_token``, ``additional_special_tokens``) and the request's
   ``chat_template_kwargs`` (overriding the special tokens, as in HF).

The engine then tokenizes the rendered text without adding special tokens (the template
wrote them), after the tokenizer's own normalizer (NFC for Qwen).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = [
    "ChatTemplate",
    "ChatTemplateError",
    "ContentFormat",
    "anthropic_to_openai",
    "conversation",
    "detect_content_format",
    "tool_dicts",
]

ContentFormat = Literal["string", "openai"]

_TEXT_PARTS = {"text": "text", "input_text": "text", "output_text": "text"}
_TEXT_PARTS |= {"refusal": "refusal", "thinking": "thinking"}
_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


class ChatTemplateError(ValueError):
    """The template raised (``raise_exception``, an undefined operation) or the request
    cannot be turned into a conversation (a tool call whose arguments are not JSON)."""


# -- the jinja environment ----------------------------------------------------------------


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (HF's assistant-mask marker): its body."""

    tags = {"generation"}  # noqa: RUF012 - jinja reads it from the class

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return str(caller())


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # jinja's own tojson HTML-escapes <, >, & and ': templates expect plain JSON.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = dict
    return env


def detect_content_format(source: str) -> ContentFormat:
    """vLLM's detection: ``"openai"`` when the template loops over a message's ``content``
    (``for x in message.content`` / ``message['content']``), else ``"string"``."""
    try:
        ast = _environment().parse(source)
    except jinja2.TemplateSyntaxError:
        return "string"
    for loop in ast.find_all(jinja2.nodes.For):
        it = loop.iter
        while isinstance(it, jinja2.nodes.Filter) and it.node is not None:
            it = it.node  # for part in message.content | selectattr(...)
        if isinstance(it, jinja2.nodes.Getattr) and it.attr == "content":
            return "openai"
        if (
            isinstance(it, jinja2.nodes.Getitem)
            and isinstance(it.arg, jinja2.nodes.Const)
            and it.arg.value == "content"
        ):
            return "openai"
    return "string"


# -- request -> conversation --------------------------------------------------------------


def _part_text(part: Any) -> str | None:
    if isinstance(part, str):
        return part
    if not isinstance(part, dict):
        return str(part)
    kind = part.get("type")
    field = _TEXT_PARTS.get(kind) if isinstance(kind, str) else None
    if field is None and kind is None and "text" in part:
        field = "text"
    if field is not None:
        text = part.get(field)
        return None if text is None else str(text)
    return f"<{kind}>"  # media: the simulator's stand-in for the model's placeholder tokens


def _content(content: Any, fmt: ContentFormat) -> str | list[dict[str, str]]:
    if content is None:
        texts: list[str] = []
    elif isinstance(content, str):
        texts = [content]
    elif isinstance(content, list):
        texts = [t for t in map(_part_text, content) if t is not None]
    else:
        texts = [json.dumps(content, ensure_ascii=False)]
    if fmt == "openai":
        return [{"type": "text", "text": t} for t in texts]
    return "\n".join(texts)


def _tool_calls(calls: list[Any]) -> list[Any]:
    out = []
    for call in calls:
        if not isinstance(call, dict):
            raise ChatTemplateError("assistant tool_calls entries must be objects")
        call = dict(call)
        function = call.get("function")
        if isinstance(function, dict):
            function = dict(function)
            args = function.get("arguments")
            if not args:
                function["arguments"] = {}
            elif not isinstance(args, dict | list):
                try:
                    parsed = json.loads(args)
                except (TypeError, ValueError) as exc:
                    raise ChatTemplateError(f"tool call arguments are not JSON: {exc}") from None
                function["arguments"] = parsed if parsed is not None else {}
            call["function"] = function
        out.append(call)
    return out


def conversation(
    messages: Sequence[Mapping[str, Any]], fmt: ContentFormat = "string"
) -> list[dict[str, Any]]:
    """The messages the template sees (step 1 of the module docstring)."""
    out: list[dict[str, Any]] = []
    for m in messages:
        role = m["role"]
        msg: dict[str, Any] = {"role": role, "content": _content(m.get("content"), fmt)}
        if role == "assistant":
            calls = m.get("tool_calls")
            if isinstance(calls, list) and calls:
                msg["tool_calls"] = _tool_calls(calls)
            elif calls is not None and not isinstance(calls, list):
                msg["tool_calls"] = calls
            reasoning = m.get("reasoning")
            if reasoning is None:
                reasoning = m.get("reasoning_content")
            if reasoning is not None:
                msg["reasoning"] = msg["reasoning_content"] = reasoning
        elif role == "tool" and "tool_call_id" in m:
            msg["tool_call_id"] = m["tool_call_id"]
        if isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        out.append(msg)
    return out


def tool_dicts(tools: Any) -> list[dict[str, Any]] | None:
    """The request's tools as vLLM's pydantic models dump them (step 2)."""
    if tools is None:
        return None
    out = []
    for tool in tools if isinstance(tools, list) else [tools]:
        if not isinstance(tool, dict):
            raise ChatTemplateError("each tool must be an object")
        fn = tool.get("function")
        dumped: dict[str, Any] = {"type": tool.get("type", "function")}
        if isinstance(fn, dict):
            dumped["function"] = {
                "name": fn.get("name"),
                "description": fn.get("description"),
                "parameters": fn.get("parameters"),
                **{k: v for k, v in fn.items() if k not in ("name", "description", "parameters")},
            }
        else:
            dumped["function"] = fn
        dumped.update((k, v) for k, v in tool.items() if k not in ("type", "function"))
        out.append(dumped)
    return out


def anthropic_to_openai(
    system: Any, messages: Sequence[Mapping[str, Any]], tools: Any = None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """An Anthropic Messages request as the OpenAI chat request vLLM's ``/v1/messages``
    turns it into: system blocks' texts concatenated into one system message; text blocks
    as text parts (one alone becomes a string); ``tool_use`` as assistant ``tool_calls``;
    ``tool_result`` as ``tool`` messages (their text parts joined with ``"\\n"``);
    ``thinking`` as text; empty messages dropped; tools as functions."""
    out: list[dict[str, Any]] = []
    if system:
        if isinstance(system, str):
            out.append({"role": "system", "content": system})
        else:
            text = "".join(
                str(b.get("text", "")) for b in system if isinstance(b, dict) and "text" in b
            )
            out.append({"role": "system", "content": text})
    for m in messages:
        role = m["role"]
        content = m.get("content")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        parts: list[dict[str, Any]] = []
        calls: list[dict[str, Any]] = []
        for block in content or []:
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text" and block.get("text"):
                parts.append({"type": "text", "text": block["text"]})
            elif kind == "thinking" and block.get("thinking"):
                parts.append({"type": "text", "text": block["thinking"]})
            elif kind == "image":
                parts.append({"type": "image_url", "image_url": {"url": ""}})
            elif kind == "tool_use":
                arguments = json.dumps(block.get("input") or {})
                calls.append(
                    {
                        "id": block.get("id") or "",
                        "type": "function",
                        "function": {"name": block.get("name") or "", "arguments": arguments},
                    }
                )
            elif kind == "tool_result" and role == "user":
                result = block.get("content")
                if isinstance(result, list):
                    result = "\n".join(
                        str(i.get("text", ""))
                        for i in result
                        if isinstance(i, dict) and i.get("type") == "text"
                    )
                text = result if isinstance(result, str) else ""
                call_id = block.get("tool_use_id") or ""
                out.append({"role": "tool", "tool_call_id": call_id, "content": text})
        msg: dict[str, Any] = {"role": role}
        if calls:
            msg["tool_calls"] = calls
        if parts:
            only_text = len(parts) == 1 and parts[0]["type"] == "text"
            msg["content"] = parts[0]["text"] if only_text else parts
        elif not calls:
            continue
        out.append(msg)
    converted = None
    if tools:
        converted = [
            {
                "type": "function",
                "function": {
                    "name": t.get("name"),
                    "description": t.get("description"),
                    "parameters": t.get("input_schema"),
                },
            }
            for t in tools
            if isinstance(t, dict)
        ]
    return out, converted


# -- the template ------------------------------------------------------------------------


def _token_text(value: Any) -> Any:
    # tokenizer_config.json writes a special token as a string or as an AddedToken dict.
    if isinstance(value, dict) and "content" in value:
        return value["content"]
    return value


def _aliased(message: dict[str, Any]) -> dict[str, Any]:
    # Hugging Face passes a message's reasoning under every name templates read it by.
    for key in ("reasoning_content", "thinking", "reasoning"):
        reasoning = message.get(key)
        if reasoning is not None:
            return {"thinking": reasoning, **message, "reasoning_content": reasoning}
    return message


class ChatTemplate:
    """One model's chat template with the special tokens of its tokenizer config."""

    def __init__(
        self,
        source: str,
        special_tokens: Mapping[str, Any] | None = None,
        content_format: ContentFormat | None = None,
    ) -> None:
        self.source = source
        self.special_tokens = dict(special_tokens or {})
        self.content_format: ContentFormat = content_format or detect_content_format(source)
        self._template = _environment().from_string(source)

    @classmethod
    def from_tokenizer_config(cls, path: str | os.PathLike[str]) -> ChatTemplate:
        """The ``chat_template`` of a ``tokenizer_config.json`` (a string, or HF's list of
        named templates: the ``default`` one) and its special tokens."""
        cfg = json.loads(Path(path).read_text(encoding="utf-8"))
        source = cfg.get("chat_template")
        if isinstance(source, list):
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default")
        if not isinstance(source, str):
            raise ValueError(f"{path}: no chat_template")
        # Like HF's special_tokens_map: a token the config leaves null is undefined in the
        # template (renders as ""), not the string "None".
        special = {k: _token_text(cfg[k]) for k in _SPECIAL_KEYS if cfg.get(k) is not None}
        extra = cfg.get("additional_special_tokens")
        if extra:
            special["additional_special_tokens"] = [_token_text(t) for t in extra]
        return cls(source, special)

    @property
    def eos_token(self) -> str | None:
        eos = self.special_tokens.get("eos_token")
        return eos if isinstance(eos, str) else None

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Any = None,
        *,
        add_generation_prompt: bool = True,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """The prompt text of a chat request (the module docstring's three steps)."""
        conv = conversation(messages, self.content_format)
        return self.render_conversation(
            conv,
            tool_dicts(tools),
            add_generation_prompt=add_generation_prompt,
            template_kwargs=template_kwargs,
        )

    def render_conversation(
        self,
        conv: Sequence[Mapping[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        *,
        add_generation_prompt: bool = True,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """Step 3 alone, on an already normalized conversation."""
        variables: dict[str, Any] = dict(self.special_tokens)
        variables.update(template_kwargs or {})
        plain = [_aliased({k: v for k, v in m.items() if v is not None}) for m in conv]
        try:
            return self._template.render(
                messages=plain,
                tools=tools,
                documents=variables.pop("documents", None),
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template: {exc}") from exc
        except (TypeError, AttributeError, KeyError, IndexError, ValueError) as exc:
            raise ChatTemplateError(f"chat template: {type(exc).__name__}: {exc}") from exc
