"""Row sums in the fixed pairwise order of ``xla.py`` (its reference): a C++ kernel
(row_sum.cc) called through jax.ffi, the same bits as that jnp fold as one custom call.

Built on first use by pallas_kernels/cpu_build.py (first of all the kernels: the sampler,
compiled first at start-up, needs it); without a compiler ``available()`` is False with
the reason in ``unavailable_reason()`` and jaxinfer/reductions.py keeps the jnp fold.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import cpu_build

TARGET = "jaxinfer_row_sum"
TARGET_SQUARES = "jaxinfer_row_sum_squares"
_KERNEL = cpu_build.Kernel(cpu_build.ROW_SUM, {TARGET: "JaxinferRowSum", TARGET_SQUARES: "JaxinferRowSumSquares"},
                           "row sum")
available, unavailable_reason, build = _KERNEL.available, _KERNEL.unavailable_reason, _KERNEL.build


def row_sum(x: jax.Array, squares: bool = False) -> jax.Array:
    """f32 [..., N] -> [...]: ``xla.row_sum``'s fixed pairwise fold as one custom call
    (the same bits); ``squares``: of x * x, each square rounded (no FMA), without
    materializing x * x. Call ``available()`` first: it registers the kernel. Leading
    dimensions are rows, so a vmapped call just has more of them."""
    if x.dtype != jnp.float32 or x.ndim < 1 or x.shape[-1] < 1:
        raise ValueError(f"row_sum: expected float32 [..., N >= 1], got {x.dtype} {x.shape}")
    out = jax.ShapeDtypeStruct(x.shape[:-1], jnp.float32)
    return jax.ffi.ffi_call(TARGET_SQUARES if squares else TARGET, out, vmap_method="broadcast_all")(x)
