"""Passive health of the backend pool: consecutive connect failures eject, a success
resets the count, and a backend without an active probe comes back through a half-open
retry after the cool-down (a clock is injected, so no test waits)."""

from __future__ import annotations

from typing import Any

import pytest

from router.config import ConfigError, parse_config
from router.pool import BackendPool


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_pool(
    backend_type: str = "anthropic", clock: Clock | None = None, **health: Any
) -> tuple[BackendPool, Clock]:
    cfg, _ = parse_config(
        {
            "health_check": health,
            "backends": [
                {"name": "a", "url": "http://h:1", "type": backend_type, "models": ["m"]},
                {"name": "b", "url": "http://h:2", "type": backend_type, "models": ["m"]},
            ],
        }
    )
    clock = clock or Clock()
    return BackendPool(cfg.backends, cfg.health_check, clock=clock), clock


def names(pool: BackendPool, endpoint: str = "anthropic") -> list[str]:
    return [b.name for b in pool.candidates("m", endpoint)[0]]  # type: ignore[arg-type]


def test_failures_must_be_consecutive_a_success_resets_the_count() -> None:
    pool, _ = make_pool()
    a = pool.get("a")
    assert a is not None
    for _ in range(10):  # a flaky backend: two failures, then a success, forever
        pool.connect_failed(a)
        pool.connect_failed(a)
        pool.connect_succeeded(a)
    assert a.state == "healthy"
    assert names(pool) == ["a", "b"]


def test_threshold_consecutive_failures_eject() -> None:
    pool, _ = make_pool(unhealthy_threshold=3)
    a = pool.get("a")
    assert a is not None
    pool.connect_failed(a)
    pool.connect_failed(a)
    assert names(pool) == ["a", "b"]
    pool.connect_failed(a)
    assert a.state == "ejected"
    assert names(pool) == ["b"]


@pytest.mark.parametrize(
    ("backend_type", "health"),
    [("anthropic", {}), ("gemini", {}), ("vllm", {"enabled": False})],
    ids=["anthropic", "gemini", "vllm-without-health-checks"],
)
def test_a_backend_without_a_probe_comes_back_half_open_after_the_cool_down(
    backend_type: str, health: dict[str, Any]
) -> None:
    endpoint = "anthropic" if backend_type == "anthropic" else "chat"
    pool, clock = make_pool(backend_type, ejection_cooldown_ms=5_000, **health)
    a = pool.get("a")
    assert a is not None
    for _ in range(3):
        pool.connect_failed(a)
    assert names(pool, endpoint) == ["b"]
    clock.now += 4.9
    assert names(pool, endpoint) == ["b"]
    assert a.state == "ejected"
    clock.now += 0.2
    assert names(pool, endpoint) == ["a", "b"]  # half-open: it gets a trial request
    assert a.state == "half_open"
    pool.connect_succeeded(a)
    assert a.state == "healthy"
    assert a.consecutive_failures == 0
    assert names(pool, endpoint) == ["a", "b"]


def test_a_half_open_backend_that_fails_again_is_ejected_for_another_cool_down() -> None:
    pool, clock = make_pool(ejection_cooldown_ms=1_000)
    a = pool.get("a")
    assert a is not None
    for _ in range(3):
        pool.connect_failed(a)
    clock.now += 1.0
    assert names(pool) == ["a", "b"]
    pool.connect_failed(a)  # one failure is enough while half-open
    assert a.state == "ejected"
    assert names(pool) == ["b"]
    clock.now += 0.5
    assert names(pool) == ["b"]
    clock.now += 0.5
    assert names(pool) == ["a", "b"]
    assert a.state == "half_open"


def test_a_probed_backend_waits_for_its_probe_not_for_the_cool_down() -> None:
    pool, clock = make_pool("vllm", ejection_cooldown_ms=1_000)
    a = pool.get("a")
    assert a is not None
    for _ in range(3):
        pool.connect_failed(a)
    clock.now += 3600
    assert names(pool, "chat") == ["b"]
    assert a.state == "ejected"


def test_state_survives_a_reload_and_a_probe_switched_off_starts_the_cool_down() -> None:
    pool, clock = make_pool("vllm", ejection_cooldown_ms=1_000)
    a = pool.get("a")
    assert a is not None
    for _ in range(3):
        pool.connect_failed(a)
    cfg, _ = parse_config(
        {
            "health_check": {"enabled": False, "ejection_cooldown_ms": 1_000},
            "backends": [
                {"name": "a", "url": "http://h:1", "type": "vllm", "models": ["m"]},
                {"name": "b", "url": "http://h:2", "type": "vllm", "models": ["m"]},
            ],
        }
    )
    pool.update(cfg.backends, cfg.health_check)
    assert a.state == "ejected"
    assert names(pool, "chat") == ["b"]
    clock.now += 1.0
    assert names(pool, "chat") == ["a", "b"]


def test_the_cool_down_is_validated() -> None:
    with pytest.raises(ConfigError) as err:
        parse_config({"health_check": {"ejection_cooldown_ms": 0}})
    assert "health_check.ejection_cooldown_ms" in str(err.value)
