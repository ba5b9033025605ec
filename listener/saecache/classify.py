"""Session class from what an engine sees of a request, without the caller's hint.

SAECache routes a session's blocks by its class (``types.route``): agent loops, chats
and one-off templated requests reuse their blocks on very different time scales. A caller
rarely says which one a request is, but the engine that renders the request's chat
template knows a few things about it for free, and those separate the classes well:

* ``tools``: how many tool definitions the request declares;
* ``tool_calls`` / ``tool_results``: tool-call markers and tool-result messages in the
  prompt (earlier steps of an agent loop);
* ``turns``: user, assistant and tool messages in the prompt after the system prompt (a
  prompt that carries earlier turns belongs to a continuing conversation);
* ``reasoning``: the template renders reasoning markers (``<think>``) or the prompt
  carries reasoning content (thinking-mode chat);
* ``temperature`` and ``max_tokens``: the sampling parameters. Programmatic templated
  requests (extraction, classification, batch summaries) tend to run greedy or nearly
  so with a short output cap; interactive chats keep the client's default temperature
  and a long or no cap.

The rule (:func:`classify`), first match wins, each step one sentence of evidence:

1. tools declared, or tool calls or tool results in the prompt -> ``AGENT``;
2. earlier turns in the prompt, or reasoning -> ``CHAT``;
3. a first request whose sampling looks programmatic (temperature at most
   ``temperature_max`` or ``max_tokens`` at most ``max_tokens_max``) -> ``SINGLE``;
4. a first request otherwise -> ``CHAT``;
5. nothing known -> ``UNKNOWN`` (the policy's default routing).

The two thresholds are the classifier's only parameters; ``RuleConfig()``'s values were
fitted on the tuning traces (``python -m bench.saecache.classes --variants base --seeds
1,2 --fit``) and never on the evaluation grid. Those traces' sampling parameters are the
trace generator's assumption of what each kind of client sends, so the thresholds (and
the accuracy in ``bench/RESULTS.md``) hold for clients like those; rules 1 and 2 do not
depend on it.

Malformed values (a non-finite or negative temperature, a count that is not a
non-negative integer, a string where a number belongs) are dropped field by field, as if
the engine had not sent them; nothing here raises on input.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .types import SessionClass

__all__ = ["RequestFeatures", "RuleConfig", "classify", "parse_features"]

MAX_COUNT = 1 << 20
"""Counts above this are not believed (dropped)."""
MAX_TEMPERATURE = 100.0


@dataclass(frozen=True, slots=True)
class RequestFeatures:
    """What an engine knows of one request; None: not known (not sent)."""

    tools: int | None = None
    turns: int | None = None
    tool_calls: int | None = None
    tool_results: int | None = None
    reasoning: bool | None = None
    temperature: float | None = None
    max_tokens: int | None = None

    def known(self) -> bool:
        """Whether any feature is known."""
        return any(getattr(self, f) is not None for f in self.__slots__)


@dataclass(frozen=True, slots=True)
class RuleConfig:
    """The thresholds of rule 3 (see the module docstring)."""

    temperature_max: float = 0.2
    """A first request sampled at this temperature or colder looks programmatic."""
    max_tokens_max: int = 1024
    """A first request capped at this many output tokens or fewer looks programmatic."""


def _count(v: Any) -> int | None:
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_COUNT:
        return None
    return v


def _temperature(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    t = float(v)
    return t if math.isfinite(t) and 0.0 <= t <= MAX_TEMPERATURE else None


def parse_features(raw: Mapping[str, Any] | None) -> RequestFeatures:
    """``RequestFeatures`` from a mapping (JSON, a decoded message), malformed fields dropped.

    ``max_tokens`` 0 means "no cap sent" (proto3's default), as does a missing key.
    """
    if not isinstance(raw, Mapping):
        return RequestFeatures()
    reasoning = raw.get("reasoning")
    max_tokens = _count(raw.get("max_tokens"))
    return RequestFeatures(
        tools=_count(raw.get("tools")),
        turns=_count(raw.get("turns")),
        tool_calls=_count(raw.get("tool_calls")),
        tool_results=_count(raw.get("tool_results")),
        reasoning=reasoning if isinstance(reasoning, bool) else None,
        temperature=_temperature(raw.get("temperature")),
        max_tokens=max_tokens if max_tokens else None,
    )


_DEFAULT = RuleConfig()


def classify(f: RequestFeatures, cfg: RuleConfig = _DEFAULT) -> SessionClass:
    """The session class the features point to (rules 1-5 of the module docstring)."""
    if (f.tools or 0) > 0 or (f.tool_calls or 0) > 0 or (f.tool_results or 0) > 0:
        return SessionClass.AGENT
    if (f.turns or 0) > 1 or f.reasoning:
        return SessionClass.CHAT
    if f.temperature is not None and f.temperature <= cfg.temperature_max:
        return SessionClass.SINGLE
    if f.max_tokens is not None and f.max_tokens <= cfg.max_tokens_max:
        return SessionClass.SINGLE
    if f.turns is not None or f.temperature is not None or f.max_tokens is not None:
        return SessionClass.CHAT
    return SessionClass.UNKNOWN
