"""Every weight matmul ``x [T, K] @ w [K, N]`` is routed here: by backend, weight dtype,
packing and quantization, plain or batch-invariant. Models call their projections through
the ``mm`` hook that ``select`` returns; ``name`` says what runs (Engine.kernels); kernels
live in ``pallas_kernels/``. One of the ops layer's three routers, with attention/dispatch.py
and reductions.py: the rest of jaxinfer reaches kernels through them (tests/test_imports.py,
whose list of known exceptions, the weight formats' imports, can only shrink).
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import jax
import jax.numpy as jnp

log = logging.getLogger("jaxinfer")


# Batch invariance. XLA:CPU picks its dot kernel by the number of rows M: one kernel for
# M == 1, another for 2 <= M <= 32, another for M >= 33 (measured for every SmolLM2
# weight shape with K = 576; K = 1536 has only the first split). Each kernel sums over K
# in its own order, so a token's activations would depend on how many other tokens share
# its step. Two answers, picked in one place (``float_matmul``):
#  * float32 weights on the CPU backend with the C++ kernel built (pallas_kernels/
#    f32_matmul/cpu.py): every output is one k-ordered FMA chain whatever M, so the kernel
#    is batch-invariant by construction and serves both ``matmul`` and ``tiled_matmul``;
#  * otherwise (bf16 weights, no compiler, TPU / GPU): XLA's dot, and ``tiled_matmul``
#    runs every dot on exactly 32 rows: T is padded up to a multiple of 32 and cut into
#    32-row tiles run one after another (lax.map keeps the HLO small), so every row goes
#    through the same dot of the same shape whatever else is in the batch. (Until
#    2026-11-28 a T of 2..32 ran as it was, on the belief that XLA:CPU's 2..32-row kernel
#    sums every row alike; on an AVX2-only Zen 3 it does not for narrow outputs: with
#    N < 16, e.g. a MoE router's [T, 64] @ [64, 8], rows of M = 2, 3, 4 or 17 differed from
#    the same rows at M = 32, so MoE routing changed with the batch.)
INVARIANT_TILE = 32


def is_quantized(w) -> bool:
    return not isinstance(w, jax.Array) and hasattr(w, "scales")   # a QuantizedWeight


def quantized_matmul(x: jax.Array, w, invariant: bool) -> jax.Array:
    """x [T, K] @ a QuantizedWeight, the one place that picks the path (the engine's hook,
    the reference generator and the quality tool all come here, so they agree):
    int8 on CPU with the C++ kernel built -> pallas_kernels/quantized_matmul/cpu.py (packed or plain
    layout; batch-invariant by construction); otherwise XLA (``invariant``: the converted
    weight through ``tiled_matmul``); GPU comes here too. The TPU kernel is chosen by ``select``."""
    if w.offsets is not None:     # 4-bit panels: made only where the CPU kernel is (quantize_model)
        from pallas_kernels.quantized_matmul import cpu as cpu_matmul
        return cpu_matmul.int4_matmul(x, w)
    if w.bits == 8 and jax.default_backend() == "cpu":
        from pallas_kernels.quantized_matmul import cpu as cpu_matmul
        if cpu_matmul.available():
            return cpu_matmul.int8_matmul(x, w)
    if not invariant:
        from pallas_kernels.quantized_matmul.xla import quantized_matmul_xla
        return quantized_matmul_xla(x, w)
    from pallas_kernels.quantized_matmul.xla import dequantize
    if w.bits == 8:     # the per-channel scale applies after the dot
        y = tiled_matmul(x.astype(jnp.float32), w.unpanelled().astype(jnp.float32)) * w.scales[None, :]
        return y.astype(x.dtype)
    return tiled_matmul(x, dequantize(w).astype(x.dtype))


def f32_kernel_applies(w) -> bool:
    """float32 weight (an array or a PanelledF32) on the CPU backend and the C++ f32 kernel
    built (built on first ask)."""
    if w.dtype != jnp.float32 or jax.default_backend() != "cpu":
        return False
    from pallas_kernels.f32_matmul import cpu as cpu_f32_matmul
    return cpu_f32_matmul.available()


def float_matmul(x: jax.Array, w, invariant: bool) -> jax.Array:
    """x [T, K] @ a float weight w [K, N] -> [T, N], the one place that picks the path:
    float32 on CPU with the kernel built -> pallas_kernels/f32_matmul/cpu.py (batch-invariant
    by construction, so both engines use it; inside shard_map it sees the local shards;
    a PanelledF32, which only a model prepared for that kernel holds, always goes there);
    otherwise XLA's dot (``invariant``: in fixed row tiles, see above)."""
    if f32_kernel_applies(w):
        from pallas_kernels.f32_matmul import cpu as cpu_f32_matmul
        return cpu_f32_matmul.f32_matmul(x.astype(jnp.float32), w)   # x @ w is f32 here too
    return xla_matmul(x, w, invariant)


def xla_matmul(x: jax.Array, w: jax.Array, invariant: bool) -> jax.Array:
    """x [T, K] @ w [K, N] -> [T, N] by XLA's dot; ``invariant``: in fixed row tiles."""
    if not invariant:
        return x @ w
    T = x.shape[0]
    n = -(-T // INVARIANT_TILE)
    if n == 1:
        return (jnp.pad(x, ((0, INVARIANT_TILE - T), (0, 0))) @ w)[:T]
    xp = jnp.pad(x, ((0, n * INVARIANT_TILE - T), (0, 0)))
    y = jax.lax.map(lambda xt: xt @ w, xp.reshape(n, INVARIANT_TILE, x.shape[1]))
    return y.reshape(n * INVARIANT_TILE, w.shape[1])[:T]


def is_indexed(w) -> bool:
    """A looped layer's weight (models/layer_loop.IndexedWeight: every layer's + an index)."""
    return hasattr(w, "arrays") and hasattr(w, "index")


def can_index(w) -> bool:
    """Whether a weight has a kernel that reads it out of every layer's by a traced index
    (the layer loop, models/layer_loop.py): float32 or int8 on CPU with the C++ kernels."""
    if is_quantized(w):
        if (w.bits != 8 and w.offsets is None) or jax.default_backend() != "cpu":
            return False
        from pallas_kernels.quantized_matmul import cpu as cpu_matmul
        return cpu_matmul.available()
    return len(w.shape) == 2 and f32_kernel_applies(w)


def indexed_matmul(x: jax.Array, w) -> jax.Array:
    """x [T, K] @ layer ``w.index``'s weight (a layer_loop.IndexedWeight): the kernels'
    indexed forms, the same bits as ``float_matmul`` / ``quantized_matmul`` on that layer's
    weight (both are batch-invariant, so plain and invariant are one)."""
    from pallas_kernels.layer_stack import first_layer

    if is_quantized(first_layer(w.arrays)):
        from pallas_kernels.quantized_matmul import cpu as cpu_matmul
        return cpu_matmul.int8_matmul_layer(x, w.arrays, w.index)
    from pallas_kernels.f32_matmul import cpu as cpu_f32_matmul
    return cpu_f32_matmul.f32_matmul_layer(x.astype(jnp.float32), w.arrays, w.index)


def matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [T, K] @ w [K, N] -> [T, N], the plain engine's dot: the f32 C++ kernel on CPU,
    else XLA's choice of kernel (fastest, not batch-invariant); see float_matmul.
    ``w`` may be a QuantizedWeight (jaxinfer/quantization.py): see quantized_matmul."""
    if is_indexed(w):
        return indexed_matmul(x, w)
    if is_quantized(w):
        return quantized_matmul(x, w, invariant=False)
    return float_matmul(x, w, invariant=False)


def tiled_matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [T, K] @ w [K, N] -> [T, N], bitwise independent of T (see above): the f32 C++
    kernel on CPU, else XLA in fixed row tiles. ``w`` may be a QuantizedWeight: see
    quantized_matmul."""
    if is_indexed(w):
        return indexed_matmul(x, w)
    if is_quantized(w):
        return quantized_matmul(x, w, invariant=True)
    return float_matmul(x, w, invariant=True)


def select(batch_invariant: bool, backend: str | None = None,
                  quantized: bool = True) -> Callable:
    """The model's ``mm`` hook: plain or batch-invariant dots (``matmul`` / ``tiled_matmul``,
    which also route quantized weights on CPU and GPU: ``quantized_matmul``). On TPU
    quantized weights go to the Pallas kernel. The choice is logged."""
    base = tiled_matmul if batch_invariant else matmul
    backend = backend or jax.default_backend()
    if not quantized:            # float weights: float_matmul picks per weight dtype
        if backend == "cpu":
            from pallas_kernels.f32_matmul import cpu as cpu_f32_matmul

            if cpu_f32_matmul.available():
                log.info("matmul: float32 weights -> C++ kernel (jax.ffi), others -> XLA dot")
            else:
                log.info("matmul: float weights -> XLA dot (C++ f32 kernel unavailable: %s)",
                         cpu_f32_matmul.unavailable_reason())
        return base
    if backend == "gpu":
        # XLA fuses the int8/int4 -> float conversion into its own GEMM; our Pallas Triton
        # kernel was slower than even a bf16 dot and made the 30-layer forward take minutes
        # to compile (RESULTS "On a GPU"), so the GPU takes XLA's path.
        log.info("matmul: quantized weights -> XLA (dequantize fused into the dot) on backend gpu")
        return base
    if backend != "tpu":
        from pallas_kernels.quantized_matmul import cpu as cpu_matmul

        if cpu_matmul.available():
            log.info("matmul: int8 weights -> C++ kernel (jax.ffi), int4 -> XLA, on backend %s",
                     backend)
        else:
            log.info("matmul: quantized weights -> XLA path on backend %s (C++ kernel "
                     "unavailable: %s)", backend, cpu_matmul.unavailable_reason())
        return base
    from pallas_kernels.quantized_matmul import pallas as Q
    from pallas_kernels.quantized_matmul.xla import QuantizedWeight

    kernel = Q.quantized_matmul_tpu
    log.info("matmul: quantized weights -> Pallas kernel on backend tpu")

    def mm(x, w):
        return kernel(x, w) if isinstance(w, QuantizedWeight) else base(x, w)

    return mm


def name(quantization: str | None, dtype: Any, backend: str | None = None) -> str:
    """Which implementation serves a model's weight matmuls (Engine.kernels, /metrics):
    the same choice as ``float_matmul`` / ``quantized_matmul`` and ``select``."""
    backend = backend or jax.default_backend()
    if backend == "tpu":
        return "pallas" if quantization else "xla"
    if backend == "cpu" and quantization == "int8":
        from pallas_kernels.quantized_matmul import cpu as cpu_matmul
        return "cpp-int8" if cpu_matmul.available() else "xla"
    if backend == "cpu" and quantization is None and jnp.dtype(dtype) == jnp.float32:
        from pallas_kernels.f32_matmul import cpu as cpu_f32_matmul
        return "cpp-f32" if cpu_f32_matmul.available() else "xla"
    return "xla"


def int4_kernel_available() -> bool:
    """Whether the CPU kernel's 4-bit panels can run here (CPU backend, kernel built)."""
    if jax.default_backend() != "cpu":
        return False
    from pallas_kernels.quantized_matmul import cpu as cpu_matmul
    return cpu_matmul.available()


def int4_kernel_applies(w: jax.Array) -> bool:
    """Whether a float [K, N] weight can take the CPU kernel's 4-bit panels (CPU backend,
    the kernel built, K and N multiples of 32)."""
    if len(w.shape) != 2 or not int4_kernel_available():
        return False
    from pallas_kernels.quantized_matmul import cpu as cpu_matmul
    return cpu_matmul.int4_applies(*w.shape)


def pack_for_backend(w, backend: str | None = None):
    """A freshly quantized weight in the layout its backend's kernel reads fastest (the
    CPU kernel's packed panels for int8 on CPU; otherwise unchanged)."""
    backend = backend or jax.default_backend()
    if backend in ("tpu", "gpu") or w.bits != 8:
        return w
    from pallas_kernels.quantized_matmul import cpu as cpu_matmul

    return cpu_matmul.pack(w) if cpu_matmul.available() else w
