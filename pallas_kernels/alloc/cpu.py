"""Arrays allocated without being written, on XLA:CPU (a C++ no-op, uninitialized.cc).

``uninitialized(shape, dtype)`` is a fresh array of unspecified content whose memory pages
become resident only when something writes them: what the paged KV pool needs to cost only
the pages requests use (engine/kv_cache.py). Built on first use by cpu_build.py; without
a compiler ``available()`` is False and callers fill with zeros instead.
"""

from __future__ import annotations

import functools
from typing import Any

import jax

from pallas_kernels import cpu_build

TARGET = "jaxinfer_uninitialized"
_KERNEL = cpu_build.Kernel("alloc/uninitialized.cc", {TARGET: "JaxinferUninitialized"}, "uninitialized buffer")
unavailable_reason, build = _KERNEL.unavailable_reason, _KERNEL.build


def available() -> bool:
    """True on the CPU backend once the no-op is built and registered with XLA:CPU."""
    return jax.default_backend() == "cpu" and _KERNEL.available()


@functools.partial(jax.jit, static_argnums=(0, 1))
def uninitialized(shape: tuple[int, ...], dtype: Any) -> jax.Array:
    """A new [shape] array of ``dtype``, its content unspecified and its pages untouched.
    One array per call: the call has no operands, so XLA could merge two in one program."""
    return jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(shape, dtype))()
