"""One source's checkpoints: load at start, write periodically and at shutdown.

``listener.checkpoint`` is the file; this is the policy around it, per source with ZMQ
transports (trtllm pollers have no sequence to resume from and are not checkpointed):

* **load** (before the sources run): a checkpoint that is missing starts empty; one
  that is unusable (truncated, corrupt, another format version, another source, engine
  kind or tracker settings, older than ``checkpoint_max_age_s``, or state the tracker
  refuses) is counted in ``checkpoint_rejected``, logged with its reason, and ignored:
  the source starts empty, as without checkpoints. A usable one fills the tracker and
  tells each transport where to resume (``ZmqSource.resume``);
* **save**: the tracker's state (``chains.export_state``) and each transport's
  position, encoded on the event loop (the state must not change while it is read) and
  written in a thread (``write_checkpoint``: atomic and durable). ``run`` saves every
  ``checkpoint_interval_ms`` when something changed (a batch applied, an event
  published) and once more when stopped. A failed write is counted
  (``checkpoint_write_failures``) and logged once; the previous file stays valid.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

from .chains import ChainTracker, StateError, export_state, import_state
from .checkpoint import (
    Checkpoint,
    CheckpointError,
    Resume,
    check_identity,
    encode_checkpoint,
    read_checkpoint,
    write_checkpoint,
)
from .zmq_source import ZmqSource

__all__ = ["Checkpointer"]

log = logging.getLogger("continuum.listener.checkpoint")


class Checkpointer:
    """Args:
    path: the source's checkpoint file.
    identity: what must match for a checkpoint to be this source's (backend, engine,
        endpoints, tracker settings): anything else is ``foreign``.
    tracker, transports: the source's.
    changes: a number that moves whenever the source's state may have changed (the
        hub's sequence of the backend plus the batches received).
    max_age_s: ``checkpoint_max_age_s``.
    """

    def __init__(
        self,
        path: Path,
        identity: dict[str, Any],
        tracker: ChainTracker,
        transports: list[ZmqSource],
        changes: Any,
        max_age_s: float,
    ) -> None:
        self.path = path
        self.identity = identity
        self.tracker = tracker
        self.transports = transports
        self._changes = changes
        self.max_age_s = max_age_s
        self._saved_at: tuple[int, ...] | None = None
        self._write_warned = False
        self.stats = {
            "checkpoint_loaded": 0,
            "checkpoint_rejected": 0,
            "checkpoint_writes": 0,
            "checkpoint_write_failures": 0,
            "checkpoint_bytes": 0,
        }

    # -- start ----------------------------------------------------------------------------

    def load(self, on_gap: Any) -> bool:
        """Fill the tracker from the checkpoint, if there is a usable one (module
        docstring); True when it did. Never raises for the file's content."""
        try:
            cp = read_checkpoint(self.path)
            if cp is None:
                return False
            check_identity(cp, self.identity, self.max_age_s)
            if len(cp.resume) != len(self.transports) or any(
                r.endpoint != t.config.endpoint
                for r, t in zip(cp.resume, self.transports, strict=False)
            ):
                raise CheckpointError("foreign", "written for other endpoints")
            try:
                import_state(self.tracker, cp.state)
            except StateError as e:
                raise CheckpointError("state", str(e)) from None
        except CheckpointError as e:
            self.stats["checkpoint_rejected"] += 1
            log.warning(
                "source %s: checkpoint %s ignored (%s); starting empty",
                self.tracker.backend,
                self.path,
                e,
            )
            return False
        except Exception:  # a case no check foresaw: still never a failed start
            self.stats["checkpoint_rejected"] += 1
            log.exception(
                "source %s: checkpoint %s ignored; starting empty", self.tracker.backend, self.path
            )
            self.tracker.reset()
            return False
        for r, t in zip(cp.resume, self.transports, strict=True):
            t.resume(r.seq, r.digest, on_gap)
        self.stats["checkpoint_loaded"] += 1
        log.info(
            "source %s: resumed from checkpoint %s (%d blocks, written %.1f s ago, seq %s)",
            self.tracker.backend,
            self.path,
            self.tracker.stats()["tracked_blocks"],
            time.time() - cp.written_at,
            ",".join(str(r.seq) for r in cp.resume),
        )
        return True

    # -- saving ---------------------------------------------------------------------------

    def _position(self) -> tuple[Resume, ...] | None:
        out = []
        for t in self.transports:
            pos = t.position()
            if pos is None:
                return None  # a transport that never received a batch: nothing to resume
            out.append(Resume(t.config.endpoint, pos[0], pos[1]))
        return tuple(out)

    def encode(self) -> bytes | None:
        """The checkpoint's bytes now, or None while there is nothing to resume from."""
        resume = self._position()
        if resume is None:
            return None
        return encode_checkpoint(
            Checkpoint(self.identity, time.time(), resume, export_state(self.tracker))
        )

    async def save(self, *, force: bool = False) -> None:
        """Write a checkpoint if the state changed since the last one (or ``force``)."""
        mark = tuple(self._changes())
        if not force and mark == self._saved_at:
            return
        data = self.encode()
        if data is None:
            return
        try:
            await asyncio.to_thread(write_checkpoint, self.path, data)
        except OSError as e:
            self.stats["checkpoint_write_failures"] += 1
            if not self._write_warned:
                self._write_warned = True
                log.warning(
                    "source %s: cannot write checkpoint %s: %s (further failures only counted)",
                    self.tracker.backend,
                    self.path,
                    e,
                )
            return
        self._saved_at = mark
        self.stats["checkpoint_writes"] += 1
        self.stats["checkpoint_bytes"] = len(data)

    async def run(self, interval_s: float) -> None:
        """Save every ``interval_s`` while changed, until cancelled."""
        while True:
            await asyncio.sleep(interval_s)
            await self.save()
