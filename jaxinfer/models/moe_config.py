"""HF ``config.json`` -> ModelConfig for the mixture-of-experts families (models/mixtral.py):
Mixtral, Qwen2-MoE and Qwen3-MoE.

Plain data, no jax: models/registry.config_from_hf calls ``config_from_hf`` for these
names. The attention is the Llama family's (read by models/config.hf_common_fields as for
Mistral, Qwen2 or Qwen3); the MLP's routing is one ``MoeStyle`` record. A field whose value
we do not implement is refused here, at load time, with its name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from jaxinfer.models.config import ModelConfig, hf_common_fields

# HF `architectures` name -> the HF model it borrows its attention from (models/config.hf_common_fields).
MOE_FAMILY = {
    "MixtralForCausalLM": "MistralForCausalLM",
    "Qwen2MoeForCausalLM": "Qwen2ForCausalLM",
    "Qwen3MoeForCausalLM": "Qwen3ForCausalLM",
}


@dataclass(frozen=True, slots=True)
class MoeStyle:
    """What a mixture-of-experts MLP needs beyond the Llama layer.

    Each token's router logits go through a softmax (float32) and its ``top_k`` experts are
    kept, their weights renormalized to sum to 1 when ``norm_topk_prob``. ``sparse`` says
    per layer whether it has experts (Qwen's ``mlp_only_layers`` / ``decoder_sparse_step``;
    the others have a dense gated MLP of intermediate_size). Qwen2-MoE adds a shared
    expert of ``shared_expert_size`` to every token, scaled by sigmoid(x @ shared gate)."""

    family: str                        # "mixtral" | "qwen2_moe" | "qwen3_moe" (HF names, README)
    num_experts: int
    top_k: int
    expert_size: int                   # each expert's MLP width
    norm_topk_prob: bool
    sparse: tuple[bool, ...]
    shared_expert_size: int = 0

    def __post_init__(self) -> None:
        for name in ("num_experts", "top_k", "expert_size"):
            v = getattr(self, name)
            if not (isinstance(v, int) and v > 0):
                raise ValueError(f"{name}: must be a positive integer, got {v!r}")
        if self.top_k > self.num_experts:
            raise ValueError(f"num_experts_per_tok: {self.top_k} is more than the {self.num_experts} experts")


def _refuse(d: Mapping[str, Any], key: str, ok: Any, arch: str, why: str) -> None:
    if key in d and d[key] is not None and not ok(d[key]):
        raise ValueError(f"{key}: {d[key]!r} is not supported for {arch} ({why})")


def config_from_hf(d: Mapping[str, Any]) -> ModelConfig:
    """A ModelConfig for one of MOE_FAMILY from its HF config dict."""
    arch = d["architectures"][0]
    # (Qwen3-MoE's sliding window is read below; the dense Qwen readers refuse it)
    fields = hf_common_fields({**d, "use_sliding_window": False}, MOE_FAMILY[arch])
    fields["architecture"] = arch
    n = fields["num_layers"]
    experts = d.get("num_local_experts", d.get("num_experts"))
    if experts is None:
        raise ValueError(f"num_experts: missing from config.json (required for {arch})")
    if arch == "MixtralForCausalLM":
        family, size, norm, sparse, shared = "mixtral", fields["intermediate_size"], True, (True,) * n, 0
    else:
        family = "qwen3_moe" if arch == "Qwen3MoeForCausalLM" else "qwen2_moe"
        size = int(d.get("moe_intermediate_size") or 0)
        norm = bool(d.get("norm_topk_prob", False))
        step = int(d.get("decoder_sparse_step", 1))
        if step < 1:
            raise ValueError(f"decoder_sparse_step: must be >= 1, got {step}")
        only = set(d.get("mlp_only_layers") or ())
        sparse = tuple(i not in only and int(experts) > 0 and (i + 1) % step == 0 for i in range(n))
        shared = int(d.get("shared_expert_intermediate_size") or 0) if family == "qwen2_moe" else 0
        if family == "qwen2_moe":
            fields["qkv_bias"] = bool(d.get("qkv_bias", True))
        if d.get("use_sliding_window"):
            if family == "qwen2_moe":
                raise ValueError(f"use_sliding_window: sliding-window layers are not supported for {arch}")
            fields["sliding_window"] = int(d["sliding_window"]) if d.get("sliding_window") else None
    moe = MoeStyle(family, int(experts), int(d.get("num_experts_per_tok", 2)), size, norm, sparse, shared)
    return ModelConfig(**fields, moe=moe)
