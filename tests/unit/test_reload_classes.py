"""Every router config field is either applied by a reload or restart-only, and README
says which."""

from __future__ import annotations

from pathlib import Path

from router.config import (
    RELOADABLE,
    RESTART_ONLY,
    RouterConfig,
    keep_restart_only,
    parse_config,
    restart_only_changes,
)
from router.config.reloading import readme_summary
from tests.config_fields import leaf_paths

README = Path(__file__).resolve().parents[2] / "README.md"
BEGIN, END = "<!-- reload-classes: begin -->\n", "<!-- reload-classes: end -->"


def test_every_field_is_classified_once() -> None:
    fields = leaf_paths(RouterConfig)
    unclassified = [p for p in fields if p not in RELOADABLE and p not in RESTART_ONLY]
    assert not unclassified, (
        "add each of these YAML paths to RELOADABLE (Router.apply_config applies it) or "
        f"RESTART_ONLY in router/config/reloading.py: {unclassified}"
    )
    both = sorted(set(RELOADABLE) & set(RESTART_ONLY))
    assert not both, f"classified both ways: {both}"
    stale = [p for p in (*RELOADABLE, *RESTART_ONLY) if p not in fields]
    assert not stale, f"no such field (renamed or removed?): {stale}"
    assert len(set(RELOADABLE)) == len(RELOADABLE) and len(set(RESTART_ONLY)) == len(RESTART_ONLY)


def test_list_items_are_classified_alike() -> None:
    """A restart-only field inside list items is compared as the whole list, so the items'
    fields must share one class."""
    lists: dict[str, set[bool]] = {}
    for path in (*RELOADABLE, *RESTART_ONLY):
        if "[]" in path:
            lists.setdefault(path.split("[]", 1)[0], set()).add(path in RELOADABLE)
    mixed = [name for name, classes in lists.items() if len(classes) > 1]
    assert not mixed, f"list items with fields of both classes: {mixed}"


def test_readme_lists_what_reloads() -> None:
    text = README.read_text(encoding="utf-8")
    assert BEGIN in text and END in text, f"README.md lost its {BEGIN.strip()} block"
    block = text.split(BEGIN, 1)[1].split(END, 1)[0]
    assert block == readme_summary(), (
        "README.md's hot-reload list differs from router/config/reloading.py; replace the "
        f"block between the reload-classes markers with:\n{readme_summary()}"
    )


def config(**sections: object) -> RouterConfig:
    base: dict[str, object] = {"backends": [{"name": "b1", "url": "http://e:8000"}]}
    return parse_config({**base, **sections})[0]


def test_changes_name_the_leaf_path_or_the_optional_block() -> None:
    old = config(kv_cache_index={"enabled": True})
    new = config(
        kv_cache_index={
            "enabled": True,
            "scoring": {"overlap_weight": 0.5, "load_weight": 0.4},
            "event_sources": [{"backend_name": "b1", "endpoint": "http://l:7817/events/b1"}],
        },
        response_cache={"redis": {"url": "redis://r:6379"}},
        prefix_routing={"enabled": True},
    )
    changed = restart_only_changes(old, new)
    assert changed == [
        "response_cache.redis",
        "kv_cache_index.scoring.overlap_weight",
        "kv_cache_index.scoring.load_weight",
    ]
    kept = keep_restart_only(old, new)
    assert kept.kv_cache_index.scoring == old.kv_cache_index.scoring
    assert kept.response_cache.redis is None
    # What reloads is taken from the new file.
    assert kept.kv_cache_index.event_sources == new.kv_cache_index.event_sources
    assert kept.prefix_routing.enabled is True
    assert restart_only_changes(old, kept) == []


def test_a_restart_only_list_is_compared_whole() -> None:
    old = config(gemini_context_cache={"enabled": False})
    new = config(dynamo={"event_bus": {"max_sessions": 9}})
    assert restart_only_changes(old, new) == ["dynamo.event_bus.max_sessions"]
    templates = {"templates": [{"model": "m", "chat_template": "/nonexistent.jinja"}]}
    a = RouterConfig.model_validate({"kv_cache_index": {"conversation": templates}})
    b = RouterConfig.model_validate({})
    assert restart_only_changes(a, b) == ["kv_cache_index.conversation.templates"]
    assert keep_restart_only(a, b).kv_cache_index.conversation == a.kv_cache_index.conversation
