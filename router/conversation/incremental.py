"""Incremental rendering: a chat template's message loop as a plan that renders only the
messages a conversation's earlier turn did not have.

Multi-turn clients resend the whole history every turn: turn k+1's messages are turn k's
and one or two more. Most chat templates render each message by itself, so the prompt of
turn k+1 is the prompt of turn k's messages followed by the new messages' text. The plan
makes the template say, for every request, what that reuse needs to hold, and
:mod:`.render_cache` keeps the chain state at those message boundaries.

A template has a plan when its top-level statements hold exactly one ``{% for <name> in
messages %}`` and nothing sets ``messages`` (no ``if`` filter, no ``else``, not
recursive, no ``break`` and no
``{% set ns.x %}`` inside: those carry state from skipped messages) and nothing in it
names ``loop`` other than by its attributes (``loop.changed`` refused). The plan is the
same template with that loop instrumented, compiled in the fast environment:

* a marker string is output just before the loop (after the text *before* it, the
  "head"), at the start of every message rendered and after the loop, so the text of each
  message is known exactly;
* the loop starts at the first message not reused (:class:`.environment.Tail`: the
  loop's index and flags as over the whole list);
* what a message's text may depend on besides the message itself is recorded:

  - ``messages[i]`` read while rendering message ``j``: the text can be reused at a
    boundary past ``max(i, j)`` (``i`` an ``int`` >= 0; anything else: never);
  - ``loop.last`` or ``loop.nextitem``: past ``j + 1`` (the next message exists);
    ``loop.length``, ``loop.revindex``, ``loop.revindex0`` and any other use of
    ``messages``: never;
  - every other name the loop body reads (special tokens, ``tools``, a namespace set
    before the loop, the names the body sets itself, as they are before the loop) is
    passed by value when the loop starts: reuse needs the same values (same types, same
    items, same order), except where the name is only compared with the loop's index
    (``loop.index0 > ns.last_query_index``): there reuse needs the comparison to give the
    same answer for every message reused.

The head's text must be the same too. What is not in this list cannot reach a message's
text: the loop body runs in jinja's immutable sandbox, cannot set names outside itself,
and ``strftime_now`` in the loop body refuses the plan.
"""

from __future__ import annotations

import copy
import operator
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jinja2
import jinja2.nodes as n

from .environment import Tail, chat_environment, compile_template

__all__ = ["NEVER", "Guard", "IncrementalPlan", "Tracker", "plan_for", "same_value"]

NEVER = 1 << 62
"""A message's ``need`` when its text can never be reused."""

_PREFIX = "_cn_"
_AHEAD = frozenset(("last", "nextitem"))
_WHOLE = frozenset(("length", "revindex", "revindex0"))
_FREE_LOOP = frozenset(("index", "index0", "first", "previtem", "depth", "depth0", "cycle"))
_COMPARE: dict[str, Callable[[Any, Any], Any]] = {
    "gt": operator.gt,
    "gteq": operator.ge,
    "lt": operator.lt,
    "lteq": operator.le,
    "eq": operator.eq,
    "ne": operator.ne,
}
_MIRROR = {"gt": "lt", "gteq": "lteq", "lt": "gt", "lteq": "gteq", "eq": "eq", "ne": "ne"}
_UNSUPPORTED = (n.Extends, n.Block, n.Include, n.Import, n.FromImport, n.Macro, n.NSRef, n.Break)


class _NoPlan(Exception):
    pass


@dataclass(frozen=True, slots=True)
class Guard:
    """``lhs(i) <op> value`` for message ``i``: ``lhs`` is ``loop.index0`` (``offset`` 0)
    or ``loop.index`` (1), ``value`` a path of names passed when the loop starts."""

    op: Callable[[Any, Any], Any]
    offset: int

    def agree(self, before: Any, now: Any, upto: int) -> bool:
        """Whether the comparison answers the same for messages ``0 .. upto-1`` with
        ``before`` as with ``now`` (ints only: anything else must be the same value)."""
        if type(before) is not int or type(now) is not int:
            return False
        op, k = self.op, self.offset
        return all(bool(op(i + k, before)) == bool(op(i + k, now)) for i in range(upto))


@dataclass(frozen=True, slots=True)
class IncrementalPlan:
    """A template's instrumented compilation and what its variables mean."""

    template: jinja2.Template
    marker: str
    """Output before the loop, before each message rendered, and after the loop."""
    snapshot_names: tuple[str, ...]
    """Names whose values (at the loop's start) must be the same for reuse."""
    guards: tuple[Guard, ...]
    """Comparisons with the loop's index, in the order their values are passed."""


class Tracker:
    """One render's record: the loop-start values and each rendered message's ``need``
    (the smallest boundary at which its text can be reused)."""

    __slots__ = ("env", "needs", "values")

    def __init__(self, env: jinja2.Environment) -> None:
        self.env = env
        self.needs: dict[int, int] = {}
        self.values: tuple[Any, ...] = ()

    def variables(self, messages: list[Any], start: int, marker: str) -> dict[str, Any]:
        return {
            "_cn_messages": Tail(messages, start),
            "_cn_mark": marker,
            "_cn_snap": self.snap,
            "_cn_at": self.at,
            "_cn_ahead": self.ahead,
            "_cn_whole": self.whole,
        }

    def _need(self, i: int, need: int) -> None:
        if need > self.needs.get(i, 0):
            self.needs[i] = need

    def snap(self, marker: str, *values: Any) -> str:
        self.values = values
        return marker

    def at(self, seq: Any, index: Any, i: int) -> Any:
        if type(index) is int and index >= 0:
            self._need(i, max(index, i) + 1)
        else:
            self._need(i, NEVER)
        return self.env.getitem(seq, index)

    def ahead(self, value: Any, i: int) -> Any:
        self._need(i, i + 2)
        return value

    def whole(self, value: Any, i: int) -> Any:
        self._need(i, NEVER)
        return value


def _name(name: str) -> n.Name:
    return n.Name(name, "load")


def _call(name: str, *args: n.Expr) -> n.Call:
    return n.Call(_name(name), list(args), [], None, None)


def _path_root(node: n.Node) -> str | None:
    """The name a path of attributes and constant items starts from, or None."""
    while True:
        if isinstance(node, n.Name):
            return node.name
        if isinstance(node, n.Getattr) and not node.attr.startswith("_"):
            node = node.node
        elif (
            isinstance(node, n.Getitem)
            and isinstance(node.arg, n.Const)
            and type(node.arg.value) in (str, int)
        ):
            node = node.node
        else:
            return None


def _loop_index(node: n.Node) -> int | None:
    if isinstance(node, n.Getattr) and isinstance(node.node, n.Name) and node.node.name == "loop":
        return {"index0": 0, "index": 1}.get(node.attr)
    return None


class _Body:
    """Rewrites one loop body (in place) and collects what its text depends on."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.assigned: set[str] = set()
        self.loaded: set[str] = set()
        self.guard_nodes: list[tuple[Guard, n.Expr]] = []
        self.guarded_roots: set[str] = set()

    def collect_assigned(self, body: Sequence[n.Node]) -> None:
        for stmt in body:
            for node in stmt.find_all(n.Name):
                if node.ctx in ("store", "param"):
                    self.assigned.add(node.name)

    def rewrite(self, node: n.Node, outer: bool) -> n.Node:
        """``node`` rewritten; ``outer``: ``loop`` is the instrumented loop's."""
        if isinstance(node, _UNSUPPORTED):
            raise _NoPlan(type(node).__name__)
        if isinstance(node, n.Name):
            return self._name(node, outer)
        if outer and isinstance(node, n.Getattr) and isinstance(node.node, n.Name):
            if node.node.name == "loop":
                if node.attr in _AHEAD:
                    return _call("_cn_ahead", node, _name("_cn_i"))
                if node.attr in _WHOLE:
                    return _call("_cn_whole", node, _name("_cn_i"))
                if node.attr in _FREE_LOOP:
                    return node
                raise _NoPlan(f"loop.{node.attr}")
        if (
            isinstance(node, n.Getitem)
            and isinstance(node.node, n.Name)
            and node.node.name == "messages"
            and not isinstance(node.arg, n.Slice)
        ):
            arg = self.rewrite(node.arg, outer)
            assert isinstance(arg, n.Expr)
            return _call("_cn_at", _name("messages"), arg, _name("_cn_i"))
        if outer and isinstance(node, n.Compare) and len(node.ops) == 1:
            guard = self._guard(node)
            if guard is not None:
                return node
        if isinstance(node, n.For):
            # the nested loop's own ``loop`` shadows ours in its body, filter and else
            node.iter = self.rewrite(node.iter, outer)
            node.target = self.rewrite(node.target, False)
            node.body = [self.rewrite(c, False) for c in node.body]
            node.else_ = [self.rewrite(c, False) for c in node.else_]
            if node.test is not None:
                node.test = self.rewrite(node.test, False)
            return node
        for field in node.fields:
            value = getattr(node, field)
            if isinstance(value, n.Node):
                setattr(node, field, self.rewrite(value, outer))
            elif isinstance(value, list):
                setattr(
                    node,
                    field,
                    [self.rewrite(v, outer) if isinstance(v, n.Node) else v for v in value],
                )
        return node

    def _name(self, node: n.Name, outer: bool) -> n.Node:
        name = node.name
        if node.ctx != "load":
            return node
        if name == "loop":
            if outer:
                raise _NoPlan("loop used other than by an attribute")
            return node
        if name == "messages":
            return _call("_cn_whole", node, _name("_cn_i"))
        if name == "strftime_now":
            raise _NoPlan("strftime_now in the loop")
        if name != self.target:
            self.loaded.add(name)
        return node

    def _guard(self, node: n.Compare) -> Guard | None:
        op = node.ops[0].op
        if op not in _COMPARE:
            return None
        left, right = node.expr, node.ops[0].expr
        offset = _loop_index(left)
        other = right
        if offset is None:
            offset, other, op = _loop_index(right), left, _MIRROR[op]
        if offset is None:
            return None
        root = _path_root(other)
        if root is None or root in ("loop", "messages", self.target) or root in self.assigned:
            return None
        if root.startswith(_PREFIX):
            return None
        guard = Guard(_COMPARE[op], offset)
        self.guard_nodes.append((guard, copy.deepcopy(other)))
        self.guarded_roots.add(root)
        return guard


def _the_loop(tree: n.Template) -> int:
    found = [
        i
        for i, stmt in enumerate(tree.body)
        if isinstance(stmt, n.For)
        and isinstance(stmt.iter, n.Name)
        and stmt.iter.name == "messages"
    ]
    if len(found) != 1:
        raise _NoPlan("not exactly one top-level loop over messages")
    loop = tree.body[found[0]]
    assert isinstance(loop, n.For)
    if loop.else_ or loop.test is not None or loop.recursive:
        raise _NoPlan("the loop has a filter, an else or recursion")
    if not isinstance(loop.target, n.Name):
        raise _NoPlan("the loop unpacks its items")
    return found[0]


def _instrument(ast: n.Template) -> tuple[n.Template, tuple[str, ...], tuple[Guard, ...]]:
    tree = copy.deepcopy(ast)
    for node in tree.find_all(n.Name):
        if node.name.startswith(_PREFIX):
            raise _NoPlan(f"the template names {node.name!r}")
        if node.name == "messages" and node.ctx != "load":
            # the loop would run over the set value (Llama 3's ``messages[1:]``), not
            # over the request's messages the plan hands it
            raise _NoPlan("the template sets messages")
    at = _the_loop(tree)
    loop = tree.body[at]
    assert isinstance(loop, n.For) and isinstance(loop.target, n.Name)
    body = _Body(loop.target.name)
    body.collect_assigned(loop.body)
    rewritten = [body.rewrite(stmt, True) for stmt in loop.body]
    # names the body reads: the assigned ones by their value before the loop (a branch
    # may read one it does not set), the others unless only compared with the index
    guarded_only = body.guarded_roots - body.loaded
    snapshot = tuple(
        sorted(name for name in body.loaded | body.guarded_roots if name not in guarded_only)
    )
    guards = tuple(g for g, _ in body.guard_nodes)
    index = n.Getattr(_name("loop"), "index0", "load")
    loop.iter = _name("_cn_messages")
    loop.body = [
        n.Assign(n.Name("_cn_i", "store"), index),
        n.Output([_name("_cn_mark")]),
        *rewritten,
    ]
    snap = _call("_cn_snap", _name("_cn_mark"), *(_name(s) for s in snapshot))
    snap.args.extend(expr for _, expr in body.guard_nodes)
    tree.body[at : at + 1] = [n.Output([snap]), loop, n.Output([_name("_cn_mark")])]
    return tree, snapshot, guards


def plan_for(ast: n.Template) -> IncrementalPlan | None:
    """The template's plan, or None when its loop does not render message by message."""
    try:
        tree, snapshot, guards = _instrument(ast)
    except _NoPlan:
        return None
    template = compile_template(chat_environment(), tree)
    marker = f"\x00cn-{secrets.token_hex(16)}\x00"
    return IncrementalPlan(template, marker, snapshot, guards)


def same_value(a: Any, b: Any) -> bool:
    """Whether a template sees ``a`` and ``b`` as the same value: same types throughout,
    equal, dicts in the same order (``1``, ``1.0`` and ``True`` differ, so do ``0.0``
    and ``-0.0``); undefined values by their name; any other object only itself."""
    if a is b:
        return True
    t = type(a)
    if t is not type(b):
        return False
    if t is str or t is int or t is bool:
        return bool(a == b)
    if t is float:
        return repr(a) == repr(b)
    if t is list or t is tuple:
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b, strict=True))
    if t is dict:
        return len(a) == len(b) and all(
            same_value(ka, kb) and same_value(va, vb)
            for (ka, va), (kb, vb) in zip(a.items(), b.items(), strict=True)
        )
    if isinstance(a, jinja2.Undefined):
        return bool(a._undefined_name == b._undefined_name)
    if isinstance(a, jinja2.utils.Namespace):
        return same_value(
            object.__getattribute__(a, "_Namespace__attrs"),
            object.__getattribute__(b, "_Namespace__attrs"),
        )
    return False
