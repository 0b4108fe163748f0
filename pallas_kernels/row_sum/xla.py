"""Row sums in jnp, in the fixed order the C++ kernel (``cpu.py`` + ``row_sum.cc``) keeps:
the kernel's reference, bitwise (tests/test_reductions.py), and the path wherever the
kernel is not (GPU, TPU, no C++ compiler; jaxinfer/reductions.py chooses).

The order: the row is folded in halves with elementwise adds, x[i] + x[i + half], an odd
length first padded with one 0 (which changes no sum), until one value is left. IEEE adds
of the same operands give the same bits in any vectorization, and the pairing depends only
on the row length, so a row's sum never depends on the rows beside it (XLA's own reduce
changes its order with the number of rows).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def row_sum(x: jax.Array, squares: bool = False) -> jax.Array:
    """x [..., N] -> [...]: the sum over the last axis as the fixed pairwise fold (any
    dtype), the kernel's signature. ``squares``: of x * x. The kernel rounds every square
    on its own; here, under jit, XLA may contract a square into the add after it (an FMA),
    so only the fold of squares computed beforehand is the kernel's bits."""
    if squares:
        x = x * x
    while x.shape[-1] > 1:
        if x.shape[-1] % 2:
            x = jnp.concatenate([x, jnp.zeros_like(x[..., :1])], axis=-1)
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    return x[..., 0]
