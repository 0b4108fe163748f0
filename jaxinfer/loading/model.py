"""What a load produces (``LoadedModel``) and how host tensors become a placed module: shared by
every format's loader (HF directories, GGUF, ``jaxinfer convert`` checkpoints, the weight
cache), so none of them imports the package that dispatches between them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import jax.numpy as jnp
import numpy as np

from jaxinfer.models.config import ModelConfig
from jaxinfer.loading.lazy import LazyTensors
from jaxinfer.models.llama import LlamaForCausalLM
from jaxinfer.models.registry import model_class, params_from_flat, weight_specs

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


@dataclass
class LoadedModel:
    config: ModelConfig
    model: LlamaForCausalLM
    tokenizer: Any                      # jaxinfer.loading.tokenizer.Tokenizer
    generation_config: dict[str, Any]
    source: str                         # what was loaded, for logs and /v1/models
    hf_config: dict[str, Any] = field(default_factory=dict)
    load_seconds: float = 0.0


def resolve_dtype(dtype: Any) -> Any:
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype: unsupported {dtype!r}; choose one of {', '.join(DTYPES)}")
        return DTYPES[dtype]
    return dtype


def hf_tensors_to_flat(cfg: ModelConfig, tensors: Mapping[str, np.ndarray]) -> LazyTensors:
    """HF-named tensors ([out, in] layout) -> our paths and layout. Names are checked now;
    each tensor is read, cut (``hf_take``), shape-checked and transposed when the model
    is built from it (loading/lazy.py: one host tensor at a time)."""
    specs = weight_specs(cfg)
    names: dict[str, list[str]] = {}
    for path, spec in specs.items():
        if spec.hf_experts:      # one tensor per expert, stacked
            names[path] = [spec.hf_name.format(e=e) for e in range(spec.hf_experts)]
        else:
            names[path] = [spec.hf_name if spec.hf_name in tensors or spec.hf_alt not in tensors
                           else spec.hf_alt]
        for name in names[path]:
            if name not in tensors:
                raise ValueError(f"checkpoint is missing tensor {name!r}")

    def read(path: str) -> np.ndarray:
        spec = specs[path]
        if spec.hf_experts:
            return np.stack([_hf_tensor(spec, tensors, n, spec.shape[1:]) for n in names[path]])
        return _hf_tensor(spec, tensors, names[path][0], spec.shape)

    return LazyTensors(list(specs), read)


def _hf_tensor(spec: Any, tensors: dict[str, np.ndarray], name: str, shape: tuple[int, ...]) -> np.ndarray:
    """HF tensor ``name`` in our layout of ``shape`` (spec: its WeightSpec)."""
    if name not in tensors:
        raise ValueError(f"checkpoint is missing tensor {name!r}")
    t = tensors[name]
    if spec.hf_take is not None:
        t = spec.hf_take(t)
    want = (*shape[:-2], shape[-1], shape[-2]) if spec.transpose else shape
    if tuple(t.shape) != want:
        raise ValueError(f"tensor {name!r} has shape {tuple(t.shape)}, expected {want}")
    return np.swapaxes(t, -1, -2) if spec.transpose else t


def build_model(cfg: ModelConfig, flat: dict[str, Any], dtype: Any, mesh: Any = None,
                finish: Any = None) -> LlamaForCausalLM:
    """Our-path host arrays -> the module, placed on ``mesh`` (each device receives only its
    shards; KV heads repeated where the model axis needs it) or on the default device.
    ``finish``: see base.build_params (one device only)."""
    from jaxinfer import sharding

    if mesh is None:
        return params_from_flat(cfg, flat, dtype, finish=finish)
    if finish is not None:
        raise ValueError("build_model: finish applies to a one-device load only")
    tp = sharding.tp_size(mesh)
    if tp > 1 and not getattr(model_class(cfg.architecture), "tensor_parallel", True):
        raise ValueError(f"tensor_parallel_size: {cfg.architecture} does not support tensor "
                         f"parallelism yet (got {tp}); use 1")
    sharding.check_tensor_parallel(cfg, tp)
    return params_from_flat(sharding.sharded_config(cfg, tp), sharding.replicate_kv_heads(cfg, flat, tp),
                            dtype, sharding.placer(mesh))
