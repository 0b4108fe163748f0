"""The model's layers as one ``lax.fori_loop`` instead of unrolled (``EngineConfig.layer_loop``,
on by default where it applies).

Why: with the layers unrolled every step executable holds 30 copies of the layer, ~19 MiB
resident each once loaded, and each bucket traces, lowers and compiles all of them (also on
a warm start, to compute its cache key). A loop holds one (RESULTS.md "Design measurements",
"A loop over layers without stacking").

How, without slicing weights or KV pages in XLA (a dynamic slice of a stacked array is a copy
per iteration): the kernels take every layer's buffer plus the traced layer index and pick
one by pointer (pallas_kernels/*/cpu.py ``*_layer``). The layer body is the family's own
code, run with ``self`` a ``LayerView``: its matrix weights are ``IndexedWeight`` (which the
``mm`` hook sends to those kernels), its vectors (norms, biases) the i-th row of their
stack (tiny), ``index`` the traced layer. So the loop computes exactly the unrolled layers'
operations in the same order: the same bits (tests/test_layer_loop.py).

Where a model's weights were stacked once at start-up (``stack_weights``: the runner does
it on one CPU device), the kernels get each array of every layer's weight as one [L, ...]
operand (pallas_kernels/layer_stack.py) instead of L operands, and the layers' own
variables become views of those stacks (no second copy). Why: XLA carries every operand
through the while loop, and a loaded XLA:CPU executable holds several KiB per HLO
instruction: ~400 per-layer operands were ~4 MiB of each of ~27 step executables.

Applies when every layer has the same class, weights and static options (attention
options, rotary parameters) and every matrix weight has a kernel that indexes (float32 or
int8 on CPU with the C++ kernels); the runner offers it only with the C++ paged attention
(float32 or int8 KV pages), without LoRA, offload or pipeline stages. Otherwise the layers unroll.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pallas_kernels.layer_stack import Stacked, first_layer

ALIGN = 64   # bytes: XLA:CPU adopts a host array as a buffer (no copy) when it is this aligned


class IndexedWeight:
    """Layer ``index``'s matrix weight out of ``arrays`` (every layer's, one shape and
    layout); only the ``mm`` hook reads it (jaxinfer/matmul.py ``indexed_matmul``)."""

    def __init__(self, arrays: Sequence[Any] | Stacked, index: jax.Array):
        self.arrays, self.index = (arrays if isinstance(arrays, Stacked) else list(arrays)), index

    def __getitem__(self, key: Any) -> "IndexedWeight":
        if key is not Ellipsis:
            raise TypeError("IndexedWeight supports only [...] indexing")
        return self

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(first_layer(self.arrays).shape)

    @property
    def dtype(self) -> Any:
        return first_layer(self.arrays).dtype


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
            if isinstance(stacked, Stacked):
                return IndexedWeight(stacked, self._index)
            return _Row(stacked, self._index)
        attr = getattr(type(self._first), name, None)
        if callable(attr) and hasattr(attr, "__get__"):
            return attr.__get__(self)              # the class's method, run on this view
        return getattr(self._first, name)          # cfg and other static attributes


def plan(layers: Sequence[nnx.Module], cfg: Any, can_index: Any,
         stored: Any = None) -> dict[str, Any] | None:
    """The loop's per-weight plan (name -> None for a matrix read through IndexedWeight from
    every layer's, a ``Stacked`` matrix, or a vector's [L, n] stack), or None when the layers
    must unroll: they differ in class, weights or static options, or a matrix weight has no
    indexing kernel. ``stored``: the model's ``layer_stacks`` (``stack_weights``), if any."""
    if len(layers) < 2 or not getattr(type(layers[0]), "loopable", False):
        return None
    if len({_signature(layer) for layer in layers}) != 1:
        return None
    if any(cfg.attention_kwargs(i) != cfg.attention_kwargs(0) or cfg.layer_rope(i) != cfg.layer_rope(0)
           for i in range(len(layers))):
        return None
    stacks: dict[str, Any] = {}
    for name, value in _weights(layers[0]).items():
        if stored is not None and name in stored:
            stacked = stored[name].get_value()
            stacks[name] = stacked if isinstance(value, jax.Array) and value.ndim <= 1 else Stacked(stacked)
        elif isinstance(value, jax.Array) and value.ndim <= 1:
            stacks[name] = jnp.stack([_weights(layer)[name] for layer in layers])
        elif can_index(value):
            stacks[name] = None
        else:
            return None
    return stacks


def run(layers: Sequence[nnx.Module], stacks: dict[str, Any], x: jax.Array, cos: jax.Array, sin: jax.Array,
        attn_loop: Any, kv_cache: Any, mm: Any, tp_axis: str | None) -> tuple[jax.Array, Any]:
    """x [T, D] through every layer in a fori_loop -> (x, the caches in the form they came:
    (k, v) per layer, or the engine's stacked pool, engine/kv_cache.py ``StackedKV``).
    ``attn_loop(index, q, k, v, (every layer's K, every layer's V))``: the runner's attention
    for a traced layer index; each side a list over layers or a ``Stacked``."""
    call = type(layers[0]).__call__
    stacked = not isinstance(kv_cache, (list, tuple))      # StackedKV: fields k, v [L, ...]
    if stacked:
        ks, vs = Stacked(kv_cache.k), Stacked(kv_cache.v)
    else:
        ks, vs = [c[0] for c in kv_cache], [c[1] for c in kv_cache]

    def body(i, carry):
        h, ks, vs = carry
        view = LayerView(layers, i, stacks)
        h, (ks, vs) = call(view, h, cos, sin, attn_loop, (ks, vs), mm, tp_axis)
        return (h, ks, vs) if stacked else (h, list(ks), list(vs))

    x, ks, vs = jax.lax.fori_loop(0, len(layers), body, (x, ks, vs))
    return x, (dataclasses.replace(kv_cache, k=ks.value, v=vs.value) if stacked else list(zip(ks, vs)))


class LayerStack(nnx.Variable):
    """Every layer's value of one weight, stacked [L, ...] (``stack_weights``): not a
    parameter of its own (the layers' ``Param``s are views of it), so not counted twice."""


def _aligned_empty(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    raw = np.empty(int(np.prod(shape)) * np.dtype(dtype).itemsize + ALIGN, np.uint8)
    start = -raw.ctypes.data % ALIGN
    return raw[start:start + raw.size - ALIGN].view(dtype).reshape(shape)


def _stack_leaves(leaves: list[jax.Array]) -> tuple[jax.Array, list[jax.Array]]:
    """Every layer's array of one field -> (their stack [L, ...], each layer's as a view of
    it). One host copy, made ALIGN-aligned so the stack and its rows are adopted as buffers
    without a copy; a row that is not (its size not a multiple of ALIGN) stays as it was."""
    host = _aligned_empty((len(leaves), *leaves[0].shape), leaves[0].dtype)
    for i, leaf in enumerate(leaves):
        host[i] = np.asarray(leaf)
    stacked = jax.device_put(host)
    if stacked.unsafe_buffer_pointer() != host.ctypes.data or host[0].nbytes % ALIGN:
        return stacked, leaves
    return stacked, [jax.device_put(host[i]) for i in range(len(leaves))]


def stack_weights(owner: nnx.Module, can_index: Any) -> dict[str, LayerStack] | None:
    """Every weight of ``owner.layers`` stacked once, on the host: name -> LayerStack, and
    each layer's weight made a view of its stack (the same bits; the old buffers are freed),
    so the loop can pass one operand per array instead of one per layer (module doc). None
    off CPU or where the layers do not loop; a row XLA would not adopt without a copy (its
    size not a multiple of ALIGN bytes) keeps its own buffer, a small second copy. The
    caller gives the stacks to its own copy of the model (``layer_stacks``): the model it
    was handed keeps plain per-layer weights, whatever is done with it later (quantizing a
    copy, a draft)."""
    layers = list(getattr(owner, "layers", ()))
    if jax.default_backend() != "cpu" or plan(layers, owner.cfg, can_index) is None:
        return None
    stacks = {}
    for name, value in _weights(layers[0]).items():
        treedef = jax.tree.structure(value)
        per_field = zip(*[jax.tree.leaves(_weights(layer)[name]) for layer in layers])
        fields = [_stack_leaves(list(leaves)) for leaves in per_field]
        stacks[name] = LayerStack(jax.tree.unflatten(treedef, [s for s, _ in fields]))
        for i, layer in enumerate(layers):
            getattr(layer, name).set_value(jax.tree.unflatten(treedef, [views[i] for _, views in fields]))
    return stacks
