"""The CPU int8 weight-only matmul: a C++ kernel (int8_matmul.cc) called through jax.ffi; the
same file's 4-bit panels (``quantize_int4`` / ``int4_matmul``) serve a speculative draft.

XLA:CPU converts int8 weights to f32 in memory before its dot, so int8 weights streamed no
fewer bytes than f32 ones (RESULTS.md, "Quantized matmul on CPU"). The kernel reads only
the int8 bytes: on packed weights it multiplies them with int16-quantized activations
(per row and block of 64) in exact int32 block sums, on plain ones it converts to f32 in
registers. Either way an output depends on its own row only and is summed in one fixed
order, so it is bitwise batch-invariant by construction (see the .cc header) and serves
both the plain and the batch-invariant engine.

The kernel is built on first use by pallas_kernels/cpu_build.py (the host's C++ compiler,
cached by a hash of source, jax version, compiler and CPU flags). Without a compiler,
``available()`` is False with the reason in ``unavailable_reason()`` and the engine keeps
the XLA path (jaxinfer/matmul.py logs which one it took).
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp

from pallas_kernels import cpu_build
from pallas_kernels.layer_stack import Stacked, first_layer, layer_weights, members
from pallas_kernels.quantized_matmul.xla import QuantizedWeight

TARGET = "jaxinfer_int8_matmul"
TARGET_LAYER = "jaxinfer_int8_matmul_layer"
TARGET_INT4 = "jaxinfer_int4_matmul"
TARGET_INT4_LAYER = "jaxinfer_int4_matmul_layer"
_KERNEL = cpu_build.Kernel("quantized_matmul/int8_matmul.cc", {TARGET: "JaxinferInt8Matmul",
                                                               TARGET_LAYER: "JaxinferInt8MatmulLayer",
                                                               TARGET_INT4: "JaxinferInt4Matmul",
                                                               TARGET_INT4_LAYER: "JaxinferInt4MatmulLayer"},
                           "int8 matmul")


# built, loaded and registered with XLA:CPU once, on the first available()
available, unavailable_reason, build = _KERNEL.available, _KERNEL.unavailable_reason, _KERNEL.build


PANEL = 32   # columns per panel of the packed layout
BLOCK = 64   # K per activation scale in the packed path (K must be a multiple)
GROUP4 = 32  # 4-bit: K per scale and offset


def pack(w: QuantizedWeight) -> QuantizedWeight:
    """An int8 weight in the kernel's packed layout, q int8 [N/32, K/2, 32, 2]: panels of
    32 columns, rows in adjacent pairs (the packed path: int16 activations, exact int32
    block sums; see int8_matmul.cc). Weights with K % 64 or N % 32 stay plain [K, N]
    (the kernel's f32 path)."""
    if w.bits != 8:
        raise ValueError(f"pack: the CPU kernel takes int8 weights, got {w.bits}-bit")
    K, N = w.shape
    if w.panel or K % BLOCK or N % PANEL:
        return w
    q = w.q.reshape(K // 2, 2, N // PANEL, PANEL).transpose(2, 0, 3, 1)
    return QuantizedWeight(q, w.scales, 8, 0, PANEL)


def int4_applies(K: int, N: int) -> bool:
    """Whether a [K, N] weight fits the 4-bit panels (K a multiple of 64, N of 32)."""
    return K % BLOCK == 0 and N % PANEL == 0


@jax.jit
def quantize_int4(w: jax.Array) -> QuantizedWeight:
    """w f32 [K, N] -> the kernel's 4-bit weight: per 32 rows of a column, offset = the
    minimum, scale = (max - min) / 15, codes round((w - offset) / scale) in 0..15 (the GGUF
    Q4_1 scheme, so a Q4_1 checkpoint's weights get back their own codes), laid out as
    int8_matmul.cc's "4-bit panels" say. ``int4_applies`` first."""
    K, N = w.shape
    g = w.astype(jnp.float32).reshape(K // GROUP4, GROUP4, N)
    # offset and scale in float16, as Q4_1 keeps them (a quarter of the bytes), the codes
    # found against those rounded values
    lo = g.min(axis=1).astype(jnp.float16).astype(jnp.float32)             # [K/32, N]
    scale = ((g.max(axis=1) - lo) / 15).astype(jnp.float16).astype(jnp.float32)
    scale = jnp.where(scale > 0, scale, 1.0)      # a constant block (or a scale below float16's)
    codes = jnp.clip(jnp.round((g - lo[:, None]) / scale[:, None]), 0, 15).astype(jnp.uint8)
    # (quad t, row kk, panel, vector h, nibble, column cc) -> [panel, t, h, nibble, byte 4 cc + kk]
    e = codes.reshape(K // 4, 4, N // PANEL, 2, 2, 8).transpose(2, 0, 3, 4, 5, 1)
    e = e.reshape(N // PANEL, K // 4, 2, 2, PANEL)
    q = (e[:, :, :, 0] | (e[:, :, :, 1] << 4)).view(jnp.int8)               # [N/32, K/4, 2, 32]
    panels = lambda a: a.astype(jnp.float16).reshape(K // GROUP4, N // PANEL, PANEL).transpose(1, 0, 2)
    return QuantizedWeight(q, panels(scale), 4, GROUP4, PANEL, panels(lo))        # f16 [N/32, K/32, 32]


def dequantize_int4(w: QuantizedWeight) -> jax.Array:
    """A ``quantize_int4`` weight -> f32 [K, N] (code * scale + offset): the reference."""
    K, N = w.shape
    b = w.q.view(jnp.uint8)
    e = jnp.stack([b & 0xF, b >> 4], axis=3).reshape(N // PANEL, K // 4, 2, 2, 8, 4)
    codes = e.transpose(1, 5, 0, 2, 3, 4).reshape(K, N).astype(jnp.float32)
    rows = lambda a: jnp.repeat(a.astype(jnp.float32).transpose(1, 0, 2).reshape(K // GROUP4, N), GROUP4, axis=0)
    return codes * rows(w.scales) + rows(w.offsets)


@functools.partial(jax.jit, inline=True)
def int4_matmul(x: jax.Array, w: QuantizedWeight) -> jax.Array:
    """x [M, K] @ a ``quantize_int4`` weight -> [M, N] in x's dtype (int16 activations per
    block of 64 as for int8 weights, exact int32 sums per group of 32). Call
    ``available()`` first."""
    K, N = w.shape
    if x.ndim != 2 or x.shape[1] != K:
        raise ValueError(f"x: expected [M, K={K}], got shape {x.shape}")
    y = jax.ffi.ffi_call(TARGET_INT4, jax.ShapeDtypeStruct((x.shape[0], N), jnp.float32))(
        x.astype(jnp.float32), w.q, w.scales, w.offsets)
    return y.astype(x.dtype)


@functools.partial(jax.jit, inline=True)
def int8_matmul(x: jax.Array, w: QuantizedWeight) -> jax.Array:
    """x [M, K] @ w (int8, plain or packed) -> [M, N] in x's dtype, f32 math.
    Call ``available()`` first: it registers the kernel."""
    if not isinstance(w, QuantizedWeight) or w.bits != 8:
        raise ValueError("int8_matmul: w must be an int8 QuantizedWeight")
    K, N = w.shape
    if x.ndim != 2 or x.shape[1] != K:
        raise ValueError(f"x: expected [M, K={K}], got shape {x.shape}")
    y = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((x.shape[0], N), jnp.float32))(
        x.astype(jnp.float32), w.q, w.scales.astype(jnp.float32))
    return y.astype(x.dtype)


def int8_matmul_layer(x: jax.Array, ws: Sequence[QuantizedWeight] | Stacked, layer: jax.Array) -> jax.Array:
    """x [M, K] @ ws[layer] -> [M, N] in x's dtype, the same bits as ``int8_matmul(x,
    ws[layer])``: every layer's weight (int8, one shape and layout), each an operand of its
    own or all in one ``Stacked`` weight (pallas_kernels/layer_stack.py); a traced layer
    index picks one by pointer, so inside lax.fori_loop nothing is sliced or copied
    (benchmarks/layer_loop_probe.py). Call ``available()`` first."""
    items, w0 = members(ws), first_layer(ws)
    if not items or any(not isinstance(w, QuantizedWeight) or w.bits != w0.bits or w.bits not in (4, 8)
                        or w.q.shape != w0.q.shape for w in layer_weights(ws)):
        raise ValueError("int8_matmul_layer: every weight must be an int8 (or every one a 4-bit) "
                         "QuantizedWeight of one shape and layout")
    K, N = w0.shape
    if x.ndim != 2 or x.shape[1] != K:
        raise ValueError(f"x: expected [M, K={K}], got shape {x.shape}")
    idx = jnp.reshape(jnp.asarray(layer, jnp.int32), (1,))
    out = jax.ShapeDtypeStruct((x.shape[0], N), jnp.float32)
    if w0.bits == 4:
        y = jax.ffi.ffi_call(TARGET_INT4_LAYER, out)(x.astype(jnp.float32), idx, *[w.q for w in items],
                                                     *[w.scales for w in items], *[w.offsets for w in items])
    else:
        y = jax.ffi.ffi_call(TARGET_LAYER, out)(x.astype(jnp.float32), idx, *[w.q for w in items],
                                                *[w.scales.astype(jnp.float32) for w in items])
    return y.astype(x.dtype)
