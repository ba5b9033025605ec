"""Hot reload: SIGHUP or a change of the config file's contents.

A new file is loaded and validated whole before anything is applied: an invalid file
is rejected with its errors logged and the running config keeps serving. Restart-only
fields (``router.config.reloading``: every field is classified there) are never
half-applied: their running values are kept and each changed path is logged as needing a
restart.

A reload never raises: it runs in the file watcher's task and in the SIGHUP handler, and
an exception escaping either would end the watcher for good (or the loop, and with it
the drain at SIGTERM). Whatever goes wrong, even a bug while applying, is logged and
counted as a rejected reload (``on_outcome``).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

from .config import (
    ConfigError,
    RouterConfig,
    keep_restart_only,
    load_config,
    log_warnings,
    restart_only_changes,
)

__all__ = ["ConfigReloader"]

log = logging.getLogger("continuum.reload")


class Reloadable(Protocol):
    """What a reload changes: the running config and whatever applies it (the router)."""

    config: RouterConfig

    def apply_config(self, config: RouterConfig) -> None: ...


class ConfigReloader:
    def __init__(
        self,
        path: str | Path,
        router: Reloadable,
        poll_interval_s: float = 1.0,
        *,
        on_apply: Sequence[Callable[[RouterConfig], None]] = (),
        on_outcome: Callable[[bool], None] | None = None,
    ) -> None:
        self.path = Path(path)
        self.router = router
        self.poll_interval_s = poll_interval_s
        self.on_apply = list(on_apply)
        """Called with each applied config, after the router (e.g. the event bus's
        credentials, which live beside the router rather than in it)."""
        self.on_outcome = on_outcome or (lambda applied: None)
        """Told whether each reload applied (the reload counter)."""
        self._digest = self._file_digest()

    def _file_digest(self) -> bytes | None:
        try:
            return hashlib.sha256(self.path.read_bytes()).digest()
        except OSError:
            return None

    def reload(self, reason: str) -> bool:
        """Load, validate and apply the file; returns whether a new config is serving."""
        try:
            applied = self._reload(reason)
        except Exception:
            log.exception("reload (%s) failed", reason)
            log.error("reload (%s) rejected: keeping the running config", reason)
            applied = False
        self.on_outcome(applied)
        return applied

    def _reload(self, reason: str) -> bool:
        self._digest = self._file_digest()
        try:
            new, issues = load_config(self.path)
        except ConfigError as exc:
            for issue in exc.issues:
                log.error("reload (%s) rejected: %s: %s", reason, issue.path, issue.message)
            log.error("reload (%s) rejected: keeping the running config", reason)
            return False
        old = self.router.config
        changed = restart_only_changes(old, new)
        for path in changed:
            log.warning("reload: %s changed; it applies only after a restart", path)
        if changed:
            new = keep_restart_only(old, new, changed)
        log_warnings(issues)
        self.router.apply_config(new)
        for hook in self.on_apply:
            hook(new)
        log.info("config reloaded (%s)", reason)
        return True

    async def watch(self) -> None:
        """Poll the file's contents; cheap, and robust to editors that replace the file."""
        while True:
            await asyncio.sleep(self.poll_interval_s)
            digest = self._file_digest()
            if digest is not None and digest != self._digest:
                self.reload("file changed")
