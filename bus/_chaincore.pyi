"""The compiled loop of ``bus.prompt_chain`` (``bus/_native/chaincore.c``)."""

from typing_extensions import Buffer

def chain_extend(key: Buffer, data: Buffer, chunk_bytes: int, /) -> list[bytes]: ...
