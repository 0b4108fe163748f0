"""Phi-3 (``Phi3ForCausalLM``): the Llama layer with fused checkpoint tensors.

What differs from the Llama family, each a config field or a weight-table entry:
* the checkpoint fuses q/k/v into ``qkv_proj`` and gate/up into ``gate_up_proj``; the
  weight table splits them at load time (``hf_take``), so the model, quantization, the
  CPU kernels' fused layouts and tensor parallelism see Llama's separate weights;
* ``sliding_window`` from its config (every layer), ``partial_rotary_factor`` (rotary on
  the first features of each head);
* longrope rotary scaling (models/config.RopeScaling): short / long per-frequency factors and an
  attention factor on cos / sin; which factor set applies is chosen once per engine from
  its max_model_len (models/base.fit_context), not per forward as transformers does.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Mapping

from jaxinfer.models.config import ModelConfig, hf_common_fields
from jaxinfer.models.base import WeightSpec, fused_part
from jaxinfer.models.llama import LlamaForCausalLM
from jaxinfer.models.llama import weight_specs as llama_weight_specs

ARCHITECTURE = "Phi3ForCausalLM"
# Phi-3's rope types: transformers reads the older names "su" and "yarn" as longrope.
_ROPE_ALIASES = {"su": "longrope", "yarn": "longrope"}


def weight_specs(cfg: ModelConfig) -> dict[str, WeightSpec]:
    """Llama's table with q/k/v taken from qkv_proj ([Hq + 2 Hkv, D] rows in that order)
    and gate/up from gate_up_proj ([2F, D]: gate rows, then up)."""
    hd, F = cfg.head_dim, cfg.intermediate_size
    qkv = (cfg.num_heads * hd, cfg.num_kv_heads * hd, cfg.num_kv_heads * hd)
    fused = {"wq": ("self_attn.qkv_proj", qkv, 0), "wk": ("self_attn.qkv_proj", qkv, 1),
             "wv": ("self_attn.qkv_proj", qkv, 2),
             "w_gate": ("mlp.gate_up_proj", (F, F), 0), "w_up": ("mlp.gate_up_proj", (F, F), 1)}
    specs = llama_weight_specs(cfg)
    for path, spec in specs.items():
        parts = path.split(".")
        if len(parts) == 3 and parts[2] in fused:
            name, sizes, part = fused[parts[2]]
            specs[path] = dataclasses.replace(
                spec, hf_name=f"model.layers.{parts[1]}.{name}.weight",
                hf_take=functools.partial(fused_part, sizes=sizes, part=part))
    return specs


def _rope_dict(d: Mapping[str, Any]) -> dict[str, Any]:
    """The rope settings from either config form (rope_scaling + rope_theta, or
    transformers >= 5's rope_parameters), the type's older names mapped."""
    rp = d.get("rope_parameters")
    rs = dict(d.get("rope_scaling") or (rp if isinstance(rp, Mapping) else {}) or {})
    rtype = rs.get("rope_type", rs.get("type")) or "default"
    rs["rope_type"] = _ROPE_ALIASES.get(rtype, rtype)
    if rs["rope_type"] not in ("default", "longrope"):
        raise ValueError(f"rope_scaling.rope_type: unsupported {rtype!r} for {ARCHITECTURE} "
                         "(supported: default, longrope)")
    return rs


def config_from_hf(d: Mapping[str, Any]) -> ModelConfig:
    """Phi3Config (config.json) -> ModelConfig; unsupported options name their field."""
    rs = _rope_dict(d)
    theta = d.get("rope_theta", rs.get("rope_theta", 10000.0))
    fields = hf_common_fields({**d, "rope_scaling": rs, "rope_theta": theta}, ARCHITECTURE)
    prf = rs.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0))
    if prf is None or not 0 < float(prf) <= 1:
        raise ValueError(f"partial_rotary_factor: must be in (0, 1], got {prf!r}")
    rotary = int(fields["head_dim"] * float(prf))
    window = d.get("sliding_window")
    fields.update(rotary_dim=None if rotary == fields["head_dim"] else rotary,
                  sliding_window=int(window) if window else None,
                  tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                  qkv_bias=False, o_bias=False, mlp_bias=False)
    return ModelConfig(**fields)


class Phi3ForCausalLM(LlamaForCausalLM):
    weight_specs = staticmethod(weight_specs)
    config_from_hf = staticmethod(config_from_hf)
