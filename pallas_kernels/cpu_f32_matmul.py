"""The CPU float32 matmul: a C++ kernel (cpu/f32_matmul.cc) called through jax.ffi.

XLA:CPU picks its dot kernel by the number of rows and each sums over K in its own order,
so the batch-invariant engine had to run every dot in fixed 32-row tiles (slow at batch 1).
This kernel computes every output as one k-ordered FMA chain whatever M, tile or thread,
so it is bitwise batch-invariant by construction (see the .cc header) and serves both the
plain and the batch-invariant engine: layers.matmul / tiled_matmul route float32 weights
here on the CPU backend. Weights are read in their stored [K, N] layout.

Built on first use by pallas_kernels/cpu_build.py; without a compiler ``available()`` is
False with the reason in ``unavailable_reason()`` and the engine keeps XLA's dots.
"""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import cpu_build

TARGET = "jaxinfer_f32_matmul"
_KERNEL = cpu_build.Kernel("f32_matmul.cc", {TARGET: "JaxinferF32Matmul"}, "f32 matmul")


def build() -> Path:
    """Compile the kernel (or find it in the cache) -> path of the shared library.
    Raises RuntimeError naming what failed."""
    return cpu_build.build(_KERNEL.source)


def available() -> bool:
    """True once the kernel is built, loaded and registered with XLA:CPU (done once)."""
    return _KERNEL.available()


def unavailable_reason() -> str | None:
    return _KERNEL.unavailable_reason()


@functools.partial(jax.jit, inline=True)
def f32_matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """x f32 [M, K] @ w f32 [K, N] -> f32 [M, N], each output one k-ordered FMA chain.
    Call ``available()`` first: it registers the kernel."""
    if x.ndim != 2 or w.ndim != 2:
        raise ValueError(f"f32_matmul: expected x [M, K] and w [K, N], got x {x.shape}, w {w.shape}")
    if x.dtype != jnp.float32 or w.dtype != jnp.float32:
        raise ValueError(f"f32_matmul: x and w must be float32, got x {x.dtype}, w {w.dtype}")
    K, N = w.shape
    if x.shape[1] != K:
        raise ValueError(f"x: expected [M, K={K}] (K = w.shape[0]), got shape {x.shape}")
    return jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((x.shape[0], N), jnp.float32))(x, w)


def f32_matmul_reference(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """The kernel's math in numpy float64 (what its f32 FMA chain approximates)."""
    return np.asarray(x, np.float64) @ np.asarray(w, np.float64)
