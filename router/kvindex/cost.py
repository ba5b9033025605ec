"""ConversationScorer: route a request to the backend that would prefill the fewest tokens.

The cost of sending the request to backend ``b``, in prompt tokens
(``kv_cache_index.conversation.scoring``, ``ConversationScoringConfig``)::

    cost(b) = prompt_tokens - credit(tier(b)) * held_tokens(b)
            + prefill_load_weight   * in_flight_prefill_tokens(b)
            + active_request_weight * in_flight_requests(b)
            + resident_weight       * resident_tokens(b)

* ``held_tokens(b)``: the ``token_count`` of b's deepest key of the request's chain, from
  ONE ``query_many`` of the chain index (``router.kvindex.chains``); ``credit`` is
  ``gpu_credit`` or ``storage_credit`` by that key's tier.
* ``prompt_tokens``: the router never tokenizes. The rendered prompt's byte length times
  a tokens-per-byte ratio: the deepest held key's own (its ``token_count`` over the bytes
  its chunks cover) when any backend holds one, else ``1 / bytes_per_token``.
* ``in_flight_prefill_tokens(b)``: the :class:`~router.kvindex.prefill.PrefillLoad`
  ledger the forwarder keeps; ``in_flight_requests(b)``: the pool's in-flight count,
  averaged over ``load_window_seconds`` (``router.kvindex.load_average``: instantaneous
  counts split a prompt two engines hold, each flip of the load sending it to the other).
* ``resident_tokens(b)``: the prompt tokens of the other conversations this router sent to
  b within ``resident_window_seconds`` (:class:`~router.kvindex.resident.LiveConversations`;
  a conversation's first request weighed by how often its prompt's conversations go on):
  what b's cache is asked to keep. Sessions stick, so an engine that took more of them
  than the others evicts their histories first; the term places a shared prompt's new
  sessions where there is room (copying the prompt, once) long before the load cap would.

The lowest cost wins among the candidates under the bounded-load cap
(``load_factor_epsilon``: PrefixAwareHash's ``ceil((1 + epsilon) * (in flight + 1) / n)``).
A backend is at the cap when it is over it now *and* on average over
``load_window_seconds``: against the count now alone, a shared prompt's engine hits the
cap whenever a few of its sessions arrive together, and every request sent past it
prefills the whole prompt on an engine that does not hold it (``make run``'s demo: 61 %
token hit rate against 83-87 % with the average). So a conversation stays where it is
held until its engine is overloaded for longer than a burst, and a shared prompt's new
sessions spread. With ``sticky_tokens`` set (off by default), a conversation whose backend
holds that many more of its tokens than any other candidate (its own history) is held to
the wider ``sticky_load_factor_epsilon``: moving it would prefill that whole history
elsewhere, while a new session placed elsewhere costs only its shared prompt, so the cap
moves new sessions first (``make run``'s demo: 79 % without it, 84-85 % with it, at a
wider load spread on ``fleet_bench``; unbounded, a tool suite's sessions pile onto one
engine).

Costs within one chunk's tokens of the lowest are a tie (the index knows holdings only to
a chunk). Among tied candidates the one holding the most wins, so load jitter never
copies a prompt to an engine that holds none of it; then the prompt's *home*: the backend
this router first sent it to (and again wherever it went once its home held none of it),
else rendezvous hashing of its first key. A prompt two engines hold keeps going to one of
them instead of alternating with load, and a request sent past a loaded home does not
move the prompt.

**One-shot prompts stay home.** A prompt whose conversations rarely send a second request
(fewer than a quarter of them, once 8 have started: ``LiveConversations.one_shot``;
templated tasks, classification, single questions under a shared system prompt) is worth
only its shared prefix: spreading its requests buys no cache room for histories, and each
one sent elsewhere prefills the prompt there and makes a second holder that load jitter
then feeds. So its home takes a request that it holds as deeply as any candidate unless
it costs more than the cheapest by the tokens it holds, and it is measured against
``sticky_load_factor_epsilon`` instead of ``load_factor_epsilon``
(``bench/affinity_bench.py``, 8 such prompts on 2 backends: 93 % of the worst prompt's
requests on one backend before, 96-98.5 % after at a max share of 0.50;
``bench/fleet_bench.py``, whose sessions go on, unchanged). The prompts whose
conversations go on are left to the cost, so their new sessions spread.

**So do prompts whose turns are small.** A prompt whose conversations go on but grow by
less than a sixteenth of the prompt per request on average (``LiveConversations.
small_turns``, over at least 3 such requests: a long system prompt and short exchanges)
is worth only its shared prefix too: a conversation adds what would fit beside it on its
home for a dozen turns, so spreading new sessions buys no room, and every one sent past
the home copies the whole prompt into an engine whose cache other prompts need. Its home
is kept as a one-shot prompt's is (``make run``'s demo, 24 tenants of ~1,800-token prompts
whose turns add 1-3 % each, six paired runs: 84.6 % token hit rate against 80.0 %, the
capped share of decisions 2.4 % against 4.9 %; ``fleet_bench``'s workloads add 11-29 % a
turn and are unchanged; ``bench/RESULTS.md``).

**Nor are they copied for load.** When every candidate under the caps holds none of such a
prompt, or of a prompt not judged yet (fewer than 3 requests after a conversation's first
and fewer than 8 conversations: where a burst of new sessions meets its home), the request
would copy the whole prompt, and in a fleet whose caches are full that copy evicts as much
of other prompts, which come back as misses and are placed again elsewhere: a cascade. So
the home stays a candidate up to ``copy_load_factor_epsilon`` (2: 3x the mean load;
``make run``'s demo, five paired runs: 90.6 % token hit rate against 83.3 %, tenants on
1.4-2.0 engines each against 2.5-2.7, ConsistentHash 88.4 %; ``fleet_bench`` and
``affinity_bench`` unchanged). A copy onto an engine that already holds part of the prompt
is the usual cap's business.

These rules are for a prompt that fits on one engine: one with more than ``1 / candidates``
of the recent requests (``LiveConversations.share``, over the last few thousand; a single
product prompt with short turns) needs several engines anyway and copies of it pay for
themselves, so it is left to the usual cost and cap.

When no candidate holds anything, ``new_prompts`` decides: ``least_loaded`` (default)
places the prompt on the candidate under the cap with the fewest prompts placed over the
last window, then the fewest requests in flight (a burst of new prompts splits evenly:
PrefixAwareHash's ring put 5 of 8 on one of two backends in ``bench/affinity_bench.py``);
``strategy`` leaves it to the configured strategy (:meth:`ConversationScorer.choose`
returns None). ``on_decision(outcome, tier)`` reports each decision (``chosen``, ``tie``,
``none_held``; the winner's tier or ``none``).

Predict on route (:meth:`ConversationScorer.routed`): once a backend is chosen, by the
scorer or by the strategy, the request's keys are written as held by it for
``predict_ttl_seconds`` (token counts estimated per chunk with the same ratio). Events
that arrive later replace the predictions (an event is a plain upsert, full TTL); a
prediction never shortens or overwrites a live entry that outlives it (the index's
``ttl`` writes), so a real entry is only ever extended. A key the backend holds with more
than half the prediction TTL left is not rewritten, so a burst of siblings costs one
write per key per half TTL. Without any listener this is the approximate
conversation-aware mode: a new prefix goes to the least loaded backend (or where the
strategy sends it), and the requests after it follow.

The request path, as the forwarder drives it::

    view = await scorer.assess(chain, candidates)     # one index query
    backend = scorer.decide(view, candidates) or strategy.select(...)
    await scorer.routed(view, backend)                # predictions (never raises)
    ticket = prefill_load.started(backend.name, scorer.prefill_tokens(view, backend))
    ... first byte, or failure: prefill_load.finished(ticket)
    ... usage: accuracy.record(backend.name, scorer.predicted_cached_tokens(view, backend),
                               cached_tokens_of(usage))
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import xxhash

from ..config.models import ConversationConfig
from ..pool import Backend
from .base import Change, IndexEntry, KvIndex, StorageTier
from .chains import Held, deepest_held
from .load_average import LoadAverage, RecentCount
from .prefill import PrefillLoad
from .resident import LiveConversations

__all__ = [
    "DECISIONS",
    "ChainView",
    "ConversationScorer",
    "CostComponents",
    "RequestChain",
]

log = logging.getLogger("continuum.kvindex")

DECISIONS: tuple[str, ...] = ("chosen", "tie", "none_held")
"""``on_decision`` outcomes: the scorer chose; the lowest cost was shared; nobody holds
anything of the chain (the last two leave the choice to the strategy)."""

_GPU = StorageTier.GPU_HOT
_MAX_HOMES = 1 << 16
_ONE_SHOT_SHARE = 0.25
_ONE_SHOT_EVIDENCE = 8
"""A prompt is one-shot once this many of its conversations started and fewer than
``_ONE_SHOT_SHARE`` of them sent a second request (a burst of new sessions starts many
before any can go on)."""
_SMALL_TURN_SHARE = 1 / 16
_SMALL_TURN_EVIDENCE = 3
"""A prompt's turns are small once this many requests after their conversation's first
added on average less than ``_SMALL_TURN_SHARE`` of a first request's prompt bytes."""
_ERROR_LOG_EVERY_S = 60.0


class RequestChain(Protocol):
    """What the scorer reads of a request's chain (``router.conversation``'s
    ``RequestChain``): its keys in order and the rendered prompt's byte length."""

    @property
    def keys(self) -> Sequence[bytes]: ...

    @property
    def prompt_bytes(self) -> int: ...

    @property
    def conversation(self) -> bytes | None: ...


@dataclass(slots=True)
class ChainView:
    """One request chain against the chain index, at one instant: what every decision,
    prediction and estimate for that request reads."""

    keys: Sequence[bytes]
    rows: list[Sequence[IndexEntry]]
    """``query_many(keys)``: each key's entries."""
    held: dict[str, Held]
    """Each candidate's deepest key (candidates holding nothing are absent)."""
    prompt_bytes: int
    tokens_per_byte: float
    prompt_tokens: int
    conversation: bytes | None = None
    """The request's conversation identity while the resident term is on
    (``router.conversation.identity``; None: off, or not identified)."""


@dataclass(frozen=True, slots=True)
class CostComponents:
    """One candidate's cost and its parts (gRPC Score, tests)."""

    backend: str
    prompt_tokens: int
    held_tokens: int
    depth: int
    """Keys of the chain held (0: none)."""
    tier: StorageTier | None
    credited_tokens: float
    """``credit(tier) * held_tokens``."""
    in_flight_prefill_tokens: int
    in_flight_requests: int
    """The backend's count now (the cost reads its average over ``load_window_seconds``)."""
    resident_tokens: int
    """Prompt tokens of the other live conversations routed to the backend."""
    cost: float


def _holds_the_most(view: ChainView, backends: Sequence[Backend]) -> bool:
    """Whether one of ``backends`` holds as many tokens of ``view``'s chain as any
    candidate (``view.held`` is not empty)."""
    most = max(h.token_count for h in view.held.values())
    held = view.held
    return any((h := held.get(b.name)) is not None and h.token_count >= most for b in backends)


class ConversationScorer:
    """The cost model over the chain index (module docstring)."""

    def __init__(
        self,
        index: KvIndex,
        config: ConversationConfig,
        load: PrefillLoad,
        *,
        entry_ttl_seconds: float,
        on_decision: Callable[[str, str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """
        Args:
            index: the chain index (keys: 16-byte chain keys).
            config: ``kv_cache_index.conversation`` (chunk size, prediction TTL, weights).
            load: the in-flight prefill ledger the forwarder keeps.
            entry_ttl_seconds: the index's TTL; predictions never live longer.
            on_decision: ``(outcome, tier)`` of every :meth:`decide` (metrics).
            clock: the load averages' clock (seconds).
        """
        self.index = index
        self.config = config
        self.scoring = config.scoring
        self.load = load
        self.chunk_bytes = config.chunk_bytes
        self.predict_ttl = min(float(config.predict_ttl_seconds), float(entry_ttl_seconds))
        self._default_tpb = 1.0 / config.scoring.bytes_per_token
        self._on_decision = on_decision
        self.decisions = dict.fromkeys(DECISIONS, 0)
        self.capped = 0
        """Decisions where every candidate holding the most of the chain was at the load
        cap, so one holding less took the request (PrefixAwareHash's ``overflow`` for its
        ring): how often balance overrode what is cached, each time prefilling again what
        those held, often a whole prompt copied."""
        self.predicted_keys = 0
        """Chain keys written as predictions since start."""
        self.prediction_errors = 0
        """Prediction writes that failed (the index was unavailable)."""
        self._error_logged = -_ERROR_LOG_EVERY_S
        self._homes: dict[bytes, str] = {}
        """A prompt's first key -> the backend this router first sent it to (insertion
        order: the oldest goes first past ``_MAX_HOMES``)."""
        self.load_average = LoadAverage(config.scoring.load_window_seconds, clock)
        self._placed = RecentCount(config.scoring.load_window_seconds, clock)
        """Prompts placed per backend lately (``new_prompts: least_loaded``)."""
        self._resident_weight = config.scoring.resident_weight
        self.live = LiveConversations(config.scoring.resident_window_seconds, clock)
        """The conversations routed lately, per backend (the ``resident_tokens`` term)."""

    # ---- reading the index ----------------------------------------------------------

    async def assess(
        self, chain: RequestChain, candidates: Sequence[Backend], *, peek: bool = False
    ) -> ChainView:
        """Query the chain index once for ``chain`` (``peek``: an operator's read, not
        counted as a routing lookup) and estimate its prompt tokens."""
        keys = chain.keys
        index = self.index
        rows = await (index.peek_many(keys) if peek else index.query_many(keys))
        held, deepest = deepest_held(rows, [b.name for b in candidates])
        tpb = self._default_tpb
        if deepest is not None and deepest.token_count > 0:
            tpb = deepest.token_count / (deepest.depth * self.chunk_bytes)
        prompt_bytes = chain.prompt_bytes
        prompt_tokens = round(prompt_bytes * tpb)
        if deepest is not None and deepest.token_count > prompt_tokens:
            prompt_tokens = deepest.token_count
        conversation = None
        if self._resident_weight:
            self.live.expire()
            conversation = chain.conversation
        return ChainView(keys, rows, held, prompt_bytes, tpb, prompt_tokens, conversation)

    def resident_tokens(self, view: ChainView, name: str) -> int:
        """The tokens of live conversations on ``name`` other than ``view``'s own."""
        live = self.live
        tokens = live.tokens(name)
        owner = live.owner(view.conversation)
        if owner is not None and owner[0] == name:
            tokens -= owner[1]
        return tokens

    def _credited(self, view: ChainView, held: Held | None) -> float:
        if held is None:
            return 0.0
        sc = self.scoring
        credit = sc.gpu_credit if held.tier is _GPU else sc.storage_credit
        return credit * min(held.token_count, view.prompt_tokens)

    def cost(self, view: ChainView, backend: Backend) -> float:
        """``backend``'s cost for the request ``view`` describes (module docstring)."""
        sc = self.scoring
        name = backend.name
        cost = (
            view.prompt_tokens
            - self._credited(view, view.held.get(name))
            + sc.prefill_load_weight * self.load.tokens(name)
            + sc.active_request_weight * self.load_average.value(backend)
        )
        if self._resident_weight:
            cost += self._resident_weight * self.resident_tokens(view, name)
        return cost

    def components(self, view: ChainView, backend: Backend) -> CostComponents:
        """:meth:`cost` with its parts."""
        held = view.held.get(backend.name)
        return CostComponents(
            backend=backend.name,
            prompt_tokens=view.prompt_tokens,
            held_tokens=held.token_count if held is not None else 0,
            depth=held.depth if held is not None else 0,
            tier=held.tier if held is not None else None,
            credited_tokens=self._credited(view, held),
            in_flight_prefill_tokens=self.load.tokens(backend.name),
            in_flight_requests=backend.in_flight,
            resident_tokens=self.resident_tokens(view, backend.name),
            cost=self.cost(view, backend),
        )

    # ---- deciding -------------------------------------------------------------------

    def pick(self, view: ChainView, candidates: Sequence[Backend]) -> tuple[Backend | None, str]:
        """The lowest-cost candidate under the load cap, and the outcome, without
        reporting it (:meth:`_pick`)."""
        best, outcome, _ = self._pick(view, candidates)
        return best, outcome

    def _pick(
        self, view: ChainView, candidates: Sequence[Backend]
    ) -> tuple[Backend | None, str, bool]:
        """:meth:`pick`, and whether every candidate holding the most was left out for
        the cap (``capped``). Candidates within one chunk's tokens of the lowest cost are a tie:
        the index knows what a backend holds only to a chunk, so a smaller difference
        says nothing. Among tied ones the one holding the most wins (a backend that holds
        nothing of the prompt takes it only when it is cheaper by a whole chunk, so load
        jitter never copies a prompt to a second engine), then a per-prompt preference."""
        if not candidates:
            return None, "none_held", False
        if not view.held:
            if self.scoring.new_prompts == "strategy" or not view.keys:
                return None, "none_held", False  # (a prompt under one chunk: nothing to place)
            return self._least_loaded(view, self._admissible(candidates)), "none_held", False
        # Once: the caps and the keep read it. ``home`` keeps the prompt (it is worth only
        # its prefix); ``copy_home`` is also the home of a prompt not judged yet.
        copy_home, prefix_only = self._stay_home(view, len(candidates))
        home = copy_home if prefix_only else None
        admissible = self._admissible(candidates, view, home, copy_home)  # samples loads
        capped = len(admissible) < len(candidates) and not _holds_the_most(view, admissible)
        costs = [(self.cost(view, b), b) for b in admissible]
        best_cost = min(c for c, _ in costs)
        band = self.chunk_bytes * view.tokens_per_byte
        kept = self._home_kept(view, costs, best_cost, band, home)
        if kept is not None:
            return kept, "chosen", capped
        tied = [b for c, b in costs if c < best_cost + band]
        if len(tied) > 1:
            credited = [self._credited(view, view.held.get(b.name)) for b in tied]
            deepest = max(credited)
            tied = [b for b, c in zip(tied, credited, strict=True) if c == deepest]
        if len(tied) > 1:
            return self._preferred(view, tied), "tie", capped
        return tied[0], "chosen", capped

    def _stay_home(self, view: ChainView, candidates: int) -> tuple[str | None, bool]:
        """The home of ``view``'s prompt, and whether the prompt is worth only its shared
        prefix (one-shot, or its turns are small: module docstring). The home is None
        unless it holds some of the chain, the prompt has less than one candidate's share
        of the recent requests, and it is worth only its prefix or not judged yet (too
        few of its requests seen; only the copy bound reads that one)."""
        if not view.keys:
            return None, False
        first = bytes(view.keys[0])
        live = self.live
        if live.share(first) * candidates >= 1.0:
            return None, False
        prefix_only = live.one_shot(first, _ONE_SHOT_SHARE, _ONE_SHOT_EVIDENCE) or (
            live.small_turns(first, _SMALL_TURN_SHARE, _SMALL_TURN_EVIDENCE)
        )
        if not prefix_only and live.judged(first, _ONE_SHOT_EVIDENCE, _SMALL_TURN_EVIDENCE):
            return None, False
        home = self._homes.get(first)
        return (home if home is not None and home in view.held else None), prefix_only

    def prompt_kinds(self) -> dict[str, int]:
        """How the prompts this router has seen conversations of are judged (admin): how
        many are known (``tracked``), and of them ``one_shot`` and ``small_turns``, the
        two kinds whose home keeps them (module docstring). All 0 while
        ``resident_weight`` is 0: the live conversations are not kept then. A scan of up
        to 16,384 prompts: for an operator's read, not the request path."""
        live = self.live
        keys = live.prompts()
        one_shot = small = 0
        for first in keys:
            if live.one_shot(first, _ONE_SHOT_SHARE, _ONE_SHOT_EVIDENCE):
                one_shot += 1
            elif live.small_turns(first, _SMALL_TURN_SHARE, _SMALL_TURN_EVIDENCE):
                small += 1
        return {"tracked": len(keys), "one_shot": one_shot, "small_turns": small}

    def _home_kept(
        self,
        view: ChainView,
        costs: Sequence[tuple[float, Backend]],
        best_cost: float,
        band: float,
        home: str | None,
    ) -> Backend | None:
        """``home`` (:meth:`_stay_home`'s answer for the request) when it is under the
        cap, holds the chain as deeply as any candidate and costs more than the cheapest
        by less than what it holds."""
        if home is None:
            return None
        credited = self._credited(view, view.held[home])
        for cost, b in costs:
            if b.name == home:
                if cost >= best_cost + max(band, credited):
                    return None
                deepest = max(self._credited(view, view.held.get(o.name)) for _, o in costs)
                return b if credited >= deepest else None
        return None

    def _least_loaded(self, view: ChainView, candidates: Sequence[Backend]) -> Backend:
        """Where a prompt nobody holds goes (``new_prompts: least_loaded``), among the
        candidates under the load cap: the fewest prompts placed over the last
        ``load_window_seconds`` (what a burst of new prompts will bring, before their
        load shows), then the fewest requests in flight now, then the fewest prefill
        tokens in flight, then the prompt's own hash."""
        first = bytes(view.keys[0]) if view.keys else b""
        tokens = self.load.tokens
        placed = self._placed.value
        return min(
            candidates,
            key=lambda b: (
                round(placed(b.name), 1),
                b.in_flight,
                tokens(b.name),
                -xxhash.xxh3_64_intdigest(first + b.name.encode()),
            ),
        )

    def _preferred(self, view: ChainView, tied: Sequence[Backend]) -> Backend:
        """One of equally good backends, the same one for every request of a prompt: its
        home (:meth:`routed`) while that is among them, else rendezvous hashing of its
        first key and the backend's name. Read-only (gRPC ``Score`` calls it). A prompt
        two engines hold keeps going to one of them, instead of alternating with load or
        a round robin, which would spread it over both for good; and a request sent past
        a loaded home (the cap) does not move the prompt to the engine that took it."""
        first = bytes(view.keys[0]) if view.keys else b""
        home = self._homes.get(first)
        for b in tied:
            if b.name == home:
                return b
        return max(tied, key=lambda b: xxhash.xxh3_64_intdigest(first + b.name.encode()))

    def _set_home(self, first: bytes, name: str) -> None:
        homes = self._homes
        homes.pop(first, None)
        homes[first] = name
        if len(homes) > _MAX_HOMES:
            del homes[next(iter(homes))]

    def _admissible(
        self,
        candidates: Sequence[Backend],
        view: ChainView | None = None,
        home: str | None = None,
        copy_home: str | None = None,
    ) -> Sequence[Backend]:
        """The candidates below the bounded-load cap (PrefixAwareHash's formula), or all
        of them when the bound is off or every one is at the cap. A backend is at the
        cap when it is over it both now and on average over ``load_window_seconds``
        (``router.kvindex.load_average``): moving a conversation prefills all it holds
        elsewhere, worth it for a lasting overload, not for a burst; and the count now
        makes the cap let go as soon as the overload ends. The backend holding
        ``sticky_tokens`` more of ``view``'s chain than any other candidate is measured
        against ``sticky_load_factor_epsilon`` instead: its conversation's own history;
        so is ``home``, the home of a prompt worth only its shared prefix
        (:meth:`_stay_home`). When no candidate under the cap holds any of the chain, the
        prompt's ``copy_home`` stays a candidate up to ``copy_load_factor_epsilon``:
        sending the request past it would copy the whole prompt into a cache that other
        prompts fill."""
        sc = self.scoring
        eps = sc.load_factor_epsilon
        n = len(candidates)
        loads = self.load_average.sample(candidates)
        if eps is None or n < 2:
            return candidates
        total_now = sum(b.in_flight for b in candidates) + 1
        total_avg = sum(loads) + 1
        cap_now = math.ceil((1.0 + eps) * total_now / n)
        cap_avg = math.ceil((1.0 + eps) * total_avg / n)
        sticky = None
        if view is not None and sc.sticky_load_factor_epsilon > eps:
            sticky = self._sticky(view, home)
        sticky_now = sticky_avg = 0
        if sticky is not None:
            wide = 1.0 + sc.sticky_load_factor_epsilon
            sticky_now = math.ceil(wide * total_now / n)
            sticky_avg = math.ceil(wide * total_avg / n)
        below = [
            b
            for b, load in zip(candidates, loads, strict=True)
            if load < cap_avg
            or b.in_flight < cap_now
            or (b.name == sticky and (load < sticky_avg or b.in_flight < sticky_now))
        ]
        if (
            copy_home is not None
            and below
            and view is not None
            and sc.copy_load_factor_epsilon > eps
            and not any(b.name in view.held for b in below)
        ):
            wide = 1.0 + sc.copy_load_factor_epsilon
            copy_now = math.ceil(wide * total_now / n)
            copy_avg = math.ceil(wide * total_avg / n)
            below += [
                b
                for b, load in zip(candidates, loads, strict=True)
                if b.name == copy_home and (load < copy_avg or b.in_flight < copy_now)
            ]
        return below or candidates

    def _sticky(self, view: ChainView, home: str | None) -> str | None:
        """The candidate holding at least ``sticky_tokens`` more of the chain than any
        other (``view.held`` has the candidates holding any), else ``home``."""
        margin = self.scoring.sticky_tokens
        if not margin or not view.held:
            return home
        best, first, second = None, 0, 0
        for name, held in view.held.items():
            tokens = held.token_count
            if tokens > first:
                best, first, second = name, tokens, first
            elif tokens > second:
                second = tokens
        return best if first - second >= margin else home

    def decide(self, view: ChainView, candidates: Sequence[Backend]) -> Backend | None:
        """The lowest-cost candidate (among tied ones the prompt's preferred). When nobody
        holds any key of the chain: the least loaded, or None (the strategy decides) with
        ``new_prompts: strategy``. Reported to ``on_decision``."""
        best, outcome, capped = self._pick(view, candidates)
        self.decisions[outcome] += 1
        self.capped += capped
        if self._on_decision is not None:
            held = view.held.get(best.name) if best is not None else None
            self._on_decision(outcome, held.tier.value if held is not None else "none")
        return best

    async def choose(self, chain: RequestChain, candidates: Sequence[Backend]) -> Backend | None:
        """:meth:`assess` then :meth:`decide`: the selector's hook."""
        return self.decide(await self.assess(chain, candidates), candidates)

    # ---- what the forwarder records -------------------------------------------------

    def predicted_cached_tokens(self, view: ChainView, backend: Backend) -> int:
        """The prompt tokens ``backend`` is expected to reuse: its held tokens (whatever
        the tier; what ``accuracy.record`` compares with the reported ``cached_tokens``)."""
        held = view.held.get(backend.name)
        return held.token_count if held is not None else 0

    def prefill_tokens(self, view: ChainView, backend: Backend) -> int:
        """The tokens ``backend`` must still compute for the request (prompt minus the
        credited held tokens): what ``PrefillLoad.started`` counts."""
        credited = self._credited(view, view.held.get(backend.name))
        return max(0, round(view.prompt_tokens - credited))

    # ---- predict on route -----------------------------------------------------------

    def predictions(self, view: ChainView, backend: Backend) -> list[Change]:
        """The writes that record ``view``'s keys as held by ``backend`` (module
        docstring): every key it does not hold, and every key it holds that has less than
        half the prediction TTL left (with its own count and tier)."""
        ttl = self.predict_ttl
        if ttl <= 0:
            return []
        name = backend.name
        renew_before = self.index.now() + ttl / 2
        per_chunk = self.chunk_bytes * view.tokens_per_byte
        changes: list[Change] = []
        for i, (key, row) in enumerate(zip(view.keys, view.rows, strict=True)):
            for e in row:
                if e.backend == name:
                    if e.expires_at < renew_before:
                        changes.append((key, name, e.token_count, e.tier))
                    break
            else:
                changes.append((key, name, round((i + 1) * per_chunk), _GPU))
        return changes

    async def routed(self, view: ChainView, backend: Backend) -> int:
        """Write ``view``'s keys as held by ``backend`` for ``predict_ttl_seconds``; returns
        how many were written. Never raises (a failed write is counted and logged at most
        once a minute): routing must not fail for a prediction."""
        if view.keys:
            # The prompt's home: where it went first, and again wherever it goes once
            # its home holds none of it any more.
            first = bytes(view.keys[0])
            home = self._homes.get(first)
            if home is None:
                self._set_home(first, backend.name)
                if not view.held:
                    self._placed.add(backend.name)
            elif view.held and home not in view.held and home != backend.name:
                self._set_home(first, backend.name)
            # (nothing held but a home known: a sibling routed at once placed it first)
            if self._resident_weight and view.conversation is not None:
                self.live.placed(
                    view.conversation,
                    first,
                    backend.name,
                    view.prompt_tokens,
                    size=view.prompt_bytes,
                )
        changes = self.predictions(view, backend)
        if not changes:
            return 0
        try:
            await self.index.write_many(changes, self.predict_ttl)
        except Exception as exc:
            self.prediction_errors += 1
            now = time.monotonic()
            if now - self._error_logged >= _ERROR_LOG_EVERY_S:
                self._error_logged = now
                log.warning("conversation prediction write failed: %r", exc)
            return 0
        self.predicted_keys += len(changes)
        return len(changes)
