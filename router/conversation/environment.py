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

Compiled once per template at start, twice: in this module's fast environment (what
requests use) and in jinja's plain ``ImmutableSandboxedEnvironment`` with the same
configuration (``chat_environment(fast=False)``, the reference the fast one is tested
against, byte for byte). Rendering is dominated by the sandbox's checks (every
``message.role``, ``content.startswith(...)``, ``loop.last`` goes through
``environment.getattr`` and ``environment.call``), so the fast environment answers the
cases plain JSON values make common inline, with the sandbox's results:

* ``obj.name`` on a plain ``dict`` for a name that is not a ``dict`` attribute: jinja
  tries ``getattr`` (which can only raise) then ``obj[name]``; this goes to ``obj[name]``
  (``message.role`` compiles to ``v["role"] if type(v) is dict and "role" in v else
  environment.getattr(v, "role")``), and an absent key to the undefined the sandbox
  would make (``False`` when an ``if``/``elif`` test is only that attribute);
  ``obj["name"]`` likewise, and ``seq[i]`` on a list with an int in range;
* ``x.name is defined`` on a dict is whether it holds the key (and not an undefined);
* ``loop`` over a list or tuple is a ``LoopContext`` that indexes the sequence and sets
  ``first`` and ``last`` per iteration (:class:`_SeqLoop`), and ``loop.<flag>`` on it is
  read directly; ``ns.<name>`` reads the namespace's attributes dict (``_`` names never);
* a loop resolves the context names its body may read before it sets them once, before
  the loop (jinja resolves them at every iteration; the context cannot change meanwhile:
  only top-level ``set`` writes it);
* a call of a ``str`` method that neither formats nor mutates (``startswith``,
  ``split``, ``strip``, ...) or of ``dict.get``/``items``/``keys``/``values`` on a value of
  exactly that type is a direct call (the sandbox's ``call`` would only check that the
  method is not marked unsafe and call it); any other object takes the sandboxed call;
* whether an attribute is safe depends only on the object's type and the attribute's
  name (jinja's checks are ``isinstance`` and name tests), so the answer is memoized per
  (type, name), up to a bound, and an attribute known safe is returned directly
  (``format`` and ``format_map`` excepted: jinja wraps those);
* ``tojson`` with its default arguments calls ``json.dumps``'s C encoder directly.

Each shortcut gives what the plain environment gives (``tests/unit/test_render_fast.py``
holds them equal for random conversations and for each shortcut on its own).
Underscore names and mutating methods still go through the sandbox on every path.
"""

from __future__ import annotations

import copy
import json
from datetime import datetime
from keyword import iskeyword as is_python_keyword
from typing import Any, NoReturn

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.tests
import jinja2.utils
from jinja2.compiler import CodeGenerator, Frame, optimizeconst
from jinja2.idtracking import (
    VAR_LOAD_ALIAS,
    VAR_LOAD_PARAMETER,
    VAR_LOAD_RESOLVE,
    VAR_LOAD_UNDEFINED,
)
from jinja2.runtime import LoopContext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import missing

__all__ = ["Tail", "chat_environment", "compile_template"]


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


def _tojson_plain(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """``transformers``' own ``tojson`` (the plain environment's)."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


_JSON = json.JSONEncoder(ensure_ascii=False)
_c_make_encoder = getattr(json.encoder, "c_make_encoder", None)
_c_encode_basestring = getattr(json.encoder, "c_encode_basestring", None)
# One encoder for every call, without json.dumps's cycle check (the only per-call state
# it keeps): a template in the immutable sandbox cannot build a cycle, and a request's
# JSON has none; a structure too deep is a RecursionError either way.
_encode = (
    _c_make_encoder(None, _JSON.default, _c_encode_basestring, None, ": ", ", ", False, False, True)
    if _c_make_encoder is not None and _c_encode_basestring is not None
    else None
)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    probe = getattr(type(value), "probe_json", None)
    if probe is not None:  # a tool call's arguments while a shape is learned (.segments)
        return str(probe(value, ensure_ascii, indent, separators, sort_keys))
    if (
        ensure_ascii
        or indent is not None
        or separators is not None
        or sort_keys
        or _encode is None
        or _c_encode_basestring is None
    ):
        return _tojson_plain(value, ensure_ascii, indent, separators, sort_keys)
    # the defaults (nearly every call): what json.dumps does, without building an encoder
    # object and its closures per call
    if isinstance(value, str):
        return str(_c_encode_basestring(value))
    return "".join(_encode(value, 0))


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
    """jinja's namespace, refusing ``_`` names (no way to CPython internals).

    Its attributes are looked up where CPython looks first (jinja's namespace answers
    every lookup in Python code): the object's own, then the namespace's names
    (``__getattr__``), which never start with ``_`` and so never shadow the object's."""

    __getattribute__ = object.__getattribute__

    def __getattr__(self, name: str) -> Any:
        try:
            return self._Namespace__attrs[name]
        except KeyError:
            raise AttributeError(name) from None

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
# LoopContext's public attributes: what the sandbox returns for them is the attribute
_LOOP_ATTRIBUTES = frozenset(
    (
        "index",
        "index0",
        "revindex",
        "revindex0",
        "first",
        "last",
        "length",
        "depth",
        "depth0",
        "previtem",
        "nextitem",
        "cycle",
        "changed",
    )
)
# methods the sandbox lets a template call as they are (they neither mutate nor format);
# each name is a method of one of the two types only
_PURE_METHODS = {
    **dict.fromkeys(
        (
            "startswith",
            "endswith",
            "strip",
            "lstrip",
            "rstrip",
            "split",
            "rsplit",
            "splitlines",
            "lower",
            "upper",
            "title",
            "capitalize",
            "replace",
            "find",
            "rfind",
            "count",
            "join",
            "isdigit",
            "isspace",
            "isalpha",
            "isalnum",
            "partition",
            "rpartition",
            "removeprefix",
            "removesuffix",
        ),
        "str",
    ),
    **dict.fromkeys(("get", "items", "keys", "values"), "dict"),
}


def _has_call(node: jinja2.nodes.Node) -> bool:
    # arguments are written twice (fast and sandboxed branch): keep that linear
    return (
        isinstance(node, jinja2.nodes.Call)
        or next(node.find_all(jinja2.nodes.Call), None) is not None
    )


class _ChatCodeGenerator(CodeGenerator):
    """Inline fast paths for plain values (see the module header)."""

    @optimizeconst
    def visit_Getattr(self, node: jinja2.nodes.Getattr, frame: Frame) -> None:
        attr = node.attr
        if self.environment.is_async or attr in _DICT_ATTRIBUTES:
            super().visit_Getattr(node, frame)
            return
        # a dict without the key: jinja's getattr raises, then so does obj[name], and
        # the sandbox returns this undefined
        # (only an ``if``/``elif`` test reads it: its truth, False, is enough)
        absent = f"environment.undefined(obj=_cv_, name={attr!r})"
        if getattr(node, "truth_only", False):
            absent = "False"
        self.write(f"((_cv_[{attr!r}] if {attr!r} in _cv_ else {absent}) if type(_cv_ := ")
        self.visit(node.node, frame)
        self.write(") is dict else ")
        if attr in _LOOP_ATTRIBUTES:
            self.write(f"_cv_.{attr} if type(_cv_) is _SeqLoop else ")
        elif attr[:1] != "_":
            self.write(
                f"_na_[{attr!r}] if type(_cv_) is _Namespace and {attr!r} in "
                "(_na_ := _cv_._Namespace__attrs) else "
            )
        self.write(f"environment.getattr(_cv_, {attr!r}))")

    @optimizeconst
    def visit_Test(self, node: jinja2.nodes.Test, frame: Frame) -> None:
        target = node.node
        if (
            node.name != "defined"
            or self.environment.is_async
            or self.environment.tests.get("defined") is not jinja2.tests.test_defined
            or node.args
            or node.kwargs
            or node.dyn_args is not None
            or node.dyn_kwargs is not None
            or not isinstance(target, jinja2.nodes.Getattr)
            or target.attr in _DICT_ATTRIBUTES
        ):
            super().visit_Test(node, frame)
            return
        # ``x.name is defined`` on a dict: whether it holds the key (with a value that is
        # not an undefined), without making the undefined jinja's getattr would return
        attr = target.attr
        self.write(f"((not isinstance(_cv_[{attr!r}], Undefined) if {attr!r} in _cv_ else False)")
        self.write(" if type(_cv_ := ")
        self.visit(target.node, frame)
        self.write(
            f") is dict else not isinstance(environment.getattr(_cv_, {attr!r}), Undefined))"
        )

    @optimizeconst
    def visit_Getitem(self, node: jinja2.nodes.Getitem, frame: Frame) -> None:
        arg = node.arg
        if self.environment.is_async or isinstance(arg, jinja2.nodes.Slice):
            super().visit_Getitem(node, frame)
            return
        if not (isinstance(arg, jinja2.nodes.Const) and type(arg.value) is str):
            # ``seq[i]`` with an int in range on a list: the item (the sandbox's getitem
            # tries obj[i] first); the pair is built in order, the object first, and
            # read from the tuple (the index expression may reuse the other names)
            self.write("(_gt_[0][_gt_[1]] if type((_gt_ := (")
            self.visit(node.node, frame)
            self.write(", ")
            self.visit(arg, frame)
            self.write("))[0]) is list and type(_gt_[1]) is int and ")
            self.write("-len(_gt_[0]) <= _gt_[1] < len(_gt_[0]) else environment.getitem(*_gt_))")
            return
        key = arg.value
        self.write(f"(_cv_[{key!r}] if (type(_cv_ := ")
        self.visit(node.node, frame)
        self.write(f") is dict and {key!r} in _cv_) else environment.getitem(_cv_, {key!r}))")

    @optimizeconst
    def visit_Call(
        self, node: jinja2.nodes.Call, frame: Frame, forward_caller: bool = False
    ) -> None:
        callee = node.node
        kind = _PURE_METHODS.get(callee.attr) if isinstance(callee, jinja2.nodes.Getattr) else None
        if (
            kind is None
            or forward_caller
            or self.environment.is_async
            or node.dyn_args is not None
            or node.dyn_kwargs is not None
            or any(is_python_keyword(k.key) for k in node.kwargs)
            or any(_has_call(arg) for arg in node.iter_child_nodes(exclude=("node",)))
        ):
            super().visit_Call(node, frame, forward_caller=forward_caller)
            return
        # str/dict methods called directly: what the sandbox's call does for them
        assert isinstance(callee, jinja2.nodes.Getattr)
        self.write("(_cm_.")
        self.write(callee.attr)
        self.write("(")
        self._arguments(node, frame)
        self.write(") if type(_cm_ := ")
        self.visit(callee.node, frame)
        self.write(f") is {kind} else environment.call(context, environment.getattr(_cm_, ")
        self.write(repr(callee.attr))
        self.write(")")
        loop_kwargs = {"_loop_vars": "_loop_vars"} if frame.loop_frame else {}
        block_kwargs = {"_block_vars": "_block_vars"} if frame.block_frame else {}
        self.signature(node, frame, {**loop_kwargs, **block_kwargs} or None)
        self.write("))")

    def _arguments(self, node: jinja2.nodes.Call, frame: Frame) -> None:
        for i, arg in enumerate(node.args):
            if i:
                self.write(", ")
            self.visit(arg, frame)
        for i, kwarg in enumerate(node.kwargs):
            if i or node.args:
                self.write(", ")
            self.visit(kwarg, frame)

    _hoisted: dict[str, str] | None = None

    def visit_For(self, node: jinja2.nodes.For, frame: Frame, **kwargs: Any) -> None:
        if not (node.recursive or node.test is not None or self.environment.is_async):
            # the names the loop's frame resolves from the context at every iteration
            # (those the body may read before it sets them): the context cannot change
            # while the loop runs (only top-level sets write it), so resolve them once
            probe = frame.inner()
            probe.symbols.analyze_node(node, for_branch="body")
            hoisted = {}
            for action, param in probe.symbols.loads.values():
                if action == VAR_LOAD_RESOLVE and param != "loop":
                    hoisted[param] = name = self.temporary_identifier()
                    self.writeline(f"{name} = {self.get_resolve_func()}({param!r})")
            self._hoisted = hoisted
        super().visit_For(node, frame, **kwargs)
        self._hoisted = None

    def enter_frame(self, frame: Frame) -> None:
        hoisted, self._hoisted = self._hoisted, None
        if not (frame.loop_frame and hoisted):
            super().enter_frame(frame)
            return
        undefs = []
        for target, (action, param) in frame.symbols.loads.items():
            if action == VAR_LOAD_RESOLVE and param in hoisted:
                self.writeline(f"{target} = {hoisted[param]}")
            elif action == VAR_LOAD_RESOLVE:
                self.writeline(f"{target} = {self.get_resolve_func()}({param!r})")
            elif action == VAR_LOAD_ALIAS:
                self.writeline(f"{target} = {param}")
            elif action == VAR_LOAD_UNDEFINED:
                undefs.append(target)
            elif action != VAR_LOAD_PARAMETER:
                raise NotImplementedError("unknown load instruction")
        if undefs:
            self.writeline(f"{' = '.join(undefs)} = missing")


class _SeqLoop(LoopContext):
    """jinja's ``loop`` over a list or tuple, the same values for less work: the item is
    indexed, ``first`` and ``last`` are plain attributes set per iteration (jinja's are
    properties, ``last`` peeking the iterator), ``length`` known from the start.

    Only the immutable sandbox compiles to this (a template cannot change the sequence
    while it iterates over it); any other iterable gets jinja's own LoopContext."""

    first = False  # shadow the base class's properties: set per iteration
    last = False

    def __init__(
        self,
        iterable: Any,
        undefined: type[jinja2.Undefined],
        recurse: Any = None,
        depth0: int = 0,
    ) -> None:
        super().__init__(iterable, undefined, recurse, depth0)
        self._length = len(iterable)

    def _peek_next(self) -> Any:
        i = self.index0 + 1
        return self._iterable[i] if i < self._length else missing  # type: ignore[index,operator]

    def __next__(self) -> tuple[Any, _SeqLoop]:
        i = self.index0 + 1
        if i >= self._length:  # type: ignore[operator]
            raise StopIteration
        rv = self._iterable[i]  # type: ignore[index]
        self.index0 = i
        self.first = i == 0
        self.last = i == self._length - 1  # type: ignore[operator]
        self._before = self._current
        self._current = rv
        return rv, self


class Tail:
    """A list's items from ``start`` on, iterated as the loop over the whole list would
    reach them (``loop.index0`` from ``start``, ``loop.length`` the whole list's,
    ``loop.previtem`` the item before ``start``): the render cache's loop
    (:mod:`.incremental`) renders only the messages an earlier turn did not have."""

    __slots__ = ("items", "start")

    def __init__(self, items: list[Any], start: int) -> None:
        self.items = items
        self.start = start


def _loop_context(
    iterable: Any, undefined: type[jinja2.Undefined], recurse: Any = None, depth0: int = 0
) -> LoopContext:
    """What compiled templates call as ``LoopContext``."""
    if type(iterable) is Tail:
        loop = _SeqLoop(iterable.items, undefined, recurse, depth0)
        if iterable.start:
            loop.index0 = iterable.start - 1
            loop._current = iterable.items[iterable.start - 1]
        return loop
    kind = _SeqLoop if type(iterable) is list or type(iterable) is tuple else LoopContext
    return kind(iterable, undefined, recurse, depth0)


_RUNTIME_IMPORT = "from jinja2.runtime import "
_LOOP_NAMES = (
    "\nLoopContext = environment.loop_context\n_SeqLoop = environment.seq_loop"
    "\n_Namespace = environment.namespace_type\n"
)


class _ChatSandbox(ImmutableSandboxedEnvironment):
    """jinja's immutable sandbox with memoized safety checks (see the module header)."""

    code_generator_class = _ChatCodeGenerator

    loop_context = staticmethod(_loop_context)
    seq_loop = _SeqLoop
    namespace_type = _Namespace

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self._safety: dict[tuple[type, str], bool] = {}

    def make_globals(self, d: Any) -> dict[str, Any]:
        # a template's globals as one dict, not jinja's ChainMap over the environment's
        # (the same names and values: these are set before any template is compiled,
        # and never after): every render merges them into its context, and a ChainMap
        # makes that a Python-level walk (about 10 us a render)
        return {**self.globals, **(d or {})}

    def _generate(self, *args: Any, **kwargs: Any) -> str:
        # compiled templates build their loops with _loop_context (the module's first
        # line imports jinja's runtime names; ours replace LoopContext right after it)
        source: str = super()._generate(*args, **kwargs)
        first, _, rest = source.partition("\n")
        if not first.startswith(_RUNTIME_IMPORT):
            raise RuntimeError("unexpected jinja code generation: no runtime import first")
        return first + _LOOP_NAMES + rest

    def getattr(self, obj: Any, attribute: str) -> Any:
        kind = type(obj)
        if type(attribute) is str:
            if kind is dict and attribute not in _DICT_ATTRIBUTES:
                try:
                    return obj[attribute]
                except LookupError:
                    return self.undefined(obj=obj, name=attribute)
            if kind is _Namespace and attribute[:1] != "_":
                # what the namespace's __getattr__ returns, and the sandbox allows
                attrs = obj._Namespace__attrs
                if attribute in attrs:
                    return attrs[attribute]
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


def chat_environment(fast: bool = True) -> ImmutableSandboxedEnvironment:
    """A new environment configured as ``transformers`` configures its own; ``fast``
    False: jinja's plain immutable sandbox, without this module's shortcuts (the
    reference the fast one is tested against)."""
    kind = _ChatSandbox if fast else ImmutableSandboxedEnvironment
    env = kind(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson if fast else _tojson_plain
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _DictConstructor()
    env.globals["namespace"] = _Namespace
    return env


def compile_template(
    env: ImmutableSandboxedEnvironment, ast: jinja2.nodes.Template
) -> jinja2.Template:
    """``ast`` compiled in ``env`` (a fresh environment per template); ``ast`` is not
    changed."""
    tree = copy.deepcopy(ast)
    for node in tree.find_all(jinja2.nodes.If):
        if isinstance(node.test, jinja2.nodes.Getattr):
            node.test.truth_only = True  # type: ignore[attr-defined]
    return env.from_string(tree)
