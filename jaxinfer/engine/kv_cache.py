"""The device side of the paged KV cache: its shape, its allocation, the pure write.

Layout (fixed across the project): per layer one ``k_pages`` and one ``v_pages`` array of
``[num_pages, page_size, num_kv_heads, head_dim]``. The whole cache is a Python list over
layers of ``(k_pages, v_pages)`` tuples — a pytree the step takes and hands back (donated).

Why a list and not one stacked ``[L, num_pages, ...]`` array: the model unrolls its layers,
and with a list every layer's pages are a buffer of their own, so the per-layer scatter
(write_kv) updates in place and the attention gathers straight from it. A stacked array
with a static layer index makes XLA copy the stacked buffer, and lax.scan over layers
copies the scanned slices in and out (benchmarks/attention_cpu.py "layout"; RESULTS.md,
"Design measurements"). A loop over layers does not need a stacked cache: kernels that take
every layer's pages as variadic operands plus the layer index, with the write aliasing all
of them in -> out, run inside ``lax.fori_loop`` without a copy and with the same bits
(benchmarks/layer_loop_probe.py; RESULTS.md "A loop over layers without stacking").

The layer loop's stacked form (``StackedKV``): on one CPU device, when the model's layers
run as one loop (models/layer_loop.py), the pool is instead one ``[L, num_pages, ...]``
array per kind (K, V; int8 pages' values and scales): the C++ kernels read layer l's rows
by pointer, so nothing is sliced, and the loop carries 2 (int8: 4) buffers instead of 2L
(4L). Why: a loaded XLA:CPU executable holds several KiB per HLO instruction, and every
page array carried through the loop costs ~4 of them in each of ~21 step executables
(RESULTS.md, "The KV pool stacked"). Page operations (kv_offload.py) index the page axis
through ``page_axis``; the unrolled model never sees the stacked form.

Page 0 is the padding sink: padded tokens of a step carry a slot inside page 0, unused
page-table entries point at page 0, and nothing ever reads it as real data (the attention
masks every position past a sequence's kv_len with a select, so even NaN there is harmless).
The host-side allocator (engine/block_manager.py) never hands page 0 out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

KVCache = list  # list over layers of (k_pages, v_pages), each [N, page_size, KVH, D]; or StackedKV


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class QuantizedPages:
    """int8 KV pages (``kv_cache_dtype="int8"``): values q int8 [N, page_size, KVH, D] and
    one f32 scale per token and KV head, scale [N, page_size, KVH]; x ~= q * scale.

    Per token, not per page: a token's quantization then depends on that token alone, so
    int8 pages stay batch-invariant (a per-page scale would grow as a page fills, and the
    rounding of earlier tokens would depend on how the sequence was chunked into steps).
    The cost is 4 bytes per token and head: 68 bytes per 64-wide head instead of bf16's
    128 (0.53x) or f32's 256 (0.27x).
    """

    q: jax.Array
    scale: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        return self.q.shape

    @property
    def ndim(self) -> int:
        return self.q.ndim

    @property
    def dtype(self) -> Any:
        return self.q.dtype

    def dequantize(self) -> jax.Array:
        return self.q.astype(jnp.float32) * self.scale[..., None]


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class StackedKV:
    """Every layer's pages as one array per kind (the layer loop's pool, module doc): ``k``,
    ``v`` [L, N, page_size, KVH, D], or QuantizedPages whose q and scale carry the leading L."""

    k: Any
    v: Any

    @property
    def num_layers(self) -> int:
        return int(self.k.shape[0])


def page_axis(kv: Any) -> int:
    """The axis of the pool's leaves that counts pages: 1 stacked [L, N, ...], else 0."""
    return 1 if isinstance(kv, StackedKV) else 0


def quantize_kv(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [T, KVH, D] -> (q int8 [T, KVH, D], scale f32 [T, KVH]): symmetric, max|x| / 127."""
    x = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x), axis=-1)
    scale = jnp.where(amax > 0, amax / 127.0, 1.0)
    return jnp.clip(jnp.round(x / scale[..., None]), -127, 127).astype(jnp.int8), scale


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    """Shape of the paged cache. Every field is static: it fixes the cache's array shapes."""

    num_layers: int
    num_pages: int          # including page 0, the padding sink
    page_size: int          # tokens per page
    num_kv_heads: int
    head_dim: int
    dtype: Any = jnp.float32

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_pages", "page_size", "num_kv_heads", "head_dim"):
            v = getattr(self, name)
            if not isinstance(v, (int, np.integer)) or v <= 0:
                raise ValueError(f"KVCacheSpec.{name}: must be a positive integer, got {v!r}")
        if self.num_pages < 2:
            raise ValueError(f"KVCacheSpec.num_pages: need at least 2 (page 0 is the padding "
                             f"sink), got {self.num_pages}")

    @property
    def itemsize(self) -> int:
        return jnp.dtype(self.dtype).itemsize

    @property
    def quantized(self) -> bool:
        return jnp.dtype(self.dtype) == jnp.int8

    @property
    def page_shape(self) -> tuple[int, int, int]:
        return (self.page_size, self.num_kv_heads, self.head_dim)

    @property
    def bytes_per_page(self) -> int:
        """Bytes one page id costs across the whole model: K and V, every layer (int8 pages
        include their f32 scale per token and head)."""
        per_head = self.head_dim * self.itemsize + (4 if self.quantized else 0)
        return 2 * self.num_layers * self.page_size * self.num_kv_heads * per_head

    @property
    def total_bytes(self) -> int:
        return self.num_pages * self.bytes_per_page

    @classmethod
    def num_pages_for_budget(cls, budget_bytes: int, *, num_layers: int, page_size: int,
                             num_kv_heads: int, head_dim: int, dtype: Any = jnp.float32) -> int:
        """How many pages (page 0 included) fit in ``budget_bytes`` of K+V over all layers."""
        per = cls(num_layers, 2, page_size, num_kv_heads, head_dim, dtype).bytes_per_page
        n = int(budget_bytes) // per
        if n < 2:
            raise ValueError(f"kv cache budget: {budget_bytes} bytes hold {n} page(s) of "
                             f"{per} bytes; need at least 2 (page 0 is the padding sink)")
        return n

    def with_budget(self, budget_bytes: int) -> "KVCacheSpec":
        """This spec with ``num_pages`` set from a byte budget."""
        n = self.num_pages_for_budget(budget_bytes, num_layers=self.num_layers,
                                      page_size=self.page_size, num_kv_heads=self.num_kv_heads,
                                      head_dim=self.head_dim, dtype=self.dtype)
        return KVCacheSpec(self.num_layers, n, self.page_size, self.num_kv_heads, self.head_dim,
                           self.dtype)


def abstract_kv_cache(spec: KVCacheSpec, stacked: bool = False) -> KVCache:
    """The pool's shapes and dtypes on one device (what ``allocate_kv_cache`` would make),
    allocating nothing."""
    lead = (spec.num_layers,) if stacked else ()
    shape = (*lead, spec.num_pages, *spec.page_shape)
    if spec.quantized:
        pages = QuantizedPages(jax.ShapeDtypeStruct(shape, jnp.int8), jax.ShapeDtypeStruct(shape[:-1], jnp.float32))
    else:
        pages = jax.ShapeDtypeStruct(shape, jnp.dtype(spec.dtype))
    return StackedKV(pages, pages) if stacked else [(pages, pages) for _ in range(spec.num_layers)]


def allocate_kv_cache(spec: KVCacheSpec, mesh: Any = None, untouched: bool = False,
                      stacked: bool = False) -> KVCache:
    """Zero-filled pages: a list over layers of (k_pages, v_pages), or with ``stacked`` (one
    device; the layer loop's form) a ``StackedKV``. With a ``mesh`` the pages are split by
    KV head over its model axis; each device allocates its part.

    ``untouched`` (the engine's pool, whose attention never reads a slot before a step
    writes it: see the module docstring): on one CPU device (``lazily_resident``) pages of
    unspecified content, never written here, so the pool costs RAM only for the pages
    requests have used and can be sized for what the configuration can use."""
    if stacked and mesh is not None:
        raise ValueError("allocate_kv_cache: the stacked pool is for one device (no mesh)")
    shape = ((spec.num_layers,) if stacked else ()) + (spec.num_pages, *spec.page_shape)
    if untouched and mesh is None and lazily_resident():
        from pallas_kernels.alloc.cpu import uninitialized as new
    else:
        new = jnp.zeros

    def make():
        if spec.quantized:
            return QuantizedPages(new(shape, jnp.int8), new(shape[:-1], jnp.float32))
        return new(shape, jnp.dtype(spec.dtype))

    if stacked:
        return StackedKV(make(), make())
    if mesh is not None:
        from jaxinfer import sharding as shd
        out = jax.tree.map(lambda x: jax.sharding.NamedSharding(mesh, shd.kv_pages_spec(x.ndim)),
                           jax.eval_shape(make))
        make = jax.jit(make, out_shardings=out)
    return [(make(), make()) for _ in range(spec.num_layers)]


def lazily_resident() -> bool:
    """Whether ``allocate_kv_cache`` (without a mesh) leaves its pages untouched: the CPU
    backend with pallas_kernels/alloc/cpu.py built."""
    if jax.default_backend() != "cpu":
        return False
    from pallas_kernels.alloc import cpu as alloc

    return alloc.available()


def kv_cache_shapes(spec: KVCacheSpec) -> KVCache:
    """The cache as ShapeDtypeStructs (for ahead-of-time lowering without allocating)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                        jax.eval_shape(lambda: allocate_kv_cache(spec)))


def write_kv(k_pages: jax.Array, v_pages: jax.Array, k_new: jax.Array, v_new: jax.Array,
             slot_mapping: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Scatter this step's K/V rows into their pages.

    k_pages, v_pages: [N, page_size, KVH, D]; k_new, v_new: [T, KVH, D];
    slot_mapping: i32[T], slot = page_id * page_size + offset. Padded tokens carry a slot
    inside page 0 (several may share one: page 0 holds garbage by design).

    Under jit with the pages donated this is an in-place scatter of T rows: its cost does
    not grow with the cache (benchmarks/attention_cpu.py, "write_kv").
    """
    N, P, KVH, D = k_pages.shape
    if k_new.shape[0] == 1:
        # One row (a batch-1 decode step): XLA rewrites a one-row scatter into a
        # dynamic-update-slice, and for that it copies the whole donated page array first
        # (measured on XLA:CPU: 60 full-cache copies per step). The same row written twice
        # (same slot, same value: the result is that row whatever the order) keeps it a
        # scatter, which writes in place.
        k_new, v_new = (jnp.concatenate([x, x]) for x in (k_new, v_new))
        slot_mapping = jnp.concatenate([slot_mapping, slot_mapping])
    if isinstance(k_pages, QuantizedPages):
        return (_write_quantized(k_pages, k_new, slot_mapping),
                _write_quantized(v_pages, v_new, slot_mapping))
    if k_new.shape[1:] != (KVH, D) or v_new.shape != k_new.shape:
        raise ValueError(f"write_kv: k_new/v_new must be [T, {KVH}, {D}], got "
                         f"{k_new.shape} and {v_new.shape}")
    if slot_mapping.shape != k_new.shape[:1]:
        raise ValueError(f"write_kv: slot_mapping must be i32[{k_new.shape[0]}], got "
                         f"{slot_mapping.shape}")
    # [N, P, KVH, D] -> [N*P, KVH, D] is a bitcast; the scatter then writes whole
    # [KVH, D] rows. Slots are in bounds by construction (the batch builder makes them).
    kf = k_pages.reshape(N * P, KVH, D).at[slot_mapping].set(
        k_new.astype(k_pages.dtype), mode="promise_in_bounds")
    vf = v_pages.reshape(N * P, KVH, D).at[slot_mapping].set(
        v_new.astype(v_pages.dtype), mode="promise_in_bounds")
    return kf.reshape(N, P, KVH, D), vf.reshape(N, P, KVH, D)


def _write_quantized(pages: QuantizedPages, x: jax.Array, slot_mapping: jax.Array) -> QuantizedPages:
    """Quantize this step's rows x [T, KVH, D] (one scale per token and head) and scatter."""
    N, P, KVH, D = pages.shape
    q, scale = quantize_kv(x)
    qf = pages.q.reshape(N * P, KVH, D).at[slot_mapping].set(q, mode="promise_in_bounds")
    sf = pages.scale.reshape(N * P, KVH).at[slot_mapping].set(scale, mode="promise_in_bounds")
    return QuantizedPages(qf.reshape(N, P, KVH, D), sf.reshape(N, P, KVH))


def write_kv_layer(k_pages: Any, v_pages: Any, k_new: jax.Array, v_new: jax.Array,
                   slot_mapping: jax.Array, layer: jax.Array) -> tuple[Any, Any]:
    """``write_kv`` into layer ``layer``'s pages out of every layer's (the layer loop's form,
    models/layer_loop.py: lists over layers, or each side one ``layer_stack.Stacked``): the
    kernel that attention/dispatch.py chooses writes in place, every array aliased in -> out.
    int8 pages get exactly ``_write_quantized``'s contents (the rows quantized here by
    ``quantize_kv``, then copied)."""
    from jaxinfer.attention import dispatch
    from pallas_kernels.layer_stack import Stacked, first_layer

    if not isinstance(first_layer(k_pages), QuantizedPages):
        rows = [k_new.astype(jnp.float32), v_new.astype(jnp.float32)]
        ks, vs = dispatch.write_rows_layer([k_pages, v_pages], rows, slot_mapping, layer)
        return ks, vs

    def part(pages: Any, field: str) -> Any:        # every layer's q (or scale), in the form given
        if isinstance(pages, Stacked):
            return Stacked(getattr(pages.value, field))
        return [getattr(p, field) for p in pages]

    def join(q: Any, scale: Any) -> Any:
        if isinstance(q, Stacked):
            return Stacked(QuantizedPages(q.value, scale.value))
        return [QuantizedPages(a, b) for a, b in zip(q, scale)]

    (kq, ks), (vq, vs) = quantize_kv(k_new), quantize_kv(v_new)
    kq_p, vq_p, ks_p, vs_p = dispatch.write_rows_layer(
        [part(k_pages, "q"), part(v_pages, "q"), part(k_pages, "scale"), part(v_pages, "scale")],
        [kq, vq, ks, vs], slot_mapping, layer)
    return join(kq_p, ks_p), join(vq_p, vs_p)
