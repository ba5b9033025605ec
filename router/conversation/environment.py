"""The jinja2 environment chat templates run in, with Hugging Face's semantics.

Templates are the engine's own (``tokenizer_config.json``), so they must see exactly
what ``transformers``' ``apply_chat_template`` gives them (``utils/chat_template_utils``,
``_compile_jinja_template``), or the rendered bytes differ from the engine's prompt:

* an ``ImmutableSandboxedEnvironment`` (templates are untrusted code, and cannot mutate
  the request's lists and dicts) with ``trim_blocks`` and ``lstrip_blocks``, and the
  ``loopcontrols`` extension (``{% break %}``, ``{% continue %}``);
* the ``{% generation %}...{% endgeneration %}`` tag, which HF uses to mark assistant
  tokens for training masks: here it renders its body unchanged, as HF does when no mask
  is asked for;
* ``tojson`` replaced by ``json.dumps`` with ``ensure_ascii=False`` and the ``indent``,
  ``separators`` and ``sort_keys`` arguments passed through (jinja's own escapes HTML
  characters and returns Markup);
* globals ``raise_exception(msg)`` (raises :class:`jinja2.TemplateError`),
  ``strftime_now(fmt)`` (local time now, as the engine formats it), ``dict`` (a
  constructor only) and ``namespace`` (which rejects ``_``-prefixed attribute names).

Compiled once per template at start. Rendering is dominated by the sandbox's attribute
checks (every ``message.role``, ``content.startswith``, ``loop.last``), so the
environment answers two cases faster, with the same results:

* ``obj.name`` on a plain ``dict`` for a name that is not a ``dict`` attribute: jinja
  tries ``getattr`` (which can only raise) then ``obj[name]``; this goes to ``obj[name]``,
  inline in the compiled template when the key is there (``message.role`` compiles to
  ``v["role"] if type(v) is dict and "role" in v else environment.getattr(v, "role")``);
* whether an attribute is safe depends only on the object's type and the attribute's
  name (jinja's checks are ``isinstance`` and name tests), so the answer is memoized per
  (type, name), up to a bound, and an attribute known safe is returned directly
  (``format`` and ``format_map`` excepted: jinja wraps those).
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any, NoReturn

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.utils
from jinja2.compiler import CodeGenerator, Frame, optimizeconst
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["chat_environment"]


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}body{% endgeneration %}`` renders ``body`` (no assistant mask)."""

    tags = {"generation"}  # noqa: RUF012 (jinja reads this class attribute)

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_render_body")
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Any) -> str:
        return str(caller())


def _raise_exception(message: Any) -> NoReturn:
    raise jinja2.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _DictConstructor:
    """``dict(...)`` and ``dict.fromkeys(...)`` and nothing else of the ``dict`` type."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


def _check_name(name: Any) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(
            f"a namespace cannot hold an underscore-prefixed attribute ({name!r})"
        )


class _Namespace(jinja2.utils.Namespace):
    """jinja's namespace, refusing ``_`` names (no way to CPython internals)."""

    # jinja's own signature trick: ``self`` may also be an attribute name.
    def __init__(*args: Any, **kwargs: Any) -> None:
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)


_DICT_ATTRIBUTES = frozenset(dir(dict))
_FORMAT_METHODS = frozenset(("format", "format_map"))  # jinja wraps these: never shortcut
_MAX_SAFETY_ENTRIES = 4096


class _ChatCodeGenerator(CodeGenerator):
    """Compiles ``x.name`` with an inline dict lookup first (see the module header)."""

    @optimizeconst
    def visit_Getattr(self, node: jinja2.nodes.Getattr, frame: Frame) -> None:
        attr = node.attr
        if self.environment.is_async or attr in _DICT_ATTRIBUTES:
            super().visit_Getattr(node, frame)
            return
        self.write(f"(_cv_[{attr!r}] if (type(_cv_ := ")
        self.visit(node.node, frame)
        self.write(f") is dict and {attr!r} in _cv_) else environment.getattr(_cv_, {attr!r}))")


class _ChatSandbox(ImmutableSandboxedEnvironment):
    """jinja's immutable sandbox with memoized safety checks (see the module header)."""

    code_generator_class = _ChatCodeGenerator

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self._safety: dict[tuple[type, str], bool] = {}

    def getattr(self, obj: Any, attribute: str) -> Any:
        kind = type(obj)
        if type(attribute) is str:
            if kind is dict and attribute not in _DICT_ATTRIBUTES:
                try:
                    return obj[attribute]
                except LookupError:
                    return self.undefined(obj=obj, name=attribute)
            if self._safety.get((kind, attribute)) and attribute not in _FORMAT_METHODS:
                # known safe for this type: jinja would return the attribute itself
                try:
                    return getattr(obj, attribute)
                except AttributeError:
                    pass
        return super().getattr(obj, attribute)

    def is_safe_attribute(self, obj: Any, attr: str, value: Any) -> bool:
        key = (type(obj), attr)
        safe = self._safety.get(key)
        if safe is None:
            safe = super().is_safe_attribute(obj, attr, value)
            if len(self._safety) < _MAX_SAFETY_ENTRIES:
                self._safety[key] = safe
        return safe


def chat_environment() -> ImmutableSandboxedEnvironment:
    """A new environment configured as ``transformers`` configures its own."""
    env = _ChatSandbox(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _DictConstructor()
    env.globals["namespace"] = _Namespace
    return env
