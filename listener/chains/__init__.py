"""Chain tracking: engine block events in, prefix-level ``KvEvent``s out, in bounded memory.

One ``ChainTracker`` per source (backend). Engines report KV-cache *blocks* (stored,
removed, all cleared), each chained to its parent by hash; the router needs *prefixes*:
which backend holds how much of the chain under which prefix key (``bus.prefix_key``).
The tracker turns one into the other:

* ``blocks``       each stored block becomes a ``TrackedBlock`` in the ``BlockStore``,
                   which holds the entry and token bounds and prunes single entries in a
                   ``PruningPolicy``'s order (``LruPolicy`` by default);
* ``states``       a block is ``PENDING`` (prefix unknown yet), ``KEYED`` (prefix known) or
                   ``UNATTRIBUTED`` (can never be keyed); the table of allowed transitions
                   (``TRANSITIONS``) and what each state holds;
* ``attribution``  pending chains are detokenized off the ingestion path and keyed at the
                   block whose text decides the key (router salts key a chain at once);
* ``prefixes``     per-prefix counts of keyed blocks, diffed against what was last
                   announced into ``cache_created`` / ``cache_offloaded`` /
                   ``cache_evicted``; ``snapshot`` replays the announced state;
* ``conversation`` (conversation mode) every block's node in its prompt's key chain
                   (``bus.prompt_chain``), from its tokens' bytes (``listener.token_bytes``);
                   per-key counts announced as ``chain_created`` / ``chain_offloaded`` /
                   ``chain_evicted``, withdrawn with the block's subtree;
* ``state``        the whole state as plain data and back (``export_state`` /
                   ``import_state``): what a listener checkpoint holds;
* ``tracker``      ``ChainTracker``, the facade: ``apply`` (synchronous, O(blocks in the
                   event), never waits for I/O), ``flush``, ``reset``, ``snapshot``,
                   ``stats``, ``idle``, ``aclose``, ``check_invariants``.

**Memory bound.** Only PENDING blocks retain token IDs, each block only its own segment
and only if it ends within ``max_chain_tokens``; entries beyond ``max_tracked_blocks`` are
pruned, and beyond ``max_retained_tokens`` the oldest holders lose their text. Hence at
all times, per source::

    retained token IDs <= min(max_retained_tokens, max_tracked_blocks * max_chain_tokens)

In conversation mode each block's node also keeps the bytes it adds after its chain's last
chunk boundary (fewer than ``chunk_bytes``), beyond ``max_retained_bytes`` the oldest lose
them, so likewise::

    retained chain bytes <= min(max_retained_bytes, max_tracked_blocks * (chunk_bytes - 1))

Never a whole backend is dropped; a prefix goes (``cache_evicted``) only when its last
block goes.

**Events.** After every engine batch (or attribution) the tracker emits, per prefix (and
per chain key), the difference from what it last announced, and ``cache_cleared`` when the
engine cleared everything; ``reset`` forgets everything without events (the source
resyncs).
"""

from .attribution import ChainAttributor
from .blocks import LruPolicy, PruningPolicy, TrackedBlock
from .conversation import ConversationSettings
from .state import StateError, export_state, import_state
from .states import (
    KEYED,
    PENDING,
    TRANSITIONS,
    UNATTRIBUTED,
    BlockState,
    Cause,
    IllegalTransition,
)
from .tracker import ChainTracker

__all__ = [
    "KEYED",
    "PENDING",
    "TRANSITIONS",
    "UNATTRIBUTED",
    "BlockState",
    "Cause",
    "ChainAttributor",
    "ChainTracker",
    "ConversationSettings",
    "IllegalTransition",
    "LruPolicy",
    "PruningPolicy",
    "StateError",
    "TrackedBlock",
    "export_state",
    "import_state",
]
