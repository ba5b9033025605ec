"""Token ids back to the exact bytes of the prompt text: a table per ``tokenizer.json``.

The conversation keys (``bus.prompt_chain``) are computed over the bytes of the rendered
prompt. The router has the text; the listener has the token ids of the engine's stored
blocks. Concatenating each token's *raw bytes* gives the text back exactly, without a
detokenize call, for the tokenizer families this module accepts (anything else is refused
at start, naming the file, rather than keyed wrongly):

* **byte-level BPE** (GPT-2, Llama 3, Qwen): every vocabulary piece is spelled in GPT-2's
  ``bytes_to_unicode`` alphabet (each of the 256 bytes as one printable character), so
  mapping the alphabet back gives the piece's bytes, including half of a multi-byte
  character when a split falls inside one. A ``ByteLevel`` pre-tokenizer that adds a
  prefix space is refused (it cannot be undone: " x" and "x" tokenize alike).
* **SentencePiece-style BPE** (Llama 2, Mistral, Gemma converted to ``tokenizer.json``):
  ``▁`` (U+2581) stands for a space and ``<0xNN>`` pieces (``byte_fallback``) for single
  bytes. The *leading-space rule*: the tokenizer may prepend a ``▁`` that is not in the
  text, and the table's reader drops it again (:meth:`TokenBytes.convert`):

  - a ``Prepend("▁")`` normalizer (the "legacy" conversion) prepends to every run of
    text, i.e. at the start and after every added token the tokenizer splits on
    (``normalized: false``): the first token of each run loses one leading space;
  - a ``Metaspace`` pre-tokenizer with ``prepend_scheme: first`` prepends only to text at
    offset 0: the first token of a chain loses one leading space unless it is an added
    token (exact unless the text itself starts with a space, which chat templates never
    render: they start with a BOS token);
  - ``prepend_scheme: never`` (and no ``Prepend``) prepends nothing;
  - ``prepend_scheme: always`` (or the old ``add_prefix_space: true``) is refused: it
    prepends only when the run does not already start with a space, so "<s> x" and "<s>x"
    tokenize alike.

  Text that contains U+2581 itself reads back as a space (the engine's own detokenizer
  does the same).

Added and special tokens are the UTF-8 of their ``content`` (a chat template renders them
as text and the engine tokenizes that text into the one id). The text the table gives back
is the prompt *after the tokenizer's normalizer*; only Unicode normal forms (NFC, NFD,
NFKC, NFKD; Qwen's is NFC) are accepted besides the space handling above, so the router can
apply the same one to its rendering. Any other normalizer (lowercasing, accent stripping,
SentencePiece's precompiled maps) is refused.

Memory: one ``bytes`` object per id (about 7 MB for Qwen's 151,669 ids), built once per file
and shared by every source that names it (:func:`load_token_bytes` caches by path, size and
modification time).
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from itertools import accumulate
from pathlib import Path
from typing import Any, Literal

import orjson

__all__ = [
    "PrependRule",
    "TokenBytes",
    "TokenizerFileError",
    "UnmappedToken",
    "build_token_bytes",
    "load_token_bytes",
]

PrependRule = Literal["never", "first", "segment"]
"""Where the tokenizer prepends a space that is not in the text: nowhere, at the start of
the text, or at the start of every run of text between split-on added tokens."""

_UNICODE_FORMS = frozenset(("NFC", "NFD", "NFKC", "NFKD"))
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>\Z")
_SPACE = "\u2581"


class TokenizerFileError(ValueError):
    """A ``tokenizer.json`` that cannot be read or is of a kind this module refuses; the
    message names the file and says why."""


class UnmappedToken(ValueError):
    """A token id the table has no bytes for (outside the vocabulary), or a token where the
    leading-space rule expects a space and finds none."""


def _byte_decoder() -> dict[str, int]:
    """GPT-2's ``bytes_to_unicode``, inverted: alphabet character -> the byte it spells."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("\xa1"), ord("\xac") + 1))
        + list(range(ord("\xae"), ord("\xff") + 1))
    )
    chars = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


class TokenBytes:
    """The bytes each token id contributes to the text, and the leading-space rule.

    ``table[id]`` is ``None`` for ids the file does not define. ``splits[id]`` is 1 for an
    added token the tokenizer splits the text on (``normalized: false``): a run of text
    starts after it, which matters only under the ``segment`` prepend rule.
    """

    __slots__ = ("kind", "normalizer", "path", "prepend", "splits", "table")

    def __init__(
        self,
        path: str,
        kind: Literal["byte_level", "sentencepiece"],
        table: list[bytes | None],
        splits: bytes,
        prepend: PrependRule,
        normalizer: str | None,
    ) -> None:
        self.path, self.kind, self.table = path, kind, table
        self.splits, self.prepend, self.normalizer = splits, prepend, normalizer

    def __len__(self) -> int:
        return len(self.table)

    @property
    def stateless(self) -> bool:
        """True when a block's bytes depend on its tokens only (no leading-space rule)."""
        return self.prepend == "never"

    def join(self, ids: Sequence[int]) -> bytes:
        """The bytes of ``ids`` (stateless tables only: see :meth:`convert`).

        Raises:
            UnmappedToken: an id outside the table.
        """
        try:
            if ids and min(ids) < 0:
                raise IndexError
            return b"".join(map(self.table.__getitem__, ids))  # type: ignore[arg-type]
        except (IndexError, TypeError):
            raise UnmappedToken("token id outside the vocabulary") from None

    def convert(self, ids: Sequence[int], at_start: bool) -> tuple[bytes, bool]:
        """The bytes of ``ids`` where ``at_start`` says whether a prepended space may open
        the first of them (the start of the chain, or after a split-on added token); returns
        the bytes and the same flag for the token after the last.

        Raises:
            UnmappedToken: an id outside the table, or a run that does not open with the
                space the rule says the tokenizer put there.
        """
        if self.prepend == "never":
            return self.join(ids), False
        table, splits, segment = self.table, self.splits, self.prepend == "segment"
        out: list[bytes] = []
        for i in ids:
            if not 0 <= i < len(table):
                raise UnmappedToken("token id outside the vocabulary")
            piece = table[i]
            if piece is None:
                raise UnmappedToken("token id outside the vocabulary")
            if splits[i]:
                out.append(piece)
                at_start = segment
                continue
            if at_start:
                if not piece.startswith(b" "):
                    raise UnmappedToken("a run of text does not open with its prepended space")
                piece = piece[1:]
                at_start = False
            out.append(piece)
        return b"".join(out), at_start

    def ends(self, ids: Sequence[int], at_start: bool) -> list[int]:
        """Cumulative byte offsets: ``ends[k]`` = bytes of ``ids[: k + 1]`` (as ``convert``)."""
        if self.prepend == "never":
            return list(accumulate(map(len, map(self.table.__getitem__, ids))))  # type: ignore[arg-type]
        total = 0
        out: list[int] = []
        for i in ids:
            data, at_start = self.convert((i,), at_start)
            total += len(data)
            out.append(total)
        return out


def _fail(path: str, why: str) -> TokenizerFileError:
    return TokenizerFileError(f"tokenizer {path}: {why}")


def _components(node: Any, key: str) -> list[dict[str, Any]]:
    """A normalizer/pre-tokenizer/decoder and the members of its ``Sequence``s, flattened."""
    if not isinstance(node, dict):
        return []
    if node.get("type") == "Sequence":
        out: list[dict[str, Any]] = []
        for member in node.get(key) or ():
            out += _components(member, key)
        return out
    return [node]


def _normalizer(path: str, spec: Any) -> tuple[str | None, bool, bool]:
    """(Unicode form or None, has a Prepend("▁"), has Replace(" " -> "▁"))."""
    form: str | None = None
    prepend = replace = False
    for n in _components(spec, "normalizers"):
        kind = n.get("type")
        if kind in _UNICODE_FORMS:
            if form is not None and form != kind:
                raise _fail(path, f"two Unicode normalizers ({form}, {kind})")
            form = kind
        elif kind == "Prepend" and n.get("prepend") == _SPACE:
            prepend = True
        elif kind == "Replace" and n.get("pattern") == {"String": " "}:
            if n.get("content") != _SPACE:
                raise _fail(path, "a Replace normalizer of spaces by anything but U+2581")
            replace = True
        else:
            raise _fail(
                path,
                f"normalizer {kind!r} is not supported (only NFC/NFD/NFKC/NFKD and the "
                "SentencePiece space handling keep the text recoverable from the tokens)",
            )
    return form, prepend, replace


def build_token_bytes(spec: dict[str, Any], path: str = "<tokenizer.json>") -> TokenBytes:
    """The table of an already-parsed ``tokenizer.json`` (``path`` names it in errors).

    Raises:
        TokenizerFileError: the tokenizer is of a kind whose tokens do not spell the text.
    """
    model = spec.get("model")
    if not isinstance(model, dict):
        raise _fail(path, "no model section")
    mtype = model.get("type")
    if mtype != "BPE":
        raise _fail(path, f"model type {mtype!r} is not supported (only BPE)")
    vocab = model.get("vocab")
    if not isinstance(vocab, dict):
        raise _fail(path, "the BPE model has no vocabulary")
    form, prepend_norm, replace_norm = _normalizer(path, spec.get("normalizer"))
    pre = _components(spec.get("pre_tokenizer"), "pretokenizers")
    dec = _components(spec.get("decoder"), "decoders")
    byte_level = any(p.get("type") == "ByteLevel" for p in pre + dec)
    metaspace = [p for p in pre if p.get("type") == "Metaspace"]
    sp_decoder = any(
        d.get("type") == "Metaspace"
        or (d.get("type") == "Replace" and d.get("pattern") == {"String": _SPACE})
        for d in dec
    )
    kind: Literal["byte_level", "sentencepiece"]
    prepend: PrependRule = "never"
    if byte_level:
        if prepend_norm or replace_norm or metaspace:
            raise _fail(path, "mixes byte-level and SentencePiece conventions")
        for p in pre:
            if p.get("type") == "ByteLevel" and p.get("add_prefix_space"):
                raise _fail(path, "ByteLevel with add_prefix_space cannot be undone")
        kind = "byte_level"
        decoder = _byte_decoder()

        def piece_bytes(piece: str) -> bytes | None:
            try:
                return bytes(decoder[c] for c in piece)
            except KeyError:
                return None

    elif metaspace or replace_norm or sp_decoder:
        kind = "sentencepiece"
        if metaspace:
            m = metaspace[0]
            if m.get("replacement", _SPACE) != _SPACE:
                raise _fail(path, "a Metaspace replacement other than U+2581")
            scheme = m.get("prepend_scheme")
            if scheme is None:
                scheme = "always" if m.get("add_prefix_space", True) else "never"
            if scheme == "always":
                raise _fail(
                    path,
                    "Metaspace prepend_scheme always cannot be undone (it prepends a space "
                    'only where the text has none, so "<s> x" and "<s>x" tokenize alike)',
                )
            if scheme not in ("first", "never"):
                raise _fail(path, f"unknown Metaspace prepend_scheme {scheme!r}")
            prepend = "first" if scheme == "first" else "never"
        if prepend_norm:
            if prepend != "never":
                raise _fail(path, "prepends a space twice (normalizer and pre-tokenizer)")
            prepend = "segment"
        fallback = bool(model.get("byte_fallback"))

        def piece_bytes(piece: str) -> bytes | None:
            if fallback:
                m = _BYTE_PIECE.match(piece)
                if m:
                    return bytes((int(m.group(1), 16),))
            return piece.replace(_SPACE, " ").encode()

    else:
        raise _fail(path, "neither byte-level nor SentencePiece-style BPE: tokens lose the text")

    added = spec.get("added_tokens") or []
    ids = [i for i in vocab.values() if type(i) is int and i >= 0]
    ids += [t["id"] for t in added if isinstance(t, dict) and type(t.get("id")) is int]
    size = max(ids, default=-1) + 1
    if size > 1 << 24:
        raise _fail(path, f"token id {size - 1} is implausibly large")
    table: list[bytes | None] = [None] * size
    for piece, i in vocab.items():
        if type(i) is int and i >= 0 and isinstance(piece, str):
            table[i] = piece_bytes(piece)
    splits = bytearray(size)
    for t in added:
        if not isinstance(t, dict) or type(t.get("id")) is not int or t["id"] < 0:
            continue
        content = t.get("content")
        if not isinstance(content, str):
            continue
        table[t["id"]] = content.encode()
        if not t.get("normalized", False):
            splits[t["id"]] = 1
    return TokenBytes(path, kind, table, bytes(splits), prepend, form)


_cache: dict[tuple[str, int, int], TokenBytes] = {}


def load_token_bytes(path: str | os.PathLike[str]) -> TokenBytes:
    """The table of the ``tokenizer.json`` at ``path``, built once per file version.

    Raises:
        TokenizerFileError: the file is missing, unreadable, not JSON, or of a refused kind.
    """
    name = str(path)
    try:
        real = os.path.realpath(name)
        st = os.stat(real)
    except OSError as exc:
        raise _fail(name, f"cannot read it: {exc.strerror or exc}") from None
    key = (real, st.st_size, st.st_mtime_ns)
    cached = _cache.get(key)
    if cached is not None:
        return cached
    try:
        spec = orjson.loads(Path(real).read_bytes())
    except OSError as exc:
        raise _fail(name, f"cannot read it: {exc.strerror or exc}") from None
    except orjson.JSONDecodeError as exc:
        raise _fail(name, f"not JSON: {exc}") from None
    if not isinstance(spec, dict):
        raise _fail(name, "not a tokenizer.json object")
    table = build_token_bytes(spec, name)
    for k in [k for k in _cache if k[0] == real]:
        del _cache[k]  # an older version of the same file
    _cache[key] = table
    return table
