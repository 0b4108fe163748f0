"""Find the exact codes of a float32 weight that came from a block-quantized checkpoint.

A GGUF's Q4_1 block (32 weights of one column along K) dequantizes to ``d * q + m`` with
``d``, ``m`` float16 and ``q`` in 0..15; a Q8_0 block to ``d * q`` with ``q`` in -127..127.
The loader turns them into float32 (loading/gguf.py), which the engine would then stream
at 4 bytes a weight. ``encode`` recovers, for every block of a float32 weight, a scale,
offset and int8 codes that give back *those very floats* through the kernel's own
dequantization formula (``CodedF32``), checking every value bit for bit, so a matmul on the
codes is bitwise the float32 matmul at 1.25 bytes a weight. A weight with any block that
no candidate reproduces stays float32: nothing here approximates.

Two candidates a block, the first that reproduces it is kept (f32_matmul.cc
``CodesEncodeImpl``, one pass in C++: ~0.3 s for the default model, where the same search
in XLA took ~2 s plus ~3 s of compiling):
  * affine: offset = the block's minimum, scale = (max - min) / 15 at float16 precision,
    codes 0..15 (Q4_1 and any 4-bit min/scale scheme with float16 parameters);
  * symmetric: offset 0, scale = max |v| / 127 at float16 precision, codes -127..127 (Q8_0).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.f32_matmul.cpu import CODE_BLOCK, TARGET_ENCODE, CodedF32, PanelledF32


def encode(w: PanelledF32) -> CodedF32 | None:
    """``w`` as a CodedF32 that dequantizes to exactly its floats, or None (some block has no
    such codes, or K is not a multiple of 32). The kernel must be available (registered)."""
    P, K, C = w.panels.shape
    if K % CODE_BLOCK or P == 0:
        return None
    codes, scale, offset, ok = _encode(w.panels)
    return CodedF32(codes, scale, offset) if int(ok[0]) else None


@jax.jit
def _encode(panels: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    P, K, C = panels.shape
    blocks = jax.ShapeDtypeStruct((P, K // CODE_BLOCK, C), jnp.float32)
    return jax.ffi.ffi_call(TARGET_ENCODE, (jax.ShapeDtypeStruct(panels.shape, jnp.int8), blocks, blocks,
                                            jax.ShapeDtypeStruct((1,), jnp.int32)))(panels)
