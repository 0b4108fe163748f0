"""Sums over the last axis in one fixed order, whatever the number of rows: the one place
that chooses the row-sum implementation (the norms, the sampler's log-softmax and MoE
routing call ``row_sum`` / ``row_sum_squares``; Engine.kernels reports ``name``).

XLA:CPU vectorizes a reduction differently with the number of rows it reduces (measured:
an RMSNorm over D = 576 gives other bits for 1-5 rows than for 8 or more, a softmax too),
so a token's activations, and every logprob computed from them, would depend on what else
shares its step: greedy tokens survive that (the argmax rarely moves by an ulp), logprobs
do not. Both implementations sum by folding the row in halves with elementwise adds
(pallas_kernels/row_sum/xla.py says the order), so a row's sum never depends on its
neighbours:

* ``cpp``: pallas_kernels/row_sum/cpu.py, the fold as one C++ call, float32 on the CPU
  backend. Why: traced in jnp, the fold is ~40 HLO instructions per sum, and a decoder
  layer's sums were half of its HLO, which doubled every step executable's compile time
  and resident size (benchmarks/RESULTS.md "Row sums as one C++ custom call").
* ``xla``: pallas_kernels/row_sum/xla.py, the fold in jnp (its reference, the same bits)
  for any dtype and backend (GPU, TPU, no C++ compiler).

The interface is matmul.py's and attention/dispatch.py's: ``select`` gives the
implementation, ``name`` says what runs.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp


def row_sum(x: jax.Array) -> jax.Array:
    """x [..., N] -> [...]: the sum over the last axis as a fixed pairwise tree."""
    return select(x)(x)


def row_sum_squares(x: jax.Array) -> jax.Array:
    """``row_sum(x * x)`` in the same fixed order (RMSNorm's variance); with the CPU kernel
    the squares are not materialized (each still rounded on its own: no FMA). Without it,
    XLA may fuse a square into an FMA with the add after it, so the two paths can differ in
    the last bit; each is batch-invariant."""
    return select(x)(x, squares=True)


def select(x: jax.Array) -> Callable[..., jax.Array]:
    """The implementation that sums x's rows, called as ``(x, squares=False)``: the C++
    fold for a float32 x on the CPU backend with the kernel built (rows longer than one),
    else the jnp fold."""
    if _kernel_applies(x):
        from pallas_kernels.row_sum import cpu as cpu_row_sum

        return cpu_row_sum.row_sum
    from pallas_kernels.row_sum import xla as xla_row_sum

    return xla_row_sum.row_sum


def name() -> str:
    """What serves float32 row sums here: "cpp" (the C++ fold) or "xla" (the jnp fold)."""
    if jax.default_backend() != "cpu":
        return "xla"
    from pallas_kernels.row_sum import cpu as cpu_row_sum

    return "cpp" if cpu_row_sum.available() else "xla"


def _kernel_applies(x: jax.Array) -> bool:
    return x.dtype == jnp.float32 and x.ndim >= 1 and x.shape[-1] > 1 and name() == "cpp"
