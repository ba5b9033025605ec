"""The root of the errors the contract layer raises, and the wire words both sides share.

Every error ``bus`` defines for bad input derives from :class:`BusError`, so a caller at a
process boundary (an ingestion path that must count and recover, never crash) can catch
the contract's errors as one family, apart from its own bugs. Each subclass also keeps the
builtin base callers already catch (``ValueError`` for malformed values).

The words are the ones the listener writes and the router reads on every event stream:

* ``ERROR_EVENT``: the SSE ``event:`` of the record that ends a stream on purpose,
  ``{"error": <reason>, ...}`` (never a ``KvEvent``);
* ``BUFFER_OVERFLOW``: the reason of a subscriber closed for falling too far behind, in
  that record and in the event bus's ``StreamClose`` (whose codes
  ``bus.stream_data.CLOSE_REASON_WORDS`` names with the same words).
"""

from __future__ import annotations

__all__ = ["BUFFER_OVERFLOW", "ERROR_EVENT", "BusError"]


class BusError(Exception):
    """Root of the contract layer's errors: bad input at a boundary, never a bug."""


ERROR_EVENT = "error"
BUFFER_OVERFLOW = "buffer_overflow"
