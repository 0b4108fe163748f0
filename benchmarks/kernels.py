"""Kernel benchmarks: our Pallas kernels against JAX's bundled ones, and the CPU quantized path.

    python benchmarks/kernels.py               # on a TPU / GPU: attention + quantized matmul
    python benchmarks/kernels.py --cpu-quant   # on CPU: f32 vs int8 vs int4 weights (XLA path)
                                               # and the int8 C++ kernel (jax.ffi), then --cpu-f32
    python benchmarks/kernels.py --cpu-f32     # on CPU: the f32 C++ kernel vs XLA's dot
    python benchmarks/kernels.py --cpu-f32-chain [--kernel-src old=DIR]
                                               # on CPU: the engine's panelled f32 matmuls
    python benchmarks/kernels.py --smoke tpu   # on CPU: the accelerator code, interpreted

On a TPU or GPU it times, on the same inputs:
  * attention: ``ragged_paged_attention_tpu`` vs ``jax.experimental.pallas.ops.tpu.
    ragged_paged_attention`` (TPU), ``ragged_paged_attention_gpu`` vs ``...ops.gpu.
    paged_attention`` (GPU, decode only: the bundled GPU kernel has no prefill), for decode
    batches and a mixed decode + prefill step;
  * quantized matmul: ``quantized_matmul_tpu/gpu`` int8 and int4, and XLA's path
    (``quantized_matmul_xla``, what the engine uses on GPU), vs a plain bf16 dot;
and reports achieved memory bandwidth (bytes that must cross HBM / time) as a fraction of
the chip's peak (table below, by ``device_kind``).

On CPU it says that it needs an accelerator and exits 0, unless ``--cpu-quant``: then it
times ``quantized_matmul_xla`` at SmolLM2-135M's shapes against f32 weights. Each timed
function chains many distinct weight matrices (so weights stream from DRAM, not L3), and
the "decode pass" runs every matmul of one SmolLM2 decode step (30 layers x 7 + the LM
head) for a weight-streaming bound on tokens/s. Variants are timed round-robin and the
minimum is reported: this VM drifts by tens of percent, compare within one run only.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from jaxinfer import matmul as routing  # noqa: E402
from pallas_kernels.f32_matmul import cpu as cpu_f32_matmul  # noqa: E402
from pallas_kernels.quantized_matmul import cpu as cpu_matmul  # noqa: E402
from pallas_kernels.quantized_matmul.xla import (XLA_CPU_COMPILER_OPTIONS, quantize,  # noqa: E402
                                                 quantized_matmul_xla)

# Peak HBM bandwidth, bytes/s, by jax device_kind (substring match, first hit wins).
PEAK_BW = [("H200", 4.8e12), ("H100", 3.35e12), ("A100", 2.0e12), ("L4", 0.3e12),
           ("TPU v6", 1.64e12), ("TPU v5p", 2.76e12), ("TPU v5", 0.82e12),
           ("TPU v4", 1.2e12)]


def peak_bandwidth(kind: str) -> float | None:
    return next((bw for k, bw in PEAK_BW if k.lower() in kind.lower()), None)


def timed(fns: dict, args: dict, rounds: int = 8) -> dict:
    """Round-robin timing, returns {name: min seconds}."""
    for k, f in fns.items():
        jax.block_until_ready(f(*args[k]))
    best = {k: float("inf") for k in fns}
    for _ in range(rounds):
        for k, f in fns.items():
            t = time.perf_counter()
            jax.block_until_ready(f(*args[k]))
            best[k] = min(best[k], time.perf_counter() - t)
    return best


# ---------------------------------------------------------------------------------------
# Accelerator: attention
# ---------------------------------------------------------------------------------------

def _attention_inputs(rng, *, S, num_decode, chunk, kv_len, H, KVH, D, ps, dtype):
    need = -(-kv_len // ps)
    N = S * need + 1
    pt = (1 + np.arange(S * need, dtype=np.int32)).reshape(S, need)
    rng.shuffle(pt.reshape(-1))
    T = num_decode + (S - num_decode) * chunk
    q = jnp.asarray(rng.standard_normal((T, H, D)), dtype)
    k = jnp.asarray(rng.standard_normal((N, ps, KVH, D)), dtype)
    v = jnp.asarray(rng.standard_normal((N, ps, KVH, D)), dtype)
    q_lens = np.array([1] * num_decode + [chunk] * (S - num_decode), np.int32)
    kv_lens = np.full(S, kv_len, np.int32)
    return q, k, v, jnp.asarray(kv_lens), jnp.asarray(q_lens), jnp.asarray(pt)


ATTENTION_CONFIGS = [  # (label, S, num_decode, chunk, kv_len, H, KVH, D, page_size)
    ("decode b8 kv1024 smollm2", 8, 8, 0, 1024, 9, 3, 64, 16),
    ("decode b64 kv1024 smollm2", 64, 64, 0, 1024, 9, 3, 64, 16),
    ("decode b1 kv8192 8B-like", 1, 1, 0, 8192, 32, 8, 128, 16),
    ("decode b8 kv4096 8B-like", 8, 8, 0, 4096, 32, 8, 128, 16),
    ("decode b64 kv2048 8B-like", 64, 64, 0, 2048, 32, 8, 128, 16),
    ("mixed 16 dec + 2x256 prefill 8B-like", 18, 16, 256, 2048, 32, 8, 128, 16),
]
SMOKE_ATTENTION_CONFIGS = [
    ("smoke decode", 2, 2, 0, 40, 8, 2, 128, 16),     # bundled TPU: head_dim % 128 == 0
    ("smoke mixed", 3, 2, 16, 40, 8, 2, 128, 16),
]


def bench_attention(backend: str, peak: float | None, smoke: bool = False) -> None:
    """Times ours vs bundled (or, with ``smoke``, runs both interpreted on CPU on tiny
    inputs and prints their difference: a check of the adapters, not a timing)."""
    from pallas_kernels.attention.pallas import (ragged_paged_attention_gpu,
                                                       ragged_paged_attention_tpu)
    ours = ragged_paged_attention_tpu if backend == "tpu" else ragged_paged_attention_gpu
    rng = np.random.default_rng(0)
    print("\nattention (bf16)                        ours ms   bundled ms   ours GB/s  "
          "(% peak)  bundled GB/s")
    for label, S, nd, chunk, kv_len, H, KVH, D, ps in (SMOKE_ATTENTION_CONFIGS if smoke
                                                        else ATTENTION_CONFIGS):
        dt = jnp.bfloat16
        q, k, v, kvl, ql, pt = _attention_inputs(rng, S=S, num_decode=nd, chunk=chunk,
                                                 kv_len=kv_len, H=H, KVH=KVH, D=D, ps=ps,
                                                 dtype=dt)
        kw = dict(num_decode=nd, prefill_chunk=chunk, sm_scale=D ** -0.5)
        if smoke and backend == "gpu":
            kw["interpret"] = True
        fns = {"ours": functools.partial(ours, **kw)}
        args = {"ours": (q, k, v, kvl, ql, pt)}
        note = ""
        try:
            bundled = _bundled_attention(backend, q, k, v, kvl, ql, pt, nd, chunk, D, smoke)
            if bundled is None:
                note = "(bundled: no prefill on GPU)"
            else:
                fns["bundled"], args["bundled"] = bundled
                jax.block_until_ready(fns["bundled"](*args["bundled"]))
        except Exception as e:          # the bundled kernels reject some head counts
            fns.pop("bundled", None)
            note = f"(bundled: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:80]})"
        if smoke:
            outs = {k_: np.asarray(f(*args[k_]), np.float32) for k_, f in fns.items()}
            if "bundled" in outs:
                diff = float(np.max(np.abs(outs["ours"][:outs["bundled"].shape[0]] -
                                           outs["bundled"])))
                note = f"max |ours - bundled| = {diff:.3g}"
            print(f"  {label:36s} interpreted: {note}", flush=True)
            continue
        t = timed(fns, args)
        nbytes = (int(kvl.sum()) * KVH * D * 2 + 2 * q.size) * jnp.dtype(dt).itemsize
        bw = {k_: nbytes / v_ for k_, v_ in t.items()}
        frac = f"{100 * bw['ours'] / peak:5.1f}%" if peak else "  n/a"
        tb = f"{t['bundled'] * 1e3:9.3f}" if "bundled" in t else "      n/a"
        bb = f"{bw['bundled'] / 1e9:9.1f}" if "bundled" in bw else "      n/a"
        print(f"  {label:36s} {t['ours'] * 1e3:8.3f}   {tb}   {bw['ours'] / 1e9:9.1f}  {frac}  "
              f"{bb}  {note}", flush=True)


def _bundled_attention(backend, q, k, v, kv_lens, q_lens, pt, nd, chunk, D, interpret=False):
    """JAX's bundled kernel on the same data (its own layouts), or None where it does not
    cover the case."""
    S = pt.shape[0]
    if backend == "tpu":
        from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention
        N, ps, KVH, _ = k.shape
        kv = jnp.stack([k, v], axis=3).reshape(N, ps, 2 * KVH, D)   # k/v heads interleaved
        cu = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(q_lens)]).astype(jnp.int32)
        blocks = {}
        if interpret:       # its tuned block table asks for a real TPU's version
            blocks = dict(num_kv_pages_per_block=min(4, pt.shape[1]), num_queries_per_block=16)
        f = jax.jit(functools.partial(ragged_paged_attention, sm_scale=D ** -0.5, **blocks))
        return f, (q, kv, kv_lens, pt, cu, jnp.array([S], jnp.int32))
    if chunk:                                  # the bundled GPU kernel is decode-only
        return None
    from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention
    kh = jnp.transpose(k, (2, 0, 1, 3))         # [KVH, N, ps, D]
    vh = jnp.transpose(v, (2, 0, 1, 3))
    P = pt.shape[1]
    splits = next(s for s in (16, 8, 4, 2, 1) if P % s == 0)
    per_block = next(b for b in (8, 4, 2, 1) if (P // splits) % b == 0)
    f = jax.jit(functools.partial(paged_attention, k_splits=splits,
                                  pages_per_compute_block=per_block, interpret=interpret))
    # it applies no softmax scale: pre-scale q (outside the timed function's inputs)
    return f, ((q.astype(jnp.float32) * D ** -0.5).astype(q.dtype), kh, vh, pt, kv_lens)


# ---------------------------------------------------------------------------------------
# Accelerator: quantized matmul
# ---------------------------------------------------------------------------------------

def bench_quantized_matmul(backend: str, peak: float | None, smoke: bool = False) -> None:
    from pallas_kernels.quantized_matmul.pallas import quantized_matmul_gpu, quantized_matmul_tpu
    from pallas_kernels.quantized_matmul.xla import quantized_matmul_reference
    ours = quantized_matmul_tpu if backend == "tpu" else quantized_matmul_gpu
    if smoke and backend == "gpu":
        ours = functools.partial(ours, interpret=True)
    rng = np.random.default_rng(0)
    print("\nquantized matmul (bf16 x)        ms      weight GB/s  (% peak)")
    shapes = ((1, 4096, 14336), (16, 4096, 14336), (1, 14336, 4096), (128, 4096, 4096))
    for M, K, N in ((1, 256, 256),) if smoke else shapes:
        w = jnp.asarray(0.02 * rng.standard_normal((K, N)), jnp.float32)
        x = jnp.asarray(rng.standard_normal((M, K)), jnp.bfloat16)
        wb = w.astype(jnp.bfloat16)
        q8, q4 = quantize(w, 8), quantize(w, 4, 128)
        xla = jax.jit(quantized_matmul_xla)     # what the engine's router picks on GPU
        fns = {"bf16 dot": jax.jit(lambda x, w: x @ w), "int8": ours, "int4 g128": ours,
               "int8 xla": xla, "int4 xla": xla}
        args = {"bf16 dot": (x, wb), "int8": (x, q8), "int4 g128": (x, q4), "int8 xla": (x, q8),
                "int4 xla": (x, q4)}
        sizes = {"bf16 dot": wb.size * 2, "int8": q8.nbytes, "int4 g128": q4.nbytes,
                 "int8 xla": q8.nbytes, "int4 xla": q4.nbytes}
        if smoke:
            for name, qw in (("int8", q8), ("int4 g128", q4)):
                diff = np.max(np.abs(np.asarray(ours(x, qw), np.float32) -
                                     np.asarray(quantized_matmul_reference(x, qw), np.float32)))
                print(f"  M={M} K={K} N={N} {name}: interpreted, max |ours - reference| = "
                      f"{diff:.3g}", flush=True)
            continue
        t = timed(fns, args)
        for name, sec in t.items():
            bw = sizes[name] / sec
            frac = f"{100 * bw / peak:5.1f}%" if peak else "  n/a"
            print(f"  M={M:<4d} K={K:<6d} N={N:<6d} {name:10s} {sec * 1e3:8.3f}  {bw / 1e9:9.1f}  {frac}",
                  flush=True)


# ---------------------------------------------------------------------------------------
# CPU: the XLA quantized path at SmolLM2-135M's shapes
# ---------------------------------------------------------------------------------------

SMOL = dict(layers=30, hidden=576, q=576, kv=192, mlp=1536, vocab=49152)


def _mm_f32(x, w):
    return x @ w


def _chain(mm, n):
    """x -> n matmuls, each over its own weight; outputs fed back (cut or tiled to K)."""
    def f(x, ws):
        K = x.shape[1]
        for w in ws:
            y = mm(x, w)
            y = y[:, :K] if y.shape[1] >= K else jnp.tile(y, (1, -(-K // y.shape[1])))[:, :K]
            x = jnp.tanh(y)
        return x
    return f


def cpu_quant(args) -> None:
    rng = np.random.default_rng(0)
    opts = XLA_CPU_COMPILER_OPTIONS
    group = args.group
    print(f"\nCPU, XLA path (quantized_matmul_xla), int4 groups of {group}; compile options "
          f"{opts}")
    kernel = cpu_matmul.available()
    print("per matrix: chains of distinct weights (> L3), min of round-robin rounds; "
          + ("'int8 kernel' = the jax.ffi C++ kernel (pallas_kernels/quantized_matmul/cpu.py)" if kernel
             else f"C++ kernel unavailable: {cpu_matmul.unavailable_reason()}"))
    print(f"  {'shape':18s} {'M':>2s}  {'f32 us':>8s} {'int8 us':>8s} {'int4 us':>8s}   "
          f"{'f32 GB/s':>8s} {'int8 GB/s':>9s} {'int4 GB/s':>9s}")
    shapes = [("576x576 (q,o)", 576, 576, 48), ("576x192 (k,v)", 576, 192, 96),
              ("576x1536 (gate,up)", 576, 1536, 32), ("1536x576 (down)", 1536, 576, 32)]
    if args.quick:
        shapes = shapes[2:3]
    for label, K, N, L in shapes:
        wf = [jnp.asarray(0.02 * rng.standard_normal((K, N)), jnp.float32) for _ in range(L)]
        w8 = [quantize(w, 8) for w in wf]
        w4 = [quantize(w, 4, group) for w in wf]
        wk = [cpu_matmul.pack(w) for w in w8] if kernel else None
        for M in (1, 2):
            x = jnp.asarray(rng.standard_normal((M, K)), jnp.float32)
            fns = {"f32": jax.jit(_chain(_mm_f32, L), compiler_options=opts),
                   "int8": jax.jit(_chain(quantized_matmul_xla, L), compiler_options=opts),
                   "int4": jax.jit(_chain(quantized_matmul_xla, L), compiler_options=opts)}
            inputs = {"f32": (x, wf), "int8": (x, w8), "int4": (x, w4)}
            if kernel:
                fns["kernel"] = jax.jit(_chain(cpu_matmul.int8_matmul, L))
                inputs["kernel"] = (x, wk)
            t = timed(fns, inputs, rounds=4 if args.quick else 10)
            us = {k: v / L * 1e6 for k, v in t.items()}
            gbs = {"f32": K * N * 4 / (us["f32"] * 1e3), "int8": w8[0].nbytes / (us["int8"] * 1e3),
                   "int4": w4[0].nbytes / (us["int4"] * 1e3)}
            extra = ""
            if kernel:
                extra = f"   int8 kernel {us['kernel']:7.1f} us {w8[0].nbytes / (us['kernel'] * 1e3):5.1f} GB/s"
            print(f"  {label:18s} {M:2d}  {us['f32']:8.1f} {us['int8']:8.1f} {us['int4']:8.1f}   "
                  f"{gbs['f32']:8.1f} {gbs['int8']:9.1f} {gbs['int4']:9.1f}{extra}", flush=True)
        del wf, w8, w4, wk
    decode_pass(rng, args)
    cpu_f32(args)


def _mm_any(x, w):
    return x @ w if isinstance(w, jax.Array) else quantized_matmul_xla(x, w)


def _nbytes(w) -> int:
    return w.size * w.dtype.itemsize if isinstance(w, jax.Array) else w.nbytes


def _decode_pass_fn(mm):
    """Every matmul of one SmolLM2 decode step (attention itself left out)."""
    def f(x, layers, head):
        for wq, wk, wv, wo, wg, wu, wd in layers:
            qh, kh, vh = mm(x, wq), mm(x, wk), mm(x, wv)
            x = x + mm(qh, wo) + 1e-3 * (kh.sum(-1, keepdims=True) + vh.sum(-1, keepdims=True))
            x = x + mm(jax.nn.silu(mm(x, wg)) * mm(x, wu), wd)
            x = x / (1.0 + jnp.abs(x).max(-1, keepdims=True))
        return jnp.argmax(mm(x, head), axis=-1)
    return f


def decode_pass(rng, args) -> None:
    c = SMOL
    shapes = [(c["hidden"], c["q"]), (c["hidden"], c["kv"]), (c["hidden"], c["kv"]),
              (c["q"], c["hidden"]), (c["hidden"], c["mlp"]), (c["hidden"], c["mlp"]),
              (c["mlp"], c["hidden"])]
    layers_f = [[jnp.asarray(0.02 * rng.standard_normal(s), jnp.float32) for s in shapes]
                for _ in range(c["layers"])]
    head_f = jnp.asarray(0.02 * rng.standard_normal((c["hidden"], c["vocab"])), jnp.float32)
    variants = {"f32": (layers_f, head_f, _mm_f32)}
    for bits in (8, 4):
        q = lambda w: quantize(w, bits, args.group)
        layers_q = [[q(w) for w in layer] for layer in layers_f]
        variants[f"int{bits}"] = (layers_q, q(head_f), quantized_matmul_xla)
        # the LM head converts slowest (one 576 x 49152 weight): keep it f32
        variants[f"int{bits}+f32 head"] = (layers_q, head_f, _mm_any)
        if bits == 8 and cpu_matmul.available():
            # the engine's CPU path: the jax.ffi kernel on 64-column panels
            variants["int8 kernel"] = ([[cpu_matmul.pack(w) for w in layer] for layer in layers_q],
                                       cpu_matmul.pack(q(head_f)), cpu_matmul.int8_matmul)
    nbytes = {k: sum(_nbytes(w) for layer in layers for w in layer) + _nbytes(head)
              for k, (layers, head, _) in variants.items()}
    print(f"\nSmolLM2-135M decode pass: all {7 * c['layers'] + 1} matmuls of one step, no "
          "attention; tok/s = 1 / step")
    for M in (1, 2):
        x = jnp.asarray(rng.standard_normal((M, c["hidden"])), jnp.float32)
        fns = {k: jax.jit(_decode_pass_fn(mm), compiler_options=XLA_CPU_COMPILER_OPTIONS)
               for k, (_, _, mm) in variants.items()}
        t = timed(fns, {k: (x, layers, head) for k, (layers, head, _) in variants.items()},
                  rounds=3 if args.quick else 8)
        for k, sec in t.items():
            print(f"  M={M} {k:15s} weights {nbytes[k] / 1e6:6.1f} MB   step {sec * 1e3:7.2f} ms   "
                  f"{1 / sec:6.1f} tok/s (per row)   {nbytes[k] / sec / 1e9:5.1f} GB/s", flush=True)
    if not args.quick:
        # The pitfall: XLA's default scheduler hoists every weight conversion to the start.
        x = jnp.asarray(rng.standard_normal((1, c["hidden"])), jnp.float32)
        layers, head, mm = variants["int8"]
        f = jax.jit(_decode_pass_fn(mm))
        t = timed({"d": f}, {"d": (x, layers, head)}, rounds=2)["d"]
        print(f"  M=1 int8 with XLA's default scheduler: step {t * 1e3:7.2f} ms "
              f"({1 / t:5.1f} tok/s): compile with XLA_CPU_COMPILER_OPTIONS", flush=True)


def cpu_f32(args) -> None:
    """The f32 C++ kernel (pallas_kernels/f32_matmul/cpu.py; batch-invariant by construction)
    against XLA's dot (plain: not invariant) and the XLA tiled path (the invariant engine's
    dot without the kernel): SmolLM2 decode passes, then 512-row prefill GEMMs."""
    if not cpu_f32_matmul.available():
        print(f"\nf32 C++ kernel unavailable: {cpu_f32_matmul.unavailable_reason()}")
        return
    rng = np.random.default_rng(0)
    c = SMOL
    shapes = [(c["hidden"], c["q"]), (c["hidden"], c["kv"]), (c["hidden"], c["kv"]),
              (c["q"], c["hidden"]), (c["hidden"], c["mlp"]), (c["hidden"], c["mlp"]),
              (c["mlp"], c["hidden"])]
    layers = [[jnp.asarray(0.02 * rng.standard_normal(s), jnp.float32) for s in shapes]
              for _ in range(c["layers"])]
    head = jnp.asarray(0.02 * rng.standard_normal((c["hidden"], c["vocab"])), jnp.float32)
    nbytes = sum(w.size * 4 for layer in layers for w in layer) + head.size * 4
    mms = {"XLA dot": _mm_f32, "XLA tiled (invariant)": lambda x, w: routing.xla_matmul(x, w, True),
           "f32 kernel": cpu_f32_matmul.f32_matmul}
    print(f"\nf32 C++ kernel, SmolLM2-135M decode pass: all {7 * c['layers'] + 1} matmuls of "
          f"one step ({nbytes / 1e6:.0f} MB of f32 weights), no attention")
    for M in ((1, 32) if args.quick else (1, 2, 8, 32)):
        x = jnp.asarray(rng.standard_normal((M, c["hidden"])), jnp.float32)
        fns = {k: jax.jit(_decode_pass_fn(mm)) for k, mm in mms.items()}
        t = timed(fns, {k: (x, layers, head) for k in fns}, rounds=3 if args.quick else 8)
        for k, sec in t.items():
            print(f"  M={M:2d} {k:22s} step {sec * 1e3:7.2f} ms   {M / sec:7.1f} tok/s   "
                  f"{nbytes / sec / 1e9:5.1f} GB/s   {2 * M * nbytes / 4 / sec / 1e9:6.1f} GFLOP/s",
                  flush=True)
    del layers, head
    print("\nf32 C++ kernel, prefill GEMM x[M, K] @ w[K, N] (2048^3: the ceiling), GFLOP/s")
    gemms = [(512, 576, 576), (512, 576, 192), (512, 576, 1536), (512, 1536, 576),
             (2048, 2048, 2048)]
    for M, K, N in gemms[2:] if args.quick else gemms:
        x = jnp.asarray(rng.standard_normal((M, K)), jnp.float32)
        w = jnp.asarray(rng.standard_normal((K, N)), jnp.float32)
        fns = {k: jax.jit(mm) for k, mm in mms.items()}
        t = timed(fns, {k: (x, w) for k in fns}, rounds=3 if args.quick else 8)
        print(f"  {M}x{K}x{N:<5d} " + "   ".join(f"{k} {2 * M * K * N / s / 1e9:6.1f}"
                                                   for k, s in t.items()), flush=True)


def _variant_matmul(name: str, src: Path):
    """The panelled f32 matmul built from another copy of f32_matmul.cc (``src``: its
    directory, with work_share.h), registered under its own FFI target: an A/B of kernel
    versions in one process, e.g. ``git show <rev>:pallas_kernels/f32_matmul/f32_matmul.cc``."""
    import ctypes

    from pallas_kernels import cpu_build
    lib = ctypes.cdll.LoadLibrary(str(cpu_build.build(src / "f32_matmul.cc")))
    target = f"bench_f32_{name}"
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(lib.JaxinferF32MatmulPanels), platform="cpu")
    return lambda x, w: jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((x.shape[0], w.shape[1]),
                                                                      jnp.float32))(x, w.panels)


def cpu_f32_chain(args) -> None:
    """The engine's float32 layout (fused q/k/v and gate/up, panel-major weights): the 120
    layer matmuls of one step plus the LM head, chained so each call waits for the last,
    at the batch sizes of decode (M = 1..32) and of packed prefill steps (128, 544). With
    --kernel-src NAME=DIR, other builds of the kernel run alternately in the same process
    (outputs checked bitwise equal)."""
    if not cpu_f32_matmul.available():
        print(f"\nf32 C++ kernel unavailable: {cpu_f32_matmul.unavailable_reason()}")
        return
    rng = np.random.default_rng(0)
    c = SMOL
    D, shapes = c["hidden"], [(c["hidden"], c["q"] + 2 * c["kv"]), (c["q"], c["hidden"]),
                              (c["hidden"], 2 * c["mlp"]), (c["mlp"], c["hidden"])]
    layers = [[cpu_f32_matmul.panel(jnp.asarray(0.02 * rng.standard_normal(s), jnp.float32))
               for s in shapes] for _ in range(c["layers"])]
    head = cpu_f32_matmul.panel(jnp.asarray(0.02 * rng.standard_normal((D, c["vocab"])), jnp.float32))
    mms = {"repo": cpu_f32_matmul.f32_matmul}
    for spec in args.kernel_src or []:
        name, _, d = spec.partition("=")
        mms[name] = _variant_matmul(name, Path(d))

    def chain(mm):
        def f(x, x2, layers, head):
            acc = jnp.zeros((x.shape[0], 1), jnp.float32)
            for ws in layers:
                for w in ws:            # a fresh input each call, depending on the last output
                    y = mm((x if w.shape[0] == D else x2) + 0 * acc, w)
                    acc = acc + y[:, :1]
            return acc, mm(x + 0 * acc, head)[:, :8]
        return jax.jit(f)

    flops_row = 2 * (c["layers"] * sum(k * n for k, n in shapes) + D * c["vocab"])
    print(f"\nf32 C++ kernel, engine layout: {4 * c['layers']} layer matmuls + LM head, chained "
          f"(min of {3 if args.quick else 10} rounds, variants alternating)")
    for M in ((8, 32) if args.quick else (1, 4, 8, 16, 32, 128, 544)):
        x = jnp.asarray(rng.standard_normal((M, D)), jnp.float32)
        x2 = jnp.asarray(rng.standard_normal((M, c["mlp"])), jnp.float32)
        fns = {k: chain(mm) for k, mm in mms.items()}
        outs = {k: np.asarray(f(x, x2, layers, head)[1]) for k, f in fns.items()}
        for k, o in outs.items():
            assert np.array_equal(o, outs["repo"]), f"kernel {k} differs from the repo's bits"
        t = timed(fns, {k: (x, x2, layers, head) for k in fns}, rounds=3 if args.quick else 10)
        print(f"  M={M:3d} " + "   ".join(f"{k} {s * 1e3:7.1f} ms ({M * flops_row / s / 1e9:5.1f} GFLOP/s)"
                                          for k, s in t.items()), flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu-quant", action="store_true",
                   help="on CPU: time the XLA quantized-matmul path at SmolLM2 shapes")
    p.add_argument("--cpu-f32", action="store_true",
                   help="on CPU: time the f32 C++ kernel against XLA's dot (decode pass, GEMM)")
    p.add_argument("--cpu-f32-chain", action="store_true",
                   help="on CPU: the f32 kernel on the engine's panelled weights, a step's "
                        "chained matmuls at decode and prefill batch sizes")
    p.add_argument("--kernel-src", action="append", metavar="NAME=DIR",
                   help="with --cpu-f32-chain: also time f32_matmul.cc from DIR (A/B)")
    p.add_argument("--group", type=int, default=64,
                   help="int4 group size for --cpu-quant (SmolLM2's K = 576 needs 64 or 32)")
    p.add_argument("--quick", action="store_true", help="fewer shapes and rounds")
    p.add_argument("--accel", default="attention,quant",
                   help="on TPU / GPU: comma-separated sections (attention, quant)")
    p.add_argument("--smoke", choices=("tpu", "gpu"), default=None,
                   help="on CPU: run the accelerator section's code interpreted on tiny "
                        "inputs (checks the bundled-kernel adapters; no timings)")
    args = p.parse_args(argv)
    backend = jax.default_backend()
    dev = jax.devices()[0]
    print(f"jax {jax.__version__}, backend {backend}, device {dev.device_kind}")
    if args.smoke:
        from jax.experimental.pallas import tpu as pltpu
        if args.smoke == "tpu":         # every pallas_call, ours and bundled, interpreted
            with pltpu.force_tpu_interpret_mode(pltpu.InterpretParams()):
                bench_attention("tpu", None, smoke=True)
                bench_quantized_matmul("tpu", None, smoke=True)
        else:
            bench_attention("gpu", None, smoke=True)
            bench_quantized_matmul("gpu", None, smoke=True)
        return 0
    if backend in ("tpu", "gpu"):
        peak = peak_bandwidth(dev.device_kind)
        print(f"peak HBM bandwidth: {peak / 1e12:.2f} TB/s" if peak else
              "peak HBM bandwidth: unknown for this device kind (fractions omitted)")
        if "attention" in args.accel:
            bench_attention(backend, peak)
        if "quant" in args.accel:
            bench_quantized_matmul(backend, peak)
        return 0
    print("benchmarks/kernels.py: the Pallas kernels need a TPU or GPU to be timed "
          f"(backend is {backend}); run it on an accelerator.")
    if args.cpu_quant:
        cpu_quant(args)
    elif args.cpu_f32:
        cpu_f32(args)
    elif args.cpu_f32_chain:
        cpu_f32_chain(args)
    else:
        print("(--cpu-quant / --cpu-f32 time the CPU matmul paths instead)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
