"""Load a model from whatever the user points at: nothing (the embedded default), an HF
checkpoint directory, a .gguf file, or a directory written by ``jaxinfer convert``."""

from __future__ import annotations

import os
import time
from typing import Any, Mapping

import numpy as np

from jaxinfer.models.config import ModelConfig
from jaxinfer.loading.model import (DTYPES, LoadedModel, build_model, hf_tensors_to_flat,  # noqa: F401
                                    resolve_dtype)
from jaxinfer.models.registry import config_from_hf, model_class

def _build(hf_config: dict[str, Any], tensors: Mapping[str, np.ndarray], dtype: Any, mesh: Any = None,
           finish: Any = None) -> tuple[ModelConfig, Any]:
    cfg = config_from_hf(hf_config)
    model_class(cfg.architecture)   # raises for unsupported architectures, naming them
    return cfg, build_model(cfg, hf_tensors_to_flat(cfg, tensors), dtype, mesh, finish)


def load_hf_dir(path: str, dtype: Any, mesh: Any = None, finish: Any = None) -> LoadedModel:
    from jaxinfer.loading.safetensors import load_safetensors, read_json
    from jaxinfer.loading.tokenizer import Tokenizer
    from jaxinfer.models.prequantized import refuse_quantized_tensors

    hf_config = read_json(os.path.join(path, "config.json"), "config.json")
    config_from_hf(hf_config)   # validate before reading weights (a declared quantization too)
    tensors = load_safetensors(path)        # the headers' names: no tensor is read yet
    refuse_quantized_tensors(tensors)       # quantized tensors that config.json does not declare
    cfg, model = _build(hf_config, tensors, dtype, mesh, finish)
    gen_path = os.path.join(path, "generation_config.json")
    gen = read_json(gen_path, "generation_config.json") if os.path.exists(gen_path) else {}
    return LoadedModel(cfg, model, Tokenizer.from_hf_dir(path), gen, path, hf_config)


def load_gguf_file(path: str, dtype: Any, mesh: Any = None, finish: Any = None) -> LoadedModel:
    from jaxinfer.loading.gguf import load_gguf

    ck = load_gguf(path, dtype=np.float32)
    cfg, model = _build(ck.config, ck.tensors, dtype, mesh, finish)
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


def load_tokenizer(model: str | None = None) -> Any:
    """The model's tokenizer alone, without reading its weights (HF or converted dir, or
    the GGUF's vocabulary)."""
    from jaxinfer.loading.tokenizer import Tokenizer

    path = model_path(model)
    if os.path.isdir(path):
        return Tokenizer.from_hf_dir(path)
    if path.endswith(".gguf"):
        from jaxinfer.loading.gguf import open_gguf
        return Tokenizer.from_gguf_reader(open_gguf(path))
    raise ValueError(f"model: {path} is neither a directory nor a .gguf file")


def load_model(model: str | None = None, dtype: Any = "float32", mesh: Any = None,
               finish: Any = None) -> LoadedModel:
    """``model``: None (embedded default), an HF dir, a .gguf file, or a converted dir.
    ``mesh`` (sharding.make_mesh): weights go straight into their tensor-parallel shards.
    ``finish(path, value)``: each weight's final form as it is read (base.build_params)."""
    from jaxinfer.loading import checkpoint

    t0 = time.perf_counter()
    dtype = resolve_dtype(dtype)
    path = model_path(model)
    if os.path.isdir(path):
        if checkpoint.is_converted(path):
            loaded = checkpoint.restore(path, dtype, mesh, finish)
        elif os.path.exists(os.path.join(path, "config.json")):
            loaded = load_hf_dir(path, dtype, mesh, finish)
        else:
            raise ValueError(f"model: {path} is a directory without config.json "
                             "(not an HF checkpoint nor a `jaxinfer convert` output)")
    elif path.endswith(".gguf"):
        loaded = load_gguf_file(path, dtype, mesh, finish)
    else:
        raise ValueError(f"model: {path} is neither a directory nor a .gguf file")
    loaded.load_seconds = time.perf_counter() - t0
    return loaded
