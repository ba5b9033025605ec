"""Reading callgrind's output files: instructions a thread executed, by shared object.

A total says that push and pull differ; the split by object says where: TLS and HTTP/2
show up in gRPC's library, SSE and JSON in the interpreter and orjson, payload copies in
libc. Only the format's parts that callgrind writes by default are handled (``positions:
line``, one event, name compression); see valgrind's "Callgrind Format Specification".
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import PurePosixPath

__all__ = ["CallgrindFormatError", "self_cost_by_object"]

_NAME = re.compile(r"\((\d+)\)(?: (.*))?\Z")
_POSITION_LINES = ("fl=", "fi=", "fe=", "cfi=", "cfl=", "cfn=")


class CallgrindFormatError(ValueError):
    """The text is not a callgrind profile this reader understands; names the line."""


def _name(table: dict[str, str], spec: str, lineno: int) -> str:
    """A possibly compressed name: ``(id) name`` defines ``id``, ``(id)`` refers to it."""
    m = _NAME.match(spec)
    if m is None:
        return spec
    ident, name = m.groups()
    if name is not None:
        table[ident] = name
        return name
    if ident not in table:
        raise CallgrindFormatError(f"line {lineno}: name ({ident}) used before it is defined")
    return table[ident]


def self_cost_by_object(text: str) -> dict[str, int]:
    """Self cost (the first event, ``Ir`` by default) per object file's base name.

    A cost line belongs to the function of the last ``fn=``, whose object is the last
    ``ob=``; the cost line after ``calls=`` is the callee's inclusive cost, which is not
    this function's own and is skipped (the callee's self cost is counted where it is
    defined). The sum over objects equals the file's ``summary:``.

    Raises:
        CallgrindFormatError: a cost line before any ``fn=``, a dangling name reference,
            a ``calls=`` with no cost line after it, or a cost that is not an integer.
    """
    objects: dict[str, str] = {}
    costs: Counter[str] = Counter()
    obj: str | None = None
    in_fn = False
    after_calls = False
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line or line.startswith("#"):
            continue
        head = line[0]
        is_cost = head.isdigit() or head in "+-*"
        if after_calls and not is_cost:
            raise CallgrindFormatError(f"line {lineno}: calls= is not followed by a cost line")
        if line.startswith("ob="):
            obj = PurePosixPath(_name(objects, line[3:].strip(), lineno)).name
            continue
        if line.startswith("cob="):
            _name(objects, line[4:].strip(), lineno)
            continue
        if line.startswith("fn="):
            in_fn = True
            continue
        if line.startswith(_POSITION_LINES):
            continue
        if line.startswith("calls="):
            after_calls = True
            continue
        if is_cost:
            parts = line.split()
            if not in_fn or obj is None:
                raise CallgrindFormatError(f"line {lineno}: a cost line outside any function")
            if after_calls:
                after_calls = False
                continue
            if len(parts) < 2:
                continue  # a position with no cost: zero
            try:
                costs[obj] += int(parts[1])
            except ValueError:
                raise CallgrindFormatError(
                    f"line {lineno}: cost {parts[1][:40]!r} is not an integer"
                ) from None
            continue
        # Header lines (version:, events:, summary:, totals:, ...) carry no cost here.
    if after_calls:
        raise CallgrindFormatError("the file ends right after a calls= line")
    return dict(costs)
