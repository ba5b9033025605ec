"""Conversation keys in the chain tracker: what is announced, withdrawn, counted and bounded.

The table here maps token id ``i < 256`` to the byte ``i`` (plus two special tokens), so a
chain's text is its token ids and the expected keys are ``bus.prompt_chain.chain_keys`` of
those bytes, exactly what the router computes from the rendered prompt. A model of the
router, fed only the emitted events, must equal ``snapshot()`` after every step, and the
tracker's derived state is recomputed from scratch (``check_invariants``).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from bus.events import KvEvent
from bus.prompt_chain import chain_keys, chain_root
from bus.salt import encode_salt
from harness.sim.kv_wire import EventEncoder, get_format
from listener.chains import ChainTracker
from listener.chains.conversation import ConversationSettings
from listener.decode import decode_batch
from listener.engine_events import (
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    EngineEvent,
    EventBatch,
)
from listener.recovery import Attributor
from listener.templates import CHATML
from listener.token_bytes import TokenBytes

SECRET = b"0123456789abcdef-secret"
BS = 4
C = 32
MODEL = "m"
SPECIAL = {256: b"<|im_start|>", 257: b"<|im_end|>"}
_PIECES: list[bytes | None] = [bytes((i,)) for i in range(256)]
TABLE = TokenBytes(
    "test", "byte_level", _PIECES + list(SPECIAL.values()), bytes(258), "never", None
)


class Router:
    """What a router would believe after applying the emitted chain events, checking that
    every record is a legal step: no key announced twice in one tier, none evicted unheld,
    and, for keys whose predecessor the test knows (``pred``), none held without it."""

    def __init__(self) -> None:
        self.events: list[KvEvent] = []
        self.keys: dict[str, tuple[str, int]] = {}
        self.pred: dict[str, str | None] = {}

    def __call__(self, ev: KvEvent) -> None:
        self.events.append(ev)
        if ev.event in ("cache_cleared", "resync"):
            self.keys.clear()
        elif ev.event == "chain_evicted":
            assert ev.chain_key in self.keys, "evicted a key never announced"
            del self.keys[ev.chain_key]
        elif ev.event in ("chain_created", "chain_offloaded"):
            assert ev.chain_key is not None and ev.token_count is not None and ev.tier
            assert self.keys.get(ev.chain_key, ("", 0))[0] != ev.tier, "announced twice"
            self.keys[ev.chain_key] = (ev.tier, ev.token_count)
        if self.pred:
            for k in self.keys:
                p = self.pred[k]
                assert p is None or p in self.keys, "a key held without its predecessor"

    def chain_kinds(self) -> list[str]:
        return [e.event for e in self.events if e.event.startswith("chain_")]


def make(
    engine: str = "vllm",
    *,
    model: str | None = MODEL,
    table: TokenBytes = TABLE,
    max_retained_bytes: int = 1 << 20,
    chunk: int = C,
    **limits: Any,
) -> tuple[ChainTracker, Router]:
    att = Attributor(model="m", template=CHATML, backend="b1", salt_secret=SECRET)
    router = Router()
    conv = ConversationSettings(table, model, chunk, max_retained_bytes)
    tracker = ChainTracker("b1", router, att, engine=engine, conversation=conv, **limits)  # type: ignore[arg-type]
    return tracker, router


def check(tracker: ChainTracker, router: Router) -> None:
    tracker.check_invariants()
    snap = {
        e.chain_key: (e.tier, e.token_count) for e in tracker.snapshot() if e.chain_key is not None
    }
    assert snap == router.keys


_ids = itertools.count(1)


def stored(
    data: bytes | list[int],
    parent: int | None = None,
    *,
    hashes: list[int] | None = None,
    medium: str | None = None,
    salt: str | None = None,
    lora: str | None = None,
    bs: int = BS,
    counts: list[int] | None = None,
) -> BlockStored:
    toks = list(data)
    if hashes is None:
        hashes = [next(_ids) for _ in range(len(toks) // bs)]
    return BlockStored(
        [BlockHash(h) for h in hashes],
        None if parent is None else BlockHash(parent),
        toks,
        bs,
        medium=medium,
        lora_id=None if lora is None else 1,
        lora_name=lora,
        cache_salt=salt,
        block_token_counts=counts,
    )


def batch(*events: EngineEvent, dp: int = 0) -> EventBatch:
    return EventBatch(1.0, list(events), dp)


def expected(
    text: bytes, salt: str | None = None, lora: str | None = None, chunk: int = C
) -> dict[str, int]:
    """key hex -> token count for a chain whose tokens are the bytes of ``text``."""
    keys = chain_keys(text, chain_root(MODEL, salt, lora), chunk)
    return {k.hex(): (i + 1) * chunk for i, k in enumerate(keys)}


TEXT = bytes(range(33, 123)) * 2  # 180 bytes: 5 full chunks of 32, 45 blocks of 4


def gpu(keys: dict[str, int]) -> dict[str, tuple[str, int]]:
    return {k: ("gpu", n) for k, n in keys.items()}


# -- announcing ---------------------------------------------------------------------------


def test_keys_follow_the_chain_across_batches_and_the_fast_path() -> None:
    tracker, router = make()
    first = stored(TEXT[:40])  # 10 blocks in one event: 1 key
    tracker.apply(batch(first))
    assert router.keys == gpu(dict(list(expected(TEXT).items())[:1]))
    parent = int(first.block_hashes[-1])
    for i in range(10, 45):  # one block per event: the fast path (keyed parents)
        h = next(_ids)
        tracker.apply(batch(stored(TEXT[4 * i : 4 * i + 4], parent, hashes=[h])))
        parent = h
        check(tracker, router)
    assert router.keys == gpu(expected(TEXT))
    assert router.chain_kinds() == ["chain_created"] * 5
    assert tracker.stats()["chain_keys"] == 5


def test_token_count_is_the_tokens_wholly_inside_the_chunk() -> None:
    tracker, router = make()
    # Tokens of 3 bytes (special ids spell 12 bytes): a chunk end falls inside a token.
    toks = [256, 257, 65, 66, 256, 67, 68, 69]  # 12+12+1+1+12+1+1+1 = 41 bytes
    tracker.apply(batch(stored(toks)))
    text = b"".join(TABLE.table[t] or b"" for t in toks)
    (key,) = chain_keys(text, chain_root(MODEL), C)
    # 32 bytes end inside the 5th token (bytes 26..37): 4 tokens lie wholly within.
    assert router.keys == {key.hex(): ("gpu", 4)}


def test_root_is_model_caller_salt_and_lora() -> None:
    tracker, router = make()
    router_salt = encode_salt(SECRET, "b1", b"\x05" * 32, "tenant-7")
    tracker.apply(batch(stored(TEXT[:32], salt=router_salt)))  # the caller's salt inside
    tracker.apply(batch(stored(TEXT[:32], salt="raw-salt")))  # any other salt as is
    tracker.apply(batch(stored(TEXT[:32], lora="adapter-a")))
    tracker.apply(batch(stored(TEXT[:32], medium=None)))
    want = {
        **expected(TEXT[:32], "tenant-7"),
        **expected(TEXT[:32], "raw-salt"),
        **expected(TEXT[:32], None, "adapter-a"),
        **expected(TEXT[:32]),
    }
    assert router.keys == gpu(want) and len(want) == 4
    check(tracker, router)


def test_shared_text_shares_keys_and_counts_references() -> None:
    tracker, router = make()
    a = stored(TEXT[:64])  # two identical chains (e.g. salted and unsalted engine blocks)
    b = stored(TEXT[:64])
    tracker.apply(batch(a, b))
    assert router.keys == gpu(expected(TEXT[:64]))
    assert router.chain_kinds() == ["chain_created"] * 2  # once per key, not per chain
    tracker.apply(batch(BlockRemoved(a.block_hashes)))
    assert router.keys == gpu(expected(TEXT[:64]))  # still held through b
    tracker.apply(batch(BlockRemoved(b.block_hashes[-1:])))
    assert router.keys == gpu(expected(TEXT[:32]))
    check(tracker, router)


def test_removing_a_block_withdraws_it_and_its_descendants_deepest_first() -> None:
    tracker, router = make()
    ev = stored(TEXT[:128])  # 32 blocks, 4 keys (one per 8 blocks)
    tracker.apply(batch(ev))
    fork = stored(b"X" * 32, int(ev.block_hashes[15]))  # a sibling branch after key 1
    tracker.apply(batch(fork))
    keys = list(expected(TEXT[:128]))
    branch = expected(TEXT[:64] + b"X" * 32)
    assert set(router.keys) == set(keys) | set(branch)
    router.events.clear()
    tracker.apply(batch(BlockRemoved([ev.block_hashes[12]])))  # inside chunk 1
    assert set(router.keys) == set(keys[:1])
    evicted = [e.chain_key for e in router.events]
    assert evicted.index(keys[3]) < evicted.index(keys[2]) < evicted.index(keys[1])
    assert evicted.index(list(branch)[2]) < evicted.index(keys[1])
    check(tracker, router)
    # The engine stores the block again: nothing under the hole gets keys back.
    again = stored(TEXT[48:52], int(ev.block_hashes[11]), hashes=[ev.block_hashes[12]])
    tracker.apply(batch(again))
    assert set(router.keys) == set(keys[:1])
    check(tracker, router)


def test_offloaded_copy_keeps_keys_in_storage_until_it_goes() -> None:
    tracker, router = make()
    ev = stored(TEXT[:64])
    tracker.apply(batch(ev))
    # vLLM's offloading connector: CPU copies without a parent and without tokens.
    cpu = BlockStored(list(ev.block_hashes), None, [], BS, medium="CPU")
    tracker.apply(batch(cpu))
    assert router.chain_kinds() == ["chain_created"] * 2
    tracker.apply(batch(BlockRemoved(ev.block_hashes)))  # gone from the GPU
    assert router.keys == {k: ("storage", n) for k, n in expected(TEXT[:64]).items()}
    assert router.chain_kinds()[2:] == ["chain_offloaded"] * 2
    tracker.apply(batch(BlockRemoved(ev.block_hashes[8:], medium="CPU")))
    assert set(router.keys) == set(list(expected(TEXT[:64]))[:1])
    check(tracker, router)
    tracker.apply(batch(stored(TEXT[:64])))  # back on the GPU under new hashes
    assert router.keys == gpu(expected(TEXT[:64]))
    check(tracker, router)


def test_snapshot_replays_keys_and_reset_or_clear_drops_them() -> None:
    tracker, router = make()
    tracker.apply(batch(stored(TEXT[:96])))
    snap = [e for e in tracker.snapshot() if e.chain_key]
    assert [e.event for e in snap] == ["chain_created"] * 3
    assert [e.chain_key for e in snap] == list(expected(TEXT[:96]))  # shallowest first
    tracker.apply(batch(AllBlocksCleared()))
    assert router.events[-1].event == "cache_cleared" and router.keys == {}
    assert tracker.snapshot() == [] and tracker.stats()["chain_nodes"] == 0
    tracker.apply(batch(stored(TEXT[:32])))
    tracker.reset()
    assert tracker.snapshot() == [] and tracker.stats()["chain_retained_bytes"] == 0
    tracker.check_invariants()


# -- no keys, counted ---------------------------------------------------------------------


def test_blocks_that_cannot_be_keyed_are_counted_per_kind() -> None:
    tracker, router = make()
    root = stored(TEXT[:32])
    tracker.apply(batch(root))
    tip = int(root.block_hashes[-1])
    tracker.apply(batch(BlockStored([BlockHash(900)], BlockHash(tip), [], BS)))  # no tokens
    tracker.apply(batch(stored([70] * (BS - 1), tip, hashes=[901])))  # wrong size
    tracker.apply(batch(stored([70, 71, 300, 72], tip, hashes=[902])))  # id outside the table
    tracker.apply(batch(stored(TEXT[:32], 900)))  # under a block without keys: none either
    tracker.apply(batch(BlockStored([BlockHash(903)], None, list(TEXT[:4]), BS, lora_id=3)))
    st_ = tracker.stats()
    assert (
        st_["chain_missing_tokens"],
        st_["chain_mismatched_tokens"],
        st_["chain_unmapped_tokens"],
        st_["chain_no_root"],
    ) == (1, 1, 1, 1)
    assert router.keys == gpu(expected(TEXT[:32]))
    check(tracker, router)


def test_no_model_no_keys() -> None:
    tracker, router = make(model=None)
    tracker.apply(batch(stored(TEXT[:64]), stored(TEXT[:64])))
    assert router.keys == {} and tracker.stats()["chain_no_root"] == 2
    assert tracker.stats()["tracked_blocks"] == 32  # tracked for their chain, not discarded


# -- engines ------------------------------------------------------------------------------


def _frames(fmt: str, text: bytes, salt: str | None) -> list[bytes]:
    """The chain as one engine format sends it: a first event of 2 blocks (with the
    request's salt), then one block per event."""
    enc = EventEncoder(get_format(fmt))
    frames = [enc.batch(1.0, [enc.stored([1, 2], None, list(text[:8]), BS, salt, True)])]
    for i in range(2, len(text) // BS):
        frames.append(enc.batch(1.0, [enc.stored([i + 1], i, list(text[4 * i : 4 * i + 4]), BS)]))
    return frames


def test_every_zmq_encoding_gives_the_same_keys() -> None:
    salt = encode_salt(SECRET, "b1", b"\x05" * 32, "tenant-9")
    want = gpu({k: n for k, n in expected(TEXT[:128], "tenant-9").items()})
    for fmt, engine in [
        ("vllm-0.23.0", "vllm"),  # encoding A (arrays), salt in extra_keys
        ("vllm-0.33", "vllm"),  # encoding M (maps)
        ("sglang-0.5.19", "sglang"),  # SGLang A, salt in the metadata map
        ("sglang-0.5.23", "sglang"),  # SGLang M, one block per page
    ]:
        tracker, router = make(engine)
        for frame in _frames(fmt, TEXT[:128], salt):
            tracker.apply(decode_batch(frame, engine))  # type: ignore[arg-type]
        assert router.keys == want, fmt
        check(tracker, router)


def test_sglang_pages_are_blocks() -> None:
    tracker, router = make("sglang")
    ev = stored(TEXT[:64], bs=16)  # 4 pages of 16 tokens
    tracker.apply(batch(ev))
    assert router.keys == gpu(expected(TEXT[:64]))
    tracker.apply(batch(BlockRemoved(ev.block_hashes[:1])))
    assert router.keys == {}
    check(tracker, router)


def test_vllm_null_blocks_fold_into_the_first_hash() -> None:
    tracker, router = make()
    # Sliding window: 3 hashes, 5 blocks of tokens (the 2 oldest are null blocks).
    tracker.apply(batch(BlockStored([BlockHash(h) for h in (1001, 1002, 1003)], None,
                                    list(TEXT[:20]), BS)))  # fmt: skip
    assert router.keys == {}  # 20 bytes: no full chunk yet
    tracker.apply(batch(stored(TEXT[20:40], 1003)))
    assert router.keys == gpu(expected(TEXT[:40]))
    check(tracker, router)


def test_trtllm_partial_last_block() -> None:
    tracker, router = make("trtllm")
    salt = encode_salt(SECRET, "b1", b"\x05" * 32)
    # Per-block counts; the last block is partial: one 12-byte token, which completes the
    # first chunk (bytes 24..36), so key 0 counts the 24 tokens in front of it.
    head = stored([*TEXT[:24], 256], hashes=list(range(1, 8)), salt=salt, counts=[4] * 6 + [1])
    tracker.apply(batch(head))
    text = TEXT[:24] + SPECIAL[256]
    (k0,) = chain_keys(text, chain_root(MODEL), C)
    assert router.keys == {k0.hex(): ("gpu", 24)}
    # The sequence grows: TensorRT-LLM stores the full block as a sibling of the partial
    # one. It completes the same key (the same text): counted, not announced again, and
    # still held when the partial block goes.
    tracker.apply(batch(stored([256, 65, 66, 67], 6, hashes=[8], counts=[4])))
    tracker.apply(batch(BlockRemoved([BlockHash(7)])))
    assert router.keys == {k0.hex(): ("gpu", 24)}
    assert router.chain_kinds() == ["chain_created"]
    tracker.apply(batch(stored(TEXT[:28], 8, hashes=list(range(9, 16)), counts=[4] * 7)))
    text += b"ABC" + TEXT[:28]
    keys = chain_keys(text, chain_root(MODEL), C)
    # key 1: 24 + 4 tokens, then 64 - 39 = 25 one-byte tokens.
    assert router.keys == {keys[0].hex(): ("gpu", 24), keys[1].hex(): ("gpu", 53)}
    check(tracker, router)


# -- memory -------------------------------------------------------------------------------


def test_byte_bound_takes_the_least_recently_extended_state() -> None:
    tracker, router = make(max_retained_bytes=100)
    chains = [stored(bytes([65 + i]) * 28) for i in range(6)]  # 28 bytes kept by each chain
    for ev in chains:
        tracker.apply(batch(ev))
        check(tracker, router)
        assert tracker.stats()["chain_retained_bytes"] <= 100
    assert tracker.stats()["chain_bytes_pruned"] > 0
    # The oldest leaf lost its state: a child under it gets no keys; the newest does.
    old, new = int(chains[0].block_hashes[-1]), int(chains[-1].block_hashes[-1])
    tracker.apply(batch(stored(b"zzzz", old), stored(b"zzzz", new)))
    assert set(router.keys) == set(expected(bytes([70]) * 28 + b"zzzz"))
    check(tracker, router)


def test_byte_bound_leaves_a_node_whose_chunk_just_ended_derivable() -> None:
    """A node right after a chunk boundary keeps no bytes, so the bound has nothing to take
    from it: the chain still extends from there once everything before it lost its bytes."""
    tracker, router = make(max_retained_bytes=40)
    first = stored(b"A" * C)  # 8 blocks: 28 bytes kept, the last block's chunk ends
    tracker.apply(batch(first))
    tracker.apply(batch(stored(b"B" * 28)))  # 56 bytes > 40: the oldest bytes go
    check(tracker, router)
    assert tracker.stats()["chain_bytes_pruned"] > 0
    assert tracker.stats()["chain_retained_bytes"] <= 40
    tracker.apply(batch(stored(b"C" * C, int(first.block_hashes[-1]))))
    assert set(expected(b"A" * C + b"C" * C)) <= set(router.keys)
    check(tracker, router)


def test_pruning_an_entry_withdraws_its_keys() -> None:
    tracker, router = make(max_tracked_blocks=20)
    tracker.apply(batch(stored(TEXT[:64])))  # 16 blocks, 2 keys
    tracker.apply(batch(stored(TEXT[64:96], 999_999)))  # orphan: nothing
    tracker.apply(batch(stored(TEXT[:32] + b"Y" * 32)))  # 16 more: the oldest are pruned
    assert tracker.stats()["tracked_blocks"] <= 20
    assert set(router.keys) <= set(expected(TEXT[:64])) | set(expected(TEXT[:32] + b"Y" * 32))
    check(tracker, router)


# -- random streams against a model of the engine -----------------------------------------


@dataclass
class Engine:
    """What the engine holds. Every block position (hash) has its parent and bytes, fixed
    when it is first stored on the GPU; ``media`` says where copies of it are now. A key
    is held while every position from the root to the block completing it has a copy
    somewhere; gpu when each of them has one on the GPU."""

    chunk: int = C
    blocks: dict[int, tuple[int | None, bytes]] = field(default_factory=dict)
    media: dict[int, set[str]] = field(default_factory=dict)

    def path(self, h: int, medium: str | None = None) -> bytes | None:
        """The text up to ``h`` if every position on the way has a copy (in ``medium``)."""
        out: list[bytes] = []
        cur: int | None = h
        while cur is not None:
            here = self.media.get(cur, set())
            if not here or (medium is not None and medium not in here):
                return None
            parent, data = self.blocks[cur]
            out.append(data)
            cur = parent
        return b"".join(reversed(out))

    def held(self, h: int) -> dict[str, tuple[str, int]]:
        """The keys position ``h`` completes, if its path is whole, with their tier."""
        text = self.path(h)
        if text is None:
            return {}
        tier = "gpu" if self.path(h, "GPU") is not None else "storage"
        before = len(text) - len(self.blocks[h][1])
        keys = expected(text, chunk=self.chunk)
        return {k: (tier, n) for k, n in keys.items() if n > before}

    def want(self) -> dict[str, tuple[str, int]]:
        out: dict[str, tuple[str, int]] = {}
        for h in self.media:
            for k, v in self.held(h).items():
                if out.get(k, ("storage",))[0] != "gpu":
                    out[k] = v
        return out

    def preds(self) -> dict[str, str | None]:
        """key -> the key before it, for every whole path now."""
        out: dict[str, str | None] = {}
        for h in self.media:
            text = self.path(h)
            keys = list(expected(text, chunk=self.chunk)) if text is not None else []
            out.update(zip(keys, [None, *keys], strict=False))
        return out

    def apply(self, ev: EngineEvent) -> None:
        if isinstance(ev, BlockStored):
            medium = ev.medium or "GPU"
            parent = None if ev.parent_block_hash is None else int(ev.parent_block_hash)
            for i, h in enumerate(map(int, ev.block_hashes)):
                if medium == "GPU":
                    self.blocks[h] = (parent, bytes(ev.token_ids[BS * i : BS * i + BS]))
                self.media.setdefault(h, set()).add(medium)
                parent = h
        elif isinstance(ev, BlockRemoved):
            for h in map(int, ev.block_hashes):
                here = self.media.get(h, set())
                here.discard(ev.medium or "GPU")
                if not here:
                    self.media.pop(h, None)


@st.composite
def engine_runs(draw: st.DrawFn) -> list[EngineEvent]:
    """Trees of GPU blocks (roots, children of any GPU block, several blocks per event),
    removals anywhere (GPU or CPU), and CPU copies without parent or tokens (vLLM's
    offloading connector)."""
    eng = Engine()
    out: list[EngineEvent] = []
    hashes = itertools.count(1)
    for _ in range(draw(st.integers(1, 40))):
        gpu_blocks = sorted(h for h, m in eng.media.items() if "GPU" in m)
        cpu_blocks = sorted(h for h, m in eng.media.items() if "CPU" in m)
        action = draw(st.sampled_from(["grow"] * 5 + ["root", "remove", "copy", "copy", "uncopy"]))
        ev: EngineEvent
        if action in ("grow", "root") or not gpu_blocks:
            parent = None
            if action != "root" and gpu_blocks:
                parent = draw(st.sampled_from(gpu_blocks))
            n = draw(st.integers(1, 3))
            data = draw(st.binary(min_size=BS * n, max_size=BS * n))
            ev = stored(data, parent, hashes=[next(hashes) for _ in range(n)])
        elif action == "remove":
            ev = BlockRemoved([BlockHash(draw(st.sampled_from(gpu_blocks)))])
        elif action == "copy":
            h = draw(st.sampled_from(gpu_blocks))
            if "CPU" in eng.media[h]:
                continue
            ev = BlockStored([BlockHash(h)], None, [], BS, medium="CPU")
        elif cpu_blocks:
            ev = BlockRemoved([BlockHash(draw(st.sampled_from(cpu_blocks)))], medium="CPU")
        else:
            continue
        eng.apply(ev)
        out.append(ev)
    return out


def _replay(
    events: list[EngineEvent], chunk: int, pred: dict[str, str | None] | None = None
) -> list[tuple[EngineEvent, dict[str, tuple[str, int]]]]:
    """Each event with what the engine's blocks hold after it (and every key's predecessor
    into ``pred``)."""
    eng = Engine(chunk)
    out = []
    for ev in events:
        eng.apply(ev)
        out.append((ev, eng.want()))
        if pred is not None:
            pred.update(eng.preds())
    return out


@settings(max_examples=200, deadline=None)
@given(events=engine_runs(), fast=st.booleans(), chunk=st.sampled_from([4, 8, 12]))
def test_property_announced_keys_are_exactly_what_the_blocks_hold(
    events: list[EngineEvent], fast: bool, chunk: int
) -> None:
    tracker, router = make(chunk=chunk)
    if not fast:
        tracker._extend = lambda dp, ev: False  # type: ignore[method-assign]
    for ev, want in _replay(events, chunk, router.pred):
        tracker.apply(batch(ev))
        check(tracker, router)
        assert router.keys == want


@settings(max_examples=150, deadline=None)
@given(
    events=engine_runs(),
    max_tracked=st.integers(1, 30),
    max_bytes=st.integers(1, 200),
)
def test_property_bounds_hold_and_nothing_unheld_is_announced(
    events: list[EngineEvent], max_tracked: int, max_bytes: int
) -> None:
    tracker, router = make(max_tracked_blocks=max_tracked, max_retained_bytes=max_bytes, chunk=8)
    for ev, want in _replay(events, 8):
        tracker.apply(batch(ev))
        check(tracker, router)
        assert tracker.stats()["chain_retained_bytes"] <= min(max_bytes, max_tracked * 7)
        assert set(router.keys) <= set(want)
