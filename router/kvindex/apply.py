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
  ``apply_events`` applies a chunk of events in order and passes runs of plain upserts and
  removes to ``write_many`` together; each event still gets the label of this table.

The returned label is for counters (``continuum_kv_events_applied_total{action=...}``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from bus.events import KvEvent
from router.config.models import StorageOffloadingConfig

from .base import Change, KvIndex, StorageTier

__all__ = ["ACTIONS", "Action", "apply_event", "apply_events"]

Action = Literal["created", "offloaded", "evicted", "cleared", "resync", "ignored"]
ACTIONS: tuple[str, ...] = ("created", "offloaded", "evicted", "cleared", "resync", "ignored")

_GPU = StorageTier.GPU_HOT
_WARM = StorageTier.STORAGE_WARM


def _plan(ev: KvEvent, offloading: StorageOffloadingConfig) -> tuple[Action, Change | None]:
    """The table above for one event: its label and, when the event is a plain upsert or
    remove, that change (the other rows need a call of their own: ``_apply_other``)."""
    kind = ev.event
    if kind == "cache_cleared" or kind == "resync":
        return ("cleared" if kind == "cache_cleared" else "resync"), None
    prefix = ev.prefix_hash
    if prefix is None:
        return "ignored", None
    if kind == "cache_created" and ev.tier != "storage":
        return "created", (prefix, ev.backend, ev.token_count or 0, _GPU)
    if kind == "cache_evicted":
        if offloading.enabled and offloading.treat_eviction_as_offload:
            return "offloaded", None  # set_tier
        return "evicted", (prefix, ev.backend, 0, None)
    # cache_offloaded, or cache_created in the storage tier.
    if not offloading.enabled:
        return "evicted", (prefix, ev.backend, 0, None)
    if ev.token_count is not None:
        return "offloaded", (prefix, ev.backend, ev.token_count, _WARM)
    return "offloaded", None  # set_tier


async def _apply_other(index: KvIndex, ev: KvEvent, action: Action) -> Action:
    """The rows without a plain change: remove_backend, set_tier (or nothing)."""
    if action in ("cleared", "resync"):
        await index.remove_backend(ev.backend)
        return action
    if action == "ignored":
        return action
    assert ev.prefix_hash is not None
    ok = await index.set_tier(ev.prefix_hash, ev.backend, _WARM)
    return "offloaded" if ok else "ignored"


async def apply_event(index: KvIndex, ev: KvEvent, offloading: StorageOffloadingConfig) -> Action:
    """Apply ``ev`` to ``index`` per the table above; return what was done."""
    action, change = _plan(ev, offloading)
    if change is None:
        return await _apply_other(index, ev, action)
    prefix, backend, count, tier = change
    if tier is None:
        await index.remove(prefix, backend)
    else:
        await index.upsert(prefix, backend, count, tier)
    return action


async def apply_events(
    index: KvIndex, events: Sequence[KvEvent], offloading: StorageOffloadingConfig
) -> list[Action]:
    """``apply_event`` for each event, in order, with runs of plain upserts and removes
    handed to ``index.write_many`` together (one Redis round trip per run instead of one
    per event). Same final state and labels as applying them one by one. If it raises,
    any prefix of ``events`` may have been applied; applying them again is harmless."""
    actions: list[Action] = []
    run: list[Change] = []
    for ev in events:
        action, change = _plan(ev, offloading)
        if change is not None:
            run.append(change)
            actions.append(action)
            continue
        if run:
            await index.write_many(run)
            run = []
        actions.append(await _apply_other(index, ev, action))
    if run:
        await index.write_many(run)
    return actions
