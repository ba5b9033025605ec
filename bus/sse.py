"""Server-sent events: the encoder the listener writes with and the parser the router reads with.

Both transports (GET /events/{backend} and the gRPC event bus) carry exactly these bytes,
so one parser serves both and a golden file can be asserted byte-equal on both paths.

Parser rules (WHATWG EventSource, plus caps): lines end in LF, CRLF or CR; a line
starting with ``:`` is a comment (heartbeat); ``id:`` sets the last event ID, which
persists across records; a blank line dispatches the record when it has data. The line
buffer and one record's accumulated ``data`` are each capped at ``MAX_SSE_BUFFER_SIZE``
(1 MiB): past it ``SseOverflow`` is raised and the consumer drops the stream and resumes
from the last event ID, so a hostile or broken peer cannot grow memory without bound.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "MAX_SSE_BUFFER_SIZE",
    "SseOverflow",
    "SseParser",
    "SseRecord",
    "encode_comment",
    "encode_record",
]

MAX_SSE_BUFFER_SIZE = 1 << 20


class SseOverflow(Exception):
    """A line or a record exceeded the cap; the stream must be dropped."""


@dataclass(frozen=True, slots=True)
class SseRecord:
    data: bytes
    event: str | None = None
    id: str | None = None
    """The last event ID in effect when this record was dispatched."""


def encode_record(data: bytes, *, event: str | None = None, id: str | None = None) -> bytes:
    """One record; ``data`` must not contain newlines (our JSON never does)."""
    if b"\n" in data or b"\r" in data:
        raise ValueError("SSE data must be a single line")
    out = b""
    if id is not None:
        out += b"id: " + id.encode() + b"\n"
    if event is not None:
        out += b"event: " + event.encode() + b"\n"
    return out + b"data: " + data + b"\n\n"


def encode_comment(text: str = "") -> bytes:
    """A comment line: keeps idle connections alive through proxies."""
    return b": " + text.encode() + b"\n\n" if text else b":\n\n"


class SseParser:
    """Incremental parser: ``feed`` bytes as they arrive, get complete records back."""

    __slots__ = (
        "_buf",
        "_data",
        "_data_len",
        "_event",
        "_has_data",
        "_pending_cr",
        "last_id",
        "max",
    )

    def __init__(self, max_size: int = MAX_SSE_BUFFER_SIZE, last_id: str | None = None) -> None:
        self.max = max_size
        self.last_id = last_id
        self._buf = bytearray()
        self._data: list[bytes] = []
        self._data_len = 0
        self._has_data = False
        self._event: str | None = None
        self._pending_cr = False

    def feed(self, chunk: bytes) -> list[SseRecord]:
        out: list[SseRecord] = []
        if not chunk:
            return out
        buf = self._buf
        if self._pending_cr:
            # A CR ended the previous chunk: an LF right here belongs to it.
            self._pending_cr = False
            if chunk[:1] == b"\n":
                chunk = chunk[1:]
        buf += chunk
        start = 0
        n = len(buf)
        while start < n:
            lf = buf.find(b"\n", start)
            cr = buf.find(b"\r", start, lf if lf >= 0 else n)
            if cr >= 0:
                end, nxt = cr, cr + 1
                if nxt < n and buf[nxt] == 0x0A:
                    nxt += 1
                elif nxt == n:
                    self._pending_cr = True
            elif lf >= 0:
                end, nxt = lf, lf + 1
            else:
                break
            self._line(bytes(buf[start:end]), out)
            start = nxt
        del buf[:start]
        if len(buf) > self.max:
            buf.clear()
            raise SseOverflow(f"SSE line longer than {self.max} bytes")
        return out

    def _line(self, line: bytes, out: list[SseRecord]) -> None:
        if not line:
            if self._has_data:
                out.append(SseRecord(b"\n".join(self._data), self._event, self.last_id))
            self._data = []
            self._data_len = 0
            self._has_data = False
            self._event = None
            return
        if line[0] == 0x3A:  # ':' comment
            return
        field, sep, value = line.partition(b":")
        if sep and value[:1] == b" ":
            value = value[1:]
        if field == b"data":
            self._data_len += len(value) + 1
            if self._data_len > self.max:
                self._data = []
                self._data_len = 0
                self._has_data = False
                raise SseOverflow(f"SSE record data larger than {self.max} bytes")
            self._data.append(value)
            self._has_data = True
        elif field == b"event":
            self._event = value.decode("utf-8", "replace")
        elif field == b"id":
            if b"\x00" not in value:
                self.last_id = value.decode("utf-8", "replace")
        # "retry" and unknown fields are ignored
