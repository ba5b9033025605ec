"""SAECache: semantic-adaptive eviction for prefix caches, as a block-level policy engine.

A caller (an engine's block manager, the trace simulator, the EvictionAdvisor service)
reports what happens to its cached blocks; ``SaeCache`` keeps one small record per block
and answers "which block goes next".

**Priority.** Each block sits in one of four queues (``types.route``) and has priority::

    P(b) = [alpha_q] * w_type(b) * p_q(b) / D_q(b)      dt_b = now - last access (>= min_dt)
    chat and agent queues (S = 1 - F_LN(dt_b; mu_q, sigma_q), X ~ LN(mu_q, sigma_q)):
      p_q = c S / (c S + 1 - c)                          the session is still alive
      D_q = max(E[X], E[X - dt_b | X > dt_b])            expected wait for its next request
    structure queue:   p_q = 1 - (o_b / o_max)^gamma,  D_q = max(dt_b, E[G - dt_b | G > dt_b])
                       (o_b: block offset; G: a structure block's re-access gap)
    evict-first queue: p_q = 1,                        D_q = dt_b
    [alpha_q]: the learned queue weight, 1 unless use_queue_weights (off by default)

``c`` is the learned probability that the block's session sends another request at all,
given the *cell* of its latest request: chat or agent, the token type of the request's
deepest block (an agent step that ends in a plain answer rather than a tool call ends the
loop) and its length in half-octave buckets (conversations near a length limit end). So
``p_q`` is the probability the session returns given it has been idle ``dt_b`` — it
falls fast for a session idle far past its typical gap, or whose last request looked like
its last — and ``D_q`` turns it into hits per second of cache residence. The paper's
``p_q = S, D_q = dt_b`` is ``use_continuation=False, use_residual=False``: within one
queue and token type it orders blocks exactly as LRU does, because ``S(dt)/dt`` falls
with ``dt`` whatever the session.

A first request the session predictor calls single-turn goes to the evict-first queue in
the paper; with ``soft_single`` it goes to the chat queue in its own cell family, so the
predictor's verdict is one more feature whose reliability ``c`` learns (a wrong verdict
no longer costs a continuing conversation its whole first turn).

The lowest priority among *evictable* blocks (not in use, no cached child: a parent is
never evicted before its child, as in vLLM) is the victim. Evict-first is strict: while
it holds an evictable block, the victim comes from it.

**O(log n) decisions.** Within one (queue, token type, offset bucket or continuation cell)
list every factor of ``P`` except the time part is shared, and the time part only falls
as ``dt`` grows (``p_q`` falls, ``D_q`` does not fall: the residual of a log-normal dips
below its mean for small ``dt``, hence the ``max``), so the list's oldest block is its
lowest. Each list is a heap on last-access time with lazy deletion; a decision looks at
the head of each non-empty list (a few dozen in practice) and pops one entry:
O(L + log n), independent of the number of blocks, and every learned parameter can change
between decisions without reordering anything. Offsets in the structure queue are
bucketed by powers of two (``0, 1, 2-3, 4-7, ...``); a bucket's positional factor uses
its midpoint.

**Online adaptation** (``learners``), each switchable off (``SaeConfig.learn_*``) and each
component removable for ablations (``SaeConfig.use_*``, which sets its factor to 1):

* token-type weights — every ``window`` block accesses, EMA (``ema``) towards each
  type's reuse rate ``(hits + evicted-then-missed) / accesses`` over the best type's,
  floored at ``weight_floor``; "evicted-then-missed" is a miss on a key in the ghost list
  of recently evicted blocks (``ghost_capacity`` keys);
* mu, sigma per multi-turn queue — online MLE over the gaps between consecutive requests
  of one session (session level, not block re-access intervals), decayed with
  ``timing_halflife`` samples;
* the same gaps as a histogram (``learners.EmpiricalGaps``, ``use_empirical_timing``, on
  by default): once a queue has 64 of them, ``S`` and ``E[X - dt | X > dt]`` are read
  from it instead of the log-normal, whose shape is wrong for Weibull, Pareto or bimodal
  gaps (think times with two modes, long pauses). The log-normal stays the prior, the
  exported parameters and the ``end_z`` quantile of the continuation fit. Chosen on the
  tuning grid (mean margin over the better of LRU and LFU +3.40 -> +3.52, failing cells
  46 -> 44 of 240), then run once on the evaluation grid (+2.53 -> +2.74, 68 -> 60 of
  225; bench/RESULTS.md);
* the structure queue's re-access gaps ``G`` (hits on its blocks, and misses on its
  blocks recently evicted: the ghost list keeps their last access), as a histogram too
  (``use_structure_wait``): once it has 64, a structure block is priced by its expected
  wait, never below LRU's ``dt``. Before, ``D = dt`` priced a shared prompt used a second
  ago as one used again within a second, over every conversation's blocks; where the
  gaps say prompts come back at longer intervals they are now ranked by them (tuning
  grid +3.52 -> +3.66, failing cells 44 -> 41; evaluation +2.74 -> +2.85, 60 -> 55, one
  more cell below -0.5);
* c per cell — resolved outcomes of requests: the session came back (continued), or
  stayed idle past ``exp(mu_q + end_z * sigma_q)`` (ended), decayed with
  ``continuation_halflife`` outcomes, with ``continuation_prior_weight`` pseudo-outcomes
  at ``continuation_prior``; a session written off that returns adds a continuation;
* gamma — fitted from per-offset-bucket would-hit rates of the structure queue;
* alpha per queue — hit blocks per resident block of the window, normalised, softmax
  with ``temperature``, EMA.

**Queue weights are off by default** (``use_queue_weights=False``: ``alpha_q`` is 1 in
``P``), because the traces say so. The worst tuning cell (tune-weibull,
single-turn-heavy 10 %, seed 2) hit 51.3 % with alpha, 56.1 % without, LRU 53.0 %. Off,
on the tuning traces (base and the three tune-* variants x seeds 1-4, 240 cells) the
mean margin over the better of LRU and LFU rose from +2.71 to +3.15 points and the worst
cell from -1.7 to -0.8; on the evaluation grid, run once after the choice, the mean rose
from +2.10 to +2.36, 35 instead of 29 of the 99 cells where LRU trails MIN by 10 points
or more reached +4.8, and the worst cell stayed at -2.3 (bench/RESULTS.md). A likely
reason, not isolated: ``p_q / D_q`` already prices each queue in hits per second of
residence, while alpha is fitted on hits per resident block of the last window, i.e. on
what the cache chose to keep, and so reinforces its own past choices. alpha is still
learned (``learn_queue_weights``, one softmax per window) and exported by ``params()``,
so exported parameters mean the same whatever the switch, and a cache that turns the
weights on can load them: the chain tracker's pruning policy does (``pruning``: there
evict-first's weight of 1/4 is what keeps a shared prompt through a flood).

Constants the paper leaves open, chosen here: initial chat timing ``mu = ln 60 s``,
``sigma = 1``; agent ``mu = ln 5 s``, ``sigma = 1``; gamma 1; window 4096 accesses;
EMA 0.3; temperature 0.5; weight floor 0.02; min_dt 1 ms; o_max the largest offset seen in
the structure queue; continuation prior 0.5 with weight 2, half-life 2000 outcomes, end
quantile z = 2.326 (the 99th percentile of the fitted gap distribution). They are fixed
once for every workload, not per mixture. All times are seconds on the caller's clock.

Size: one module (about 780 lines): the priority, the queues' bookkeeping and the online
learners are one algorithm whose invariants (above) span all three.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field

from .learners import (
    ContinuationFit,
    EmpiricalGaps,
    GammaFit,
    LogNormalMle,
    alive,
    ema_weights,
    softmax_weights,
)
from .types import Queue, SessionClass, TokenType, route

__all__ = ["SaeCache", "SaeConfig", "SaeParams", "offset_bucket"]

_NQ = len(Queue)
_NT = len(TokenType)
_NB = 16
_EF, _ST, _CH, _AG = Queue.EVICT_FIRST, Queue.STRUCTURE, Queue.CHAT, Queue.AGENT
_SYS, _TDEF = TokenType.SYSTEM, TokenType.TOOL_DEF
_STRICT = ((_EF,), (_ST, _CH, _AG))
_FLAT = ((_EF, _ST, _CH, _AG),)
_SQRT2 = math.sqrt(2.0)
_erfc, _log = math.erfc, math.log
_REP = [0.0] + [(2 ** (k - 1)) * 1.5 - 0.5 for k in range(1, _NB)]
_NL = 20  # length buckets of a request (half octaves of its deepest block offset)
_NCELL = 3 * _NT * _NL  # (session family, type of the deepest block, length bucket)
_EXP_TAIL = 1e-12  # survival below which the residual is approximated by the elapsed time


def _time_factor(
    p: float,
    dt: float,
    mu: float,
    sigma: float,
    mean: float,
    lognormal: bool,
    cont: bool,
    resid: bool,
) -> float:
    """``p_q(dt) / D(dt)`` of a multi-turn block (see ``SaeCache._timed``); ``dt > 0``."""
    if not lognormal:
        return (p if cont else 1.0) / dt
    z = (_log(dt) - mu) / sigma
    surv = 0.5 * _erfc(z / _SQRT2)
    a = alive(p, surv, cont)
    if not resid:
        return a / dt
    if surv > _EXP_TAIL:
        wait = mean * 0.5 * _erfc((z - sigma) / _SQRT2) / surv - dt
        if wait < mean:
            wait = mean
    else:
        wait = dt if dt > mean else mean
    return a / wait


def session_cell(family: int, deep_type: int, deep_offset: int) -> int:
    """Feature cell of a request: its session's family (0 chat, 1 agent, 2 a first request
    predicted single-turn), its deepest block's type and offset."""
    lb = min(int(2.0 * math.log2(deep_offset + 1)), _NL - 1) if deep_offset > 0 else 0
    return (family * _NT + deep_type) * _NL + lb


def offset_bucket(offset: int) -> int:
    """Power-of-two bucket of a block offset: 0 | 1 | 2-3 | 4-7 | ... (capped at 15)."""
    return min(offset.bit_length(), _NB - 1)


@dataclass(slots=True)
class SaeParams:
    """Every learned parameter; ``SaeCache.params()`` exports, ``load_params`` restores."""

    type_weights: list[float] = field(default_factory=lambda: [1.0] * _NT)
    queue_weights: list[float] = field(default_factory=lambda: [1.0] * _NQ)
    mu: dict[int, float] = field(
        default_factory=lambda: {int(_CH): math.log(60.0), int(_AG): math.log(5.0)}
    )
    sigma: dict[int, float] = field(default_factory=lambda: {int(_CH): 1.0, int(_AG): 1.0})
    gamma: float = 1.0
    continuation: dict[int, float] = field(default_factory=dict)


@dataclass(slots=True)
class SaeConfig:
    """Tunables (see the module docstring for the chosen defaults).

    ``use_*`` removes a component from the priority (its factor becomes 1); every one is
    on except ``use_queue_weights`` (see the module docstring). ``learn_*`` freezes a
    learner; ``learn_queue_weights`` keeps fitting ``alpha`` even while the weights are
    not used, so ``params()`` exports it either way.
    """

    window: int = 4096
    ema: float = 0.3
    temperature: float = 0.5
    weight_floor: float = 0.02
    ghost_capacity: int = 65536
    min_dt: float = 1e-3
    timing_halflife: float | None = 2000.0
    max_sessions: int = 65536
    strict_evict_first: bool = True
    use_type_weights: bool = True
    use_queue_weights: bool = False
    use_lognormal: bool = True
    use_positional: bool = True
    use_continuation: bool = True
    use_residual: bool = True
    soft_single: bool = True
    use_empirical_timing: bool = True
    use_structure_wait: bool = True
    learn_type_weights: bool = True
    learn_queue_weights: bool = True
    learn_timing: bool = True
    learn_gamma: bool = True
    learn_continuation: bool = True
    continuation_prior: float = 0.5
    continuation_prior_weight: float = 2.0
    continuation_halflife: float | None = 2000.0
    end_z: float = 2.326
    params: SaeParams | None = None

    def frozen(self) -> SaeConfig:
        """The same configuration with every learner switched off."""
        from dataclasses import replace

        return replace(
            self,
            learn_type_weights=False,
            learn_queue_weights=False,
            learn_timing=False,
            learn_gamma=False,
            learn_continuation=False,
        )


class _Blk:
    __slots__ = (
        "bucket",
        "cell",
        "children",
        "key",
        "last",
        "offset",
        "owner",
        "parent",
        "queue",
        "refs",
        "seq",
        "shared",
        "ttype",
    )

    def __init__(
        self, key: Hashable, parent: _Blk | None, ttype: int, offset: int, owner: Hashable
    ) -> None:
        self.key, self.parent, self.ttype, self.offset, self.owner = (
            key,
            parent,
            ttype,
            offset,
            owner,
        )
        self.bucket = 0
        self.cell = 0
        self.children = 0
        self.refs = 0
        self.seq = 0
        self.shared = False
        self.last = 0.0
        self.queue = _CH


_FAMILY = {SessionClass.AGENT: 1, SessionClass.SINGLE: 2}


class _Sess:
    """A session: its last request time, class and the deepest block of that request."""

    __slots__ = ("cls", "deep", "dtype", "last")

    def __init__(self, last: float, cls: SessionClass) -> None:
        self.last, self.cls = last, cls
        self.deep = -1
        self.dtype = int(TokenType.USER)

    def cell(self) -> int:
        return session_cell(_FAMILY.get(self.cls, 0), self.dtype, max(self.deep, 0))


class SaeCache:
    """Per-block state and eviction order of one cache (one engine, one KV group).

    Not thread-safe; every method is O(1) amortised except ``victim``/``evict``
    (O(L + log n)) and ``rank`` (O(k log k) for k candidates).
    """

    def __init__(self, config: SaeConfig | None = None) -> None:
        cfg = self.cfg = config if config is not None else SaeConfig()
        p = cfg.params if cfg.params is not None else SaeParams()
        self.w = list(p.type_weights)
        self.alpha = list(p.queue_weights)
        self.timing = {
            q: LogNormalMle(
                p.mu[int(q)],
                p.sigma[int(q)],
                halflife=cfg.timing_halflife,
                learn=cfg.learn_timing,
            )
            for q in (_CH, _AG)
        }
        self.st_gaps = EmpiricalGaps(halflife=cfg.timing_halflife, learn=cfg.learn_timing)
        self.gaps = {
            q: EmpiricalGaps(halflife=cfg.timing_halflife, learn=cfg.learn_timing)
            for q in (_CH, _AG)
        }
        self.gamma = GammaFit(p.gamma, learn=cfg.learn_gamma, ema=cfg.ema)
        self.cont = ContinuationFit(
            _NCELL,
            prior=cfg.continuation_prior,
            prior_weight=cfg.continuation_prior_weight,
            halflife=cfg.continuation_halflife,
            learn=cfg.learn_continuation,
            init=p.continuation,
        )
        self.o_max = 1.0
        self._ctab: list[list[float]] = []
        self._refresh()
        self._blocks: dict[Hashable, _Blk] = {}
        self._heaps: list[dict[int, list[tuple[float, int, _Blk]]]] = [{} for _ in range(_NQ)]
        self._seq = 0
        self._ghost: OrderedDict[Hashable, tuple[int, int, Hashable, float]] = OrderedDict()
        self._sessions: OrderedDict[Hashable, _Sess] = OrderedDict()
        self._pending: OrderedDict[Hashable, _Sess] = OrderedDict()
        self.occupancy = [0] * _NQ
        self._ticks = 0
        self._acc = [0.0] * _NT
        self._reuse = [0.0] * _NT
        self._qhits = [0.0] * _NQ
        self.hits = self.misses = self.ghost_misses = self.evictions = 0

    # -- parameters -------------------------------------------------------------------

    def params(self) -> SaeParams:
        return SaeParams(
            type_weights=list(self.w),
            queue_weights=list(self.alpha),
            mu={int(q): m.mu for q, m in self.timing.items()},
            sigma={int(q): m.sigma for q, m in self.timing.items()},
            gamma=self.gamma.gamma,
            continuation=self.cont.table(),
        )

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._blocks

    # -- sessions ---------------------------------------------------------------------

    def session_class(self, session: Hashable) -> SessionClass | None:
        """The class a known session routes by; None for a session not seen (or expired)."""
        s = self._sessions.get(session)
        return None if s is None else s.cls

    def begin_request(
        self, session: Hashable, now: float, hint: SessionClass = SessionClass.UNKNOWN
    ) -> SessionClass:
        """A request of ``session`` starts; returns the class its blocks are routed by.

        A session seen before is multi-turn (agent if it was or is hinted so, else chat)
        and its gap since the previous request feeds that queue's timing fit. A new
        session takes ``hint`` (the session predictor's or the caller's guess).
        """
        self._expire(now)
        s = self._sessions.get(session)
        if s is None:
            cls = hint
            s = self._sessions[session] = _Sess(now, cls)
            if len(self._sessions) > self.cfg.max_sessions:
                self._sessions.popitem(last=False)
            self._track(session, s)
            return cls
        self._sessions.move_to_end(session)
        prev = s.cell()
        if self._pending.pop(session, None) is not None:
            self.cont.observe(prev, True)
        else:
            self.cont.observe(prev, True, count=False)  # came back after being written off
        cls = s.cls
        if cls not in (SessionClass.CHAT, SessionClass.AGENT):
            cls = SessionClass.AGENT if hint == SessionClass.AGENT else SessionClass.CHAT
        q = _AG if cls == SessionClass.AGENT else _CH
        self.timing[q].observe(now - s.last)
        self.gaps[q].observe(now - s.last)
        s.last, s.cls = now, cls
        s.deep, s.dtype = -1, int(TokenType.USER)
        self._track(session, s)
        return cls

    def _track(self, session: Hashable, s: _Sess) -> None:
        self._pending[session] = s
        if len(self._pending) > self.cfg.max_sessions:
            _, old = self._pending.popitem(last=False)
            self.cont.observe(old.cell(), False)

    def _expire(self, now: float) -> None:
        """Sessions idle past the ``end_z`` quantile of their gap distribution have ended."""
        pend = self._pending
        if not pend:
            return
        z = self.cfg.end_z
        ends = {q: math.exp(m.mu + z * m.sigma) for q, m in self.timing.items()}
        end = min(ends.values())
        while pend:
            key = next(iter(pend))
            s = pend[key]
            idle = now - s.last
            if idle < end:
                return
            if idle < ends[_AG if s.cls == SessionClass.AGENT else _CH]:
                # a chat session at the head: agents behind it may have expired, but they
                # wait for it (bounded delay; keeps the sweep O(1) amortised)
                return
            del pend[key]
            self.cont.observe(s.cell(), False)

    def _route(self, ttype: int, session: Hashable, shared: bool) -> Queue:
        if (session is None or session == "") and (ttype == _SYS or ttype == _TDEF):
            return _ST  # no session ids: every request looks like one conversation's
        sclass = self._class(session)
        q = route(ttype, sclass, shared)
        if q == _EF and sclass == SessionClass.SINGLE and self.cfg.soft_single:
            return _CH  # ranked by its learned continuation (family 2) instead
        return q

    def _class(self, session: Hashable) -> SessionClass:
        s = self._sessions.get(session)
        return SessionClass.UNKNOWN if s is None else s.cls

    def _deepest(self, session: Hashable, offset: int, ttype: int) -> None:
        s = self._sessions.get(session)
        if s is not None and offset > s.deep:
            s.deep, s.dtype = offset, ttype

    # -- block events -----------------------------------------------------------------

    def insert(
        self,
        key: Hashable,
        parent: Hashable | None,
        *,
        ttype: TokenType,
        offset: int,
        now: float,
        session: Hashable = None,
        pinned: bool = True,
        queue: Queue | None = None,
    ) -> None:
        """A block was computed and cached (a miss); it is in use when ``pinned``.

        A key already cached counts as a hit instead. ``queue`` overrides the routing rule
        for callers that know better (the listener's pruning policy).
        """
        b = self._blocks.get(key)
        if b is not None:
            self.hit(key, now=now, session=session, pinned=pinned)
            return
        if session is not None:
            self._deepest(session, offset, int(ttype))
        pb = self._blocks.get(parent) if parent is not None else None
        b = _Blk(key, pb, int(ttype), offset, session)
        b.bucket = offset_bucket(offset)
        b.last = now
        if pb is not None:
            if pb.children == 0 and pb.seq:
                pb.seq = 0
            pb.children += 1
        ghost = self._ghost.pop(key, None) if self._ghost else None
        self.misses += 1
        reused = ghost is not None
        if ghost is not None:
            self.ghost_misses += 1
            if ghost[1] == _ST and now > ghost[3] and self.cfg.use_structure_wait:
                self.st_gaps.observe(now - ghost[3])  # a gap the cache did not outlast
            if ghost[2] != session:
                b.shared = True
        if queue is not None:
            b.queue = queue
        elif pb is not None and pb.queue == _EF and not b.shared:
            b.queue = _EF  # reusable only after its parent, which is not expected to be
        else:
            b.queue = self._route(b.ttype, session, b.shared)
        if b.queue == _ST and offset + 1 > self.o_max:
            self.o_max = float(offset + 1)
            self._refresh()
        self.occupancy[b.queue] += 1
        self._blocks[key] = b
        self._account(b, reused)
        if pinned:
            b.refs = 1
        else:
            self._push(b)

    def hit(
        self, key: Hashable, *, now: float, session: Hashable = None, pinned: bool = True
    ) -> bool:
        """A cached block was reused; returns False for an unknown key."""
        b = self._blocks.get(key)
        if b is None:
            return False
        self.hits += 1
        b.seq = 0
        if b.queue == _ST and now > b.last and self.cfg.use_structure_wait:
            self.st_gaps.observe(now - b.last)
        b.last = now
        if session is not None:
            self._deepest(session, b.offset, b.ttype)
        if session != b.owner and not b.shared:
            b.shared = True
        q = self._route(b.ttype, session, b.shared)
        if q != b.queue:
            self.occupancy[b.queue] -= 1
            self.occupancy[q] += 1
            b.queue = q
            if q == _ST and b.offset + 1 > self.o_max:
                self.o_max = float(b.offset + 1)
                self._refresh()
        self._qhits[q] += 1  # credited to the queue that holds the block from now on
        self._account(b, True)
        if pinned:
            b.refs += 1
        elif b.refs == 0 and b.children == 0:
            self._push(b)
        return True

    def release(self, key: Hashable) -> None:
        """A request using the block finished (undoes one ``pinned`` insert or hit)."""
        b = self._blocks.get(key)
        if b is None or b.refs == 0:
            return
        b.refs -= 1
        if b.refs == 0 and b.children == 0:
            self._push(b)

    def remove(self, key: Hashable) -> bool:
        """The cache dropped the block (its own decision); remembered as evicted."""
        b = self._blocks.get(key)
        if b is None:
            return False
        self._unlink(b)
        return True

    def clear(self) -> None:
        self._blocks.clear()
        for h in self._heaps:
            h.clear()
        self._ghost.clear()
        self.occupancy = [0] * _NQ

    # -- decisions --------------------------------------------------------------------

    def priority(self, key: Hashable, now: float) -> float | None:
        b = self._blocks.get(key)
        if b is None:
            return None
        if b.refs == 0 and b.children == 0 and b.seq:
            return self._prio(b, now)  # as ranked for eviction (its list's cell)
        b.cell = self._cell(b)
        return self._prio(b, now)

    def victim(self, now: float) -> Hashable | None:
        """The evictable block with the lowest priority, or None."""
        b = self._victim(now)
        return None if b is None else b.key

    def evict(self, now: float) -> Hashable | None:
        """Remove and return the victim (None when nothing is evictable)."""
        b = self._victim(now)
        if b is None:
            return None
        self.evictions += 1
        self._unlink(b)
        return b.key

    def rank(self, keys: Iterable[Hashable], n: int, now: float) -> list[Hashable]:
        """Up to ``n`` of ``keys`` in eviction order.

        Keys never observed come first (nothing speaks for keeping them); a block is
        ranked only after every cached child of it, and not at all when a cached child is
        not among ``keys`` (the cache could not free it without that child going first).
        """
        out: list[Hashable] = []
        cand: dict[Hashable, _Blk] = {}
        for k in keys:
            if k in cand:
                continue
            b = self._blocks.get(k)
            if b is None:
                if k not in out:
                    out.append(k)
            else:
                cand[k] = b
        if len(out) >= n:
            return out[:n]
        incand: dict[_Blk, int] = dict.fromkeys(cand.values(), 0)
        for b in cand.values():
            if b.parent is not None and b.parent in incand:
                incand[b.parent] += 1
        left = dict(incand)
        heap: list[tuple[tuple[int, float], int, _Blk]] = []
        order = 0
        for b in cand.values():
            if b.children == 0:
                order += 1
                heap.append((self._rkey(b, now), order, b))
        heapq.heapify(heap)
        while heap and len(out) < n:
            _, _, b = heapq.heappop(heap)
            out.append(b.key)
            p = b.parent
            if p is not None and p in left:
                left[p] -= 1
                if left[p] == 0 and p.children == incand[p]:
                    order += 1
                    heapq.heappush(heap, (self._rkey(p, now), order, p))
        return out

    # -- internals --------------------------------------------------------------------

    def _rkey(self, b: _Blk, now: float) -> tuple[int, float]:
        tier = 1 if self.cfg.strict_evict_first and b.queue != _EF else 0
        if not b.seq:
            b.cell = self._cell(b)
        return tier, self._prio(b, now)

    def _prio(self, b: _Blk, now: float) -> float:
        q = b.queue
        c = self._ctab[q][b.ttype * _NB + (b.bucket if q == _ST else 0)]
        if q == _CH or q == _AG:
            return c * self._timed(q, self.cont.p(b.cell), now - b.last)
        dt = max(now - b.last, self.cfg.min_dt)
        stg = self._gap_table(q)
        if stg is not None:
            w = stg.wait_at(dt)
            return c / (w if w > dt else dt)
        return c / dt

    def _gap_table(self, q: Queue) -> EmpiricalGaps | None:
        """The histogram that prices queue ``q``'s waits, once it is ready and switched on
        (multi-turn queues: ``use_empirical_timing``, and only with the timing component;
        structure: ``use_structure_wait``); None: the log-normal, or ``dt``."""
        cfg = self.cfg
        if q == _CH or q == _AG:
            g = self.gaps[q]
            on = cfg.use_empirical_timing and cfg.use_lognormal
        elif q == _ST:
            g, on = self.st_gaps, cfg.use_structure_wait
        else:
            return None
        return g if on and g.ready else None

    def _cell(self, b: _Blk) -> int:
        """The continuation cell of a multi-turn block: its owner session's latest request."""
        if not self.cfg.use_continuation:
            return 0
        s = self._sessions.get(b.owner)
        if s is None:
            return session_cell(1 if b.queue == _AG else 0, b.ttype, b.offset)
        return s.cell()

    def _timed(self, q: Queue, p: float, dt: float) -> float:
        """Time part of a multi-turn block's priority: ``p_q(dt) / D(dt)``.

        ``p_q`` is the survival ``S(dt)`` or, with ``use_continuation``, the probability
        that the session is still alive after ``dt`` idle, ``p S / (p S + 1 - p)``;
        ``D`` is ``dt`` or, with ``use_residual``, the expected wait for its next request
        ``max(E[X], E[X - dt | X > dt])``. Both parts only fall as ``dt`` grows.
        """
        cfg = self.cfg
        g = self._gap_table(q)
        if g is not None:
            return g.factor(p, max(dt, cfg.min_dt), cfg.use_continuation, cfg.use_residual)
        m = self.timing[q]
        return _time_factor(
            p,
            max(dt, cfg.min_dt),
            m.mu,
            m.sigma,
            math.exp(m.mu + 0.5 * m.sigma * m.sigma),
            cfg.use_lognormal,
            cfg.use_continuation,
            cfg.use_residual,
        )

    def _coef(self, q: int, t: int, bucket: int) -> float:
        c = 1.0
        cfg = self.cfg
        if cfg.use_queue_weights:
            c *= self.alpha[q]
        if cfg.use_type_weights:
            c *= self.w[t]
        if q == _ST and cfg.use_positional:
            r = _REP[bucket] / self.o_max
            c *= max(1.0 - r**self.gamma.gamma, 1e-6) if r < 1.0 else 1e-6
        return c

    def _refresh(self) -> None:
        """Recompute the per-list coefficients (after any parameter change)."""
        self._ctab = [
            [self._coef(q, lid // _NB, lid % _NB) for lid in range(_NT * _NB)] for q in Queue
        ]

    def _push(self, b: _Blk) -> None:
        self._seq += 1
        b.seq = self._seq
        q = b.queue
        if q == _CH or q == _AG:
            b.cell = self._cell(b)
            lid = b.ttype * _NCELL + b.cell
        else:
            lid = b.ttype * _NB + (b.bucket if q == _ST else 0)
        lists = self._heaps[b.queue]
        heap = lists.get(lid)
        if heap is None:
            heap = lists[lid] = []
        heapq.heappush(heap, (b.last, b.seq, b))

    def _victim(self, now: float) -> _Blk | None:
        cfg = self.cfg
        order = _STRICT if cfg.strict_evict_first else _FLAT
        min_dt = cfg.min_dt
        heappop = heapq.heappop
        pcont = self.cont.ps
        lognormal, cont, resid = cfg.use_lognormal, cfg.use_continuation, cfg.use_residual
        for group in order:
            best: _Blk | None = None
            best_p = math.inf
            for q in group:
                lists = self._heaps[q]
                if not lists:
                    continue
                ctab = self._ctab[q]
                timed = q == _CH or q == _AG
                table = self._gap_table(q)
                emp = table if timed else None
                stg = None if timed else table
                if timed:
                    m = self.timing[q]
                    mu, sigma = m.mu, m.sigma
                    mean = math.exp(mu + 0.5 * sigma * sigma)
                for lid in list(lists):
                    heap = lists[lid]
                    while heap and heap[0][1] != heap[0][2].seq:
                        heappop(heap)
                    if not heap:
                        del lists[lid]
                        continue
                    last, _, b = heap[0]
                    dt = now - last
                    if dt < min_dt:
                        dt = min_dt
                    if emp is not None:
                        p = ctab[(lid // _NCELL) * _NB] * emp.factor(
                            pcont[lid % _NCELL], dt, cont, resid
                        )
                    elif timed:
                        p = ctab[(lid // _NCELL) * _NB] * _time_factor(
                            pcont[lid % _NCELL], dt, mu, sigma, mean, lognormal, cont, resid
                        )
                    elif stg is not None:
                        w = stg.wait_at(dt)
                        p = ctab[lid] / (w if w > dt else dt)
                    else:
                        p = ctab[lid] / dt
                    if p < best_p:
                        best, best_p = b, p
            if best is not None:
                return best
        return None

    def _unlink(self, b: _Blk) -> None:
        del self._blocks[b.key]
        b.seq = 0
        self.occupancy[b.queue] -= 1
        p = b.parent
        if p is not None:
            p.children -= 1
            if p.children == 0 and p.refs == 0 and p.key in self._blocks:
                self._push(p)
            b.parent = None
        cap = self.cfg.ghost_capacity
        if cap > 0:
            self._ghost[b.key] = (b.ttype, b.queue, b.owner, b.last)
            if len(self._ghost) > cap:
                self._ghost.popitem(last=False)

    def _account(self, b: _Blk, reused: bool) -> None:
        t = b.ttype
        self._acc[t] += 1.0
        if reused:
            self._reuse[t] += 1.0
        if b.queue == _ST:
            self.gamma.observe(b.bucket, reused)
        self._ticks += 1
        if self._ticks >= self.cfg.window:
            self._update()

    def _update(self) -> None:
        cfg = self.cfg
        self._ticks = 0
        if cfg.learn_timing:
            if cfg.use_empirical_timing:
                for g in self.gaps.values():
                    g.refresh()
            if cfg.use_structure_wait:
                self.st_gaps.refresh()
        if cfg.learn_type_weights:
            self.w = ema_weights(
                self.w, self._acc, self._reuse, ema=cfg.ema, floor=cfg.weight_floor
            )
        if cfg.learn_gamma:
            self.gamma.update(_REP, self.o_max)
        if cfg.learn_queue_weights:
            self.alpha = softmax_weights(
                self.alpha,
                self._qhits,
                [float(x) for x in self.occupancy],
                temperature=cfg.temperature,
                ema=cfg.ema,
            )
        self._acc = [0.0] * _NT
        self._reuse = [0.0] * _NT
        self._qhits = [0.0] * _NQ
        self._refresh()
