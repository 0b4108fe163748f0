"""The CPU ragged paged attention: a C++ kernel (cpu/paged_attention.cc) called through jax.ffi.

Same signature and meaning as ``pallas_kernels.attention.xla.ragged_paged_attention`` (the step
layout of engine/batch.py: ``num_decode`` one-token slots, then slots of ``prefill_chunk``
rows), for float32 KV pages. It reads K and V in place through the page table, where the
jnp version gathers every 64-token block into a copy inside an XLA while loop. Each
(query row, head) is computed by one thread in one fixed order that depends only on that
row (see the .cc header), so it is bitwise batch-invariant by construction.

Built on first use by pallas_kernels/cpu_build.py; without a compiler ``available()`` is
False and attention/dispatch.py keeps the jnp path.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import cpu_build

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
    if hasattr(k_pages, "scale") or k_pages.dtype != jnp.float32 or v_pages.dtype != jnp.float32:
        raise ValueError(f"cpu paged attention reads float32 pages, got {k_pages.dtype} "
                         "(use the 'xla' attention for bf16 / int8 KV caches)")
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


@functools.partial(jax.jit, static_argnames=("num_decode", "prefill_chunk", "sm_scale",
                                             "sliding_window", "soft_cap"))
def ragged_paged_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                           kv_lens: jax.Array, q_lens: jax.Array, page_table: jax.Array, *,
                           num_decode: int, prefill_chunk: int, sm_scale: float,
                           sliding_window: int | None = None,
                           soft_cap: float | None = None,
                           alibi_slopes: jax.Array | None = None) -> jax.Array:
    """q [T, H, D]; k_pages, v_pages f32[N, page_size, KVH, D]; kv_lens, q_lens i32[S];
    page_table i32[S, P]; ``alibi_slopes`` f32[H] (BLOOM / MPT: query head h adds
    slope[h] * (key pos - query pos) to its scores). Returns [T, H, D] in q's dtype (f32
    math). Call ``available()`` first: it registers the kernel."""
    slopes, attrs = _checked(q, k_pages, v_pages, kv_lens, q_lens, page_table, num_decode, prefill_chunk,
                             sm_scale, sliding_window, soft_cap, alibi_slopes)
    out = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))(
        q.astype(jnp.float32), k_pages, v_pages, kv_lens.astype(jnp.int32),
        q_lens.astype(jnp.int32), page_table.astype(jnp.int32), slopes, **attrs)
    return out.astype(q.dtype)


# The layer loop's forms (benchmarks/layer_loop_probe.py): every layer's pages are operands
# of their own and a traced layer index picks one layer's pair by pointer, so inside
# lax.fori_loop no page array is sliced (a slice of a stacked cache is a copy) or copied.

def ragged_paged_attention_layer(q: jax.Array, k_pages: Sequence[jax.Array], v_pages: Sequence[jax.Array],
                                 layer: jax.Array, kv_lens: jax.Array, q_lens: jax.Array,
                                 page_table: jax.Array, *, num_decode: int, prefill_chunk: int,
                                 sm_scale: float, sliding_window: int | None = None,
                                 soft_cap: float | None = None,
                                 alibi_slopes: jax.Array | None = None) -> jax.Array:
    """``ragged_paged_attention`` on layer ``layer``'s pages out of every layer's
    (``k_pages[i]``, ``v_pages[i]`` f32[N, page_size, KVH, D]): the same bits."""
    k_pages, v_pages = list(k_pages), list(v_pages)
    if not k_pages or len(k_pages) != len(v_pages) or any(
            p.shape != k_pages[0].shape or p.dtype != jnp.float32 for p in k_pages + v_pages):
        raise ValueError("paged attention (layer): one float32 K and V page array of one shape per layer")
    slopes, attrs = _checked(q, k_pages[0], v_pages[0], kv_lens, q_lens, page_table, num_decode, prefill_chunk,
                             sm_scale, sliding_window, soft_cap, alibi_slopes)
    idx = jnp.reshape(jnp.asarray(layer, jnp.int32), (1,))
    out = jax.ffi.ffi_call(TARGET_LAYER, jax.ShapeDtypeStruct(q.shape, jnp.float32))(
        q.astype(jnp.float32), idx, kv_lens.astype(jnp.int32), q_lens.astype(jnp.int32),
        page_table.astype(jnp.int32), slopes, *k_pages, *v_pages, **attrs)
    return out.astype(q.dtype)


def write_kv_layer(k_pages: Sequence[jax.Array], v_pages: Sequence[jax.Array], k_new: jax.Array,
                   v_new: jax.Array, slot_mapping: jax.Array,
                   layer: jax.Array) -> tuple[list[jax.Array], list[jax.Array]]:
    """kv_cache.write_kv into layer ``layer``'s pages, in place (every layer's page arrays
    are aliased in -> out; the kernel fails if XLA copied them): the same page contents.
    k_new, v_new [T, KVH, D]; slot_mapping i32[T]. Returns (k_pages, v_pages) lists."""
    k_pages, v_pages = list(k_pages), list(v_pages)
    L = len(k_pages)
    if not L or len(v_pages) != L or any(p.shape != k_pages[0].shape or p.dtype != jnp.float32
                                         for p in k_pages + v_pages):
        raise ValueError("write_kv_layer: one float32 K and V page array of one shape per layer")
    N, P, KVH, D = k_pages[0].shape
    if k_new.shape[1:] != (KVH, D) or v_new.shape != k_new.shape or slot_mapping.shape != k_new.shape[:1]:
        raise ValueError(f"write_kv_layer: k_new/v_new must be [T, {KVH}, {D}] and slot_mapping i32[T], got "
                         f"{k_new.shape}, {v_new.shape}, {slot_mapping.shape}")
    idx = jnp.reshape(jnp.asarray(layer, jnp.int32), (1,))
    outs = jax.ffi.ffi_call(TARGET_WRITE_LAYER, [jax.ShapeDtypeStruct(p.shape, p.dtype) for p in k_pages + v_pages],
                            input_output_aliases={4 + j: j for j in range(2 * L)})(
        idx, slot_mapping.astype(jnp.int32), k_new.astype(jnp.float32), v_new.astype(jnp.float32),
        *k_pages, *v_pages)
    return list(outs[:L]), list(outs[L:])
