"""Prefix recovery: the /detokenize client against a real loopback server, and the key the
listener recovers from rendered prompts against the router's own ``extract_prefix_key``.

The engine side is mimicked faithfully: requests are rendered through the chat template
the way vLLM/SGLang do (system turn, user turns, content parts joined with "\\n"),
tokenized by a toy tokenizer whose detokenize is exact, and served back by an aiohttp
server answering in vLLM's (``{"prompt"}``) or SGLang's (``{"text"}``) shape.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from typing import Any

import orjson
import pytest
import pytest_asyncio
from aiohttp import web
from hypothesis import given, settings
from hypothesis import strategies as st

from bus.prefix_key import extract_prefix_key
from bus.salt import SaltError, encode_salt
from listener.recovery import (
    NEED_MORE,
    Attributor,
    DetokenizeError,
    Detokenizer,
)
from listener.templates import (
    CHATML,
    LLAMA3,
    QWEN2_5,
    ChatTemplate,
    locate_anchor,
    marker_template,
)

SPECIALS = (
    "<|im_start|>",
    "<|im_end|>",
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
)
_CHAR_BASE = 1000
LLAMA31_PREAMBLE = "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n"


def encode(text: str) -> list[int]:
    """Toy tokenizer: one ID per special marker, one per character otherwise."""
    out: list[int] = []
    i = 0
    while i < len(text):
        for n, special in enumerate(SPECIALS, start=1):
            if text.startswith(special, i):
                out.append(n)
                i += len(special)
                break
        else:
            out.append(_CHAR_BASE + ord(text[i]))
            i += 1
    return out


def decode(ids: list[int], *, skip_special: bool = False) -> str:
    """Exact inverse of ``encode``."""
    return "".join(
        ("" if skip_special else SPECIALS[t - 1]) if t < _CHAR_BASE else chr(t - _CHAR_BASE)
        for t in ids
    )


def engine_text(content: Any) -> str:
    """What vLLM/SGLang put in the template for a message's content."""
    if isinstance(content, str):
        return content
    return "\n".join(p["text"] for p in content if p.get("type", "text") == "text")


def render(
    body: Mapping[str, Any],
    template: str,
    *,
    default_system: str | None = None,
) -> str:
    """Render an OpenAI or Anthropic request like the engine's chat template would.

    ``template``: ``chatml``, ``llama3`` (3.0) or ``llama3.1`` (always a system turn,
    with the date preamble; content trimmed like the real template).
    """
    msgs: list[tuple[str, str]] = []
    if body.get("system") is not None:
        msgs.append(("system", engine_text(body["system"])))
    msgs += [(m["role"], engine_text(m["content"])) for m in body["messages"]]
    if template == "chatml":
        if default_system is not None and (not msgs or msgs[0][0] != "system"):
            msgs.insert(0, ("system", default_system))
        turns = "".join(f"<|im_start|>{r}\n{c}<|im_end|>\n" for r, c in msgs)
        return turns + "<|im_start|>assistant\n"
    out = "<|begin_of_text|>"
    if template == "llama3.1":
        system = msgs.pop(0)[1] if msgs and msgs[0][0] == "system" else ""
        out += "<|start_header_id|>system<|end_header_id|>\n\n"
        out += LLAMA31_PREAMBLE + system.strip() + "<|eot_id|>"
    for role, content in msgs:
        out += f"<|start_header_id|>{role}<|end_header_id|>\n\n{content.strip()}<|eot_id|>"
    return out + "<|start_header_id|>assistant<|end_header_id|>\n\n"


class FakeEngine:
    """``POST /detokenize`` like vLLM (``{"prompt"}``) or SGLang (``{"text"}``).

    ``fail`` makes the next N requests answer 503; ``gate`` (if set) holds answers.
    """

    def __init__(self, flavor: str) -> None:
        self.flavor = flavor
        self.requests: list[dict[str, Any]] = []
        self.fail = 0
        self.gate: asyncio.Event | None = None
        self.received = asyncio.Event()
        self.app = web.Application()
        self.app.router.add_post("/detokenize", self.handle)

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.requests.append(body)
        self.received.set()
        if self.gate is not None:
            await self.gate.wait()
        if self.fail:
            self.fail -= 1
            return web.json_response({"error": {"message": "busy", "code": 503}}, status=503)
        tokens = body.get("tokens")
        if self.flavor == "vllm":
            if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
                err = {"message": "bad tokens", "type": "BadRequestError", "code": 400}
                return web.json_response({"error": err}, status=400)
            return web.json_response({"prompt": decode(tokens)})
        skip = body.get("skip_special_tokens", True)
        if tokens and isinstance(tokens[0], list):
            return web.json_response({"text": [decode(t, skip_special=skip) for t in tokens]})
        return web.json_response({"text": decode(tokens, skip_special=skip)})


async def serve(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    return runner, f"http://{host}:{port}/detokenize"


@pytest_asyncio.fixture(params=["vllm", "sglang"])
async def engine(request: pytest.FixtureRequest) -> AsyncIterator[tuple[FakeEngine, str]]:
    fake = FakeEngine(request.param)
    runner, url = await serve(fake.app)
    yield fake, url
    await runner.cleanup()


# -- the /detokenize client ---------------------------------------------------------------


async def test_detokenize_round_trip_in_engine_shape(engine: tuple[FakeEngine, str]) -> None:
    fake, url = engine
    text = "<|im_start|>system\nBe brief.<|im_end|>"
    async with Detokenizer(url, model="served", flavor=fake.flavor) as d:  # type: ignore[arg-type]
        assert await d.detokenize(encode(text)) == text
    (sent,) = fake.requests
    assert sent["model"] == "served" and sent["tokens"] == encode(text)
    # SGLang strips special tokens unless told not to; the template markers must survive.
    assert sent.get("skip_special_tokens") is (False if fake.flavor == "sglang" else None)


async def test_many_sequences_batch_on_sglang_and_fan_out_on_vllm(
    engine: tuple[FakeEngine, str],
) -> None:
    fake, url = engine
    seqs = [encode(f"text number {i}") for i in range(5)]
    async with Detokenizer(url, flavor=fake.flavor, max_batch=4) as d:  # type: ignore[arg-type]
        assert await d.detokenize_many(seqs) == [f"text number {i}" for i in range(5)]
    assert len(fake.requests) == (2 if fake.flavor == "sglang" else 5)


async def test_cache_and_in_flight_coalescing() -> None:
    fake = FakeEngine("vllm")
    fake.gate = asyncio.Event()
    runner, url = await serve(fake.app)
    try:
        async with Detokenizer(url) as d:
            first = asyncio.create_task(d.detokenize(encode("same")))
            second = asyncio.create_task(d.detokenize(encode("same")))
            await fake.received.wait()
            fake.gate.set()
            assert await first == await second == "same"
            assert await d.detokenize(encode("same")) == "same"
            assert len(fake.requests) == 1 and d.cache_hits == 1
    finally:
        await runner.cleanup()


async def test_failures_raise_clear_retryable_errors_without_payloads() -> None:
    fake = FakeEngine("vllm")
    runner, url = await serve(fake.app)
    try:
        async with Detokenizer(url) as d:
            fake.fail = 1
            with pytest.raises(DetokenizeError) as err:
                await d.detokenize([4242, 4243])
            assert err.value.status == 503 and err.value.retryable
            assert "4242" not in str(err.value) and "busy" not in str(err.value)
            # the cache must not have stored the failure
            assert await d.detokenize(encode("ok")) == "ok"
    finally:
        await runner.cleanup()
    async with Detokenizer(url, timeout=1.0) as d:  # server gone: connection refused
        with pytest.raises(DetokenizeError) as err:
            await d.detokenize([1])
        assert err.value.status is None and err.value.retryable


async def test_client_errors_are_not_retryable() -> None:
    async def reject(_: web.Request) -> web.Response:
        return web.json_response({"error": {"message": "token 99 out of vocab"}}, status=400)

    async def garbage(_: web.Request) -> web.Response:
        return web.Response(text="not json", content_type="application/json")

    app = web.Application()
    app.router.add_post("/detokenize", reject)
    app.router.add_post("/garbage", garbage)
    runner, url = await serve(app)
    try:
        async with Detokenizer(url) as d:
            with pytest.raises(DetokenizeError) as err:
                await d.detokenize([99])
            assert err.value.status == 400 and not err.value.retryable
            assert "99" not in str(err.value).replace("HTTP 400", "")
        async with Detokenizer(url.replace("/detokenize", "/garbage")) as d:
            with pytest.raises(DetokenizeError, match="invalid JSON"):
                await d.detokenize([1])
    finally:
        await runner.cleanup()


async def test_timeout_is_a_retryable_detokenize_error() -> None:
    fake = FakeEngine("vllm")
    fake.gate = asyncio.Event()
    runner, url = await serve(fake.app)
    try:
        async with Detokenizer(url, timeout=0.05) as d:
            with pytest.raises(DetokenizeError) as err:
                await d.detokenize([1])
            assert err.value.retryable
    finally:
        fake.gate.set()
        await runner.cleanup()


# -- salts --------------------------------------------------------------------------------

SECRET = b"0123456789abcdef-secret"


def test_from_salt_good_bad_foreign_and_without_secret() -> None:
    att = Attributor(model="m", template=CHATML, backend="vllm-1", salt_secret=SECRET)
    key = bytes(range(32))
    assert att.from_salt(encode_salt(SECRET, "vllm-1", key, "tenant")) == key
    with pytest.raises(SaltError):
        att.from_salt(encode_salt(SECRET, "vllm-2", key))  # bound to another backend
    assert att.from_salt("tenant-42-salt") is None
    no_secret = Attributor(model="m", template=CHATML, backend="vllm-1")
    assert no_secret.from_salt(encode_salt(SECRET, "vllm-1", key)) is None
    assert not no_secret.can_detokenize


# -- templates: the listener's key equals the router's ------------------------------------

PARTS = [{"type": "text", "text": "First part."}, {"type": "image_url", "image_url": {}}]
PARTS += [{"type": "text", "text": "Second part."}]
LONG = "A long and winding system prompt. " * 80
REQUESTS: dict[str, dict[str, Any]] = {
    "openai_system": {
        "model": "m",
        "messages": [
            {"role": "system", "content": "You are a terse assistant."},
            {"role": "user", "content": "Hello"},
        ],
    },
    "openai_parts": {
        "model": "m",
        "messages": [{"role": "system", "content": PARTS}, {"role": "user", "content": "Hi"}],
    },
    "openai_first_message": {
        "model": "m",
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Only me."}]}],
    },
    "openai_developer": {
        "model": "m",
        "messages": [
            {"role": "developer", "content": "Developer rules."},
            {"role": "user", "content": "Go"},
        ],
    },
    "openai_empty_system_skipped": {
        "model": "m",
        "messages": [{"role": "system", "content": ""}, {"role": "user", "content": "Q?"}],
    },
    "anthropic_system": {
        "model": "m",
        "system": "Anthropic style system.",
        "messages": [{"role": "user", "content": "Hey"}],
    },
    "anthropic_blocks": {
        "model": "m",
        "system": [{"type": "text", "text": "Block one."}, {"type": "text", "text": "Two."}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Hey"}]}],
    },
    "anthropic_no_system": {
        "model": "m",
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Just a user."}]}],
    },
    "non_ascii": {
        "model": "모델",
        "messages": [
            {"role": "system", "content": "당신은 친절한 도우미입니다 🙂 — ünïcødé"},
            {"role": "user", "content": "안녕"},
        ],
    },
    "long_system": {
        "model": "m",
        "messages": [{"role": "system", "content": LONG}, {"role": "user", "content": "x"}],
    },
    "long_non_ascii_first_message": {
        "model": "m",
        "messages": [{"role": "user", "content": "한국어 문장입니다. " * 200}],
    },
}
RENDERINGS: dict[str, tuple[str, ChatTemplate, str | None]] = {
    "chatml": ("chatml", CHATML, None),
    "qwen2.5": ("chatml", QWEN2_5, QWEN2_5.default_system_prompt),
    "llama3": ("llama3", LLAMA3, None),
    "llama3.1": ("llama3.1", LLAMA3, None),
}


@pytest.mark.parametrize("max_len", [1024, 40])
@pytest.mark.parametrize("rendering", sorted(RENDERINGS))
async def test_recovered_key_equals_router_key(rendering: str, max_len: int) -> None:
    style, template, default = RENDERINGS[rendering]
    fake = FakeEngine("vllm")
    runner, url = await serve(fake.app)
    try:
        async with Detokenizer(url, model="m") as d:
            for name, body in REQUESTS.items():
                att = Attributor(
                    model=body["model"],
                    template=template,
                    backend="b",
                    detokenizer=d,
                    max_prefix_length=max_len,
                )
                tokens = encode(render(body, style, default_system=default))
                got = await att.from_tokens(tokens)
                want = extract_prefix_key(body, max_prefix_length=max_len)
                assert want is not None
                assert got == want, f"{rendering}/{name}"
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("rendering", sorted(RENDERINGS))
def test_every_token_prefix_is_need_more_or_the_right_key(rendering: str) -> None:
    """Monotone: a cut chain never yields a wrong key (the chain tracker relies on it)."""
    style, template, default = RENDERINGS[rendering]
    for max_len in (1024, 25):
        for body in REQUESTS.values():
            att = Attributor(model=body["model"], template=template, backend="b")
            att.max_prefix_length = max_len
            text = render(body, style, default_system=default)
            want = extract_prefix_key(body, max_prefix_length=max_len)
            seen_key = False
            for cut in range(len(text) + 1):
                got = att.from_text(text[:cut])
                if got is NEED_MORE:
                    assert not seen_key, "decidability must be monotone"
                    continue
                assert got is not None and got.key == want
                seen_key = True
            assert seen_key


_content = st.text(
    st.characters(blacklist_categories=["Cs"], blacklist_characters="<|"), min_size=1
).filter(lambda s: s.strip() == s)


@settings(max_examples=60, deadline=None)
@given(system=st.none() | _content, user=_content, max_len=st.integers(1, 64))
def test_property_chatml_and_llama(system: str | None, user: str, max_len: int) -> None:
    msgs = [{"role": "user", "content": user}]
    if system is not None:
        msgs.insert(0, {"role": "system", "content": system})
    body = {"model": "m", "messages": msgs}
    want = extract_prefix_key(body, max_prefix_length=max_len)
    for style, template in (("chatml", CHATML), ("llama3", LLAMA3), ("llama3.1", LLAMA3)):
        att = Attributor(model="m", template=template, backend="b", max_prefix_length=max_len)
        got = att.from_text(render(body, style))
        assert got is not None and got is not NEED_MORE and got.key == want, style


def test_locate_anchor_edges() -> None:
    assert locate_anchor("plain completion prompt", CHATML).kind == "no_anchor"
    cut = "<|im_start|>system\nunfinished"
    assert locate_anchor(cut, CHATML).kind == "need_more"
    assert locate_anchor(cut, CHATML, complete=True).kind == "no_anchor"
    # A trailing partial end marker is not content.
    assert locate_anchor(cut + "<|im_e", CHATML, max_prefix_length=10).content == "unfinished"
    assert locate_anchor(cut + "<|im_e", CHATML, max_prefix_length=11).kind == "need_more"
    # A partial Llama 3.1 preamble cannot be decided yet.
    half = "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nCutting Know"
    assert locate_anchor(half, LLAMA3, max_prefix_length=4).kind == "need_more"
    # Marker templates see system and user turns only.
    mistralish = marker_template("[SYS]", "[INST]", "[/INST]", bos=("<s>",))
    found = locate_anchor("<s>[INST]question[/INST]answer</s>[INST]more[/INST]", mistralish)
    assert (found.kind, found.tag, found.content) == ("found", "M", "question")
    found = locate_anchor("<s>[SYS]rules[/INST][INST]q[/INST]", mistralish)
    assert (found.tag, found.content) == ("S", "rules")
    with pytest.raises(ValueError):
        ChatTemplate(name="x", end="</s>")


def test_default_system_prompt_is_absent_but_a_real_one_counts() -> None:
    default = QWEN2_5.default_system_prompt
    assert default is not None
    text = f"<|im_start|>system\n{default}<|im_end|>\n<|im_start|>user\nhello<|im_end|>"
    found = locate_anchor(text, QWEN2_5)
    assert (found.tag, found.content) == ("M", "hello")
    # A prefix of the default prompt cannot be decided even past max_prefix_length.
    assert locate_anchor(text[:40], QWEN2_5, max_prefix_length=5).kind == "need_more"
    other = text.replace(default, default + " Also be brief.")
    assert locate_anchor(other, QWEN2_5).tag == "S"


def test_request_bodies_are_json_serialisable() -> None:
    """Guard: the fixtures above are what a client would really send."""
    for body in REQUESTS.values():
        assert orjson.loads(orjson.dumps(body)) == body


def test_several_templates_are_tried_in_order() -> None:
    """Config leaves ``chat_template`` unset: try ChatML, then Llama 3."""
    att = Attributor(model="m", template=(CHATML, LLAMA3), backend="b")
    for name in ("openai_system", "anthropic_no_system", "non_ascii"):
        body = REQUESTS[name]
        att.model = body["model"]
        for style in ("chatml", "llama3", "llama3.1"):
            got = att.from_text(render(body, style))
            assert got is not None and got is not NEED_MORE
            assert got.key == extract_prefix_key(body), (name, style)
    assert att.from_text("<|begin_of_text|><|start_header_id|>sys") is NEED_MORE
    assert att.from_text("neither template") is None
