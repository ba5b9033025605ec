"""Per-iteration render memo: a loop body's output reused when its inputs are the same.

Opt-in (``load_chat_template(..., memo=True)``): with the environment's inline fast
paths, keying an iteration (evaluating its key expressions, freezing the message,
hashing it) costs about as much as rendering it for the templates measured (Qwen's and
Mistral's bodies are a few comparisons and concatenations per message), so requests
render without it; ``bench/render_bench.py`` keeps measuring it. It could pay for a
template whose loop body costs more per message (none is measured here).

A chat template spends nearly all its time in ``{% for message in messages %}``, and a
conversation's next turn resends every earlier message: most loop iterations of a request
repeat, with the same inputs, an iteration some earlier request already rendered. This
module proves, from the template's AST, what a loop body's output can depend on, and the
compiled template then keys each iteration on exactly those values and reuses the output
stored under an equal key.

Only loops over the messages are considered (``messages`` and names set from it, as
:mod:`.content_format` finds them). What an iteration can depend on (the analysis,
:func:`install_memos`):

* the loop variable's value (the message), as a whole;
* every *outer read*: a name the body reads that the iteration has not (certainly)
  assigned itself (``ns``, ``messages``, ``tools``, ``add_generation_prompt``, ...), and
  the outer loop's flags (``loop.first``, ``loop.last``, ``loop.index0``, ...). These
  are keyed as the largest side-effect-free expressions around them that read nothing
  the iteration computes: ``loop.index0 > ns.last_query_index`` is keyed as one boolean,
  ``messages[loop.index0 - 1].role != "tool"`` as another, not as the whole list (a
  condition that reads the message too, ``message.role == "system" and not
  loop.first``, is keyed whole); a name the body sets on some path only is keyed with
  the value it had before the body;
* nothing else: locals are computed from those, filters and tests are jinja's own pure
  ones (never ``random``), and every callable a body can reach comes from a key value
  (JSON values' methods, the environment's pure globals, checked by identity at run
  time; any other callable, ``strftime_now`` included, makes the iteration unkeyable).

A loop is refused (rendered as jinja renders it, every time) when the body assigns a
namespace attribute (``{% set ns.x = ... %}``: state carried between iterations),
``break``s or ``continue``s the memoized loop itself, uses ``loop`` other than through
those flags (``loop.cycle``, ``loop.changed``, a recursive ``loop(...)``), defines or
calls macros, or uses a node type the analysis does not know. At run time, an iteration
whose key holds a value that is not plain JSON data (an undefined, a namespace, a
function other than the pure globals) or whose key expressions raise is rendered without
the memo; an iteration whose body raises stores nothing.

Keys compare type-strictly (``1``, ``1.0`` and ``True`` are different keys; so are
``0.0`` and ``-0.0``), so equal keys mean equal inputs, and equal inputs give equal
output: the memo never changes what is rendered, and ``tests/unit/test_render_fast.py``
checks that against the plain jinja2 sandbox for random conversations.

The store is bounded: two generations of at most ``MEMO_ENTRIES`` each (a hit moves an
entry into the young generation; a full young generation becomes the old one), outputs
longer than ``MEMO_MAX_OUTPUT`` characters are not stored.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from typing import Any

import jinja2.nodes as nodes
from jinja2.defaults import DEFAULT_FILTERS, DEFAULT_TESTS

from .content_format import message_lists, refers_to

__all__ = [
    "MEMO_ENTRIES",
    "MEMO_MAX_OUTPUT",
    "MemoStore",
    "freeze",
    "install_memos",
    "memo_body",
    "memo_slot",
]

MEMO_ENTRIES = 4096
MEMO_MAX_OUTPUT = 64 * 1024

_LOOP_FLAGS = frozenset(
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
    )
)
_IMPURE_FILTERS = frozenset(("random",))
# filters that take another filter's or test's name as an argument
_BY_NAME_FILTERS = frozenset(("map", "select", "reject", "selectattr", "rejectattr"))
_PURE_EXPRS = (
    nodes.Compare,
    nodes.BinExpr,
    nodes.UnaryExpr,
    nodes.Concat,
    nodes.CondExpr,
    nodes.Tuple,
    nodes.List,
    nodes.Dict,
    nodes.Pair,
    nodes.Slice,
    nodes.Operand,
    nodes.Getitem,
    nodes.Getattr,
    nodes.Keyword,
)
_OTHER_EXPRS = (nodes.Call,)
_CONTAINERS = (nodes.Operand, nodes.Keyword, nodes.Pair, nodes.Slice)  # not expressions
# what reads both the target and outer values is keyed whole only when it is a condition
# (a small value, and its short-circuits kept); else its parts are
_CONDITIONS = (nodes.Compare, nodes.And, nodes.Or, nodes.Not, nodes.Test)
_TARGET = 1
_OUTER = 2
_IMPURE = -1


def memo_body(
    components: list[nodes.Expr], invariant: int, body: list[nodes.Node], slot: int
) -> nodes.Node:
    """A memoized loop body: ``components`` are evaluated first and key the output of
    ``body`` in the environment's store number ``slot``; the first ``invariant`` of them
    are evaluated at the loop's first iteration only.

    jinja allows no new node types, so this is a ``ScopedEvalContextModifier`` (whose
    children the symbol tracking visits in the loop's own frame, as the body's) holding
    the components as its options and marked with ``memo_slot``, which the environment's
    code generator compiles (:mod:`.environment`)."""
    options = [nodes.Keyword(f"k{i}", c) for i, c in enumerate(components)]
    node = nodes.ScopedEvalContextModifier(options, body)
    node.memo_slot = slot  # type: ignore[attr-defined]
    node.memo_invariant = invariant  # type: ignore[attr-defined]
    return node


def memo_slot(node: nodes.Node) -> int | None:
    """The store number of a :func:`memo_body` node, None for any other node."""
    slot = getattr(node, "memo_slot", None)
    return slot if isinstance(slot, int) else None


class _Refuse(Exception):
    """The body does something the analysis cannot prove harmless."""


class _NoKey(Exception):
    """A key value that is not plain data (the iteration renders without the memo)."""


class _Analysis:
    """Collects the components of one loop body, or raises :class:`_Refuse`."""

    def __init__(self, target: str, filters: dict[str, Any], tests: dict[str, Any]) -> None:
        self.target = target
        self.filters = filters
        self.tests = tests
        self.components: list[nodes.Expr] = []
        self._seen: set[str] = {repr(nodes.Name(target, "load"))}
        self.mutable: frozenset[str] = frozenset()
        """Names assigned somewhere in the body (the target included, if it is)."""

    # --- expressions -------------------------------------------------------------

    def _check_filter(self, node: nodes.Filter | nodes.Test) -> None:
        if node.dyn_args is not None or node.dyn_kwargs is not None:
            raise _Refuse("dynamic filter arguments")
        if isinstance(node, nodes.Test):
            if self.tests.get(node.name) is not DEFAULT_TESTS.get(node.name):
                raise _Refuse(f"test {node.name!r} is not jinja's own")
            return
        if node.name in _IMPURE_FILTERS:
            raise _Refuse(f"filter {node.name!r}")
        own = self.filters.get(node.name)
        if own is not DEFAULT_FILTERS.get(node.name) and node.name != "tojson":
            raise _Refuse(f"filter {node.name!r} is not jinja's own")
        if node.name in _BY_NAME_FILTERS:
            for arg in [*node.args, *(k.value for k in node.kwargs)]:
                if not isinstance(arg, nodes.Const) or arg.value in _IMPURE_FILTERS:
                    raise _Refuse(f"filter {node.name!r} with a computed name")

    def _reads(self, node: nodes.Node, local: frozenset[str], loop_visible: bool) -> int:
        """What side-effect-free ``node`` reads (``_TARGET | _OUTER`` bits, 0 for a
        constant), or ``_IMPURE`` when it calls something or reads a local."""
        if isinstance(node, nodes.Const | nodes.TemplateData):
            return 0
        if isinstance(node, nodes.Name):
            if node.ctx != "load" or node.name in local or node.name in self.mutable:
                return _IMPURE
            if node.name == self.target:
                return _TARGET
            if node.name == "loop" and loop_visible:
                raise _Refuse("the loop object itself is read")
            return _OUTER
        if isinstance(node, nodes.Getattr) and _is_loop(node.node, local, loop_visible):
            if node.attr not in _LOOP_FLAGS:
                raise _Refuse(f"loop.{node.attr}")
            return _OUTER
        if isinstance(node, nodes.Filter | nodes.Test):
            self._check_filter(node)
            if node.node is None:
                return _IMPURE
        elif not isinstance(node, _PURE_EXPRS):
            return _IMPURE
        reads = 0
        for child in node.iter_child_nodes():
            child_reads = self._reads(child, local, loop_visible)
            if child_reads == _IMPURE:
                return _IMPURE
            reads |= child_reads
        return reads

    def _add(self, node: nodes.Node) -> None:
        dump = repr(node)
        if dump not in self._seen:
            self._seen.add(dump)
            self.components.append(copy.deepcopy(node))  # type: ignore[arg-type]

    def expr(self, node: nodes.Node, local: frozenset[str], loop_visible: bool) -> None:
        """Record the outer reads of expression ``node`` as components: the largest
        side-effect-free expressions around them that read no local."""
        reads = self._reads(node, local, loop_visible)
        mixed = reads & _TARGET and not isinstance(node, _CONDITIONS)
        if reads != _IMPURE and not mixed and not isinstance(node, _CONTAINERS):
            if reads & _OUTER:
                while isinstance(node, nodes.Not):  # as good a key, and shared with ``x``
                    node = node.node
                self._add(node)
            return  # else a constant, or the target's (keyed as a whole)
        if isinstance(node, nodes.Name):
            if node.name not in local:
                # assigned somewhere in the body, not certainly yet: its value here may
                # still be the one it had before the body, which is keyed then
                self._add(nodes.Name(node.name, "load"))
            return
        if isinstance(node, nodes.Filter | nodes.Test):
            self._check_filter(node)
        elif reads != _IMPURE:
            pass  # the target's value mixed with outer ones: keyed part by part
        elif not isinstance(node, _PURE_EXPRS + _OTHER_EXPRS):
            raise _Refuse(f"expression {type(node).__name__}")
        for child in node.iter_child_nodes():
            self.expr(child, local, loop_visible)

    # --- statements --------------------------------------------------------------

    def block(
        self, body: Iterable[nodes.Node], assigned: set[str], loop_visible: bool, inner: bool
    ) -> set[str]:
        """Walk statements in order; ``assigned`` is the names certainly bound so far
        (returned updated). ``inner``: inside a nested loop (break/continue are its)."""
        for stmt in body:
            assigned = self.stmt(stmt, assigned, loop_visible, inner)
        return assigned

    def stmt(
        self, node: nodes.Node, assigned: set[str], loop_visible: bool, inner: bool
    ) -> set[str]:
        local = frozenset(assigned)
        if isinstance(node, nodes.Output):
            for child in node.nodes:
                self.expr(child, local, loop_visible)
            return assigned
        if isinstance(node, nodes.If):
            self.expr(node.test, local, loop_visible)
            branches = [self.block(node.body, set(assigned), loop_visible, inner)]
            for elif_ in node.elif_:
                self.expr(elif_.test, local, loop_visible)
                branches.append(self.block(elif_.body, set(assigned), loop_visible, inner))
            branches.append(self.block(node.else_, set(assigned), loop_visible, inner))
            return assigned | set.intersection(*branches)
        if isinstance(node, nodes.Assign):
            self.expr(node.node, local, loop_visible)
            return assigned | _targets(node.target)
        if isinstance(node, nodes.For):
            if node.recursive:
                raise _Refuse("a recursive inner loop")
            self.expr(node.iter, local, loop_visible)
            bound = _targets(node.target)
            if node.test is not None:
                if any(n.name == "loop" for n in node.test.find_all(nodes.Name)):
                    raise _Refuse("an inner loop's filter reads loop")
                self.expr(node.test, local | bound, loop_visible)
            outer_mutable = self.mutable
            self.mutable = outer_mutable | _assigned_in(node.body)
            self.block(node.body, assigned | bound | {"loop"}, False, True)
            self.mutable = outer_mutable
            self.block(node.else_, set(assigned), loop_visible, inner)
            return assigned
        if isinstance(node, nodes.Break | nodes.Continue):
            if not inner:
                raise _Refuse("break/continue of the memoized loop")
            return assigned
        if isinstance(node, nodes.ExprStmt):
            self.expr(node.node, local, loop_visible)
            return assigned
        raise _Refuse(f"statement {type(node).__name__}")


def _is_loop(node: nodes.Node, local: frozenset[str], loop_visible: bool) -> bool:
    return (
        loop_visible
        and isinstance(node, nodes.Name)
        and node.name == "loop"
        and "loop" not in local
        and node.ctx == "load"
    )


def _assigned_in(body: Iterable[nodes.Node]) -> set[str]:
    """Names ``set`` in ``body`` at its own level (inner loops scope their own)."""
    out: set[str] = set()
    for node in body:
        if isinstance(node, nodes.Assign):
            out |= _targets(node.target)
        elif isinstance(node, nodes.If):
            out |= _assigned_in(node.body)
            for elif_ in node.elif_:
                out |= _assigned_in(elif_.body)
            out |= _assigned_in(node.else_)
        elif isinstance(node, nodes.For):
            out |= _assigned_in(node.else_)
    return out


def _targets(node: nodes.Node) -> set[str]:
    if isinstance(node, nodes.Name):
        return {node.name}
    if isinstance(node, nodes.Tuple):
        out: set[str] = set()
        for item in node.items:
            out |= _targets(item)
        return out
    raise _Refuse(f"assignment to {type(node).__name__}")  # NSRef: a namespace attribute


def plan_loop(
    loop: nodes.For,
    filters: dict[str, Any],
    tests: dict[str, Any],
    macros: frozenset[str] = frozenset(),
) -> list[nodes.Expr] | None:
    """The key components of ``loop``'s body, or None when the body's output cannot be
    proven a function of them. The loop-invariant ones come first: those that read
    neither the target nor ``loop`` (outer names, which the body cannot assign, and
    their attributes) have one value for the whole loop and are keyed once per loop."""
    if loop.recursive or loop.test is not None or not isinstance(loop.target, nodes.Name):
        return None
    if any(memo_slot(n) is not None for n in loop.body):
        return None
    if any(n.name in macros for n in loop.find_all(nodes.Name)):
        return None  # a macro call (its output would be keyed by the macro object)
    target = loop.target.name
    analysis = _Analysis(target, filters, tests)
    try:
        analysis.mutable = frozenset(_assigned_in(loop.body))
        if "loop" in analysis.mutable:
            return None
        analysis.block(loop.body, set(), True, False)
    except _Refuse:
        return None
    components = [nodes.Name(target, "load"), *analysis.components]
    invariant = [c for c in components if not _reads_name(c, ("loop", target))]
    return invariant + [c for c in components if _reads_name(c, ("loop", target))]


def _reads_name(node: nodes.Node, names: tuple[str, ...]) -> bool:
    return any(n.name in names for n in node.find_all(nodes.Name)) or (
        isinstance(node, nodes.Name) and node.name in names
    )


def install_memos(ast: nodes.Template, filters: dict[str, Any], tests: dict[str, Any]) -> list[int]:
    """Wrap the body of every provable outermost loop over the messages (``messages`` or
    a name set from it, as :mod:`.content_format` finds them) of ``ast`` in place in a
    :func:`memo_body`; returns the line numbers of the memoized loops. Other loops
    (``tools``, a message's parts) are short, and keying them would cost more than
    rendering them."""
    memoized: list[int] = []
    macros = frozenset(m.name for m in ast.find_all(nodes.Macro))
    lists = message_lists(ast)

    def visit(node: nodes.Node) -> None:
        for child in node.iter_child_nodes():
            if isinstance(child, nodes.For) and any(refers_to(child.iter, n) for n in lists):
                components = plan_loop(child, filters, tests, macros)
                if components is not None:
                    slot = len(memoized)
                    target = child.target.name  # type: ignore[attr-defined]
                    invariant = sum(not _reads_name(c, ("loop", target)) for c in components)
                    child.body = [memo_body(components, invariant, child.body, slot)]
                    memoized.append(child.lineno)
                    continue
            if isinstance(child, nodes.Macro | nodes.CallBlock):
                continue  # macro bodies run per call, with arguments the analysis ignores
            visit(child)

    visit(ast)
    return memoized


class _Marker:
    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"<{self.name}>"


_TRUE = _Marker("true")
_FALSE = _Marker("false")


def freeze(value: Any, pure: dict[int, tuple[str, Any]]) -> Any:
    """A hashable, type-strict image of ``value`` (plain JSON data, or one of the
    ``pure`` functions by id); raises :class:`_NoKey` for anything else.

    Strings and None stand for themselves; every other value is a tuple whose first item
    says its type (a dict's keys and values follow alternately), so two values have
    equal images only when they are equal and of the same types throughout."""
    kind = type(value)
    if kind is str or value is None:
        return value
    if kind is dict:
        out: list[Any] = ["d"]
        for k, v in value.items():
            out.append(k if type(k) is str else freeze(k, pure))
            out.append(v if type(v) is str else freeze(v, pure))
        return tuple(out)
    if kind is list:
        return ("l", *[v if type(v) is str else freeze(v, pure) for v in value])
    if kind is bool:
        return _TRUE if value else _FALSE
    if kind is int:
        return ("i", value)
    if kind is float:
        return ("f", value.hex())
    if kind is tuple:
        return ("t", *[freeze(v, pure) for v in value])
    known = pure.get(id(value))
    if known is not None and known[1] is value:
        return ("g", known[0])
    raise _NoKey(kind.__name__)


class MemoStore:
    """One memoized loop's outputs by key: two generations, bounded (see the header)."""

    __slots__ = ("_old", "_young", "entries", "hits", "max_output", "misses")

    def __init__(self, entries: int = MEMO_ENTRIES, max_output: int = MEMO_MAX_OUTPUT) -> None:
        self._young: dict[Any, str] = {}
        self._old: dict[Any, str] = {}
        self.entries = entries
        self.max_output = max_output
        self.hits = 0
        self.misses = 0

    def get(self, key: Any) -> str | None:
        out = self._young.get(key)
        if out is None:
            out = self._old.get(key)
            if out is None:
                self.misses += 1
                return None
            self._put(key, out)
        self.hits += 1
        return out

    def put(self, key: Any, output: str) -> None:
        if len(output) <= self.max_output:
            self._put(key, output)

    def _put(self, key: Any, output: str) -> None:
        young = self._young
        if len(young) >= self.entries:
            self._old = young
            self._young = young = {}
        young[key] = output

    def __len__(self) -> int:
        return len(self._young) + len(self._old)


def key_function(pure_globals: dict[str, Any]) -> Callable[..., Any]:
    """``memo_key(components, invariant)`` for compiled templates: the frozen key (after
    the already frozen ``invariant`` part), or None when an iteration cannot be keyed."""
    pure = {id(v): (name, v) for name, v in pure_globals.items()}

    def memo_key(components: tuple[Any, ...], invariant: Any = ()) -> Any:
        try:
            return (invariant, *[freeze(c, pure) for c in components])
        except (_NoKey, RecursionError):
            return None

    return memo_key
