"""The wire contracts: bus/_gen is in sync with proto/, messages round-trip, buf lint passes."""

from __future__ import annotations

import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bus._gen.continuum.bus.v1 import bus_pb2, bus_pb2_grpc
from bus._gen.continuum.kvindex.v1 import kvindex_pb2, kvindex_pb2_grpc

REPO_ROOT = Path(__file__).resolve().parents[2]
COMMITTED_GEN = REPO_ROOT / "bus" / "_gen"


def _tree(root: Path) -> dict[str, bytes]:
    """Relative posix path -> bytes of every file under root, caches excluded."""
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and "__pycache__" not in p.relative_to(root).parts and p.suffix != ".pyc"
    }


def _run_gen(out: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(REPO_ROOT / "proto" / "gen.py"), "--out", str(out)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, f"proto/gen.py failed:\n{result.stdout}\n{result.stderr}"


def test_committed_gen_matches_a_fresh_run(tmp_path: Path) -> None:
    out = tmp_path / "_gen"
    _run_gen(out)
    fresh = _tree(out)
    committed = _tree(COMMITTED_GEN)
    hint = "bus/_gen is stale: run `make proto` and commit the result"
    assert sorted(fresh) == sorted(committed), hint
    differing = sorted(name for name in fresh if fresh[name] != committed[name])
    assert not differing, f"{hint}; differing files: {differing}"


def test_generation_is_deterministic_and_replaces_stale_files(tmp_path: Path) -> None:
    out = tmp_path / "_gen"
    _run_gen(out)
    first = _tree(out)
    stale = out / "continuum" / "gone" / "v1" / "gone_pb2.py"
    stale.parent.mkdir(parents=True)
    stale.write_text("# from a deleted proto\n")
    _run_gen(out)
    assert _tree(out) == first
    # Nothing is left behind beside the output directory.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["_gen"]


def test_generated_imports_go_through_bus_gen() -> None:
    for path in COMMITTED_GEN.rglob("*_pb2*.py*"):
        for line in path.read_text(encoding="utf-8").splitlines():
            assert not line.startswith(("from continuum", "import continuum")), (path, line)
    assert bus_pb2.Hello.__module__ == "bus._gen.continuum.bus.v1.bus_pb2"


def test_session_hello_round_trips() -> None:
    request = bus_pb2.SessionRequest(
        hello=bus_pb2.Hello(
            client_id="kv-listener-a",
            role=bus_pb2.ROLE_KV_LISTENER,
            sources=["vllm-1", "vllm-2"],
        )
    )
    wire = request.SerializeToString(deterministic=True)
    parsed = bus_pb2.SessionRequest.FromString(wire)
    assert parsed == request
    assert parsed.WhichOneof("kind") == "hello"
    assert parsed.hello.client_id == "kv-listener-a"
    assert parsed.hello.role == bus_pb2.ROLE_KV_LISTENER
    assert list(parsed.hello.sources) == ["vllm-1", "vllm-2"]
    assert pickle.loads(pickle.dumps(parsed)) == request


def test_stream_data_round_trips_bytes_exactly() -> None:
    sse = (
        b"id: 1700000000-7\nevent: cache_created\n"
        b'data: {"event":"cache_created","backend":"vllm-1","prefix_hash":"'
        + b"ab" * 32
        + b'","token_count":2048,"tier":"gpu"}\n\n'
        + b"\x00\xff\r\n"  # arbitrary bytes survive untouched
    )
    request = bus_pb2.StreamRequest(data=bus_pb2.StreamData(data=sse))
    parsed = bus_pb2.StreamRequest.FromString(request.SerializeToString())
    assert parsed.WhichOneof("kind") == "data"
    assert parsed.data.data == sse

    close = bus_pb2.StreamRequest(
        close=bus_pb2.StreamClose(reason=bus_pb2.CLOSE_REASON_BUFFER_OVERFLOW, detail="queue full")
    )
    assert bus_pb2.StreamRequest.FromString(close.SerializeToString()) == close


def test_enum_values_are_fixed() -> None:
    assert bus_pb2.Role.items() == [
        ("ROLE_UNSPECIFIED", 0),
        ("ROLE_KV_LISTENER", 1),
        ("ROLE_BROKER", 2),
    ]
    assert bus_pb2.CloseReason.items() == [
        ("CLOSE_REASON_UNSPECIFIED", 0),
        ("CLOSE_REASON_BUFFER_OVERFLOW", 1),
        ("CLOSE_REASON_DRAINING", 2),
        ("CLOSE_REASON_UNSUBSCRIBED", 3),
        ("CLOSE_REASON_ERROR", 4),
    ]
    assert kvindex_pb2.Tier.items() == [
        ("TIER_UNSPECIFIED", 0),
        ("TIER_GPU_HOT", 1),
        ("TIER_STORAGE_WARM", 2),
    ]


def test_services_have_the_design_names_and_shapes() -> None:
    bus = bus_pb2.DESCRIPTOR.services_by_name["EventBus"]
    assert bus.full_name == "continuum.bus.v1.EventBus"
    shapes = {
        m.name: (m.client_streaming, m.server_streaming, m.input_type.name, m.output_type.name)
        for m in bus.methods
    }
    assert shapes == {
        "Session": (True, True, "SessionRequest", "SessionResponse"),
        "Stream": (True, False, "StreamRequest", "StreamResponse"),
    }
    kv = kvindex_pb2.DESCRIPTOR.services_by_name["KvIndex"]
    assert kv.full_name == "continuum.kvindex.v1.KvIndex"
    assert {m.name: (m.client_streaming, m.server_streaming) for m in kv.methods} == {
        name: (False, False) for name in ("Query", "Score", "Backends", "Stats", "Clear")
    }
    # The grpc modules expose the usual stub/servicer/registration trio.
    assert callable(bus_pb2_grpc.add_EventBusServicer_to_server)
    assert callable(kvindex_pb2_grpc.add_KvIndexServicer_to_server)
    assert callable(bus_pb2_grpc.EventBusStub) and callable(kvindex_pb2_grpc.KvIndexStub)


def test_score_request_key_is_a_oneof() -> None:
    request = kvindex_pb2.ScoreRequest(
        request=kvindex_pb2.ChatRequest(model="m", request_json=b'{"messages":[]}')
    )
    assert request.WhichOneof("key") == "request"
    request.prefix_hash = "00" * 32
    assert request.WhichOneof("key") == "prefix_hash"
    assert not request.HasField("request")


@pytest.mark.skipif(
    shutil.which("buf") is None, reason="buf CLI not on PATH (npm i -g @bufbuild/buf)"
)
def test_buf_lint_passes() -> None:
    result = subprocess.run(
        ["buf", "lint"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, f"buf lint:\n{result.stdout}\n{result.stderr}"
