"""Checkpoint files: one source's chain state on disk, so a restarted listener keeps it.

An engine's KV events say what it *stores*, once; a cache hit stores nothing. A listener
that restarts empty beside a running engine therefore never relearns the prefixes the
engine keeps serving from its cache, unless the engine's replay buffer still holds the
batches that stored them (vLLM's is bounded: ``buffer_steps``). A checkpoint closes that
hole: the listener writes each source's tracker state (``listener.chains.state``) with
the sequence number of the last batch applied, and on start continues from there, asking
the engine's replay only for the batches after it.

File layout (one file per source, ``<checkpoint_dir>/<backend_name>.ckpt``)::

    magic "CTMKVCKP" (8) | format version (u32 BE) | body length (u64 BE)
    | SHA-256 of the body (32) | body (msgpack map)

The body holds the identity (backend, engine, endpoints, the settings the state depends
on), when it was written, per transport the last sequence number and a digest of that
batch's payload (``Resume``), and the tracker state. The identity check refuses a file
another source, another engine kind or other tracker settings wrote; the payload digest
lets the source tell, through the engine's replay, that the engine still is the one
that published that batch (``listener.zmq_source``).

Writes are atomic: a private temporary file in the same directory (mode 0600, the
directory 0700), fsync, rename over the old file, fsync of the directory; a crash at any
point leaves the previous checkpoint or the new one, never a torn file. Reading never
raises for bad content: ``CheckpointError`` says why (``kind``) and the caller counts it,
logs it and starts empty.
"""

from __future__ import annotations

import hashlib
import os
import struct
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack

__all__ = [
    "FORMAT_VERSION",
    "Checkpoint",
    "CheckpointError",
    "Resume",
    "check_identity",
    "decode_checkpoint",
    "encode_checkpoint",
    "payload_digest",
    "read_checkpoint",
    "write_checkpoint",
]

MAGIC = b"CTMKVCKP"
FORMAT_VERSION = 1
_HEADER = struct.Struct(">8sIQ32s")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used. ``kind``: ``truncated``, ``magic``, ``version``,
    ``checksum``, ``malformed``, ``foreign`` (another source, engine kind or settings),
    ``expired`` (older than ``checkpoint_max_age``) or ``state`` (the tracker refused it)."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind = kind


@dataclass(frozen=True, slots=True)
class Resume:
    """Where one transport stood: the last batch applied and a digest of its payload."""

    endpoint: str
    seq: int
    digest: bytes | None


@dataclass(frozen=True, slots=True)
class Checkpoint:
    identity: dict[str, Any]
    written_at: float
    """Unix time of the write."""
    resume: tuple[Resume, ...]
    state: Any
    """``listener.chains.state.export_state`` data."""


def payload_digest(payload: bytes) -> bytes:
    """What identifies one published batch (its payload carries the engine's timestamp)."""
    return hashlib.blake2b(payload, digest_size=16).digest()


def encode_checkpoint(cp: Checkpoint) -> bytes:
    body = msgpack.packb(
        {
            "identity": cp.identity,
            "written_at": cp.written_at,
            "resume": [[r.endpoint, r.seq, r.digest] for r in cp.resume],
            "state": cp.state,
        },
        use_bin_type=True,
    )
    return _HEADER.pack(MAGIC, FORMAT_VERSION, len(body), hashlib.sha256(body).digest()) + body


def decode_checkpoint(data: bytes) -> Checkpoint:
    """Parse and verify a checkpoint file's bytes; ``CheckpointError`` when unusable."""
    if len(data) < _HEADER.size:
        raise CheckpointError("truncated", f"{len(data)} bytes, shorter than the header")
    magic, version, length, digest = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise CheckpointError("magic", "not a listener checkpoint")
    if version != FORMAT_VERSION:
        raise CheckpointError("version", f"format {version}, this listener reads {FORMAT_VERSION}")
    body = data[_HEADER.size :]
    if len(body) != length:
        raise CheckpointError("truncated", f"body of {len(body)} bytes, header says {length}")
    if hashlib.sha256(body).digest() != digest:
        raise CheckpointError("checksum", "body does not match its SHA-256")
    try:
        obj = msgpack.unpackb(body, raw=False, strict_map_key=True)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as e:
        raise CheckpointError("malformed", f"body does not decode: {e}") from None
    try:
        identity, written_at, resume = obj["identity"], obj["written_at"], obj["resume"]
        if type(identity) is not dict or type(written_at) not in (int, float):
            raise TypeError("identity or written_at")
        out = []
        for endpoint, seq, digest_ in resume:
            if type(endpoint) is not str or type(seq) is not int or seq < 0:
                raise TypeError("resume entry")
            if digest_ is not None and type(digest_) is not bytes:
                raise TypeError("resume digest")
            out.append(Resume(endpoint, seq, digest_))
        return Checkpoint(identity, float(written_at), tuple(out), obj["state"])
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError("malformed", f"body fields: {e}") from None


def check_identity(cp: Checkpoint, identity: Mapping[str, Any], max_age_s: float) -> None:
    """Raise ``CheckpointError`` unless ``cp`` was written by this source as configured
    now, within ``max_age_s``."""
    if cp.identity != dict(identity):
        diff = sorted(k for k in set(cp.identity) | set(identity)
                      if cp.identity.get(k) != identity.get(k))  # fmt: skip
        raise CheckpointError("foreign", "written with another " + ", ".join(diff))
    age = time.time() - cp.written_at
    if age > max_age_s:
        raise CheckpointError("expired", f"written {age:.0f} s ago (max {max_age_s:.0f} s)")


def read_checkpoint(path: Path) -> Checkpoint | None:
    """The checkpoint at ``path``; None when there is none. ``CheckpointError`` (kind
    ``truncated`` for an unreadable file) when it is unusable."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise CheckpointError("truncated", f"cannot read {path}: {e}") from None
    return decode_checkpoint(data)


def write_checkpoint(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` atomically and durably (module docstring)."""
    directory = path.parent
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = directory / f".{path.name}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    dfd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
