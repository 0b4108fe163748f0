"""HF `architectures` name -> model class. A new family registers itself here.

A family's class carries ``weight_specs(cfg)`` and ``config_from_hf(d)`` (models/base.py).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import jax.numpy as jnp

from jaxinfer.models.config import LLAMA_FAMILY, ModelConfig
from jaxinfer.models.base import WeightSpec, build_params
from jaxinfer.models.gemma3 import Gemma3ForCausalLM
from jaxinfer.models.gpt import GptForCausalLM
from jaxinfer.models.gpt_config import GPT_FAMILY
from jaxinfer.models.llama import LlamaForCausalLM
from jaxinfer.models.mixtral import MixtralForCausalLM
from jaxinfer.models.moe_config import MOE_FAMILY
from jaxinfer.models.phi3 import Phi3ForCausalLM
from jaxinfer.models.prequantized import refuse_quantization_config

_REGISTRY: dict[str, type] = {name: LlamaForCausalLM for name in LLAMA_FAMILY}
_REGISTRY.update({name: GptForCausalLM for name in GPT_FAMILY})
_REGISTRY["Gemma3ForCausalLM"] = Gemma3ForCausalLM
_REGISTRY["Phi3ForCausalLM"] = Phi3ForCausalLM
_REGISTRY.update({name: MixtralForCausalLM for name in MOE_FAMILY})


def register(name: str, cls: type) -> None:
    _REGISTRY[name] = cls


def supported_architectures() -> list[str]:
    return sorted(_REGISTRY)


def model_class(architecture: str) -> Any:
    try:
        return _REGISTRY[architecture]
    except KeyError:
        raise ValueError(f"architectures: unsupported architecture {architecture!r}; supported: "
                         f"{', '.join(supported_architectures())}") from None


def config_from_hf(d: Mapping[str, Any]) -> ModelConfig:
    """An HF ``config.json`` dict -> ModelConfig, parsed by the family its
    ``architectures`` names; errors name the missing or bad field (an unknown architecture:
    the list of supported ones; a pre-quantized checkpoint: its format, models/prequantized.py)."""
    refuse_quantization_config(d)
    archs = d.get("architectures") or []
    if not isinstance(archs, list) or not archs:
        raise ValueError("architectures: config.json must list the model class, e.g. [\"LlamaForCausalLM\"]")
    return model_class(archs[0]).config_from_hf(d)


def weight_specs(cfg: ModelConfig) -> dict[str, WeightSpec]:
    """The weight table of ``cfg``'s family."""
    return model_class(cfg.architecture).weight_specs(cfg)


def params_from_flat(cfg: ModelConfig, flat: dict[str, Any], dtype: Any = jnp.float32,
                     place: Callable[[tuple[str | None, ...], Any], Any] | None = None,
                     finish: Callable[[str, Any], Any] | None = None) -> Any:
    """``cfg``'s family module with every weight taken from ``flat`` (base.build_params)."""
    return build_params(model_class(cfg.architecture), cfg, flat, dtype, place, finish)
