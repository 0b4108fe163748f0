"""The Llama family in one file: Llama 1/2/3 (llama3 rope scaling), Mistral, Qwen2, Qwen3, SmolLM2.

Differences between members are config flags (qkv bias, q/k norm, sliding window, tied
embeddings), never separate code paths.

Each weight is described once in ``weight_specs`` (shape, logical axes, HF name): the
module's init, the checkpoint loaders and sharding all read that one table.

The forward pass is written for a ragged batch: ``tokens`` / ``positions`` are a flat [T]
axis holding every scheduled token of every sequence, and attention is a callback that
owns the KV cache layout (contiguous for the reference generator, paged for the engine).
That keeps one layer function for prefill, decode and any mix of the two.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from jaxinfer.models.config import ModelConfig, hf_common_fields
from jaxinfer import matmul as M
from jaxinfer.models import layer_loop
from jaxinfer.models import layers as L
# Re-exported: the family-neutral pieces used to live here and are imported from here.
from jaxinfer.models.base import (AttentionFn, MatmulFn, WeightSpec, flat_params,  # noqa: F401
                                  init_value)


def weight_specs(cfg: ModelConfig) -> dict[str, WeightSpec]:
    """Our parameter path ("layers.3.wq") -> its description."""
    D, F, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    Hq, Hkv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    specs: dict[str, WeightSpec] = {
        "embed": WeightSpec((V, D), ("vocab", "embed"), "model.embed_tokens.weight"),
        "final_norm": WeightSpec((D,), (None,), "model.norm.weight", init="ones"),
        # The head is always stored [D, V] so the logits matmul streams rows of a 2-D
        # weight; for tied models the loader fills it with embed.T (one extra copy, but
        # `x @ emb.T` on XLA:CPU streamed at a fraction of the speed).
        "lm_head": WeightSpec((D, V), ("embed", "vocab"),
                              "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight",
                              transpose=True),
    }
    for i in range(cfg.num_layers):
        hf = f"model.layers.{i}"
        p = f"layers.{i}"
        specs[f"{p}.attn_norm"] = WeightSpec((D,), (None,), f"{hf}.input_layernorm.weight", init="ones")
        specs[f"{p}.wq"] = WeightSpec((D, Hq), ("embed", "q_heads"), f"{hf}.self_attn.q_proj.weight", True)
        specs[f"{p}.wk"] = WeightSpec((D, Hkv), ("embed", "kv_heads"), f"{hf}.self_attn.k_proj.weight", True)
        specs[f"{p}.wv"] = WeightSpec((D, Hkv), ("embed", "kv_heads"), f"{hf}.self_attn.v_proj.weight", True)
        specs[f"{p}.wo"] = WeightSpec((Hq, D), ("q_heads", "embed"), f"{hf}.self_attn.o_proj.weight", True)
        if cfg.qkv_bias:
            specs[f"{p}.bq"] = WeightSpec((Hq,), ("q_heads",), f"{hf}.self_attn.q_proj.bias", init="zeros")
            specs[f"{p}.bk"] = WeightSpec((Hkv,), ("kv_heads",), f"{hf}.self_attn.k_proj.bias", init="zeros")
            specs[f"{p}.bv"] = WeightSpec((Hkv,), ("kv_heads",), f"{hf}.self_attn.v_proj.bias", init="zeros")
        if cfg.o_bias:
            specs[f"{p}.bo"] = WeightSpec((D,), (None,), f"{hf}.self_attn.o_proj.bias", init="zeros")
        if cfg.qk_norm:
            specs[f"{p}.q_norm"] = WeightSpec((cfg.head_dim,), (None,), f"{hf}.self_attn.q_norm.weight", init="ones")
            specs[f"{p}.k_norm"] = WeightSpec((cfg.head_dim,), (None,), f"{hf}.self_attn.k_norm.weight", init="ones")
        specs[f"{p}.mlp_norm"] = WeightSpec((D,), (None,), f"{hf}.post_attention_layernorm.weight", init="ones")
        specs[f"{p}.w_gate"] = WeightSpec((D, F), ("embed", "mlp"), f"{hf}.mlp.gate_proj.weight", True)
        specs[f"{p}.w_up"] = WeightSpec((D, F), ("embed", "mlp"), f"{hf}.mlp.up_proj.weight", True)
        specs[f"{p}.w_down"] = WeightSpec((F, D), ("mlp", "embed"), f"{hf}.mlp.down_proj.weight", True)
        if cfg.mlp_bias:
            specs[f"{p}.b_gate"] = WeightSpec((F,), ("mlp",), f"{hf}.mlp.gate_proj.bias", init="zeros")
            specs[f"{p}.b_up"] = WeightSpec((F,), ("mlp",), f"{hf}.mlp.up_proj.bias", init="zeros")
            specs[f"{p}.b_down"] = WeightSpec((D,), (None,), f"{hf}.mlp.down_proj.bias", init="zeros")
    return specs


class DecoderLayer(nnx.Module):
    """Pre-norm attention + gated MLP. Attributes are named after ``weight_specs`` paths."""

    loopable = True     # its code reads weights only as self.<name>[...] (models/layer_loop.py)

    def __init__(self, cfg: ModelConfig, index: int, specs: dict[str, WeightSpec],
                 dtype: Any, rngs: nnx.Rngs):
        prefix = f"layers.{index}."
        for path, spec in specs.items():
            if path.startswith(prefix):
                setattr(self, path[len(prefix):], nnx.Param(init_value(spec, rngs.params(), dtype)))
        self.cfg = cfg
        self.index = index

    def norm(self, x: jax.Array, w: jax.Array) -> jax.Array:
        """The family's RMSNorm (Gemma overrides it with its (1 + w) form)."""
        return L.rms_norm(x, w, self.cfg.rms_norm_eps)

    def attention(self, h: jax.Array, cos: jax.Array, sin: jax.Array, attn: AttentionFn,
                  cache: Any, mm: MatmulFn, tp_axis: str | None) -> tuple[jax.Array, Any]:
        """h [T, D] (normed) -> (o [T, D], cache): projections, q/k norm, rotary, attention,
        output projection. Under tensor parallelism (``tp_axis``: the mesh axis, inside
        shard_map) the weights are this device's slices: head counts come from the weights'
        shapes, and the row-parallel wo partial sums are all-reduced."""
        cfg = self.cfg
        T, hd = h.shape[0], cfg.head_dim
        if hasattr(self, "wqkv"):     # fused at load time (quantization.fuse_projections)
            Hq = cfg.num_heads * hd
            qkv = mm(h, self.wqkv[...])                                      # [T, Hq + 2*Hkv*hd]
            q, k, v = jnp.split(qkv, [Hq, Hq + cfg.num_kv_heads * hd], axis=-1)
        else:
            q = mm(h, self.wq[...])                                          # [T, Hq*hd]
            k = mm(h, self.wk[...])                                          # [T, Hkv*hd]
            v = mm(h, self.wv[...])
        if cfg.qkv_bias:
            q, k, v = q + self.bq[...], k + self.bk[...], v + self.bv[...]
        q = q.reshape(T, -1, hd)                                             # [T, Hq_local, hd]
        k = k.reshape(T, -1, hd)                                             # [T, Hkv_local, hd]
        v = v.reshape(T, -1, hd)
        if cfg.qk_norm:
            q, k = self.norm(q, self.q_norm[...]), self.norm(k, self.k_norm[...])
        q, k = L.apply_partial_rope(q, cos, sin), L.apply_partial_rope(k, cos, sin)
        o, cache = attn(self.index, q, k, v, cache)                       # [T, Hq, hd]
        o = L.all_reduce(mm(o.reshape(T, -1), self.wo[...]), tp_axis)        # [T, D]
        if cfg.o_bias:
            o = o + self.bo[...]
        return o, cache

    def mlp(self, h: jax.Array, mm: MatmulFn, tp_axis: str | None) -> jax.Array:
        """h [T, D] (normed) -> [T, D]: the gated MLP (w_down's partial sums all-reduced)."""
        cfg = self.cfg
        if hasattr(self, "w_gate_up"):   # fused at load time
            g, u = jnp.split(mm(h, self.w_gate_up[...]), 2, axis=-1)           # [T, F] each
        else:
            g, u = mm(h, self.w_gate[...]), mm(h, self.w_up[...])               # [T, F]
        if cfg.mlp_bias:
            g, u = g + self.b_gate[...], u + self.b_up[...]
        y = L.all_reduce(mm(L.activation(cfg.hidden_act, g) * u, self.w_down[...]), tp_axis)  # [T, D]
        if cfg.mlp_bias:
            y = y + self.b_down[...]
        return y

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array,
                 attn: AttentionFn, cache: Any, mm: MatmulFn = M.matmul,
                 tp_axis: str | None = None) -> tuple[jax.Array, Any]:
        """x [T, D] -> (x [T, D], cache): pre-norm residual attention, then MLP."""
        with jax.named_scope("attention"):
            o, cache = self.attention(self.norm(x, self.attn_norm[...]), cos, sin, attn,
                                      cache, mm, tp_axis)
            x = x + o
        with jax.named_scope("mlp"):
            x = x + self.mlp(self.norm(x, self.mlp_norm[...]), mm, tp_axis)
        return x, cache


class LlamaForCausalLM(nnx.Module):
    """The model; other families subclass it and override the hooks (``layer_class``,
    ``embed_tokens``, ``rope``, ``final_logits``) and the two static methods."""

    layer_class = DecoderLayer
    weight_specs = staticmethod(weight_specs)

    @staticmethod
    def config_from_hf(d: Mapping[str, Any]) -> ModelConfig:
        archs = d.get("architectures") or ["?"]
        return ModelConfig(**hf_common_fields(d, archs[0]))

    def __init__(self, cfg: ModelConfig, dtype: Any = jnp.float32, *, rngs: nnx.Rngs):
        specs = self.weight_specs(cfg)
        for name in ("embed", "final_norm", "lm_head"):
            setattr(self, name, nnx.Param(init_value(specs[name], rngs.params(), dtype)))
        self.layers = nnx.List([self.layer_class(cfg, i, specs, dtype, rngs)
                                for i in range(cfg.num_layers)])
        self.cfg = cfg
        self.dtype = dtype

    def embed_tokens(self, tokens: jax.Array, tp_axis: str | None) -> jax.Array:
        """tokens i32[T] -> [T, D]."""
        return L.embed_lookup(self.embed[...], tokens, tp_axis)

    def rope(self, positions: jax.Array) -> list[tuple[jax.Array, jax.Array]]:
        """positions i32[T] -> each layer's (cos, sin) [T, rotary_dim], computed once per
        distinct (base, scaling) (ModelConfig.layer_rope)."""
        cfg, by_params = self.cfg, {}
        out = []
        for i in range(cfg.num_layers):
            key = cfg.layer_rope(i)
            if key not in by_params:
                # inv_freq is a numpy constant computed at trace time (not a parameter)
                by_params[key] = L.rope_cos_sin(positions, L.rope_inv_freq(cfg, cfg.rotary_dim, layer=i),
                                                L.rope_attention_factor(cfg, i))
            out.append(by_params[key])
        return out

    def final_logits(self, x: jax.Array, mm: MatmulFn) -> jax.Array:
        """x [S, D] (last hidden states) -> f32[S, V_local]."""
        x = L.rms_norm(x, self.final_norm[...], self.cfg.rms_norm_eps)
        return mm(x, self.lm_head[...]).astype(jnp.float32)

    def __call__(self, tokens: jax.Array, positions: jax.Array, kv_cache: Sequence[Any],
                 attn: AttentionFn, logits_index: jax.Array | None = None,
                 mm: MatmulFn = M.matmul, tp_axis: str | None = None) -> tuple[jax.Array, list[Any]]:
        """tokens, positions i32[T]; logits_index i32[S] picks the rows whose logits are
        needed (prompt positions that are not sampled cost no LM-head matmul). ``mm`` is
        every weight matmul (``matmul.tiled_matmul`` for batch invariance; a quantized
        matmul plugs in here too). ``tp_axis``: see DecoderLayer; embedding and LM head are
        then vocabulary-parallel (one all-reduce in, one all-gather of the logits out).
        Returns (logits f32[S or T, V], updated per-layer caches)."""
        x = self.embed_tokens(tokens, tp_axis)                                # [T, D]
        # EngineConfig.layer_loop: one fori_loop over identical layers (models/layer_loop.py)
        attn_loop = getattr(attn, "layer_loop", None)
        stacks = None if attn_loop is None else layer_loop.plan(list(self.layers), self.cfg, M.can_index,
                                                                getattr(self, "layer_stacks", None))
        if stacks is not None:
            cos, sin = self.rope(positions)[0]
            x, new_cache = layer_loop.run(list(self.layers), stacks, x, cos, sin, attn_loop, kv_cache, mm, tp_axis)
        else:
            if not isinstance(kv_cache, (list, tuple)):
                raise ValueError("a stacked KV pool needs the layer loop (engine/kv_cache.py StackedKV)")
            new_cache = []
            for layer, (cos, sin), c in zip(self.layers, self.rope(positions), kv_cache):
                x, c = layer(x, cos, sin, attn, c, mm, tp_axis)
                new_cache.append(c)
        if logits_index is not None:
            x = x[logits_index]                                               # [S, D]
        logits = self.final_logits(x, mm)                                     # [S, V_local]
        if tp_axis is not None:
            logits = jax.lax.all_gather(logits, tp_axis, axis=1, tiled=True)  # [S, V]
        return logits, new_cache
