"""A template's output for plain chats learned once per conversation shape, then produced
by concatenation: no jinja on the request path for the common request.

Rendering a chat runs the template's jinja code for every message (a few microseconds a
message even with :mod:`.environment`'s shortcuts): at 8k tokens that is most of what
the conversation path costs the router. But for the common request, where every message
the template sees is exactly ``{"role": str, "content": str}``, a chat template's output
is the messages' contents placed between strings that depend on the *shape* only: the
sequence of roles and the other template variables (``add_generation_prompt``, the
special tokens, ``chat_template_kwargs``). The template may still look at the contents
(Qwen's asks whether an assistant message holds ``</think>`` and whether the last user
message starts with ``<tool_response>``): those questions are recorded with their answers.

So for each new shape, the template is rendered with *probe* contents, ``str`` subclasses
that record every operation the template performs on them:

* ``startswith``, ``endswith``, ``in``, ``==``, truth, ``split``/``rsplit`` on a separator
  (which leaves the probe whole when the separator is absent) and ``strip``/``lstrip``/
  ``rstrip`` (the probe itself when they remove nothing) become *predicates*: (message,
  question, answer);
* ``+`` and ``str()`` (which filters such as ``replace`` call first) give a derived
  string on which any operation but ``+`` and output makes the shape opaque, and so does
  any other operation on a probe (``len``, indexing, iteration, hashing, ``replace``,
  ...): an opaque shape is always rendered by jinja.

The output is then cut at the probes' texts into a *program*: literal strings and
message indexes. Each shape is rendered twice, with two probe sets that differ in every
way a hidden transformation would show: set A's texts have inner quotes, backslashes,
newlines, ``<&>`` and non-ASCII characters (any escaping, ``tojson``, splitting or
truncation breaks them), set B's the same with whitespace at both ends and another
length (any trimming or slicing of a string built from a content breaks them). Both
answer the predicates' questions about set A's text (so ``content | trim`` is the
predicate "trimming leaves it as it is" in both, and B's padding stays), and both must
give the same predicates and the same program, with every probe text intact, or the
shape is opaque.

A request of that shape whose contents answer every predicate as the probes did runs the
same template code with the same results, so its prompt is the program with its
contents: ``"".join``.

Agent loops go the same way (:meth:`SegmentRenderer.render_chat`): every string of a
prepared message is a *slot* probed like a content (a tool message's ``tool_call_id``, a
tool call's ``id`` and ``name``), a tool call's ``arguments`` object the slot of its
``tojson`` text (a ``dict`` whose every method makes the shape opaque, and whose
``tojson`` with the default arguments is a probe). Their shape is the messages' keys in
order with the roles, which strings are empty, and the declared tools by their JSON (the
tools are rendered as they are while learning: a tool suite's text is a literal). Text
parts (``openai`` content format: ``{"type": literal, "text": slot}``) are served the same
way. Numbers or other objects in a message,
``continue_final_message``, ``documents``, a predicate answered otherwise or an opaque
shape render with jinja as before. A template may show the date (``strftime_now`` called with
one constant format that names nothing finer than the day, as Llama's and Mistral's do):
it is in the learned pieces, and every shape is dropped and learned again when it
changes (one call per format and request checks it). Templates that name ``lipsum``
(random text) or the time of day get no segment renderer at all.
Nor do templates that test or cut a string they build with ``~``, ``%``, ``join``,
``format`` or the escaping filters (which read a probe's text without its methods)
instead of outputting it, nor those naming ``int``, ``float``, ``wordcount``, ``urlize``,
``wordwrap``, ``title`` (their results depend on the text in ways no probe shows) or
``random``.
``tests/unit/test_render_fast.py`` holds this path equal to jinja's plain sandbox for
random conversations of both template families, and the golden test to ``transformers``.

A shape's first concatenation is checked against jinja's render of that request too (a
safety net under the probes: a difference makes the shape opaque, counted as
``mismatched`` and logged once), so learning a shape costs three renders, once. A shape is
learned the second time it comes (its first request renders with jinja, its hash kept,
up to :data:`MAX_SEEN`): traffic where most shapes never come back (agent loops of many
patterns, a client varying its tools) costs no more than rendering with jinja.

Memory: shapes are kept first in, first out, up to :data:`MAX_SHAPES` shapes and
:data:`MAX_ITEMS` program items and predicates in all (a few MiB).
"""

from __future__ import annotations

import logging
import operator
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from itertools import repeat
from typing import Any

import jinja2
import jinja2.nodes as n
import orjson
import xxhash

log = logging.getLogger("continuum.conversation")

__all__ = [
    "COMMON_CALL",
    "EMPTY",
    "FUTILE_AFTER",
    "FUTILE_MAX",
    "MAX_ITEMS",
    "MAX_SEEN",
    "MAX_SHAPES",
    "SLOT",
    "SegmentRenderer",
    "segment_renderer",
]

MAX_SHAPES = 4096
"""Shapes kept (each a sequence of roles with the other variables)."""
FUTILE_AFTER = 8
"""Opaque shapes of one kind in a row before its requests are left to jinja unread."""
FUTILE_MAX = 4096
"""The most requests of a kind left unread in a row before its shapes are tried again."""
MAX_SEEN = 1 << 14
"""Shapes remembered as seen once (a hash each), before any is learned."""
MAX_ITEMS = 1 << 18
"""Program items and predicates kept over all shapes (each a pointer and, for a literal,
a short string: some 20 MiB at most)."""

_RANDOM_GLOBALS = frozenset(("lipsum",))
"""Globals whose value changes between any two renders of the same input."""
_DATE_ONLY = re.compile(r"(?:%%|%-?[aAbBdejmyYuwUWVGhCDFx]|[^%])*")
"""A ``strftime`` format naming nothing finer than the day: its text changes once a day
(times of day, ``%c``, ``%s`` and the like would change it every second)."""

_OPEN, _MID, _CLOSE = "\ue000", "\ue002", "\ue001"
_INNER_A = "\"\\\n\t<&>'\u00e9\u2028\u4e2d"
_INNER_B = _INNER_A + "xyz"
_PAD = " \n\t"
_FIND_A = re.compile(re.escape(_OPEN) + r"(\d+)" + re.escape(_MID + _INNER_A + _CLOSE))
_FIND_B = re.compile(
    re.escape(_PAD + _OPEN) + r"(\d+)" + re.escape(_MID + _INNER_B + _CLOSE + _PAD[::-1])
)
_SENTINEL_CHARS = re.compile("[" + _OPEN + _MID + _CLOSE + "]")


def _strip_same(s: str, chars: Any) -> bool:
    return s.strip(chars) == s


def _lstrip_same(s: str, chars: Any) -> bool:
    return s.lstrip(chars) == s


def _rstrip_same(s: str, chars: Any) -> bool:
    return s.rstrip(chars) == s


def _rare(sub: str) -> str:
    """The character of ``sub`` to look for first: punctuation before letters (it is
    rarer in prose, and a one-character search is a ``memchr``, some 50 times faster
    than searching for a tag like ``</think>`` in text full of its letters)."""
    for ch in sub:
        if not ch.isalnum() and not ch.isspace():
            return ch
    return sub[:1]


def _no_clock(fmt: str) -> str:
    return ""


def _truth(s: str, _: Any) -> bool:
    return bool(s)


Question = Callable[[str, Any], bool]
_Predicate = tuple[int, Question, Any, bool]


class _Trace:
    """What one probe render recorded."""

    __slots__ = ("opaque", "predicates")

    def __init__(self) -> None:
        self.predicates: list[_Predicate] = []
        self.opaque = False

    def ask(self, probe: _Probe, question: Question, arg: Any) -> bool:
        answer = bool(question(probe.core, arg))
        self.predicates.append((probe.position, question, arg, answer))
        return answer


def _is_text(arg: Any) -> bool:
    return type(arg) is str or (type(arg) is tuple and all(type(a) is str for a in arg))


class _Traced(str):
    """A string of a probe render: ``+`` with a plain string, and ``str()`` (which
    filters such as ``replace`` call before working on the text), give a
    :class:`_Derived`."""

    trace: _Trace

    def __str__(self) -> str:
        return _derived(str.__str__(self), self.trace)

    def __add__(self, other: Any) -> Any:
        return _derived(str.__add__(str.__str__(self), other), self.trace)

    def __radd__(self, other: Any) -> Any:
        if type(other) is not str:
            self.trace.opaque = True
            return NotImplemented
        return _derived(other + str.__str__(self), self.trace)


class _Derived(_Traced):
    """A string built from a probe with ``+``: anything but ``+`` or output is opaque."""


def _derived(text: str, trace: _Trace) -> _Derived:
    out = _Derived(text)
    out.trace = trace
    return out


class _Probe(_Traced):
    """One message's content during a probe render (see the module header)."""

    position: int
    core: str
    """The text questions are answered about: set A's text in both sets, so both take
    the same branches and set B's padding shows only to what the probe cannot see."""

    def startswith(self, prefix: Any, *rest: Any) -> bool:
        if rest or not _is_text(prefix):
            self.trace.opaque = True
            return str.startswith(self, prefix, *rest)
        return self.trace.ask(self, str.startswith, prefix)

    def endswith(self, suffix: Any, *rest: Any) -> bool:
        if rest or not _is_text(suffix):
            self.trace.opaque = True
            return str.endswith(self, suffix, *rest)
        return self.trace.ask(self, str.endswith, suffix)

    def __contains__(self, sub: Any) -> bool:
        if type(sub) is not str:
            self.trace.opaque = True
            return str.__contains__(self, sub)
        return self.trace.ask(self, operator.contains, sub)

    def __eq__(self, other: object) -> bool:
        if type(other) is not str:
            self.trace.opaque = True
            return str.__eq__(self, other)
        return self.trace.ask(self, operator.eq, other)

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other)

    __hash__ = str.__hash__  # replaced below (opaque), like every other operation

    def __bool__(self) -> bool:
        return self.trace.ask(self, _truth, None)

    def _stripped(self, question: Question, method: Any, chars: Any) -> Any:
        if chars is not None and type(chars) is not str:
            self.trace.opaque = True
            return method(self, chars)
        if self.trace.ask(self, question, chars):
            return self
        return method(str.__str__(self), chars)

    def strip(self, chars: Any = None) -> Any:
        return self._stripped(_strip_same, str.strip, chars)

    def lstrip(self, chars: Any = None) -> Any:
        return self._stripped(_lstrip_same, str.lstrip, chars)

    def rstrip(self, chars: Any = None) -> Any:
        return self._stripped(_rstrip_same, str.rstrip, chars)

    def _split(self, method: Any, sep: Any, maxsplit: Any) -> Any:
        if type(sep) is not str or not sep or type(maxsplit) is not int:
            self.trace.opaque = True
            return method(str.__str__(self), sep, maxsplit)
        if maxsplit == 0 or not self.trace.ask(self, operator.contains, sep):
            return [self]
        return method(str.__str__(self), sep, maxsplit)

    def split(self, sep: Any = None, maxsplit: Any = -1) -> Any:
        return self._split(str.split, sep, maxsplit)

    def rsplit(self, sep: Any = None, maxsplit: Any = -1) -> Any:
        return self._split(str.rsplit, sep, maxsplit)


_TRACED = frozenset(
    (
        "startswith",
        "endswith",
        "__contains__",
        "__eq__",
        "__ne__",
        "__bool__",
        "strip",
        "lstrip",
        "rstrip",
        "split",
        "rsplit",
        "__add__",
        "__radd__",
    )
)
# what any string does without looking at its text, or only to show it
_NEUTRAL = frozenset(
    (
        "__str__",
        "__class__",
        "__new__",
        "__init__",
        "__init_subclass__",
        "__subclasshook__",
        "__getattribute__",
        "__setattr__",
        "__delattr__",
        "__dir__",
        "__doc__",
        "__reduce__",
        "__reduce_ex__",
        "__sizeof__",
        "__getnewargs__",
        "__class_getitem__",
    )
)


def _opaque(cls: type, name: str) -> None:
    original = getattr(str, name)

    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        self.trace.opaque = True
        return original(str.__str__(self), *args, **kwargs)

    method.__name__ = name
    setattr(cls, name, method)


for _name in dir(str):
    if _name in _NEUTRAL or not callable(getattr(str, _name)):
        continue
    if _name not in _TRACED:
        _opaque(_Probe, _name)
    if _name not in ("__add__", "__radd__"):
        _opaque(_Derived, _name)


def _probe(text: str, core: str, index: int, trace: _Trace) -> _Probe:
    p = _Probe(text)
    p.position = index
    p.trace = trace
    p.core = core
    return p


class _JsonProbe(dict[str, Any]):
    """A tool call's ``arguments`` (an object) during a probe render: the environment's
    ``tojson`` with its default arguments gives the slot's probe text (traced like a
    content); any other use of the object (its items, its length, other ``tojson``
    arguments) makes the shape opaque."""

    probe: _Probe

    def probe_json(self, ensure_ascii: Any, indent: Any, separators: Any, sort_keys: Any) -> str:
        if ensure_ascii or indent is not None or separators is not None or sort_keys:
            self.probe.trace.opaque = True
        return self.probe


def _opaque_dict(name: str) -> None:
    original = getattr(dict, name)

    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        self.probe.trace.opaque = True
        return original(self, *args, **kwargs)

    method.__name__ = name
    setattr(_JsonProbe, name, method)


for _name in dir(dict):
    if _name not in _NEUTRAL and callable(getattr(dict, _name)):
        _opaque_dict(_name)


def _json_probe(probe: _Probe) -> _JsonProbe:
    out = _JsonProbe()
    out.probe = probe
    return out


def _text_a(i: int) -> str:
    return f"{_OPEN}{i}{_MID}{_INNER_A}{_CLOSE}"


def _text_b(i: int) -> str:
    return f"{_PAD}{_OPEN}{i}{_MID}{_INNER_B}{_CLOSE}{_PAD[::-1]}"


@dataclass(frozen=True, slots=True)
class _Check:
    """One question asked of several messages with the same answer."""

    pick: Callable[[Sequence[str]], tuple[str, ...]]
    """The messages' contents (``itemgetter``: a tuple, always)."""
    question: Question
    arg: Any
    answer: bool
    rare: str | None
    """For "does not contain ``arg``": a character of it most contents lack (one
    ``memchr`` per content settles the check when none holds it)."""

    def holds(self, contents: Sequence[str]) -> bool:
        texts = self.pick(contents)
        if self.answer:
            return all(map(self.question, texts, repeat(self.arg)))
        rare = self.rare
        if rare is not None and not any(map(operator.contains, texts, repeat(rare))):
            return True
        return not any(map(self.question, texts, repeat(self.arg)))


@dataclass(frozen=True, slots=True)
class _Shape:
    pick: Callable[[Sequence[str]], tuple[str, ...]]
    """The output's pieces, from the contents followed by ``literals`` (C-level)."""
    literals: list[str]
    checks: tuple[_Check, ...]
    size: int
    """Program items and predicates (the memory bound's unit)."""

    @classmethod
    def of(cls, program: tuple[Any, ...], predicates: Sequence[_Predicate], count: int) -> _Shape:
        """``program`` (literals and message indexes) over ``count`` messages, and the
        ``predicates`` that must hold, compiled for the request path."""
        literals = [p for p in program if type(p) is str]
        at = iter(range(count, count + len(literals)))
        pool = [p if type(p) is int else next(at) for p in program]
        literals.append("")
        pool += [count + len(literals) - 1] * 2  # itemgetter of 2+ items: a tuple
        grouped: dict[tuple[Any, ...], list[int]] = {}
        for i, question, arg, answer in predicates:
            grouped.setdefault((question, arg, answer), []).append(i)
        checks = tuple(
            _Check(
                operator.itemgetter(*indexes, indexes[0]),
                question,
                arg,
                answer,
                _rare(arg) if question is operator.contains and not answer and arg else None,
            )
            for (question, arg, answer), indexes in grouped.items()
        )
        # long literals (a tool suite's JSON) count by their length too
        size = len(program) + len(predicates) + sum(map(len, literals)) // _CHARS_PER_ITEM
        return cls(operator.itemgetter(*pool), literals, checks, size)

    def text(self, contents: list[str]) -> str:
        return "".join(self.pick(contents + self.literals))


_OPAQUE = _Shape(operator.itemgetter(0, 0), [], (), 0)
_CHARS_PER_ITEM = 64
_CHAT = "chat"
"""The first item of :meth:`SegmentRenderer.render_chat`'s keys (the plain path's keys
start with the tuple of roles)."""

_ProbeChat = Callable[[Callable[[int], str]], list[dict[str, Any]]]
"""Builds one probe render's messages, given the probe text of each slot."""


def _plain_probes(roles: tuple[str, ...]) -> _ProbeChat:
    return lambda probe: [{"role": r, "content": probe(i)} for i, r in enumerate(roles)]


SLOT, EMPTY, ARGUMENTS = 1, 0, 2
"""A signature's markers: a string slot, an empty string, a tool call's arguments."""
COMMON_CALL = (
    ("id", SLOT),
    ("function", (("arguments", ARGUMENTS), ("name", SLOT))),
    ("type", "function"),
)
"""vLLM's prepared tool call with an id, a name and an object for arguments."""


_ROLE_CONTENT = ("role", "content")
_CALL = ("id", "function", "type")
_FUNCTION = ("arguments", "name")
"""The key orders of vLLM's prepared tool calls (``.messages``): a fast path."""


def _signature(
    chat: Sequence[Any], values: list[str], tojson: Callable[[Any], str]
) -> tuple[Any, ...] | None:
    """The shape of a prepared conversation, its strings appended to ``values`` in slot
    order, or None when a message holds anything else (content parts, numbers, ...).
    A message ``{"role": r, "content": text}`` is ``(r, SLOT or EMPTY)``, any other a
    tuple of ``(key, literal, slot marker or nested fields)`` pairs."""
    out: list[tuple[Any, ...]] = []
    add = out.append
    push = values.append
    for m in chat:
        if type(m) is not dict:
            return None
        if tuple(m) == _ROLE_CONTENT:
            role, content = m.values()
            if type(role) is str and type(content) is str:
                if content:
                    push(content)
                    add((role, SLOT))
                else:
                    add((role, EMPTY))
                continue
        fields = _fields(m, values, tojson)
        if fields is None:
            return None
        add(fields)
    return tuple(out)


def _string(key: str, value: str, values: list[str]) -> tuple[str, int]:
    """A string field: a slot (its value appended to ``values``), or the empty string."""
    if value:
        values.append(value)
        return key, SLOT
    return key, EMPTY


def _fields(
    m: dict[str, Any], values: list[str], tojson: Callable[[Any], str]
) -> tuple[Any, ...] | None:
    fields: list[tuple[str, Any]] = []
    for k, v in m.items():
        t = type(v)
        if k == "role":
            if t is not str:
                return None
            fields.append((k, v))  # a literal of the shape: templates branch on it
        elif t is str:
            fields.append(_string(k, v, values))
        elif k == "tool_calls" and t is list:
            calls = []
            for call in v:
                one = _call(call, values, tojson)
                if one is None:
                    return None
                calls.append(one)
            fields.append((k, tuple(calls)))
        elif k == "content" and t is list:  # text parts ("openai" content format)
            parts = []
            for part in v:
                one = _part(part, values)
                if one is None:
                    return None
                parts.append(one)
            fields.append((k, tuple(parts)))
        else:
            return None
    return tuple(fields)


def _part(part: Any, values: list[str]) -> tuple[Any, ...] | None:
    """One content part ``{"type": literal, other keys: text}`` (as :func:`_fields`)."""
    if type(part) is not dict:
        return None
    fields: list[tuple[str, Any]] = []
    for k, v in part.items():
        if type(v) is not str:
            return None
        fields.append((k, v) if k == "type" else _string(k, v, values))
    return tuple(fields)


def _call(call: Any, values: list[str], tojson: Callable[[Any], str]) -> Any:
    """One tool call's fields (as :func:`_fields`), or None."""
    if type(call) is not dict:
        return None
    if tuple(call) == _CALL:
        cid, function, kind = call.values()
        if (
            kind == "function"
            and type(cid) is str
            and cid
            and type(function) is dict
            and tuple(function) == _FUNCTION
        ):
            arguments, name = function.values()
            if type(arguments) is dict and type(name) is str and name:
                values += (cid, tojson(arguments), name)
                return COMMON_CALL
    fields: list[tuple[str, Any]] = []
    for k, v in call.items():
        t = type(v)
        if k == "type" and v == "function":
            fields.append((k, v))
        elif t is str:
            fields.append(_string(k, v, values))
        elif k == "function" and t is dict:
            function_fields: list[tuple[str, Any]] = []
            for fk, fv in v.items():
                ft = type(fv)
                if fk == "arguments" and ft is dict:
                    values.append(tojson(fv))
                    function_fields.append((fk, ARGUMENTS))
                elif ft is str:
                    function_fields.append(_string(fk, fv, values))
                else:
                    return None
            fields.append((k, tuple(function_fields)))
        else:
            return None
    return tuple(fields)


def _chat_probes(signature: tuple[Any, ...]) -> _ProbeChat:
    """The probe messages of a :func:`_signature`: its literals as they are, its slots
    numbered in the same order as the request's values."""

    def build(probe: Callable[[int], str]) -> list[dict[str, Any]]:
        slot = iter(range(1 << 30))

        def fill(fields: tuple[Any, ...]) -> dict[str, Any]:
            if fields and type(fields[0]) is str:  # {"role": r, "content": text}
                role, content = fields
                return {"role": role, "content": probe(next(slot)) if content else ""}
            out: dict[str, Any] = {}
            for k, v in fields:
                if v == SLOT and type(v) is int:
                    out[k] = probe(next(slot))
                elif v == EMPTY and type(v) is int:
                    out[k] = ""
                elif v == ARGUMENTS and type(v) is int:
                    out[k] = _json_probe(probe(next(slot)))  # type: ignore[arg-type]
                elif type(v) is str:
                    out[k] = v
                elif k == "tool_calls":
                    out[k] = [fill(call) for call in v]
                elif k == "content":  # text parts
                    out[k] = [fill(part) for part in v]
                else:  # a tool call's function
                    out[k] = fill(v)
            return out

        return [fill(m) for m in signature]

    return build


class SegmentRenderer:
    """One compiled template's shapes (one event loop: no locking)."""

    __slots__ = (
        "_clock",
        "_date_formats",
        "_dates",
        "_futile",
        "_items",
        "_seen",
        "_shapes",
        "_template",
        "_unchecked",
        "date_changes",
        "first_seen",
        "hits",
        "learned",
        "mismatched",
        "opaque",
        "refused",
        "skipped",
        "tojson",
    )

    def __init__(self, template: jinja2.Template, date_formats: Sequence[str] = ()) -> None:
        """``date_formats``: what the template passes ``strftime_now`` (its output, the
        date, is in the learned pieces: they are dropped when it changes)."""
        self._template = template
        self._date_formats = tuple(date_formats)
        clock = template.environment.globals.get("strftime_now")
        self._clock: Callable[[str], str] = clock if callable(clock) else _no_clock
        self._dates = self._today()
        self.date_changes = 0
        """Times every shape was dropped because the date the template shows changed."""
        self.tojson = template.environment.filters["tojson"]
        """The filter a tool call's arguments are rendered with (the same function, so a
        slot's value is the text the template would output)."""
        self._shapes: dict[tuple[Any, ...], _Shape] = {}
        self._items = 0
        self.hits = 0
        """Requests produced by concatenation."""
        self.learned = 0
        """Shapes learned (each two probe renders)."""
        self.opaque = 0
        """Shapes found opaque (their requests render with jinja)."""
        self.refused = 0
        """Requests of a known shape whose contents answered a predicate otherwise."""
        self.mismatched = 0
        """Shapes whose first request's concatenation differed from jinja's render of it
        (made opaque, logged): a template this module's checks missed."""
        self._unchecked: set[tuple[Any, ...]] = set()
        self._futile = {False: [0, 0], True: [0, 0]}
        """Per kind (tools declared or not): opaque shapes in a row, requests to skip."""
        self.skipped = 0
        """Requests left to jinja unread, their kind's shapes having been opaque."""
        self._seen: dict[int, None] = {}
        """Hashes of shapes seen once and not learned (first in, first out)."""
        self.first_seen = 0
        """Requests of a shape not seen before, rendered with jinja (a shape is learned
        the second time it comes: one seen only once never costs the probe renders)."""
        """Shapes learned whose first concatenation is still to be checked."""

    def render(
        self, roles: tuple[str, ...], contents: list[str], variables: Mapping[str, Any]
    ) -> str | None:
        """The prompt for a plain chat (:func:`.messages.plain_chat`: its messages' roles
        and contents, as the template sees them) with the template's other ``variables``
        (as ``render_inputs`` gives them), or None: render this request with jinja."""
        fingerprint = []
        for name, value in variables.items():
            if value is not None and type(value) not in (str, bool, int):
                return None
            fingerprint.append((name, type(value), value))
        return self._serve(
            (roles, tuple(fingerprint)),
            _plain_probes(roles),
            contents,
            variables,
            lambda: [{"role": r, "content": c} for r, c in zip(roles, contents, strict=True)],
        )

    def render_chat(self, chat: Sequence[Any], variables: Mapping[str, Any]) -> str | None:
        """The prompt for any conversation whose messages hold only strings, ``None`` and
        tool calls (``{id, type, function: {name, arguments: object}}``) as vLLM prepares
        them, with ``tools`` declared or not: an agent loop's request. Every string is a
        slot (a probe while learning), a tool call's ``arguments`` the slot of its
        ``tojson`` text; the shape is the messages' keys in order with the roles, which
        strings are empty, the tools' JSON (their digest) and the other ``variables``.
        None: render this request with jinja."""
        if not self.trying(variables.get("tools") is not None):
            return None
        values: list[str] = []
        signature = _signature(chat, values, self.tojson)
        if signature is None:
            return None
        return self.render_slots(signature, values, variables, lambda: chat)

    def trying(self, tools: bool) -> bool:
        """Whether to read a request of this kind (``tools`` declared or not) into slots
        at all. A kind whose last :data:`FUTILE_AFTER` shapes were all opaque (a template
        that cuts tool call ids or dumps whole calls, as Mistral's does) is left to jinja
        for a while, since reading its slots is a pass over its messages for nothing: 16
        requests, doubling at each opaque try after that up to :data:`FUTILE_MAX`; a
        request of that kind served by concatenation ends the streak."""
        state = self._futile[tools]
        if state[1]:
            state[1] -= 1
            self.skipped += 1
            return False
        return True

    def _opaque_seen(self, tools: bool, opaque: bool) -> None:
        state = self._futile[tools]
        if not opaque:
            state[0] = 0
            return
        state[0] += 1
        if state[0] >= FUTILE_AFTER:
            state[1] = min(FUTILE_MAX, 16 << min(state[0] - FUTILE_AFTER, 16))

    def render_slots(
        self,
        signature: tuple[Any, ...],
        values: list[str],
        variables: Mapping[str, Any],
        chat: Callable[[], Sequence[Any]],
    ) -> str | None:
        """:meth:`render_chat` from a conversation's signature and slot values (as
        ``.messages.agent_slots`` reads them from a request); ``chat``: its prepared
        messages, for the check of a shape's first concatenation."""
        fingerprint: list[Any] = []
        tools_key = None
        for name, value in variables.items():
            if name == "tools" and value is not None:
                try:
                    tools_key = xxhash.xxh3_128_digest(orjson.dumps(value))
                except (TypeError, orjson.JSONEncodeError):
                    return None
            elif value is not None and type(value) not in (str, bool, int):
                return None
            else:
                fingerprint.append((name, type(value), value))
        key = (_CHAT, signature, tuple(fingerprint), tools_key)
        return self._serve(
            key, _chat_probes(signature), values, variables, chat, kind=tools_key is not None
        )

    def _serve(
        self,
        key: tuple[Any, ...],
        probes: _ProbeChat,
        values: list[str],
        variables: Mapping[str, Any],
        chat: Callable[[], Sequence[Any]],
        kind: bool | None = None,
    ) -> str | None:
        """The request ``key`` names, from its slot ``values``: its shape's pieces and
        values joined (the shape learned with ``probes`` when new), or None when the
        shape is opaque or a value answers a question otherwise. ``chat``: the request's
        messages as the template sees them, for the check of a shape's first use;
        ``kind``: the request's kind for :meth:`trying` (None: not tracked). One lookup
        of ``key`` on the way to a known shape (a large signature's hash is not cached:
        some 5 us for an 8k-token agent loop)."""
        if self._date_formats:
            self._check_date()
        shape = self._shapes.get(key)
        if shape is None:
            seen, digest = self._seen, hash(key)
            if digest not in seen:
                seen[digest] = None
                if len(seen) > MAX_SEEN:
                    del seen[next(iter(seen))]
                self.first_seen += 1
                return None
            del seen[digest]
            shape = self._learn(key, probes, len(values), variables)
        if shape is _OPAQUE:
            if kind is not None:
                self._opaque_seen(kind, True)
            return None
        for check in shape.checks:
            if not check.holds(values):
                self.refused += 1
                return None
        text = shape.text(values)
        if (
            self._unchecked
            and key in self._unchecked
            and not self._agrees(key, text, chat(), variables)
        ):
            return None
        if kind is not None:
            self._opaque_seen(kind, False)
        self.hits += 1
        return text

    def _agrees(
        self,
        key: tuple[Any, ...],
        text: str,
        chat: Sequence[Any],
        variables: Mapping[str, Any],
    ) -> bool:
        """A shape's first concatenation, checked against jinja's render of the same
        request (one more render per shape, once): a safety net under the probes."""
        self._unchecked.discard(key)
        try:
            same = str(self._template.render(messages=chat, **variables)) == text
        except Exception:
            same = False
        if not same:
            self.mismatched += 1
            self.opaque += 1
            self._shapes[key] = _OPAQUE
            if self.mismatched == 1:
                log.warning(
                    "conversation keys: a chat template's output differs from the "
                    "pieces learned for its conversation shape (roles %s); such shapes "
                    "render with jinja (logged once)",
                    [m.get("role") if isinstance(m, dict) else None for m in chat],
                )
        return same

    def _today(self) -> tuple[str, ...]:
        clock = self._clock
        return tuple(clock(f) for f in self._date_formats)

    def _check_date(self) -> None:
        """Drop every shape once the date the template shows is another (their pieces
        hold the old one); the next requests learn them again."""
        today = self._today()
        if today != self._dates:
            self._dates = today
            for key in self._shapes:
                self._seen[hash(key)] = None
            self._shapes.clear()
            self._unchecked.clear()
            self._items = 0
            self.date_changes += 1

    def stats(self) -> dict[str, int]:
        return {
            "shapes": len(self._shapes),
            "items": self._items,
            "hits": self.hits,
            "learned": self.learned,
            "opaque": self.opaque,
            "refused": self.refused,
            "mismatched": self.mismatched,
            "date_changes": self.date_changes,
            "first_seen": self.first_seen,
            "skipped": self.skipped,
        }

    def _learn(
        self,
        key: tuple[Any, ...],
        probes: _ProbeChat,
        count: int,
        variables: Mapping[str, Any],
    ) -> _Shape:
        """Render the shape with both probe sets (``probes`` builds the messages, slots
        ``0..count-1``) and compile what they agree on, or make the shape opaque."""
        a = self._probe_render(probes, variables, _text_a)
        b = self._probe_render(probes, variables, _text_b)
        shape = _OPAQUE
        if a is not None and b is not None:
            program_a = _program(a[0], _FIND_A, count)
            if (
                program_a is not None
                and program_a == _program(b[0], _FIND_B, count)
                and a[1] == b[1]
            ):
                shape = _Shape.of(program_a, a[1], count)
        self.learned += 1
        if shape is _OPAQUE:
            self.opaque += 1
        self._keep(key, shape)
        return shape

    def _probe_render(
        self, probes: _ProbeChat, variables: Mapping[str, Any], text: Callable[[int], str]
    ) -> tuple[str, list[_Predicate]] | None:
        trace = _Trace()
        chat = probes(lambda i: _probe(text(i), _text_a(i), i, trace))
        try:
            out = str(self._template.render(messages=chat, **variables))
        except Exception:  # a template that raises for this shape renders with jinja
            return None
        if trace.opaque:
            return None
        return out, trace.predicates

    def _keep(self, key: tuple[Any, ...], shape: _Shape) -> None:
        size = shape.size + 1
        if size > MAX_ITEMS:
            return
        shapes = self._shapes
        while shapes and (len(shapes) >= MAX_SHAPES or self._items + size > MAX_ITEMS):
            oldest = next(iter(shapes))
            self._unchecked.discard(oldest)
            old = shapes.pop(oldest)
            self._items -= old.size + 1
        shapes[key] = shape
        self._items += size
        if shape is not _OPAQUE:
            self._unchecked.add(key)


def _program(out: str, find: re.Pattern[str], count: int) -> tuple[Any, ...] | None:
    """``out`` cut at the probe texts ``find`` matches, or None when a probe's text was
    changed (a sentinel character left outside an intact probe text)."""
    program: list[Any] = []
    at = 0
    for match in find.finditer(out):
        literal = out[at : match.start()]
        if literal:
            program.append(literal)
        index = int(match.group(1))
        if index >= count:
            return None
        program.append(index)
        at = match.end()
    if at < len(out):
        program.append(out[at:])
    if any(type(p) is str and _SENTINEL_CHARS.search(p) for p in program):
        return None
    return tuple(program)


_JOINERS = frozenset(("join", "format", "format_map"))
_MARKUP_FILTERS = frozenset(("safe", "e", "escape", "forceescape", "striptags", "urlencode"))
"""Filters that build a new string from their value's text in C code, without its
methods: harmless when output as they are (the probes show any change to the text)."""
_READING_FILTERS = frozenset(
    (
        "int",
        "float",
        "round",
        "wordcount",
        "filesizeformat",
        "urlize",
        "wordwrap",
        "title",
        "random",
    )
)
"""Filters whose result depends on the text in ways no probe can show (a number parsed
from it, URLs or long lines or words found in it by regular expressions) or on nothing
(``random``): a template naming one gets no segment renderer."""


def _untraced(node: n.Node) -> bool:
    """Whether ``node`` builds a string from its operands without their methods (``~``,
    ``'...' % x``, ``join``, ``format``): a probe inside it is no longer traced."""
    if isinstance(node, n.Concat):
        return True
    if isinstance(node, n.Mod):
        return isinstance(node.left, n.Const) and isinstance(node.left.value, str)
    if isinstance(node, n.Filter):
        return node.name in _JOINERS or node.name in _MARKUP_FILTERS
    if isinstance(node, n.Call):
        return isinstance(node.node, n.Getattr) and node.node.attr in _JOINERS
    return False


def _built_for_output(ast: n.Template) -> bool:
    """Whether every untraced string building is output as it is (through ``+``, ``~``
    and conditional expressions only), so nothing can test or cut what it built."""
    shown: set[int] = set()

    def walk(expr: n.Node) -> None:
        shown.add(id(expr))
        if isinstance(expr, n.Concat):
            for sub in expr.nodes:
                walk(sub)
        elif isinstance(expr, n.Add):
            walk(expr.left)
            walk(expr.right)
        elif isinstance(expr, n.CondExpr):
            walk(expr.expr1)
            if expr.expr2 is not None:
                walk(expr.expr2)

    for output in ast.find_all(n.Output):
        for expr in output.nodes:
            walk(expr)
    return all(id(node) in shown for node in ast.find_all(n.Node) if _untraced(node))


def _date_formats(ast: n.Template) -> tuple[str, ...] | None:
    """The formats the template passes ``strftime_now``, or None when it uses that name
    otherwise (not called with one constant string) or with a format finer than a day."""
    calls = [
        c
        for c in ast.find_all(n.Call)
        if isinstance(c.node, n.Name) and c.node.name == "strftime_now"
    ]
    uses = sum(1 for name in ast.find_all(n.Name) if name.name == "strftime_now")
    formats = []
    for c in calls:
        if (
            len(c.args) != 1
            or c.kwargs
            or c.dyn_args is not None
            or c.dyn_kwargs is not None
            or not isinstance(c.args[0], n.Const)
            or not isinstance(c.args[0].value, str)
            or not _DATE_ONLY.fullmatch(c.args[0].value)
        ):
            return None
        formats.append(c.args[0].value)
    # ``strftime_now is defined`` (Llama's guard) names it too, harmlessly
    tests = sum(
        1
        for t in ast.find_all(n.Test)
        if t.name == "defined" and isinstance(t.node, n.Name) and t.node.name == "strftime_now"
    )
    if uses != len(calls) + tests:
        return None
    return tuple(dict.fromkeys(formats))


def segment_renderer(ast: n.Template, template: jinja2.Template) -> SegmentRenderer | None:
    """A segment renderer for ``template`` (compiled from ``ast``), or None when its
    output may change between renders of the same request (random text, the time of
    day) or it tests or cuts a string built without the probes' methods (see the
    header). The date (``strftime_now`` of a format naming the day at the finest) is a
    learned piece like any other, and every shape is learned anew when it changes."""
    for name in ast.find_all(n.Name):
        if name.name in _RANDOM_GLOBALS:
            return None
    formats = _date_formats(ast)
    if formats is None:
        return None
    for node in ast.find_all(n.Filter):
        if node.name in _READING_FILTERS:
            return None
    if not _built_for_output(ast):
        return None
    return SegmentRenderer(template, formats)
