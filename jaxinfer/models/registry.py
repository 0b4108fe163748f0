"""HF `architectures` name -> model class. A new family registers itself here."""

from __future__ import annotations

from typing import Any

from jaxinfer.config import LLAMA_FAMILY
from jaxinfer.models.llama import LlamaForCausalLM

_REGISTRY: dict[str, type] = {name: LlamaForCausalLM for name in LLAMA_FAMILY}


def register(name: str, cls: type) -> None:
    _REGISTRY[name] = cls


def supported_architectures() -> list[str]:
    return sorted(_REGISTRY)


def model_class(architecture: str) -> Any:
    try:
        return _REGISTRY[architecture]
    except KeyError:
        raise ValueError(f"unsupported architecture {architecture!r}; supported: "
                         f"{', '.join(supported_architectures())}") from None
