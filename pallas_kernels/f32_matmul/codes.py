"""Find the exact codes of a float32 weight that came from a block-quantized checkpoint.

A GGUF's Q4_1 block (32 weights of one column along K) dequantizes to ``d * q + m`` with
``d``, ``m`` float16 and ``q`` in 0..15; a Q8_0 block to ``d * q`` with ``q`` in -127..127.
The loader turns them into float32 (loading/gguf.py), which the engine then streams at 4
bytes a weight. ``encode`` recovers, for every block of a float32 weight, a scale, offset and
int8 codes that give back *those very floats* through the kernel's own dequantization
(``CodedF32``; the kernel checks them itself: every value is compared bit for bit), so a
matmul on the codes is bitwise the float32 matmul at 1.25 bytes a weight. A weight with
any block that no candidate reproduces stays float32: nothing here approximates.

Two candidates a block, the one that reproduces it is kept:
  * affine: offset = the block's minimum, scale = (max - min) / 15 rounded to float16,
    codes 0..15 (Q4_1 and any 4-bit min/scale scheme with float16 parameters);
  * symmetric: offset 0, scale = max |v| / 127 rounded to float16, codes -127..127 (Q8_0).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.f32_matmul.cpu import CODE_BLOCK, TARGET_DEQUANT, CodedF32, PanelledF32

CHUNK = 64   # panels encoded per call (two compiled shapes for SmolLM2: K = 576 and 1536)


def encode(w: PanelledF32) -> CodedF32 | None:
    """``w`` as a CodedF32 that dequantizes to exactly its floats, or None (some block has no
    such codes, or K is not a multiple of 32). The kernel must be available (registered)."""
    P, K, _ = w.panels.shape
    if K % CODE_BLOCK or P == 0 or not _first_block_has_codes(np.asarray(w.panels[0, :CODE_BLOCK])):
        return None
    parts = []
    for p0 in range(0, P, CHUNK):
        chunk = w.panels[p0:p0 + CHUNK]
        n = chunk.shape[0]
        if n < CHUNK:      # zero panels: symmetric scale 0, code 0 reproduces them
            chunk = jnp.pad(chunk, ((0, CHUNK - n), (0, 0), (0, 0)))
        codes, scale, offset, ok = _encode_chunk(chunk)
        if not bool(ok):
            return None
        parts.append((codes[:n], scale[:n], offset[:n]))
    if len(parts) == 1:
        return CodedF32(*parts[0])
    return CodedF32(*(jnp.concatenate(a) for a in zip(*parts)))


def _first_block_has_codes(v: np.ndarray) -> bool:
    """The first block [32, 16] checked in numpy (which never contracts into an FMA), so a
    float weight of another origin (random, trained, bf16) is passed over without compiling
    the full check; a yes here is only a first filter (the kernel's check decides)."""
    lo, hi = v.min(axis=0), v.max(axis=0)
    amax = np.abs(v).max(axis=0)
    ok = np.zeros(v.shape[1], bool)
    with np.errstate(divide="ignore", invalid="ignore"):
        for offset, scale, qmin, qmax in ((lo, (hi - lo) / np.float32(15), 0, 15),
                                          (np.zeros_like(lo), amax / np.float32(127), -127, 127)):
            scale = scale.astype(np.float16).astype(np.float32)
            q = np.clip(np.round((v - offset) / np.where(scale == 0, 1, scale)), qmin, qmax)
            q = np.where(scale == 0, 0, q).astype(np.float32)
            ok |= ((scale * q + offset).view(np.uint32) == v.view(np.uint32)).all(axis=0)
    return bool(ok.all())


def _f16(x: jax.Array) -> jax.Array:
    return x.astype(jnp.float16).astype(jnp.float32)


def _dequant(codes: jax.Array, scale: jax.Array, offset: jax.Array) -> jax.Array:
    """The kernel's own floats for codes [P, K, 16] (so the check tests what it will run)."""
    out = jax.ShapeDtypeStruct(codes.shape, jnp.float32)
    return jax.ffi.ffi_call(TARGET_DEQUANT, out)(codes, scale, offset)


@functools.partial(jax.jit)
def _encode_chunk(panels: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """panels f32 [P, K, 16] -> codes int8 [P, K, 16], scale / offset f32 [P, K/32, 16] and
    whether every value is reproduced bit for bit."""
    P, K, C = panels.shape
    v = panels.reshape(P, K // CODE_BLOCK, CODE_BLOCK, C)
    lo, hi = v.min(axis=2), v.max(axis=2)                        # [P, B, 16]
    candidates = []
    for offset, scale, qmin, qmax in (
            (lo, _f16((hi - lo) / 15), 0, 15),                       # affine 4-bit
            (jnp.zeros_like(lo), _f16(jnp.abs(v).max(axis=2) / 127), -127, 127)):   # symmetric 8-bit
        safe = jnp.where(scale == 0, 1.0, scale)[:, :, None, :]
        q = jnp.clip(jnp.round((v - offset[:, :, None, :]) / safe), qmin, qmax)
        codes = jnp.where(scale[:, :, None, :] == 0, 0, q).astype(jnp.int8).reshape(P, K, C)
        back = _dequant(codes, scale, offset).reshape(v.shape)
        # bit for bit (-0.0 is not 0.0 here; a NaN never matches)
        exact = (jax.lax.bitcast_convert_type(back, jnp.uint32)
                 == jax.lax.bitcast_convert_type(v, jnp.uint32)).all(axis=2)      # [P, B, 16]
        candidates.append((codes, scale, offset, exact))
    (ca, sa, oa, ea), (cs, ss, os_, es) = candidates
    use_a = ea                                                     # per block and column
    codes = jnp.where(jnp.repeat(use_a, CODE_BLOCK, axis=1), ca, cs)
    return codes, jnp.where(use_a, sa, ss), jnp.where(use_a, oa, os_), (ea | es).all()
