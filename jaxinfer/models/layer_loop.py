"""The model's layers as one ``lax.fori_loop`` instead of unrolled (``EngineConfig.layer_loop``,
on by default where it applies).

Why: with the layers unrolled every step executable holds 30 copies of the layer, ~19 MiB
resident each once loaded, and each bucket traces, lowers and compiles all of them (also on
a warm start, to compute its cache key). A loop holds one (RESULTS.md "Design measurements",
"A loop over layers without stacking").

How, without stacking weights or KV pages (a dynamic slice of a stacked array is a copy per
iteration): the kernels take every layer's buffer as operands plus the traced layer index
and pick one by pointer (pallas_kernels/*/cpu.py ``*_layer``). The layer body is the family's
own code, run with ``self`` a ``LayerView``: its matrix weights are ``IndexedWeight`` (which
the ``mm`` hook sends to those kernels), its vectors (norms, biases) the i-th row of their
stack (tiny), ``index`` the traced layer. So the loop computes exactly the unrolled layers'
operations in the same order: the same bits (tests/test_layer_loop.py).

Applies when every layer has the same class, weights and static options (attention
options, rotary parameters) and every matrix weight has a kernel that indexes (float32 or
int8 on CPU with the C++ kernels); the runner offers it only with the C++ paged attention
(float32 or int8 KV pages), without LoRA, offload or pipeline stages. Otherwise the layers unroll.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
from flax import nnx


class IndexedWeight:
    """Layer ``index``'s matrix weight out of ``arrays`` (every layer's, one shape and
    layout); only the ``mm`` hook reads it (jaxinfer/matmul.py ``indexed_matmul``)."""

    def __init__(self, arrays: Sequence[Any], index: jax.Array):
        self.arrays, self.index = list(arrays), index

    def __getitem__(self, key: Any) -> "IndexedWeight":
        if key is not Ellipsis:
            raise TypeError("IndexedWeight supports only [...] indexing")
        return self

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.arrays[0].shape)

    @property
    def dtype(self) -> Any:
        return self.arrays[0].dtype


class _Row:
    """A vector weight's row ``index`` of its [L, n] stack, read with ``[...]``."""

    def __init__(self, stacked: jax.Array, index: jax.Array):
        self.stacked, self.index = stacked, index

    def __getitem__(self, key: Any) -> jax.Array:
        if key is not Ellipsis:
            raise TypeError("a looped layer's vector weight supports only [...] indexing")
        return jax.lax.dynamic_index_in_dim(self.stacked, self.index, keepdims=False)


def _weights(layer: nnx.Module) -> dict[str, Any]:
    """name -> value of the layer's parameters."""
    return {k: v[...] for k, v in vars(layer).items() if isinstance(v, nnx.Variable)}


def _signature(layer: nnx.Module) -> tuple:
    return (type(layer), tuple((k, type(v).__name__, tuple(getattr(v, "shape", ())), str(getattr(v, "dtype", "")))
                               for k, v in sorted(_weights(layer).items())))


class LayerView:
    """``layers[index]`` for the layer class's own methods inside the loop (see module doc)."""

    def __init__(self, layers: Sequence[nnx.Module], index: jax.Array, stacks: dict[str, jax.Array]):
        object.__setattr__(self, "_first", layers[0])
        object.__setattr__(self, "_index", index)
        object.__setattr__(self, "_values", {k: [_weights(layer)[k] for layer in layers] for k in stacks})
        object.__setattr__(self, "_stacks", stacks)

    def __getattr__(self, name: str) -> Any:
        if name == "index":
            return self._index
        if name in self._stacks:
            stacked = self._stacks[name]
            if stacked is None:
                return IndexedWeight(self._values[name], self._index)
            return _Row(stacked, self._index)
        attr = getattr(type(self._first), name, None)
        if callable(attr) and hasattr(attr, "__get__"):
            return attr.__get__(self)              # the class's method, run on this view
        return getattr(self._first, name)          # cfg and other static attributes


def plan(layers: Sequence[nnx.Module], cfg: Any, can_index: Any) -> dict[str, Any] | None:
    """The loop's per-weight plan (name -> None for a matrix read through IndexedWeight, or
    its [L, n] stack for a vector), or None when the layers must unroll: they differ in
    class, weights or static options, or a matrix weight has no indexing kernel."""
    if len(layers) < 2 or not getattr(type(layers[0]), "loopable", False):
        return None
    if len({_signature(layer) for layer in layers}) != 1:
        return None
    if any(cfg.attention_kwargs(i) != cfg.attention_kwargs(0) or cfg.layer_rope(i) != cfg.layer_rope(0)
           for i in range(len(layers))):
        return None
    stacks: dict[str, Any] = {}
    for name, value in _weights(layers[0]).items():
        if isinstance(value, jax.Array) and value.ndim <= 1:
            stacks[name] = jnp.stack([_weights(layer)[name] for layer in layers])
        elif can_index(value):
            stacks[name] = None
        else:
            return None
    return stacks


def run(layers: Sequence[nnx.Module], stacks: dict[str, Any], x: jax.Array, cos: jax.Array, sin: jax.Array,
        attn_loop: Any, kv_cache: Sequence[Any], mm: Any, tp_axis: str | None) -> tuple[jax.Array, list[Any]]:
    """x [T, D] through every layer in a fori_loop -> (x, the caches as (k, v) per layer).
    ``attn_loop(index, q, k, v, (k_pages list, v_pages list))``: the runner's attention for a
    traced layer index."""
    call = type(layers[0]).__call__
    ks, vs = [c[0] for c in kv_cache], [c[1] for c in kv_cache]

    def body(i, carry):
        h, ks, vs = carry
        view = LayerView(layers, i, stacks)
        h, (ks, vs) = call(view, h, cos, sin, attn_loop, (list(ks), list(vs)), mm, tp_axis)
        return h, list(ks), list(vs)

    x, ks, vs = jax.lax.fori_loop(0, len(layers), body, (x, ks, vs))
    return x, list(zip(ks, vs))
