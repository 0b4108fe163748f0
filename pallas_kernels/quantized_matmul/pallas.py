"""The weight-only quantized matmul's Pallas kernel: one body, lowered by Mosaic (TPU) or
Triton (GPU). Formats, the reference and the XLA path: ``xla.py`` beside it."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.quantized_matmul.xla import QuantizedWeight, _check, _unpack_int4


# ---------------------------------------------------------------------------------------
# Pallas kernel (one body; Mosaic and Triton lowerings)
# ---------------------------------------------------------------------------------------

def _qmm_int8_kernel(x_ref,   # [bm, K]
                     q_ref,   # int8 [K, bn]
                     s_ref,   # f32 [1, bn]
                     o_ref,   # [bm, bn]
                     *, tk: int):
    """acc = sum over K chunks of x_chunk @ q_chunk (integers are exact in bf16/f32), then
    one scale per output column."""
    bm, K = x_ref.shape
    cdt = jnp.float32 if x_ref.dtype == jnp.float32 else jnp.bfloat16
    prec = lax.Precision.HIGHEST if cdt == jnp.float32 else None
    acc = jnp.zeros(o_ref.shape, jnp.float32)
    for k0 in range(0, K, tk):
        xk = x_ref[:, pl.ds(k0, tk)].astype(cdt)
        wk = q_ref[pl.ds(k0, tk), :].astype(jnp.float32).astype(cdt)
        acc += jnp.dot(xk, wk, precision=prec, preferred_element_type=jnp.float32)
    o_ref[...] = (acc * s_ref[...]).astype(o_ref.dtype)


def _qmm_int4_kernel(xe_ref,  # [bm, K/2]: x's even columns (rows 2i of w: low nibbles)
                     xo_ref,  # [bm, K/2]: x's odd columns (high nibbles)
                     p_ref,   # int8 [K/2, bn]
                     s_ref,   # f32 [K/group, bn]
                     o_ref,   # [bm, bn]
                     *, half_group: int, tkp: int):
    """Per chunk of ``tkp`` packed rows (whole groups): dequantize low and high nibbles
    with their groups' scales, then xe_chunk @ low + xo_chunk @ high."""
    bm, Kh = xe_ref.shape
    bn = o_ref.shape[1]
    cdt = jnp.float32 if xe_ref.dtype == jnp.float32 else jnp.bfloat16
    prec = lax.Precision.HIGHEST if cdt == jnp.float32 else None
    ngc = tkp // half_group                                   # groups per chunk
    acc = jnp.zeros(o_ref.shape, jnp.float32)
    for k0 in range(0, Kh, tkp):
        lo, hi = _unpack_int4(p_ref[pl.ds(k0, tkp), :])                        # [tkp, bn]
        sc = s_ref[pl.ds(k0 // half_group, ngc), :]                              # [ngc, bn]
        if ngc > 1:
            sc = jnp.broadcast_to(sc[:, None, :], (ngc, half_group, bn)).reshape(tkp, bn)
        w_lo = (lo.astype(jnp.float32) * sc).astype(cdt)
        w_hi = (hi.astype(jnp.float32) * sc).astype(cdt)
        xe = xe_ref[:, pl.ds(k0, tkp)].astype(cdt)
        xo = xo_ref[:, pl.ds(k0, tkp)].astype(cdt)
        acc += jnp.dot(xe, w_lo, precision=prec, preferred_element_type=jnp.float32)
        acc += jnp.dot(xo, w_hi, precision=prec, preferred_element_type=jnp.float32)
    o_ref[...] = acc.astype(o_ref.dtype)


def _pick_blocks(M: int, K: int, N: int, w: QuantizedWeight, backend: str, block_m, block_n):
    if backend == "gpu":
        # Triton: power-of-two tiles, every dot dim >= 16
        bm = block_m or max(16, min(64, 1 << max(0, (M - 1).bit_length())))
        if block_n is None:
            block_n = next((b for b in (256, 128, 64, 32, 16) if N % b == 0), None)
            if block_n is None:
                raise ValueError(f"N = {N}: the Triton kernel needs a multiple of 16")
        if w.bits == 8:
            tk = next((b for b in (128, 64, 32, 16) if K % b == 0), None)
            if tk is None:
                raise ValueError(f"K = {K}: the Triton kernel needs a multiple of 16")
        else:
            tk = w.group // 2
            if tk < 16 or tk & (tk - 1):
                raise ValueError(f"group = {w.group}: the Triton kernel needs group / 2 a power "
                                 "of two >= 16")
    else:
        # Mosaic: (8, 128) tiles; a block dim equal to the full array dim is always legal
        bm = block_m or min(128, -(-M // 8) * 8)
        if block_n is None:
            block_n = next((b for b in (512, 256, 128) if N % b == 0), N)
        # big static K chunks keep lane slices of x 128-aligned and the dots large
        if w.bits == 8:
            tk = next((b for b in (512, 256, 128) if K % b == 0), K)
        else:   # packed rows per step: whole groups, up to 1024 (~2 MB of f32 temporaries)
            hg, Kh = w.group // 2, K // 2
            tk = max((c * hg for c in range(1, 1024 // hg + 1) if Kh % (c * hg) == 0),
                     default=hg)
    if N % block_n:
        raise ValueError(f"block_n = {block_n} does not divide N = {N}")
    return bm, block_n, tk


def _qmm_pallas(x, w: QuantizedWeight, *, backend: str, interpret, block_m, block_n):
    _check(x, w)
    M, K = x.shape
    N = w.shape[1]
    bm, bn, tk = _pick_blocks(M, K, N, w, backend, block_m, block_n)
    Mp = -(-M // bm) * bm
    if Mp != M:
        x = jnp.pad(x, ((0, Mp - M), (0, 0)))
    grid = (Mp // bm, N // bn)
    if backend == "gpu":
        params = pltriton.CompilerParams(num_warps=4, num_stages=2)
    else:
        params = pltpu.CompilerParams(dimension_semantics=("parallel", "parallel"))
    out_spec = pl.BlockSpec((bm, bn), lambda i, j: (i, j))
    if w.bits == 8:
        kernel = functools.partial(_qmm_int8_kernel, tk=tk)
        in_specs = [pl.BlockSpec((bm, K), lambda i, j: (i, 0)),
                    pl.BlockSpec((K, bn), lambda i, j: (0, j)),
                    pl.BlockSpec((1, bn), lambda i, j: (0, j))]
        args = (x, w.q, w.scales.reshape(1, N))
    else:
        kernel = functools.partial(_qmm_int4_kernel, half_group=w.group // 2, tkp=tk)
        ng = K // w.group
        xs = x.reshape(Mp, K // 2, 2)
        in_specs = [pl.BlockSpec((bm, K // 2), lambda i, j: (i, 0)),
                    pl.BlockSpec((bm, K // 2), lambda i, j: (i, 0)),
                    pl.BlockSpec((K // 2, bn), lambda i, j: (0, j)),
                    pl.BlockSpec((ng, bn), lambda i, j: (0, j))]
        args = (xs[:, :, 0], xs[:, :, 1], w.q, w.scales)
    y = pl.pallas_call(kernel, grid=grid, in_specs=in_specs, out_specs=out_spec,
                       out_shape=jax.ShapeDtypeStruct((Mp, N), x.dtype),
                       compiler_params=params, interpret=interpret,
                       name=f"jaxinfer_quantized_matmul_int{w.bits}_{backend}")(*args)
    return y[:M]


_STATIC = ("interpret", "block_m", "block_n")


@functools.partial(jax.jit, static_argnames=_STATIC)
def quantized_matmul_tpu(x: jax.Array, w: QuantizedWeight, *, interpret: bool | Any = False,
                         block_m: int | None = None, block_n: int | None = None) -> jax.Array:
    """x [M, K] @ w -> [M, N] in x's dtype, Mosaic TPU kernel. interpret: False on a TPU,
    ``pltpu.InterpretParams()`` (or True) to run it on CPU."""
    return _qmm_pallas(x, w, backend="tpu", interpret=interpret, block_m=block_m,
                       block_n=block_n)


@functools.partial(jax.jit, static_argnames=_STATIC)
def quantized_matmul_gpu(x: jax.Array, w: QuantizedWeight, *, interpret: bool | Any = False,
                         block_m: int | None = None, block_n: int | None = None) -> jax.Array:
    """x [M, K] @ w -> [M, N] in x's dtype, Triton GPU kernel. interpret: False on a GPU,
    True to run it on CPU. Needs K, N multiples of 16 and int4 groups of 32, 64, 128, ..."""
    return _qmm_pallas(x, w, backend="gpu", interpret=interpret, block_m=block_m,
                       block_n=block_n)
