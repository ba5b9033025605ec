"""How one ``KvEvent`` changes the index: the tier transitions, in one table.

``offloading`` is ``kv_cache_index.storage_offloading``. "on" = ``enabled``; "demote" =
``treat_eviction_as_offload``. ``count`` is the event's ``token_count`` (0 when absent).

====================  =========================================  ===========================
event                 offloading on                              offloading off
====================  =========================================  ===========================
``cache_created``     upsert(count, GpuHot) -> ``created``       same
  with tier storage   upsert(count, StorageWarm) -> ``offloaded``  remove -> ``evicted``
``cache_offloaded``   upsert(count, StorageWarm); without a      remove -> ``evicted``
                      count set_tier(StorageWarm) -> ``offloaded``
``cache_evicted``     demote: set_tier(StorageWarm)               remove -> ``evicted``
                      -> ``offloaded``; else remove -> ``evicted``
``cache_cleared``     remove_backend -> ``cleared``              same
``resync``            remove_backend -> ``resync`` (the snapshot  same
                      of ``cache_created`` that follows rebuilds)
====================  =========================================  ===========================

Invariants:

* Without storage tracking, the index holds GPU state only: a prefix whose blocks are only
  in a slower tier is not on the GPU, so an offload is an eviction.
* A set_tier that finds no live entry creates nothing (the token count is unknown) and
  returns ``ignored``; so does a prefixed event without ``prefix_hash`` (the decoder rejects
  those, so only hand-built events can be).
* Every path is one index call: applying an event is as atomic as the index's methods.

The returned label is for counters (``continuum_kv_events_applied_total{action=...}``).
"""

from __future__ import annotations

from typing import Literal

from bus.events import KvEvent
from router.config.models import StorageOffloadingConfig

from .base import KvIndex, Tier

__all__ = ["ACTIONS", "Action", "apply_event"]

Action = Literal["created", "offloaded", "evicted", "cleared", "resync", "ignored"]
ACTIONS: tuple[str, ...] = ("created", "offloaded", "evicted", "cleared", "resync", "ignored")

_GPU = Tier.GPU_HOT
_WARM = Tier.STORAGE_WARM


async def apply_event(index: KvIndex, ev: KvEvent, offloading: StorageOffloadingConfig) -> Action:
    """Apply ``ev`` to ``index`` per the table above; return what was done."""
    kind = ev.event
    if kind == "cache_cleared" or kind == "resync":
        await index.remove_backend(ev.backend)
        return "cleared" if kind == "cache_cleared" else "resync"
    prefix = ev.prefix_hash
    if prefix is None:
        return "ignored"
    if kind == "cache_created" and ev.tier != "storage":
        await index.upsert(prefix, ev.backend, ev.token_count or 0, _GPU)
        return "created"
    if kind == "cache_evicted":
        if offloading.enabled and offloading.treat_eviction_as_offload:
            ok = await index.set_tier(prefix, ev.backend, _WARM)
            return "offloaded" if ok else "ignored"
        await index.remove(prefix, ev.backend)
        return "evicted"
    # cache_offloaded, or cache_created in the storage tier.
    if not offloading.enabled:
        await index.remove(prefix, ev.backend)
        return "evicted"
    if ev.token_count is not None:
        await index.upsert(prefix, ev.backend, ev.token_count, _WARM)
        return "offloaded"
    ok = await index.set_tier(prefix, ev.backend, _WARM)
    return "offloaded" if ok else "ignored"
