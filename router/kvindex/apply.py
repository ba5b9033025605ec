"""How one ``KvEvent`` changes the indexes: the tier transitions, in one table.

Two indexes take events: the prefix index (``cache_*`` kinds, keyed by ``prefix_hash``)
and, with conversation routing on, the chain index (``chain_*`` kinds, keyed by the
16 bytes of ``chain_key``). A chain kind follows the row of its ``cache_*`` namesake into
the chain index; without a chain index it is ``ignored``.

``offloading`` is ``kv_cache_index.storage_offloading``. "on" = ``enabled``; "demote" =
``treat_eviction_as_offload``. ``count`` is the event's ``token_count`` (0 when absent).

=========================  =========================================  ======================
event                      offloading on                              offloading off
=========================  =========================================  ======================
``cache_created``,         upsert(count, GpuHot) -> ``created``       same
``chain_created``
  with tier storage        upsert(count, StorageWarm) -> ``offloaded``  remove -> ``evicted``
``cache_offloaded``,       upsert(count, StorageWarm); without a      remove -> ``evicted``
``chain_offloaded``        count set_tier(StorageWarm) -> ``offloaded``
``cache_evicted``,         demote: set_tier(StorageWarm)               remove -> ``evicted``
``chain_evicted``          -> ``offloaded``; else remove -> ``evicted``
``cache_cleared``          remove_backend in both -> ``cleared``      same
``resync``                 remove_backend in both -> ``resync``;      same
                           with a ``snapshot_size`` > 0 begin_resync
                           in both instead (the snapshot builds both
                           anew, ``end_resync`` swaps it in)
=========================  =========================================  ======================

Invariants:

* Without storage tracking, the indexes hold GPU state only: a key whose blocks are only
  in a slower tier is not on the GPU, so an offload is an eviction.
* A set_tier that finds no live entry creates nothing (the token count is unknown) and
  returns ``ignored``; so does a keyed event without its key (the decoder rejects those,
  so only hand-built events can be), and a chain event when there is no chain index.
* Every path but the two whole-backend rows is one index call: applying an event is as
  atomic as the index's methods. ``apply_events`` applies a chunk of events in order and
  passes each index's runs of plain upserts and removes to its ``write_many`` together
  (one call per run per index; a run ends at an event that needs a call of its own);
  each event still gets the label of this table.
* Chain events never touch the prefix index nor prefix events the chain index, so the
  prefix index behaves exactly as without conversation routing.

The returned label is for counters (``continuum_kv_events_applied_total{action=...}``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from bus.events import CHAIN_KINDS, KvEvent
from router.config.models import StorageOffloadingConfig

from .base import Change, KvIndex, StorageTier

__all__ = ["ACTIONS", "Action", "apply_event", "apply_events", "end_resync"]

Action = Literal["created", "offloaded", "evicted", "cleared", "resync", "ignored"]
ACTIONS: tuple[str, ...] = ("created", "offloaded", "evicted", "cleared", "resync", "ignored")

_GPU = StorageTier.GPU_HOT
_WARM = StorageTier.STORAGE_WARM
_CREATED = frozenset(("cache_created", "chain_created"))
_EVICTED = frozenset(("cache_evicted", "chain_evicted"))


def _plan(
    ev: KvEvent, offloading: StorageOffloadingConfig, chains: bool
) -> tuple[Action, bool, Change | None]:
    """The table above for one event: its label, whether it is the chain index's, and,
    when the event is a plain upsert or remove, that change (the other rows need a call
    of their own: ``_apply_other``)."""
    kind = ev.event
    if kind == "cache_cleared" or kind == "resync":
        return ("cleared" if kind == "cache_cleared" else "resync"), False, None
    chain = kind in CHAIN_KINDS
    key: str | bytes | None
    if chain:
        if not chains or ev.chain_key is None:
            return "ignored", True, None
        key = bytes.fromhex(ev.chain_key)
    else:
        key = ev.prefix_hash
        if key is None:
            return "ignored", False, None
    if kind in _CREATED and ev.tier != "storage":
        return "created", chain, (key, ev.backend, ev.token_count or 0, _GPU)
    if kind in _EVICTED:
        if offloading.enabled and offloading.treat_eviction_as_offload:
            return "offloaded", chain, None  # set_tier
        return "evicted", chain, (key, ev.backend, 0, None)
    # *_offloaded, or *_created in the storage tier.
    if not offloading.enabled:
        return "evicted", chain, (key, ev.backend, 0, None)
    if ev.token_count is not None:
        return "offloaded", chain, (key, ev.backend, ev.token_count, _WARM)
    return "offloaded", chain, None  # set_tier


def entry_of(
    ev: KvEvent, offloading: StorageOffloadingConfig, chains: bool
) -> tuple[bool, str | bytes] | None:
    """The entry a ``*_created`` / ``*_offloaded`` event leaves in an index, as (in the
    chain index, key), or None when it leaves none (a storage-tier entry without
    ``storage_offloading``, an event of another kind): what a snapshot states."""
    action, chain, change = _plan(ev, offloading, chains)
    if action not in ("created", "offloaded") or (change is not None and change[3] is None):
        return None
    key = bytes.fromhex(ev.chain_key) if chain and ev.chain_key else ev.prefix_hash
    return None if key is None else (chain, key)


async def _apply_other(
    index: KvIndex, chain_index: KvIndex | None, ev: KvEvent, action: Action, chain: bool
) -> Action:
    """The rows without a plain change: remove_backend, set_tier (or nothing)."""
    if action in ("cleared", "resync"):
        # A snapshot of known size follows a resync: build it aside, swap it in whole.
        staged = action == "resync" and bool(ev.snapshot_size)
        for idx in (index, chain_index):
            if idx is None:
                pass
            elif staged:
                await idx.begin_resync(ev.backend)
            else:
                await idx.remove_backend(ev.backend)
        return action
    if action == "ignored":
        return action
    if chain:
        assert chain_index is not None and ev.chain_key is not None
        ok = await chain_index.set_tier(bytes.fromhex(ev.chain_key), ev.backend, _WARM)
    else:
        assert ev.prefix_hash is not None
        ok = await index.set_tier(ev.prefix_hash, ev.backend, _WARM)
    return "offloaded" if ok else "ignored"


async def apply_event(
    index: KvIndex,
    ev: KvEvent,
    offloading: StorageOffloadingConfig,
    chain_index: KvIndex | None = None,
) -> Action:
    """Apply ``ev`` to ``index`` (prefix kinds) or ``chain_index`` (chain kinds) per the
    table above; return what was done."""
    action, chain, change = _plan(ev, offloading, chain_index is not None)
    if change is None:
        return await _apply_other(index, chain_index, ev, action, chain)
    target = chain_index if chain else index
    assert target is not None
    key, backend, count, tier = change
    if tier is None:
        await target.remove(key, backend)
    else:
        await target.upsert(key, backend, count, tier)
    return action


async def apply_events(
    index: KvIndex,
    events: Sequence[KvEvent],
    offloading: StorageOffloadingConfig,
    chain_index: KvIndex | None = None,
) -> list[Action]:
    """``apply_event`` for each event, in order, with each index's runs of plain upserts
    and removes handed to its ``write_many`` together (one Redis round trip per run instead
    of one per event). Same final state and labels as applying them one by one. If it
    raises, any prefix of ``events`` may have been applied; applying them again is
    harmless."""
    chains = chain_index is not None
    actions: list[Action] = []
    run: list[Change] = []
    chain_run: list[Change] = []
    for ev in events:
        action, chain, change = _plan(ev, offloading, chains)
        if change is not None:
            (chain_run if chain else run).append(change)
            actions.append(action)
            continue
        if action != "ignored":  # a call of its own: what came before it goes first
            if run:
                await index.write_many(run)
                run = []
            if chain_run:
                assert chain_index is not None
                await chain_index.write_many(chain_run)
                chain_run = []
        actions.append(await _apply_other(index, chain_index, ev, action, chain))
    if run:
        await index.write_many(run)
    if chain_run:
        assert chain_index is not None
        await chain_index.write_many(chain_run)
    return actions


async def end_resync(index: KvIndex, chain_index: KvIndex | None, backend: str) -> None:
    """The snapshot after a ``resync`` is complete: swap it in, in both indexes (the
    consumer calls this after the last record of a resync block)."""
    await index.end_resync(backend)
    if chain_index is not None:
        await chain_index.end_resync(backend)
