"""Byte-exact msgpack encoding of vLLM / SGLang KV-event batches (listener/ENGINE_FORMATS.md §2–§3).

The engines encode with msgspec; this reproduces its output with plain ``msgpack`` for each
supported release. What makes the bytes equal:

* ``EventBatch`` is always an array ``[ts, events, dp_rank]`` (``[ts, events]`` in vLLM
  0.9.0); ``ts`` is a float64 (``cb``), containers use minimal headers, ints the smallest
  msgpack int type (unsigned for ``>= 0``), str/bin the smallest str/bin type: msgspec and
  ``msgpack.packb(use_bin_type=True)`` agree on all of these.
* **Encoding A** (``array_like``): ``[tag, field1, field2, ...]`` with every field of the
  release present (msgspec ignores ``omit_defaults`` for array-like structs).
* **Encoding M** (``omit_defaults``): ``{"type": tag, field: value, ...}`` in declaration
  order; fields that have a default (all ``None``) are left out while ``None``. msgspec
  writes the map header for the struct's *total* field count (tag included) and patches the
  count afterwards, so a struct with 16+ possible entries (vLLM 0.33 ``BlockStored``: 15
  fields + tag) gets a ``map16`` header (``de 00 0b``) even when only 11 entries are sent.
* SGLang 0.5.18–0.5.19 sends a salted block as ``BlockStoredWithMetadata``: the A array
  plus an 8th element ``{"cache_salt": salt}``; 0.5.20+ (M) has a ``cache_salt`` key.
* vLLM ≥0.17 carries the salt only as ``extra_keys[0] == [salt]`` on a request's first
  block; ``extra_keys`` is ``[nil] * n_blocks`` otherwise. Earlier releases do not show it.

Field tables (tag first, then by position / declaration order):

===============  =====================================================================
vllm-0.9.0       Stored: hashes parent tokens block_size lora_id; Removed: hashes
vllm-0.10.2      + medium (both)
vllm-0.23.0      Stored + lora_name extra_keys group_idx kv_cache_spec_kind
                 kv_cache_spec_sliding_window; Removed + group_idx
vllm-0.24        as 0.23.0, map encoding
vllm-0.33        Stored + locality ownership session_id lookahead_token_ids;
                 Removed + locality ownership; map encoding
sglang-0.5.19    Stored: hashes parent tokens block_size lora_id medium [metadata];
                 Removed: hashes medium
sglang-0.5.23    Stored: ... medium cache_salt session_id lora_name; map encoding
===============  =====================================================================

The values this simulator sends: ``lora_id``/``lora_name`` nil, ``medium`` ``"GPU"``,
``group_idx`` 0, ``kv_cache_spec_kind`` ``"full_attention"``, everything newer nil.
"""

from __future__ import annotations

import operator
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import msgpack

__all__ = ["FORMATS", "EventEncoder", "WireFormat", "get_format"]

_packb = msgpack.Packer(use_bin_type=True, autoreset=True).pack
_F64 = struct.Struct(">Bd")

_VLLM_10 = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium")
_VLLM_23 = (
    *_VLLM_10,
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
)
_VLLM_23_DEFAULTED = frozenset(_VLLM_23[7:])
_VLLM_33 = (*_VLLM_23, "locality", "ownership", "session_id", "lookahead_token_ids")
_SGLANG_23 = (*_VLLM_10, "cache_salt", "session_id", "lora_name")


@dataclass(frozen=True, slots=True)
class WireFormat:
    """One engine release's event layout."""

    name: str
    engine: Literal["vllm", "sglang"]
    encoding: Literal["A", "M"]
    stored_fields: tuple[str, ...]
    removed_fields: tuple[str, ...]
    #: Fields with a default (nil): omitted in encoding M while nil.
    defaulted: frozenset[str]
    #: ``EventBatch`` has the third element ``dp_rank`` (vLLM ≥0.9.1, SGLang).
    has_dp_rank: bool
    #: Replay replies carry the topic frame (vLLM ≥0.26, SGLang ≥0.5.22).
    replay_topic: bool
    #: How a request's cache_salt shows: not at all, vLLM ``extra_keys``, SGLang's metadata
    #: element (A) or ``cache_salt`` key (M).
    salt: Literal["none", "extra_keys", "metadata", "named"]
    #: Published hash type: vLLM 0.9 Python ``hash()`` (signed), vLLM ≥0.10.2 u64 or bytes,
    #: SGLang signed int64.
    hash_kinds: tuple[str, ...]


FORMATS: dict[str, WireFormat] = {
    f.name: f
    for f in (
        WireFormat(
            "vllm-0.9.0", "vllm", "A", _VLLM_10[:5], ("block_hashes",),
            frozenset(), False, False, "none", ("i64",),
        ),
        WireFormat(
            "vllm-0.10.2", "vllm", "A", _VLLM_10, ("block_hashes", "medium"),
            frozenset(), True, False, "none", ("u64", "bytes"),
        ),
        WireFormat(
            "vllm-0.23.0", "vllm", "A", _VLLM_23, ("block_hashes", "medium", "group_idx"),
            _VLLM_23_DEFAULTED, True, False, "extra_keys", ("u64", "bytes"),
        ),
        WireFormat(
            "vllm-0.24", "vllm", "M", _VLLM_23, ("block_hashes", "medium", "group_idx"),
            _VLLM_23_DEFAULTED | {"group_idx"}, True, False, "extra_keys", ("u64", "bytes"),
        ),
        WireFormat(
            "vllm-0.33", "vllm", "M", _VLLM_33,
            ("block_hashes", "medium", "group_idx", "locality", "ownership"),
            frozenset(_VLLM_33[7:]) | {"group_idx", "locality", "ownership"},
            True, True, "extra_keys", ("u64", "bytes"),
        ),
        WireFormat(
            "sglang-0.5.19", "sglang", "A", _VLLM_10, ("block_hashes", "medium"),
            frozenset(), True, False, "metadata", ("i64",),
        ),
        WireFormat(
            "sglang-0.5.23", "sglang", "M", _SGLANG_23, ("block_hashes", "medium"),
            frozenset(_SGLANG_23[6:]), True, True, "named", ("i64",),
        ),
    )
}  # fmt: skip


def get_format(name: str) -> WireFormat:
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(
            f"unknown KV event format {name!r}; expected one of {', '.join(FORMATS)}"
        ) from None


def _array_header(n: int) -> bytes:
    if n < 16:
        return bytes((0x90 | n,))
    if n < 1 << 16:
        return b"\xdc" + n.to_bytes(2, "big")
    return b"\xdd" + n.to_bytes(4, "big")


# Slots of the variable parts of an event; everything else is a constant of the format.
_HASHES, _PARENT, _TOKENS, _BLOCK_SIZE, _EXTRA_KEYS, _SALT = range(6)
_SLOT_OF = {
    "block_hashes": _HASHES,
    "parent_block_hash": _PARENT,
    "token_ids": _TOKENS,
    "block_size": _BLOCK_SIZE,
}
#: Values of the constant fields (this simulator has no LoRA, one tier, one KV group).
_CONSTANTS: dict[str, Any] = {
    "lora_id": None,
    "medium": "GPU",
    "lora_name": None,
    "extra_keys": None,
    "group_idx": 0,
    "kv_cache_spec_kind": "full_attention",
    "kv_cache_spec_sliding_window": None,
    "locality": None,
    "ownership": None,
    "session_id": None,
    "lookahead_token_ids": None,
    "cache_salt": None,
}


class _Plan:
    """An event layout compiled to a bytes ``%`` template: constants with ``%b`` holes."""

    __slots__ = ("_pick", "_template")

    def __init__(self, items: list[bytes | int]) -> None:
        template = b""
        order: list[int] = []
        for x in items:
            if isinstance(x, bytes):
                template += x.replace(b"%", b"%%")
            else:
                template += b"%b"
                order.append(x)
        self._template = template
        if len(order) == 1:
            only = order[0]
            self._pick: Callable[[Sequence[bytes]], tuple[bytes, ...]] = lambda p: (p[only],)
        else:
            self._pick = operator.itemgetter(*order)

    def __call__(self, parts: Sequence[bytes]) -> bytes:
        return self._template % self._pick(parts)


def _map_header(count: int, possible: int) -> bytes:
    # msgspec reserves the header for every possible entry and patches the count in.
    if possible < 16:
        return bytes((0x80 | count,))
    return b"\xde" + count.to_bytes(2, "big")


class EventEncoder:
    """Encodes events and batches of one :class:`WireFormat`; every method returns bytes.

    Each event kind is compiled once into a *plan*: a bytes ``%`` template holding the
    constant runs (keys, tag, fixed values) with a ``%b`` hole per per-event value, so
    encoding an event is a few ``packb`` calls and one C-level format (the burst benchmark
    needs that speed).
    """

    def __init__(self, fmt: WireFormat) -> None:
        self.fmt = fmt
        self._map = fmt.encoding == "M"
        self._extra_keys = fmt.salt == "extra_keys"
        variable = dict(_SLOT_OF)
        if fmt.salt == "extra_keys":
            variable["extra_keys"] = _EXTRA_KEYS
        if fmt.salt == "named":
            variable["cache_salt"] = _SALT
        self._stored_plans = {
            salted: self._plan("BlockStored", fmt.stored_fields, variable, salted)
            for salted in (False, True)
        }
        self._removed_plan = self._plan("BlockRemoved", fmt.removed_fields, variable, False)
        self._cleared = _packb({"type": "AllBlocksCleared"} if self._map else ["AllBlocksCleared"])

    def _plan(
        self, tag: str, fields: tuple[str, ...], variable: dict[str, int], salted: bool
    ) -> _Plan:
        items: list[bytes | int] = []
        if not self._map:
            metadata = salted and self.fmt.salt == "metadata" and tag == "BlockStored"
            items.append(_array_header(1 + len(fields) + metadata) + _packb(tag))
            for f in fields:
                items.append(variable[f] if f in variable else _packb(_CONSTANTS[f]))
            if metadata:  # SGLang's BlockStoredWithMetadata
                items += [b"\x81" + _packb("cache_salt"), _SALT]
            return _Plan(items)
        count = 1
        for f in fields:
            if f in variable:
                if f == "cache_salt" and not salted:
                    continue
                items += [_packb(f), variable[f]]
            elif _CONSTANTS[f] is not None or f not in self.fmt.defaulted:
                items.append(_packb(f) + _packb(_CONSTANTS[f]))
            else:
                continue
            count += 1
        head = _map_header(count, 1 + len(fields)) + _packb("type") + _packb(tag)
        return _Plan([head, *items])

    def stored(
        self,
        block_hashes: Sequence[Any],
        parent_block_hash: Any,
        token_ids: Sequence[int],
        block_size: int,
        cache_salt: str | None = None,
        first_block: bool = False,
    ) -> bytes:
        """One ``BlockStored``. ``cache_salt`` is the request's salt; ``first_block`` says
        ``block_hashes[0]`` is the request's first block (where vLLM shows the salt)."""
        extra = b""
        if self._extra_keys:
            keys: list[Any] = [None] * len(block_hashes)
            if cache_salt and first_block:
                keys[0] = [cache_salt]
            extra = _packb(keys)
        return self.stored_packed(
            _packb(list(block_hashes)),
            _packb(parent_block_hash),
            _packb(list(token_ids)),
            _packb(block_size),
            extra,
            cache_salt,
        )

    def stored_packed(
        self,
        hashes: bytes,
        parent: bytes,
        tokens: bytes,
        block_size: bytes,
        extra_keys: bytes,
        cache_salt: str | None = None,
    ) -> bytes:
        """``stored`` from already packed values (``extra_keys`` only used by vLLM ≥0.17
        formats; pass ``b""`` otherwise)."""
        salt = _packb(cache_salt) if cache_salt else b""
        plan = self._stored_plans[bool(cache_salt) and self.fmt.salt in ("metadata", "named")]
        return plan((hashes, parent, tokens, block_size, extra_keys, salt))

    def removed(self, block_hashes: Sequence[Any]) -> bytes:
        return self._removed_plan((_packb(list(block_hashes)),))

    def cleared(self) -> bytes:
        return self._cleared

    def batch(self, ts: float, events: Sequence[bytes], dp_rank: int | None = 0) -> bytes:
        """``[ts, [events...], dp_rank]`` from already encoded events."""
        head = b"\x93" if self.fmt.has_dp_rank else b"\x92"
        parts = [head, _F64.pack(0xCB, ts), _array_header(len(events)), *events]
        if self.fmt.has_dp_rank:
            parts.append(_packb(dp_rank))
        return b"".join(parts)
