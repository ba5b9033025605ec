"""Config loading: errors and warnings name the YAML path; `config validate` exit codes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from router.config import ConfigError, load_config, parse_config, restart_only_changes


def errors_of(data: object) -> dict[str, str]:
    with pytest.raises(ConfigError) as ei:
        parse_config(data)
    return {i.path: i.message for i in ei.value.issues}


def test_defaults_are_the_seeds() -> None:
    cfg, warnings = parse_config({"backends": [{"name": "a", "url": "http://h:1"}]})
    pr = cfg.prefix_routing
    assert (pr.enabled, pr.max_prefix_length, pr.load_factor_epsilon, pr.virtual_nodes) == (
        False,
        1024,
        0.25,
        150,
    )
    assert pr.anthropic_cache_control_injection is False
    assert cfg.backends[0].anthropic_auto_cache_control is True
    assert cfg.backends[0].type == "openai" and cfg.backends[0].weight == 1
    assert warnings == []


@pytest.mark.parametrize(
    ("data", "path"),
    [
        ({"prefix_routing": {"load_factor_epsilon": 0.001}}, "prefix_routing.load_factor_epsilon"),
        ({"prefix_routing": {"load_factor_epsilon": 10.5}}, "prefix_routing.load_factor_epsilon"),
        ({"prefix_routing": {"virtual_nodes": 0}}, "prefix_routing.virtual_nodes"),
        ({"prefix_routing": {"max_prefix_length": 0}}, "prefix_routing.max_prefix_length"),
        ({"prefix_routing": {"virtual_node": 5}}, "prefix_routing.virtual_node"),
        ({"selection_strategy": "Fastest"}, "selection_strategy"),
        ({"server": {"listen": "8080"}}, "server.listen"),
        ({"server": {"grpc_listen": "host:99999"}}, "server.grpc_listen"),
        ({"backends": [{"name": "a", "url": "ftp://x"}]}, "backends[0].url"),
        ({"backends": [{"name": "bad name", "url": "http://x"}]}, "backends[0].name"),
        ({"backends": [{"name": "trailing-lf\n", "url": "http://x"}]}, "backends[0].name"),
        ({"backends": [{"name": "a", "url": "http://x", "type": "tgi"}]}, "backends[0].type"),
        ({"backends": [{"name": "a", "url": "http://x", "weight": 0}]}, "backends[0].weight"),
        ({"backends": [{"url": "http://x"}]}, "backends[0].name"),
        ({"health_check": {"interval_ms": 5}}, "health_check.interval_ms"),
        ({"unknown_section": {}}, "unknown_section"),
    ],
)
def test_errors_name_the_yaml_path(data: dict, path: str) -> None:
    assert path in errors_of(data)


def test_duplicate_backend_names() -> None:
    errs = errors_of(
        {"backends": [{"name": "a", "url": "http://x"}, {"name": "a", "url": "http://y"}]}
    )
    assert "duplicate" in errs["backends[1].name"]


def test_prefix_aware_hash_without_prefix_routing_warns_on_selection_strategy() -> None:
    _, warnings = parse_config(
        {"selection_strategy": "PrefixAwareHash", "backends": [{"name": "a", "url": "http://x"}]}
    )
    assert [w.path for w in warnings] == ["selection_strategy"]
    _, none = parse_config(
        {
            "selection_strategy": "PrefixAwareHash",
            "prefix_routing": {"enabled": True},
            "backends": [{"name": "a", "url": "http://x"}],
        }
    )
    assert none == []


def test_top_level_must_be_a_mapping_and_yaml_errors_have_line(tmp_path: Path) -> None:
    assert "(root)" in errors_of([1, 2])
    bad = tmp_path / "bad.yaml"
    bad.write_text("server:\n  listen: [unclosed\n")
    with pytest.raises(ConfigError) as ei:
        load_config(bad)
    assert "line" in str(ei.value)


def test_restart_only_changes() -> None:
    a, _ = parse_config({"server": {"listen": "127.0.0.1:1"}})
    b, _ = parse_config({"server": {"listen": "127.0.0.1:2"}, "selection_strategy": "Random"})
    assert restart_only_changes(a, b) == ["server.listen"]


def _validate(tmp_path: Path, text: str) -> subprocess.CompletedProcess[str]:
    f = tmp_path / "c.yaml"
    f.write_text(text)
    return subprocess.run(
        [sys.executable, "-m", "router", "config", "validate", str(f)],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_cli_validate_ok_with_warning(tmp_path: Path) -> None:
    r = _validate(
        tmp_path,
        "selection_strategy: PrefixAwareHash\nbackends:\n  - {name: a, url: 'http://x:1'}\n",
    )
    assert r.returncode == 0, r.stderr
    assert "warning: selection_strategy:" in r.stderr


def test_cli_validate_errors_exit_1(tmp_path: Path) -> None:
    r = _validate(tmp_path, "prefix_routing:\n  load_factor_epsilon: 42\n")
    assert r.returncode == 1
    assert "error: prefix_routing.load_factor_epsilon:" in r.stderr


def _kv(**kv: object) -> dict:
    return {
        "prefix_routing": {"enabled": True},
        "backends": [{"name": "a", "url": "http://x", "type": "vllm"}],
        "kv_cache_index": {"enabled": True, **kv},
    }


def test_kv_scoring_weights_must_sum_to_one() -> None:
    errs = errors_of(_kv(scoring={"overlap_weight": 0.5, "load_weight": 0.3, "health_weight": 0.1}))
    assert "sum to 1.0" in errs["kv_cache_index.scoring"]
    parse_config(_kv(scoring={"overlap_weight": 0.5, "load_weight": 0.4, "health_weight": 0.1}))


def test_kv_gpu_tier_weight_below_threshold_warns_on_its_path() -> None:
    _, warnings = parse_config(_kv(scoring={"gpu_tier_weight": 0.2, "min_overlap_threshold": 0.3}))
    assert [w.path for w in warnings] == ["kv_cache_index.scoring.gpu_tier_weight"]


@pytest.mark.parametrize(
    ("kv", "path"),
    [
        ({"max_entries": 50}, "kv_cache_index.max_entries"),
        ({"entry_ttl_seconds": 0}, "kv_cache_index.entry_ttl_seconds"),
        ({"backend": "redis"}, "kv_cache_index.backend"),
        ({"event_sources": [{"backend_name": "zz", "endpoint": "http://l/e"}]},
         "kv_cache_index.event_sources[0].backend_name"),
        ({"event_sources": [{"backend_name": "a", "endpoint": "ftp://l"}]},
         "kv_cache_index.event_sources[0].endpoint"),
        ({"event_sources": [{"backend_name": "a"}]}, "kv_cache_index.event_sources[0].endpoint"),
    ],
)  # fmt: skip
def test_kv_errors_name_the_path(kv: dict, path: str) -> None:
    assert path in errors_of(_kv(**kv))


def test_cache_salt_needs_a_secret_and_a_salting_engine() -> None:
    cfg = _kv()
    cfg["backends"] = [
        {"name": "a", "url": "http://x", "type": "vllm", "cache_salt": True},
        {"name": "b", "url": "http://y", "type": "openai", "cache_salt": True},
    ]
    with pytest.raises(ConfigError) as ei:
        parse_config(cfg)
    msgs = {(i.path, i.message) for i in ei.value.issues}
    assert any(p == "backends[0].cache_salt" and "secret" in m for p, m in msgs)
    assert any(p == "backends[1].cache_salt" and "not openai" in m for p, m in msgs)


def test_kv_cache_index_and_cache_backend_are_restart_only() -> None:
    a, _ = parse_config(_kv())
    b, _ = parse_config({**_kv(max_entries=500), "response_cache": {"capacity": 5}})
    assert restart_only_changes(a, b) == ["kv_cache_index.max_entries"]  # capacity hot-reloads


def _redis(**redis: object) -> dict:
    return {
        "backends": [{"name": "a", "url": "http://x"}],
        "response_cache": {"backend": "redis", "redis": redis},
    }


SENTINEL = {"master_name": "m", "addresses": ["127.0.0.1:26379"]}
CLUSTER = {"startup_nodes": ["127.0.0.1:7000", "[::1]:7001"]}


@pytest.mark.parametrize(
    ("redis", "path", "says"),
    [
        ({"mode": "sentinel"}, "response_cache.redis", "needs a sentinel section"),
        ({"mode": "cluster"}, "response_cache.redis", "needs a cluster section"),
        ({"cluster": CLUSTER}, "response_cache.redis", "needs mode: cluster"),
        ({"mode": "sentinel", "sentinel": SENTINEL, "cluster": CLUSTER},
         "response_cache.redis", "needs mode: cluster"),
        ({"mode": "cluster", "cluster": {"startup_nodes": []}},
         "response_cache.redis.cluster.startup_nodes", "at least 1"),
        ({"mode": "cluster", "cluster": {}},
         "response_cache.redis.cluster.startup_nodes", "required"),
        ({"mode": "cluster", "cluster": {"startup_nodes": ["nohost"]}},
         "response_cache.redis.cluster.startup_nodes", "host:port"),
        ({"mode": "cluster", "cluster": {"startup_nodes": ["h:0"]}},
         "response_cache.redis.cluster.startup_nodes", "port 0"),
        ({"mode": "cluster", "cluster": {"startup_nodes": "h:1"}},
         "response_cache.redis.cluster.startup_nodes", "list"),
        ({"mode": "cluster", "cluster": {**CLUSTER, "seeds": ["h:1"]}},
         "response_cache.redis.cluster.seeds", "unknown field"),
        ({"sentinel": SENTINEL}, "response_cache.redis", "needs mode: sentinel"),
        ({"mode": "sideways"}, "response_cache.redis.mode", "standalone"),
        ({"mode": "sentinel", "sentinel": {"addresses": ["h:1"]}},
         "response_cache.redis.sentinel.master_name", "required"),
        ({"mode": "sentinel", "sentinel": {"master_name": "m", "addresses": []}},
         "response_cache.redis.sentinel.addresses", "at least 1"),
        ({"mode": "sentinel", "sentinel": {"master_name": "m", "addresses": ["nohost"]}},
         "response_cache.redis.sentinel.addresses", "host:port"),
        ({"mode": "sentinel", "sentinel": {"master_name": "m", "addresses": ["h:0"]}},
         "response_cache.redis.sentinel.addresses", "port 0"),
        ({"mode": "sentinel", "sentinel": {**SENTINEL, "pasword": "x"}},
         "response_cache.redis.sentinel.pasword", "unknown field"),
        ({"mode": "sentinel", "sentinel": {"master_name": "m", "addresses": ["h:99999"]}},
         "response_cache.redis.sentinel.addresses", "out of range"),
    ],
)  # fmt: skip
def test_redis_mode_errors_name_the_path(redis: dict, path: str, says: str) -> None:
    errs = errors_of(_redis(**redis))
    assert path in errs, errs
    assert says in errs[path], errs


def test_cluster_config_parses() -> None:
    cfg, _ = parse_config(_redis(mode="cluster", password="p", tls=True, cluster=CLUSTER))
    r = cfg.response_cache.redis
    assert r is not None and r.mode == "cluster" and r.cluster is not None
    assert r.cluster.startup_nodes == CLUSTER["startup_nodes"]


def test_kv_index_on_a_cluster_is_accepted(tmp_path: Path) -> None:
    cfg = {**_redis(mode="cluster", cluster=CLUSTER), "kv_cache_index": {"backend": "redis"}}
    parsed, issues = parse_config(cfg)
    assert parsed.kv_cache_index.backend == "redis"
    assert not [i for i in issues if i.path.startswith("kv_cache_index")], issues
    r = _validate(
        tmp_path,
        "response_cache:\n  backend: redis\n  redis:\n    mode: cluster\n"
        "    cluster: {startup_nodes: ['127.0.0.1:7000']}\n"
        "kv_cache_index: {enabled: true, backend: redis}\n",
    )
    assert r.returncode == 0, r.stderr


def test_sentinel_config_parses() -> None:
    cfg, _ = parse_config(
        _redis(
            mode="sentinel",
            password="p",
            tls=True,
            sentinel={**SENTINEL, "password": "sp", "username": "u", "tls": True, "db": 2},
        )
    )
    assert cfg.response_cache.redis is not None
    s = cfg.response_cache.redis.sentinel
    assert s is not None and (s.master_name, s.password, s.db) == ("m", "sp", 2)
    cfg, _ = parse_config(
        _redis(mode="sentinel", sentinel={"master_name": "m", "addresses": ["a:1", "[::1]:2"]})
    )
    assert cfg.response_cache.redis is not None and cfg.response_cache.redis.mode == "sentinel"
