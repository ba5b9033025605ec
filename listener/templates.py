"""Chat templates: where the router's anchor text sits inside a detokenized prompt.

The router keys a request on its anchor (``bus.prefix_key.anchor_text``): the first
non-empty system/developer message ("S"), else the first non-empty message ("M"). The
engine only shows the listener token IDs; detokenized, they are the *rendered* prompt,
so the listener must undo the chat template to get the same bytes back. Content-part
arrays are rendered by the engine with their text parts joined by ``"\\n"``, which is
exactly what ``bus.prefix_key`` hashes, so no special handling is needed here.

A template is a turn grammar, either

* generic: ``turn_start + role + role_end + content + end`` (ChatML, Llama 3), so any
  role is recognised; or
* markers: ``system_start`` / ``user_start`` + content + ``end`` (configurable forms);
  such a template cannot see other roles, so its "M" anchor is the first *user* turn.

``locate_anchor`` scans turns in order and decides on the first non-empty one that is
not an injected default: a system turn gives "S", any other turn "M". Rules that keep the
result equal to the router's key:

* a system turn whose content equals the template's ``default_system_prompt`` (Qwen2.5
  injects one when the request had none) or is empty after stripping the template's own
  ``system_preamble`` (Llama 3.1's "Cutting Knowledge Date/Today Date" lines) is absent;
* when the anchor's end marker is not in the text yet, the answer is NEED_MORE, unless
  the content seen so far already reaches ``max_prefix_length`` bytes: the key only
  hashes that many bytes, so it is computable (a trailing partial end marker and a
  trailing U+FFFD from a split multi-byte character are not counted);
* ``complete=True`` says the text cannot grow, so NEED_MORE becomes NO_ANCHOR.

Known differences from the router, inherent in reading rendered text: Llama 3 trims
message content, so anchors with leading/trailing whitespace do not match; a system
message placed *after* the first user message is keyed "S" by the router but "M" here;
a literal Llama 3.1 preamble inside a user's own system prompt is stripped.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Literal

from bus.prefix_key import DEFAULT_MAX_PREFIX_LENGTH

__all__ = [
    "CHATML",
    "LLAMA3",
    "NEED_MORE_TOKENS",
    "NO_ANCHOR",
    "QWEN2_5",
    "TEMPLATES",
    "ChatTemplate",
    "Located",
    "get_template",
    "locate_anchor",
    "marker_template",
]

_MAX_ROLE_CHARS = 64
"""A role name longer than this means the text is not in the template's grammar."""


@dataclass(frozen=True, slots=True)
class ChatTemplate:
    """How one model family renders chat turns (see the module docstring)."""

    name: str
    end: str
    """Marker closing every turn's content (``<|im_end|>``, ``<|eot_id|>``)."""
    turn_start: str | None = None
    role_end: str | None = None
    system_start: str | None = None
    user_start: str | None = None
    bos: tuple[str, ...] = ()
    """Optional text before the first turn (``<|begin_of_text|>``)."""
    system_roles: frozenset[str] = frozenset(("system", "developer"))
    system_preamble: re.Pattern[str] | None = None
    """Text the template itself puts at the start of a system turn; stripped."""
    preamble_leads: tuple[str, ...] = ()
    """Fixed starts of ``system_preamble``: a partial preamble means NEED_MORE."""
    default_system_prompt: str | None = None
    """System prompt the template injects when the request had none: treated as absent."""
    _markers: tuple[tuple[str, str], ...] = field(default=(), init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.end:
            raise ValueError("a chat template needs an end marker")
        generic = self.turn_start is not None and self.role_end is not None
        markers = tuple(
            (m, role) for m, role in ((self.system_start, "system"), (self.user_start, "user")) if m
        )
        if generic == bool(markers):
            raise ValueError("give either turn_start+role_end or system_start/user_start")
        object.__setattr__(self, "_markers", markers)

    def with_default_system_prompt(self, prompt: str | None) -> ChatTemplate:
        return replace(self, default_system_prompt=prompt)


def marker_template(
    system_start: str,
    user_start: str,
    end: str,
    *,
    name: str = "markers",
    bos: tuple[str, ...] = (),
    default_system_prompt: str | None = None,
) -> ChatTemplate:
    """A template given as plain markers, for model families without a built-in entry."""
    return ChatTemplate(
        name=name,
        end=end,
        system_start=system_start,
        user_start=user_start,
        bos=bos,
        default_system_prompt=default_system_prompt,
    )


CHATML = ChatTemplate(name="chatml", turn_start="<|im_start|>", role_end="\n", end="<|im_end|>")
QWEN2_5 = replace(
    CHATML,
    name="qwen2.5",
    default_system_prompt="You are Qwen, created by Alibaba Cloud. You are a helpful assistant.",
)
LLAMA3 = ChatTemplate(
    name="llama3",
    turn_start="<|start_header_id|>",
    role_end="<|end_header_id|>\n\n",
    end="<|eot_id|>",
    bos=("<|begin_of_text|>",),
    system_preamble=re.compile(
        r"(?:Environment: ipython\n)?(?:Tools: [^\n]*\n\n)?"
        r"Cutting Knowledge Date: [^\n]*\nToday Date: [^\n]*\n\n"
    ),
    preamble_leads=("Environment: ipython\n", "Tools: ", "Cutting Knowledge Date: "),
)
TEMPLATES: dict[str, ChatTemplate] = {t.name: t for t in (CHATML, QWEN2_5, LLAMA3)}


def get_template(name: str) -> ChatTemplate:
    try:
        return TEMPLATES[name]
    except KeyError:
        raise ValueError(f"unknown chat template {name!r}; known: {sorted(TEMPLATES)}") from None


@dataclass(frozen=True, slots=True)
class Located:
    """Outcome of ``locate_anchor``.

    ``end`` is the offset in the text at which the anchor became decidable (just past
    its end marker, or where its content reached ``max_prefix_length`` bytes); the chain
    tracker uses it to guess which block holds that point.
    """

    kind: Literal["found", "need_more", "no_anchor"]
    tag: Literal["S", "M"] | None = None
    content: str | None = None
    end: int = 0


NEED_MORE_TOKENS = Located("need_more")
NO_ANCHOR = Located("no_anchor")


def _partial_tail(text: str, marker: str) -> int:
    """Length of the longest proper prefix of ``marker`` that ``text`` ends with."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


def _decidable_prefix(content: str, limit: int | None) -> int | None:
    """Chars of a partial ``content`` that reach ``limit`` UTF-8 bytes, or None if fewer."""
    if limit is None:
        return None
    total = 0
    for i, ch in enumerate(content):
        o = ord(ch)
        total += 1 if o < 0x80 else 2 if o < 0x800 else 3 if o < 0x10000 else 4
        if total >= limit:
            return i + 1
    return None


def _strip_preamble(content: str, template: ChatTemplate, *, partial: bool) -> str | None:
    """System content without the template's own preamble; None when it may be incomplete."""
    pattern = template.system_preamble
    if pattern is None:
        return content
    m = pattern.match(content)
    if m:
        return content[m.end() :]
    if partial and any(
        lead.startswith(content) or content.startswith(lead) for lead in template.preamble_leads
    ):
        return None
    return content


def _first_turn(text: str, pos: int, template: ChatTemplate) -> tuple[str, int] | str | None:
    """(role, content start) of the turn at ``pos``; "need" if cut short; None if absent."""
    rest = text[pos:]
    if template._markers:
        for marker, role in template._markers:
            if rest.startswith(marker):
                return role, pos + len(marker)
        if any(marker.startswith(rest) for marker, _ in template._markers):
            return "need"
        return None
    assert template.turn_start is not None
    if not rest.startswith(template.turn_start):
        return "need" if template.turn_start.startswith(rest) else None
    return _role_at(text, pos + len(template.turn_start), template)


def _next_turn(text: str, pos: int, template: ChatTemplate) -> tuple[str, int] | str | None:
    """The next turn at or after ``pos`` (anything between turns is skipped)."""
    if template._markers:
        best: tuple[int, str, str] | None = None
        for marker, role in template._markers:
            i = text.find(marker, pos)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, marker, role)
        if best is None:
            return "need"
        return best[2], best[0] + len(best[1])
    assert template.turn_start is not None
    i = text.find(template.turn_start, pos)
    if i < 0:
        return "need"
    return _role_at(text, i + len(template.turn_start), template)


def _role_at(text: str, start: int, template: ChatTemplate) -> tuple[str, int] | str | None:
    assert template.role_end is not None
    r = text.find(template.role_end, start, start + _MAX_ROLE_CHARS + len(template.role_end))
    if r < 0:
        return "need" if len(text) - start <= _MAX_ROLE_CHARS + len(template.role_end) else None
    return text[start:r], r + len(template.role_end)


def locate_anchor(
    text: str,
    template: ChatTemplate,
    *,
    complete: bool = False,
    max_prefix_length: int | None = DEFAULT_MAX_PREFIX_LENGTH,
) -> Located:
    """Find the anchor (tag and content) in a rendered, detokenized prompt.

    Args:
        text: the detokenized chain, from token 0.
        template: the engine's chat template.
        complete: the text cannot grow (chain at its cap): never answer NEED_MORE.
        max_prefix_length: the router's ``max_prefix_length``; partial content of at
            least this many bytes is enough to compute the key.

    Returns:
        ``Located("found", tag, content, end)``, ``NEED_MORE_TOKENS`` or ``NO_ANCHOR``.
        A found partial content may be longer than the limit: ``compute_prefix_key``
        truncates it.
    """
    need = NO_ANCHOR if complete else NEED_MORE_TOKENS
    pos = 0
    for b in template.bos:
        if text.startswith(b):
            pos = len(b)
            break
        if b.startswith(text):
            return need
    turn = _first_turn(text, pos, template)
    while True:
        if turn is None:
            return NO_ANCHOR
        if isinstance(turn, str):
            return need
        role, start = turn
        system = role in template.system_roles
        stop = text.find(template.end, start)
        if stop < 0:
            raw = text[start:]
            raw = raw[: len(raw) - _partial_tail(raw, template.end)].rstrip("\ufffd")
            return _partial(raw, start, system, template, max_prefix_length) or need
        content = text[start:stop]
        if system:
            content = _strip_preamble(content, template, partial=False) or ""
            if content == template.default_system_prompt:
                content = ""
        if content:
            return Located("found", "S" if system else "M", content, stop + len(template.end))
        turn = _next_turn(text, stop + len(template.end), template)


def _partial(
    content: str, start: int, system: bool, template: ChatTemplate, limit: int | None
) -> Located | None:
    """Decide on a turn whose end marker is not in the text yet; None means NEED_MORE."""
    offset = start
    if system:
        stripped = _strip_preamble(content, template, partial=True)
        if stripped is None:
            return None
        offset += len(content) - len(stripped)
        content = stripped
        default = template.default_system_prompt
        if default is not None and default.startswith(content):
            return None
    if not content:
        return None
    cut = _decidable_prefix(content, limit)
    if cut is None:
        return None
    return Located("found", "S" if system else "M", content, offset + cut)
