"""A simulated engine's KV event publisher, driven line by line on stdin.

It runs the engine simulator's own burst code (``harness.sim.kv_events.KvEventPublisher.burst``:
the simulator's vLLM/SGLang encoder, its tokenizer and its ZMQ PUB, so the bytes are
what ``python -m harness.sim``'s ``POST /sim/burst`` sends) without the HTTP engine
around it, and with one option the simulator has not: ``--salted`` puts a router-issued
cache salt (``bus.salt.encode_salt``, keyed by ``$CONTINUUM_BENCH_SALT_SECRET``) on the
first block of every chain, as vLLM shows it (``extra_keys[0] == [salt]``; SGLang formats:
``cache_salt``). That is the path a request routed by continuum takes: a listener with
the same secret verifies the salt and attributes every chain, so every block event
becomes tracked, keyed state (an unsalted burst is discarded by a listener with a salt
secret). ``--prefixes N`` spreads the chains over N prefix keys (0: one key per chain).

Commands, one a line; each is answered by one JSON line on stdout:

* ``burst BATCHES EVENTS_PER_BATCH``: publish as fast as one core allows (chains of 64
  blocks, one block per event); answers the publisher's burst report (``events_per_s``,
  ``first_seq``, ``last_seq``, ...);
* ``paced RATE SECONDS EVENTS_PER_BATCH``: ``RATE`` events per second for ``SECONDS``,
  each batch a whole chain of its own, encoded up front and then sent on a fixed
  schedule; answers ``{"times": [monotonic send time of each batch], "events_per_batch"}``.

Closing stdin ends the process. It prints ``READY`` once the PUB socket is bound.

Run: ``python -m harness.publisher --endpoint 'tcp://*:5557' [--format vllm-0.33]
[--salted [--prefixes 0] [--backend sim]] [--token-ids simple|qwen2] [--hwm 100000]``
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import msgpack

from bus.salt import encode_salt

from .sim.kv_events import CapturePublisher, KvEventPublisher, ZmqPublisher
from .sim.kv_wire import get_format
from .sim.tokenizer import Qwen2Tokenizer, SimpleTokenizer

__all__ = [
    "DEFAULT_SALT_SECRET",
    "SALT_ENV",
    "SaltingEncoder",
    "main",
    "salted_publisher",
    "send_paced",
]

SALT_ENV = "CONTINUUM_BENCH_SALT_SECRET"
DEFAULT_SALT_SECRET = b"ingest-bench-salt-secret-0123456789"
"""The secret when ``$CONTINUUM_BENCH_SALT_SECRET`` is unset; a listener verifying these
salts needs the same one."""
_NIL = b"\xc0"  # msgpack nil: a burst event whose parent is nil starts a chain


class SaltingEncoder:
    """The simulator's encoder, plus a router-issued cache salt on every chain's first block.

    ``KvEventPublisher.burst`` packs a chain's first event with parent nil; this wrapper puts
    ``[salt]`` into that event's ``extra_keys[0]`` (vLLM >= 0.17, both encodings), or into
    ``cache_salt`` for SGLang formats. ``prefixes == 0``: a new prefix key per chain.
    """

    def __init__(self, enc: Any, secret: bytes, backend: str, prefixes: int, bpe: int) -> None:
        self._enc, self.fmt = enc, enc.fmt
        self._secret, self._backend, self._prefixes, self._bpe = secret, backend, prefixes, bpe
        self._chains = 0
        self._memo: dict[int, str] = {}
        self._packb = msgpack.Packer(use_bin_type=True, autoreset=True).pack

    def _salt(self) -> str:
        i = self._chains if self._prefixes <= 0 else self._chains % self._prefixes
        self._chains += 1
        salt = self._memo.get(i)
        if salt is None:
            key = hashlib.sha256(b"ingest-bench-prefix-%d" % i).digest()
            salt = encode_salt(self._secret, self._backend, key)
            if self._prefixes > 0:
                self._memo[i] = salt
        return salt

    def stored_packed(
        self,
        hashes: bytes,
        parent: bytes,
        tokens: bytes,
        block_size: bytes,
        extra_keys: bytes,
        cache_salt: str | None = None,
    ) -> bytes:
        if parent == _NIL:
            salt = self._salt()
            if self.fmt.salt == "extra_keys":
                keys = [[salt]] + [None] * (self._bpe - 1)
                return self._enc.stored_packed(
                    hashes, parent, tokens, block_size, self._packb(keys)
                )
            return self._enc.stored_packed(hashes, parent, tokens, block_size, extra_keys, salt)
        return self._enc.stored_packed(hashes, parent, tokens, block_size, extra_keys)

    def batch(self, ts: float, events: Sequence[bytes], dp_rank: int | None = 0) -> bytes:
        return self._enc.batch(ts, events, dp_rank)


def salted_publisher(
    publisher: Any,
    fmt: str,
    salt: tuple[bytes, str, int] | None,
    sample_ids: Callable[[int], list[int]] | None = None,
) -> KvEventPublisher:
    """The simulator's KV event publisher sending through ``publisher`` (a ``ZmqPublisher``,
    or a ``CapturePublisher`` to get the batches as bytes). ``salt`` = (secret, backend,
    prefixes) salts every chain's first block (:class:`SaltingEncoder`); None: unsalted.
    ``sample_ids`` makes the token ids (the simple tokenizer's by default; a real
    tokenizer's for listeners that map ids to bytes)."""
    events = KvEventPublisher(
        block_size=16,
        fmt=get_format(fmt),
        publisher=publisher,
        sample_ids=sample_ids or SimpleTokenizer().sample_ids,
    )
    if salt is not None:
        secret, backend, prefixes = salt
        events.encoder = SaltingEncoder(events.encoder, secret, backend, prefixes, 1)  # type: ignore[assignment]
    return events


async def send_paced(
    events: KvEventPublisher, pub: ZmqPublisher, rate: float, seconds: float, per: int
) -> Any:
    """Encode every batch first (the burst code, into a list), then send them on a fixed
    schedule through the real PUB socket, so encoding does not delay a send."""
    capture = CapturePublisher()
    events.publisher = capture  # type: ignore[assignment]
    try:
        await events.burst(int(rate * seconds / per), per, chain_blocks=per)  # a chain per batch
    finally:
        events.publisher = pub
    interval = per / rate
    times: list[float] = []
    t0 = time.monotonic()
    for b, payload in enumerate(capture.payloads):
        delay = t0 + b * interval - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        times.append(time.monotonic())
        pub.publish(payload)
    return {"times": times, "events_per_batch": per}


async def _serve(args: argparse.Namespace) -> None:
    secret = os.environ.get(SALT_ENV, "").encode() or DEFAULT_SALT_SECRET
    salt = (secret, args.backend, args.prefixes) if args.salted else None
    pub = ZmqPublisher(args.endpoint, hwm=args.hwm)
    sample_ids = Qwen2Tokenizer().sample_ids if args.token_ids == "qwen2" else None
    events = salted_publisher(pub, args.format, salt, sample_ids)
    events.start()
    print("READY", flush=True)
    loop = asyncio.get_running_loop()
    try:
        while line := await loop.run_in_executor(None, sys.stdin.readline):
            cmd, *vals = line.split() or [""]
            if cmd == "burst":
                res = await events.burst(int(vals[0]), int(vals[1]))
            elif cmd == "paced":
                res = await send_paced(events, pub, float(vals[0]), float(vals[1]), int(vals[2]))
            else:
                res = {"error": f"unknown command {line.strip()!r}"}
            print(json.dumps(res), flush=True)
    finally:
        events.close()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m harness.publisher", description=__doc__)
    p.add_argument("--endpoint", required=True, help="ZMQ PUB endpoint to bind")
    p.add_argument("--format", default="vllm-0.33", help="engine wire format (harness.sim)")
    p.add_argument("--hwm", type=int, default=100_000, help="PUB SNDHWM (batches)")
    p.add_argument("--salted", action="store_true", help="salt every chain's first block")
    p.add_argument("--prefixes", type=int, default=0, help="distinct prefix keys (0: per chain)")
    p.add_argument("--backend", default="sim", help="the backend the salts are issued for")
    p.add_argument(
        "--token-ids", choices=("simple", "qwen2"), default="simple",
        help="whose token ids the blocks carry: the simulator's simple tokenizer, or Qwen2's "
        "vocabulary (every id maps through Qwen2's tokenizer.json: conversation keys)",
    )  # fmt: skip
    asyncio.run(_serve(p.parse_args(argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
