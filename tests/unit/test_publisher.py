"""harness.publisher: salted bursts a listener can attribute, and paced runs.

The push tests and the listener benchmarks rely on two things: every chain's first block
carries a salt the listener's secret verifies (for the backend it was issued to, one
prefix key per chain or ``prefixes`` of them in turn), decoded by the listener's own
decoder from the real wire bytes; and a paced run sends whole chains, one per batch, no
earlier than its schedule.
"""

from __future__ import annotations

import time

import pytest

from bus.salt import SaltError, verify_salt
from harness.publisher import SaltingEncoder, salted_publisher, send_paced
from harness.sim.kv_events import CapturePublisher
from listener.decode import decode_batch
from listener.engine_events import BlockStored

SECRET = b"publisher-test-secret-0123456789"


def _stored(payloads: list[bytes]) -> list[list[BlockStored]]:
    out = []
    for p in payloads:
        batch = decode_batch(p, "vllm")
        assert batch.skipped == 0
        out.append([e for e in batch.events if isinstance(e, BlockStored)])
    return out


@pytest.mark.parametrize("fmt", ["vllm-0.33", "vllm-0.23.0"])
@pytest.mark.parametrize("prefixes", [0, 3])
async def test_every_chain_starts_with_a_salt_the_listener_verifies(
    fmt: str, prefixes: int
) -> None:
    cap = CapturePublisher()
    hub = salted_publisher(cap, fmt, (SECRET, "b1", prefixes))
    assert isinstance(hub.encoder, SaltingEncoder)
    await hub.burst(40, 8)  # 320 events: 5 chains of 64 blocks
    keys = []
    for event in (e for batch in _stored(cap.payloads) for e in batch):
        if event.parent_block_hash is None:
            assert event.cache_salt is not None
            info = verify_salt(SECRET, "b1", event.cache_salt)
            assert info is not None
            with pytest.raises(SaltError):  # issued for b1 only
                verify_salt(SECRET, "b2", event.cache_salt)
            keys.append(info.prefix_key)
        else:
            assert event.cache_salt is None
    assert len(keys) == 5
    if prefixes:
        assert keys == [keys[i % prefixes] for i in range(5)] and len(set(keys)) == prefixes
    else:
        assert len(set(keys)) == 5


async def test_unsalted_burst_is_the_simulators() -> None:
    cap = CapturePublisher()
    await salted_publisher(cap, "vllm-0.33", None).burst(8, 8)
    events = [e for batch in _stored(cap.payloads) for e in batch]
    assert len(events) == 64 and all(e.cache_salt is None for e in events)


async def testsend_paced_run_sends_a_salted_chain_per_batch_on_schedule() -> None:
    sent = CapturePublisher()
    hub = salted_publisher(CapturePublisher(), "vllm-0.33", (SECRET, "b1", 0))
    rate, seconds, per = 4000.0, 0.05, 8
    t_start = time.monotonic()
    res = await send_paced(hub, sent, rate, seconds, per)  # type: ignore[arg-type]
    times = res["times"]
    assert res["events_per_batch"] == per
    assert len(times) == len(sent.payloads) == int(rate * seconds / per)
    interval = per / rate
    assert all(t >= t_start + b * interval for b, t in enumerate(times))
    assert times == sorted(times)
    for batch in _stored(sent.payloads):
        assert len(batch) == per
        assert batch[0].parent_block_hash is None
        assert verify_salt(SECRET, "b1", batch[0].cache_salt or "") is not None
        assert all(e.parent_block_hash is not None for e in batch[1:])
    assert hub.publisher is sent  # the real socket is back in place for later bursts
