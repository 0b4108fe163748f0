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

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import cpu_build

TARGET = "jaxinfer_paged_attention"
_KERNEL = cpu_build.Kernel("attention/paged_attention.cc", {TARGET: "JaxinferPagedAttention"},
                           "paged attention")


# built, loaded and registered with XLA:CPU once, on the first available()
available, unavailable_reason, build = _KERNEL.available, _KERNEL.unavailable_reason, _KERNEL.build


@functools.partial(jax.jit, static_argnames=("num_decode", "prefill_chunk", "sm_scale",
                                             "sliding_window", "soft_cap"))
def ragged_paged_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                           kv_lens: jax.Array, q_lens: jax.Array, page_table: jax.Array, *,
                           num_decode: int, prefill_chunk: int, sm_scale: float,
                           sliding_window: int | None = None,
                           soft_cap: float | None = None) -> jax.Array:
    """q [T, H, D]; k_pages, v_pages f32[N, page_size, KVH, D]; kv_lens, q_lens i32[S];
    page_table i32[S, P]. Returns [T, H, D] in q's dtype (f32 math). Call ``available()``
    first: it registers the kernel."""
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
    out = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))(
        q.astype(jnp.float32), k_pages, v_pages, kv_lens.astype(jnp.int32),
        q_lens.astype(jnp.int32), page_table.astype(jnp.int32),
        num_decode=np.int64(num_decode), prefill_chunk=np.int64(prefill_chunk),
        sm_scale=np.float32(sm_scale), sliding_window=np.int64(sliding_window or 0),
        soft_cap=np.float32(soft_cap or 0.0))
    return out.astype(q.dtype)
