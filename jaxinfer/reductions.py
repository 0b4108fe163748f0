"""Sums over the last axis in one fixed order, whatever the number of rows.

XLA:CPU vectorizes a reduction differently with the number of rows it reduces (measured:
an RMSNorm over D = 576 gives other bits for 1-5 rows than for 8 or more, a softmax too),
so a token's activations, and every logprob computed from them, would depend on what else
shares its step: greedy tokens survive that (the argmax rarely moves by an ulp), logprobs
do not. ``row_sum`` sums by folding the row in halves with elementwise adds: IEEE adds of
the same operands give the same bits in any vectorization, and the pairing depends only
on the row length, so a row's sum never depends on its neighbours.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def row_sum(x: jax.Array) -> jax.Array:
    """x [..., N] -> [...]: the sum over the last axis as a fixed pairwise tree (an odd
    length is padded with one 0, which changes no sum).

    On the CPU backend a float32 sum is one call of the C++ kernel that does the same fold
    (pallas_kernels/row_sum/cpu.row_sum: the same bits, tests/test_reductions.py): traced
    in jnp, the fold is ~40 HLO instructions per sum, and a decoder layer's sums were half
    of its HLO, which doubled every step executable's compile time and resident size
    (benchmarks/RESULTS.md "Row sums as one C++ custom call"). Elsewhere (GPU, TPU, no C++ compiler) the jnp fold."""
    if _kernel_applies(x):
        from pallas_kernels.row_sum import cpu as cpu_row_sum

        return cpu_row_sum.row_sum(x)
    return row_sum_tree(x)


def row_sum_squares(x: jax.Array) -> jax.Array:
    """``row_sum(x * x)`` in the same fixed order (RMSNorm's variance); with the CPU kernel
    the squares are not materialized (each still rounded on its own: no FMA). Without it,
    XLA may fuse a square into an FMA with the add after it, so the two paths can differ in
    the last bit; each is batch-invariant."""
    if _kernel_applies(x):
        from pallas_kernels.row_sum import cpu as cpu_row_sum

        return cpu_row_sum.row_sum(x, squares=True)
    return row_sum_tree(x * x)


def name() -> str:
    """What serves float32 row sums here: "cpp" (the C++ fold) or "xla" (the jnp fold)."""
    if jax.default_backend() != "cpu":
        return "xla"
    from pallas_kernels.row_sum import cpu as cpu_row_sum

    return "cpp" if cpu_row_sum.available() else "xla"


def _kernel_applies(x: jax.Array) -> bool:
    return x.dtype == jnp.float32 and x.ndim >= 1 and x.shape[-1] > 1 and name() == "cpp"


def row_sum_tree(x: jax.Array) -> jax.Array:
    """``row_sum`` in jnp ops (any backend, any dtype)."""
    while x.shape[-1] > 1:
        if x.shape[-1] % 2:
            x = jnp.concatenate([x, jnp.zeros_like(x[..., :1])], axis=-1)
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    return x[..., 0]
