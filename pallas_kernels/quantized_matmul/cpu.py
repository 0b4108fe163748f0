"""The CPU int8 weight-only matmul: a C++ kernel (cpu/int8_matmul.cc) called through jax.ffi.

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
the XLA path (attention/dispatch.py logs which one it took).
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
_KERNEL = cpu_build.Kernel("quantized_matmul/int8_matmul.cc", {TARGET: "JaxinferInt8Matmul",
                                                               TARGET_LAYER: "JaxinferInt8MatmulLayer"},
                           "int8 matmul")


# built, loaded and registered with XLA:CPU once, on the first available()
available, unavailable_reason, build = _KERNEL.available, _KERNEL.unavailable_reason, _KERNEL.build


PANEL = 32   # columns per panel of the packed layout
BLOCK = 64   # K per activation scale in the packed path (K must be a multiple)


def pack(w: QuantizedWeight) -> QuantizedWeight:
    """An int8 weight in the kernel's packed layout, q int8 [N/32, K/2, 32, 2]: panels of
    32 columns, rows in adjacent pairs (the packed path: int16 activations, exact int32
    block sums; see cpu/int8_matmul.cc). Weights with K % 64 or N % 32 stay plain [K, N]
    (the kernel's f32 path)."""
    if w.bits != 8:
        raise ValueError(f"pack: the CPU kernel takes int8 weights, got {w.bits}-bit")
    K, N = w.shape
    if w.panel or K % BLOCK or N % PANEL:
        return w
    q = w.q.reshape(K // 2, 2, N // PANEL, PANEL).transpose(2, 0, 3, 1)
    return QuantizedWeight(q, w.scales, 8, 0, PANEL)


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
    if not items or any(not isinstance(w, QuantizedWeight) or w.bits != 8 or w.q.shape != w0.q.shape
                        for w in layer_weights(ws)):
        raise ValueError("int8_matmul_layer: every weight must be an int8 QuantizedWeight of one shape and layout")
    K, N = w0.shape
    if x.ndim != 2 or x.shape[1] != K:
        raise ValueError(f"x: expected [M, K={K}], got shape {x.shape}")
    idx = jnp.reshape(jnp.asarray(layer, jnp.int32), (1,))
    y = jax.ffi.ffi_call(TARGET_LAYER, jax.ShapeDtypeStruct((x.shape[0], N), jnp.float32))(
        x.astype(jnp.float32), idx, *[w.q for w in items], *[w.scales.astype(jnp.float32) for w in items])
    return y.astype(x.dtype)
