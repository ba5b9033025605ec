"""The states of a tracked block and the only transitions between them.

A block's state says what the tracker still knows about the prefix its chain belongs to.
What a block holds in each state (``ChainTracker.check_invariants`` asserts these):

* ``PENDING``      prefix unknown yet. Has a ``root`` (itself, or the pending root of its
                   chain) and, below the root, a live pending ``parent`` that lists it among
                   its ``children``. Holds its own token segment while the path from the root
                   is fully known and ends within ``max_chain_tokens`` (then so does its
                   parent); otherwise it is *blocked* (no tokens) and waits on its
                   ``frontier``, the deepest ancestor that still has text, which is pending,
                   alive and not known to be insufficient. No ``prefix``.
* ``KEYED``        prefix known. Holds a reference to its prefix's counts and nothing else:
                   no tokens, no parent, no children (descendants inherit the key when they
                   are stored).
* ``UNATTRIBUTED`` can never be keyed. Length only: no tokens, prefix, parent or children;
                   descendants inherit the state when they are stored.

Only ``PENDING`` blocks hold token IDs.

**Birth.** A block is created in whichever state its position decides, which is not a
transition: ``KEYED`` for the first block of a root with a verified router salt, for a
keyed copy of a block in another medium (its *twin*) and under a keyed parent;
``UNATTRIBUTED`` under an unattributed parent, for a root without usable text and for a
blocked block whose frontier is already insufficient; ``PENDING`` otherwise.

**Transitions.** ``KEYED`` and ``UNATTRIBUTED`` are final. A ``PENDING`` block leaves that
state once, together with its pending subtree (the tracker's ``settle``), for one of the
causes in ``TRANSITIONS``. No state has a transition to itself.

**Removal** is not a state: a removed (or pruned) block is marked dead (``alive`` false)
and leaves the tracker in whatever state it had; attribution jobs still holding it see
that and drop it.

Every state change goes through ``TrackedBlock.transition``, which looks the change up
here; one that is not in the table raises ``IllegalTransition`` and changes nothing.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping

__all__ = [
    "KEYED",
    "PENDING",
    "TRANSITIONS",
    "UNATTRIBUTED",
    "BlockState",
    "Cause",
    "IllegalTransition",
]


class BlockState(enum.IntEnum):
    """A tracked block's state (see the module docstring). Values index per-state counts."""

    PENDING = 0
    KEYED = 1
    UNATTRIBUTED = 2


PENDING = BlockState.PENDING
KEYED = BlockState.KEYED
UNATTRIBUTED = BlockState.UNATTRIBUTED


class Cause(enum.StrEnum):
    """Why a pending block leaves ``PENDING`` (one entry of ``TRANSITIONS`` each).

    A ``StrEnum`` so that looking a cause up hashes it in C (a plain ``Enum`` hashes its
    name in Python).
    """

    KEY_DECIDED = "key_decided"
    """Recovery found the key and this block's text, or that of a pending ancestor on its
    path, already decides it: the shallowest such block and its pending subtree."""

    ANCESTOR_REMOVED = "ancestor_removed"
    """The engine removed an ancestor, or the entry bound pruned it: the text above this
    block is gone. Not counted in ``unattributed_chains`` (the chain was cut by a removal,
    not found unkeyable)."""

    TEXT_PRUNED = "text_pruned"
    """The token bound took the block's text (the oldest token holder first)."""

    TEXT_INSUFFICIENT = "text_insufficient"
    """The text ends before the anchor is decided and no more can come: a blocked block
    under a frontier known to be insufficient, or that frontier at ``max_chain_tokens``."""

    NO_ANCHOR = "no_anchor"
    """The text has no chat-template anchor (recovery answered with no key)."""

    DETOKENIZE_REFUSED = "detokenize_refused"
    """/detokenize failed in a way retrying cannot fix."""

    PATH_BROKEN = "path_broken"
    """The path from the root to the block's frontier is not whole. Defensive: it cannot
    happen while the invariants above hold."""


TRANSITIONS: Mapping[BlockState, Mapping[Cause, BlockState]] = {
    PENDING: {
        Cause.KEY_DECIDED: KEYED,
        Cause.ANCESTOR_REMOVED: UNATTRIBUTED,
        Cause.TEXT_PRUNED: UNATTRIBUTED,
        Cause.TEXT_INSUFFICIENT: UNATTRIBUTED,
        Cause.NO_ANCHOR: UNATTRIBUTED,
        Cause.DETOKENIZE_REFUSED: UNATTRIBUTED,
        Cause.PATH_BROKEN: UNATTRIBUTED,
    },
    KEYED: {},
    UNATTRIBUTED: {},
}
"""state -> cause -> the state it leads to; anything missing is illegal. Read-only (plain
dicts rather than ``MappingProxyType``: ``transition`` looks it up on every change)."""


class IllegalTransition(RuntimeError):
    """A state change that ``TRANSITIONS`` does not allow: a bug in the tracker."""

    def __init__(self, state: BlockState, cause: Cause) -> None:
        super().__init__(f"a {state.name} block cannot change state for {cause.name}")
        self.state, self.cause = state, cause
