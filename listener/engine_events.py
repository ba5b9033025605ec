"""Engine-level KV events after decoding: one shape for vLLM, SGLang and TensorRT-LLM.

Decoders (``decode.py`` for ZMQ msgpack, ``trtllm.py`` for trtllm-serve JSON) produce
these; the chain tracker consumes them. Field names follow vLLM's
``vllm/distributed/kv_events.py`` (past-tense event names).

Block hashes are opaque engine ids (``BlockHash``): an int normalised to ``value mod 2**64``
(vLLM's uint64, SGLang's signed int64 and TensorRT-LLM's uint64 all land in one space),
or the raw bytes when an engine sends a digest. They are only unique within one
``namespace`` (engine instance, dp rank, KV-cache group, medium) and are never confused
with a ``bus.prefix_key.PrefixKey``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NewType

__all__ = [
    "AllBlocksCleared",
    "BlockHash",
    "BlockRemoved",
    "BlockStored",
    "EngineEvent",
    "EventBatch",
    "normalize_hash",
]

BlockHash = NewType("BlockHash", "int | bytes")  # type: ignore[valid-newtype]

_U64 = (1 << 64) - 1


def normalize_hash(value: object) -> BlockHash | None:
    """An engine hash as an opaque id; ``None`` for anything that is not a hash."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return BlockHash(value & _U64)
    if isinstance(value, (bytes, bytearray)) and 0 < len(value) <= 64:
        return BlockHash(bytes(value))
    return None


@dataclass(slots=True)
class BlockStored:
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    """All tokens of the blocks, concatenated (empty when the engine sent none)."""
    block_size: int
    medium: str | None = None
    """``GPU`` (or None, meaning GPU); ``CPU``, ``CPU_PINNED``, ``DISK``... are slower tiers."""
    lora_id: int | None = None
    lora_name: str | None = None
    cache_salt: str | None = None
    """The request's salt when the engine exposes it (first block of a request only)."""
    group_idx: int = 0
    block_token_counts: list[int] | None = None
    """Per-block token counts when blocks differ in size (TensorRT-LLM's partial last
    block); ``None`` means every block holds ``block_size`` tokens."""


@dataclass(slots=True)
class BlockRemoved:
    block_hashes: list[BlockHash]
    medium: str | None = None
    group_idx: int = 0


@dataclass(slots=True)
class AllBlocksCleared:
    pass


EngineEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(slots=True)
class EventBatch:
    ts: float
    events: list[EngineEvent] = field(default_factory=list)
    dp_rank: int | None = None
    skipped: int = 0
    """Events in the batch that were not understood (unknown tag, wrong field types)."""
    malformed: int = 0
    """Those of ``skipped`` of a known kind (a block event with a field of the wrong type):
    lost block events, so the consumer resyncs. An unknown kind may be an engine newer than
    the decoder and costs nothing the listener tracks."""
