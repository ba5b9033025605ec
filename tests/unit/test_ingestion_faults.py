"""Failures on the ingestion path: every one ends in a counted drop of the event it hit
and a resync of its backend, never in a silent loss.

The sources are real: a vLLM-shaped publisher on a ZeroMQ PUB socket (msgpack encoding A,
``listener.decode``) and a fake trtllm-serve over HTTP, each feeding a ``SourceRuntime``
(its chain tracker and the event hub) exactly as the listener process wires them. Salts
are router-issued (``bus.salt``), one tenant per caller salt.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgpack
import pytest

from bus.backoff import NoBackoff
from bus.events import KvEvent
from bus.salt import SALT_PREFIX, encode_salt
from listener.app import SourceRuntime
from listener.chains import ChainTracker
from listener.config import ListenerConfig, SourceConfig
from listener.engine_events import BlockHash, BlockStored, EventBatch
from listener.recovery import Attributor
from listener.stream import EventHub
from listener.templates import CHATML
from tests import waiting
from tests.unit.test_trtllm_source import FakeTrtllmServe, block, serve, stored
from tests.unit.test_zmq_source import FakeEngine, engine_factory, reconnected, zctx

__all__ = ["engine_factory", "serve", "zctx"]  # fixtures

TIMEOUT = 5.0
SECRET = "0123456789abcdef-secret"
BACKEND = "vllm-1"
KEY_A, KEY_B, KEY_X = b"\x0a" * 32, b"\x0b" * 32, b"\x0c" * 32
BAD_MAC_SALT = f"{SALT_PREFIX}{KEY_X.hex()}.{'é' * 22}.tenant-x"
"""Well formed up to a MAC of the right length in non-ASCII characters: the client picks
the text after a router prefix it copied."""


def salt(backend: str, key: bytes, tenant: str) -> str:
    return encode_salt(SECRET.encode(), backend, key, tenant)


async def eventually(pred: Callable[[], bool]) -> None:
    await waiting.eventually(pred, TIMEOUT, 0.001)


class RecordingHub(EventHub):
    """The listener's hub, also keeping every published event in order."""

    def __init__(self) -> None:
        super().__init__(1024, 1024)
        self.seen: list[KvEvent] = []

    def publish(self, backend: str, ev: KvEvent) -> str:
        self.seen.append(ev)
        return super().publish(backend, ev)

    def kinds(self) -> list[tuple[str, str | None]]:
        return [(e.event, e.reason if e.event == "resync" else e.prefix_hash) for e in self.seen]


def runtime(monkeypatch: pytest.MonkeyPatch, **source: Any) -> tuple[SourceRuntime, RecordingHub]:
    monkeypatch.setenv("CONTINUUM_TEST_SALT", SECRET)
    src = SourceConfig(backend_name=BACKEND, model="m", **source)
    cfg = ListenerConfig(salt_secret_env="CONTINUUM_TEST_SALT", sources=[src])
    hub = RecordingHub()
    return SourceRuntime(cfg, src, hub), hub


@contextlib.asynccontextmanager
async def running(rt: SourceRuntime) -> AsyncIterator[None]:
    tasks = [asyncio.create_task(t.run()) for t in rt.transports]
    try:
        yield
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await rt.aclose()


def inject_tracker_fault(monkeypatch: pytest.MonkeyPatch, trigger: str) -> None:
    """Make the tracker raise (an unexpected error, not a bad salt) on one salt."""
    original = Attributor.from_salt

    def from_salt(self: Attributor, value: str) -> Any:
        if value == trigger:
            raise RuntimeError("injected tracker fault")
        return original(self, value)

    monkeypatch.setattr(Attributor, "from_salt", from_salt)


def created(hub: RecordingHub) -> set[str | None]:
    return {e.prefix_hash for e in hub.seen if e.event == "cache_created"}


# --------------------------------------------------------------------------------------------
# The tracker on its own


def tracker() -> tuple[ChainTracker, list[KvEvent]]:
    att = Attributor(model="m", template=CHATML, backend="b1", salt_secret=SECRET.encode())
    out: list[KvEvent] = []
    return ChainTracker("b1", out.append, att, engine="trtllm", backoff=NoBackoff()), out


def root(h: int, salt_value: str) -> BlockStored:
    return BlockStored([BlockHash(h)], None, [1, 2, 3, 4], 4, cache_salt=salt_value)


def created_keys(out: list[KvEvent]) -> set[str | None]:
    return {e.prefix_hash for e in out if e.event == "cache_created"}


def test_a_non_ascii_mac_discards_only_its_own_chain() -> None:
    t, out = tracker()
    t.apply(
        EventBatch(
            0.0,
            [
                root(1, salt("b1", KEY_A, "a")),
                root(2, BAD_MAC_SALT),
                root(3, salt("b1", KEY_B, "b")),
            ],
        )
    )
    assert created_keys(out) == {KEY_A.hex(), KEY_B.hex()}
    assert t.stats()["salt_failures"] == 1 and t.stats()["failed_events"] == 0
    assert [e.event for e in out].count("resync") == 0


def test_an_event_that_raises_is_dropped_counted_and_resyncs_and_the_rest_applies(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    inject_tracker_fault(monkeypatch, "boom")
    t, out = tracker()
    t.apply(
        EventBatch(
            0.0, [root(1, salt("b1", KEY_A, "a")), root(2, "boom"), root(3, salt("b1", KEY_B, "b"))]
        )
    )
    kinds = [(e.event, e.reason) for e in out]
    assert kinds == [("resync", "tracker_error"), ("cache_created", None)]
    assert out[1].prefix_hash == KEY_B.hex()
    assert t.stats()["failed_events"] == 1
    assert {e.prefix_hash for e in t.snapshot()} == {KEY_B.hex()}
    t.check_invariants()


def test_the_owner_resyncs_when_it_asks_to(monkeypatch: pytest.MonkeyPatch) -> None:
    inject_tracker_fault(monkeypatch, "boom")
    att = Attributor(model="m", template=CHATML, backend="b1", salt_secret=SECRET.encode())
    out: list[KvEvent] = []
    reasons: list[str] = []
    t = ChainTracker(
        "b1", out.append, att, engine="trtllm", backoff=NoBackoff(), on_fault=reasons.append
    )
    t.apply(EventBatch(0.0, [root(2, "boom"), root(3, salt("b1", KEY_B, "b"))]))
    assert reasons == ["tracker_error"]
    assert [e.event for e in out] == ["cache_created"]


# --------------------------------------------------------------------------------------------
# vLLM over ZeroMQ


def vllm_stored(h: int, salt_value: str | None) -> list[Any]:
    """vLLM 0.23 encoding A: the salt rides in ``extra_keys[0]`` of a request's first block."""
    extra = [[salt_value]] if salt_value is not None else [None]
    return ["BlockStored", [h], None, [1, 2, 3, 4], 4, None, "GPU", None, extra, 0]


def vllm_batch(*events: list[Any]) -> bytes:
    return msgpack.packb([1_700_000_000.5, list(events), 0])


async def vllm_runtime(
    monkeypatch: pytest.MonkeyPatch, engine: FakeEngine
) -> tuple[SourceRuntime, RecordingHub]:
    return runtime(monkeypatch, engine="vllm", zmq_endpoint=engine.bind())


async def test_vllm_non_ascii_mac_loses_no_other_tenants_events(
    monkeypatch: pytest.MonkeyPatch, engine_factory: Callable[..., FakeEngine]
) -> None:
    engine = engine_factory()
    rt, hub = await vllm_runtime(monkeypatch, engine)
    async with running(rt):
        await engine.subscribed()
        payload = vllm_batch(
            vllm_stored(1, salt(BACKEND, KEY_A, "a")),
            vllm_stored(2, BAD_MAC_SALT),
            vllm_stored(3, salt(BACKEND, KEY_B, "b")),
        )
        await engine.publish(payload=payload)
        await engine.publish(payload=vllm_batch(vllm_stored(4, salt(BACKEND, KEY_X, "x"))))
        await eventually(lambda: KEY_X.hex() in created(hub))
    assert created(hub) == {KEY_A.hex(), KEY_B.hex(), KEY_X.hex()}
    st = rt.stats()
    assert (st["salt_failures"], st["failed_events"], st["callback_errors"]) == (1, 0, 0)


async def test_vllm_tracker_fault_drops_that_event_and_resyncs(
    monkeypatch: pytest.MonkeyPatch, engine_factory: Callable[..., FakeEngine]
) -> None:
    inject_tracker_fault(monkeypatch, "boom")
    engine = engine_factory()
    rt, hub = await vllm_runtime(monkeypatch, engine)
    async with running(rt):
        await engine.subscribed()
        payload = vllm_batch(
            vllm_stored(1, salt(BACKEND, KEY_A, "a")),
            vllm_stored(2, "boom"),
            vllm_stored(3, salt(BACKEND, KEY_B, "b")),
        )
        await engine.publish(payload=payload)
        await eventually(lambda: KEY_B.hex() in created(hub))
    assert hub.kinds() == [("resync", "tracker_error"), ("cache_created", KEY_B.hex())]
    st = rt.stats()
    assert (st["failed_events"], st["callback_errors"]) == (1, 0)
    assert hub.stats()["backends"][BACKEND]["resyncs_published"] == 1


async def test_vllm_undecodable_batch_is_counted_and_resyncs(
    monkeypatch: pytest.MonkeyPatch, engine_factory: Callable[..., FakeEngine]
) -> None:
    engine = engine_factory()
    rt, hub = await vllm_runtime(monkeypatch, engine)
    async with running(rt):
        await engine.subscribed()
        await engine.publish(payload=vllm_batch(vllm_stored(1, salt(BACKEND, KEY_A, "a"))))
        await eventually(lambda: KEY_A.hex() in created(hub))
        await engine.publish(payload=b"\xc1")  # seq 1: not msgpack
        await engine.publish(payload=vllm_batch(vllm_stored(3, salt(BACKEND, KEY_B, "b"))))
        await eventually(lambda: KEY_B.hex() in created(hub))
    assert hub.kinds() == [
        ("cache_created", KEY_A.hex()),
        ("resync", "decode_error"),
        ("cache_created", KEY_B.hex()),
    ]
    st = rt.stats()
    assert (st["decode_errors"], st["resyncs"], st["last_seq"]) == (1, 1, 2)


# --------------------------------------------------------------------------------------------
# TensorRT-LLM over HTTP


def trt_runtime(
    monkeypatch: pytest.MonkeyPatch, serve: FakeTrtllmServe
) -> tuple[SourceRuntime, RecordingHub]:
    return runtime(
        monkeypatch,
        engine="trtllm",
        trtllm_endpoint=f"{serve.base}/kv_cache_events",
        allowed_publishers=["127.0.0.1"],
        poll_interval_ms=10,
    )


async def test_trtllm_non_ascii_mac_loses_no_other_tenants_events(
    monkeypatch: pytest.MonkeyPatch, serve: FakeTrtllmServe
) -> None:
    rt, hub = trt_runtime(monkeypatch, serve)
    serve.push(
        stored(0, [block(11, [1, 2], salt=salt(BACKEND, KEY_A, "a"))]),
        stored(1, [block(12, [1, 2], salt=BAD_MAC_SALT)]),
        stored(2, [block(13, [1, 2], salt=salt(BACKEND, KEY_B, "b"))]),
    )
    async with running(rt):
        await eventually(lambda: KEY_B.hex() in created(hub))
    assert created(hub) == {KEY_A.hex(), KEY_B.hex()}
    st = rt.stats()
    assert (st["salt_failures"], st["failed_events"], st["callback_errors"]) == (1, 0, 0)


async def test_trtllm_tracker_fault_drops_that_event_and_resyncs(
    monkeypatch: pytest.MonkeyPatch, serve: FakeTrtllmServe
) -> None:
    inject_tracker_fault(monkeypatch, "boom")
    rt, hub = trt_runtime(monkeypatch, serve)
    serve.push(
        stored(0, [block(11, [1, 2], salt=salt(BACKEND, KEY_A, "a"))]),
        stored(1, [block(12, [1, 2], salt="boom")]),
        stored(2, [block(13, [1, 2], salt=salt(BACKEND, KEY_B, "b"))]),
    )
    async with running(rt):
        await eventually(lambda: KEY_B.hex() in created(hub))
    assert hub.kinds() == [("resync", "tracker_error"), ("cache_created", KEY_B.hex())]
    st = rt.stats()
    assert (st["failed_events"], st["callback_errors"]) == (1, 0)


async def test_a_failing_batch_callback_resyncs_the_source(
    monkeypatch: pytest.MonkeyPatch, engine_factory: Callable[..., FakeEngine]
) -> None:
    """Past the tracker (the hub, a flush): the source counts the batch and resyncs."""
    engine = engine_factory()
    rt, hub = await vllm_runtime(monkeypatch, engine)
    calls = 0
    apply = rt.tracker.apply

    def failing_once(batch: EventBatch, *, flush: bool = True) -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("injected")
        apply(batch, flush=flush)

    monkeypatch.setattr(rt.tracker, "apply", failing_once)
    async with running(rt):
        await engine.subscribed()
        await engine.publish(payload=vllm_batch(vllm_stored(1, salt(BACKEND, KEY_A, "a"))))
        await eventually(lambda: calls == 1)
        await engine.publish(payload=vllm_batch(vllm_stored(2, salt(BACKEND, KEY_B, "b"))))
        await eventually(lambda: KEY_B.hex() in created(hub))
    assert hub.kinds() == [("resync", "callback_error"), ("cache_created", KEY_B.hex())]
    st = rt.stats()
    assert (st["callback_errors"], st["resyncs"]) == (1, 1)


async def test_trtllm_failing_batch_callback_resyncs_the_source(
    monkeypatch: pytest.MonkeyPatch, serve: FakeTrtllmServe
) -> None:
    rt, hub = trt_runtime(monkeypatch, serve)
    apply = rt.tracker.apply
    calls = 0

    def failing_once(batch: EventBatch, *, flush: bool = True) -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("injected")
        apply(batch, flush=flush)

    monkeypatch.setattr(rt.tracker, "apply", failing_once)
    serve.push(stored(0, [block(11, [1, 2], salt=salt(BACKEND, KEY_A, "a"))]))
    async with running(rt):
        await eventually(lambda: calls == 1)
        serve.push(stored(1, [block(13, [1, 2], salt=salt(BACKEND, KEY_B, "b"))]))
        await eventually(lambda: KEY_B.hex() in created(hub))
    assert hub.kinds() == [("resync", "callback_error"), ("cache_created", KEY_B.hex())]
    st = rt.stats()
    assert (st["callback_errors"], st["resyncs"]) == (1, 1)


async def test_max_frame_bytes_from_the_config_bounds_the_socket(
    monkeypatch: pytest.MonkeyPatch, engine_factory: Callable[..., FakeEngine]
) -> None:
    assert SourceConfig(backend_name="b", engine="vllm", zmq_endpoint="tcp://e:1").max_frame_bytes
    engine = engine_factory()
    rt, hub = runtime(monkeypatch, engine="vllm", zmq_endpoint=engine.bind(), max_frame_bytes=4096)
    async with running(rt):
        await engine.subscribed()
        big = vllm_stored(1, salt(BACKEND, KEY_A, "a"))
        big[3] = [7] * 4096  # token ids: a frame over 4 KiB
        await engine.publish(payload=vllm_batch(big))
        await eventually(lambda: rt.stats()["disconnects"] == 1)
        await reconnected(engine, None)
        await engine.publish(payload=vllm_batch(vllm_stored(2, salt(BACKEND, KEY_B, "b"))))
        await eventually(lambda: KEY_B.hex() in created(hub))
    assert hub.kinds() == [("cache_created", KEY_B.hex())]  # seq 0 was never seen: no gap
    assert rt.stats()["decode_errors"] == 0


async def test_vllm_malformed_block_event_is_counted_and_resyncs(
    monkeypatch: pytest.MonkeyPatch, engine_factory: Callable[..., FakeEngine]
) -> None:
    """A BlockStored that does not decode is a lost block (its children become orphans):
    the batch's other events apply after a resync; an unknown kind costs nothing."""
    engine = engine_factory()
    rt, hub = await vllm_runtime(monkeypatch, engine)
    async with running(rt):
        await engine.subscribed()
        await engine.publish(payload=vllm_batch(vllm_stored(1, salt(BACKEND, KEY_A, "a"))))
        await eventually(lambda: KEY_A.hex() in created(hub))
        bad = vllm_stored(2, salt(BACKEND, KEY_X, "x"))
        bad[4] = "four"  # block_size of the wrong type
        unknown = ["BlockUpdated", [5], 1]
        payload = vllm_batch(unknown, bad, vllm_stored(3, salt(BACKEND, KEY_B, "b")))
        await engine.publish(payload=payload)
        await eventually(lambda: KEY_B.hex() in created(hub))
        await engine.publish(payload=vllm_batch(unknown))
        await engine.publish(payload=vllm_batch(vllm_stored(4, salt(BACKEND, KEY_X, "x"))))
        await eventually(lambda: KEY_X.hex() in created(hub))
    assert hub.kinds() == [
        ("cache_created", KEY_A.hex()),
        ("resync", "malformed_event"),
        ("cache_created", KEY_B.hex()),
        ("cache_created", KEY_X.hex()),
    ]
    st = rt.stats()
    assert (st["skipped_events"], st["malformed_events"], st["resyncs"]) == (3, 1, 1)


async def test_trtllm_malformed_block_event_is_counted_and_resyncs(
    monkeypatch: pytest.MonkeyPatch, serve: FakeTrtllmServe
) -> None:
    rt, hub = trt_runtime(monkeypatch, serve)
    serve.push(stored(0, [block(11, [1, 2], salt=salt(BACKEND, KEY_A, "a"))]))
    async with running(rt):
        await eventually(lambda: KEY_A.hex() in created(hub))
        serve.push(
            {"event_id": 1, "data": {"type": "brand_new"}},
            stored(2, [block("not a hash", [1, 2], salt=salt(BACKEND, KEY_X, "x"))]),
            stored(3, [block(13, [1, 2], salt=salt(BACKEND, KEY_B, "b"))]),
        )
        await eventually(lambda: KEY_B.hex() in created(hub))
    assert hub.kinds() == [
        ("cache_created", KEY_A.hex()),
        ("resync", "malformed_event"),
        ("cache_created", KEY_B.hex()),
    ]
    st = rt.stats()
    assert (st["skipped"], st["malformed"], st["resyncs"]) == (2, 1, 1)
