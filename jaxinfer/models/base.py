"""What every model family shares: the weight table's record, the attention and matmul
callback types, and building a module from (or flattening it to) our-path arrays.

A family (models/<family>.py) is a module class with two static methods, ``weight_specs(cfg)``
(our path -> WeightSpec: drives init, loading, sharding and quantization) and
``config_from_hf(d)`` (config.json -> ModelConfig), registered in models/registry.py.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxinfer.models.config import ModelConfig


@dataclass(frozen=True, slots=True)
class WeightSpec:
    """One weight: our shape (matmul weights are [in, out]; expert weights [experts, in,
    out]), logical axes, HF source."""

    shape: tuple[int, ...]
    axes: tuple[str | None, ...]   # logical axis names; sharding.py maps them to mesh axes
    hf_name: str
    transpose: bool = False        # HF/torch stores linear weights as [out, in] (swap the last two axes)
    init: str = "normal"           # "normal" | "ones" | "zeros" (random init for tests)
    # The part of the HF tensor that is this weight, taken before the transpose (a fused
    # q/k/v checkpoint tensor -> its q, k or v rows); None: the whole tensor.
    hf_take: Callable[[np.ndarray], np.ndarray] | None = None
    hf_alt: str | None = None      # the name other writers use (e.g. without the base prefix)
    # > 0: one HF tensor per expert, ``hf_name`` holding "{e}" for its index, stacked on a
    # new leading axis (each taken and transposed on its own)
    hf_experts: int = 0


MatmulFn = Callable[[jax.Array, jax.Array], jax.Array]   # x [T, K], w [K, N] -> [T, N]


class AttentionFn(Protocol):
    """Attention over a layer's KV cache; the cache layout is the callee's business.

    q [T, num_heads, head_dim], k/v [T, num_kv_heads, head_dim] (rotary applied) ->
    (out [T, num_heads, head_dim], the layer's updated cache).
    """

    def __call__(self, layer: int, q: jax.Array, k: jax.Array, v: jax.Array,
                 cache: Any) -> tuple[jax.Array, Any]: ...


def fused_part(t: np.ndarray, *, sizes: tuple[int, ...], part: int, axis: int = 0,
               groups: int = 1) -> np.ndarray:
    """Part ``part`` of a checkpoint tensor that fuses several projections: its features
    along ``axis`` are ``groups`` repeats of blocks of ``sizes`` features (GPT-2's q/k/v:
    one group of (D, D, D); BLOOM's: one group per head; Phi-3's gate/up: one group of
    (F, F)). A WeightSpec's ``hf_take`` is this with the layout bound (functools.partial)."""
    t = np.moveaxis(t, axis, 0)
    g = t.reshape(groups, sum(sizes), *t.shape[1:])
    off = sum(sizes[:part])
    out = g[:, off:off + sizes[part]].reshape(groups * sizes[part], *t.shape[1:])
    return np.moveaxis(out, 0, axis)


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


def abstract_model(cls: Any, cfg: ModelConfig, dtype: Any) -> nnx.Module:
    """Family ``cls``'s module for ``cfg`` with every weight a ShapeDtypeStruct, to be
    filled. Nothing is allocated or traced: ``nnx.eval_shape`` would trace each weight's
    random init, ~1 s of every start for 30 layers (most of it in flax asking tracers for
    their sharding)."""
    return cls(cfg, dtype, rngs=_NoInit())


def build_params(cls: Any, cfg: ModelConfig, flat: dict[str, Any], dtype: Any = jnp.float32,
                 place: Callable[[tuple[str | None, ...], Any], jax.Array] | None = None,
                 finish: Callable[[str, jax.Array], Any] | None = None) -> nnx.Module:
    """Build family ``cls``'s module with every weight taken from ``flat`` (our paths -> arrays).

    The module is created abstractly (no random init is materialized), then filled.
    ``place(logical_axes, host_array)`` puts each weight where it lives (sharding.placer:
    each device gets only its slice); by default the default device. ``finish(path,
    value)``: each weight's final form, made as soon as it is read (a quantized load then
    never holds the whole float model: quantization.weight_finisher).
    """
    specs = cls.weight_specs(cfg)
    missing = [p for p in specs if p not in flat]
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} weight(s), e.g. "
                         f"{specs[missing[0]].hf_name!r} (for {missing[0]})")
    model = abstract_model(cls, cfg, dtype)
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
        del arr                               # the host copy, before finish makes more
        get_param(model, path).set_value(value if finish is None else finish(path, value))
    return model


def get_param(model: nnx.Module, path: str) -> nnx.Param:
    obj: Any = model
    for part in path.split("."):
        obj = obj[int(part)] if part.isdigit() else getattr(obj, part)
    return obj


def flat_params(model: nnx.Module) -> dict[str, jax.Array]:
    """Our paths -> arrays (for saving and inspection)."""
    return {path: get_param(model, path)[...] for path in type(model).weight_specs(model.cfg)}


def fit_context(model: nnx.Module, max_model_len: int) -> nnx.Module:
    """``model`` set up for sequences of up to ``max_model_len`` tokens, once per engine:
    longrope (models/config.RopeScaling) takes its long factors when max_model_len exceeds the
    model's original_max_position_embeddings, else its short ones, for every token alike
    (a token's rotation may not depend on its neighbours or on how long its sequence grew).
    Otherwise (and when nothing changes) the module itself; else a new module sharing its
    arrays, the given one untouched."""
    rs = model.cfg.rope_scaling
    use_long = rs is not None and max_model_len > rs.original_max_position_embeddings
    if rs is None or rs.rope_type != "longrope" or use_long == rs.use_long:
        return model
    cfg = dataclasses.replace(model.cfg, rope_scaling=dataclasses.replace(rs, use_long=use_long))
    model = nnx.merge(*nnx.split(model))
    for _, module in nnx.iter_modules(model):
        if hasattr(module, "cfg"):
            module.cfg = cfg
    return model
