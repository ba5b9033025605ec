"""Attribution: finding the prefix key of a pending chain, off the ingestion path.

The key depends only on the anchor text near the start of a chain. (A root whose first
block carries a router salt is keyed at once when it is stored; this module handles the
rest.) The leaf of each stored event is queued under its root (``mark_dirty``); a few
worker tasks detokenize root..leaf (``recover_many``):

* NEED_MORE marks the leaf's text *insufficient*: its blocked descendants can never get
  more text and become unattributed; others wait for more blocks. At ``max_chain_tokens``
  no child can add text: the chain is given up.
* A key is attached to the *shallowest* block whose text already decides it, found by
  probing a few ancestors (first guess interpolated from where the anchor ended in the
  text, then a k-ary search); that block and all its pending descendants become
  ``KEYED``, and blocks stored under it later inherit the key for free. Attaching at the
  decision block (not at the root, not at the leaf) is what lets two system prompts that
  share a first block get different keys, while every conversation under one system
  prompt costs no further detokenize call.
* No anchor, or a failure retrying cannot fix: the chain is given up.

Detokenize failures are retried with backoff; a chain removed meanwhile is simply
forgotten, and a ``reset`` (new generation) makes every job in flight drop its result.
"""

from __future__ import annotations

import asyncio
import logging
from array import array
from bisect import bisect_left
from collections.abc import Callable, Sequence
from typing import Protocol

from bus.backoff import Backoff
from bus.prefix_key import PrefixKey
from listener.recovery import NEED_MORE, DetokenizeError, NeedMore, Recovered

from .blocks import BlockStore, TrackedBlock
from .prefixes import PrefixLedger
from .states import PENDING, Cause

__all__ = ["AttributionJobs", "ChainAttributor"]

log = logging.getLogger("listener.chains")


class ChainAttributor(Protocol):
    """What the tracker needs from ``listener.recovery.Attributor``."""

    @property
    def can_detokenize(self) -> bool: ...
    def from_salt(self, salt: str) -> PrefixKey | None: ...
    async def recover_many(
        self, seqs: Sequence[Sequence[int]]
    ) -> list[Recovered | NeedMore | None]: ...


class AttributionJobs:
    """The queue of chains to attribute and the worker tasks that do it.

    Args:
        backend: the source's backend name (for logs).
        attributor: detokenize-based recovery.
        blocks: where decided chains are settled.
        ledger: the prefixes keys go to; flushed after each key found.
        queue: the roots with dirty leaves (shared with ``blocks``, which forgets settled
            and removed roots).
        warn_once: logs a warning the first time per kind.
        concurrency: worker tasks.
        backoff: delay strategy after detokenize failures.
        probe_fanout, max_probe_rounds: search for the block that decides the anchor.
    """

    def __init__(
        self,
        backend: str,
        attributor: ChainAttributor,
        blocks: BlockStore,
        ledger: PrefixLedger,
        queue: dict[TrackedBlock, None],
        warn_once: Callable[[str, str], None],
        *,
        concurrency: int,
        backoff: Backoff,
        probe_fanout: int,
        max_probe_rounds: int,
    ) -> None:
        self.backend = backend
        self._attributor = attributor
        self._blocks, self._ledger = blocks, ledger
        self._warn_once = warn_once
        self._concurrency = concurrency
        self._backoff = backoff
        self._fanout, self._rounds = max(1, probe_fanout), max(0, max_probe_rounds)
        self._queue = queue
        self._active: set[TrackedBlock] = set()
        self._gen = 0
        self._workers: list[asyncio.Task[None]] = []
        self._wake: asyncio.Event | None = None
        self._idle: asyncio.Event | None = None
        self._busy = 0
        self._failures = 0
        self.detokenize_failures = 0

    @property
    def queued(self) -> int:
        """Roots queued or being worked on."""
        return len(self._queue) + len(self._active)

    def reset(self) -> None:
        """Forget the queue; jobs in flight see the new generation and drop their result."""
        self._gen += 1
        self._queue.clear()

    def mark_dirty(self, leaf: TrackedBlock) -> None:
        """``leaf`` (pending) was stored: (re)queue its root and wake a worker."""
        root = leaf.root
        if root is None or not root.alive:
            return
        if root.dirty is None:
            root.dirty = {}
        if leaf.parent is not None:
            root.dirty.pop(leaf.parent, None)
        root.dirty[leaf] = None
        if root not in self._active:
            self._queue[root] = None
        self._kick()

    def requeue(self, root: TrackedBlock) -> None:
        """Queue ``root`` (pending, with dirty leaves) again: a tracker restored from a
        checkpoint resumes the attribution it had not finished."""
        if root not in self._active:
            self._queue[root] = None
        self._kick()

    def _kick(self) -> None:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return  # no loop yet: ``idle``/the next apply inside a loop starts the workers
        if self._wake is None or self._idle is None:
            self._wake, self._idle = asyncio.Event(), asyncio.Event()
        self._workers = [t for t in self._workers if not t.done()]
        while len(self._workers) < self._concurrency:
            self._workers.append(asyncio.create_task(self._worker()))
        self._idle.clear()
        self._wake.set()

    async def idle(self) -> None:
        """Wait until no attribution work is queued or running."""
        while self._queue or self._busy:
            self._kick()
            assert self._idle is not None
            await self._idle.wait()

    async def aclose(self) -> None:
        """Stop the workers; work queued later waits for the next ``idle``/``mark_dirty``."""
        workers, self._workers = self._workers, []
        for t in workers:
            t.cancel()
        await asyncio.gather(*workers, return_exceptions=True)

    async def _worker(self) -> None:
        assert self._wake is not None and self._idle is not None
        while True:
            if not self._queue:
                if not self._busy:
                    self._idle.set()
                self._wake.clear()
                await self._wake.wait()
                continue
            root = next(iter(self._queue))
            del self._queue[root]
            if root.alive and root.dirty:
                await self._job(root)
            # An idle worker keeps no root: through its parent and children links a root
            # holds its whole tree (a shared system prompt's is every chain), which would
            # outlive a clear or a reset until this worker's next job.
            del root

    async def _job(self, root: TrackedBlock) -> None:
        self._busy += 1
        self._active.add(root)
        try:
            await self._process(root)
        except Exception:
            log.exception("source %s: attribution job failed", self.backend)
        finally:
            self._busy -= 1
            self._active.discard(root)
            if root.alive and root.dirty and root.root is root:
                self._queue[root] = None

    async def _process(self, root: TrackedBlock) -> None:
        gen = self._gen
        while root.alive and root.dirty and gen == self._gen:
            leaves = list(root.dirty)
            root.dirty.clear()
            for i, leaf in enumerate(leaves):
                if not leaf.alive or leaf.state != PENDING:
                    continue
                try:
                    await self._evaluate(leaf, gen)
                except DetokenizeError as exc:
                    self.detokenize_failures += 1
                    if gen != self._gen:
                        return
                    if not exc.retryable:
                        if leaf.alive and leaf.state == PENDING:
                            self._blocks.unattribute(leaf, Cause.DETOKENIZE_REFUSED)
                        continue
                    self._failures += 1
                    if root.dirty is not None:
                        for again in leaves[i:]:
                            root.dirty[again] = None
                    delay = self._backoff.compute(self._failures)
                    self._warn_once("detokenize", f"detokenize failed ({exc}); retrying")
                    await asyncio.sleep(delay)
                    return
                if self._failures:
                    self._failures = 0
                    self._backoff.reset()

    async def _evaluate(self, leaf: TrackedBlock, gen: int) -> None:
        f = leaf if leaf.tokens is not None else leaf.frontier
        if f is None or not f.alive or f.state != PENDING:
            return
        blocks = self._blocks
        if f.insufficient:
            blocks.kill_blocked(f)
            return
        path = self._path(f)
        if path is None:
            blocks.unattribute(leaf, Cause.PATH_BROKEN)
            return
        buf: array[int] = array("I")
        cum: list[int] = []
        for b in path:
            assert b.tokens is not None
            buf.extend(b.tokens)
            cum.append(len(buf))
        (res,) = await self._attributor.recover_many([buf])
        if gen != self._gen or not f.alive or f.state != PENDING:
            return
        if res is NEED_MORE:
            f.insufficient = True
            if f.depth >= blocks.max_chain_tokens:  # no child can add text: give it up
                blocks.unattribute(f, Cause.TEXT_INSUFFICIENT)
            else:
                blocks.kill_blocked(f)
        elif not isinstance(res, Recovered):
            blocks.unattribute(f, Cause.NO_ANCHOR)
        else:
            d = await self._decision(path, cum, buf, res, gen)
            if d is not None and d.alive and d.state == PENDING:
                blocks.settle(d, Cause.KEY_DECIDED, self._ledger.prefix(res.key))
                self._ledger.flush()

    @staticmethod
    def _path(f: TrackedBlock) -> list[TrackedBlock] | None:
        """root..f, all alive, pending and holding their tokens; None if broken."""
        path = []
        b: TrackedBlock | None = f
        while b is not None:
            if not b.alive or b.state != PENDING or b.tokens is None:
                return None
            path.append(b)
            if b.root is b:
                path.reverse()
                return path
            b = b.parent
        return None

    async def _decision(
        self,
        path: list[TrackedBlock],
        cum: list[int],
        buf: array[int],
        found: Recovered,
        gen: int,
    ) -> TrackedBlock | None:
        """The shallowest block on ``path`` whose text already yields ``found.key``.

        Decidability is monotone along a path, so this is a search between the deepest
        block known insufficient (``lo``) and the leaf (``hi``). The first round probes
        around the block where the anchor ended (interpolated from ``decided_at``), later
        rounds split the interval ``probe_fanout`` ways; each round is one batched call.
        """
        hi = len(path) - 1
        lo = next((i for i in range(hi - 1, -1, -1) if path[i].insufficient), -1)
        guess = bisect_left(cum, found.decided_at * cum[hi])
        for round_no in range(self._rounds):
            if hi - lo <= 1:
                break
            cands = [c for c in (guess - 1, guess) if lo < c < hi] if round_no == 0 else []
            if not cands:
                k = min(self._fanout, hi - lo - 1)
                cands = sorted({lo + (j + 1) * (hi - lo) // (k + 1) for j in range(k)})
                cands = [c for c in cands if lo < c < hi]
            results = await self._attributor.recover_many([buf[: cum[c]] for c in cands])
            if gen != self._gen:
                return None
            for c, r in zip(cands, results, strict=True):
                if isinstance(r, Recovered) and r.key == found.key:
                    hi = c
                    break
                lo = c
                if r is NEED_MORE:
                    path[c].insufficient = True
        return path[hi]
