"""Checkpoint files: the format refuses every damaged, foreign or stale file with a reason,
writes are atomic and private, and a listener source given any such file starts empty
(counted, logged), never crashes; given its own file it resumes where it stood."""

from __future__ import annotations

import asyncio
import os
import stat
import time
from pathlib import Path
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bus.salt import encode_salt
from listener.app import SourceRuntime
from listener.chains import export_state
from listener.checkpoint import (
    FORMAT_VERSION,
    MAGIC,
    Checkpoint,
    CheckpointError,
    Resume,
    check_identity,
    decode_checkpoint,
    encode_checkpoint,
    payload_digest,
    read_checkpoint,
    write_checkpoint,
)
from listener.config import ListenerConfig, SourceConfig
from listener.engine_events import BlockHash, BlockStored, EventBatch
from listener.stream import EventHub

SECRET = "0123456789abcdef-secret"
IDENTITY = {"backend": "b1", "engine": "vllm"}


def sample() -> Checkpoint:
    return Checkpoint(IDENTITY, time.time(), (Resume("tcp://h:1", 41, b"\x07" * 16),),
                      {"blocks": [[0, 0, "GPU", 2**64 - 1, 0, 4, "gpu", 1, 0, None, -1, -1, -1,
                                   False, None]]})  # fmt: skip


def test_round_trip() -> None:
    cp = sample()
    assert decode_checkpoint(encode_checkpoint(cp)) == cp


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_property_any_damage_is_refused_with_a_reason(data: st.DataObject) -> None:
    good = encode_checkpoint(sample())
    how = data.draw(st.sampled_from(["truncate", "flip", "append"]))
    if how == "truncate":
        bad = good[: data.draw(st.integers(0, len(good) - 1))]
    elif how == "flip":
        i = data.draw(st.integers(0, len(good) - 1))
        bad = good[:i] + bytes([good[i] ^ data.draw(st.integers(1, 255))]) + good[i + 1 :]
    else:
        bad = good + data.draw(st.binary(min_size=1, max_size=16))
    with pytest.raises(CheckpointError) as e:
        decode_checkpoint(bad)
    assert e.value.kind in ("truncated", "magic", "version", "checksum", "malformed")


@settings(max_examples=100, deadline=None)
@given(junk=st.binary(max_size=200))
def test_property_random_bytes_are_refused(junk: bytes) -> None:
    with pytest.raises(CheckpointError):
        decode_checkpoint(junk)


def _with_body(body: bytes, version: int = FORMAT_VERSION) -> bytes:
    import hashlib
    import struct

    header = struct.pack(">8sIQ32s", MAGIC, version, len(body), hashlib.sha256(body).digest())
    return header + body


@pytest.mark.parametrize(
    ("data", "kind"),
    [
        (b"", "truncated"),
        (b"CTMKVCKP", "truncated"),
        (b"NOTACKPT" + bytes(44), "magic"),
        (_with_body(msgpack.packb({}), version=2), "version"),
        (_with_body(b"\xc1"), "malformed"),  # a byte msgpack never uses
        (_with_body(msgpack.packb([1, 2])), "malformed"),
        (_with_body(msgpack.packb({"identity": {}, "written_at": 1.0})), "malformed"),
        (
            _with_body(
                msgpack.packb(
                    {"identity": {}, "written_at": 1.0, "resume": [["e", -1, None]], "state": None}
                )
            ),
            "malformed",
        ),
        (
            _with_body(
                msgpack.packb({"identity": [], "written_at": 1.0, "resume": [], "state": None})
            ),
            "malformed",
        ),
    ],
)
def test_each_kind_of_bad_file_is_named(data: bytes, kind: str) -> None:
    with pytest.raises(CheckpointError) as e:
        decode_checkpoint(data)
    assert e.value.kind == kind


def test_identity_and_age_are_checked() -> None:
    cp = sample()
    check_identity(cp, IDENTITY, 60)
    with pytest.raises(CheckpointError, match="engine") as e:
        check_identity(cp, {**IDENTITY, "engine": "sglang"}, 60)
    assert e.value.kind == "foreign"
    old = Checkpoint(cp.identity, time.time() - 120, cp.resume, cp.state)
    with pytest.raises(CheckpointError) as e:
        check_identity(old, IDENTITY, 60)
    assert e.value.kind == "expired"


def test_writes_are_private_and_atomic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "ckpt" / "b1.ckpt"
    write_checkpoint(path, b"first")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert read_checkpoint(tmp_path / "none.ckpt") is None

    def fail(src: Any, dst: Any) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError):
        write_checkpoint(path, b"second")
    assert path.read_bytes() == b"first"  # the old file stands
    assert os.listdir(path.parent) == ["b1.ckpt"]  # and no temporary is left behind


# -- a listener source with a checkpoint directory -----------------------------------------------

KEY = b"\x05" * 32


def runtime(
    monkeypatch: pytest.MonkeyPatch, directory: Path, **over: Any
) -> tuple[SourceRuntime, EventHub]:
    monkeypatch.setenv("CONTINUUM_TEST_SALT", SECRET)
    fields: dict[str, Any] = {
        "backend_name": "b1",
        "engine": "vllm",
        "model": "m",
        "zmq_endpoint": "tcp://127.0.0.1:5999",
        "replay_endpoint": "tcp://127.0.0.1:5998",
    }
    src = SourceConfig(**(fields | over))
    cfg = ListenerConfig(
        salt_secret_env="CONTINUUM_TEST_SALT", sources=[src], checkpoint_dir=str(directory)
    )
    hub = EventHub(1024, 1024)
    return SourceRuntime(cfg, src, hub), hub


def fill(rt: SourceRuntime) -> None:
    """A salted chain of three blocks, as the source delivers it after batch 9."""
    salt = encode_salt(SECRET.encode(), "b1", KEY)
    ev = BlockStored([BlockHash(h) for h in (1, 2, 3)], None, [7] * 12, 4, cache_salt=salt)
    rt.tracker.apply(EventBatch(1.0, [ev], 0))
    t = rt.transports[0]
    t._last_seq, t._last_payload = 9, b"payload 9"  # type: ignore[union-attr]


async def saved(monkeypatch: pytest.MonkeyPatch, directory: Path) -> SourceRuntime:
    """A source that took batch 9 and wrote its checkpoint."""
    rt, _ = runtime(monkeypatch, directory)
    fill(rt)
    assert rt.checkpointer is not None
    await rt.checkpointer.save()
    return rt


async def assert_started_empty(rt: SourceRuntime, *others: SourceRuntime) -> None:
    st = rt.stats()
    assert (st["checkpoint_rejected"], st["checkpoint_loaded"], st["tracked_blocks"]) == (1, 0, 0)
    assert rt.transports[0]._resume is None  # type: ignore[union-attr]
    for r in (rt, *others):
        await r.aclose()


async def test_a_source_resumes_from_its_own_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = await saved(monkeypatch, tmp_path)
    assert first.checkpointer is not None
    await first.checkpointer.save()  # unchanged: not written again
    assert first.checkpointer.stats["checkpoint_writes"] == 1
    second, hub = runtime(monkeypatch, tmp_path)
    assert export_state(second.tracker) == export_state(first.tracker)
    assert second.transports[0]._resume == (9, payload_digest(b"payload 9"))  # type: ignore[union-attr]
    assert second.stats()["checkpoint_loaded"] == 1
    assert [e.prefix_hash for e in second.tracker.snapshot()] == [KEY.hex()]
    sub = hub.subscribe("b1")  # a router connecting gets the checkpoint's view
    kinds = [r.event for r in sub.ready()]
    assert kinds == ["resync", "cache_created"]
    await first.aclose()
    await second.aclose()


async def test_a_gap_keeps_the_view_and_marks_it_incomplete(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rt, hub = runtime(monkeypatch, tmp_path)
    fill(rt)
    sub = hub.subscribe("b1")
    sub.ready()
    rt._on_gap(3)
    recs = sub.ready()
    assert [r.event for r in recs] == ["resync", "cache_created"]
    assert b'"incomplete":true' in recs[0].data and b'"checkpoint_gap"' in recs[0].data
    assert rt.stats()["view_incomplete"] == 1
    late = hub.subscribe("b1")  # a subscriber joining later is told too
    assert b'"incomplete":true' in late.ready()[0].data
    rt._on_resync("restart")  # the engine restarted: empty, and complete again
    assert rt.stats()["view_incomplete"] == 0
    assert b"incomplete" not in hub.subscribe("b1").ready()[0].data
    await rt.aclose()


@pytest.mark.parametrize(
    "damage",
    [
        lambda b: b[:-1],
        lambda b: b[:10],
        lambda b: b[:60] + bytes([b[60] ^ 1]) + b[61:],
        lambda b: b"\x00" * len(b),
        lambda b: b"",
    ],
    ids=["last-byte", "header", "bit-flip", "zeros", "empty"],
)
async def test_a_damaged_checkpoint_starts_empty_and_is_counted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, damage: Any, caplog: Any
) -> None:
    first = await saved(monkeypatch, tmp_path)
    path = tmp_path / "b1.ckpt"
    path.write_bytes(damage(path.read_bytes()))
    second, _ = runtime(monkeypatch, tmp_path)
    assert "checkpoint" in caplog.text and "ignored" in caplog.text
    await assert_started_empty(second, first)


@pytest.mark.parametrize(
    "other",
    [
        {"max_tracked_blocks": 5000},
        {"engine": "sglang"},
        {"zmq_endpoint": "tcp://127.0.0.1:6000"},
        {"model": "other"},
    ],
)
async def test_a_checkpoint_of_other_settings_is_not_loaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, other: dict[str, Any]
) -> None:
    first = await saved(monkeypatch, tmp_path)
    second, _ = runtime(monkeypatch, tmp_path, **other)
    await assert_started_empty(second, first)


async def test_a_checkpoint_whose_state_the_tracker_refuses_starts_empty(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = await saved(monkeypatch, tmp_path)
    data = decode_checkpoint((tmp_path / "b1.ckpt").read_bytes())
    bad = Checkpoint(data.identity, data.written_at, data.resume, {"blocks": [["junk"]]})
    write_checkpoint(tmp_path / "b1.ckpt", encode_checkpoint(bad))
    second, _ = runtime(monkeypatch, tmp_path)
    await assert_started_empty(second, first)


async def test_nothing_is_written_before_the_first_batch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rt, _ = runtime(monkeypatch, tmp_path)
    assert rt.checkpointer is not None
    await rt.checkpointer.save(force=True)
    assert not (tmp_path / "b1.ckpt").exists()
    await asyncio.sleep(0)
    await rt.aclose()
