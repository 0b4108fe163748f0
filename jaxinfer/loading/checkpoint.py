"""Converted checkpoints (``jaxinfer convert``): params saved with orbax, next to an HF-style
config.json, the tokenizer files and generation_config.json, so a second start skips
GGUF dequantization / safetensors transposes."""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import numpy as np

MARKER = "jaxinfer_checkpoint.json"
FORMAT_VERSION = 1


def is_converted(path: str) -> bool:
    return os.path.exists(os.path.join(path, MARKER))


def save(loaded: Any, out_dir: str) -> str:
    """Write ``loaded`` (a LoadedModel) to ``out_dir``; returns the absolute path."""
    import orbax.checkpoint as ocp
    from jaxinfer.models.llama import flat_params

    out_dir = os.path.abspath(out_dir)
    if os.path.exists(os.path.join(out_dir, "params")):
        raise FileExistsError(f"output: {out_dir} already holds a converted checkpoint")
    os.makedirs(out_dir, exist_ok=True)
    params = flat_params(loaded.model)
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(os.path.join(out_dir, "params"), params)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(loaded.hf_config, f, indent=1)
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump(loaded.generation_config, f, indent=1)
    loaded.tokenizer.hf.save_pretrained(out_dir)
    dtype = str(next(iter(params.values())).dtype)
    with open(os.path.join(out_dir, MARKER), "w") as f:
        json.dump({"format_version": FORMAT_VERSION, "dtype": dtype, "source": loaded.source}, f)
    return out_dir


def restore(path: str, dtype: Any, mesh: Any = None, finish: Any = None) -> Any:
    """Read a converted checkpoint. With ``mesh``, orbax reads each weight straight into its
    tensor-parallel shards (KV-head weights that must be repeated come back replicated,
    then are repeated and re-placed)."""
    import orbax.checkpoint as ocp
    from jaxinfer.models.registry import config_from_hf
    from jaxinfer.loading.model import LoadedModel
    from jaxinfer.loading.safetensors import read_json
    from jaxinfer.loading.tokenizer import Tokenizer
    from jaxinfer import sharding
    from jaxinfer.loading.model import build_model
    from jaxinfer.models.registry import weight_specs

    path = os.path.abspath(path)
    meta = read_json(os.path.join(path, MARKER), "converted checkpoint marker")
    if meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{path}: converted with format {meta.get('format_version')}, "
                         f"this jaxinfer reads format {FORMAT_VERSION}: convert again")
    hf_config = read_json(os.path.join(path, "config.json"), "config.json")
    cfg = config_from_hf(hf_config)
    saved_dtype = np.dtype(meta["dtype"]) if meta.get("dtype") != "bfloat16" else jax.numpy.bfloat16
    specs = weight_specs(cfg)
    if mesh is None:
        abstract = {p: jax.ShapeDtypeStruct(s.shape, saved_dtype) for p, s in specs.items()}
    else:
        tp = sharding.tp_size(mesh)
        sharding.check_tensor_parallel(cfg, tp)
        split_kv = sharding.kv_head_replication(cfg.num_heads, cfg.num_kv_heads, tp) == 1

        def where(s):
            keep = split_kv or "kv_heads" not in s.axes
            spec = sharding.partition_spec(s.axes) if keep else sharding.P()
            return jax.sharding.NamedSharding(mesh, spec)

        abstract = {p: jax.ShapeDtypeStruct(s.shape, saved_dtype, sharding=where(s)) for p, s in specs.items()}
    with ocp.StandardCheckpointer() as ckpt:
        params = ckpt.restore(os.path.join(path, "params"), abstract)
    model = build_model(cfg, params, dtype, mesh, finish)
    gen_path = os.path.join(path, "generation_config.json")
    gen = read_json(gen_path, "generation_config.json") if os.path.exists(gen_path) else {}
    return LoadedModel(cfg, model, Tokenizer.from_hf_dir(path), gen, path, hf_config)
