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

from typing import NamedTuple

from .errors import BusError

__all__ = [
    "MAX_SSE_BUFFER_SIZE",
    "SseOverflow",
    "SseParser",
    "SseRecord",
    "encode_comment",
    "encode_record",
]

MAX_SSE_BUFFER_SIZE = 1 << 20

_MAX_EVENT_NAMES = 64
_event_names: dict[bytes, str] = {}
"""Decoded ``event:`` values: a handful of kinds, seen once per record."""


class SseOverflow(BusError):
    """A line or a record exceeded the cap; the stream must be dropped."""


class SseRecord(NamedTuple):
    """One dispatched record (a tuple: built once per event on the router's hot path)."""

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


_new_record = tuple.__new__  # NamedTuple's own __new__ is Python code: 3x slower


class SseParser:
    """Incremental parser: ``feed`` bytes as they arrive, get complete records back.

    Cost matters here: the router parses every KV event of every backend with it. A chunk
    without CR (what our listener sends) is split into lines by one ``bytes.split`` in C;
    only a chunk with CR, or one following a chunk that ended in CR, takes the general
    line scanner. Both feed the same line loop (:meth:`_lines`).
    """

    __slots__ = (
        "_buf",
        "_data",
        "_data_len",
        "_event",
        "_pending_cr",
        "last_id",
        "max",
    )

    def __init__(self, max_size: int = MAX_SSE_BUFFER_SIZE, last_id: str | None = None) -> None:
        self.max = max_size
        self.last_id = last_id
        self._buf = bytearray()
        """The unfinished last line (never holds a CR: a CR ends a line)."""
        self._data: list[bytes] = []
        """The ``data`` lines of the record in progress; non-empty = it has data."""
        self._data_len = 0
        self._event: str | None = None
        self._pending_cr = False

    def feed(self, chunk: bytes) -> list[SseRecord]:
        """Parse ``chunk``; return the records it completes, in order.

        Raises:
            SseOverflow: a line or one record's data exceeded ``max``; the stream must be
                dropped (records completed earlier in this chunk are not returned).
        """
        if not chunk:
            return []
        buf = self._buf
        if self._pending_cr or b"\r" in chunk:
            lines = self._split_any(chunk)
        else:
            if buf:
                buf += chunk
                lines = bytes(buf).split(b"\n")
            else:
                lines = chunk.split(b"\n")
            buf[:] = lines.pop()
        if len(buf) > self.max:
            buf.clear()
            raise SseOverflow(f"SSE line longer than {self.max} bytes")
        return self._lines(lines)

    def _split_any(self, chunk: bytes) -> list[bytes]:
        """Complete lines ending in LF, CRLF or CR; the unfinished rest stays in ``_buf``."""
        buf = self._buf
        if self._pending_cr:
            # A CR ended the previous chunk: an LF right here belongs to it.
            self._pending_cr = False
            if chunk[:1] == b"\n":
                chunk = chunk[1:]
        buf += chunk
        lines: list[bytes] = []
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
            lines.append(bytes(buf[start:end]))
            start = nxt
        del buf[:start]
        return lines

    def _lines(self, lines: list[bytes]) -> list[SseRecord]:
        out: list[SseRecord] = []
        append = out.append
        cap = self.max
        names = _event_names
        # The record in progress lives in locals for the loop (attribute access per line
        # would cost more than the parsing) and goes back into ``self`` at the end.
        data = self._data
        data_len = self._data_len
        event = self._event
        last_id = self.last_id
        try:
            for line in lines:
                if not line:
                    if data:
                        value = data[0] if len(data) == 1 else b"\n".join(data)
                        append(_new_record(SseRecord, (value, event, last_id)))
                        data = []
                        data_len = 0
                    event = None
                    continue
                if line[0] == 0x3A:  # ':' comment
                    continue
                field, sep, value = line.partition(b":")
                if sep and value[:1] == b" ":
                    value = value[1:]
                if field == b"data":
                    data_len += len(value) + 1
                    if data_len > cap:
                        data = []
                        data_len = 0
                        self._buf.clear()
                        raise SseOverflow(f"SSE record data larger than {cap} bytes")
                    data.append(value)
                elif field == b"event":
                    event = names.get(value)
                    if event is None:
                        event = value.decode("utf-8", "replace")
                        if len(names) < _MAX_EVENT_NAMES:
                            names[value] = event
                elif field == b"id":
                    if b"\x00" not in value:
                        last_id = value.decode("utf-8", "replace")
                # "retry" and unknown fields are ignored
        finally:
            self._data = data
            self._data_len = data_len
            self._event = event
            self.last_id = last_id
        return out
