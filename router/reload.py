"""Hot reload: SIGHUP or a change of the config file's contents.

A new file is loaded and validated whole before anything is applied: an invalid file
is rejected with its errors logged and the running config keeps serving. So is an empty
one (no YAML document): it would validate as a config without backends, and it is what
a file written in place looks like between its truncation and its write. The watcher
applies a change only once the file held the same bytes for a whole poll interval, and
parses exactly the bytes it hashed, so a file caught half-written (a valid prefix, say,
with half the backends) is not applied. Restart-only fields (``router.config.reloading``:
every field is classified there) are never half-applied: their running values are kept
and each changed path is logged as needing a restart.

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

from bus.config import ConfigIssue, parse_yaml

from .config import (
    ConfigError,
    RouterConfig,
    keep_restart_only,
    log_warnings,
    parse_config,
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
        self._pending: bytes | None = None
        """A changed digest seen at the last poll, reloaded if the next poll sees it too."""

    def _read(self) -> bytes | None:
        try:
            return self.path.read_bytes()
        except OSError:
            return None

    def _file_digest(self) -> bytes | None:
        data = self._read()
        return None if data is None else hashlib.sha256(data).digest()

    def reload(self, reason: str, data: bytes | None = None) -> bool:
        """Load, validate and apply the file (``data``: its bytes, already read); returns
        whether a new config is serving."""
        try:
            applied = self._reload(reason, data)
        except Exception:
            log.exception("reload (%s) failed", reason)
            log.error("reload (%s) rejected: keeping the running config", reason)
            applied = False
        self.on_outcome(applied)
        return applied

    def _load(self, data: bytes | None) -> tuple[RouterConfig, list[ConfigIssue]]:
        if data is None:
            try:
                data = self.path.read_bytes()
            except OSError as exc:
                self._digest = None
                raise ConfigError(
                    [ConfigIssue("error", "(file)", f"cannot read {self.path}: {exc}")]
                ) from None
        self._digest = hashlib.sha256(data).digest()
        raw = parse_yaml(data, self.path)
        if raw is None:
            raise ConfigError(
                [ConfigIssue("error", "(file)", f"{self.path}: empty (no YAML document)")]
            )
        return parse_config(raw, str(self.path))

    def _reload(self, reason: str, data: bytes | None) -> bool:
        try:
            new, issues = self._load(data)
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

    def poll(self) -> bool | None:
        """One look at the file: a change is reloaded when this poll sees the same bytes as
        the last one (the writer is done); returns the reload's outcome, None if none ran."""
        data = self._read()
        digest = None if data is None else hashlib.sha256(data).digest()
        if digest is None or digest == self._digest or digest != self._pending:
            self._pending = None if digest == self._digest else digest
            return None
        self._pending = None
        return self.reload("file changed", data)

    async def watch(self) -> None:
        """Poll the file's contents; cheap, and robust to editors that replace the file."""
        while True:
            await asyncio.sleep(self.poll_interval_s)
            self.poll()
