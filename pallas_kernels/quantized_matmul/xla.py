"""Weight-only quantized matmul: int8 per output channel, int4 grouped along K.

Formats (what ``quantize_int8`` / ``quantize_int4`` return, and what every path reads):

* int8: ``q`` int8 [K, N] and ``scale`` f32 [N]; w ~= q * scale[None, :]. Symmetric,
  scale = max|w[:, n]| / 127, q in [-127, 127].
* int4: ``packed`` int8 [K/2, N] and ``scales`` f32 [K/group, N]; byte i of column n holds
  row 2i in its low nibble and row 2i+1 in its high nibble, both two's-complement 4-bit;
  w[k, n] ~= nibble(k, n) * scales[k // group, n]. Symmetric, scale = max|w| / 7 over the
  group, values in [-7, 7]. ``group`` must divide K (SmolLM2's K = 576 takes 64 or 32, not
  128: 576 = 4.5 * 128).

``QuantizedWeight`` bundles either format as one pytree (arrays as leaves, bits/group
static), so a model's ``mm(x, w)`` hook can take it in place of a float weight.

Paths, all computing x [M, K] @ w [K, N] -> [M, N] in x's dtype with f32 accumulation:

* ``quantized_matmul_reference`` — dequantize to f32, one f32 dot at HIGHEST precision.
* ``quantized_matmul_xla`` — the CPU path: dequantize in one fused XLA loop, then one dot.
  XLA:CPU cannot fuse the int8->f32 conversion into its GEMV, so the f32 weight is written
  to cache and read back, at about the rate at which it streams f32 weights from DRAM, so
  per matrix it beats f32 modestly and a whole decode step's matmuls about tie with f32 at
  one row (benchmarks/kernels.py --cpu-quant; RESULTS.md). Its clear gain is memory (4x /
  ~7x smaller weights). A jitted model must be compiled with ``XLA_CPU_COMPILER_OPTIONS``
  (memory-optimized scheduler), or XLA hoists every layer's conversion to the start and
  keeps all the f32 copies live (a many times slower step).
* ``pallas_kernels.quantized_matmul.cpu.int8_matmul`` — what the engine uses for int8 on CPU: a C++
  kernel through jax.ffi that reads only the int8 bytes (packed weights, ``panel=32``:
  int16 activations and exact int32 block sums); bitwise batch-invariant by construction.
  This XLA path remains for int4 and for hosts without a C++ compiler.
* ``quantized_matmul_tpu`` / ``quantized_matmul_gpu`` (``pallas.py``) — one Pallas kernel body, lowered by
  Mosaic (TPU) or Triton (GPU): the grid walks (row block, column block); each step loads
  its [K, block_n] slab of int8 weights (half that for int4) and dequantizes in registers
  chunk by chunk along K, so only the quantized bytes cross HBM. int8: dot of raw integer
  values, scale applied once per output; int4: per chunk of whole groups, low and high
  nibbles are scaled by their groups' scales and dotted with x's even and odd columns
  (one group per chunk on GPU, up to 1024 packed rows on TPU).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

__all__ = ["QuantizedWeight", "quantize", "quantize_int8", "quantize_int4", "dequantize",
           "quantized_matmul_reference", "quantized_matmul_xla", "XLA_CPU_COMPILER_OPTIONS"]

# Compile options for a jitted step that uses ``quantized_matmul_xla`` on XLA:CPU. The
# default scheduler runs every weight conversion first (they depend only on parameters),
# so a 30-layer model keeps ~200 f32 weight copies alive; this scheduler converts each
# weight right before its dot (RESULTS.md, "Design measurements").
XLA_CPU_COMPILER_OPTIONS = {"xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED"}

_INT8_MAX = 127
_INT4_MAX = 7


@functools.partial(jax.tree_util.register_dataclass, data_fields=["q", "scales", "offsets"],
                   meta_fields=["bits", "group", "panel"])
@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
    """A quantized [K, N] weight. bits 8: q int8 [K, N], scales f32 [N] (group 0).
    bits 4: q = packed int8 [K/2, N], scales f32 [K/group, N].
    ``panel`` 32 (the CPU kernel's layouts, cpu_matmul.pack / quantize_int4): int8: q is int8
    [N/32, K/2, 32, 2], column panels with rows in adjacent pairs; 0 = the plain layouts.
    4-bit: affine codes (``offsets`` set: w = code * scale + offset, codes 0..15, per group of
    32 rows of a column, the GGUF Q4_1 scheme), q int8 [N/32, K/4, 2, 32] two codes a byte,
    scales and offsets float16 [N/32, K/32, 32]; only the CPU kernel reads it."""

    q: jax.Array
    scales: jax.Array
    bits: int
    group: int = 0
    panel: int = 0
    offsets: jax.Array | None = None

    @property
    def shape(self) -> tuple[int, int]:
        if self.panel:                # rows of K in pairs (int8) or quads (4-bit)
            n_panels, k_steps = self.q.shape[:2]
            return ((4 if self.bits == 4 else 2) * k_steps, n_panels * self.panel)
        rows, n = self.q.shape
        return (rows * 2 if self.bits == 4 else rows, n)

    def unpanelled(self) -> jax.Array:
        """q in the plain [K, N] layout (int8)."""
        if not self.panel:
            return self.q
        K, N = self.shape
        return self.q.transpose(1, 3, 0, 2).reshape(K, N)

    def columns_as_rows(self, cols: jax.Array) -> jax.Array:
        """cols i32[T] -> f32 [T, K]: columns of an int8 weight, dequantized (a tied LM
        head's embedding rows: the table's rows as per-row int8 codes times their scale)."""
        if self.bits != 8:
            raise ValueError(f"columns_as_rows: int8 weights only, this one has {self.bits} bits")
        if self.panel:                 # q[n // P, k // 2, n % P, k % 2] holds element (k, n)
            q = self.q[cols // self.panel, :, cols % self.panel, :].reshape(cols.shape[0], -1)
        else:
            q = self.q[:, cols].T
        return q.astype(jnp.float32) * self.scales[cols][:, None]

    def __getitem__(self, key: Any) -> "QuantizedWeight":
        """``param[...]`` (how a model reads its weights) returns the weight itself."""
        if key is Ellipsis:
            return self
        raise TypeError("QuantizedWeight supports only [...] indexing")

    @property
    def nbytes(self) -> int:
        return sum(a.size * a.dtype.itemsize for a in (self.q, self.scales, self.offsets) if a is not None)


# ---------------------------------------------------------------------------------------
# Quantization and dequantization
# ---------------------------------------------------------------------------------------

def quantize_int8(w: jax.Array) -> tuple[jax.Array, jax.Array]:
    """w [K, N] -> (q int8 [K, N], scale f32 [N]); symmetric per output channel."""
    if w.ndim != 2:
        raise ValueError(f"w: expected [K, N], got shape {w.shape}")
    w = w.astype(jnp.float32)
    amax = jnp.max(jnp.abs(w), axis=0)
    scale = jnp.where(amax > 0, amax / _INT8_MAX, 1.0)
    q = jnp.clip(jnp.round(w / scale), -_INT8_MAX, _INT8_MAX).astype(jnp.int8)
    return q, scale


def quantize_int4(w: jax.Array, group: int = 128) -> tuple[jax.Array, jax.Array]:
    """w [K, N] -> (packed int8 [K/2, N], scales f32 [K/group, N]); symmetric per group of
    ``group`` rows and per column; rows 2i / 2i+1 in the low / high nibble of byte i."""
    if w.ndim != 2:
        raise ValueError(f"w: expected [K, N], got shape {w.shape}")
    K, N = w.shape
    if group <= 0 or group % 2:
        raise ValueError(f"group: must be a positive even number, got {group}")
    if K % group:
        divs = [g for g in (256, 128, 64, 32, 16) if K % g == 0]
        raise ValueError(f"K (w.shape[0]) = {K} is not a multiple of group = {group}"
                         + (f"; groups that divide it: {divs}" if divs else ""))
    w = w.astype(jnp.float32).reshape(K // group, group, N)
    amax = jnp.max(jnp.abs(w), axis=1)                                    # [K/group, N]
    scales = jnp.where(amax > 0, amax / _INT4_MAX, 1.0)
    q = jnp.clip(jnp.round(w / scales[:, None, :]), -_INT4_MAX, _INT4_MAX).astype(jnp.int8)
    q = q.reshape(K // 2, 2, N)
    packed = (q[:, 0] & 0xF) | (q[:, 1] << 4)                             # wraps in int8
    return packed.astype(jnp.int8), scales


def quantize(w: jax.Array, bits: int, group: int = 128) -> QuantizedWeight:
    """w [K, N] -> QuantizedWeight (bits 8: per channel; bits 4: grouped)."""
    if bits == 8:
        q, s = quantize_int8(w)
        return QuantizedWeight(q, s, 8, 0)
    if bits == 4:
        q, s = quantize_int4(w, group)
        return QuantizedWeight(q, s, 4, group)
    raise ValueError(f"bits: expected 8 or 4, got {bits}")


def _unpack_int4(packed: jax.Array) -> tuple[jax.Array, jax.Array]:
    """packed int8 [..] -> (low, high) int32 nibbles, sign-extended. Works in int32 because
    narrow-integer vector shifts are not supported by every Pallas backend."""
    p = packed.astype(jnp.int32)                       # sign-extends the byte
    return (p << 28) >> 28, p >> 4                     # arithmetic shifts


def dequantize(w: QuantizedWeight) -> jax.Array:
    """QuantizedWeight -> f32 [K, N]."""
    if w.bits == 8:
        return w.unpanelled().astype(jnp.float32) * w.scales[None, :]
    K, N = w.shape
    lo, hi = _unpack_int4(w.q)
    full = jnp.stack([lo, hi], axis=1).reshape(K, N).astype(jnp.float32)
    return (full.reshape(K // w.group, w.group, N) * w.scales[:, None, :]).reshape(K, N)


def _check(x: jax.Array, w: QuantizedWeight, panel_ok: bool = False) -> None:
    if not isinstance(w, QuantizedWeight):
        raise TypeError(f"w: expected a QuantizedWeight, got {type(w).__name__}")
    if x.ndim != 2:
        raise ValueError(f"x: expected [M, K], got shape {x.shape}")
    if w.q.dtype != jnp.int8:
        raise ValueError(f"w.q: expected int8, got {w.q.dtype}")
    if w.panel and not panel_ok:
        raise ValueError("w: a panel-packed weight (the CPU kernel's layout) reaches only "
                         "pallas_kernels.quantized_matmul.cpu; quantize without packing for this path")
    K, N = w.shape
    if x.shape[1] != K:
        raise ValueError(f"K: x has {x.shape[1]} columns, the weight has {K} rows")
    if w.bits == 8:
        if w.scales.shape != (N,):
            raise ValueError(f"scales: int8 expects [N] = ({N},), got {w.scales.shape}")
    elif w.bits == 4:
        if w.group <= 0 or K % w.group:
            raise ValueError(f"group: {w.group} does not divide K = {K}")
        if w.scales.shape != (K // w.group, N):
            raise ValueError(f"scales: int4 expects [K/group, N] = ({K // w.group}, {N}), got "
                             f"{w.scales.shape}")
    else:
        raise ValueError(f"bits: expected 8 or 4, got {w.bits}")


# ---------------------------------------------------------------------------------------
# Reference and the XLA (CPU) path
# ---------------------------------------------------------------------------------------

@jax.jit
def quantized_matmul_reference(x: jax.Array, w: QuantizedWeight) -> jax.Array:
    """x [M, K] @ dequantize(w) -> [M, N] in x's dtype; f32 math at HIGHEST precision."""
    _check(x, w, panel_ok=True)
    y = jnp.dot(x.astype(jnp.float32), dequantize(w), precision=lax.Precision.HIGHEST)
    return y.astype(x.dtype)


# Column-block width of the XLA path for big weights. Converting a whole [576, 49152] LM
# head to f32 makes a 113 MB temporary that is page-faulted in on every call; a loop over
# column blocks reuses one cached block (the width was the fastest of those tried:
# RESULTS.md, "Design measurements"). Weights up to _XLA_WHOLE elements are converted in
# one piece.
_XLA_BLOCK_N = 4096
_XLA_WHOLE = 1 << 22


@jax.jit
def quantized_matmul_xla(x: jax.Array, w: QuantizedWeight) -> jax.Array:
    """x [M, K] @ w -> [M, N] in x's dtype: the XLA:CPU path.

    One fused loop turns the int8 (or unpacked int4) weight into f32 with its scales, then
    one plain 2-D dot, the form XLA:CPU streams fastest (measured against int8 x int8
    dots, bf16 dots, int4-typed weights and K/N-chunked variants: all slower). Weights
    with more than 4M elements (an LM head) go in column blocks of 4096.
    """
    _check(x, w)
    xf = x.astype(jnp.float32)
    M = x.shape[0]
    if w.bits == 8:
        # A lone row runs as two: XLA:CPU's two-row dot takes the converted weight ~25%
        # faster than its one-row GEMV does (measured at SmolLM2's shapes).
        xf = jnp.pad(xf, ((0, 1), (0, 0))) if M == 1 else xf
    K, N = w.shape
    if K * N <= _XLA_WHOLE or N % _XLA_BLOCK_N:
        return _xla_block(xf, w)[:M].astype(x.dtype)

    def body(j, out):
        cols = lambda a: lax.dynamic_slice_in_dim(a, j * _XLA_BLOCK_N, _XLA_BLOCK_N, axis=1)
        blk = QuantizedWeight(cols(w.q), cols(w.scales[None] if w.bits == 8 else w.scales),
                              w.bits, w.group)
        if w.bits == 8:
            blk = QuantizedWeight(blk.q, blk.scales[0], 8, 0)
        return lax.dynamic_update_slice_in_dim(out, _xla_block(xf, blk), j * _XLA_BLOCK_N, 1)

    out = lax.fori_loop(0, N // _XLA_BLOCK_N, body, jnp.zeros((xf.shape[0], N), jnp.float32))
    return out[:M].astype(x.dtype)


def _xla_block(xf: jax.Array, w: QuantizedWeight) -> jax.Array:
    if w.bits == 8:
        return jnp.dot(xf, w.q.astype(jnp.float32)) * w.scales[None, :]
    return jnp.dot(xf, dequantize(w))
