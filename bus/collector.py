"""The cyclic garbage collector's settings for a long-running Continuum process.

Both processes allocate containers by the thousand per unit of work and free almost all
of them by reference counting: the listener a few dozen per engine event, the router
every object of a request's parsed JSON body (an agent loop of 500 messages is about 900
lists and dicts) for as long as the request is in flight. CPython collects its youngest
generation every 700 net container allocations, so with 16 such requests in flight the
collector ran about once per request, walked every live body and promoted them to the
older generations, whose passes walk the whole heap: measured in one router at
32k-token agent loops, 30-40 % of its CPU per request was the collector
(``bench/RESULTS.md``, the collector's section). At 20,000 a request's objects are
freed long before a pass would see them.

Objects alive at startup (modules, configuration, compiled chat templates) live for the
process: frozen, no pass walks them again. The cost is only that rare cyclic garbage is
reclaimed later (at most some 20,000 objects' worth).
"""

from __future__ import annotations

import gc

__all__ = ["YOUNG_THRESHOLD", "tune_collector"]

YOUNG_THRESHOLD = 20_000
"""Net container allocations between two collections of the youngest generation."""


def tune_collector(young_threshold: int = YOUNG_THRESHOLD) -> None:
    """Freeze what is alive now and collect the youngest generation less often; call it
    once, when the process has finished starting up."""
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(young_threshold, older, oldest)
