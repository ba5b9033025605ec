"""The PromQL of the deployment kit, and the series and labels each expression names.

The dashboard (``deploy/grafana/continuum.json``) and the alert rules
(``deploy/prometheus/alerts.yaml``) hold PromQL that must keep naming series the router and
listener really export. :func:`all_expressions` collects every expression (Grafana's
variables replaced by what Prometheus would see: ``$__rate_interval`` by a duration,
``$backend`` by ``.*``; a ``label_values(metric, label)`` variable query by the
equivalent ``group by (label) (metric)``), and :func:`references` reads one expression
into what it uses: each vector selector's metric name and matcher labels, and every label
named by a grouping or matching clause (``by``, ``without``, ``on``, ``ignoring``,
``group_left``, ``group_right``).

This is a scanner over PromQL's tokens, not a full parser: Prometheus's own parser
(``promtool check rules``) judges the syntax; this only has to find names. It raises
:class:`PromqlError` on what it cannot scan (an unterminated string or brace), so a
malformed expression fails the test that reads it instead of passing unread.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

__all__ = [
    "DASHBOARD",
    "RESERVED",
    "RULES",
    "PromqlError",
    "References",
    "Selector",
    "all_expressions",
    "dashboard_expressions",
    "dashboard_panels",
    "references",
    "rule_expressions",
    "walk_panels",
]

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "deploy" / "grafana" / "continuum.json"
RULES = ROOT / "deploy" / "prometheus" / "alerts.yaml"

_GROUPING = frozenset(("by", "without", "on", "ignoring", "group_left", "group_right"))
_KEYWORDS = frozenset(("and", "or", "unless", "bool", "offset", "inf", "nan", "atan2"))
_AGGREGATIONS = frozenset(
    (
        "sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values",
        "bottomk", "topk", "quantile", "limitk", "limit_ratio",
    )
)  # fmt: skip
RESERVED = _GROUPING | _KEYWORDS | _AGGREGATIONS
"""Words that are never metric names where this scanner meets them."""
_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
_NUMBER = re.compile(r"(0x[0-9a-fA-F]+|[0-9]*\.?[0-9]+(e[+-]?[0-9]+)?)([smhdwy]|ms)?")
_MATCH_OP = re.compile(r"\s*(=~|!~|!=|=)\s*")
_GRAFANA_DURATIONS = ("$__rate_interval", "${__rate_interval}", "$__interval", "$__range")
_LABEL_VALUES = re.compile(r"^\s*label_values\(\s*(.+?)\s*,\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*\)\s*$")


class PromqlError(ValueError):
    """An expression this scanner cannot read."""


@dataclass(frozen=True)
class Selector:
    """One vector selector: ``metric{label="..."}``."""

    metric: str
    """Empty for a bare ``{...}`` selector."""
    matchers: frozenset[tuple[str, str, str]]
    """``(label, operator, value)`` of each matcher, the value unquoted."""

    @property
    def labels(self) -> frozenset[str]:
        return frozenset(label for label, _, _ in self.matchers)


@dataclass
class References:
    """What one expression names."""

    selectors: list[Selector] = field(default_factory=list)
    grouping: set[str] = field(default_factory=set)
    """Labels of ``by (...)``, ``on (...)`` and the other grouping clauses."""


def grafana_to_promql(expr: str) -> str:
    """A Grafana target's expression as Prometheus receives it (variables expanded)."""
    for var in _GRAFANA_DURATIONS:
        expr = expr.replace(var, "5m")
    return re.sub(r"\$\{?[a-zA-Z_][a-zA-Z0-9_]*\}?", ".*", expr)


def walk_panels(panels: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every panel of a panel list, rows and the panels nested in collapsed rows included."""
    out: list[dict[str, Any]] = []
    for p in panels:
        out.append(p)
        out.extend(walk_panels(p.get("panels") or []))
    return out


def dashboard_panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel, rows' nested panels included, rows themselves excluded."""
    return [p for p in walk_panels(dashboard.get("panels") or []) if p.get("type") != "row"]


def dashboard_expressions(path: Path = DASHBOARD) -> list[tuple[str, str]]:
    """``(where, expr)`` for every panel target and every query variable of the dashboard."""
    dashboard = json.loads(path.read_text(encoding="utf-8"))
    out: list[tuple[str, str]] = []
    for panel in dashboard_panels(dashboard):
        for target in panel.get("targets") or []:
            where = f"panel {panel.get('title')!r} target {target.get('refId')}"
            out.append((where, grafana_to_promql(str(target.get("expr", "")))))
    for var in (dashboard.get("templating") or {}).get("list") or []:
        if var.get("type") != "query":
            continue
        query = var.get("query")
        text = query.get("query", "") if isinstance(query, dict) else str(query or "")
        m = _LABEL_VALUES.match(text)
        if m is None:
            raise PromqlError(f"variable {var.get('name')!r}: not a label_values query: {text!r}")
        expr = f"group by ({m.group(2)}) ({grafana_to_promql(m.group(1))})"
        out.append((f"variable {var.get('name')!r}", expr))
    return out


def rule_expressions(path: Path = RULES) -> list[tuple[str, str]]:
    """``(where, expr)`` for every rule of a Prometheus rules file."""
    doc = yaml.safe_load(path.read_text(encoding="utf-8"))
    out: list[tuple[str, str]] = []
    for group in doc["groups"]:
        for rule in group["rules"]:
            name = rule.get("alert") or rule.get("record")
            out.append((f"rule {name}", str(rule["expr"])))
    return out


def all_expressions() -> list[tuple[str, str]]:
    return dashboard_expressions() + rule_expressions()


def _string_end(expr: str, i: int) -> int:
    """Index after the string literal starting at ``expr[i]``."""
    quote = expr[i]
    j = i + 1
    while j < len(expr):
        if expr[j] == "\\" and quote != "`":
            j += 2
            continue
        if expr[j] == quote:
            return j + 1
        j += 1
    raise PromqlError(f"unterminated string at {i}: {expr!r}")


def _unquote(literal: str) -> str:
    if literal[0] == "`":
        return literal[1:-1]
    return literal[1:-1].encode("latin-1", "backslashreplace").decode("unicode_escape")


def _matchers(expr: str, i: int) -> tuple[frozenset[tuple[str, str, str]], int]:
    """The matchers of the list starting at the ``{`` at ``expr[i]``, and the index after
    its ``}``."""
    found: set[tuple[str, str, str]] = set()
    j = i + 1
    while True:
        while j < len(expr) and expr[j] in " \t\n,":
            j += 1
        if j >= len(expr):
            raise PromqlError(f"unterminated matcher list at {i}: {expr!r}")
        if expr[j] == "}":
            return frozenset(found), j + 1
        m = _LABEL.match(expr, j)
        if m is None:
            raise PromqlError(f"expected a label name at {j}: {expr!r}")
        op = _MATCH_OP.match(expr, m.end())
        if op is None or op.end() >= len(expr) or expr[op.end()] not in "\"'`":
            raise PromqlError(f"expected a matcher after {m.group()!r} at {j}: {expr!r}")
        j = _string_end(expr, op.end())
        found.add((m.group(), op.group(1), _unquote(expr[op.end() : j])))


def _label_list(expr: str, i: int) -> tuple[set[str], int]:
    """Labels of the ``( a, b )`` list whose ``(`` is at or after ``i`` (spaces skipped)."""
    while i < len(expr) and expr[i].isspace():
        i += 1
    if i >= len(expr) or expr[i] != "(":
        return set(), i  # group_left without a list
    end = expr.find(")", i)
    if end < 0:
        raise PromqlError(f"unterminated label list at {i}: {expr!r}")
    names = [n.strip() for n in expr[i + 1 : end].split(",") if n.strip()]
    for n in names:
        if not _LABEL.fullmatch(n):
            raise PromqlError(f"not a label name: {n!r} in {expr!r}")
    return set(names), end + 1


def references(expr: str) -> References:
    """The selectors and grouping labels of one PromQL expression."""
    refs = References()
    i = 0
    while i < len(expr):
        c = expr[i]
        if c.isspace() or c in "()+-*/%^=!<>,":
            i += 1
        elif c == "[":
            end = expr.find("]", i)
            if end < 0:
                raise PromqlError(f"unterminated range at {i}: {expr!r}")
            i = end + 1  # a range or subquery: durations only
        elif c in "\"'`":
            i = _string_end(expr, i)
        elif c == "{":
            matchers, i = _matchers(expr, i)
            refs.selectors.append(Selector("", matchers))
        elif c == "#":
            nl = expr.find("\n", i)
            i = len(expr) if nl < 0 else nl + 1
        elif c.isdigit() or (c == "." and i + 1 < len(expr) and expr[i + 1].isdigit()):
            m = _NUMBER.match(expr, i)
            assert m is not None
            i = m.end()
        else:
            m = _NAME.match(expr, i)
            if m is None:
                raise PromqlError(f"unexpected {c!r} at {i}: {expr!r}")
            word, i = m.group(), m.end()
            rest = expr[i:].lstrip()
            if word in _GROUPING:
                labels, i = _label_list(expr, i)
                refs.grouping |= labels
            elif word.lower() in _KEYWORDS or word in _AGGREGATIONS:
                continue
            elif rest.startswith("("):
                continue  # a function or an aggregation
            elif rest.startswith("{"):
                brace = expr.index("{", i)
                matchers, i = _matchers(expr, brace)
                refs.selectors.append(Selector(word, matchers))
            else:
                refs.selectors.append(Selector(word, frozenset()))
    return refs
