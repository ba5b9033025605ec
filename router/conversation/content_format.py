"""Which content shape a template expects: vLLM's "string" or "openai" content format.

vLLM flattens a message's content parts to one string (text parts joined with ``"\\n"``)
unless the template itself walks the parts, in which case it passes the parts on as
``[{"type": "text", "text": ...}, ...]``. It decides once per template (``--chat-template-
content-format auto``, ``vllm/renderers/hf.py``: ``_detect_content_format``) by reading the
template's jinja AST, and this module answers the same question the same way:

1. the names that hold the messages: ``messages``, then every ``{% set x = <expr> %}``
   whose right side is one of those names, possibly sliced (``messages[1:]``), filtered
   (``messages|reverse``) or tested, repeated until nothing new appears;
2. the loop variables over those names (``{% for m in loop_messages %}``);
3. the format is "openai" when some loop iterates over one of those variables'
   ``content`` (``m['content']`` or ``m.content``, again possibly sliced, filtered or
   tested), else "string".

As in vLLM, a matched assignment or loop whose target is not a plain name (``{% set
ns.x = messages %}``, ``{% for a, b in messages %}``) makes the detection give up and
answer "string"; ``messages[0]['content']`` loops are not followed (only loop variables
are). The walk visits nodes in jinja's own ``find_all`` order, so it stops where vLLM's
does.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Literal

import jinja2.nodes as nodes

__all__ = ["ContentFormat", "detect_content_format"]

ContentFormat = Literal["string", "openai"]


class _GiveUp(Exception):
    """A target shape the detection does not follow (vLLM asserts, then says "string")."""


def _is_name(node: nodes.Node, name: str) -> bool:
    return isinstance(node, nodes.Name) and node.ctx == "load" and node.name == name


def _is_member(node: nodes.Node, name: str, key: str) -> bool:
    """``name[key]`` or ``name.key``."""
    if isinstance(node, nodes.Getitem):
        return (
            _is_name(node.node, name)
            and isinstance(node.arg, nodes.Const)
            and node.arg.value == key
        )
    if isinstance(node, nodes.Getattr):
        return _is_name(node.node, name) and node.attr == key
    return False


def _refers_to(node: nodes.Node, name: str, key: str | None = None) -> bool:
    """``node`` is ``name`` (or ``name[key]``), possibly filtered, tested or sliced."""
    while True:
        if isinstance(node, nodes.Filter):
            if node.node is None:
                return False
            node = node.node
        elif isinstance(node, nodes.Test):
            node = node.node
        elif isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice):
            node = node.node
        else:
            break
    return _is_member(node, name, key) if key else _is_name(node, name)


def _target_name(node: nodes.Node) -> str:
    if not isinstance(node, nodes.Name):
        raise _GiveUp
    return node.name


def _message_lists(root: nodes.Template) -> list[str]:
    """``messages`` and every name assigned from it, transitively."""
    found = ["messages"]
    queue = ["messages"]
    seen = {"messages"}
    while queue:
        current = queue.pop(0)
        for assign in root.find_all(nodes.Assign):
            if _refers_to(assign.node, current):
                name = _target_name(assign.target)
                found.append(name)
                if name not in seen:
                    seen.add(name)
                    queue.append(name)
    return found


def _loops_over(root: nodes.Template, names: list[str], key: str | None) -> Iterator[str]:
    """Loop variables of ``for`` loops over one of ``names`` (or their ``key``)."""
    for loop in root.find_all(nodes.For):
        if any(_refers_to(loop.iter, name, key) for name in names):
            yield _target_name(loop.target)


def detect_content_format(ast: nodes.Template) -> ContentFormat:
    """vLLM's "auto" content format of the template whose parsed AST is ``ast``."""
    try:
        message_vars = list(_loops_over(ast, _message_lists(ast), None))
        for _ in _loops_over(ast, message_vars, "content"):
            return "openai"
    except _GiveUp:
        return "string"
    return "string"
