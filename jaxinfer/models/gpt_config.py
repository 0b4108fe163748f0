"""HF ``config.json`` -> ModelConfig for the GPT-style families (models/gpt.py): GPT-2,
GPT-NeoX (Pythia), OPT, BLOOM, Falcon, GPTBigCode (StarCoder / SantaCoder) and MPT.

Plain data, no jax: models/registry.config_from_hf calls ``config_from_hf`` for these
names. Each family's reader maps its own field names onto one ``GptStyle`` record of
flags; a field whose value we do not implement is refused here, at load time, with its name.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from jaxinfer.bounds import require
from jaxinfer.models.config import ACTIVATIONS, ModelConfig, hf_eos_ids

# HF `architectures` name -> the family's reader (below).
GPT_FAMILY = (
    "GPT2LMHeadModel",
    "GPTNeoXForCausalLM",
    "OPTForCausalLM",
    "BloomForCausalLM",
    "FalconForCausalLM",
    "GPTBigCodeForCausalLM",
    "MptForCausalLM",
)


@dataclass(frozen=True, slots=True)
class FusedQKV:
    """How a checkpoint's fused q/k/v projection orders its output features: ``groups``
    repeats of (q, k, v) blocks of ``sizes`` features each. GPT-2 / MPT: one group of
    (D, D, D); NeoX / BLOOM: one group per head of (hd, hd, hd); Falcon's new architecture:
    one group per KV head of (q_per_kv * hd, hd, hd); multi-query: one group of (D, hd, hd)."""

    groups: int
    sizes: tuple[int, int, int]


@dataclass(frozen=True, slots=True)
class GptStyle:
    """The flags that tell the GPT-style families apart (models/gpt.py reads only these).

    ``positions``: "learned" (a position table added to the embedding, rows start at
    ``position_offset``), "rope" (rotary on the first ``rotary_dim`` features of each head)
    or "alibi" (a per-head linear bias on the attention scores, ``alibi`` the slope rule).
    """

    family: str                         # "gpt2", "gpt_neox", ... (for messages and the README)
    positions: str                      # "learned" | "rope" | "alibi"
    position_offset: int = 0            # OPT: learned rows 0 and 1 are never used
    num_positions: int = 0              # rows of the learned table (without the offset)
    rotary_dim: int = 0                 # rope: features per head that rotate (NeoX: rotary_pct)
    alibi: str = ""                     # "bloom" | "mpt": the slope rule for non-power-of-2 heads
    alibi_bias_max: float = 8.0         # MPT
    parallel_residual: bool = False     # x + attn(norm1 x) + mlp(norm2 x) (NeoX, Falcon)
    shared_input_norm: bool = False     # parallel residual reading one norm (Falcon 7B / 40B-style)
    post_norm: bool = False             # OPT do_layer_norm_before=False: norm after each residual add
    norm_bias: bool = True              # MPT: LayerNorm without bias
    embed_norm: bool = False            # BLOOM: LayerNorm right after the embedding
    final_norm: bool = True             # OPT 350m-style (post-norm) models have none
    project_dim: int = 0                # OPT word_embed_proj_dim != hidden: project_in / out
    clip_qkv: float | None = None       # MPT: clamp the fused q/k/v product to [-c, c]
    qkv: FusedQKV | None = None         # the checkpoint's fused q/k/v layout (None: separate)
    conv1d: bool = False                # GPT-2: Conv1D weights stored [in, out]


def _refuse_rope_scaling(d: Mapping[str, Any], arch: str) -> float:
    """The rope base; any rope scaling is refused naming the field."""
    rp = d.get("rope_parameters") if isinstance(d.get("rope_parameters"), Mapping) else {}
    rs = d.get("rope_scaling") or None
    rtype = (rs or {}).get("rope_type", (rs or {}).get("type")) if rs else rp.get("rope_type", "default")
    require(rtype in (None, "default"), "rope_scaling" if rs else "rope_parameters.rope_type",
            f"{arch}: rope scaling {rtype!r} is not supported (only unscaled rotary)")
    theta = d.get("rope_theta", rp.get("rope_theta", d.get("rotary_emb_base", 10000.0)))
    return float(theta)


class _Reader:
    """``need`` / ``get`` over a config dict, errors naming the field and the architecture."""

    def __init__(self, d: Mapping[str, Any], arch: str):
        self.d, self.arch = d, arch

    def need(self, *keys: str) -> Any:
        for k in keys:
            if self.d.get(k) is not None:
                return self.d[k]
        raise ValueError(f"{keys[0]}: missing from config.json (required for {self.arch})")

    def get(self, key: str, default: Any) -> Any:
        v = self.d.get(key)
        return default if v is None else v

    def refuse(self, key: str, ok: Callable[[Any], bool], default: Any, what: str) -> None:
        v = self.get(key, default)
        require(ok(v), key, f"{self.arch}: {what} (got {v!r})")


def _act(name: str, arch: str, field: str) -> str:
    require(name in ACTIVATIONS, field, f"{arch}: unsupported activation {name!r} "
            f"(supported: {', '.join(ACTIVATIONS)})")
    return name


def _gpt2(r: _Reader) -> dict[str, Any]:
    D, H = int(r.need("n_embd", "hidden_size")), int(r.need("n_head", "num_attention_heads"))
    r.refuse("scale_attn_by_inverse_layer_idx", lambda v: not v, False, "per-layer attention scaling is not supported")
    r.refuse("scale_attn_weights", bool, True, "unscaled attention is not supported")
    npos = int(r.need("n_positions", "max_position_embeddings"))
    return dict(hidden_size=D, num_heads=H, num_kv_heads=H, num_layers=int(r.need("n_layer", "num_hidden_layers")),
                intermediate_size=int(r.get("n_inner", 4 * D)), max_position_embeddings=npos,
                rms_norm_eps=float(r.get("layer_norm_epsilon", 1e-5)),
                hidden_act=_act(r.get("activation_function", "gelu_new"), r.arch, "activation_function"),
                tie_word_embeddings=bool(r.get("tie_word_embeddings", True)),
                qkv_bias=True, o_bias=True, mlp_bias=True,
                gpt=GptStyle("gpt2", "learned", num_positions=npos, conv1d=True,
                             qkv=FusedQKV(1, (D, D, D))))


def _gpt_bigcode(r: _Reader) -> dict[str, Any]:
    out = _gpt2(r)
    D, H = out["hidden_size"], out["num_heads"]
    hd = D // H
    mq = bool(r.get("multi_query", True))
    qkv = FusedQKV(1, (D, hd, hd)) if mq else FusedQKV(H, (hd, hd, hd))
    out.update(num_kv_heads=1 if mq else H,
               hidden_act=_act(r.get("activation_function", "gelu_pytorch_tanh"), r.arch, "activation_function"),
               gpt=dataclasses.replace(out["gpt"], family="gpt_bigcode", conv1d=False, qkv=qkv))
    return out


def _gpt_neox(r: _Reader) -> dict[str, Any]:
    D, H = int(r.need("hidden_size")), int(r.need("num_attention_heads"))
    hd = D // H
    rp = r.d.get("rope_parameters") if isinstance(r.d.get("rope_parameters"), Mapping) else {}
    pct = float(rp.get("partial_rotary_factor", r.get("rotary_pct", 0.25)))
    rot = int(hd * pct)
    require(0 < rot <= hd and rot % 2 == 0, "rotary_pct",
            f"{r.arch}: rotates {rot} of {hd} features per head; must be even and > 0")
    bias = bool(r.get("attention_bias", True))
    return dict(hidden_size=D, num_heads=H, num_kv_heads=H, num_layers=int(r.need("num_hidden_layers")),
                intermediate_size=int(r.need("intermediate_size")),
                max_position_embeddings=int(r.get("max_position_embeddings", 2048)),
                rms_norm_eps=float(r.get("layer_norm_eps", 1e-5)),
                rope_theta=_refuse_rope_scaling(r.d, r.arch),
                hidden_act=_act(r.get("hidden_act", "gelu"), r.arch, "hidden_act"),
                tie_word_embeddings=bool(r.get("tie_word_embeddings", False)),
                qkv_bias=bias, o_bias=bias, mlp_bias=True,
                gpt=GptStyle("gpt_neox", "rope", rotary_dim=rot,
                             parallel_residual=bool(r.get("use_parallel_residual", True)),
                             qkv=FusedQKV(H, (hd, hd, hd))))


def _opt(r: _Reader) -> dict[str, Any]:
    D, H = int(r.need("hidden_size")), int(r.need("num_attention_heads"))
    r.refuse("layer_norm_elementwise_affine", bool, True, "LayerNorm without weights is not supported")
    pre = bool(r.get("do_layer_norm_before", True))
    proj = int(r.get("word_embed_proj_dim", D))
    bias = bool(r.get("enable_bias", True))
    npos = int(r.get("max_position_embeddings", 2048))
    return dict(hidden_size=D, num_heads=H, num_kv_heads=H, num_layers=int(r.need("num_hidden_layers")),
                intermediate_size=int(r.need("ffn_dim")), max_position_embeddings=npos,
                rms_norm_eps=1e-5,    # OPT's LayerNorm default; its config has no field for it
                hidden_act=_act(r.get("activation_function", "relu"), r.arch, "activation_function"),
                tie_word_embeddings=bool(r.get("tie_word_embeddings", True)),
                qkv_bias=bias, o_bias=bias, mlp_bias=bias,
                gpt=GptStyle("opt", "learned", position_offset=2, num_positions=npos, post_norm=not pre,
                             final_norm=pre and not r.get("_remove_final_layer_norm", False),
                             project_dim=proj if proj != D else 0))


def _bloom(r: _Reader) -> dict[str, Any]:
    D, H = int(r.need("hidden_size", "n_embed")), int(r.need("n_head", "num_attention_heads"))
    hd = D // H
    r.refuse("apply_residual_connection_post_layernorm", lambda v: not v, False,
             "residuals taken after the layer norm are not supported")
    r.refuse("pretraining_tp", lambda v: v == 1 or not r.get("slow_but_exact", False), 1,
             "slow_but_exact tensor-parallel emulation is not supported")
    return dict(hidden_size=D, num_heads=H, num_kv_heads=H, num_layers=int(r.need("n_layer", "num_hidden_layers")),
                intermediate_size=4 * D, max_position_embeddings=int(r.get("seq_length", 2048)),
                rms_norm_eps=float(r.get("layer_norm_epsilon", 1e-5)), hidden_act="gelu_new",
                tie_word_embeddings=bool(r.get("tie_word_embeddings", True)),
                qkv_bias=True, o_bias=True, mlp_bias=True,
                gpt=GptStyle("bloom", "alibi", alibi="bloom", embed_norm=True, qkv=FusedQKV(H, (hd, hd, hd))))


def _falcon(r: _Reader) -> dict[str, Any]:
    D, H = int(r.need("hidden_size")), int(r.need("num_attention_heads"))
    hd = int(r.get("head_dim", D // H))
    r.refuse("alibi", lambda v: not v, False, "ALiBi Falcon (falcon-rw) is not supported; "
             "BLOOM and MPT use ALiBi")
    new = bool(r.get("new_decoder_architecture", False))
    parallel = bool(r.get("parallel_attn", True))
    require(parallel or not new, "parallel_attn",
            f"{r.arch}: new_decoder_architecture needs parallel_attn (transformers has no other form)")
    if new:
        kvh = int(r.get("num_kv_heads", H))
        qkv = FusedQKV(kvh, ((H // kvh) * hd, hd, hd))
    elif r.get("multi_query", True):
        kvh, qkv = 1, FusedQKV(1, (H * hd, hd, hd))
    else:
        kvh, qkv = H, FusedQKV(H, (hd, hd, hd))
    n_ln = r.get("num_ln_in_parallel_attn", 2 if new else 1)
    bias = bool(r.get("bias", False))
    return dict(hidden_size=D, num_heads=H, num_kv_heads=kvh, head_dim=hd,
                num_layers=int(r.need("num_hidden_layers")),
                intermediate_size=int(r.get("ffn_hidden_size", 4 * D)),
                max_position_embeddings=int(r.get("max_position_embeddings", 2048)),
                rms_norm_eps=float(r.get("layer_norm_epsilon", 1e-5)),
                rope_theta=_refuse_rope_scaling(r.d, r.arch),
                hidden_act=_act(r.get("activation", "gelu"), r.arch, "activation"),
                tie_word_embeddings=bool(r.get("tie_word_embeddings", True)),
                qkv_bias=bias, o_bias=bias, mlp_bias=bias,
                gpt=GptStyle("falcon", "rope", rotary_dim=hd, parallel_residual=parallel,
                             shared_input_norm=parallel and n_ln == 1, qkv=qkv))


def _mpt(r: _Reader) -> dict[str, Any]:
    D, H = int(r.need("d_model", "hidden_size")), int(r.need("n_heads", "num_attention_heads"))
    ac = r.get("attn_config", {})
    ac = ac if isinstance(ac, Mapping) else {}
    a = _Reader(ac, r.arch)
    a.refuse("alibi", bool, True, "MPT without ALiBi is not supported")
    a.refuse("qk_ln", lambda v: not v, False, "q/k layer norms are not supported")
    a.refuse("prefix_lm", lambda v: not v, False, "prefix-LM attention is not supported")
    a.refuse("attn_uses_sequence_id", lambda v: not v, False, "sequence-id attention is not supported")
    r.refuse("no_bias", bool, True, "biases are not supported (transformers' MPT has none either)")
    r.refuse("logit_scale", lambda v: v is None, None, "logit scaling is not supported")
    clip = a.get("clip_qkv", None)
    scale = a.get("softmax_scale", None)
    return dict(hidden_size=D, num_heads=H, num_kv_heads=H, num_layers=int(r.need("n_layers", "num_hidden_layers")),
                # transformers' MptMLP is 4 x d_model whatever expansion_ratio says, and so are
                # the checkpoints it saves; a GGUF's converter names its real width (gguf_gpt.py).
                intermediate_size=int(r.get("ffn_hidden_size", 4 * D)),
                max_position_embeddings=int(r.get("max_seq_len", 2048)),
                rms_norm_eps=float(r.get("layer_norm_epsilon", 1e-5)), hidden_act="gelu",
                attn_scale=None if scale is None else float(scale),
                tie_word_embeddings=bool(r.get("tie_word_embeddings", True)),
                gpt=GptStyle("mpt", "alibi", alibi="mpt", alibi_bias_max=float(a.get("alibi_bias_max", 8)),
                             norm_bias=False, clip_qkv=None if not clip else float(clip),
                             qkv=FusedQKV(1, (D, D, D))))


_READERS: dict[str, Callable[[_Reader], dict[str, Any]]] = {
    "GPT2LMHeadModel": _gpt2, "GPTNeoXForCausalLM": _gpt_neox, "OPTForCausalLM": _opt,
    "BloomForCausalLM": _bloom, "FalconForCausalLM": _falcon,
    "GPTBigCodeForCausalLM": _gpt_bigcode, "MptForCausalLM": _mpt,
}


def config_from_hf(d: Mapping[str, Any]) -> ModelConfig:
    """A ModelConfig for one of GPT_FAMILY from its HF config dict."""
    arch = d["architectures"][0]
    r = _Reader(d, arch)
    fields = _READERS[arch](r)
    fields.setdefault("head_dim", fields["hidden_size"] // fields["num_heads"])
    require(fields["head_dim"] * fields["num_heads"] == fields["hidden_size"] or arch == "FalconForCausalLM",
            "num_attention_heads", f"{arch}: hidden size {fields['hidden_size']} is not a multiple "
            f"of {fields['num_heads']} heads")
    return ModelConfig(architecture=arch, vocab_size=int(r.need("vocab_size")),
                       bos_token_id=d.get("bos_token_id"), eos_token_ids=hf_eos_ids(d), **fields)
