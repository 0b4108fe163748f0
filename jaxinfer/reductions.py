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
    length is padded with one 0, which changes no sum)."""
    while x.shape[-1] > 1:
        if x.shape[-1] % 2:
            x = jnp.concatenate([x, jnp.zeros_like(x[..., :1])], axis=-1)
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    return x[..., 0]
