"""Decode one vLLM / SGLang ZMQ payload (a msgpack ``EventBatch``) into ``engine_events``.

The wire formats are described byte by byte in ``listener/ENGINE_FORMATS.md`` (§2–§5). In short:

* The payload is always a msgpack **array** ``[ts, events, dp_rank]``. vLLM 0.9.0 has no
  ``dp_rank`` (it decodes as ``None``). Elements after the third are ignored.
* Each event chooses its own encoding, and nothing else says which one it uses:

  - **A** (array, vLLM 0.9–0.23, SGLang ≤0.5.19): ``[tag, f1, f2, ...]``, with the fields by
    position. Missing trailing fields take their default and extra ones are ignored.
  - **M** (map, vLLM ≥0.24, SGLang ≥0.5.20): ``{"type": tag, name: value, ...}``. Fields equal
    to their default are left out, and unknown keys are ignored.

  Tags are ``BlockStored``, ``BlockRemoved`` and ``AllBlocksCleared``. These events are
  **skipped and counted** in ``EventBatch.skipped``, never fatal for the batch: an unknown tag,
  an event that is neither an array nor a map, or an event with a field of the wrong type.
  Those of a known tag are counted in ``EventBatch.malformed`` too (a lost block event: the
  source resyncs). Only a frame that is not an ``EventBatch`` at all raises ``DecodeError``.

Positional layout of encoding A (index 0 is the tag)::

    BlockStored   1 block_hashes  2 parent_block_hash  3 token_ids  4 block_size  5 lora_id
                  6 medium        vLLM: 7 lora_name  8 extra_keys  9 group_idx
                                  SGLang: 7 metadata map {"cache_salt": ...} (0.5.18–0.5.19)
    BlockRemoved  1 block_hashes  2 medium  3 group_idx (vLLM)

Field rules:

* Hashes go through ``normalize_hash`` semantics: an int becomes ``value mod 2**64`` (vLLM's
  uint64 and SGLang's negative int64 end up in one space), and a bin becomes bytes. One
  non-hash in ``block_hashes`` or ``parent_block_hash`` skips the event. So does an empty
  ``block_hashes``.
* ``token_ids`` must be ints in ``[0, 2**32)``. ``nil`` means "none sent" and becomes ``[]``.
  For SGLang with EAGLE, ``token_ids`` is a list of bigram pairs ``[t[i], t[i+1]]``
  (``convert_to_bigram_key``). The decoder keeps the **first element of each pair**, which
  gives back ``t[0..n-1]``, one token per KV slot, so ``block_size`` (the page length counted
  in pairs) still matches. The second element is not checked.
* ``block_size`` must be an int ≥ 1. Whether ``len(token_ids) == block_size * len(hashes)``
  holds is **not** checked here. With vLLM hybrid or sliding-window models it legitimately
  does not, so the chain tracker checks it per engine (seed: "엔진별 block_size 처리").
* ``medium``, ``lora_name`` and ``cache_salt`` must be str or nil. ``lora_id`` must be an int
  or nil. ``group_idx`` must be an int ≥ 0, and nil means 0.

How ``cache_salt`` is found:

* SGLang A: element 7, the metadata map ``{"cache_salt": s}``.
* SGLang M: the ``cache_salt`` key. (A ``cache_salt`` key in a vLLM map is honoured too.)
* vLLM: there is no named field (0.9 → 0.33). The salt is a bare string in ``extra_keys[0]``,
  the key tuple of the event's first block. vLLM builds that tuple as
  ``lora_name? + multimodal keys + cache_salt? + prompt-embeds digest?``, and puts the salt
  only in a request's first block. The rule is:

  1. Take the str elements of ``extra_keys[0]``.
  2. If ``lora_name`` is set, drop the first of them that equals it (that is the LoRA key).
  3. The salt is the **last** str that remains. The digest after it is bin, and multimodal
     keys come before it.

  Limits: from vLLM 0.19 multimodal keys are arrays ``[identifier, offset]``, so the rule is
  exact. In 0.17–0.18 they are bare strings. A first block that holds an image but no salt
  then reports the image identifier as its salt, and cannot be told apart on the wire.
  Before 0.17 the salt is not published at all. The rule does not require
  ``parent_block_hash`` to be nil, even though the engine only salts a request's first block
  (listener/ENGINE_FORMATS.md's own 0.23 example has a parent). It prefers reporting a
  salt to missing one. Consumers must therefore **verify** a salt (``bus.salt``'s HMAC)
  before trusting it. Never use it as an identity on its own.

Hostile input is bounded by the payload length:

* Frames longer than ``max_frame_bytes`` are refused before parsing. The transport should set
  ``zmq.MAXMSGSIZE`` to the same value.
* msgpack runs with per-object caps that never exceed the frame length (``_unpack_limits``).
  A header that claims more elements or bytes than that (2**31, say) fails before anything
  is allocated.
* A smaller claim that the body does not back costs preallocated slots. msgpack-python ≥1.2.4
  allocates at most 10 000 slots (80 kB) per open array ahead of time, and nests at most 1024
  deep. That transient cost is therefore at most about 82 MB for any frame, and under 3 MB
  for frames under 1 KiB. Older msgpack allocates the full claim, so require ≥1.2.4.
* Everything else is memory for objects that really are in the frame. That is inherent to
  decoding into Python objects: a 3-byte token id becomes a 36-byte int and list slot, and
  the worst case, 1-byte elements that become 30–70-byte objects, is about 40× the frame.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Callable
from typing import Any, Literal

import msgpack

from listener.engine_events import (
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    EngineEvent,
    EventBatch,
    normalize_hash,
)

__all__ = ["DEFAULT_MAX_FRAME_BYTES", "DecodeError", "Engine", "decode_batch"]

Engine = Literal["vllm", "sglang"]

DEFAULT_MAX_FRAME_BYTES = 64 << 20
"""Largest payload accepted, in bytes (64 MiB). A real batch is a few kB, and a 128k-token
prefill is under 1 MiB."""

# Per-object caps for msgpack. They apply on top of the frame length, and the smaller one wins.
_MAX_ARRAY_LEN = 1 << 24  # elements. token_ids of one event is the largest honest array
_MAX_MAP_LEN = 1 << 12  # entries. An M event has about 15 keys
_MAX_STR_LEN = 1 << 20  # bytes. Tags, media, LoRA names, salts, multimodal identifiers
_MAX_BIN_LEN = 1 << 20  # bytes. Hashes and digests are 32 bytes
_MAX_EXT_LEN = 1 << 10  # bytes. Engines send no ext types, so one is a wrong field type

_U64 = (1 << 64) - 1

# A typecode whose items are 4 bytes unsigned: ``array(_TOKEN_CODE, tokens)`` checks in C
# that every token is an int in [0, 2**32).
_TOKEN_CODE = "I" if array("I").itemsize == 4 else "L"


class DecodeError(ValueError):
    """The payload is not an engine ``EventBatch`` (the whole frame is dropped).

    Raised for input that is not msgpack, a top level that is not ``[ts, events, ...]``, a
    ``ts`` that is not a finite number, ``events`` that is not an array, a ``dp_rank`` that is
    not nil or an int ≥ 0, and sizes beyond the caps. A bad single event never raises; it is
    counted in ``EventBatch.skipped``.
    """


class _BadEvent(ValueError):
    """One event has a field of the wrong type, so the event is skipped."""


# What a malformed event can raise while it is picked apart. This covers an unknown tag or a
# missing key (KeyError), a short array (IndexError), an unhashable tag (TypeError) and a bad
# token (OverflowError). The handlers only touch decoded msgpack data, so nothing else is caught.
_SKIP = (LookupError, TypeError, ValueError, OverflowError)


def decode_batch(
    payload: bytes,
    engine: Engine,
    *,
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
) -> EventBatch:
    """Decode one ZMQ payload frame (the third frame, after topic and seq).

    Args:
        payload: the msgpack bytes of one ``EventBatch``.
        engine: ``"vllm"`` or ``"sglang"``. It selects the positional layout of encoding A
            (element 7 of ``BlockStored``) and SGLang's EAGLE bigram ``token_ids``.
        max_frame_bytes: payloads longer than this are refused without being parsed.

    Returns:
        The batch. Its events are in wire order. Events that were not understood are left
        out and counted in ``skipped``.

    Raises:
        DecodeError: the payload is not an ``EventBatch`` (see the class docstring).
        ValueError: ``engine`` is not a known engine (a caller bug, not bad input).
    """
    try:
        array_handlers, map_handlers = _HANDLERS[engine]
    except KeyError:
        raise ValueError(f"unknown engine {engine!r}; expected 'vllm' or 'sglang'") from None
    size = len(payload)
    if size > max_frame_bytes:
        raise DecodeError(f"frame of {size} bytes exceeds max_frame_bytes ({max_frame_bytes})")
    try:
        top = msgpack.unpackb(
            payload, **(_LIMITS_SMALL if size <= _SMALL_FRAME else _unpack_limits(size))
        )
    except Exception as exc:  # FormatError, StackError, ExtraData, limits, bad UTF-8, MemoryError
        raise DecodeError(f"not a msgpack frame ({type(exc).__name__}: {exc})") from exc
    if type(top) is not list or len(top) < 2:
        raise DecodeError(f"top level is not an array [ts, events, dp_rank]: {_what(top)}")
    ts = top[0]
    if type(ts) is int:
        ts = float(ts)
    elif type(ts) is not float:
        raise DecodeError(f"ts is not a number: {_what(ts)}")
    if not math.isfinite(ts):
        raise DecodeError(f"ts is not finite: {ts!r}")
    events = top[1]
    if type(events) is not list:
        raise DecodeError(f"events is not an array: {_what(events)}")
    dp_rank = top[2] if len(top) > 2 else None
    if dp_rank is not None and (type(dp_rank) is not int or dp_rank < 0):
        raise DecodeError(f"dp_rank is neither nil nor an int >= 0: {_what(dp_rank)}")

    out: list[EngineEvent] = []
    append = out.append
    skipped = malformed = 0
    for ev in events:
        kind = type(ev)
        try:
            if kind is list:
                append(array_handlers[ev[0]](ev))
            elif kind is dict:
                append(map_handlers[ev["type"]](ev))
            else:
                skipped += 1
        except _SKIP:
            skipped += 1
            malformed += _known_kind(ev, array_handlers)
    return EventBatch(ts, out, dp_rank, skipped, malformed)


def _known_kind(ev: list[Any] | dict[Any, Any], handlers: dict[Any, _Handler]) -> bool:
    """Whether a skipped event names a kind the decoder knows (it was malformed, not new)."""
    try:
        tag = ev[0] if type(ev) is list else ev.get("type")  # type: ignore[union-attr]
        return tag in handlers
    except (LookupError, TypeError):  # empty array, unhashable tag
        return False


def _what(value: object) -> str:
    """A short description for an error message. Never the repr of a big container."""
    if value is None or type(value) in (bool, int, float):
        return repr(value)
    if type(value) in (str, bytes):
        return f"{type(value).__name__} of length {len(value)}"  # type: ignore[arg-type]
    return type(value).__name__


# Frames up to this size need no explicit caps. unpackb's own caps (``len(packed)``, and half
# of that for maps) are already within ours.
_SMALL_FRAME = min(_MAX_STR_LEN, _MAX_BIN_LEN, _MAX_ARRAY_LEN, 2 * _MAX_MAP_LEN)

_LIMITS_SMALL = {
    "raw": False,
    "strict_map_key": False,
    "use_list": True,
    "max_ext_len": _MAX_EXT_LEN,
}


def _unpack_limits(size: int) -> dict[str, Any]:
    """``unpackb`` options for a frame larger than ``_SMALL_FRAME``. Every cap is at most the
    frame length, because one element takes at least one byte.

    ``unpackb`` sizes its own caps from ``len(packed)`` (a map gets half of it). For small
    frames that is already within our caps, so ``_LIMITS_SMALL`` only adds the ext cap.
    ``max_buffer_size`` belongs only to the streaming ``Unpacker``; ``unpackb`` has no such
    parameter.
    """
    return {
        "raw": False,
        "strict_map_key": False,
        "use_list": True,
        "max_str_len": min(size, _MAX_STR_LEN),
        "max_bin_len": min(size, _MAX_BIN_LEN),
        "max_array_len": min(size, _MAX_ARRAY_LEN),
        "max_map_len": min(size // 2, _MAX_MAP_LEN),
        "max_ext_len": min(size, _MAX_EXT_LEN),
    }


# --- fields ---------------------------------------------------------------------------------
# Hot path: one handler and one ``_stored`` / ``_removed`` call per event. Checks are inlined
# ``type(x) is T`` tests, which also keep bool out of int fields. The decoded lists belong to
# us, so they are normalised in place and reused rather than copied. Helpers run only on rare
# paths.


def _hash(value: object) -> BlockHash:
    """One hash, with the same result as ``normalize_hash``. Ints take the fast path."""
    if type(value) is int:
        return value & _U64  # type: ignore[return-value]
    h = normalize_hash(value)
    if h is None:
        raise _BadEvent(f"not a block hash: {_what(value)}")
    return h


def _hashes(value: object) -> list[BlockHash]:
    """``block_hashes`` normalised in place. msgpack ints lie in [-2**63, 2**64), so only
    negative ones (SGLang's signed int64) change."""
    if type(value) is not list or not value:
        raise _BadEvent("block_hashes is not a non-empty array")
    for i, h in enumerate(value):
        if type(h) is not int or h < 0:
            value[i] = _hash(h)
    return value


def _salt_from_extra_keys(extra_keys: object, lora_name: str | None) -> str | None:
    """vLLM's cache_salt: the last str in ``extra_keys[0]`` other than the LoRA name.

    The full rule and its limits are in the module docstring.
    """
    if type(extra_keys) is not list:
        raise _BadEvent("extra_keys is not an array")
    if not extra_keys or extra_keys[0] is None:
        return None
    first = extra_keys[0]
    if type(first) is not list:
        raise _BadEvent("extra_keys[0] is neither nil nor an array")
    strings = [k for k in first if type(k) is str]
    if lora_name is not None and lora_name in strings:
        strings.remove(lora_name)
    return strings[-1] if strings else None


def _stored(
    hashes: Any,
    parent: Any,
    tokens: Any,
    block_size: Any,
    lora_id: Any,
    medium: Any,
    lora_name: Any,
    salt: Any,
    extra_keys: Any,
    group: Any,
    bigrams: bool,
) -> BlockStored:
    """Check the raw fields of one BlockStored and build it; ``_BadEvent`` if one is wrong."""
    if type(hashes) is list and len(hashes) == 1:  # SGLang always, vLLM usually
        h = hashes[0]
        if type(h) is int:
            if h < 0:
                hashes[0] = h & _U64
        else:
            hashes[0] = _hash(h)
    else:
        _hashes(hashes)
    if type(parent) is int:
        if parent < 0:
            parent &= _U64
    elif parent is not None:
        parent = _hash(parent)
    if type(tokens) is list:
        if bigrams and tokens and type(tokens[0]) is list:
            # SGLang EAGLE bigram keys [[t0, t1], [t1, t2], ...]: the first of each pair is the
            # token. A non-pair raises (int: TypeError, []: IndexError) or fails the check below.
            tokens = [pair[0] for pair in tokens]
        array(_TOKEN_CODE, tokens)  # TypeError / OverflowError unless ints in [0, 2**32)
    elif tokens is None:
        tokens = []
    else:
        raise _BadEvent("token_ids is not an array")
    if group is None:
        group = 0
    if (
        type(block_size) is not int
        or block_size < 1
        or type(group) is not int
        or group < 0
        or (medium is not None and type(medium) is not str)
        or (lora_id is not None and type(lora_id) is not int)
        or (lora_name is not None and type(lora_name) is not str)
    ):
        raise _BadEvent("block_size, group_idx, medium, lora_id or lora_name is wrong")
    if salt is not None:
        if type(salt) is not str:
            raise _BadEvent("cache_salt is not a str")
    elif extra_keys is not None and (
        type(extra_keys) is not list or not extra_keys or extra_keys[0] is not None
    ):
        # vLLM >=0.17 sends [nil, ...] for blocks without extra keys: no call for those.
        salt = _salt_from_extra_keys(extra_keys, lora_name)
    return BlockStored(hashes, parent, tokens, block_size, medium, lora_id, lora_name, salt, group)


def _removed(hashes: Any, medium: Any, group: Any) -> BlockRemoved:
    if type(hashes) is list and len(hashes) == 1:  # vLLM's GPU pool: one event per hash
        h = hashes[0]
        if type(h) is int:
            if h < 0:
                hashes[0] = h & _U64
        else:
            hashes[0] = _hash(h)
    else:
        _hashes(hashes)
    if group is None:
        group = 0
    if (medium is not None and type(medium) is not str) or type(group) is not int or group < 0:
        raise _BadEvent("medium or group_idx is wrong")
    return BlockRemoved(hashes, medium, group)


# --- events ---------------------------------------------------------------------------------

_Handler = Callable[[Any], EngineEvent]


def _vllm_stored_a(ev: list[Any]) -> BlockStored:
    n = len(ev)
    if n < 10:
        if n < 5:
            raise _BadEvent("BlockStored array is too short")
        ev = ev + [None] * (10 - n)
    return _stored(
        ev[1], ev[2], ev[3], ev[4], ev[5], ev[6], ev[7], None, ev[8], ev[9], False
    )  # fmt: skip


def _sglang_stored_a(ev: list[Any]) -> BlockStored:
    n = len(ev)
    if n < 7:
        if n < 5:
            raise _BadEvent("BlockStored array is too short")
        ev = ev + [None] * (7 - n)
    _, hashes, parent, tokens, block_size, lora_id, medium = ev[:7]
    salt = None
    if n > 7 and (metadata := ev[7]) is not None:  # BlockStoredWithMetadata (0.5.18-0.5.19)
        if type(metadata) is not dict:
            raise _BadEvent("BlockStored metadata is not a map")
        salt = metadata.get("cache_salt")
    return _stored(
        hashes, parent, tokens, block_size, lora_id, medium, None, salt, None, None, True
    )  # fmt: skip


def _vllm_stored_m(ev: dict[Any, Any]) -> BlockStored:
    get = ev.get
    return _stored(
        ev["block_hashes"], get("parent_block_hash"), get("token_ids"), ev["block_size"],
        get("lora_id"), get("medium"), get("lora_name"), get("cache_salt"), get("extra_keys"),
        get("group_idx"), False,
    )  # fmt: skip


def _sglang_stored_m(ev: dict[Any, Any]) -> BlockStored:
    get = ev.get
    return _stored(
        ev["block_hashes"], get("parent_block_hash"), get("token_ids"), ev["block_size"],
        get("lora_id"), get("medium"), get("lora_name"), get("cache_salt"), None,
        get("group_idx"), True,
    )  # fmt: skip


def _removed_a(ev: list[Any]) -> BlockRemoved:
    n = len(ev)
    if n == 4:  # vLLM >=0.20
        return _removed(ev[1], ev[2], ev[3])
    return _removed(ev[1], ev[2] if n > 2 else None, ev[3] if n > 3 else None)


def _removed_m(ev: dict[Any, Any]) -> BlockRemoved:
    get = ev.get
    return _removed(ev["block_hashes"], get("medium"), get("group_idx"))


def _cleared(ev: object) -> AllBlocksCleared:
    return AllBlocksCleared()


_HANDLERS: dict[str, tuple[dict[Any, _Handler], dict[Any, _Handler]]] = {
    "vllm": (
        {"BlockStored": _vllm_stored_a, "BlockRemoved": _removed_a, "AllBlocksCleared": _cleared},
        {"BlockStored": _vllm_stored_m, "BlockRemoved": _removed_m, "AllBlocksCleared": _cleared},
    ),
    "sglang": (
        {
            "BlockStored": _sglang_stored_a,
            "BlockRemoved": _removed_a,
            "AllBlocksCleared": _cleared,
        },
        {
            "BlockStored": _sglang_stored_m,
            "BlockRemoved": _removed_m,
            "AllBlocksCleared": _cleared,
        },
    ),
}
