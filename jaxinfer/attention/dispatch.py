"""Backend -> attention implementation, chosen once at start-up and logged.

All implementations share one signature (see pallas_kernels/attention/xla.py): q [T, H, D], the layer's
K/V pages, kv_lens, q_lens, page_table, and the static bucket layout.

* ``xla``: the pure-jnp ragged paged attention — any backend, any KV dtype, and the
  reference every kernel is tested against (bitwise batch-invariant on XLA:CPU).
* ``cpp``: pallas_kernels/attention/cpu.py — a C++ kernel through jax.ffi for XLA:CPU,
  float32 pages (bitwise batch-invariant by construction); several times the jnp path's
  speed on decode, less on prefill (benchmarks/attention_cpu.py; RESULTS.md).
* ``pallas``: pallas_kernels/attention/pallas.py — the Mosaic kernel on TPU, the
  Triton kernel on GPU. Not available on CPU (its tests run it there in interpret mode).
* ``auto``: ``pallas`` on TPU / GPU; on CPU ``cpp`` for float32 pages when the kernel
  builds (a C++ compiler is there), else ``xla``. ALiBi models (BLOOM, MPT) get ``xla``
  on TPU / GPU: the Pallas kernels take no slopes yet (logged).
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import jax
import jax.numpy as jnp

log = logging.getLogger("jaxinfer")

IMPLEMENTATIONS = ("auto", "xla", "cpp", "pallas")


def select(name: str = "auto", backend: str | None = None, kv_quantized: bool = False,
           kv_dtype: Any = jnp.float32, alibi: bool = False) -> tuple[str, Callable]:
    """Returns (the implementation's name, the function) for ``backend`` (default: JAX's).
    ``xla`` and ``pallas`` read float and int8 KV pages (``kv_quantized`` is logged);
    ``cpp`` reads float32 and int8 pages (not bf16: ``kv_dtype``). ``alibi``: the model adds ALiBi
    slopes, which ``xla`` and ``cpp`` take (not ``pallas``)."""
    if name not in IMPLEMENTATIONS:
        raise ValueError(f"attention: unknown implementation {name!r}; choose one of "
                         f"{', '.join(IMPLEMENTATIONS)}")
    backend = backend or jax.default_backend()
    if alibi and name == "pallas":
        raise ValueError("attention: 'pallas' does not take ALiBi slopes (BLOOM / MPT); "
                         "use 'xla', 'cpp' or 'auto'")
    if alibi and name == "auto" and backend in ("tpu", "gpu"):
        log.info("attention: ALiBi model -> the jnp path (the Pallas kernels take no slopes)")
        name = "xla"
    cpp_pages = kv_quantized or jnp.dtype(kv_dtype) == jnp.float32
    if name == "auto":
        if backend in ("tpu", "gpu"):
            name = "pallas"
        else:
            from pallas_kernels.attention import cpu as cpu_attention
            name = "cpp" if backend == "cpu" and cpp_pages and cpu_attention.available() else "xla"
    if name == "cpp":
        if backend != "cpu" or not cpp_pages:
            raise ValueError(f"attention: 'cpp' needs the CPU backend and a float32 or int8 KV cache "
                             f"(here: backend {backend!r}, KV {jnp.dtype(kv_dtype).name}); "
                             "use 'xla' or 'auto'")
        from pallas_kernels.attention import cpu as cpu_attention
        if not cpu_attention.available():
            raise ValueError(f"attention: the 'cpp' kernel cannot be built here: "
                             f"{cpu_attention.unavailable_reason()}")
        fn = cpu_attention.ragged_paged_attention
    elif name == "xla":
        from pallas_kernels.attention.xla import ragged_paged_attention as fn
    elif backend == "tpu":
        from pallas_kernels.attention.pallas import ragged_paged_attention_tpu as fn
    elif backend == "gpu":
        from pallas_kernels.attention.pallas import ragged_paged_attention_gpu as fn
    else:
        raise ValueError(f"attention: 'pallas' needs a TPU or GPU backend, this one is {backend!r} "
                         "(use 'xla' or 'auto')")
    chosen = f"{name}-{backend}" if name == "pallas" else name
    log.info("attention: %s on backend %s%s", chosen, backend,
             ", int8 KV pages" if kv_quantized else "")
    return chosen, fn
