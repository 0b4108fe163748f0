"""The mixture-of-experts families on the Llama layer: Mixtral, Qwen2-MoE, Qwen3-MoE.

Attention is the Llama family's (Mistral's sliding window, Qwen2's q/k/v biases, Qwen3's
q/k norms: config flags). The MLP of a sparse layer routes each token to its top-k
experts (models/moe.py: routing, grouped matmul, combine); Qwen2-MoE adds a shared expert
gated per token; Qwen's dense layers (``mlp_only_layers``, ``decoder_sparse_step``) keep
the Llama MLP. The config's routing fields are one ``MoeStyle`` (models/moe_config.py).

Expert weights are [experts, in, out] in the weight table, stacked from the checkpoint's
one tensor per expert (what transformers' save_pretrained writes), and sharded over the
mesh's model axis by expert (sharding.py "expert"). Weight quantization is refused for now
(``quantization = False``: the int8 / int4 kernels take 2-D weights); int8 KV pages and
tensor parallelism work.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxinfer.models.config import ModelConfig
from jaxinfer.models import layers as L
from jaxinfer.models import moe
from jaxinfer.models.base import MatmulFn, WeightSpec
from jaxinfer.models.llama import DecoderLayer, LlamaForCausalLM
from jaxinfer.models.llama import weight_specs as llama_weight_specs
from jaxinfer.models.moe_config import config_from_hf

# Each family's HF names under model.layers.{i}.: the sparse block, its experts' projections.
_NAMES = {
    "mixtral": dict(block="block_sparse_moe", gate="w1", up="w3", down="w2"),
    "qwen2_moe": dict(block="mlp", gate="gate_proj", up="up_proj", down="down_proj"),
    "qwen3_moe": dict(block="mlp", gate="gate_proj", up="up_proj", down="down_proj"),
}


def weight_specs(cfg: ModelConfig) -> dict[str, WeightSpec]:
    """Llama's table; a sparse layer's MLP replaced by the router [D, E] and the experts'
    moe_gate / moe_up [E, D, F] and moe_down [E, F, D] (plus Qwen2-MoE's shared expert as
    the Llama MLP and its gate [D, 1])."""
    m = cfg.moe
    names = _NAMES[m.family]
    D, E, F = cfg.hidden_size, m.num_experts, m.expert_size
    specs = llama_weight_specs(cfg)
    for i, sparse in enumerate(m.sparse):
        if not sparse:
            continue
        p, hf = f"layers.{i}", f"model.layers.{i}.{names['block']}"
        for w in ("w_gate", "w_up", "w_down"):
            del specs[f"{p}.{w}"]
        specs[f"{p}.router"] = WeightSpec((D, E), ("embed", None), f"{hf}.gate.weight", True)
        for ours, theirs, shape in (("moe_gate", "gate", (E, D, F)), ("moe_up", "up", (E, D, F)),
                                    ("moe_down", "down", (E, F, D))):
            specs[f"{p}.{ours}"] = WeightSpec(shape, ("expert", None, None),
                                              f"{hf}.experts.{{e}}.{names[theirs]}.weight", True, hf_experts=E)
        if m.shared_expert_size:
            S = m.shared_expert_size
            specs[f"{p}.w_gate"] = WeightSpec((D, S), ("embed", "mlp"), f"{hf}.shared_expert.gate_proj.weight", True)
            specs[f"{p}.w_up"] = WeightSpec((D, S), ("embed", "mlp"), f"{hf}.shared_expert.up_proj.weight", True)
            specs[f"{p}.w_down"] = WeightSpec((S, D), ("mlp", "embed"), f"{hf}.shared_expert.down_proj.weight", True)
            specs[f"{p}.shared_gate"] = WeightSpec((D, 1), ("embed", None), f"{hf}.shared_expert_gate.weight", True)
    return specs


class MoeDecoderLayer(DecoderLayer):
    """Llama's layer; a sparse layer's MLP routes each token to its top-k experts."""

    loopable = False    # expert weights are read by gathers, not the mm hook; sparse/dense layers differ

    def mlp(self, h: jax.Array, mm: MatmulFn, tp_axis: str | None) -> jax.Array:
        """h [T, D] (normed) -> [T, D]."""
        m = self.cfg.moe
        if not m.sparse[self.index]:
            return super().mlp(h, mm, tp_axis)
        # rounded to the model dtype first, as transformers' float() after its linear
        logits = L.as_computed(mm(h, self.router[...])).astype(jnp.float32)   # [T, E]
        weights, experts = moe.route(logits, m.top_k, m.norm_topk_prob)       # [T, k]
        w_gate = self.moe_gate[...]                                           # [E_local, D, F]
        first = 0 if tp_axis is None else jax.lax.axis_index(tp_axis) * w_gate.shape[0]
        y = moe.grouped_expert_mlp(h, experts, w_gate, self.moe_up[...], self.moe_down[...],
                                   lambda g: L.activation(self.cfg.hidden_act, g), mm, first)   # [T, k, D]
        out = L.all_reduce(moe.combine(y, weights), tp_axis)                  # [T, D]
        if m.shared_expert_size:
            gate = jax.nn.sigmoid(mm(h, self.shared_gate[...]))               # [T, 1]
            out = out + gate * super().mlp(h, mm, tp_axis)
        return out


class MixtralForCausalLM(LlamaForCausalLM):
    """Mixtral, Qwen2-MoE and Qwen3-MoE (registered under each HF name)."""

    layer_class = MoeDecoderLayer
    weight_specs = staticmethod(weight_specs)
    config_from_hf = staticmethod(config_from_hf)
    quantization = False
