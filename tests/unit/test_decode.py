"""listener.decode: golden engine frames, per-event encodings, leniency, and hostile input."""

from __future__ import annotations

import copy
import json
import math
import tracemalloc
from dataclasses import replace
from pathlib import Path
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from listener.decode import DEFAULT_MAX_FRAME_BYTES, DecodeError, decode_batch
from listener.engine_events import (
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    EventBatch,
    normalize_hash,
)

FIXTURE = Path(__file__).parent.parent / "fixtures" / "engine" / "kv_event_frames.json"
GOLDEN: list[dict[str, Any]] = json.loads(FIXTURE.read_text())["frames"]

H = BlockHash(14248744570211613888)  # the document's example hash (uint64, >= 2**63)
P = BlockHash(3846834883482343549)
TS = 1700000000.5
U64 = (1 << 64) - 1


def from_json(v: Any) -> Any:
    """Fixture JSON back to msgpack values ({"bin": hex} is bytes)."""
    if isinstance(v, dict):
        if set(v) == {"bin"}:
            return bytes.fromhex(v["bin"])
        return {k: from_json(x) for k, x in v.items()}
    if isinstance(v, list):
        return [from_json(x) for x in v]
    return v


EVENT_TYPES = {
    "BlockStored": BlockStored,
    "BlockRemoved": BlockRemoved,
    "AllBlocksCleared": AllBlocksCleared,
}


def expected_batch(exp: dict[str, Any]) -> EventBatch:
    events = [EVENT_TYPES[e.pop("event")](**e) for e in from_json(exp["events"])]
    return EventBatch(exp["ts"], events, exp["dp_rank"], exp["skipped"])


def pack(*events: Any, dp_rank: Any = 0, ts: Any = TS) -> bytes:
    return msgpack.packb([ts, list(events), dp_rank])


def a_stored(**kw: Any) -> list[Any]:
    """A vLLM 0.23-layout array BlockStored (12 elements) with the document's values."""
    f = {
        "block_hashes": [H],
        "parent_block_hash": P,
        "token_ids": [101, 102, 103, 104],
        "block_size": 4,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "extra_keys": [None],
        "group_idx": 0,
        "kv_cache_spec_kind": "full_attention",
        "kv_cache_spec_sliding_window": None,
    } | kw
    return ["BlockStored", *f.values()]


def m_stored(**kw: Any) -> dict[str, Any]:
    """A vLLM 0.33-style map BlockStored (defaults omitted)."""
    return {
        "type": "BlockStored",
        "block_hashes": [H],
        "parent_block_hash": P,
        "token_ids": [101, 102, 103, 104],
        "block_size": 4,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "group_idx": 0,
    } | kw


def stored(**kw: Any) -> BlockStored:
    f: dict[str, Any] = {
        "block_hashes": [H],
        "parent_block_hash": P,
        "token_ids": [101, 102, 103, 104],
        "block_size": 4,
        "medium": "GPU",
    } | kw
    return BlockStored(**f)


def one(payload: bytes, engine: str = "vllm") -> Any:
    batch = decode_batch(payload, engine)  # type: ignore[arg-type]
    assert batch.skipped == 0, batch
    assert len(batch.events) == 1, batch
    return batch.events[0]


# --- golden frames --------------------------------------------------------------------------


@pytest.mark.parametrize("frame", GOLDEN, ids=[f["name"] for f in GOLDEN])
def test_golden_frame_decodes_to_expected_batch(frame: dict[str, Any]) -> None:
    payload = bytes.fromhex(frame["hex"])
    got = decode_batch(payload, frame["engine"])
    assert got == expected_batch(frame["expected"])
    # Field by field as well, so a failure names the field (and hashes keep their exact type).
    for g, e in zip(got.events, expected_batch(frame["expected"]).events, strict=True):
        assert type(g) is type(e)
        for name in getattr(e, "__slots__", ()):
            assert getattr(g, name) == getattr(e, name), name
        for h in getattr(g, "block_hashes", []):
            assert type(h) in (int, bytes)


@pytest.mark.parametrize("frame", GOLDEN, ids=[f["name"] for f in GOLDEN])
def test_golden_fixture_is_self_consistent(frame: dict[str, Any]) -> None:
    payload = bytes.fromhex(frame["hex"])
    assert msgpack.unpackb(payload, raw=False, strict_map_key=False) == from_json(
        frame["structure"]
    )
    if frame["origin"].startswith("built here"):
        assert msgpack.packb(from_json(frame["structure"])) == payload


def test_golden_covers_the_required_versions() -> None:
    names = {f["name"] for f in GOLDEN}
    for required in (
        "vllm-0.10.2-A-BlockStored",
        "vllm-0.10.2-A-BlockRemoved",
        "vllm-0.10.2-A-AllBlocksCleared",
        "vllm-0.23.0-A-BlockStored-salted",
        "vllm-0.9.0-A-BlockStored-no-rank",
        "vllm-0.33.0-M-BlockStored-salted",
        "vllm-0.33.0-M-BlockRemoved",
        "vllm-0.33.0-M-AllBlocksCleared",
        "sglang-0.5.19-A-BlockStored-salted",
        "sglang-0.5.23-M-BlockStored-salted",
        "vllm-0.23.0-A-BlockStored-bin32-hashes",
    ):
        assert required in names


def test_sglang_negative_int64_and_vllm_uint64_land_on_the_same_hash() -> None:
    sg = one(bytes.fromhex(_golden("sglang-0.5.19-A-BlockStored-salted")), "sglang")
    vl = one(bytes.fromhex(_golden("vllm-0.10.2-A-BlockStored")))
    assert sg.block_hashes == vl.block_hashes == [H]
    assert "d3c5bdb5b18abd3cc0" in _golden("sglang-0.5.19-A-BlockStored-salted")


def _golden(name: str) -> str:
    return next(f["hex"] for f in GOLDEN if f["name"] == name)


# --- encodings, chosen per event ------------------------------------------------------------


def test_encoding_is_chosen_per_event_in_one_batch() -> None:
    batch = decode_batch(
        pack(
            a_stored(),
            {"type": "BlockRemoved", "block_hashes": [H], "medium": "GPU", "group_idx": 0},
            ["AllBlocksCleared"],
            m_stored(extra_keys=[["salt-m"]]),
            ["BlockRemoved", [P], "CPU", 1],
            {"type": "AllBlocksCleared"},
        ),
        "vllm",
    )
    assert batch == EventBatch(
        TS,
        [
            stored(),
            BlockRemoved([H], "GPU", 0),
            AllBlocksCleared(),
            stored(cache_salt="salt-m"),
            BlockRemoved([P], "CPU", 1),
            AllBlocksCleared(),
        ],
        0,
        0,
    )


def test_sglang_mixes_array_and_map_events_too() -> None:
    batch = decode_batch(
        pack(
            ["BlockStored", [-1], None, [1, 2], 2, None, "GPU"],
            {"type": "BlockStored", "block_hashes": [-2], "token_ids": [3, 4], "block_size": 2},
            ["BlockRemoved", [-1, -2], "CPU_PINNED"],
        ),
        "sglang",
    )
    assert batch.events == [
        BlockStored([BlockHash(U64)], None, [1, 2], 2, "GPU"),
        BlockStored([BlockHash(U64 - 1)], None, [3, 4], 2, None),
        BlockRemoved([BlockHash(U64), BlockHash(U64 - 1)], "CPU_PINNED"),
    ]


def test_map_encoding_defaults_omitted() -> None:
    ev = one(pack({"type": "BlockStored", "block_hashes": [H], "block_size": 16}))
    assert ev == BlockStored([H], None, [], 16)
    assert one(pack({"type": "BlockRemoved", "block_hashes": [H]})) == BlockRemoved([H])


def test_vllm_090_has_no_rank_and_old_arrays_take_defaults() -> None:
    batch = decode_batch(msgpack.packb([TS, [a_stored()[:6]]]), "vllm")
    assert batch.dp_rank is None
    assert batch.events == [stored(medium=None)]
    # 0.10.2 (7), 0.14 (8), 0.17 (9), 0.20 (10), 0.22 (12) elements, and a future 20.
    for n in (7, 8, 9, 10, 12):
        assert one(pack(a_stored()[:n])) == stored()
    assert one(pack([*a_stored(), "future", 1, None, [1], {"x": 1}, 2.5, b"", 0])) == stored()
    # Shorter than tag + 4 fields: not a BlockStored.
    assert decode_batch(pack(a_stored()[:4]), "vllm").skipped == 1


def test_group_idx() -> None:
    assert one(pack(a_stored(group_idx=3))).group_idx == 3
    assert one(pack(a_stored(group_idx=None))).group_idx == 0
    assert one(pack(m_stored(group_idx=2))).group_idx == 2
    assert one(pack(["BlockRemoved", [H], "GPU", 5])) == BlockRemoved([H], "GPU", 5)


def test_lora_and_medium() -> None:
    ev = one(pack(a_stored(lora_id=7, lora_name="sql-lora", medium="CPU")))
    assert (ev.lora_id, ev.lora_name, ev.medium) == (7, "sql-lora", "CPU")
    ev = one(pack(m_stored(lora_name="x", medium="STORAGE")))
    assert (ev.lora_name, ev.medium) == ("x", "STORAGE")


def test_extra_top_level_elements_are_ignored() -> None:
    batch = decode_batch(msgpack.packb([TS, [a_stored()], 2, "extra", [1, 2], {"k": 0}]), "vllm")
    assert batch == EventBatch(TS, [stored()], 2, 0)


def test_integer_ts_is_accepted() -> None:
    assert decode_batch(pack(ts=1700000000), "vllm").ts == 1700000000.0


# --- leniency: unknown and malformed events are skipped and counted -------------------------


def test_unknown_tags_are_skipped_and_counted() -> None:
    batch = decode_batch(
        pack(
            ["BlockUpdated", [H], 1],
            {"type": "Created", "num_blocks": 3},
            a_stored(),
            {"no_type": 1},
            [],
            [["BlockStored"]],  # unhashable tag
            {"type": ["BlockStored"]},
        ),
        "vllm",
    )
    assert batch.events == [stored()]
    assert batch.skipped == 6


def test_non_container_events_are_skipped_and_counted() -> None:
    batch = decode_batch(pack(1, "BlockStored", None, True, 2.5, b"\x00", a_stored(), -3), "vllm")
    assert batch.events == [stored()]
    assert batch.skipped == 7


def test_unknown_keys_and_extra_positions_are_ignored() -> None:
    ev = one(
        pack(
            m_stored(
                locality="LOCAL",
                ownership=2,
                session_id="s",
                lookahead_token_ids=[[1, 2]],
                kv_cache_spec_kind="sliding_window",
                **{"brand_new": {"nested": [1]}},
            )
        )
    )
    assert ev == stored()
    assert one(pack(["BlockRemoved", [H], "GPU", 0, "LOCAL", 3, "x"])) == BlockRemoved([H], "GPU")
    assert one(pack(["AllBlocksCleared", 1, 2])) == AllBlocksCleared()
    # Non-string map keys are tolerated (strict_map_key=False) and ignored.
    assert one(pack({**m_stored(), 1: 2, b"k": 3})) == stored()


BAD_A_FIELDS: list[tuple[str, Any]] = [
    ("block_hashes", "abc"),
    ("block_hashes", []),
    ("block_hashes", None),
    ("block_hashes", [H, "x"]),
    ("block_hashes", [1.5]),
    ("block_hashes", [True]),
    ("block_hashes", [None]),
    ("block_hashes", [b""]),
    ("block_hashes", [b"\x01" * 65]),
    ("block_hashes", [[H]]),
    ("parent_block_hash", "p"),
    ("parent_block_hash", 1.0),
    ("parent_block_hash", False),
    ("parent_block_hash", [P]),
    ("token_ids", "tokens"),
    ("token_ids", {"a": 1}),
    ("token_ids", [1, "2"]),
    ("token_ids", [1, 2.0]),
    ("token_ids", [1, None]),
    ("token_ids", [-1]),
    ("token_ids", [1 << 32]),
    ("token_ids", [[101, 102]]),  # bigram pairs are SGLang-only
    ("block_size", 0),
    ("block_size", -4),
    ("block_size", "4"),
    ("block_size", 4.0),
    ("block_size", True),
    ("block_size", None),
    ("lora_id", "7"),
    ("lora_id", 1.5),
    ("lora_id", False),
    ("medium", 1),
    ("medium", ["GPU"]),
    ("medium", b"GPU"),
    ("lora_name", 3),
    ("lora_name", {"n": 1}),
    ("extra_keys", "salt"),
    ("extra_keys", 5),
    ("extra_keys", ["salt"]),
    ("extra_keys", [5]),
    ("group_idx", -1),
    ("group_idx", "0"),
    ("group_idx", 0.0),
    ("group_idx", True),
]


@pytest.mark.parametrize(("field", "value"), BAD_A_FIELDS)
def test_a_wrong_field_type_skips_only_that_event(field: str, value: Any) -> None:
    batch = decode_batch(pack(a_stored(), a_stored(**{field: value}), a_stored()), "vllm")
    assert batch.events == [stored(), stored()]
    assert batch.skipped == 1


@pytest.mark.parametrize(("field", "value"), [*BAD_A_FIELDS, ("cache_salt", 5)])
def test_m_wrong_field_type_skips_only_that_event(field: str, value: Any) -> None:
    batch = decode_batch(pack(m_stored(), m_stored(**{field: value}), m_stored()), "vllm")
    assert batch.events == [stored(), stored()]
    assert batch.skipped == 1


@pytest.mark.parametrize(
    "event",
    [
        ["BlockRemoved"],
        ["BlockRemoved", []],
        ["BlockRemoved", "h"],
        ["BlockRemoved", [H], 5],
        ["BlockRemoved", [H], "GPU", -1],
        ["BlockRemoved", [H, None], "GPU"],
        {"type": "BlockRemoved"},
        {"type": "BlockRemoved", "block_hashes": [H], "medium": 1},
        {"type": "BlockRemoved", "block_hashes": [H], "group_idx": "0"},
        {"type": "BlockStored", "block_hashes": [H]},  # no block_size
    ],
)
def test_bad_removed_and_short_events_are_skipped(event: Any) -> None:
    batch = decode_batch(pack(event, ["AllBlocksCleared"]), "vllm")
    assert batch.events == [AllBlocksCleared()]
    assert batch.skipped == 1


@pytest.mark.parametrize(
    "event",
    [
        ["BlockStored", [H], P, [1, 2], 2, None, "GPU", "not-a-map"],
        ["BlockStored", [H], P, [1, 2], 2, None, "GPU", {"cache_salt": 5}],
        ["BlockStored", [H], P, [[1, 2], 3], 2, None, "GPU"],  # mixed pairs and ints
        ["BlockStored", [H], P, [[1, 2], []], 2, None, "GPU"],
        ["BlockStored", [H], P, [[1, 2], ["a", 2]], 2, None, "GPU"],
        {"type": "BlockStored", "block_hashes": [H], "block_size": 2, "cache_salt": [1]},
    ],
)
def test_bad_sglang_events_are_skipped(event: Any) -> None:
    batch = decode_batch(pack(event, ["AllBlocksCleared"]), "sglang")
    assert batch.events == [AllBlocksCleared()]
    assert batch.skipped == 1


def test_token_ids_nil_means_none_sent() -> None:
    assert one(pack(a_stored(token_ids=None))).token_ids == []
    assert one(pack(m_stored(token_ids=None))).token_ids == []


def test_block_size_is_not_checked_against_token_count() -> None:
    # vLLM hybrid / sliding-window events legitimately carry more tokens than hashes*block_size;
    # the chain tracker decides per engine (seed, "엔진별 block_size 처리").
    ev = one(pack(a_stored(token_ids=list(range(12)), block_size=4)))
    assert (ev.block_size, len(ev.token_ids)) == (4, 12)


# --- hashes ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("wire", "want"),
    [
        (0, 0),
        (U64, U64),
        (1 << 63, 1 << 63),
        (-1, U64),
        (-(1 << 63), 1 << 63),
        (-4197999503497937728, H),
        (b"\xab" * 32, b"\xab" * 32),
        (b"\x01", b"\x01"),
        (b"\x02" * 64, b"\x02" * 64),
    ],
)
def test_hash_normalisation(wire: Any, want: Any) -> None:
    ev = one(pack(a_stored(block_hashes=[wire, wire], parent_block_hash=wire)))
    assert ev.block_hashes == [want, want]
    assert ev.parent_block_hash == want
    assert type(ev.parent_block_hash) is type(want)
    assert one(pack(["BlockRemoved", [wire]])).block_hashes == [want]


hash_values = st.one_of(
    st.integers(-(1 << 63), U64), st.binary(min_size=0, max_size=70), st.booleans()
)


@settings(deadline=None)
@given(st.lists(hash_values, min_size=1, max_size=4), hash_values | st.none())
def test_hashes_match_normalize_hash(hashes: list[Any], parent: Any) -> None:
    want = [normalize_hash(h) for h in hashes]
    want_parent = normalize_hash(parent) if parent is not None else None
    ok = None not in want and (parent is None or want_parent is not None)
    for engine, event in (
        ("vllm", a_stored(block_hashes=hashes, parent_block_hash=parent)),
        ("vllm", m_stored(block_hashes=hashes, parent_block_hash=parent)),
        ("sglang", ["BlockStored", hashes, parent, [1], 1, None, "GPU"]),
    ):
        batch = decode_batch(pack(event), engine)  # type: ignore[arg-type]
        if ok:
            assert batch.events[0].block_hashes == want  # type: ignore[union-attr]
            assert batch.events[0].parent_block_hash == want_parent  # type: ignore[union-attr]
        else:
            assert (batch.events, batch.skipped) == ([], 1)


# --- cache_salt -----------------------------------------------------------------------------

DIGEST = b"\x5a" * 32


@pytest.mark.parametrize(
    ("lora_name", "extra_keys", "salt"),
    [
        (None, None, None),
        (None, [], None),
        (None, [None], None),
        (None, [None, None, None], None),
        (None, [["s"]], "s"),
        (None, [["s"], None], "s"),
        (None, [None, ["late"]], None),  # the salt only ever sits in the first block
        (None, [["s", DIGEST]], "s"),  # prompt-embeds digest (bin) after the salt
        (None, [[["mm-1", 0], ["mm-2", 16], "s"]], "s"),  # 0.19+ multimodal keys are arrays
        (None, [[["mm-1", 0]]], None),
        ("lora", [["lora"]], None),
        ("lora", [["lora", "s"]], "s"),
        ("lora", [["lora", ["mm", 0], "s", DIGEST], ["lora"]], "s"),
        ("lora", [["lora", "lora"]], "lora"),  # the salt may equal the LoRA name
        ("lora", [["lora", ["mm", 0]]], None),
        (None, [["lora-but-no-lora-name"]], "lora-but-no-lora-name"),
        (None, [["mm-id-017", "s"]], "s"),  # 0.17-0.18: string multimodal ids come first
        # Documented limit: 0.17-0.18, image in the first block and no salt -> the image id.
        (None, [["mm-id-017"]], "mm-id-017"),
        (None, [[1, None, "s", 2.5]], "s"),
        (None, [[""]], ""),
    ],
)
def test_vllm_salt_from_extra_keys(lora_name: Any, extra_keys: Any, salt: Any) -> None:
    ev = one(pack(a_stored(lora_name=lora_name, extra_keys=extra_keys)))
    assert (ev.cache_salt, ev.lora_name) == (salt, lora_name)
    m = m_stored(lora_name=lora_name)
    if extra_keys is not None:
        m["extra_keys"] = extra_keys
    ev = one(pack(m))
    assert (ev.cache_salt, ev.lora_name) == (salt, lora_name)


def test_sglang_salt() -> None:
    base = ["BlockStored", [H], P, [1, 2], 2, None, "GPU"]
    assert one(pack(base), "sglang").cache_salt is None
    assert one(pack([*base, None]), "sglang").cache_salt is None
    assert one(pack([*base, {}]), "sglang").cache_salt is None
    assert one(pack([*base, {"cache_salt": "t", "other": 1}]), "sglang").cache_salt == "t"
    m = {"type": "BlockStored", "block_hashes": [H], "block_size": 2, "token_ids": [1, 2]}
    assert one(pack(m | {"cache_salt": "t", "lora_name": "l"}), "sglang").cache_salt == "t"
    assert one(pack(m | {"lora_name": "l"}), "sglang").lora_name == "l"
    assert one(pack(m | {"session_id": "x"}), "sglang").cache_salt is None


def test_sglang_eagle_bigram_pairs_keep_the_first_token() -> None:
    ev = one(pack(["BlockStored", [1], None, [[5, 6], [6, 7], [7, 8]], 3, None, "GPU"]), "sglang")
    assert (ev.token_ids, ev.block_size) == ([5, 6, 7], 3)
    m = {"type": "BlockStored", "block_hashes": [1], "token_ids": [[5, 6], [6, 7]], "block_size": 2}
    assert one(pack(m), "sglang").token_ids == [5, 6]
    # Not in vLLM: pairs there are a wrong type.
    assert decode_batch(pack(m), "vllm").skipped == 1


# --- frame-level errors ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("payload", "says"),
    [
        (b"", "msgpack"),
        (b"\xc1", "msgpack"),  # the one never-used msgpack byte
        (pack(a_stored())[:-1], "msgpack"),  # truncated
        (pack(a_stored()) + b"\x00", "msgpack"),  # trailing bytes
        (msgpack.packb({"ts": TS, "events": []}), "top level"),
        (msgpack.packb(5), "top level"),
        (msgpack.packb([TS]), "top level"),
        (msgpack.packb(["1700000000", []]), "ts"),
        (msgpack.packb([None, []]), "ts"),
        (msgpack.packb([True, []]), "ts"),
        (msgpack.packb([math.nan, []]), "ts"),
        (msgpack.packb([math.inf, []]), "ts"),
        (msgpack.packb([TS, {"a": 1}]), "events"),
        (msgpack.packb([TS, None]), "events"),
        (msgpack.packb([TS, "events"]), "events"),
        (msgpack.packb([TS, [], "0"]), "dp_rank"),
        (msgpack.packb([TS, [], -1]), "dp_rank"),
        (msgpack.packb([TS, [], True]), "dp_rank"),
        (msgpack.packb([TS, [], 1.0]), "dp_rank"),
        (b"\x92\xcb" + b"\x00" * 8 + b"\x91\xa2\xff\xfe", "msgpack"),  # invalid UTF-8 str
        (b"\x92\x00\x91\x81\x91\x00\x00", "msgpack"),  # unhashable map key
    ],
)
def test_undecodable_frames_raise_decode_error(payload: bytes, says: str) -> None:
    with pytest.raises(DecodeError, match=says) as info:
        decode_batch(payload, "vllm")
    assert isinstance(info.value, ValueError)


def test_empty_events_is_a_valid_batch() -> None:
    assert decode_batch(pack(), "sglang") == EventBatch(TS, [], 0, 0)


def test_unknown_engine_is_a_caller_error_not_a_decode_error() -> None:
    with pytest.raises(ValueError, match="engine") as info:
        decode_batch(pack(), "trtllm")  # type: ignore[arg-type]
    assert not isinstance(info.value, DecodeError)


def test_frame_size_cap() -> None:
    payload = pack(a_stored())
    assert decode_batch(payload, "vllm", max_frame_bytes=len(payload)).events == [stored()]
    with pytest.raises(DecodeError, match="max_frame_bytes"):
        decode_batch(payload, "vllm", max_frame_bytes=len(payload) - 1)


# --- hostile input: fuzzing and memory ------------------------------------------------------


def decode_or_error(payload: bytes, engine: str = "vllm") -> EventBatch | None:
    """Decode must return a batch or raise DecodeError; anything else fails the test."""
    try:
        batch = decode_batch(payload, engine)  # type: ignore[arg-type]
    except DecodeError:
        return None
    assert isinstance(batch, EventBatch)
    assert batch.skipped >= 0
    return batch


def peak_bytes(payload: bytes, engine: str = "vllm") -> int:
    tracemalloc.start()
    try:
        decode_or_error(payload, engine)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=300), st.sampled_from(["vllm", "sglang"]))
def test_fuzz_random_bytes(payload: bytes, engine: str) -> None:
    decode_or_error(payload, engine)


@settings(max_examples=300, deadline=None)
@given(st.binary(min_size=1, max_size=8), st.sampled_from(["vllm", "sglang"]))
def test_fuzz_random_bytes_behind_a_valid_prefix(tail: bytes, engine: str) -> None:
    # Starts like a batch, so the parser gets past the first bytes.
    decode_or_error(b"\x93\xcb" + b"\x41\xd9\x54\xfc\x40\x20\x00\x00" + b"\x91" + tail, engine)


@pytest.mark.parametrize("frame", GOLDEN, ids=[f["name"] for f in GOLDEN])
def test_every_truncation_of_a_golden_frame_is_a_decode_error(frame: dict[str, Any]) -> None:
    payload = bytes.fromhex(frame["hex"])
    for n in range(len(payload)):
        with pytest.raises(DecodeError):
            decode_batch(payload[:n], frame["engine"])


msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(1 << 63), U64)
    | st.floats()
    | st.text(max_size=6)
    | st.binary(max_size=40)
    | st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "GPU", "type"]),
    lambda inner: (
        st.lists(inner, max_size=5)
        | st.dictionaries(st.text(max_size=12) | st.integers(-5, 5), inner, max_size=5)
    ),
    max_leaves=12,
)


def _paths(v: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(v, list):
        for i, x in enumerate(v):
            out += _paths(x, (*prefix, i))
    elif isinstance(v, dict):
        for k, x in v.items():
            out += _paths(x, (*prefix, k))
    return out


def _replace(root: Any, path: tuple[Any, ...], new: Any) -> Any:
    if not path:
        return new
    root = copy.deepcopy(root)
    node = root
    for step in path[:-1]:
        node = node[step]
    node[path[-1]] = new
    return root


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(GOLDEN), st.data())
def test_fuzz_type_substitution_in_golden_frames(frame: dict[str, Any], data: Any) -> None:
    structure = from_json(frame["structure"])
    path = data.draw(st.sampled_from(_paths(structure)))
    mutated = _replace(structure, path, data.draw(msgpack_values))
    batch = decode_or_error(msgpack.packb(mutated), frame["engine"])
    if len(path) >= 2 and path[0] == 1:
        # An event or something inside one: never fatal; each event is decoded or counted.
        assert batch is not None
        assert len(batch.events) + batch.skipped == len(mutated[1])


@settings(max_examples=200, deadline=None)
@given(st.lists(msgpack_values, max_size=6), st.sampled_from(["vllm", "sglang"]))
def test_fuzz_random_events_never_fail_the_batch(events: list[Any], engine: str) -> None:
    batch = decode_or_error(pack(*events), engine)
    assert batch is not None
    assert len(batch.events) + batch.skipped == len(events)


# Headers claiming huge sizes with a tiny body: array32, array16, map32, map16, str32, str16,
# bin32, bin16, ext32, ext16.
HUGE_HEADERS = [b"\xdd", b"\xdc", b"\xdf", b"\xde", b"\xdb", b"\xda", b"\xc6", b"\xc5", b"\xc9"]


def _header(kind: bytes, n: int) -> bytes:
    width = 2 if kind in (b"\xdc", b"\xde", b"\xda", b"\xc5") else 4
    h = kind + (n & ((1 << (8 * width)) - 1)).to_bytes(width, "big")
    return h + b"\x01" if kind == b"\xc9" else h  # ext type byte


@settings(max_examples=400, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(HUGE_HEADERS),
            st.sampled_from([1 << 31, (1 << 32) - 1, 0xFFFF, 10_000, 100]),
        ),
        min_size=1,
        max_size=18,
    ),
    st.integers(0, 60),
    st.binary(max_size=20),
)
def test_fuzz_huge_declared_lengths_stay_small(
    headers: list[tuple[bytes, int]], cut: int, tail: bytes
) -> None:
    valid = pack(a_stored(), m_stored())
    cut = min(cut, len(valid))
    payload = (valid[:cut] + b"".join(_header(k, n) for k, n in headers) + tail)[:100]
    assume(len(payload) > 0)
    assert peak_bytes(payload) < 2 * 1024 * 1024


@pytest.mark.parametrize(
    "payload",
    [
        b"\xdd\x80\x00\x00\x00" * 20,  # array32 claiming 2**31, nested
        b"\xdd\xff\xff\xff\xff" + b"\x00" * 95,
        b"\xdf\x80\x00\x00\x00" * 20,  # map32
        b"\xdb\x80\x00\x00\x00" + b"a" * 95,  # str32
        b"\xc6\xff\xff\xff\xff" + b"\x00" * 95,  # bin32
        b"\xc9\x80\x00\x00\x00\x01" + b"\x00" * 94,  # ext32
        b"\x93\xcb" + b"\x00" * 8 + b"\xdd\x7f\xff\xff\xff" + b"\x00" * 80,
        b"\xdc\x00\x60" * 33 + b"\x00",  # 33 nested arrays claiming 96 each
        b"\x9f" * 100,  # 100 nested fixarrays
    ],
)
def test_hostile_100_byte_frames_allocate_little(payload: bytes) -> None:
    assert len(payload) <= 100
    with pytest.raises(DecodeError):
        decode_batch(payload, "vllm")
    assert peak_bytes(payload) < 1024 * 1024


def test_preallocation_is_bounded_for_large_frames() -> None:
    # 2 MiB frame: a bin pads it, then 1024+ nested arrays each claiming 1M elements. msgpack
    # >=1.2.4 preallocates at most 10 000 slots per open array (<=1024 deep): about 82 MB,
    # whatever the claims. Older msgpack would try 1024 * 8 MB here.
    pad = 2 << 20
    payload = b"\x92\xc6" + pad.to_bytes(4, "big") + b"\x00" * pad + b"\xdd\x00\x0f\x42\x40" * 1100
    assert peak_bytes(payload) < len(payload) + 90 * 1024 * 1024


def test_default_frame_cap_refuses_before_parsing() -> None:
    payload = b"\x00" * (DEFAULT_MAX_FRAME_BYTES + 1)
    with pytest.raises(DecodeError, match="max_frame_bytes"):
        decode_batch(payload, "vllm")
    assert peak_bytes(payload) < 64 * 1024


def test_claims_beyond_the_frame_length_fail_at_the_header() -> None:
    # 64 KiB frame whose events array claims 2**24 elements: refused by max_array_len
    # (= frame length) before any allocation.
    payload = b"\x92\xcb" + b"\x00" * 8 + b"\xdd\x01\x00\x00\x00" + b"\xc0" * (64 * 1024)
    with pytest.raises(DecodeError, match="max_array_len"):
        decode_batch(payload, "vllm")
    assert peak_bytes(payload) < 64 * 1024


# --- A and M agree (property) ---------------------------------------------------------------


@st.composite
def stored_fields(draw: Any) -> dict[str, Any]:
    n = draw(st.integers(1, 3))
    block_size = draw(st.integers(1, 4))
    return {
        "block_hashes": draw(st.lists(st.integers(-(1 << 63), U64), min_size=n, max_size=n)),
        "parent_block_hash": draw(st.none() | st.integers(-(1 << 63), U64)),
        "token_ids": draw(
            st.lists(
                st.integers(0, (1 << 32) - 1), min_size=n * block_size, max_size=n * block_size
            )
        ),
        "block_size": block_size,
        "lora_id": draw(st.none() | st.integers(0, 100)),
        "medium": draw(st.sampled_from([None, "GPU", "CPU", "STORAGE"])),
        "lora_name": draw(st.none() | st.text(min_size=1, max_size=8)),
        "salt": draw(st.none() | st.text(min_size=1, max_size=12)),
        "group_idx": draw(st.integers(0, 3)),
    }


@settings(deadline=None)
@given(stored_fields())
def test_array_and_map_encodings_decode_identically(f: dict[str, Any]) -> None:
    first: list[Any] = []
    if f["lora_name"] is not None:
        first.append(f["lora_name"])
    if f["salt"] is not None:
        first.append(f["salt"])
    extra_keys = [first or None] + [[f["lora_name"]] if f["lora_name"] else None] * (
        len(f["block_hashes"]) - 1
    )
    want = BlockStored(
        [h & U64 for h in f["block_hashes"]],
        None if f["parent_block_hash"] is None else f["parent_block_hash"] & U64,
        f["token_ids"],
        f["block_size"],
        f["medium"],
        f["lora_id"],
        f["lora_name"],
        f["salt"],
        f["group_idx"],
    )
    a = [
        "BlockStored",
        f["block_hashes"],
        f["parent_block_hash"],
        f["token_ids"],
        f["block_size"],
        f["lora_id"],
        f["medium"],
        f["lora_name"],
        extra_keys,
        f["group_idx"],
        "full_attention",
        None,
    ]
    m = {
        "type": "BlockStored",
        "block_hashes": f["block_hashes"],
        "parent_block_hash": f["parent_block_hash"],
        "token_ids": f["token_ids"],
        "block_size": f["block_size"],
        "lora_id": f["lora_id"],
        "medium": f["medium"],
        "lora_name": f["lora_name"],
        "extra_keys": extra_keys,
        "group_idx": f["group_idx"],
    }
    assert one(pack(a)) == want
    assert one(pack(m)) == want
    sglang_a = ["BlockStored", *a[1:7], {"cache_salt": f["salt"]}]
    sglang_m = {k: v for k, v in m.items() if k != "extra_keys"} | {"cache_salt": f["salt"]}
    # SGLang A has no lora_name or group_idx positions.
    assert one(pack(sglang_a), "sglang") == replace(want, lora_name=None, group_idx=0)
    assert one(pack(sglang_m), "sglang") == want


def test_malformed_events_of_a_known_kind_are_counted_apart_from_unknown_ones() -> None:
    """An unknown kind may be an engine newer than this decoder (nothing lost that the
    listener tracks); a known kind that does not decode is a lost block event."""
    batch = decode_batch(
        pack(
            ["BlockUpdated", [H], 1],
            {"type": "Created"},
            a_stored()[:4],  # short: block_size missing
            {"type": "BlockRemoved", "block_hashes": "not a list"},
            [["BlockStored"]],  # unhashable tag: not a known kind
            a_stored(),
        ),
        "vllm",
    )
    assert batch.events == [stored()]
    assert (batch.skipped, batch.malformed) == (5, 2)
