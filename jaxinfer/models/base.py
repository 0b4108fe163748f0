"""What every model family shares: the weight table's record, the attention and matmul
callback types, and building a module from (or flattening it to) our-path arrays.

A family (models/<family>.py) is a module class with two static methods, ``weight_specs(cfg)``
(our path -> WeightSpec: drives init, loading, sharding and quantization) and
``config_from_hf(d)`` (config.json -> ModelConfig), registered in models/registry.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxinfer.config import ModelConfig


@dataclass(frozen=True, slots=True)
class WeightSpec:
    """One weight: our shape (matmul weights are [in, out]), logical axes, HF source."""

    shape: tuple[int, ...]
    axes: tuple[str | None, ...]   # logical axis names; sharding.py maps them to mesh axes
    hf_name: str
    transpose: bool = False        # HF/torch stores linear weights as [out, in]
    init: str = "normal"           # "normal" | "ones" | "zeros" (random init for tests)
    # The part of the HF tensor that is this weight, taken before the transpose (a fused
    # q/k/v checkpoint tensor -> its q, k or v rows); None: the whole tensor.
    hf_take: Callable[[np.ndarray], np.ndarray] | None = None
    hf_alt: str | None = None      # the name other writers use (e.g. without the base prefix)


MatmulFn = Callable[[jax.Array, jax.Array], jax.Array]   # x [T, K], w [K, N] -> [T, N]


class AttentionFn(Protocol):
    """Attention over a layer's KV cache; the cache layout is the callee's business.

    q [T, num_heads, head_dim], k/v [T, num_kv_heads, head_dim] (rotary applied) ->
    (out [T, num_heads, head_dim], the layer's updated cache).
    """

    def __call__(self, layer: int, q: jax.Array, k: jax.Array, v: jax.Array,
                 cache: Any) -> tuple[jax.Array, Any]: ...


def init_value(spec: WeightSpec, key: Any, dtype: Any) -> Any:
    if key is _NO_INIT:
        return jax.ShapeDtypeStruct(spec.shape, dtype)
    if spec.init == "ones":
        return jnp.ones(spec.shape, dtype)
    if spec.init == "zeros":
        return jnp.zeros(spec.shape, dtype)
    return (0.02 * jax.random.normal(key, spec.shape, jnp.float32)).astype(dtype)



_NO_INIT = object()


class _NoInit:
    """Stands in for nnx.Rngs in ``abstract_model``: its keys tell ``init_value`` to make
    only each weight's shape."""

    def params(self) -> object:
        return _NO_INIT


def abstract_model(cfg: ModelConfig, dtype: Any) -> nnx.Module:
    """``cfg``'s module with every weight a ShapeDtypeStruct, to be filled. Nothing is
    allocated or traced: ``nnx.eval_shape`` would trace each weight's random init, ~1 s of
    every start for 30 layers (most of it in flax asking tracers for their sharding)."""
    from jaxinfer.models.registry import model_class

    return model_class(cfg.architecture)(cfg, dtype, rngs=_NoInit())


def weight_specs(cfg: ModelConfig) -> dict[str, WeightSpec]:
    """The weight table of ``cfg``'s family."""
    from jaxinfer.models.registry import model_class

    return model_class(cfg.architecture).weight_specs(cfg)


def params_from_flat(cfg: ModelConfig, flat: dict[str, Any], dtype: Any = jnp.float32,
                     place: Callable[[tuple[str | None, ...], Any], jax.Array] | None = None
                     ) -> nnx.Module:
    """Build the module with every weight taken from ``flat`` (our paths -> arrays).

    The module is created abstractly (no random init is materialized), then filled.
    ``place(logical_axes, host_array)`` puts each weight where it lives (sharding.placer:
    each device gets only its slice); by default the default device.
    """
    from jaxinfer.models.registry import model_class

    cls = model_class(cfg.architecture)
    specs = cls.weight_specs(cfg)
    missing = [p for p in specs if p not in flat]
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} weight(s), e.g. "
                         f"{specs[missing[0]].hf_name!r} (for {missing[0]})")
    model = abstract_model(cfg, dtype)
    for path, spec in specs.items():
        arr = flat[path]
        if tuple(arr.shape) != spec.shape:
            raise ValueError(f"weight {spec.hf_name!r} has shape {tuple(arr.shape)}, "
                             f"expected {spec.shape} (ours {path})")
        if place is None:
            value = jnp.asarray(arr, dtype=dtype)
        elif isinstance(arr, jax.Array):      # already on the mesh (orbax restored it sharded)
            value = place(spec.axes, arr.astype(dtype))
        else:
            value = place(spec.axes, np.asarray(arr).astype(np.dtype(dtype), copy=False))
        get_param(model, path).set_value(value)
    return model


def get_param(model: nnx.Module, path: str) -> nnx.Param:
    obj: Any = model
    for part in path.split("."):
        obj = obj[int(part)] if part.isdigit() else getattr(obj, part)
    return obj


def flat_params(model: nnx.Module) -> dict[str, jax.Array]:
    """Our paths -> arrays (for saving and inspection)."""
    return {path: get_param(model, path)[...] for path in weight_specs(model.cfg)}
