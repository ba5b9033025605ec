"""Simulated LLM inference engines for tests, benchmarks and the demo.

Kept import-light on purpose: ``python -m harness.sim`` start-up time is paid by every test that
spawns a fleet, so nothing heavy is imported here. Use the submodules directly:
``harness.sim.fleet.SimFleet``, ``harness.sim.engine.SimEngine``, ``harness.sim.httpserver.serve``.

KV-event engine features (``--tokenizer qwen2``, ``--kv-events``, ``--kv-events-trtllm``):
``harness.sim.tokenizer`` / ``prompt`` (tokenizers, ChatML), ``block_hash`` (engine block
hashes), ``kv_wire`` (byte-exact vLLM/SGLang msgpack), ``kv_events`` (ZMQ publisher with
replay, trtllm queue, burst mode).
"""
