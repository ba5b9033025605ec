"""Tier 4's import direction: the index knows nothing of where its events come from.

``router.kvindex`` (the index) and ``router.ingest`` (reading event streams) import
neither each other nor the event bus; ``router.eventbus`` imports ``router.ingest`` for
the opener seam; ``router.kv_runtime`` is where they meet. Read from the sources (no
import side effects), so a violating import fails here even if nothing executes it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROUTER = Path(__file__).resolve().parents[2] / "router"


def _imports(package: str) -> set[str]:
    """Absolute names of the ``router.*`` modules a package's files import."""
    found: set[str] = set()
    for path in (ROUTER / package).glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                if node.level:  # relative: resolve against router/<package>/
                    base = ["router", package][: max(0, 3 - node.level)]
                    name = ".".join([*base, node.module] if node.module else base)
                else:
                    name = node.module or ""
                found.add(name)
            elif isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
    return {n for n in found if n == "router" or n.startswith("router.")}


@pytest.mark.parametrize(
    ("package", "forbidden"),
    [
        ("kvindex", ("router.ingest", "router.eventbus", "router.kv_runtime")),
        ("ingest", ("router.kvindex", "router.eventbus", "router.kv_runtime", "router.redis")),
        ("redis", ("router.kvindex", "router.cache", "router.ingest")),
    ],
)
def test_package_imports_stay_one_way(package: str, forbidden: tuple[str, ...]) -> None:
    imported = _imports(package)
    assert imported, f"router/{package} imports nothing from router: the check is broken"
    bad = sorted(n for n in imported if n.startswith(forbidden))
    assert not bad, f"router.{package} imports {bad}"


def test_the_event_bus_hub_takes_the_opener_seam_from_ingest() -> None:
    assert "router.ingest" in _imports("eventbus")
