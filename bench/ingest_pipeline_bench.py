"""The listener's ingestion pipeline in one process: decode -> chain tracker -> event hub.

``ingest_bench`` measures the real processes (ZMQ, SSE, the event loop) but its figures move
with whatever else runs on the machine. This one takes the same salted burst the judged
``ingest_bench`` variants publish, keeps the frames in memory, and times each stage over
them against ``msgpack.unpackb`` of the same frames (the bare loop's decode) in the same run:

* ``unpack``  ``msgpack.unpackb`` only (the baseline);
* ``decode``  ``listener.decode.decode_batch``;
* ``full``    decode, ``ChainTracker.apply`` (salt MAC per chain, every block keyed, pruning
  at ``max_tracked_blocks``), flushes as the listener does them (once per run of
  ``--drain`` batches), ``EventHub.publish`` and one subscriber drained;
* ``conv``    the same in conversation mode (``conversation.enabled``, 1 KiB chunks):
  every block's tokens also go through Qwen2's token byte table and extend its chain's
  key chain, and the chain keys are announced too. The burst's token ids are Qwen2
  vocabulary ids (``Qwen2Tokenizer.sample_ids``, for every stage), so every block maps.

Target: ``conv`` costs <= 1.5x ``full`` per engine event (the ``conv/full`` column, same
run).

For figures that other jobs cannot disturb, count instructions instead of seconds; the
difference from a run that only generates the frames (``--once none``) is the stage's cost::

    valgrind --tool=callgrind --callgrind-out-file=/dev/null \\
        .venv/bin/python -m bench.ingest_pipeline_bench --once full --batches 6000 \\
        --max-tracked-blocks 20000
    (the same with --once none; instructions per event = difference / (6000 x 8))
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import msgpack

from bench._table import render_table
from bus.events import KvEvent
from harness.publisher import DEFAULT_SALT_SECRET as SALT_SECRET
from harness.publisher import salted_publisher
from harness.sim.kv_events import CapturePublisher
from harness.sim.tokenizer import Qwen2Tokenizer, bundled_qwen2_json
from listener.chains import ChainTracker
from listener.chains.conversation import ConversationSettings
from listener.decode import decode_batch
from listener.recovery import Attributor
from listener.stream import EventHub
from listener.templates import CHATML
from listener.token_bytes import load_token_bytes

FORMATS = {"M": "vllm-0.33", "A": "vllm-0.23.0"}
STAGES = ("unpack", "decode", "full", "conv")
TARGET_CONV = 1.5


def make_frames(fmt: str, batches: int, prefixes: int) -> list[bytes]:
    """The salted burst of ``ingest_bench`` (8 events per batch, chains of 64 blocks), with
    Qwen2 vocabulary ids."""
    cap = CapturePublisher()
    ids = Qwen2Tokenizer().sample_ids
    hub = salted_publisher(cap, fmt, (SALT_SECRET, "sim", prefixes), sample_ids=ids)
    asyncio.run(hub.burst(batches, 8))
    # As the listener does at start (listener.cli): what exists now is out of the cyclic
    # GC's reach, so the generator's objects do not weigh on the stages measured, and the
    # young generation is collected every 20,000 allocations, not 700.
    gc.collect()
    gc.freeze()
    _, g1, g2 = gc.get_threshold()
    gc.set_threshold(20_000, g1, g2)
    return cap.payloads


def _stage(
    name: str, frames: list[bytes], drain: int, max_tracked_blocks: int = 100_000
) -> Callable[[], int]:
    """A closure that runs one stage over all frames and returns the events seen."""
    if name == "unpack":

        def unpack() -> int:
            return sum(len(msgpack.unpackb(p)[1]) for p in frames)

        return unpack
    if name == "decode":

        def decode() -> int:
            return sum(len(decode_batch(p, "vllm").events) for p in frames)

        return decode

    conversation = None
    if name == "conv":
        conversation = ConversationSettings(load_token_bytes(bundled_qwen2_json()), "sim")

    def full() -> int:
        attributor = Attributor(model="", template=CHATML, backend="sim", salt_secret=SALT_SECRET)
        hub = EventHub(history_size=10_000, queue_size=1_000_000)

        def emit(ev: KvEvent) -> None:  # the event id publish returns is not needed here
            hub.publish("sim", ev)

        tracker = ChainTracker(
            "sim",
            emit,
            attributor,
            max_tracked_blocks=max_tracked_blocks,
            conversation=conversation,
        )
        hub.add_backend("sim", tracker.snapshot)
        sub = hub.subscribe("sim", None)
        n = 0
        for i, p in enumerate(frames):
            batch = decode_batch(p, "vllm")
            n += len(batch.events)
            tracker.apply(batch, flush=False)
            if i % drain == drain - 1:
                tracker.flush()
                sub.ready(1 << 20)
        tracker.flush()
        sub.ready(1 << 20)
        return n

    return full


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", type=int, default=25_000, help="batches of 8 events (25000)")
    p.add_argument("--formats", nargs="+", default=["M", "A"], choices=sorted(FORMATS))
    p.add_argument("--prefixes", type=int, default=0, help="0: a new prefix per chain")
    p.add_argument("--drain", type=int, default=65, help="batches per flush (65)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument(
        "--max-tracked-blocks",
        type=int,
        default=100_000,
        help="the tracker's bound (100000); lower it so that short runs reach pruning",
    )
    p.add_argument(
        "--once",
        choices=["none", *STAGES],
        help="one run of one stage, no table (none: only generate the frames)",
    )
    args = p.parse_args(argv)

    if args.once:
        frames = make_frames(FORMATS[args.formats[0]], args.batches, args.prefixes)
        if args.once != "none":
            _stage(args.once, frames, args.drain, args.max_tracked_blocks)()
        return 0

    rows: list[list[Any]] = []
    verdicts: list[str] = []
    for fmt in args.formats:
        print(f"generating {args.batches} salted batches ({FORMATS[fmt]})...", file=sys.stderr)
        frames = make_frames(FORMATS[fmt], args.batches, args.prefixes)
        times: dict[str, list[float]] = {name: [] for name in STAGES}
        events = 0
        for r in range(args.repeats):
            for name in times:  # interleaved: a slow moment hits every stage alike
                run = _stage(name, frames, args.drain, args.max_tracked_blocks)
                t0 = time.process_time()
                events = run()
                times[name].append(time.process_time() - t0)
            print(f"  round {r + 1}/{args.repeats}", file=sys.stderr)
        base = statistics.median(times["unpack"]) / events * 1e6
        prefix_only = statistics.median(times["full"]) / events * 1e6
        for name, ts in times.items():
            us = statistics.median(ts) / events * 1e6
            ratio = f"{us / prefix_only:.2f}x" if name == "conv" else ""
            rows.append(
                [FORMATS[fmt], name, f"{us:.2f}", f"{us / base:.2f}x", ratio, f"{1e6 / us:,.0f}"]
            )
        conv = statistics.median(
            c / f for c, f in zip(times["conv"], times["full"], strict=True)
        )  # paired per round
        verdicts.append(
            f"{FORMATS[fmt]}: conv/full {conv:.2f}x (paired per round; target <= "
            f"{TARGET_CONV}x): {'PASS' if conv <= TARGET_CONV else 'FAIL'}"
        )
    print(
        f"\ningestion pipeline in one process: {args.batches} batches x 8 block events, salted "
        f"chains of 64 blocks, flush every {args.drain} batches; CPU time, medians of "
        f"{args.repeats} interleaved rounds\n"
    )
    print(
        render_table(
            ["format", "stage", "us/event", "vs unpack", "conv/full", "events/s (one core)"],
            rows,
            left=2,
        )
    )
    print()
    for line in verdicts:
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
