"""The model's shape, ``ModelConfig`` (with its ``RopeScaling``), and how an HF config.json
fills it.

Every ``ModelConfig`` field changes compiled shapes or code (it is a static argument of the
jitted step), validated once in ``__post_init__`` with errors that name the field.
``hf_common_fields`` reads config.json as the Llama family names its fields; the other
families start from it (models/phi3.py, gemma3.py, moe_config.py) or read their own names
(models/gpt_config.py), and models/registry.config_from_hf picks the family. Plain data,
no jax.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from jaxinfer.bounds import require

# HF `architectures` names that the Llama-family model file serves (see models/registry.py).
LLAMA_FAMILY = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)
# Activations a model's MLP may name (models/layers.py ``activation``); "gelu_new" is
# GPT-2's name for the tanh approximation.
ACTIVATIONS = ("silu", "gelu", "gelu_pytorch_tanh", "gelu_new", "relu")
# HF `layer_types` entries ModelConfig understands (see ModelConfig.layer_window).
LAYER_TYPES = ("full_attention", "sliding_attention")
# RopeScaling.rope_type values models/layers.rope_inv_freq implements.
ROPE_TYPES = ("llama3", "linear", "longrope", "default")


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """Rotary frequency scaling: ``llama3`` (Llama 3.1+), ``linear`` and ``longrope``
    (Phi-3: per-frequency divisors, ``short_factor`` or ``long_factor``, and cos / sin
    scaled by ``attention_factor``).

    Longrope: transformers uses the long factors for a forward whose sequence passes
    original_max_position_embeddings and the short ones otherwise, so a token's rotation
    there depends on how long its sequence has grown (and on what shares its forward). We
    pick one set per engine instead (``use_long``; models/base.fit_context): the long
    factors when the engine's max_model_len exceeds original_max_position_embeddings,
    else the short ones. Both agree with transformers where its own choice is the same."""

    rope_type: str
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float = 1.0
    use_long: bool = False

    def __post_init__(self) -> None:
        require(self.rope_type in ROPE_TYPES, "rope_scaling.rope_type",
                f"unsupported rope scaling {self.rope_type!r} (supported: {', '.join(ROPE_TYPES)})")
        require(self.factor > 0, "rope_scaling.factor", f"must be > 0, got {self.factor}")
        if self.rope_type == "longrope":
            require(len(self.short_factor) > 0 and len(self.short_factor) == len(self.long_factor),
                    "rope_scaling.short_factor", "longrope needs short_factor and long_factor lists "
                    f"of one length (got {len(self.short_factor)} and {len(self.long_factor)})")
            require(all(f > 0 for f in self.short_factor + self.long_factor), "rope_scaling.long_factor",
                    "longrope factors must be > 0")
            require(self.attention_factor > 0, "rope_scaling.attention_factor",
                    f"must be > 0, got {self.attention_factor}")

    @property
    def ext_factors(self) -> tuple[float, ...]:
        """Longrope's divisors of the inverse frequencies in use."""
        return self.long_factor if self.use_long else self.short_factor


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """The shape of a decoder-only transformer of the Llama family.

    Names follow HF ``config.json`` where one exists; ``models.registry.config_from_hf`` maps the rest.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False          # Qwen2: bias on q/k/v; Llama `attention_bias`: on q/k/v/o
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False           # Qwen3: RMSNorm over head_dim on q and k before rotary
    sliding_window: int | None = None  # Mistral: attend to at most this many previous tokens
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Per-layer attention (Gemma 2/3): HF's `layer_types` ("sliding_attention" layers use
    # `sliding_window`, "full_attention" layers see everything); None: every layer uses
    # `sliding_window`. Read through `layer_window` / `attention_kwargs`, never directly.
    layer_types: tuple[str, ...] | None = None
    attn_scale: float | None = None      # softmax scale; None: head_dim ** -0.5
    attn_soft_cap: float | None = None   # scores -> cap * tanh(scores / cap) (attn_logit_softcapping)
    final_soft_cap: float | None = None  # the same on the logits (final_logit_softcapping)
    rope_local_theta: float | None = None  # rotary base of sliding layers (rope_local_base_freq)
    gpt: Any = None                 # models/gpt_config.GptStyle for the GPT-style families, else None
    rotary_dim: int | None = None   # features per head that rotate (Phi-3's partial_rotary_factor); None: all
    moe: Any = None                 # models/moe_config.MoeStyle for mixture-of-experts models, else None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
            v = getattr(self, name)
            require(isinstance(v, int) and v > 0, name, f"must be a positive integer, got {v!r}")
        require(self.num_heads % self.num_kv_heads == 0, "num_key_value_heads",
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})")
        require(self.head_dim % 2 == 0, "head_dim", f"must be even for rotary, got {self.head_dim}")
        require(self.rms_norm_eps > 0, "rms_norm_eps", f"must be > 0, got {self.rms_norm_eps}")
        require(self.rope_theta > 0, "rope_theta", f"must be > 0, got {self.rope_theta}")
        require(self.hidden_act in ACTIVATIONS, "hidden_act",
                f"unsupported activation {self.hidden_act!r} (supported: {', '.join(ACTIVATIONS)})")
        require(self.sliding_window is None or self.sliding_window > 0, "sliding_window",
                f"must be a positive integer or null, got {self.sliding_window!r}")
        if self.layer_types is not None:
            require(len(self.layer_types) == self.num_layers, "layer_types",
                    f"has {len(self.layer_types)} entries for {self.num_layers} layers")
            bad = sorted(set(self.layer_types) - set(LAYER_TYPES))
            require(not bad, "layer_types", f"unsupported layer type(s) {bad} (supported: "
                    f"{', '.join(LAYER_TYPES)})")
            require("sliding_attention" not in self.layer_types or self.sliding_window is not None,
                    "sliding_window", "layer_types has sliding_attention layers but no window")
        rd = self.rotary_dim
        require(rd is None or (isinstance(rd, int) and 0 < rd <= self.head_dim and rd % 2 == 0),
                "partial_rotary_factor", f"rotates {rd} features per head: must be even and in "
                f"(0, head_dim={self.head_dim}]")
        rs = self.rope_scaling
        if rs is not None and rs.rope_type == "longrope":
            require(len(rs.short_factor) == (rd or self.head_dim) // 2, "rope_scaling.short_factor",
                    f"has {len(rs.short_factor)} entries, expected rotated features / 2 = "
                    f"{(rd or self.head_dim) // 2}")
        for name in ("attn_scale", "attn_soft_cap", "final_soft_cap", "rope_local_theta"):
            v = getattr(self, name)
            require(v is None or v > 0, name, f"must be > 0 or null, got {v!r}")

    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def sm_scale(self) -> float:
        return self.attn_scale if self.attn_scale is not None else self.head_dim ** -0.5

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of layer ``layer`` (None: full attention)."""
        if self.layer_types is None:
            return self.sliding_window
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None

    def layer_rope(self, layer: int) -> tuple[float, "RopeScaling | None"]:
        """(rotary base, scaling) of layer ``layer``: sliding layers use ``rope_local_theta``
        unscaled when it is set (Gemma 3), every other layer rope_theta / rope_scaling."""
        if self.rope_local_theta is not None and self.layer_window(layer) is not None:
            return self.rope_local_theta, None
        return self.rope_theta, self.rope_scaling

    def attention_kwargs(self, layer: int) -> dict[str, Any]:
        """The static keyword arguments every attention implementation takes for ``layer``
        (pallas_kernels/attention/xla.py's signature): the one place a layer's attention options are read."""
        return {"sm_scale": self.sm_scale, "sliding_window": self.layer_window(layer),
                "soft_cap": self.attn_soft_cap}


def hf_common_fields(d: Mapping[str, Any], arch: str) -> dict[str, Any]:
    """ModelConfig fields of an HF config.json dict as the Llama family reads them; other
    families start from these and override/add their own."""
    def need(key: str) -> Any:
        if key not in d or d[key] is None:
            raise ValueError(f"{key}: missing from config.json (required for {arch})")
        return d[key]

    num_heads = int(need("num_attention_heads"))
    hidden = int(need("hidden_size"))
    head_dim = d.get("head_dim") or hidden // num_heads
    theta, scaling = _hf_rope(d)
    eos_ids = hf_eos_ids(d)
    is_qwen2 = arch == "Qwen2ForCausalLM"
    attn_bias = bool(d.get("attention_bias", False))
    sliding = None
    if arch == "MistralForCausalLM":
        sliding = d.get("sliding_window")
    elif arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and d.get("use_sliding_window"):
        raise ValueError("use_sliding_window: Qwen sliding-window layers are not supported")
    return dict(
        architecture=arch,
        vocab_size=int(need("vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(need("intermediate_size")),
        num_layers=int(need("num_hidden_layers")),
        num_heads=num_heads,
        num_kv_heads=int(d.get("num_key_value_heads") or num_heads),
        head_dim=int(head_dim),
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        rope_theta=float(theta if theta is not None else 10000.0),
        rope_scaling=scaling,
        max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        qkv_bias=is_qwen2 or attn_bias,
        o_bias=attn_bias and not is_qwen2,
        mlp_bias=bool(d.get("mlp_bias", False)),
        qk_norm=arch == "Qwen3ForCausalLM",
        sliding_window=int(sliding) if sliding else None,
        hidden_act=str(d.get("hidden_act", "silu")),
        bos_token_id=d.get("bos_token_id"),
        eos_token_ids=eos_ids,
    )


def _hf_rope(d: Mapping[str, Any]) -> tuple[Any, RopeScaling | None]:
    """(rope_theta as written or None, rope scaling) from either config form: rope_theta and
    rope_scaling, or transformers >= 5's `rope_parameters`, which folds both into one dict."""
    rp = d.get("rope_parameters") if isinstance(d.get("rope_parameters"), Mapping) else None
    rs = d.get("rope_scaling") or None
    if rs is None and rp is not None and rp.get("rope_type", "default") != "default":
        rs = rp
    scaling = None
    if rs:
        rtype = rs.get("rope_type", rs.get("type"))
        if rtype == "longrope":
            scaling = _longrope(d, rs)
        elif rtype not in (None, "default"):
            scaling = rope_scaling_from_hf(rs, rtype)
    theta = d.get("rope_theta")
    if theta is None and rp is not None:
        theta = rp.get("rope_theta")
    return theta, scaling


def rope_scaling_from_hf(rs: Mapping[str, Any], rope_type: str) -> RopeScaling:
    """A llama3 / linear scaling from an HF rope_scaling (or rope_parameters) dict."""
    return RopeScaling(
        rope_type=rope_type,
        factor=float(rs.get("factor", 1.0)),
        low_freq_factor=float(rs.get("low_freq_factor", 1.0)),
        high_freq_factor=float(rs.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(rs.get("original_max_position_embeddings", 8192)),
    )


def hf_eos_ids(d: Mapping[str, Any]) -> tuple[int, ...]:
    """config.json's ``eos_token_id``: one id, a list of them, or none."""
    eos = d.get("eos_token_id")
    ids = eos if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
    return tuple(int(e) for e in ids)


def _longrope(d: Mapping[str, Any], rs: Mapping[str, Any]) -> RopeScaling:
    """Longrope's fields as transformers reads them: a top-level
    original_max_position_embeddings wins (Phi-3 keeps it there); ``factor`` defaults to
    max_position_embeddings / original; ``attention_factor`` to sqrt(1 + ln factor / ln
    original) (1 where factor <= 1)."""
    orig = int(d.get("original_max_position_embeddings") or rs.get("original_max_position_embeddings")
               or d.get("max_position_embeddings", 2048))
    factor = rs.get("factor")
    factor = float(factor) if factor is not None else d.get("max_position_embeddings", orig) / orig
    att = rs.get("attention_factor")
    if att is None:
        att = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))

    def factors(key: str) -> tuple[float, ...]:
        v = rs.get(key)
        require(isinstance(v, (list, tuple)) and all(isinstance(x, (int, float)) for x in v),
                f"rope_scaling.{key}", f"longrope needs a list of numbers, got {v!r:.80}")
        return tuple(float(x) for x in v)

    return RopeScaling("longrope", factor=factor, original_max_position_embeddings=orig,
                       short_factor=factors("short_factor"), long_factor=factors("long_factor"),
                       attention_factor=float(att))
