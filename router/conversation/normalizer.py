"""The tokenizer's normalizer, applied to the rendered prompt as the engine's tokenizer does.

The engine tokenizes the *normalized* prompt, so the bytes its KV blocks hold (and the
listener rebuilds from token ids) are those of the normalized text: Qwen's
``tokenizer.json`` carries ``{"type": "NFC"}``, so a client's decomposed "e\\u0301" is
cached as "\\u00e9". The router keys the same normalized text.

Supported ``normalizer`` values of ``tokenizer.json`` (HF ``tokenizers``), each exactly:

* ``null``: no normalization;
* ``NFC``, ``NFD``, ``NFKC``, ``NFKD``: ``unicodedata.normalize``;
* ``Lowercase``: per character, like the Rust ``char::to_lowercase`` that ``tokenizers``
  applies one character at a time (so a final capital sigma becomes "σ", never "ς",
  unlike ``str.lower``);
* ``Sequence`` of the above, in order.

Any other type (``Replace``, ``Prepend``, ``Strip``, ``StripAccents``, ``BertNormalizer``,
``Precompiled``, ``Nmt``, ...) is a config error naming it: rather no chain than a wrong one.
Unicode data is Python's (``unicodedata.unidata_version``); the Rust crates may be a
version ahead, which matters only for characters assigned in between.

``tokenizers`` normalizes the text *between* its added tokens that have ``normalized:
false`` (special tokens such as ``<|im_start|>``), never across them, so the slow path
cuts the text there too. The fast path is one ``unicodedata.is_normalized`` call per
form: a string in a normal form has every substring in that form, so an already
normalized prompt (nearly every prompt) is returned as is for a few microseconds per
hundred KiB.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal

__all__ = ["Normalizer", "UnsupportedNormalizer"]

_Form = Literal["NFC", "NFD", "NFKC", "NFKD"]
_FORMS: frozenset[str] = frozenset(("NFC", "NFD", "NFKC", "NFKD"))


class UnsupportedNormalizer(ValueError):
    """A ``normalizer`` this module cannot reproduce exactly (its message names the type)."""


def _lowercase(text: str) -> str:
    # str.lower is per code point except for the final-sigma rule, the one context rule
    # CPython applies; mapping capital sigma first makes it per code point throughout.
    return text.replace("\u03a3", "\u03c3").lower()


def _step(spec: Any, where: str) -> list[tuple[str, Callable[[str], str]]]:
    if not isinstance(spec, dict) or not isinstance(spec.get("type"), str):
        raise UnsupportedNormalizer(f"{where}: expected an object with a 'type', got {spec!r}")
    kind = spec["type"]
    if kind in _FORMS:
        form: _Form = kind
        return [(kind, lambda s: unicodedata.normalize(form, s))]
    if kind == "Lowercase":
        return [(kind, _lowercase)]
    if kind == "Sequence":
        steps = spec.get("normalizers")
        if not isinstance(steps, list):
            raise UnsupportedNormalizer(f"{where}: Sequence without a 'normalizers' list")
        out: list[tuple[str, Callable[[str], str]]] = []
        for i, sub in enumerate(steps):
            out.extend(_step(sub, f"{where}.normalizers[{i}]"))
        return out
    raise UnsupportedNormalizer(
        f"{where}: normalizer type {kind!r} is not supported (supported: NFC, NFD, NFKC, "
        "NFKD, Lowercase and Sequence of them)"
    )


class Normalizer:
    """One tokenizer's normalizer, ready to apply to rendered prompts."""

    __slots__ = ("_forms", "_only_forms", "_split", "_steps", "description")

    def __init__(self, spec: Any, protected: Iterable[str] = ()) -> None:
        """``spec``: the ``normalizer`` value of ``tokenizer.json``; ``protected``: the
        contents of its added tokens with ``normalized: false`` (never normalized).

        Raises:
            UnsupportedNormalizer: a normalizer type that cannot be reproduced exactly.
        """
        self._steps = [] if spec is None else _step(spec, "normalizer")
        self._forms: tuple[_Form, ...] = tuple(
            name  # type: ignore[misc]
            for name, _ in self._steps
            if name in _FORMS
        )
        self._only_forms = len(self._forms) == len(self._steps)
        tokens = sorted({t for t in protected if t}, key=len, reverse=True)
        self._split = re.compile("(" + "|".join(map(re.escape, tokens)) + ")") if tokens else None
        self.description = "+".join(name for name, _ in self._steps) or "none"

    @classmethod
    def from_tokenizer_json(cls, data: Any) -> Normalizer:
        """From a parsed ``tokenizer.json``."""
        if not isinstance(data, dict):
            raise UnsupportedNormalizer("tokenizer.json: expected a JSON object")
        added = data.get("added_tokens") or []
        protected = [
            t["content"]
            for t in added
            if isinstance(t, dict) and isinstance(t.get("content"), str) and not t.get("normalized")
        ]
        return cls(data.get("normalizer"), protected)

    @property
    def identity(self) -> bool:
        return not self._steps

    @property
    def splits_at_ascii(self) -> bool:
        """Whether two texts this leaves unchanged, the second starting with an ASCII
        character, are left unchanged together: true without steps and for normal forms
        only (an ASCII character is a stable code point: it never composes with what
        precedes it and no combining mark reorders across it)."""
        return self._only_forms

    def __call__(self, text: str) -> str:
        """``text`` as the tokenizer normalizes it before tokenizing."""
        if not self._steps:
            return text
        if self._only_forms and all(unicodedata.is_normalized(f, text) for f in self._forms):
            return text
        if self._split is None:
            return self._apply(text)
        pieces: Sequence[str] = self._split.split(text)
        # split() with one group: even indexes are the text between tokens, odd the tokens.
        return "".join(p if i % 2 else self._apply(p) for i, p in enumerate(pieces))

    def _apply(self, text: str) -> str:
        for _, fn in self._steps:
            text = fn(text)
        return text
