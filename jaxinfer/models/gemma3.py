"""Gemma 3 (text): ``Gemma3ForCausalLM`` (HF) and the GGUF architecture ``gemma3``.

What differs from the Llama family, each a hook of llama.py's classes or a config field:
* RMSNorm scales by (1 + w) in float32 (layers.rms_norm_plus_one), on q and k too;
* four norms per layer: input, post-attention, pre-feedforward, post-feedforward;
* sliding-window and global layers interleaved (``layer_types``), each kind with its own
  rotary base (rope_local_base_freq unscaled vs rope_theta with rope_scaling);
* softmax scale query_pre_attn_scalar ** -0.5; final logit soft-capping where configured;
* embeddings multiplied by sqrt(hidden_size), rounded to the embedding dtype as HF does;
* gelu_pytorch_tanh gated MLP and a tied head (config flags the Llama code already reads).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer import matmul as M
from jaxinfer.models import layers as L
from jaxinfer.models.base import AttentionFn, MatmulFn, WeightSpec
from jaxinfer.models.config import (LAYER_TYPES, ModelConfig, RopeScaling, hf_common_fields,
                                     rope_scaling_from_hf)
from jaxinfer.models.llama import DecoderLayer, LlamaForCausalLM
from jaxinfer.models.llama import weight_specs as llama_weight_specs

ARCHITECTURE = "Gemma3ForCausalLM"
log = logging.getLogger("jaxinfer")


def weight_specs(cfg: ModelConfig) -> dict[str, WeightSpec]:
    """The Llama table (Gemma's norms are stored as w with (1 + w) applied, so they start at
    zero) plus the post-attention and pre/post-feedforward norms."""
    specs = {}
    for path, spec in llama_weight_specs(cfg).items():
        if spec.init == "ones":           # every norm
            spec = dataclasses.replace(spec, init="zeros")
        if path.endswith(".mlp_norm"):    # Llama's post_attention_layernorm is Gemma's pre-FFN
            spec = dataclasses.replace(spec, hf_name=spec.hf_name.replace(
                "post_attention_layernorm", "pre_feedforward_layernorm"))
        specs[path] = spec
    D = cfg.hidden_size
    for i in range(cfg.num_layers):
        hf = f"model.layers.{i}"
        specs[f"layers.{i}.post_attn_norm"] = WeightSpec(
            (D,), (None,), f"{hf}.post_attention_layernorm.weight", init="zeros")
        specs[f"layers.{i}.post_mlp_norm"] = WeightSpec(
            (D,), (None,), f"{hf}.post_feedforward_layernorm.weight", init="zeros")
    return specs


def _rope_params(d: Mapping[str, Any]) -> tuple[float, float, RopeScaling | None]:
    """(global base, local base, global scaling) from either config form: transformers >= 5
    ``rope_parameters`` per layer type, or rope_theta / rope_local_base_freq / rope_scaling."""
    rp = d.get("rope_parameters")
    if isinstance(rp, Mapping) and ("full_attention" in rp or "sliding_attention" in rp):
        full = dict(rp.get("full_attention") or {})
        local = dict(rp.get("sliding_attention") or {})
    else:
        full = dict(d.get("rope_scaling") or {})
        full["rope_theta"] = d.get("rope_theta", 1_000_000.0)
        local = {"rope_theta": d.get("rope_local_base_freq", 10_000.0)}
    ltype = local.get("rope_type", local.get("type", "default"))
    if ltype not in (None, "default"):
        raise ValueError(f"rope_parameters.sliding_attention.rope_type: unsupported {ltype!r} "
                         "(sliding layers support the default rotary only)")
    ftype = full.get("rope_type", full.get("type", "default"))
    scaling = rope_scaling_from_hf(full, ftype) if ftype not in (None, "default") else None
    return (float(full.get("rope_theta", 1_000_000.0)), float(local.get("rope_theta", 10_000.0)),
            scaling)


def config_from_hf(d: Mapping[str, Any]) -> ModelConfig:
    """Gemma3TextConfig (config.json) -> ModelConfig; unsupported options name their field."""
    if d.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention: bidirectional Gemma 3 attention is not "
                         "supported (causal decoding only)")
    fields = hf_common_fields({**d, "hidden_act": d.get("hidden_activation",
                                                          d.get("hidden_act", "gelu_pytorch_tanh"))},
                              ARCHITECTURE)
    n = fields["num_layers"]
    types = d.get("layer_types")
    if types is None:
        pattern = int(d.get("sliding_window_pattern", 6))
        if pattern < 1:
            raise ValueError(f"sliding_window_pattern: must be >= 1, got {pattern}")
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
    if not isinstance(types, (list, tuple)) or any(t not in LAYER_TYPES for t in types):
        raise ValueError(f"layer_types: expected a list of {', '.join(LAYER_TYPES)}, got {types!r}")
    if d.get("attn_logit_softcapping") is not None:
        log.warning("attn_logit_softcapping=%s is ignored for Gemma 3 (as transformers does)",
                    d["attn_logit_softcapping"])
    theta, local_theta, scaling = _rope_params(d)
    window = d.get("sliding_window", 4096)
    qpas = d.get("query_pre_attn_scalar", 256)
    fields.update(
        rope_theta=theta, rope_scaling=scaling, rope_local_theta=local_theta,
        layer_types=tuple(types),
        sliding_window=int(window) if window else None,
        attn_scale=float(qpas) ** -0.5,
        # transformers' Gemma 3 reads attn_logit_softcapping but never applies it (Gemma 2
        # did); the reference wins, and the user is told.
        attn_soft_cap=None,
        final_soft_cap=_opt_float(d.get("final_logit_softcapping")),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", True)),
        qk_norm=True, qkv_bias=bool(d.get("attention_bias", False)),
        o_bias=bool(d.get("attention_bias", False)), mlp_bias=False,
    )
    return ModelConfig(**fields)


def _opt_float(v: Any) -> float | None:
    return None if v is None else float(v)


class Gemma3DecoderLayer(DecoderLayer):
    # Not through the layer loop (models/layer_loop.py), even when every layer is alike:
    # measured (session 35, a tiny Gemma 3 with non-zero norm weights, all layers global)
    # the looped engine's logprobs differ from the unrolled one's in the last bit; the
    # (1 + w) norms are the suspect (with w = 0 the two agree). Real Gemma 3 checkpoints
    # mix sliding and global layers and unrolled anyway.
    loopable = False

    def norm(self, x: jax.Array, w: jax.Array) -> jax.Array:
        return L.rms_norm_plus_one(x, w, self.cfg.rms_norm_eps)

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array,
                 attn: AttentionFn, cache: Any, mm: MatmulFn = M.matmul,
                 tp_axis: str | None = None) -> tuple[jax.Array, Any]:
        """x [T, D]: norm -> attention -> norm -> residual; norm -> MLP -> norm -> residual."""
        with jax.named_scope("attention"):
            o, cache = self.attention(self.norm(x, self.attn_norm[...]), cos, sin, attn,
                                      cache, mm, tp_axis)
            x = x + self.norm(o, self.post_attn_norm[...])
        with jax.named_scope("mlp"):
            y = self.mlp(self.norm(x, self.mlp_norm[...]), mm, tp_axis)
            x = x + self.norm(y, self.post_mlp_norm[...])
        return x, cache


class Gemma3ForCausalLM(LlamaForCausalLM):
    layer_class = Gemma3DecoderLayer
    weight_specs = staticmethod(weight_specs)
    config_from_hf = staticmethod(config_from_hf)
    # Not yet checked against tp=1 under shard_map: refused at load (loading.build_model).
    tensor_parallel = False

    def embed_tokens(self, tokens: jax.Array, tp_axis: str | None) -> jax.Array:
        x = L.embed_lookup(self.embed[...], tokens, tp_axis)                 # [T, D]
        # HF: a float32 scalar sqrt(hidden) cast to the embedding's dtype, then the product.
        return x * jnp.asarray(np.float32(self.cfg.hidden_size ** 0.5), x.dtype)

    def final_logits(self, x: jax.Array, mm: MatmulFn) -> jax.Array:
        x = L.rms_norm_plus_one(x, self.final_norm[...], self.cfg.rms_norm_eps)
        logits = mm(x, self.lm_head[...]).astype(jnp.float32)                 # [S, V_local]
        return L.soft_cap(logits, self.cfg.final_soft_cap)
