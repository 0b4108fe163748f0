"""Attention over a contiguous per-row KV cache: the reference generator's layout.

Deliberately plain (dense scores, masks as selects): it is the oracle the paged path is
compared with, not a fast path.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxinfer.models.config import ModelConfig


def contiguous_attention(positions: jax.Array, batch: int, seq: int, cfg: ModelConfig):
    """AttentionFn over caches (k, v) of [B, M, KVH, D]; tokens are [B*seq] row-major and
    ``positions`` i32[B, seq] are their absolute positions (where their K/V are written).
    Each layer's scale, window and soft-cap come from ``cfg.attention_kwargs``; ALiBi
    models add slope * (key pos - query pos) per head (layers.model_alibi_slopes)."""
    from jaxinfer.models.layers import model_alibi_slopes

    alibi = model_alibi_slopes(cfg)

    def attn(layer: int, q: jax.Array, k: jax.Array, v: jax.Array, cache: Any):
        opts = cfg.attention_kwargs(layer)
        scale, window, cap = opts["sm_scale"], opts["sliding_window"], opts["soft_cap"]
        kc, vc = cache
        B, M, KVH, D = kc.shape
        H = q.shape[1]
        rows = jnp.arange(batch)[:, None]
        kc = kc.at[rows, positions].set(k.reshape(batch, seq, KVH, D).astype(kc.dtype))
        vc = vc.at[rows, positions].set(v.reshape(batch, seq, KVH, D).astype(vc.dtype))
        q5 = q.reshape(batch, seq, KVH, H // KVH, D)
        s = jnp.einsum("bskgd,bmkd->bkgsm", q5, kc, preferred_element_type=jnp.float32) * scale
        if cap is not None:
            s = cap * jnp.tanh(s / cap)
        kv_pos = jnp.arange(M)[None, None, :]
        if alibi is not None:
            dist = (kv_pos - positions[:, :, None]).astype(jnp.float32)           # [B, seq, M]
            s = s + jnp.asarray(alibi).reshape(KVH, H // KVH)[None, :, :, None, None] * dist[:, None, None]
        mask = kv_pos <= positions[:, :, None]                                # [B, seq, M]
        if window is not None:
            mask &= kv_pos > positions[:, :, None] - window
        s = jnp.where(mask[:, None, None], s, -jnp.inf)
        p = jax.nn.softmax(s, axis=-1)
        o = jnp.einsum("bkgsm,bmkd->bskgd", p.astype(vc.dtype), vc)
        return o.reshape(batch * seq, H, D).astype(q.dtype), (kc, vc)

    return attn
