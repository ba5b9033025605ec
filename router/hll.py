"""HyperLogLog for counting distinct prefix keys in fixed memory.

The admin endpoint reports ``unique_prefixes``; an exact set would grow without bound
under adversarial traffic. 2^14 one-byte registers (16 KiB) give about 0.8% standard
error, and linear counting keeps small counts exact in practice. Prefix keys are
SHA-256 digests, so their bytes are used directly as the hash.
"""

from __future__ import annotations

import math

__all__ = ["HyperLogLog"]

_P = 14
_M = 1 << _P
_ALPHA = 0.7213 / (1 + 1.079 / _M)


class HyperLogLog:
    __slots__ = ("_registers",)

    def __init__(self) -> None:
        self._registers = bytearray(_M)

    def add_digest(self, digest: bytes) -> None:
        x = int.from_bytes(digest[:8], "big")
        idx = x >> (64 - _P)
        rest = x & ((1 << (64 - _P)) - 1)
        rank = (64 - _P) - rest.bit_length() + 1
        if rank > self._registers[idx]:
            self._registers[idx] = rank

    def count(self) -> int:
        regs = self._registers
        zeros = regs.count(0)
        if zeros == _M:
            return 0
        estimate = _ALPHA * _M * _M / sum(2.0**-r for r in regs)
        if estimate <= 2.5 * _M and zeros:
            estimate = _M * math.log(_M / zeros)
        return round(estimate)

    def clear(self) -> None:
        self._registers = bytearray(_M)
