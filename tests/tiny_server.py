"""The serving tests' real engine: a tiny random-weight Llama (2 layers, hidden 64, the
default model's tokenizer) behind the real ``AsyncEngine``, with a small bucket ladder, so
it compiles in seconds and every test module that uses ``ENGINE_KW`` shares one set of
executables through the session's compilation cache (tests/conftest.py).

Run as a script it serves one the way ``jaxinfer serve`` does (``run_server``: guarded
uvicorn, graceful SIGTERM), for tests that need a server process of their own:

    python tests/tiny_server.py --port 8123 [--shutdown-timeout 10] [--compile-cache DIR] [--step-delay S]
                                [--lose-device-at-step N]
"""

from __future__ import annotations

import argparse
import time
from typing import Any

# Small ladders: a handful of executables (decode 4 rows, mixed 0/4 decodes + one 32-token
# prefill chunk, pages per sequence up to 8 of 16 tokens).
ENGINE_KW = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128, num_pages=32,
                 page_buckets=(8,), min_sampler_rows=16, decode_buckets=(4,), mixed_decode_buckets=(0, 4),
                 prefill_buckets=((1, 32),))
MODEL_NAME = "tiny-random-llama"


def tiny_async_engine(**engine_kw: Any):
    """-> AsyncEngine over the tiny model (``ENGINE_KW`` updated by ``engine_kw``); skips the
    test when the default model (for its tokenizer) is not installed."""
    import pytest
    from flax import nnx

    from jaxinfer.models.config import ModelConfig
    from jaxinfer.engine.async_engine import AsyncEngine
    from jaxinfer.engine.engine import Engine
    from jaxinfer.loading import LoadedModel
    from jaxinfer.loading.default import default_model_path
    from jaxinfer.loading.gguf import open_gguf
    from jaxinfer.loading.tokenizer import Tokenizer
    from jaxinfer.models.llama import LlamaForCausalLM

    try:
        tok = Tokenizer.from_gguf_reader(open_gguf(default_model_path()))
    except FileNotFoundError as e:
        pytest.skip(str(e))
    cfg = ModelConfig(architecture="LlamaForCausalLM", vocab_size=len(tok), hidden_size=64,
                      intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                      max_position_embeddings=256, tie_word_embeddings=True,
                      eos_token_ids=tuple(tok.eos_token_ids))
    loaded = LoadedModel(cfg, LlamaForCausalLM(cfg, rngs=nnx.Rngs(0)), tok, {}, MODEL_NAME)
    return AsyncEngine(Engine(loaded=loaded, progress=False, **{**ENGINE_KW, **engine_kw}))


def device_loss(engine: Any, at_step: int):
    """An Engine.fault_hook: the ``at_step``-th scheduled step finds its KV pages gone."""
    import jax

    seen = [0]

    def hook(sched: Any) -> None:
        seen[0] += 1
        if seen[0] == at_step:
            for x in jax.tree.leaves(engine.runner.kv):
                x.delete()
            raise RuntimeError("simulated device loss")
    return hook


def main() -> int:
    ap = argparse.ArgumentParser(description="Serve the tiny test model (tests only).")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--shutdown-timeout", type=float, default=10.0)
    ap.add_argument("--compile-cache", help="JAX compilation cache directory to share")
    ap.add_argument("--step-delay", type=float, default=0.0,
                    help="seconds added to every engine step, so requests stay in flight a while")
    ap.add_argument("--lose-device-at-step", type=int, default=0,
                    help="the Nth scheduled step deletes the KV pages and raises, as a device lost "
                         "in the middle of a step would (the engine must die and the server exit 1)")
    args = ap.parse_args()
    if args.compile_cache:
        from jaxinfer.engine.resources import enable_compilation_cache

        enable_compilation_cache(args.compile_cache)
    from serving.server import run_server

    def engine():
        aeng = tiny_async_engine()
        if args.step_delay:
            step = aeng.engine.step

            def slow_step(*a, **kw):
                time.sleep(args.step_delay)
                return step(*a, **kw)
            aeng.engine.step = slow_step
        if args.lose_device_at_step:
            aeng.engine.fault_hook = device_loss(aeng.engine, args.lose_device_at_step)
        return aeng

    return run_server(engine, port=args.port, shutdown_timeout=args.shutdown_timeout,
                      log_level="warning", access_log=False)


if __name__ == "__main__":
    raise SystemExit(main())
