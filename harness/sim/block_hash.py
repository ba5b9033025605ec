"""Block hashes as the engines publish them (listener/ENGINE_FORMATS.md §4).

With KV events on, the prefix cache uses one of these as its key function, so the hashes in
the events are the cache's own keys and a removal names exactly what a store announced.

* :class:`VllmHasher`: vLLM's recurrence (the single source of truth, from
  ``vllm/v1/core/kv_cache_utils.py``, ``--prefix-caching-hash-algo sha256``)::

      digest_0 = sha256(pickle((NONE_HASH, tuple(tokens_0), extra_0), protocol=5))
      digest_i = sha256(pickle((digest_{i-1}, tuple(tokens_i), extra_i), protocol=5))
      NONE_HASH = sha256(pickle($PYTHONHASHSEED or "vllm-none-hash", protocol=5))
      extra_0 = (cache_salt,) for a salted request, else None; extra_i (i>0) = None

  published as ``u64`` (low 64 bits of the digest, vLLM ≥0.10.2's default), ``bytes`` (the
  raw 32 bytes, ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``) or ``i64`` (the same low 64 bits
  as a signed int, standing in for vLLM 0.9's Python ``hash()``, which no other process can
  reproduce anyway). For an unsalted prompt these are the digests a real vLLM (≤0.30, sha256,
  same seed) computes for the same token ids; 0.31+ tags the salt key internally.
* :class:`SglangHasher`: SGLang's chained page hash approximated:
  ``sha256(previous digest ++ salt (first page only) ++ tokens as uint32 little endian)``,
  published as the first 8 digest bytes read as a **signed** big-endian int64
  (``hash_str_to_int64``).

Both cost a few microseconds per block; the default (no events) cache hash stays the fast
blake2b chain of :mod:`harness.sim.prefix_cache`.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import sys
from array import array
from collections.abc import Sequence
from typing import Any, Literal

__all__ = ["HashKind", "SglangHasher", "VllmHasher", "vllm_none_hash"]

HashKind = Literal["u64", "bytes", "i64"]

_U64 = (1 << 64) - 1
_PROTO = pickle.HIGHEST_PROTOCOL  # 5 on Python 3.8+, as vLLM uses
_sha256 = hashlib.sha256
_dumps = pickle.dumps


def vllm_none_hash() -> bytes:
    """vLLM's NONE_HASH: the parent digest of every first block."""
    seed = os.environ.get("PYTHONHASHSEED") or "vllm-none-hash"
    return _sha256(_dumps(seed, protocol=_PROTO)).digest()


class VllmHasher:
    """vLLM's sha256 block-hash chain; keys are u64 ints, signed i64 ints or 32-byte digests."""

    def __init__(self, kind: HashKind = "u64") -> None:
        if kind not in ("u64", "bytes", "i64"):
            raise ValueError(f"unknown hash kind {kind!r}")
        self.kind = kind
        self._none = vllm_none_hash()

    def chain(self, tokens: Sequence[int], block_size: int, salt: str | None) -> list[Any]:
        digests: list[bytes] = []
        parent = self._none
        extra: tuple[str, ...] | None = (salt,) if salt else None
        for start in range(0, len(tokens) - block_size + 1, block_size):
            block = tuple(tokens[start : start + block_size])
            parent = _sha256(_dumps((parent, block, extra), protocol=_PROTO)).digest()
            extra = None
            digests.append(parent)
        if self.kind == "bytes":
            return digests
        if self.kind == "u64":
            return [int.from_bytes(d, "big") & _U64 for d in digests]
        return [int.from_bytes(d[-8:], "big", signed=True) for d in digests]


_LITTLE = sys.byteorder == "little"


def _u32le(tokens: Sequence[int]) -> bytes:
    a = array("I", tokens) if array("I").itemsize == 4 else array("L", tokens)
    if not _LITTLE:  # pragma: no cover - big-endian hosts
        a.byteswap()
    return a.tobytes()


class SglangHasher:
    """SGLang-style chained page hash; keys are signed int64 ints."""

    def chain(self, tokens: Sequence[int], block_size: int, salt: str | None) -> list[Any]:
        out: list[int] = []
        prior = b""
        salt_bytes = salt.encode("utf-8", "surrogatepass") if salt else b""
        for start in range(0, len(tokens) - block_size + 1, block_size):
            h = _sha256(prior)
            if salt_bytes:
                h.update(salt_bytes)
                salt_bytes = b""
            h.update(_u32le(tokens[start : start + block_size]))
            prior = h.digest()
            out.append(int.from_bytes(prior[:8], "big", signed=True))
        return out
