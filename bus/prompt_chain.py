"""The prompt key chain: the single source of truth for how a rendered prompt is keyed.

The prefix key (``bus.prefix_key``) names a request's system prompt; the chain names every
``chunk_bytes`` of its whole rendered prompt, so the router can learn how much of *this*
conversation a backend holds. Router and listener compute it from the same bytes:

* the router renders the request with the model's chat template (the engine's own) and
  applies the tokenizer's normalizer (NFC for Qwen's);
* the listener concatenates the bytes of the stored blocks' tokens (a vocabulary byte
  table), which are exactly those bytes when the engine tokenized that text.

The recurrence, over the UTF-8 bytes ``T`` of the prompt and ``C = chunk_bytes``::

    root     = H(b"continuum-chain-v1" ‖ field(model) ‖ field(cache_salt) ‖ field(lora))
    chunk[i] = T[i*C : (i+1)*C]                  full chunks only: a tail shorter than C
                                                 has no key
    key[0]   = H(root ‖ chunk[0])
    key[i]   = H(key[i-1] ‖ chunk[i])

    field(None) = 0xFF;  field(s) = len(utf8(s)) as 4 bytes big-endian ‖ utf8(s)
    H = XXH3-128, the 16-byte big-endian digest

So key ``i`` depends on the root and on every byte up to the end of chunk ``i``, nothing
after it, and either side extends a chain from a parent's last key plus at most one partial
chunk (:class:`ChainState`): no pass ever re-reads a byte. The root separates models,
cache salts (tenants) and LoRA adapters, as the engines' own block hashes do; ``None`` and
``""`` are different roots. On the wire a key is 32 lowercase hex characters.

Why XXH3 and not SHA-256: the router hashes every request's whole prompt (128 KiB at 32k
tokens: about 15 us with XXH3-128 against 130 us with SHA-256 here). A collision could only
misroute a request (the engine's own block hashes decide what is reused), so a fast
non-cryptographic 128-bit hash is enough; ``tests/fixtures/prompt_chain_golden.json``
pins the exact values.

The loop over the chunks is compiled (``bus._chaincore``, ``bus/_native/chaincore.c``):
in Python a slice, a concatenation, a hash call and an append per chunk cost 8.7 us for
an 8k-token prompt's 34 chunks, four times the hashing itself; compiled, 3.1 us.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NewType, cast

import xxhash

from ._chaincore import chain_extend

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "KEY_BYTES",
    "ChainKey",
    "ChainState",
    "chain_keys",
    "chain_root",
    "extend",
    "extend_pieces",
]

ChainKey = NewType("ChainKey", bytes)
"""16 bytes: one key of a prompt chain (never an engine block hash, never a prefix key)."""

KEY_BYTES = 16
DEFAULT_CHUNK_BYTES = 1024
_DOMAIN = b"continuum-chain-v1"
_ABSENT = b"\xff"
_hash = xxhash.xxh3_128_digest


def _field(value: str | None) -> bytes:
    if value is None:
        return _ABSENT
    raw = value.encode()
    return len(raw).to_bytes(4, "big") + raw


def chain_root(model: str, cache_salt: str | None = None, lora: str | None = None) -> ChainKey:
    """The root every chain of (model, cache salt, LoRA adapter) starts from."""
    return ChainKey(_hash(_DOMAIN + _field(model) + _field(cache_salt) + _field(lora)))


def chain_keys(
    text: bytes, root: ChainKey, chunk_bytes: int = DEFAULT_CHUNK_BYTES
) -> list[ChainKey]:
    """The keys of every full chunk of ``text``, in order (the router's one pass).

    Raises:
        ValueError: ``chunk_bytes`` < 1, or ``root`` is not ``KEY_BYTES`` long.
        TypeError: ``text`` or ``root`` is not bytes-like.
    """
    return cast(list[ChainKey], chain_extend(root, text, chunk_bytes))


@dataclass(frozen=True, slots=True)
class ChainState:
    """Where a chain stands after some bytes: what extending it needs, and nothing more.

    ``key`` is the last full chunk's key (the root before the first), ``partial`` the bytes
    after it (fewer than ``chunk_bytes``), ``length`` every byte so far. Immutable, so a
    block's state can be shared by all the blocks stored under it.
    """

    key: ChainKey
    partial: bytes
    length: int

    @classmethod
    def start(cls, root: ChainKey) -> ChainState:
        return cls(root, b"", 0)


def extend(
    state: ChainState, data: bytes, chunk_bytes: int = DEFAULT_CHUNK_BYTES
) -> tuple[ChainState, Sequence[ChainKey]]:
    """``state`` extended by ``data``: the new state and the keys of the chunks it completed.

    ``extend(extend(s, a), b)`` gives the same keys as ``extend(s, a + b)``, and from
    :meth:`ChainState.start` the same as :func:`chain_keys` (the listener's incremental pass).
    """
    keys, rest = extend_pieces(state.key, (state.partial, data), chunk_bytes)
    key = keys[-1] if keys else state.key
    return ChainState(key, rest, state.length + len(data)), keys


def extend_pieces(
    key: ChainKey, pieces: Sequence[bytes], chunk_bytes: int = DEFAULT_CHUNK_BYTES
) -> tuple[list[ChainKey], bytes]:
    """The keys of the full chunks of ``b"".join(pieces)`` in a chain whose last key is
    ``key`` (the root before the first chunk), and the bytes after the last of them.

    :func:`extend` without the state objects, for a partial chunk kept in pieces (the
    listener keeps a block's own bytes, not a copy of the partial chunk): the pieces are
    joined once and hashed from there.

    Raises:
        ValueError: ``chunk_bytes`` < 1, or ``key`` is not ``KEY_BYTES`` long.
    """
    data = b"".join(pieces)
    keys = chain_extend(key, data, chunk_bytes)
    return cast(list[ChainKey], keys), data[len(keys) * chunk_bytes :]
