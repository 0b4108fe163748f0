"""Stateless building blocks of the Llama family: RMSNorm, rotary embedding, gated MLP.

Every function works on a flat (ragged) token axis T: a step's tokens from all sequences
are concatenated, so prefill and decode are the same code with different batches.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.models.config import ModelConfig
from jaxinfer.reductions import row_sum, row_sum_squares


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """x [..., D]: normalize in float32, scale in x's dtype (as HF's LlamaRMSNorm does)."""
    x32 = x.astype(jnp.float32)
    # a fixed summation order: XLA's own mean would depend on the number of rows T
    var = row_sum_squares(x32)[..., None] / x.shape[-1]
    return weight * (x32 * jax.lax.rsqrt(var + eps)).astype(x.dtype)


def rms_norm_plus_one(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """Gemma's RMSNorm: scale by (1 + weight), all in float32, then cast (HF Gemma3RMSNorm)."""
    x32 = x.astype(jnp.float32)
    var = row_sum_squares(x32)[..., None] / x.shape[-1]       # fixed order, as rms_norm
    return (x32 * jax.lax.rsqrt(var + eps) * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)


def soft_cap(x: jax.Array, cap: float | None) -> jax.Array:
    """cap * tanh(x / cap) (Gemma's logit soft-capping); identity for None."""
    return x if cap is None else cap * jnp.tanh(x / cap)


def rope_inv_freq(cfg: ModelConfig, dim: int | None = None, layer: int = 0) -> np.ndarray:
    """Inverse rotary frequencies [dim // 2] (float32) of ``layer``, with llama3/linear
    scaling. ``dim``: the rotated features per head (partial rotary, GPT-NeoX), by default
    all of head_dim. ``layer``: ModelConfig.layer_rope (Gemma 3's sliding layers have their
    own base, unscaled).

    Computed in numpy at trace time: they are constants of the model, folded into the step.
    """
    dim = dim or cfg.head_dim
    theta, rs = cfg.layer_rope(layer)
    inv = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim))
    inv = inv.astype(np.float32)
    if rs is None or rs.rope_type == "default":
        return inv
    if rs.rope_type == "linear":
        return (inv / np.float32(rs.factor)).astype(np.float32)
    if rs.rope_type == "longrope":   # per-frequency divisors (models/config.RopeScaling)
        shape = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
        return (1.0 / (np.asarray(rs.ext_factors, np.float32) * (np.float32(theta) ** shape))).astype(np.float32)
    # llama3: long wavelengths divided by `factor`, short ones kept, a smooth ramp between.
    old = rs.original_max_position_embeddings
    low_wl, high_wl = old / rs.low_freq_factor, old / rs.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > low_wl, inv / rs.factor, inv)
    smooth = (old / wavelen - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
    medium = ~(wavelen < high_wl) & ~(wavelen > low_wl)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def rope_attention_factor(cfg: ModelConfig, layer: int = 0) -> float:
    """The factor cos and sin are multiplied by (longrope's attention_factor), else 1."""
    rs = cfg.layer_rope(layer)[1]
    return rs.attention_factor if rs is not None and rs.rope_type == "longrope" else 1.0


def rope_cos_sin(positions: jax.Array, inv_freq: np.ndarray, scale: float = 1.0
                 ) -> tuple[jax.Array, jax.Array]:
    """positions i32[T] -> cos, sin f32[T, head_dim] (halves repeated, HF's non-interleaved
    form), each times ``scale`` (rope_attention_factor)."""
    freqs = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    # Computed once per step, then handed through a conditional XLA cannot see through
    # (a run-time predicate; both branches return the same values: x + 0.0 is x for
    # every value here, cos and sin of non-negative angles are never -0.0). Without it
    # XLA:CPU fuses cos/sin into every layer's rope of q and of k and evaluates them once
    # per head and element: a visible share of a long prefill, for the same values.
    # (lax.optimization_barrier does not stop that: XLA:CPU drops it before fusion.)
    cos_sin = jnp.concatenate([jnp.cos(emb), jnp.sin(emb)], axis=-1)          # [T, 2 * head_dim]
    if scale != 1.0:
        cos_sin = cos_sin * np.float32(scale)
    cos_sin = jax.lax.cond(positions.reshape(-1)[0] > 0, lambda t: t, lambda t: t + 0.0, cos_sin)
    return cos_sin[:, :emb.shape[1]], cos_sin[:, emb.shape[1]:]


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [T, heads, head_dim]; cos/sin [T, head_dim]. Rotates pairs (i, i + head_dim/2)."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    c, s = cos[:, None, :].astype(x.dtype), sin[:, None, :].astype(x.dtype)
    return _no_fma(x * c, c) + _no_fma(rotated * s, s)


def _no_fma(prod: jax.Array, like: jax.Array) -> jax.Array:
    """``prod`` unchanged, behind a select LLVM cannot see through (``like == like`` holds
    for every non-NaN value), so ``a * b + c * d`` is not contracted into an FMA: XLA:CPU
    contracts one product or the other depending on how the surrounding fusion is emitted,
    which moved a token's rotated K by an ulp with the number of tokens in its step."""
    return jnp.where(like == like, prod, jnp.zeros_like(prod))


def as_computed(y: jax.Array) -> jax.Array:
    """``y`` unchanged, behind a select XLA cannot see through (``y == y`` holds for every
    non-NaN value): a bf16 dot followed by a cast to float32 is otherwise folded into one
    float32-output dot, which skips the bf16 rounding, for some row counts only (XLA:CPU,
    measured: 2..32 rows yes, a 32-row tile inside lax.map no), so the bits of a row would
    depend on how many rows share its step."""
    return jnp.where(y == y, y, jnp.zeros_like(y))


def apply_partial_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [T, heads, head_dim]; cos/sin [T, rotary_dim]: rotary on the first rotary_dim
    features of each head, the rest passed through (GPT-NeoX's rotary_pct)."""
    rd = cos.shape[-1]
    if rd == x.shape[-1]:
        return apply_rope(x, cos, sin)
    return jnp.concatenate([apply_rope(x[..., :rd], cos, sin), x[..., rd:]], axis=-1)


def layer_norm(x: jax.Array, weight: jax.Array, bias: jax.Array | None, eps: float) -> jax.Array:
    """x [..., D]: LayerNorm (mean and variance in float32, as torch's on float32 input)."""
    x32 = x.astype(jnp.float32)
    # fixed summation orders (reductions.row_sum), as rms_norm
    mean = row_sum(x32)[..., None] / x.shape[-1]
    var = row_sum(jnp.square(x32 - mean))[..., None] / x.shape[-1]
    y = ((x32 - mean) * jax.lax.rsqrt(var + eps)).astype(x.dtype) * weight
    return y if bias is None else y + bias


def alibi_slopes(num_heads: int, rule: str, bias_max: float = 8.0) -> np.ndarray:
    """ALiBi slopes f32[num_heads]: head h adds slope[h] * (key position - query position)
    to its scores. For a power-of-two head count both rules give 2 ** (-8 (h + 1) / H);
    otherwise "bloom" appends every other slope of the next power of two, "mpt" interleaves
    the next power of two's slopes (each as transformers builds them)."""
    if rule == "bloom":
        p2 = 1 << (num_heads.bit_length() - 1)                      # largest power of 2 <= H
        s = [2.0 ** (-8.0 * (i + 1) / p2) for i in range(p2)]
        s += [2.0 ** (-4.0 * (2 * i + 1) / p2) for i in range(num_heads - p2)]
        return np.asarray(s, np.float32)
    p2 = 1 << (num_heads - 1).bit_length()                          # smallest power of 2 >= H
    s = 1.0 / np.power(2.0, np.arange(1, p2 + 1) * (bias_max / p2))
    if p2 != num_heads:
        s = np.concatenate([s[1::2], s[::2]])[:num_heads]
    return s.astype(np.float32)


def model_alibi_slopes(cfg: ModelConfig) -> np.ndarray | None:
    """f32[num_heads] for an ALiBi model (BLOOM, MPT: models/gpt.py), else None."""
    g = cfg.gpt
    if g is None or g.positions != "alibi":
        return None
    return alibi_slopes(cfg.num_heads, g.alibi, g.alibi_bias_max)


def local_heads(values: np.ndarray, axis: str | None) -> jax.Array:
    """A per-head constant [H] -> this device's heads [H / tp] under tensor parallelism
    (heads are split in order over the mesh's model axis), the whole of it without."""
    if axis is None:
        return jnp.asarray(values)
    n = values.shape[0] // jax.lax.axis_size(axis)
    return jax.lax.dynamic_slice_in_dim(jnp.asarray(values), jax.lax.axis_index(axis) * n, n)


def activation(name: str, x: jax.Array) -> jax.Array:
    """The MLP activation by its HF name (models/config.ACTIVATIONS)."""
    if name == "silu":
        return jax.nn.silu(x)
    if name == "gelu":
        return jax.nn.gelu(x, approximate=False)
    if name == "relu":
        return jax.nn.relu(x)
    return jax.nn.gelu(x, approximate=True)   # gelu_pytorch_tanh, gelu_new


def all_reduce(x: jax.Array, axis: str | None) -> jax.Array:
    """Sum the row-parallel partial products over the tensor-parallel axis (identity without)."""
    return x if axis is None else jax.lax.psum(x, axis)


def embed_lookup(emb: jax.Array, tokens: jax.Array, axis: str | None) -> jax.Array:
    """emb [V or V_local, D], tokens i32[T] -> [T, D].

    Vocabulary-parallel (``axis`` set, inside shard_map): each device holds rows
    [i * V_local, (i + 1) * V_local), contributes its rows and zeros elsewhere, and one
    all-reduce assembles them. Exactly one device adds a non-zero, so the sum is exact.
    """
    if axis is None:
        # a tied model's table read from its LM head (quantization.TiedEmbedding)
        return emb.rows(tokens) if hasattr(emb, "rows") else emb[tokens]
    v_local = emb.shape[0]
    local = tokens - jax.lax.axis_index(axis) * v_local
    mine = (local >= 0) & (local < v_local)
    rows = emb[jnp.clip(local, 0, v_local - 1)]
    return jax.lax.psum(jnp.where(mine[:, None], rows, jnp.zeros_like(rows)), axis)
