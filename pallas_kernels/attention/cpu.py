"""The CPU ragged paged attention: a C++ kernel (paged_attention.cc) called through jax.ffi.

Same signature and meaning as ``pallas_kernels.attention.xla.ragged_paged_attention`` (the step
layout of engine/batch.py: ``num_decode`` one-token slots, then slots of ``prefill_chunk``
rows), for float32 KV pages or int8 ones (engine/kv_cache.py ``QuantizedPages``: values
and one f32 scale per token and head, read here as their ``q`` and ``scale`` arrays). It
reads K and V in place through the page table, where the jnp version gathers every 64-token
block into a copy inside an XLA while loop; int8 rows are dequantized as they are read,
exactly as ``QuantizedPages.dequantize`` does, so int8 pages give the bits of float32 pages
holding their dequantized values. Each
(query row, head) is computed by one thread in one fixed order that depends only on that
row (see the .cc header), so it is bitwise batch-invariant by construction.

Built on first use by pallas_kernels/cpu_build.py; without a compiler ``available()`` is
False and jaxinfer/attention/dispatch.py keeps the jnp path.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import cpu_build
from pallas_kernels.layer_stack import Stacked, first_layer, layer_weights, members

TARGET = "jaxinfer_paged_attention"
TARGET_LAYER = "jaxinfer_paged_attention_layer"
TARGET_WRITE_LAYER = "jaxinfer_kv_write_layer"
_KERNEL = cpu_build.Kernel("attention/paged_attention.cc", {TARGET: "JaxinferPagedAttention",
                                                            TARGET_LAYER: "JaxinferPagedAttentionLayer",
                                                            TARGET_WRITE_LAYER: "JaxinferKvWriteLayer"},
                           "paged attention")


# built, loaded and registered with XLA:CPU once, on the first available()
available, unavailable_reason, build = _KERNEL.available, _KERNEL.unavailable_reason, _KERNEL.build


def _checked(q, k_pages, v_pages, kv_lens, q_lens, page_table, num_decode: int, prefill_chunk: int,
             sm_scale: float, sliding_window: int | None, soft_cap: float | None,
             alibi_slopes: jax.Array | None) -> tuple[jax.Array, dict[str, Any]]:
    """ValueError naming what is wrong with one layer's arguments; else (the slopes
    operand, the kernel's attributes), shared by both entry points."""
    from pallas_kernels.attention.xla import check_args

    check_args(q, k_pages, v_pages, kv_lens, q_lens, page_table, num_decode, prefill_chunk)
    f32 = not hasattr(k_pages, "scale") and k_pages.dtype == jnp.float32 and v_pages.dtype == jnp.float32
    if not (f32 or (_is_int8(k_pages) and _is_int8(v_pages))):
        raise ValueError(f"cpu paged attention reads float32 pages or int8 pages with f32 scales, got "
                         f"{k_pages.dtype} (use the 'xla' attention for bf16 KV caches)")
    if q.shape[-1] % 8:
        raise ValueError(f"cpu paged attention: head_dim must be a multiple of 8, got {q.shape[-1]}")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
    if soft_cap is not None and not soft_cap > 0:
        raise ValueError(f"soft_cap must be > 0, got {soft_cap}")
    if alibi_slopes is not None and alibi_slopes.shape != (q.shape[1],):
        raise ValueError(f"alibi_slopes: expected [{q.shape[1]}] (one per query head), got {alibi_slopes.shape}")
    slopes = jnp.zeros((0,), jnp.float32) if alibi_slopes is None else alibi_slopes.astype(jnp.float32)
    return slopes, dict(num_decode=np.int64(num_decode), prefill_chunk=np.int64(prefill_chunk),
                        sm_scale=np.float32(sm_scale), sliding_window=np.int64(sliding_window or 0),
                        soft_cap=np.float32(soft_cap or 0.0))


def _is_int8(pages: Any) -> bool:
    """int8 pages with per-token scales (kv_cache.QuantizedPages): q s8[N, ps, KVH, D] and
    scale f32[N, ps, KVH]."""
    return (hasattr(pages, "scale") and pages.q.dtype == jnp.int8 and pages.scale.dtype == jnp.float32
            and pages.scale.shape == pages.q.shape[:3])


def _page_operands(k_pages: Sequence[Any] | Stacked, v_pages: Sequence[Any] | Stacked) -> list[jax.Array]:
    """Every layer's pages as the kernels' operands: float32 K_0.., V_0..; int8 Kq_0..,
    Vq_0.., then their scales Ks_0.., Vs_0.. (each kind one [L, ...] operand when stacked)."""
    ks, vs = members(k_pages), members(v_pages)
    if _is_int8(first_layer(k_pages)):
        return [p.q for p in ks] + [p.q for p in vs] + [p.scale for p in ks] + [p.scale for p in vs]
    return ks + vs


@functools.partial(jax.jit, static_argnames=("num_decode", "prefill_chunk", "sm_scale",
                                             "sliding_window", "soft_cap"))
def ragged_paged_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                           kv_lens: jax.Array, q_lens: jax.Array, page_table: jax.Array, *,
                           num_decode: int, prefill_chunk: int, sm_scale: float,
                           sliding_window: int | None = None,
                           soft_cap: float | None = None,
                           alibi_slopes: jax.Array | None = None) -> jax.Array:
    """q [T, H, D]; k_pages, v_pages f32[N, page_size, KVH, D] (or int8 QuantizedPages); kv_lens, q_lens i32[S];
    page_table i32[S, P]; ``alibi_slopes`` f32[H] (BLOOM / MPT: query head h adds
    slope[h] * (key pos - query pos) to its scores). Returns [T, H, D] in q's dtype (f32
    math). Call ``available()`` first: it registers the kernel."""
    slopes, attrs = _checked(q, k_pages, v_pages, kv_lens, q_lens, page_table, num_decode, prefill_chunk,
                             sm_scale, sliding_window, soft_cap, alibi_slopes)
    out = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))(
        q.astype(jnp.float32), *_page_operands([k_pages], [v_pages]), kv_lens.astype(jnp.int32),
        q_lens.astype(jnp.int32), page_table.astype(jnp.int32), slopes, **attrs)
    return out.astype(q.dtype)


# The layer loop's forms (benchmarks/layer_loop_probe.py): every layer's pages are operands
# of their own, or each kind one stacked [L, ...] operand (``layer_stack.Stacked``: the
# engine's pool on one device, engine/kv_cache.py StackedKV), and a traced layer index picks
# one layer's pair by pointer, so inside lax.fori_loop no page array is sliced (a slice of
# a stacked cache in XLA is a copy) or copied.

def _same_kind(k_pages: Sequence[Any] | Stacked, v_pages: Sequence[Any] | Stacked) -> bool:
    """K and V alike: lists of one length, or both stacked; every layer's pages one shape and kind."""
    if isinstance(k_pages, Stacked) != isinstance(v_pages, Stacked) or len(members(k_pages)) != len(members(v_pages)):
        return False
    if isinstance(k_pages, Stacked) and k_pages.value.shape[0] != v_pages.value.shape[0]:
        return False
    each = layer_weights(k_pages) + layer_weights(v_pages)
    return bool(each) and all(p.shape == each[0].shape and _is_int8(p) == _is_int8(each[0]) for p in each)


def ragged_paged_attention_layer(q: jax.Array, k_pages: Sequence[Any] | Stacked, v_pages: Sequence[Any] | Stacked,
                                 layer: jax.Array, kv_lens: jax.Array, q_lens: jax.Array,
                                 page_table: jax.Array, *, num_decode: int, prefill_chunk: int,
                                 sm_scale: float, sliding_window: int | None = None,
                                 soft_cap: float | None = None,
                                 alibi_slopes: jax.Array | None = None) -> jax.Array:
    """``ragged_paged_attention`` on layer ``layer``'s pages out of every layer's
    (``k_pages[i]``, ``v_pages[i]`` f32[N, page_size, KVH, D], or int8 QuantizedPages; or
    each a ``Stacked`` of such with a leading L): the same bits."""
    if not isinstance(k_pages, Stacked):
        k_pages, v_pages = list(k_pages), list(v_pages)
    if not _same_kind(k_pages, v_pages):
        raise ValueError("paged attention (layer): one K and V page array of one shape and kind per layer")
    slopes, attrs = _checked(q, first_layer(k_pages), first_layer(v_pages), kv_lens, q_lens, page_table,
                             num_decode, prefill_chunk, sm_scale, sliding_window, soft_cap, alibi_slopes)
    idx = jnp.reshape(jnp.asarray(layer, jnp.int32), (1,))
    out = jax.ffi.ffi_call(TARGET_LAYER, jax.ShapeDtypeStruct(q.shape, jnp.float32))(
        q.astype(jnp.float32), idx, kv_lens.astype(jnp.int32), q_lens.astype(jnp.int32),
        page_table.astype(jnp.int32), slopes, *_page_operands(k_pages, v_pages), **attrs)
    return out.astype(q.dtype)


def write_rows_layer(pages: Sequence[Sequence[jax.Array] | Stacked], rows: Sequence[jax.Array],
                     slot_mapping: jax.Array, layer: jax.Array) -> list[list[jax.Array] | Stacked]:
    """Rows into layer ``layer``'s page arrays, in place (every array is aliased in -> out;
    the kernel fails if XLA copied them). ``pages[g]``: group g's array of every layer
    ([N, page_size, ...]), or all groups each one ``Stacked`` [L, N, page_size, ...];
    ``rows[g]`` [T, ...] its new rows (same dtype; slot t of slot_mapping i32[T] gets row t).
    Groups: float32 K, V; or int8 Kq, Vq and f32 Ks, Vs. Returns the groups' new arrays, in
    the form they came."""
    stacked = bool(pages) and all(isinstance(g, Stacked) for g in pages)
    if not stacked and any(isinstance(g, Stacked) for g in pages):
        raise ValueError("write_kv_layer: every group stacked, or none")
    groups, rows = [members(g) if stacked else list(g) for g in pages], list(rows)
    each = [layer_weights(g) for g in pages] if stacked else groups
    L = pages[0].value.shape[0] if stacked else len(groups[0]) if groups else 0
    kinds = ([jnp.float32] * 2, [jnp.int8] * 2 + [jnp.float32] * 2)
    if not L or len(rows) != len(groups) or [r.dtype for r in rows] not in kinds or any(
            len(g) != len(groups[0]) or any(p.shape != g[0].shape or p.dtype != r.dtype for p in g)
            for g, r in zip(each, rows)) or (stacked and any(g.value.shape[0] != L for g in pages)):
        raise ValueError("write_kv_layer: float32 K, V (or int8 Kq, Vq and f32 Ks, Vs) page arrays of one shape "
                         "per layer, and their new rows in the same dtypes")
    for g, r in zip(each, rows):
        if r.shape[1:] != g[0].shape[2:] or r.shape[:1] != slot_mapping.shape:
            raise ValueError(f"write_kv_layer: new rows must be [T, *{g[0].shape[2:]}] with slot_mapping i32[T], "
                             f"got {r.shape} and {slot_mapping.shape}")
    flat = [p for g in groups for p in g]
    idx = jnp.reshape(jnp.asarray(layer, jnp.int32), (1,))
    n_in = 2 + len(rows)
    outs = jax.ffi.ffi_call(TARGET_WRITE_LAYER, [jax.ShapeDtypeStruct(p.shape, p.dtype) for p in flat],
                            input_output_aliases={n_in + j: j for j in range(len(flat))})(
        idx, slot_mapping.astype(jnp.int32), *rows, *flat)
    if stacked:
        return [Stacked(o) for o in outs]
    return [list(outs[i * L:(i + 1) * L]) for i in range(len(groups))]


def write_kv_layer(k_pages: Sequence[jax.Array] | Stacked, v_pages: Sequence[jax.Array] | Stacked,
                   k_new: jax.Array, v_new: jax.Array, slot_mapping: jax.Array,
                   layer: jax.Array) -> tuple[Any, Any]:
    """kv_cache.write_kv into layer ``layer``'s float32 pages, in place: the same page
    contents. k_new, v_new [T, KVH, D]; slot_mapping i32[T]. Returns (k_pages, v_pages) in
    the form they came (lists or Stacked). (int8 pages: kv_cache.write_kv_layer quantizes,
    then ``write_rows_layer``.)"""
    ks, vs = write_rows_layer([k_pages, v_pages], [k_new.astype(jnp.float32), v_new.astype(jnp.float32)],
                              slot_mapping, layer)
    return ks, vs
