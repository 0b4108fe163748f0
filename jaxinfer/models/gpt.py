"""The GPT-style families in one file: GPT-2, GPT-NeoX (Pythia), OPT, BLOOM, Falcon,
GPTBigCode (StarCoder / SantaCoder) and MPT.

They share one layer: LayerNorm (with or without bias), attention with biases, a plain
(not gated) MLP. What differs is a handful of flags (``ModelConfig.gpt``, read from each
family's config.json by models/gpt_config.py): learned positions (with OPT's offset),
rotary on part of each head (NeoX) or on all of it (Falcon), ALiBi (BLOOM, MPT), parallel
residual (NeoX, Falcon), post-norm (OPT 350m), an embedding LayerNorm (BLOOM), OPT's
project_in / out, MPT's clip_qkv. No family has its own code path.

The weight table uses the Llama family's parameter names (wq / wk / wv / wo, w_up /
w_down, lm_head), so quantization, the CPU kernels' fused and panelled layouts and tensor
parallelism (sharding.py) treat these models exactly as they treat Llama. Checkpoints that
fuse q/k/v into one tensor are split at load time by the table's ``hf_take`` (each
family's layout is a ``FusedQKV``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from jaxinfer.models.config import ModelConfig
from jaxinfer import matmul as M
from jaxinfer.models import layers as L
from jaxinfer.models.base import AttentionFn, MatmulFn, WeightSpec, fused_part, init_value
from jaxinfer.models.gpt_config import config_from_hf
from jaxinfer.models.llama import DecoderLayer

# Each family's HF tensor names: the model-level prefix, then names under it ({i}: layer).
# Roles absent from a family are absent from its row.
_NAMES: dict[str, dict[str, str]] = {
    "gpt2": dict(prefix="transformer.", embed="wte", pos="wpe", final_norm="ln_f", layer="h.{i}.",
                 attn_norm="ln_1", mlp_norm="ln_2", qkv="attn.c_attn", o="attn.c_proj",
                 up="mlp.c_fc", down="mlp.c_proj", lm_head="lm_head.weight"),
    "gpt_neox": dict(prefix="gpt_neox.", embed="embed_in", final_norm="final_layer_norm", layer="layers.{i}.",
                     attn_norm="input_layernorm", mlp_norm="post_attention_layernorm",
                     qkv="attention.query_key_value", o="attention.dense", up="mlp.dense_h_to_4h",
                     down="mlp.dense_4h_to_h", lm_head="embed_out.weight"),
    "opt": dict(prefix="model.decoder.", embed="embed_tokens", pos="embed_positions",
                final_norm="final_layer_norm", proj_in="project_in", proj_out="project_out",
                layer="layers.{i}.", attn_norm="self_attn_layer_norm", mlp_norm="final_layer_norm",
                q="self_attn.q_proj", k="self_attn.k_proj", v="self_attn.v_proj", o="self_attn.out_proj",
                up="fc1", down="fc2", lm_head="lm_head.weight"),
    "bloom": dict(prefix="transformer.", embed="word_embeddings", embed_norm="word_embeddings_layernorm",
                  final_norm="ln_f", layer="h.{i}.", attn_norm="input_layernorm",
                  mlp_norm="post_attention_layernorm", qkv="self_attention.query_key_value",
                  o="self_attention.dense", up="mlp.dense_h_to_4h", down="mlp.dense_4h_to_h",
                  lm_head="lm_head.weight"),
    "falcon": dict(prefix="transformer.", embed="word_embeddings", final_norm="ln_f", layer="h.{i}.",
                   attn_norm="input_layernorm", mlp_norm="post_attention_layernorm",
                   qkv="self_attention.query_key_value", o="self_attention.dense",
                   up="mlp.dense_h_to_4h", down="mlp.dense_4h_to_h", lm_head="lm_head.weight"),
    "mpt": dict(prefix="transformer.", embed="wte", final_norm="norm_f", layer="blocks.{i}.",
                attn_norm="norm_1", mlp_norm="norm_2", qkv="attn.Wqkv", o="attn.out_proj",
                up="ffn.up_proj", down="ffn.down_proj", lm_head="lm_head.weight"),
}
_NAMES["gpt_bigcode"] = _NAMES["gpt2"]


def _layer_norm_names(cfg: ModelConfig, names: dict[str, str]) -> dict[str, str]:
    """Our norm -> the family's norm name: Falcon's depend on its architecture flags."""
    g = cfg.gpt
    if g.family != "falcon":
        return {"attn_norm": names["attn_norm"], "mlp_norm": names["mlp_norm"]}
    if g.shared_input_norm:
        return {"attn_norm": "input_layernorm"}
    if g.parallel_residual:
        return {"attn_norm": "ln_attn", "mlp_norm": "ln_mlp"}
    return {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"}


def weight_specs(cfg: ModelConfig) -> dict[str, WeightSpec]:
    """Our parameter path -> its description (the one table; see models/llama.py)."""
    names = _NAMES[cfg.gpt.family]
    pre = names["prefix"]
    specs = _model_specs(cfg, names)
    for i in range(cfg.num_layers):
        specs.update(_layer_specs(cfg, names, i))
    # Other writers' names: the base model's checkpoints (and older hub files, e.g. GPT-2's)
    # have no model-level prefix; transformers 5 names NeoX's head lm_head, Pythia embed_out.
    def alt(name: str) -> str | None:
        if name == "embed_out.weight":
            return "lm_head.weight"
        return name[len(pre):] if name.startswith(pre) else None

    return {p: dataclasses.replace(s, hf_alt=alt(s.hf_name)) for p, s in specs.items()}


def _norm_specs(cfg: ModelConfig, path: str, hf: str) -> dict[str, WeightSpec]:
    """A LayerNorm's weight, and its bias where the family has them."""
    D = cfg.hidden_size
    specs = {path: WeightSpec((D,), (None,), f"{hf}.weight", init="ones")}
    if cfg.gpt.norm_bias:
        specs[f"{path}_b"] = WeightSpec((D,), (None,), f"{hf}.bias", init="zeros")
    return specs


def _model_specs(cfg: ModelConfig, names: dict[str, str]) -> dict[str, WeightSpec]:
    """The weights outside the layers: embeddings, their norm and projections, the final
    norm, the LM head."""
    g, pre = cfg.gpt, names["prefix"]
    D, V = cfg.hidden_size, cfg.vocab_size
    E = g.project_dim or D                         # embedding width (OPT's word_embed_proj_dim)
    specs: dict[str, WeightSpec] = {"embed": WeightSpec((V, E), ("vocab", "embed"), f"{pre}{names['embed']}.weight")}
    if g.positions == "learned":
        specs["pos_embed"] = WeightSpec((g.num_positions + g.position_offset, D), (None, "embed"),
                                        f"{pre}{names['pos']}.weight")
    if g.embed_norm:
        specs.update(_norm_specs(cfg, "embed_norm", pre + names["embed_norm"]))
    if g.project_dim:
        specs["proj_in"] = WeightSpec((E, D), (None, None), f"{pre}{names['proj_in']}.weight", True)
        specs["proj_out"] = WeightSpec((D, E), (None, None), f"{pre}{names['proj_out']}.weight", True)
    if g.final_norm:
        specs.update(_norm_specs(cfg, "final_norm", pre + names["final_norm"]))
    head = f"{pre}{names['embed']}.weight" if cfg.tie_word_embeddings else names["lm_head"]
    specs["lm_head"] = WeightSpec((E, V), ("embed", "vocab"), head, transpose=True)
    return specs


def _layer_specs(cfg: ModelConfig, names: dict[str, str], i: int) -> dict[str, WeightSpec]:
    """Layer ``i``'s weights: its norms, attention (q, k, v cut from a fused matrix where
    the family fuses them) and MLP, with the biases the family has."""
    g = cfg.gpt
    D, F, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    Hq, Hkv = cfg.num_heads * hd, cfg.num_kv_heads * hd
    lin = not g.conv1d                             # torch Linear: [out, in]; GPT-2's Conv1D: [in, out]
    hf, p = names["prefix"] + names["layer"].format(i=i), f"layers.{i}"
    specs: dict[str, WeightSpec] = {}
    for ours, theirs in _layer_norm_names(cfg, names).items():
        specs.update(_norm_specs(cfg, f"{p}.{ours}", hf + theirs))
    for j, (w, b, width, axis) in enumerate((("wq", "bq", Hq, "q_heads"), ("wk", "bk", Hkv, "kv_heads"),
                                              ("wv", "bv", Hkv, "kv_heads"))):
        if g.qkv is not None:
            src = hf + names["qkv"]
            take_w = functools.partial(fused_part, groups=g.qkv.groups, sizes=g.qkv.sizes, part=j,
                                       axis=0 if lin else 1)
            take_b = functools.partial(fused_part, groups=g.qkv.groups, sizes=g.qkv.sizes, part=j)
        else:
            src, take_w, take_b = hf + names[("q", "k", "v")[j]], None, None
        specs[f"{p}.{w}"] = WeightSpec((D, width), ("embed", axis), f"{src}.weight", lin, hf_take=take_w)
        if cfg.qkv_bias:
            specs[f"{p}.{b}"] = WeightSpec((width,), (axis,), f"{src}.bias", init="zeros", hf_take=take_b)
    specs[f"{p}.wo"] = WeightSpec((Hq, D), ("q_heads", "embed"), f"{hf}{names['o']}.weight", lin)
    if cfg.o_bias:
        specs[f"{p}.bo"] = WeightSpec((D,), (None,), f"{hf}{names['o']}.bias", init="zeros")
    specs[f"{p}.w_up"] = WeightSpec((D, F), ("embed", "mlp"), f"{hf}{names['up']}.weight", lin)
    specs[f"{p}.w_down"] = WeightSpec((F, D), ("mlp", "embed"), f"{hf}{names['down']}.weight", lin)
    if cfg.mlp_bias:
        specs[f"{p}.b_up"] = WeightSpec((F,), ("mlp",), f"{hf}{names['up']}.bias", init="zeros")
        specs[f"{p}.b_down"] = WeightSpec((D,), (None,), f"{hf}{names['down']}.bias", init="zeros")
    return specs


class GptLayer(DecoderLayer):
    """One block: LayerNorms, attention with biases, plain MLP; sequential or parallel
    residual, pre- or post-norm, as ``cfg.gpt`` says. Weights and hooks as in DecoderLayer
    (``attention`` and ``mlp`` overridden; ``cos`` / ``sin`` are None without rotary)."""

    # GptForCausalLM runs its layers unrolled (no layer loop), so the runner must not stack
    # their weights or the KV pool for one (models/layer_loop.py, engine/kv_cache.py StackedKV)
    loopable = False

    def _norm(self, name: str, x: jax.Array) -> jax.Array:
        b = getattr(self, f"{name}_b")[...] if self.cfg.gpt.norm_bias else None
        return L.layer_norm(x, getattr(self, name)[...], b, self.cfg.rms_norm_eps)

    def attention(self, h: jax.Array, cos: jax.Array | None, sin: jax.Array | None, attn: AttentionFn,
                  cache: Any, mm: MatmulFn, tp_axis: str | None) -> tuple[jax.Array, Any]:
        """h [T, D] (normed) -> (o [T, D], cache)."""
        cfg, g = self.cfg, self.cfg.gpt
        T, hd = h.shape[0], cfg.head_dim
        if hasattr(self, "wqkv"):     # fused at load time (quantization.fuse_projections)
            q, k, v = jnp.split(mm(h, self.wqkv[...]),
                                [cfg.num_heads * hd, (cfg.num_heads + cfg.num_kv_heads) * hd], axis=-1)
        else:
            q, k, v = mm(h, self.wq[...]), mm(h, self.wk[...]), mm(h, self.wv[...])   # [T, H*hd]
        if cfg.qkv_bias:
            q, k, v = q + self.bq[...], k + self.bk[...], v + self.bv[...]
        if g.clip_qkv is not None:
            q, k, v = (jnp.clip(t, -g.clip_qkv, g.clip_qkv) for t in (q, k, v))
        q, k, v = (t.reshape(T, -1, hd) for t in (q, k, v))                           # [T, H_local, hd]
        if cos is not None:
            q, k = L.apply_partial_rope(q, cos, sin), L.apply_partial_rope(k, cos, sin)
        o, cache = attn(self.index, q, k, v, cache)                                     # [T, Hq_local, hd]
        o = L.all_reduce(mm(o.reshape(T, -1), self.wo[...]), tp_axis)                   # [T, D]
        return (o + self.bo[...] if cfg.o_bias else o), cache

    def mlp(self, h: jax.Array, mm: MatmulFn, tp_axis: str | None) -> jax.Array:
        """h [T, D] (normed) -> [T, D]: up, activation, down (no gate)."""
        u = mm(h, self.w_up[...])                                                      # [T, F_local]
        if self.cfg.mlp_bias:
            u = u + self.b_up[...]
        y = L.all_reduce(mm(L.activation(self.cfg.hidden_act, u), self.w_down[...]), tp_axis)   # [T, D]
        return y + self.b_down[...] if self.cfg.mlp_bias else y

    def __call__(self, x: jax.Array, cos: jax.Array | None, sin: jax.Array | None, attn: AttentionFn,
                 cache: Any, mm: MatmulFn = M.matmul, tp_axis: str | None = None) -> tuple[jax.Array, Any]:
        g = self.cfg.gpt
        with jax.named_scope("attention"):
            h = x if g.post_norm else self._norm("attn_norm", x)
            a, cache = self.attention(h, cos, sin, attn, cache, mm, tp_axis)
        with jax.named_scope("mlp"):
            if g.parallel_residual:
                return x + a + self.mlp(h if g.shared_input_norm else self._norm("mlp_norm", x), mm, tp_axis), cache
            x = x + a
            if g.post_norm:
                x = self._norm("attn_norm", x)
            x = x + self.mlp(x if g.post_norm else self._norm("mlp_norm", x), mm, tp_axis)
            return (self._norm("mlp_norm", x) if g.post_norm else x), cache


class GptForCausalLM(nnx.Module):
    """The model; same call as LlamaForCausalLM (the runner, the reference generator and
    the quality tool drive both alike)."""

    weight_specs = staticmethod(weight_specs)
    config_from_hf = staticmethod(config_from_hf)

    def __init__(self, cfg: ModelConfig, dtype: Any = jnp.float32, *, rngs: nnx.Rngs):
        specs = weight_specs(cfg)
        for name, spec in specs.items():
            if not name.startswith("layers."):
                setattr(self, name, nnx.Param(init_value(spec, rngs.params(), dtype)))
        self.layers = nnx.List([GptLayer(cfg, i, specs, dtype, rngs) for i in range(cfg.num_layers)])
        self.cfg = cfg
        self.dtype = dtype

    def _norm(self, name: str, x: jax.Array) -> jax.Array:
        b = getattr(self, f"{name}_b")[...] if self.cfg.gpt.norm_bias else None
        return L.layer_norm(x, getattr(self, name)[...], b, self.cfg.rms_norm_eps)

    def __call__(self, tokens: jax.Array, positions: jax.Array, kv_cache: Sequence[Any],
                 attn: AttentionFn, logits_index: jax.Array | None = None,
                 mm: MatmulFn = M.matmul, tp_axis: str | None = None) -> tuple[jax.Array, list[Any]]:
        """tokens, positions i32[T] -> (logits f32[S or T, V], caches); see LlamaForCausalLM."""
        cfg, g = self.cfg, self.cfg.gpt
        x = L.embed_lookup(self.embed[...], tokens, tp_axis)                   # [T, E]
        if g.project_dim:
            x = mm(x, self.proj_in[...])                                         # [T, D]
        if g.positions == "learned":
            x = x + self.pos_embed[...][positions + g.position_offset]
        if g.embed_norm:
            x = self._norm("embed_norm", x)
        cos = sin = None
        if g.positions == "rope":
            cos, sin = L.rope_cos_sin(positions, L.rope_inv_freq(cfg, g.rotary_dim))   # [T, rotary_dim]
        new_cache = []
        for layer, c in zip(self.layers, kv_cache):
            x, c = layer(x, cos, sin, attn, c, mm, tp_axis)
            new_cache.append(c)
        if logits_index is not None:
            x = x[logits_index]                                                   # [S, D]
        if g.final_norm:
            x = self._norm("final_norm", x)
        if g.project_dim:
            x = mm(x, self.proj_out[...])                                         # [S, E]
        logits = mm(x, self.lm_head[...]).astype(jnp.float32)                    # [S, V_local]
        if tp_axis is not None:
            logits = jax.lax.all_gather(logits, tp_axis, axis=1, tiled=True)     # [S, V]
        return logits, new_cache
