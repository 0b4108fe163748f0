"""Load a model from whatever the user points at: nothing (the embedded default), an HF
checkpoint directory, a .gguf file, or a directory written by ``jaxinfer convert``."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

import jax.numpy as jnp
import numpy as np

from jaxinfer.config import ModelConfig
from jaxinfer.models.llama import LlamaForCausalLM
from jaxinfer.models.registry import config_from_hf, model_class, params_from_flat, weight_specs

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


def hf_tensors_to_flat(cfg: ModelConfig, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """HF-named tensors ([out, in] layout) -> our paths and layout, checking every shape."""
    flat: dict[str, np.ndarray] = {}
    for path, spec in weight_specs(cfg).items():
        if spec.hf_experts:      # one tensor per expert, stacked
            flat[path] = np.stack([_hf_tensor(spec, tensors, spec.hf_name.format(e=e), spec.shape[1:])
                                   for e in range(spec.hf_experts)])
            continue
        name = spec.hf_name if spec.hf_name in tensors or spec.hf_alt not in tensors else spec.hf_alt
        flat[path] = _hf_tensor(spec, tensors, name, spec.shape)
    return flat


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


def build_model(cfg: ModelConfig, flat: dict[str, Any], dtype: Any, mesh: Any = None
                ) -> LlamaForCausalLM:
    """Our-path host arrays -> the module, placed on ``mesh`` (each device receives only its
    shards; KV heads repeated where the model axis needs it) or on the default device."""
    from jaxinfer import sharding

    if mesh is None:
        return params_from_flat(cfg, flat, dtype)
    tp = sharding.tp_size(mesh)
    if tp > 1 and not getattr(model_class(cfg.architecture), "tensor_parallel", True):
        raise ValueError(f"tensor_parallel_size: {cfg.architecture} does not support tensor "
                         f"parallelism yet (got {tp}); use 1")
    sharding.check_tensor_parallel(cfg, tp)
    return params_from_flat(sharding.sharded_config(cfg, tp), sharding.replicate_kv_heads(cfg, flat, tp),
                            dtype, sharding.placer(mesh))


def _build(hf_config: dict[str, Any], tensors: dict[str, np.ndarray], dtype: Any, mesh: Any = None
           ) -> tuple[ModelConfig, Any]:
    cfg = config_from_hf(hf_config)
    model_class(cfg.architecture)   # raises for unsupported architectures, naming them
    return cfg, build_model(cfg, hf_tensors_to_flat(cfg, tensors), dtype, mesh)


def load_hf_dir(path: str, dtype: Any, mesh: Any = None) -> LoadedModel:
    from jaxinfer.loading.safetensors import load_safetensors, read_json
    from jaxinfer.loading.tokenizer import Tokenizer

    hf_config = read_json(os.path.join(path, "config.json"), "config.json")
    config_from_hf(hf_config)   # validate before reading weights
    cfg, model = _build(hf_config, load_safetensors(path), dtype, mesh)
    gen_path = os.path.join(path, "generation_config.json")
    gen = read_json(gen_path, "generation_config.json") if os.path.exists(gen_path) else {}
    return LoadedModel(cfg, model, Tokenizer.from_hf_dir(path), gen, path, hf_config)


def load_gguf_file(path: str, dtype: Any, mesh: Any = None) -> LoadedModel:
    from jaxinfer.loading.gguf import load_gguf

    ck = load_gguf(path, dtype=np.float32)
    cfg, model = _build(ck.config, ck.tensors, dtype, mesh)
    return LoadedModel(cfg, model, ck.tokenizer, dict(ck.generation_config), path, dict(ck.config))


def model_path(model: str | None) -> str:
    from jaxinfer.loading.default import default_model_path

    path = default_model_path() if model is None else os.path.expanduser(model)
    if not os.path.exists(path):
        raise FileNotFoundError(f"model: {path} does not exist (expected an HF checkpoint directory, "
                                "a .gguf file or a directory written by `jaxinfer convert`)")
    return path


def read_config(model: str | None = None) -> ModelConfig:
    """The model's config without reading its weights (to size a mesh before loading)."""
    from jaxinfer.loading.safetensors import read_json

    path = model_path(model)
    if os.path.isdir(path):
        return config_from_hf(read_json(os.path.join(path, "config.json"), "config.json"))
    if path.endswith(".gguf"):
        from jaxinfer.loading.gguf import read_gguf_config
        return config_from_hf(read_gguf_config(path))
    raise ValueError(f"model: {path} is neither a directory nor a .gguf file")


def load_model(model: str | None = None, dtype: Any = "float32", mesh: Any = None) -> LoadedModel:
    """``model``: None (embedded default), an HF dir, a .gguf file, or a converted dir.
    ``mesh`` (sharding.make_mesh): weights go straight into their tensor-parallel shards."""
    from jaxinfer.loading import checkpoint

    t0 = time.perf_counter()
    dtype = resolve_dtype(dtype)
    path = model_path(model)
    if os.path.isdir(path):
        if checkpoint.is_converted(path):
            loaded = checkpoint.restore(path, dtype, mesh)
        elif os.path.exists(os.path.join(path, "config.json")):
            loaded = load_hf_dir(path, dtype, mesh)
        else:
            raise ValueError(f"model: {path} is a directory without config.json "
                             "(not an HF checkpoint nor a `jaxinfer convert` output)")
    elif path.endswith(".gguf"):
        loaded = load_gguf_file(path, dtype, mesh)
    else:
        raise ValueError(f"model: {path} is neither a directory nor a .gguf file")
    loaded.load_seconds = time.perf_counter() - t0
    return loaded
