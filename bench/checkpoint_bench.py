"""Checkpoint cost: what saving and loading one source's chain state takes.

A listener with ``checkpoint_dir`` encodes each changed source every
``checkpoint_interval_ms`` on its event loop (``export_state`` + ``encode_checkpoint``:
the state must not change while it is read), writes the bytes in a thread
(``write_checkpoint``: temp file, fsync, rename), and at start decodes and imports it.
The loop-blocking part is the figure that matters: ingestion waits for it.

Per scenario a tracker is filled with ``blocks`` blocks in chains of 64, one block per
event, 8 events per batch (the shape of ``listener_memory_bench``):

* ``keyed``: router-salted chains: every block keyed at once, no tokens kept;
* ``pending``: unsalted chains and no detokenizer reachable: every block pending with
  its 16 token ids (the largest state per block).

Measured (this thread's CPU time, medians of ``--repeats``): ``ingest`` (applying the
events that built the state: the baseline, same run), ``save on loop`` (export +
encode), ``write`` (wall time of the durable write, off the loop), ``load`` (decode +
import into an empty tracker, at start), and the file's size. ``save/ingest`` is the
same-run ratio: how a periodic save compares with the ingestion it follows.

Run: ``.venv/bin/python -m bench.checkpoint_bench [--repeats 5] [--blocks 10000 100000]``
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bus.events import KvEvent
from bus.salt import encode_salt
from listener.chains import ChainTracker, export_state, import_state
from listener.checkpoint import (
    Checkpoint,
    Resume,
    decode_checkpoint,
    encode_checkpoint,
    write_checkpoint,
)
from listener.engine_events import BlockHash, BlockStored, EngineEvent, EventBatch
from listener.recovery import Attributor
from listener.templates import CHATML

from ._table import fmt_float, median, render_table

SECRET = b"0123456789abcdef-secret"
CHAIN = 64
BS = 16
PER_BATCH = 8


def batches(blocks: int, salted: bool) -> list[EventBatch]:
    out: list[EventBatch] = []
    events: list[EngineEvent] = []
    for i in range(blocks):
        chain, pos = divmod(i, CHAIN)
        h = BlockHash(i + 1)
        if pos == 0:
            salt = encode_salt(SECRET, "b", chain.to_bytes(32, "big")) if salted else None
            ev = BlockStored([h], None, [7] * BS, BS, cache_salt=salt)
        else:
            ev = BlockStored([h], BlockHash(i), [7] * BS, BS)
        events.append(ev)
        if len(events) == PER_BATCH:
            out.append(EventBatch(1.0, list(events), 0))
            events.clear()
    if events:
        out.append(EventBatch(1.0, events, 0))
    return out


class _Unreachable:
    """A /detokenize nobody answers: unsalted chains stay pending (their jobs never run
    here: the benchmark does not yield to the loop)."""

    async def detokenize_many(self, seqs: Any) -> list[str]:
        await asyncio.Event().wait()
        return []


TRACKERS: list[ChainTracker] = []


def tracker(blocks: int) -> ChainTracker:
    att = Attributor(
        model="m",
        template=CHATML,
        backend="b",
        salt_secret=SECRET,
        detokenizer=_Unreachable(),  # type: ignore[arg-type]
    )

    def emit(ev: KvEvent) -> None:
        return None

    t = ChainTracker("b", emit, att, max_tracked_blocks=blocks)
    TRACKERS.append(t)
    return t


def _ingest(t: ChainTracker, evs: list[EventBatch]) -> None:
    for b in evs:
        t.apply(b, flush=False)
    t.flush()


def _save(t: ChainTracker) -> bytes:
    cp = Checkpoint({"backend": "b"}, time.time(), (Resume("tcp://e:1", 1, None),),
                    export_state(t))  # fmt: skip
    return encode_checkpoint(cp)


def _load(t: ChainTracker, data: bytes) -> None:
    import_state(t, decode_checkpoint(data).state)


def _clock(fn: Callable[..., Any], *args: Any, wall: bool = False) -> tuple[float, Any]:
    clock = time.perf_counter if wall else time.thread_time
    t0 = clock()
    result = fn(*args)
    return clock() - t0, result


def scenario(blocks: int, salted: bool, repeats: int, tmp: Path) -> dict[str, float]:
    evs = batches(blocks, salted)
    res: dict[str, list[float]] = {k: [] for k in ("ingest", "save", "write", "load", "bytes")}
    for _ in range(repeats):
        t = tracker(blocks)
        res["ingest"].append(_clock(_ingest, t, evs)[0])
        took, data = _clock(_save, t)
        res["save"].append(took)
        res["bytes"].append(len(data))
        res["write"].append(_clock(write_checkpoint, tmp / "b.ckpt", data, wall=True)[0])
        fresh = tracker(blocks)
        res["load"].append(_clock(_load, fresh, data)[0])
        assert fresh.stats()["tracked_blocks"] == blocks
    return {k: median(v) for k, v in res.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--blocks", type=int, nargs="+", default=[10_000, 100_000])
    args = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for blocks in args.blocks:
            for name, salted in (("keyed", True), ("pending", False)):
                r = asyncio.run(_in_loop(blocks, salted, args.repeats, Path(d)))
                rows.append(
                    [
                        name,
                        f"{blocks:,}",
                        fmt_float(r["ingest"] * 1000, 1),
                        fmt_float(r["save"] * 1000, 1),
                        fmt_float(r["save"] / r["ingest"], 2),
                        fmt_float(r["write"] * 1000, 1),
                        fmt_float(r["load"] * 1000, 1),
                        fmt_float(r["bytes"] / 2**20, 2),
                    ]
                )
    headers = ["state", "blocks", "ingest ms", "save on loop ms", "save/ingest", "write ms",
               "load ms", "file MiB"]  # fmt: skip
    print(f"checkpoint cost, medians of {args.repeats} (CPU time; write: wall time)")
    print(render_table(headers, rows, left=1))


async def _in_loop(blocks: int, salted: bool, repeats: int, tmp: Path) -> dict[str, float]:
    """In a running loop, as in the listener (attribution jobs need one to queue)."""
    try:
        return scenario(blocks, salted, repeats, tmp)
    finally:
        for t in TRACKERS:
            await t.aclose()
        TRACKERS.clear()


if __name__ == "__main__":
    main()
