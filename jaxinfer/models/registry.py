"""HF `architectures` name -> model class. A new family registers itself here.

A family's class carries ``weight_specs(cfg)`` and ``config_from_hf(d)`` (models/base.py).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

from jaxinfer.config import LLAMA_FAMILY, ModelConfig
from jaxinfer.models.gemma3 import Gemma3ForCausalLM
from jaxinfer.models.gpt import GptForCausalLM
from jaxinfer.models.gpt_config import GPT_FAMILY
from jaxinfer.models.llama import LlamaForCausalLM
from jaxinfer.models.mixtral import MixtralForCausalLM
from jaxinfer.models.moe_config import MOE_FAMILY
from jaxinfer.models.phi3 import Phi3ForCausalLM

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


def config_parser(architecture: str) -> Callable[[Mapping[str, Any]], ModelConfig]:
    """config.json dict -> ModelConfig for ``architecture``'s family."""
    return model_class(architecture).config_from_hf
