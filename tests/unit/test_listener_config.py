"""Listener config: defaults, YAML paths in every error, cross-field rules, the example file,
and the ``--check``/``--help`` command line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from listener.cli import main
from listener.config import (
    ChatTemplateMarkers,
    ConfigError,
    ListenerConfig,
    load_listener_config,
    parse_listener_config,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = REPO_ROOT / "config.kv-listener.yaml.example"


def vllm(**kw: Any) -> dict[str, Any]:
    src: dict[str, Any] = {
        "backend_name": "vllm-1",
        "engine": "vllm",
        "zmq_endpoint": "tcp://127.0.0.1:5557",
        "detokenize_endpoint": "http://127.0.0.1:8000/detokenize",
        "model": "m",
    }
    src.update(kw)
    return {k: v for k, v in src.items() if v is not None}


def trtllm(**kw: Any) -> dict[str, Any]:
    src: dict[str, Any] = {
        "backend_name": "trt-1",
        "engine": "trtllm",
        "trtllm_endpoint": "http://trt:8000/kv_cache_events",
        "allowed_publishers": ["trt"],
    }
    src.update(kw)
    return {k: v for k, v in src.items() if v is not None}


def errors(data: dict[str, Any]) -> dict[str, str]:
    """YAML path -> message of every error (fails when the config is valid)."""
    with pytest.raises(ConfigError) as info:
        parse_listener_config(data)
    assert all(i.severity == "error" for i in info.value.issues)
    return {i.path: i.message for i in info.value.issues}


def warnings(data: dict[str, Any]) -> dict[str, str]:
    _, issues = parse_listener_config(data)
    return {i.path: i.message for i in issues if i.severity == "warning"}


# -- defaults and the example ---------------------------------------------------------------


def test_defaults_are_the_documented_ones() -> None:
    cfg, issues = parse_listener_config({"sources": [vllm()]})
    assert issues == []
    assert cfg.listen == "127.0.0.1:7817"
    assert cfg.grpc_listen is None and cfg.grpc_tls is None
    assert (cfg.history_size, cfg.heartbeat_interval_ms, cfg.subscriber_queue_size) == (
        10_000,
        15_000,
        4096,
    )
    s = cfg.sources[0]
    assert (s.zmq_mode, s.topic, s.replay_endpoint, s.dp_ranks) == ("connect", "", None, None)
    assert s.poll_interval_ms == 100
    assert (s.max_chain_tokens, s.max_tracked_blocks, s.max_retained_tokens) == (
        16384,
        100_000,
        16_777_216,
    )
    assert s.allowed_publishers == [] and s.chat_template is None


def test_example_file_validates_without_warnings() -> None:
    cfg, issues = load_listener_config(EXAMPLE)
    assert issues == []
    assert [s.backend_name for s in cfg.sources] == ["vllm-1", "sglang-1", "trtllm-1"]
    assert {s.engine for s in cfg.sources} == {"vllm", "sglang", "trtllm"}
    assert isinstance(cfg.sources[1].chat_template, ChatTemplateMarkers)


def test_every_field_has_a_docstring() -> None:
    from listener.config import ConversationConfig, GrpcTlsConfig, SourceConfig

    for model in (
        ListenerConfig,
        SourceConfig,
        GrpcTlsConfig,
        ChatTemplateMarkers,
        ConversationConfig,
    ):
        undocumented = [n for n, f in model.model_fields.items() if not f.description]
        assert undocumented == [], model.__name__


# -- field errors name YAML paths -------------------------------------------------------------


def test_field_errors_name_yaml_paths() -> None:
    errs = errors(
        {
            "listen": "nope",
            "histroy_size": 5,
            "history_size": 1,
            "sources": [
                vllm(),
                vllm(
                    backend_name="bad name",
                    engine="tgi",
                    zmq_endpoint="http://x:1",
                    dp_ranks=0,
                    allowed_publishers=["10.0.0.0/8", "not a host!"],
                ),
            ],
        }
    )
    assert set(errs) == {
        "listen",
        "histroy_size",
        "history_size",
        "sources[1].backend_name",
        "sources[1].engine",
        "sources[1].zmq_endpoint",
        "sources[1].dp_ranks",
        "sources[1].allowed_publishers",
    }
    assert errs["histroy_size"] == "unknown field"
    assert "host:port" in errs["listen"]
    assert "[A-Za-z0-9_-]{1,64}" in errs["sources[1].backend_name"]
    assert "not a host!" in errs["sources[1].allowed_publishers"]


def test_chat_template_forms() -> None:
    assert errors({"sources": [vllm(chat_template="mistral")]}) == {
        "sources[0].chat_template": (
            'must be "chatml", "llama3" or a mapping {system_start, user_start, end}'
        )
    }
    errs = errors({"sources": [vllm(chat_template={"system_start": "<s>", "bogus": 1})]})
    assert set(errs) == {
        "sources[0].chat_template.user_start",
        "sources[0].chat_template.end",
        "sources[0].chat_template.bogus",
    }
    cfg, _ = parse_listener_config({"sources": [vllm(chat_template="chatml")]})
    assert cfg.sources[0].chat_template == "chatml"


def test_backend_names_allow_no_dots_and_at_most_64_chars() -> None:
    assert "sources[0].backend_name" in errors({"sources": [vllm(backend_name="a.b")]})
    assert "sources[0].backend_name" in errors({"sources": [vllm(backend_name="a" * 65)]})
    # "$" would accept a final LF; names end up in URLs, metrics labels and logs.
    assert "sources[0].backend_name" in errors({"sources": [vllm(backend_name="a\n")]})
    parse_listener_config({"sources": [vllm(backend_name="A_b-" + "c" * 60)]})


def test_ranges() -> None:
    errs = errors(
        {
            "heartbeat_interval_ms": 10,
            "subscriber_queue_size": 0,
            "sources": [vllm(max_chain_tokens=0, max_tracked_blocks=0, max_retained_tokens=0)],
        }
    )
    assert set(errs) == {
        "heartbeat_interval_ms",
        "subscriber_queue_size",
        "sources[0].max_chain_tokens",
        "sources[0].max_tracked_blocks",
        "sources[0].max_retained_tokens",
    }


# -- cross-field rules -----------------------------------------------------------------------


def test_zmq_engines_require_zmq_endpoint() -> None:
    errs = errors(
        {"sources": [vllm(), vllm(backend_name="sg", engine="sglang", zmq_endpoint=None)]}
    )
    assert errs == {"sources[1].zmq_endpoint": "engine sglang requires sources[1].zmq_endpoint"}


def test_zmq_engines_reject_trtllm_options() -> None:
    errs = errors({"sources": [vllm(trtllm_endpoint="http://t/x", poll_interval_ms=50)]})
    assert set(errs) == {"sources[0].trtllm_endpoint", "sources[0].poll_interval_ms"}
    assert "engine trtllm only" in errs["sources[0].trtllm_endpoint"]


def test_trtllm_requires_endpoint_and_salt_secret_and_forbids_zmq() -> None:
    errs = errors(
        {
            "sources": [
                trtllm(
                    trtllm_endpoint=None,
                    zmq_endpoint="tcp://h:1",
                    zmq_mode="connect",  # explicitly given, even if it is the default
                    topic="",
                    dp_ranks=2,
                )
            ]
        }
    )
    assert errs["sources[0].trtllm_endpoint"] == "engine trtllm requires sources[0].trtllm_endpoint"
    for field in ("zmq_endpoint", "zmq_mode", "topic", "dp_ranks"):
        assert errs[f"sources[0].{field}"] == (
            f"engine trtllm does not use ZMQ: remove sources[0].{field}"
        )
    assert "requires salt_secret_file or salt_secret_env" in errs["sources[0].engine"]
    assert "no public /detokenize" in errs["sources[0].engine"]
    # With a secret (env needs no file) and the fields removed it is valid, even though
    # the env variable is not set here: that is checked at start, not by --check.
    cfg, issues = parse_listener_config({"salt_secret_env": "X_SALT", "sources": [trtllm()]})
    assert issues == []
    endpoint = cfg.sources[0].trtllm_endpoint
    assert endpoint is not None and endpoint.endswith("/kv_cache_events")


def test_trtllm_host_must_be_an_allowed_publisher() -> None:
    base = {"salt_secret_env": "X"}
    errs = errors({**base, "sources": [trtllm(allowed_publishers=[])]})
    assert errs == {
        "sources[0].allowed_publishers": (
            "trtllm_endpoint host 'trt' must be listed in sources[0].allowed_publishers"
        )
    }
    ok = trtllm(
        trtllm_endpoint="http://10.1.2.3:8000/kv_cache_events", allowed_publishers=["10.1.0.0/16"]
    )
    parse_listener_config({**base, "sources": [ok]})


def test_detokenize_requires_model() -> None:
    errs = errors({"sources": [vllm(model=None)]})
    assert errs == {
        "sources[0].model": "sources[0].detokenize_endpoint requires sources[0].model "
        "(it is part of the prefix key)"
    }


def test_attribution_warning_without_detokenize_or_salt() -> None:
    warned = warnings({"sources": [vllm(detokenize_endpoint=None, model=None)]})
    assert set(warned) == {"sources[0]"}
    assert "detokenize_endpoint or salt_secret_file/salt_secret_env" in warned["sources[0]"]
    assert (
        warnings({"salt_secret_env": "S", "sources": [vllm(detokenize_endpoint=None, model=None)]})
        == {}
    )


def test_duplicate_backend_names_and_bound_endpoints() -> None:
    errs = errors(
        {
            "sources": [
                vllm(
                    zmq_endpoint="tcp://*:5557",
                    zmq_mode="bind",
                    dp_ranks=2,
                    allowed_publishers=["10.0.0.1"],
                ),
                vllm(zmq_endpoint="tcp://*:5558", zmq_mode="bind", allowed_publishers=["10.0.0.2"]),
            ]
        }
    )
    assert errs == {
        "sources[1].backend_name": "duplicate backend_name 'vllm-1' (first at sources[0])",
        "sources[1].zmq_endpoint": "tcp://*:5558 is already bound by sources[0].zmq_endpoint",
    }


def test_bind_without_allowed_publishers_warns() -> None:
    warned = warnings({"sources": [vllm(zmq_endpoint="tcp://*:5557", zmq_mode="bind")]})
    assert set(warned) == {"sources[0].allowed_publishers"}


def test_dp_ranks_expand_ports_and_replay_ports() -> None:
    cfg, _ = parse_listener_config(
        {"sources": [vllm(zmq_endpoint="tcp://h:5557", replay_endpoint="tcp://h:5600", dp_ranks=3)]}
    )
    eps = cfg.sources[0].zmq_endpoints()
    assert [(e.rank, e.endpoint, e.replay_endpoint) for e in eps] == [
        (0, "tcp://h:5557", "tcp://h:5600"),
        (1, "tcp://h:5558", "tcp://h:5601"),
        (2, "tcp://h:5559", "tcp://h:5602"),
    ]
    cfg, _ = parse_listener_config({"sources": [vllm(zmq_endpoint="inproc://kv", dp_ranks=2)]})
    assert [e.endpoint for e in cfg.sources[0].zmq_endpoints()] == [
        "inproc://kv",
        "inproc://kv_dp1",
    ]


def test_dp_ranks_errors() -> None:
    errs = errors({"sources": [vllm(zmq_endpoint="ipc:///tmp/kv", dp_ranks=2)]})
    assert "dp_ranks requires a tcp:// or inproc:// endpoint" in errs["sources[0].zmq_endpoint"]
    errs = errors({"sources": [vllm(zmq_endpoint="tcp://h:65535", dp_ranks=2)]})
    assert "exceeds 65535" in errs["sources[0].zmq_endpoint"]
    errs = errors(
        {"sources": [vllm(zmq_endpoint="tcp://h:5557", replay_endpoint="tcp://h:5558", dp_ranks=2)]}
    )
    assert "also the zmq_endpoint of dp rank 1" in errs["sources[0].replay_endpoint"]


def test_event_bus_section_is_validated() -> None:
    # Push mode's own rules are in tests/unit/test_eventbus_config.py.
    errs = errors({"event_bus": {"url": "https://router:9443"}, "sources": [vllm()]})
    assert errs == {"event_bus.client_id": "Field required"}


def test_grpc_rules(tmp_path: Path) -> None:
    errs = errors({"grpc_tls": {"cert": str(tmp_path / "c"), "key": str(tmp_path / "k")}})
    assert errs == {
        "grpc_tls": "grpc_tls requires grpc_listen",
        "grpc_tls.cert": f"file {str(tmp_path / 'c')!r} does not exist",
        "grpc_tls.key": f"file {str(tmp_path / 'k')!r} does not exist",
    }
    errs = errors({"listen": "0.0.0.0:7817", "grpc_listen": "127.0.0.1:7817"})
    assert errs == {"grpc_listen": "port 7817 is already used by listen"}
    (tmp_path / "c").write_text("x")
    (tmp_path / "k").write_text("x")
    cfg, _ = parse_listener_config(
        {
            "grpc_listen": "127.0.0.1:0",
            "listen": "127.0.0.1:0",
            "grpc_tls": {"cert": str(tmp_path / "c"), "key": str(tmp_path / "k")},
        }
    )
    assert cfg.grpc_tls is not None and cfg.grpc_tls.client_ca is None


def test_salt_secret_file_must_exist(tmp_path: Path) -> None:
    errs = errors({"salt_secret_file": str(tmp_path / "nope")})
    assert set(errs) == {"salt_secret_file"}


def test_publisher_allowed_matching() -> None:
    cfg, _ = parse_listener_config(
        {"sources": [vllm(allowed_publishers=["10.0.0.0/8", "Engine-1.local", "::1"])]}
    )
    s = cfg.sources[0]
    assert s.publisher_allowed("10.2.3.4")
    assert s.publisher_allowed("engine-1.local")
    assert s.publisher_allowed("[::1]")
    assert not s.publisher_allowed("11.0.0.1")
    assert not s.publisher_allowed("engine-2.local")


# -- loading files and the command line ------------------------------------------------------


def test_yaml_problems_are_reported(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("sources: [\n")
    with pytest.raises(ConfigError) as info:
        load_listener_config(bad)
    assert info.value.issues[0].path == "(yaml)"
    assert "invalid YAML at line" in info.value.issues[0].message
    seq = tmp_path / "seq.yaml"
    seq.write_text("- 1\n")
    with pytest.raises(ConfigError) as info:
        load_listener_config(seq)
    assert info.value.issues[0].path == "(root)"
    with pytest.raises(ConfigError) as info:
        load_listener_config(tmp_path / "missing.yaml")
    assert info.value.issues[0].path == "(file)"


def test_cli_check(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--config", str(EXAMPLE), "--check"]) == 0
    assert "ok (0 warning(s))" in capsys.readouterr().out
    bad = tmp_path / "bad.yaml"
    bad.write_text("sources:\n  - backend_name: x\n    engine: vllm\n")
    assert main(["--config", str(bad), "--check"]) == 1
    err = capsys.readouterr().err
    assert "error: sources[0].zmq_endpoint: engine vllm requires sources[0].zmq_endpoint" in err
    assert "invalid (1 error(s))" in err


def test_cli_help_is_a_man_page(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    positions = [
        out.index(section)
        for section in (
            "NAME",
            "SYNOPSIS",
            "DESCRIPTION",
            "OPTIONS",
            "CONFIGURATION",
            "SIGNALS",
            "EXIT STATUS",
            "EXAMPLES",
        )
    ]
    assert positions == sorted(positions)
    assert "--check" in out and "continuum-kv-listener --config FILE" in out


def test_cli_requires_config(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main([])
    assert info.value.code == 2


# -- conversation keys ----------------------------------------------------------------------


def test_conversation_defaults_and_ranges() -> None:
    cfg, _ = parse_listener_config({"sources": [vllm()]})
    conv = cfg.conversation
    assert (conv.enabled, conv.chunk_bytes, conv.max_retained_bytes) == (False, 1024, 64 << 20)
    assert cfg.sources[0].tokenizer is None
    for bad in (63, 65_537):
        e = errors({"conversation": {"chunk_bytes": bad}, "sources": [vllm()]})
        assert list(e) == ["conversation.chunk_bytes"]
    e = errors({"conversation": {"max_retained_bytes": 10}, "sources": [vllm()]})
    assert list(e) == ["conversation.max_retained_bytes"]


def test_conversation_requires_a_loadable_tokenizer_per_source(tmp_path: Path) -> None:
    from harness.sim.tokenizer import bundled_qwen2_json

    qwen = str(bundled_qwen2_json())
    on = {"enabled": True}
    e = errors({"conversation": on, "sources": [vllm(), vllm(backend_name="b2", tokenizer=qwen)]})
    assert (
        list(e) == ["sources[0].tokenizer"]
        and "requires sources[0].tokenizer" in e["sources[0].tokenizer"]
    )
    missing = str(tmp_path / "nope.json")
    e = errors({"conversation": on, "sources": [vllm(tokenizer=missing)]})
    assert e["sources[0].tokenizer"].startswith(f"tokenizer {missing}: cannot read it")
    wordpiece = tmp_path / "wp.json"
    wordpiece.write_text('{"model": {"type": "WordPiece", "vocab": {}}}')
    e = errors({"conversation": on, "sources": [vllm(tokenizer=str(wordpiece))]})
    assert str(wordpiece) in e["sources[0].tokenizer"] and "WordPiece" in e["sources[0].tokenizer"]
    cfg, issues = parse_listener_config({"conversation": on, "sources": [vllm(tokenizer=qwen)]})
    assert issues == [] and cfg.conversation.enabled
    no_model = vllm(tokenizer=qwen, model=None, detokenize_endpoint=None)
    w = warnings({"conversation": on, "salt_secret_env": "X", "sources": [no_model]})
    assert "without sources[0].model" in w["sources[0].model"]
    w = warnings({"sources": [vllm(tokenizer=qwen)]})
    assert "unused" in w["sources[0].tokenizer"]
