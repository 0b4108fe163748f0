"""HF checkpoint directories: config.json + one or sharded *.safetensors (+ index).

safetensors never unpickles, so a hostile file can at worst be rejected as corrupt.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from typing import Any

import numpy as np
from safetensors import SafetensorError, safe_open

from jaxinfer.loading.lazy import LazyTensors


def read_json(path: str, what: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"{what}: {path} does not exist") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{what}: {path} is not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{what}: {path} must hold a JSON object")
    return data


def safetensors_files(model_dir: str) -> list[str]:
    """The checkpoint's shard files, in index order (or the single file)."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        weight_map = read_json(index, "safetensors index").get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"safetensors index: {index} has no 'weight_map'")
        files = sorted(set(weight_map.values()))
        for f in files:
            if os.path.basename(f) != f:
                raise ValueError(f"safetensors index: shard name {f!r} must be a plain file name")
        return [os.path.join(model_dir, f) for f in files]
    files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors weights found "
                                "(pickled .bin checkpoints are not loaded, by design)")
    return [os.path.join(model_dir, f) for f in files]


def load_safetensors(model_dir: str, wanted: set[str] | None = None) -> LazyTensors:
    """HF tensor name -> float32/bf16 numpy array, for every tensor (or only ``wanted``),
    each read from its shard when asked for (loading/lazy.py)."""
    where: dict[str, str] = {}
    for path in safetensors_files(model_dir):
        if not os.path.exists(path):
            raise FileNotFoundError(f"safetensors shard {path} listed in the index does not exist")
        with _opened(path) as f:
            where.update({name: path for name in f.keys() if wanted is None or name in wanted})

    def read(name: str) -> np.ndarray:
        with _opened(where[name]) as f:
            return np.asarray(f.get_tensor(name))

    return LazyTensors(list(where), read)


@contextlib.contextmanager
def _opened(path: str) -> Iterator[Any]:
    """``safe_open`` with the errors of a bad file as ValueError naming it."""
    try:
        # framework="numpy" (bfloat16 as ml_dtypes, safetensors >= 0.8): host arrays, so
        # a tensor-parallel load sends each device only its shard (a "flax" read would
        # first put every whole tensor on the default device).
        with safe_open(path, framework="numpy") as f:
            yield f
    except (SafetensorError, OSError, ValueError) as e:
        raise ValueError(f"{path}: corrupt or unreadable safetensors file ({e})") from None
