"""Config plumbing shared by router and listener: issues named by YAML path, YAML reading.

Both processes load YAML into pydantic models and must report problems the same way
(``error: prefix_routing.virtual_nodes: ...``), so the pieces live here once.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from .errors import BusError

M = TypeVar("M", bound=BaseModel)

__all__ = [
    "ConfigError",
    "ConfigIssue",
    "clean_message",
    "duplicate_names",
    "log_warnings",
    "parse_duration",
    "parse_hostport",
    "parse_validated",
    "parse_yaml",
    "read_yaml",
    "validation_issues",
    "yaml_path",
]

_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")
_UNIT_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, None: 1.0}


def parse_duration(value: str | int | float) -> float:
    """``"250ms"``, ``"30s"``, ``"5m"``, ``"1h"``, ``"1d"`` or a number of seconds, in seconds.

    The one duration syntax of both configs (router and listener).
    """
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    m = _DURATION_RE.match(str(value))
    if not m:
        raise ValueError(f'expected a duration like "500ms", "30s", "5m" or "1h", got {value!r}')
    return float(m.group(1)) * _UNIT_S[m.group(2)]


_HOSTPORT_RE = re.compile(
    r"^(?:\[(?P<v6>[0-9A-Fa-f:.]+)\]|(?P<host>[^:\[\]\s]+)):(?P<port>\d{1,5})$"
)


@dataclass(frozen=True, slots=True)
class ConfigIssue:
    severity: Literal["error", "warning"]
    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.severity}: {self.path}: {self.message}"


class ConfigError(BusError):
    """The file cannot be used; ``issues`` lists every error found, each with its path."""

    def __init__(self, issues: list[ConfigIssue]) -> None:
        self.issues = issues
        super().__init__("; ".join(str(i) for i in issues))


def parse_hostport(value: str) -> tuple[str, int]:
    """Split ``host:port`` (``[v6]:port`` for IPv6); raises ValueError naming the problem."""
    m = _HOSTPORT_RE.match(value)
    if not m:
        raise ValueError(f'expected "host:port", got {value!r}')
    port = int(m.group("port"))
    if port > 65535:
        raise ValueError(f"port {port} is out of range 0-65535")
    return (m.group("v6") or m.group("host"), port)


def duplicate_names(names: Sequence[str], section: str, field: str, what: str) -> list[ConfigIssue]:
    """An error per repeated name of a list section (``backends[3].name``), naming the first.

    ``what`` is how the message calls the name (``backend name``).

    The names key per-backend state in both processes (streams, index entries, metrics
    labels), so two entries with one name would silently share it.
    """
    issues: list[ConfigIssue] = []
    first: dict[str, int] = {}
    for i, name in enumerate(names):
        if name in first:
            issues.append(
                ConfigIssue(
                    "error",
                    f"{section}[{i}].{field}",
                    f"duplicate {what} {name!r} (first at {section}[{first[name]}])",
                )
            )
        else:
            first[name] = i
    return issues


def yaml_path(loc: Iterable[Any]) -> str:
    """``("backends", 0, "url")`` -> ``backends[0].url``.

    pydantic puts union member names (``literal['a','b']``, ``ModelName``) into error
    locations; they are not YAML keys, so they are left out.
    """
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part[:1].isupper() or "[" in part:
            continue
        else:
            out += f".{part}" if out else str(part)
    return out or "(root)"


def clean_message(msg: str) -> str:
    for prefix in ("Value error, ", "Assertion failed, "):
        if msg.startswith(prefix):
            return msg[len(prefix) :]
    return msg


def validation_issues(exc: ValidationError) -> list[ConfigIssue]:
    """One error issue per distinct (path, message) of a pydantic ValidationError."""
    issues: list[ConfigIssue] = []
    seen: set[tuple[str, str]] = set()
    for e in exc.errors(include_url=False):
        path = yaml_path(e["loc"])
        message = "unknown field" if e["type"] == "extra_forbidden" else clean_message(e["msg"])
        if (path, message) not in seen:
            seen.add((path, message))
            issues.append(ConfigIssue("error", path, message))
    return issues


def parse_validated(
    model: type[M],
    data: Any,
    source: str,
    check: Callable[[M], list[ConfigIssue]],
    to_issues: Callable[[ValidationError], list[ConfigIssue]] = validation_issues,
) -> tuple[M, list[ConfigIssue]]:
    """Parsed YAML -> ``model``: field errors, then cross-field ``check``.

    Raises ConfigError with every error; returns the config and its warnings.
    """
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(
            [ConfigIssue("error", "(root)", f"{source}: expected a mapping at the top level")]
        )
    try:
        cfg = model.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(to_issues(exc)) from None
    issues = check(cfg)
    errors = [i for i in issues if i.severity == "error"]
    if errors:
        raise ConfigError(errors)
    return cfg, issues


def read_yaml(path: str | Path) -> Any:
    """Parse a YAML file; ConfigError names the line and column of a syntax error."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError([ConfigIssue("error", "(file)", f"cannot read {path}: {exc}")]) from None
    return parse_yaml(data, path)


def parse_yaml(data: bytes, path: str | Path) -> Any:
    """Parse a YAML file's bytes (read once by a caller that also hashes them); ConfigError
    says when they are not UTF-8 or not YAML."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            [ConfigIssue("error", "(file)", f"{path}: not UTF-8 text (byte {exc.start})")]
        ) from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(
            [ConfigIssue("error", "(yaml)", f"{path}: invalid YAML{where}: {problem}")]
        ) from None


def log_warnings(issues: Iterable[ConfigIssue], logger: logging.Logger) -> None:
    for issue in issues:
        if issue.severity == "warning":
            logger.warning("config %s: %s", issue.path, issue.message)
