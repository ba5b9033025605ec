"""A model's chat template, loaded from the engine's own files and compiled once.

Sources, as the engine reads them:

* ``tokenizer_config.json``: ``chat_template`` (a string, or a list of ``{"name",
  "template"}``: ``transformers`` then uses ``tool_use`` when the request has tools and the
  list has one, else ``default``), and the special tokens the template may name
  (``bos_token``, ``eos_token``, ``unk_token``, ``sep_token``, ``pad_token``,
  ``cls_token``, ``mask_token``; strings or ``{"content": ...}`` objects);
* a ``.jinja`` file (vLLM's ``--chat-template``), which replaces the config's template;
* ``tokenizer.json``, for its normalizer (:mod:`.normalizer`).

A file that is missing, not JSON, without a template, or whose template does not
compile raises :class:`TemplateLoadError` naming the config field, so ``config validate``
reports ``kv_cache_index.conversation.templates[i].<field>: ...``.

``transformers`` 5 passes the named special tokens only (``additional_special_tokens``
is no longer a template variable), and so does this module. Loads are cached by
(path, size, mtime), so checking the config and then building the runtime reads and
compiles each file once.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2
import orjson

from .content_format import ContentFormat, detect_content_format
from .environment import chat_environment, compile_template
from .errors import TemplateLoadError
from .incremental import IncrementalPlan, plan_for
from .normalizer import Normalizer, UnsupportedNormalizer
from .raw_prompt import raw_prompt_prefix
from .segments import SegmentRenderer, segment_renderer

__all__ = ["SPECIAL_TOKEN_NAMES", "ChatTemplate", "CompiledTemplate", "load_chat_template"]

SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
"""The special tokens ``transformers`` passes to every template render (by these names)."""


@dataclass(frozen=True, slots=True)
class CompiledTemplate:
    """One template text, compiled, with the content format vLLM would detect for it."""

    name: str
    source: str
    template: jinja2.Template
    """Compiled with the fast environment (what requests use)."""
    content_format: ContentFormat
    plain: jinja2.Template
    """The same source in jinja's plain immutable sandbox: the reference ``template``
    is tested against, and the bench's baseline."""
    incremental: IncrementalPlan | None = None
    """The message loop instrumented for the render cache (:mod:`.incremental`), or None
    when the template does not render message by message."""
    segments: SegmentRenderer | None = None
    """Plain chats by concatenation, per learned shape (:mod:`.segments`), or None when
    the template's output may change between renders of one request."""


@dataclass(frozen=True, slots=True)
class ChatTemplate:
    """Everything needed to render one model's requests as its engine does."""

    templates: Mapping[str, CompiledTemplate]
    """By name: ``default`` for a single template; a config's named list as named."""
    special_tokens: Mapping[str, str]
    normalizer: Normalizer
    raw_prompt_prefix: str = ""
    """What the tokenizer puts before a raw (``/v1/completions``) prompt: its BOS for
    Llama-style tokenizers, nothing for Qwen2 (:mod:`.raw_prompt`)."""

    def select(self, has_tools: bool) -> CompiledTemplate:
        """The template ``transformers`` picks: ``tool_use`` for a request with tools (when
        there is one), else ``default``."""
        if has_tools and "tool_use" in self.templates:
            return self.templates["tool_use"]
        return self.templates["default"]


def _read(path: str, field: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except FileNotFoundError:
        raise TemplateLoadError(field, f"file {path!r} does not exist") from None
    except OSError as exc:
        raise TemplateLoadError(field, f"cannot read {path!r}: {exc.strerror or exc}") from None


def _json(path: str, field: str) -> Any:
    try:
        return orjson.loads(_read(path, field))
    except orjson.JSONDecodeError as exc:
        raise TemplateLoadError(field, f"{path!r} is not JSON: {exc}") from None


def _token_text(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _config_templates(config: Any, path: str) -> dict[str, str]:
    raw = config.get("chat_template")
    field = "tokenizer_config"
    if isinstance(raw, str):
        return {"default": raw}
    if isinstance(raw, list):
        named: dict[str, str] = {}
        for i, item in enumerate(raw):
            if not (
                isinstance(item, dict)
                and isinstance(item.get("name"), str)
                and isinstance(item.get("template"), str)
            ):
                raise TemplateLoadError(
                    field, f"{path!r}: chat_template[{i}] is not a {{name, template}} object"
                )
            named[item["name"]] = item["template"]
        if "default" not in named:
            raise TemplateLoadError(
                field, f"{path!r}: chat_template lists no 'default' template ({sorted(named)})"
            )
        return named
    if raw is None:
        raise TemplateLoadError(field, f"{path!r} has no chat_template")
    raise TemplateLoadError(field, f"{path!r}: chat_template is neither a string nor a list")


def _compile(name: str, source: str, field: str, path: str) -> CompiledTemplate:
    env = chat_environment()
    try:
        ast = env.parse(source)
        template = compile_template(env, ast)
        plain = chat_environment(fast=False).from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        where = f"template {name!r} " if name != "default" else "template "
        raise TemplateLoadError(
            field, f"{path!r}: {where}line {exc.lineno}: {exc.message}"
        ) from None
    return CompiledTemplate(
        name,
        source,
        template,
        detect_content_format(ast),
        plain,
        plan_for(ast),
        segment_renderer(ast, template),
    )


def _stamp(path: str | None) -> tuple[str, int, int] | None:
    if path is None:
        return None
    try:
        st = os.stat(path)
    except OSError:
        return (path, -1, -1)
    return (path, st.st_size, st.st_mtime_ns)


def load_chat_template(
    tokenizer_config: str | None = None,
    chat_template: str | None = None,
    tokenizer: str | None = None,
) -> ChatTemplate:
    """Load and compile a model's template from the configured paths.

    Raises:
        TemplateLoadError: a file that does not load; ``field`` names which.
    """
    return _load(_stamp(tokenizer_config), _stamp(chat_template), _stamp(tokenizer))


@functools.lru_cache(maxsize=64)
def _load(
    tokenizer_config: tuple[str, int, int] | None,
    chat_template: tuple[str, int, int] | None,
    tokenizer: tuple[str, int, int] | None,
) -> ChatTemplate:
    if tokenizer_config is None and chat_template is None:
        raise TemplateLoadError(
            "chat_template", "set tokenizer_config (its chat_template) or chat_template"
        )
    special: dict[str, str] = {}
    sources: dict[str, str] = {}
    config: Any = None
    if tokenizer_config is not None:
        path = tokenizer_config[0]
        config = _json(path, "tokenizer_config")
        if not isinstance(config, dict):
            raise TemplateLoadError("tokenizer_config", f"{path!r} is not a JSON object")
        for name in SPECIAL_TOKEN_NAMES:
            text = _token_text(config.get(name))
            if text is not None:
                special[name] = text
        if chat_template is None:
            sources = _config_templates(config, path)
    compiled: dict[str, CompiledTemplate]
    if chat_template is not None:
        path = chat_template[0]
        try:
            text = _read(path, "chat_template").decode()
        except UnicodeDecodeError as exc:
            raise TemplateLoadError("chat_template", f"{path!r} is not UTF-8: {exc}") from None
        compiled = {"default": _compile("default", text, "chat_template", path)}
    else:
        assert tokenizer_config is not None
        path = tokenizer_config[0]
        compiled = {n: _compile(n, s, "tokenizer_config", path) for n, s in sources.items()}
    normalizer = Normalizer(None)
    tokenizer_json: Any = None
    if tokenizer is not None:
        path = tokenizer[0]
        tokenizer_json = _json(path, "tokenizer")
        try:
            normalizer = Normalizer.from_tokenizer_json(tokenizer_json)
        except UnsupportedNormalizer as exc:
            raise TemplateLoadError("tokenizer", f"{path!r}: {exc}") from None
    prefix = raw_prompt_prefix(tokenizer_json, config, special.get("bos_token"))
    return ChatTemplate(compiled, special, normalizer, prefix)
