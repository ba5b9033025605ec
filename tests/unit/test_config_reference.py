"""The reference examples document every option of the typed config models with its
default (``tests/config_fields.py``: the convention), and the router's is a valid config
(the listener's: ``test_listener_config.py``, ``--check``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import BaseModel

from listener.config.models import ListenerConfig
from router.config.models import RouterConfig
from tests.config_fields import EXAMPLE_CONVENTION, check_example

ROOT = Path(__file__).resolve().parents[2]
ROUTER_EXAMPLE = ROOT / "deploy" / "config.example.yaml"
LISTENER_EXAMPLE = ROOT / "config.kv-listener.yaml.example"

NOT_OPTIONS: dict[type[BaseModel], tuple[str, ...]] = {
    # Accepts nothing: an inline token is rejected with a pointer to the two ways.
    ListenerConfig: ("event_bus.credential",),
}

EXAMPLES = [
    pytest.param(RouterConfig, ROUTER_EXAMPLE, id="router"),
    pytest.param(ListenerConfig, LISTENER_EXAMPLE, id="listener"),
]


def problems(model: type[BaseModel], text: str) -> list[str]:
    return check_example(model, text, NOT_OPTIONS.get(model, ()))


@pytest.mark.parametrize(("model", "example"), EXAMPLES)
def test_example_documents_every_field_with_its_default(
    model: type[BaseModel], example: Path
) -> None:
    found = problems(model, example.read_text(encoding="utf-8"))
    assert not found, (
        f"{example.relative_to(ROOT)}:\n  " + "\n  ".join(found) + (f"\n\n{EXAMPLE_CONVENTION}")
    )


def test_router_example_validates() -> None:
    cmd = [sys.executable, "-m", "router", "config", "validate", str(ROUTER_EXAMPLE)]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "ok (0 warning(s))" in done.stdout, done.stdout


# -- the check itself: each kind of mistake is named by its YAML path --------------------

TEXT = ROUTER_EXAMPLE.read_text(encoding="utf-8")


def edited(old: str, new: str, text: str = TEXT) -> str:
    assert old in text, old
    return text.replace(old, new, 1)


def test_a_missing_field_is_named() -> None:
    text = edited("    load_weight: 0.3\n", "")
    assert problems(RouterConfig, text) == [
        "kv_cache_index.scoring.load_weight: missing; document it (its default: 0.3)"
    ]
    text = edited("    health_path: /health ", "    x_health_path: /health ")
    assert problems(RouterConfig, text)[-1] == (
        "backends[].health_path: missing in one of the items; document it (its default: unset)"
    )


def test_a_value_other_than_the_default_is_named() -> None:
    text = edited("  timeout_ms: 2000\n", "  timeout_ms: 2500\n")
    (found,) = problems(RouterConfig, text)
    assert found.startswith("health_check.timeout_ms (line ") and found.endswith(
        ": 2500 is not the code's default 2000: set 2000, or keep the example and start "
        "the comment with '# default 2000'"
    ), found
    # In a commented-out block too.
    text = edited("#   pool_size: 8 ", "#   pool_size: 9 ")
    (found,) = problems(RouterConfig, text)
    assert found.startswith("response_cache.redis.pool_size (line "), found


def test_a_wrong_stated_default_is_named() -> None:
    text = edited(
        "  enabled: true                   # default false\n  backend: memory",
        "  enabled: true                   # default true\n  backend: memory",
    )
    (found,) = problems(RouterConfig, text)
    assert found.startswith("response_cache.enabled (line "), found
    assert found.endswith(": the comment says default true, the code's default is false")


def test_an_unknown_key_and_broken_commented_yaml_are_named() -> None:
    text = edited("  virtual_nodes: 150 ", "  virtual_node: 150 ")
    found = problems(RouterConfig, text)
    assert found[0].startswith("prefix_routing.virtual_node (line "), found
    assert found[0].endswith("not a field of PrefixRoutingConfig")
    assert "prefix_routing.virtual_nodes: missing; document it (its default: 150)" in found
    # A prose comment line that reads as a setting is named as one, with its line.
    text = edited("  interval_ms: 10000\n", "  interval_ms: 10000\n  # note: see below\n")
    (note,) = problems(RouterConfig, text)
    assert note.startswith("health_check.note (line "), note
    assert note.endswith("): not a field of HealthCheckConfig"), note
    # One that breaks the uncommented file is said so.
    text = edited("  interval_ms: 10000\n", "  interval_ms: 10000\n  # note: a: b\n")
    (found_yaml,) = problems(RouterConfig, text)
    assert "commented-out settings made live is not YAML" in found_yaml, found_yaml
