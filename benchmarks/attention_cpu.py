"""Paged attention and KV writes on CPU: formulations, page sizes, KV blocks, cache layout.

    python benchmarks/attention_cpu.py            # everything (a few minutes on 2 cores)
    python benchmarks/attention_cpu.py decode     # one section: decode pagesize block prefill
                                                  # write layout

SmolLM2-135M shapes: 9 query heads, 3 KV heads, head_dim 64, 30 layers, f32. Every timed
function runs all 30 layers, each over its own cache (so K/V come from memory, not a warm
cache, as in a real step); figures are per layer. Variants are timed round-robin in one
process and the minimum is reported (the median beside it): this VM drifts by tens of
percent, so only compare numbers printed by the same run.
"""

from __future__ import annotations

import functools
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.attention import xla
from jaxinfer.engine import kv_cache as kvc

H, KVH, D, LAYERS = 9, 3, 64, 30
G = H // KVH
NEG = -jnp.inf


def timed(fns: dict, args, rounds: int = 6, per: int = 2, scale: float = 1.0 / LAYERS) -> dict:
    """Round-robin timing; prints and returns {name: (min, median)} in ms (per layer).

    ``args`` is shared, or a dict giving each name its own arguments."""
    argd = args if isinstance(args, dict) else {k: args for k in fns}
    for k, f in fns.items():
        jax.block_until_ready(f(*argd[k]))
    ts = {k: [] for k in fns}
    for _ in range(rounds):
        for k, f in fns.items():
            for _ in range(per):
                t = time.perf_counter()
                jax.block_until_ready(f(*argd[k]))
                ts[k].append((time.perf_counter() - t) * 1e3 * scale)
    res = {k: (min(v), float(np.median(v))) for k, v in ts.items()}
    for k, (mn, med) in res.items():
        print(f"  {k:44s} {mn:8.3f} ms   (median {med:.3f})", flush=True)
    return res


def make_decode(S=32, lens=(320, 448), max_pages=32, ps=16, seed=0, dtype=jnp.float32):
    """S decode sequences with kv_len uniform in ``lens`` (mean ~384), pages shuffled."""
    rng = np.random.default_rng(seed)
    kv_lens = rng.integers(lens[0], lens[1], S).astype(np.int32)
    need = -(-kv_lens // ps)
    n = 1 + int(need.sum())
    perm = rng.permutation(np.arange(1, n)).astype(np.int32)
    pt = np.zeros((S, max_pages), np.int32)
    i = 0
    for s in range(S):
        pt[s, :need[s]] = perm[i:i + need[s]]
        i += need[s]
    ks = [jnp.asarray(rng.standard_normal((n, ps, KVH, D), np.float32), dtype) for _ in range(LAYERS)]
    vs = [jnp.asarray(rng.standard_normal((n, ps, KVH, D), np.float32), dtype) for _ in range(LAYERS)]
    q = jnp.asarray(rng.standard_normal((S, H, D), np.float32))
    real = int(kv_lens.sum()) * KVH * D * jnp.dtype(dtype).itemsize * 2
    return (q, ks, vs, jnp.asarray(kv_lens), jnp.ones(S, jnp.int32), jnp.asarray(pt)), real


def over_layers(attn):
    """jit(q, ks, vs, kv_lens, q_lens, pt): 30 layers, each layer's output feeds the next q."""

    @jax.jit
    def f(q, ks, vs, kv_lens, q_lens, pt):
        for k, v in zip(ks, vs):
            q = attn(q, k, v, kv_lens, q_lens, pt).astype(q.dtype)
        return q

    return f


def engine_decode(q, k, v, kv_lens, q_lens, pt, **kw):
    return xla.ragged_paged_attention(q, k, v, kv_lens, q_lens, pt, num_decode=q.shape[0],
                                      prefill_chunk=0, sm_scale=D ** -0.5, **kw)


def cpp_attention():
    """The C++ kernel's ragged_paged_attention (pallas_kernels/attention/cpu.py), or None
    where it cannot be built (the reason is printed)."""
    from pallas_kernels.attention import cpu as cpu_attention
    if not cpu_attention.available():
        print(f"  (C++ kernel unavailable: {cpu_attention.unavailable_reason()})")
        return None
    return cpu_attention.ragged_paged_attention


def cpp_decode(q, k, v, kv_lens, q_lens, pt):
    return cpp_attention()(q, k, v, kv_lens, q_lens, pt, num_decode=q.shape[0],
                           prefill_chunk=0, sm_scale=D ** -0.5)


# --- alternative decode formulations (what the engine's choice was measured against) -------

def naive_decode(q, k, v, kv_lens, q_lens, pt):
    """Gather every page of every sequence, dense einsums over [S, L, KVH, D]."""
    S, P = pt.shape
    L = P * k.shape[1]
    kg, vg = k[pt].reshape(S, L, KVH, D), v[pt].reshape(S, L, KVH, D)
    s = jnp.einsum("skgd,slkd->skgl", q.reshape(S, KVH, G, D), kg) * D ** -0.5
    ok = jnp.arange(L)[None, :] < kv_lens[:, None]
    s = jnp.where(ok[:, None, None], s, NEG)
    p = jax.nn.softmax(s, axis=-1)
    vg = jnp.where(ok[:, :, None, None], vg, 0.0)
    return jnp.einsum("skgl,slkd->skgd", p, vg).reshape(S, H, D)


def blocked_decode(q, k, v, kv_lens, q_lens, pt, *, form: str, blk: int = xla.KV_BLOCK):
    """The engine's block loop with another per-block formulation, gathering whole pages
    (the engine gathers token rows, see xla._gather_block):

    kT_vT   K gathered to [S,KVH,D,blk], V to [S,KVH,blk,D] (the engine's layout)
    nt      K and V both gathered to [S,KVH,blk,D]; scores 'skmd,sknd' (K transposed in the dot)
    natural no transposes: dots over the gathered [S,blk,KVH,D] ('skmd,snkd', XLA transposes)
    waste   [S,blk*KVH,D] as one GEMM operand per sequence, all 9 heads against all 3 KV
            heads (3x the flops), the off-head scores masked away
    """
    S, P = pt.shape
    ps = k.shape[1]
    ppb = blk // ps
    nb = -(-P // ppb)
    ptb = jnp.pad(pt, ((0, 0), (0, nb * ppb - P))).reshape(S, nb, ppb)
    qk = q.reshape(S, KVH, G, D) * D ** -0.5
    own = (jnp.arange(H)[:, None] // G) == jnp.arange(KVH)[None, :]          # [H, KVH]

    def body(b, c):
        m, l, acc = c
        pages = jax.lax.dynamic_index_in_dim(ptb, b, 1, keepdims=False)
        ok = (b * blk + jnp.arange(blk))[None, :] < kv_lens[:, None]        # [S, blk]
        kb = k[pages].reshape(S, blk, KVH, D)
        vb = jnp.where(ok[:, :, None, None], v[pages].reshape(S, blk, KVH, D), 0.0)
        if form == "waste":
            s = jnp.einsum("shd,snd->shn", qk.reshape(S, H, D), kb.reshape(S, blk * KVH, D))
            s = s.reshape(S, H, blk, KVH)
            s = jnp.where(own[None, :, None, :] & ok[:, None, :, None], s, NEG)
            s = s.reshape(S, KVH, G, blk * KVH)
        else:
            if form == "kT_vT":
                s = jnp.einsum("skmd,skdn->skmn", qk, kb.transpose(0, 2, 3, 1))
            elif form == "nt":
                s = jnp.einsum("skmd,sknd->skmn", qk, kb.transpose(0, 2, 1, 3))
            else:
                s = jnp.einsum("skmd,snkd->skmn", qk, kb)
            s = jnp.where(ok[:, None, None, :], s, NEG)
        mn = jnp.maximum(m, s.max(-1))
        safe = jnp.where(mn == NEG, 0.0, mn)
        p = jnp.exp(s - safe[..., None])
        a = jnp.exp(m - safe)
        l = l * a + xla._tree_sum(p)
        if form == "waste":
            pv = jnp.einsum("shn,snd->shd", p.reshape(S, H, blk * KVH), vb.reshape(S, blk * KVH, D))
            pv = pv.reshape(S, KVH, G, D)
        elif form == "natural":
            pv = jnp.einsum("skmn,snkd->skmd", p, vb)
        else:
            pv = jnp.einsum("skmn,sknd->skmd", p, vb.transpose(0, 2, 1, 3))
        return mn, l, acc * a[..., None] + pv

    init = (jnp.full((S, KVH, G), NEG), jnp.zeros((S, KVH, G)), jnp.zeros((S, KVH, G, D)))
    hi = (jnp.max(kv_lens) + blk - 1) // blk
    m, l, acc = jax.lax.fori_loop(0, hi, body, init)
    return (acc / l[..., None]).reshape(S, H, D)


def section_decode():
    print("\n== decode: 32 sequences, kv_len 320..447 (mean ~384), page 16, table 32 pages "
          "(512 tokens), per layer ==")
    args, real = make_decode()
    fns = {"engine (xla.ragged_paged_attention)": over_layers(engine_decode)}
    if cpp_attention() is not None:
        fns["C++ kernel (cpu_attention)"] = over_layers(cpp_decode)
    for form in ("kT_vT", "nt", "natural", "waste"):
        fns[f"blocked, per-block form {form}"] = over_layers(functools.partial(blocked_decode, form=form))
    fns["naive: gather all pages + dense einsum"] = over_layers(naive_decode)
    outs = {k: f(*args) for k, f in fns.items()}
    base = outs["naive: gather all pages + dense einsum"]
    for k, o in outs.items():
        err = float(jnp.max(jnp.abs(o - base)))
        assert err < 1e-4, (k, err)
    res = timed(fns, args)
    for name in ("engine (xla.ragged_paged_attention)", "C++ kernel (cpu_attention)"):
        if name in res:
            print(f"  real K+V bytes per layer {real / 1e6:.1f} MB -> {name} streams "
                  f"{real / res[name][0] / 1e6:.1f} GB/s")
    eng = fns["engine (xla.ragged_paged_attention)"]
    timed({"engine, f32 cache": eng, "engine, bf16 cache": eng},
          {"engine, f32 cache": args, "engine, bf16 cache": make_decode(dtype=jnp.bfloat16)[0]})
    sums = jax.jit(lambda ks, vs: [k.sum() + v.sum() for k, v in zip(ks, vs)])
    timed({"floor: reduce-sum of each layer's whole K and V": lambda *a: sums(a[1], a[2])}, args)


def section_pagesize():
    print("\n== decode, page size (same sequences, same 512-token table width) ==")
    f = over_layers(engine_decode)
    argd = {f"page_size {ps}": make_decode(ps=ps, max_pages=512 // ps)[0] for ps in (16, 32, 64)}
    timed({k: f for k in argd}, argd)


def section_block():
    print("\n== decode, KV block (tokens reduced per step of the online softmax) ==")
    print("  (below 64 XLA:CPU's dot sums head_dim in another order for a few rows than for"
          " many, so decode and prefill bits of a token would differ: see pallas_kernels/attention/xla.py)")
    args, _ = make_decode()
    fns = {}
    for blk in (32, 64, 128, 256, 512):
        def attn(q, k, v, kv_lens, q_lens, pt, blk=blk):
            qd = q.reshape(q.shape[0], 1, H, D)
            return xla._attend_slots(qd, k, v, kv_lens, q_lens, pt, sm_scale=D ** -0.5,
                                     sliding_window=None, soft_cap=None, kv_block=blk).reshape(q.shape)
        note = {32: " (not batch invariant: rejected)", xla.KV_BLOCK: " [engine]"}.get(blk, "")
        fns[f"KV block {blk}{note}"] = over_layers(attn)
    timed(fns, args)


def section_prefill():
    print("\n== prefill: one fresh chunk against its own pages, by query block, per layer ==")
    rng = np.random.default_rng(1)
    for C in (256, 512):
        n = 1 + C // 16 + 1
        k = [jnp.asarray(rng.standard_normal((n, 16, KVH, D), np.float32)) for _ in range(LAYERS)]
        v = [jnp.asarray(rng.standard_normal((n, 16, KVH, D), np.float32)) for _ in range(LAYERS)]
        pt = jnp.asarray(np.arange(1, 1 + C // 16, dtype=np.int32)[None])
        q = jnp.asarray(rng.standard_normal((C, H, D), np.float32))
        kv = jnp.asarray([C], jnp.int32)
        fns = {}
        for qb in (64, 128, 256, C):
            if qb > C:
                continue

            def attn(q, k, v, kv_lens, q_lens, pt, C=C, qb=qb):
                o = xla._attend_slots(q.reshape(1, C, H, D), k, v, kv_lens, q_lens, pt,
                                      sm_scale=D ** -0.5, sliding_window=None, soft_cap=None,
                                      q_block=qb)
                return o.reshape(C, H, D)
            tag = " [engine]" if qb == min(C, xla.Q_BLOCK) else ""
            fns[f"chunk {C}, query block {qb}{tag}"] = over_layers(attn)
        if cpp_attention() is not None:
            fns[f"chunk {C}, C++ kernel"] = over_layers(
                lambda q, k, v, kv_lens, q_lens, pt, C=C: cpp_attention()(
                    q, k, v, kv_lens, q_lens, pt, num_decode=0, prefill_chunk=C, sm_scale=D ** -0.5))
        res = timed(fns, (q, k, v, kv, kv, pt))
        flops = 4 * C * C * H * D / 2          # causal half of QK^T and PV
        best = min(r[0] for r in res.values())
        print(f"    best: {flops / best / 1e6:.1f} GFLOP/s on the causal half")


def section_write():
    print("\n== write_kv: 32 new tokens into a donated cache (one layer), vs cache size ==")
    rng = np.random.default_rng(2)
    kn = jnp.asarray(rng.standard_normal((32, KVH, D), np.float32))
    f = jax.jit(kvc.write_kv, donate_argnums=(0, 1))
    for pages in (1024, 8192, 32768):
        k = jnp.zeros((pages, 16, KVH, D))
        v = jnp.zeros((pages, 16, KVH, D))
        slots = jnp.asarray(rng.choice(pages * 16, 32, replace=False).astype(np.int32))
        k, v = f(k, v, kn, kn, slots)
        ts = []
        for _ in range(30):
            t = time.perf_counter()
            k, v = f(k, v, kn, kn, slots)
            jax.block_until_ready(k)
            ts.append((time.perf_counter() - t) * 1e3)
        mb = 2 * k.size * 4 / 1e6
        print(f"  cache {mb:7.0f} MB (K+V): {min(ts):.3f} ms (median {np.median(ts):.3f})"
              f" - a copy would take ~{mb / 10:.0f} ms at 10 GB/s", flush=True)


def section_layout():
    print("\n== cache layout in a 30-layer step: write 32 tokens + decode attention, per layer ==")
    args, _ = make_decode()
    q, ks, vs, kv_lens, q_lens, pt = args
    slots = jnp.asarray((np.asarray(pt)[:, 0] * 16 + 15).astype(np.int32))
    kn = jnp.asarray(np.random.default_rng(3).standard_normal((32, KVH, D), np.float32))

    def attn_only(q, cache, kv_lens, q_lens, pt, slots, kn):
        for k, v in cache:
            q = engine_decode(q, k, v, kv_lens, q_lens, pt)
        return q, cache

    def step_list(q, cache, kv_lens, q_lens, pt, slots, kn):
        out = []
        for k, v in cache:
            k, v = kvc.write_kv(k, v, kn, kn, slots)
            q = engine_decode(q, k, v, kv_lens, q_lens, pt)
            out.append((k, v))
        return q, out

    def write_stacked(K, i, slots, kn):
        L, N, ps = K.shape[:3]
        return K.reshape(L, N * ps, KVH, D).at[i, slots].set(kn).reshape(K.shape)

    def step_stacked(q, cache, kv_lens, q_lens, pt, slots, kn):
        K, V = cache
        for i in range(LAYERS):
            K, V = write_stacked(K, i, slots, kn), write_stacked(V, i, slots, kn)
            q = engine_decode(q, K[i], V[i], kv_lens, q_lens, pt)
        return q, (K, V)

    def step_scan(q, cache, kv_lens, q_lens, pt, slots, kn):
        def body(q, kv):
            k, v = kvc.write_kv(kv[0], kv[1], kn, kn, slots)
            return engine_decode(q, k, v, kv_lens, q_lens, pt), (k, v)
        return jax.lax.scan(body, q, cache)

    as_list = lambda: [(k + 0, v + 0) for k, v in zip(ks, vs)]         # noqa: E731
    as_stack = lambda: (jnp.stack(ks), jnp.stack(vs))                  # noqa: E731
    for name, fn, make in (("attention only (no write), list", attn_only, as_list),
                           ("list of (k, v) per layer [engine]", step_list, as_list),
                           ("stacked [L, ...], static layer index", step_stacked, as_stack),
                           ("stacked [L, ...], lax.scan over layers", step_scan, as_stack)):
        f = jax.jit(fn, donate_argnums=(1,))
        cache = make()
        q2, cache = f(q, cache, kv_lens, q_lens, pt, slots, kn)
        ts = []
        for _ in range(8):
            t = time.perf_counter()
            q2, cache = f(q, cache, kv_lens, q_lens, pt, slots, kn)
            jax.block_until_ready(q2)
            ts.append((time.perf_counter() - t) * 1e3 / LAYERS)
        print(f"  {name:44s} {min(ts):8.3f} ms   (median {np.median(ts):.3f})", flush=True)
        del cache


SECTIONS = {"decode": section_decode, "pagesize": section_pagesize, "block": section_block,
            "prefill": section_prefill, "write": section_write, "layout": section_layout}

if __name__ == "__main__":
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; figures are ms per layer")
    for name in sys.argv[1:] or SECTIONS:
        SECTIONS[name]()
