"""What the fixed-order arithmetic that makes logprobs batch-invariant costs.

Three changes (issue 24): RMSNorm's mean and the sampler's log-sum-exp sum through
``jaxinfer.reductions.row_sum`` (a fixed pairwise tree) instead of XLA's reductions, and
the rope's ``x * cos + rotated * sin`` keeps its two products apart so XLA:CPU cannot
contract one of them into an FMA. This script times the old and the new form IN THE SAME
PROCESS, alternating: the ops alone (jitted, median of many calls), then decode steps of
the default model (two engines, one traced with the old functions patched in).

    python benchmarks/fixed_order_cost.py [--tokens 48] [--batch 1 8]
"""

from __future__ import annotations

import argparse
import statistics
import time
from contextlib import contextmanager

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.engine import sampler as S
from jaxinfer.models import layers as L


def old_rms_norm(x, weight, eps):
    x32 = x.astype(jnp.float32)
    var = jnp.mean(x32 * x32, axis=-1, keepdims=True)
    return weight * (x32 * jax.lax.rsqrt(var + eps)).astype(x.dtype)


def old_apply_rope(x, cos, sin):
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    c, s = cos[:, None, :].astype(x.dtype), sin[:, None, :].astype(x.dtype)
    return x * c + rotated * s


OLD = {(L, "rms_norm"): old_rms_norm, (L, "apply_rope"): old_apply_rope,
       (S, "row_sum"): lambda x: jnp.sum(x, axis=-1)}


@contextmanager
def old_functions():
    """Patch the pre-change forms in (they are looked up at trace time)."""
    saved = {k: getattr(*k) for k in OLD}
    for (mod, name), fn in OLD.items():
        setattr(mod, name, fn)
    try:
        yield
    finally:
        for (mod, name), fn in saved.items():
            setattr(mod, name, fn)


def time_call(f, *args, reps: int = 200) -> float:
    """Median microseconds of f(*args) (jitted, compiled by a first call)."""
    jax.block_until_ready(f(*args))
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e6


def ops() -> list[tuple[str, float, float]]:
    rng = np.random.default_rng(0)
    rows = []
    w = jnp.asarray(rng.normal(size=576).astype(np.float32))
    for t in (1, 32, 512):
        x = jnp.asarray(rng.normal(size=(t, 576)).astype(np.float32))
        old = jax.jit(lambda a: old_rms_norm(a, w, 1e-5))
        new = jax.jit(lambda a: L.rms_norm(a, w, 1e-5))
        rows.append((f"rms_norm [{t}, 576]", time_call(old, x), time_call(new, x)))
    for b in (1, 32):
        x = jnp.asarray(rng.normal(size=(b, 49152)).astype(np.float32))

        def lse(a, total):
            m = jnp.max(a, axis=-1)
            return m + jnp.log(total(jnp.exp(a - m[:, None])))
        old = jax.jit(lambda a: lse(a, lambda e: jnp.sum(e, axis=-1)))
        new = jax.jit(lambda a: lse(a, S.row_sum))
        rows.append((f"log-sum-exp [{b}, 49152]", time_call(old, x, reps=50), time_call(new, x, reps=50)))
    inv = (1.0 / 10000 ** (np.arange(0, 64, 2) / 64)).astype(np.float32)
    for t in (1, 32, 512):
        q = jnp.asarray(rng.normal(size=(t, 9, 64)).astype(np.float32))
        pos = jnp.arange(1, t + 1, dtype=jnp.int32)

        def rope(a, p, fn):
            c, s = L.rope_cos_sin(p, inv)
            return fn(a, c, s)
        old = jax.jit(lambda a, p: rope(a, p, old_apply_rope))
        new = jax.jit(lambda a, p: rope(a, p, L.apply_rope))
        rows.append((f"rope q [{t}, 9, 64]", time_call(old, q, pos), time_call(new, q, pos)))
    return rows


def decode_steps(batches: list[int], tokens: int) -> list[tuple[str, float, float]]:
    from jaxinfer import Engine
    from jaxinfer.sampling_params import SamplingParams
    from jaxinfer.loading import load_model

    loaded = load_model(None, "float32")
    kw = dict(max_num_seqs=max(batches), max_num_batched_tokens=256, max_model_len=256,
              num_pages=max(batches) * 16 + 8, warmup="full", decode_buckets=tuple(sorted(set(batches))),
              mixed_decode_buckets=(0, max(batches)), prefill_buckets=((1, 32),), page_buckets=(16,))
    with old_functions():
        old = Engine(loaded=loaded, progress=False, **kw)
    new = Engine(loaded=loaded, progress=False, **kw)
    prompt = loaded.tokenizer.encode("The history of the printing press begins")
    p = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True, logprobs=2)

    def ms_per_decode_step(eng, b) -> float:
        for i in range(b):
            eng.add_request(prompt + [i + 3], p)
        ts = []
        while eng.has_unfinished():
            t0 = time.perf_counter()
            eng.step()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts[4:]) * 1e3      # past the prefill steps

    rows = []
    for b in batches:
        ms = {"old": [], "new": []}
        for _ in range(3):                          # alternating, first round warms up
            with old_functions():                   # buckets compiled on first use, too
                ms["old"].append(ms_per_decode_step(old, b))
            ms["new"].append(ms_per_decode_step(new, b))
        rows.append((f"decode step, batch {b} (ms)", min(ms["old"][1:]), min(ms["new"][1:])))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=48, help="new tokens per request")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8], help="decode batch sizes")
    args = ap.parse_args()
    print("| what | old | fixed order | new / old |\n|---|---|---|---|")
    for name, old, new in ops():
        print(f"| {name} (us) | {old:.1f} | {new:.1f} | {new / old:.2f} |")
    for name, old, new in decode_steps(args.batch, args.tokens):
        print(f"| {name} | {old:.2f} | {new:.2f} | {new / old:.2f} |")


if __name__ == "__main__":
    main()
