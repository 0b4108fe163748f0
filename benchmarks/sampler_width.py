"""What a wide sampler costs when few rows are real (EngineConfig.min_sampler_rows).

* ``micro``: the sampler executable alone (runner.sample_fn), vocabulary 49152 (the
  default model's), one real row padded to widths 1 / 4 / 16 / 32, greedy and sampled:
  compile seconds and the mean of 50 calls.
* ``engine``: the default model on the default ladder (max_num_seqs 64: widths up to 128),
  batch-1 decode of 96 tokens with ``min_sampler_rows`` 1 (one sampler per power of two)
  vs the default None (one sampler of the widest width; the forwards write their rows
  into it in place), greedy and sampled, engines alternating (5 reps): tok/s and whether
  the tokens are the same.

    python benchmarks/sampler_width.py [micro] [engine]
"""

from __future__ import annotations

import sys
import time

import numpy as np


def micro() -> None:
    import jax
    import jax.numpy as jnp

    from jaxinfer.sampling_params import SamplingParams
    from jaxinfer.engine import runner as R
    from jaxinfer.engine import sampler as S
    from jaxinfer.engine.guided import empty_mask
    from jaxinfer.engine.resources import compiler_options

    V = 49152
    base = np.random.default_rng(0).normal(size=(32, V)).astype(np.float32) * 3
    for W in (1, 4, 16, 32):
        logits = jnp.asarray(base[:W])
        pen = (jnp.zeros((W, V), bool), jnp.zeros((W, V), jnp.int32))
        rows = jnp.arange(W, dtype=jnp.int32)
        m = empty_mask(W, V)
        mask = S.TokenMask(*(jnp.asarray(x) for x in (m.bits, m.bias_ids, m.bias_vals, m.active)))
        compiled = None
        for kind, sp in (("greedy", SamplingParams(temperature=0)),
                         ("sampled", SamplingParams(temperature=0.8, top_p=0.9, seed=3))):
            t = S.sampling_tensors_from_params([sp], [5], [0], W)
            if compiled is None:
                t0 = time.perf_counter()
                compiled = jax.jit(R.sample_fn).lower(logits, pen, rows, t, mask).compile(compiler_options())
                print(f"width {W:2d}: compile {time.perf_counter() - t0:.2f} s", flush=True)
            for _ in range(3):
                compiled(logits, pen, rows, t, mask).block_until_ready()
            t0 = time.perf_counter()
            for _ in range(50):
                compiled(logits, pen, rows, t, mask).block_until_ready()
            print(f"width {W:2d}, 1 real row, {kind:7s}: {(time.perf_counter() - t0) / 50 * 1e3:.2f} ms", flush=True)


def engine() -> None:
    from jaxinfer.sampling_params import SamplingParams
    from jaxinfer.engine.engine import Engine
    from jaxinfer.loading import load_model

    loaded = load_model(None, "float32")
    prompt = loaded.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Write a short story about a lighthouse keeper."}], add_generation_prompt=True)
    engines = {m: Engine(loaded=loaded, progress=False, min_sampler_rows=m, warmup="full") for m in (1, None)}
    print({m: len(e.runner.samplers) for m, e in engines.items()}, "sampler executables", flush=True)
    n, rates, tokens = 96, {}, {}
    for _ in range(5):
        for kind, sp in (("greedy", SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)),
                         ("sampled", SamplingParams(temperature=0.8, top_p=0.95, seed=1, max_tokens=n,
                                                    ignore_eos=True))):
            for m, e in engines.items():
                e.generate([prompt], SamplingParams(temperature=0, max_tokens=2))
                t0 = time.perf_counter()
                tokens[kind, m] = e.generate([prompt], sp)[0].outputs[0].token_ids
                rates.setdefault((kind, m), []).append(n / (time.perf_counter() - t0))
    for kind in ("greedy", "sampled"):
        a, b = np.median(rates[kind, 1]), np.median(rates[kind, None])
        print(f"{kind}: min_sampler_rows 1 {a:.1f} tok/s, default (one width) {b:.1f} tok/s ({b / a:.3f}x); "
              f"same tokens: {tokens[kind, 1] == tokens[kind, None]}", flush=True)


if __name__ == "__main__":
    which = sys.argv[1:] or ["micro", "engine"]
    for name in which:
        {"micro": micro, "engine": engine}[name]()
