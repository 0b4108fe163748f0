"""Backend -> attention implementation: the one place the paged attention, the layer
loop's forms of it and of the KV write are chosen (the runner and engine/kv_cache.py
come here; nothing else in jaxinfer imports an attention kernel).

All implementations share one signature (see pallas_kernels/attention/xla.py): q [T, H, D], the layer's
K/V pages, kv_lens, q_lens, page_table, and the static bucket layout.

* ``xla``: the pure-jnp ragged paged attention — any backend, any KV dtype, and the
  reference every kernel is tested against (bitwise batch-invariant on XLA:CPU).
* ``cpp``: pallas_kernels/attention/cpu.py — a C++ kernel through jax.ffi for XLA:CPU,
  float32 or int8 pages (bitwise batch-invariant by construction); several times the jnp path's
  speed on decode, less on prefill (benchmarks/attention_cpu.py; RESULTS.md).
* ``pallas``: pallas_kernels/attention/pallas.py — the Mosaic kernel on TPU, the
  Triton kernel on GPU. Not available on CPU (its tests run it there in interpret mode).
* ``auto``: ``pallas`` on TPU / GPU; on CPU ``cpp`` for float32 pages when the kernel
  builds (a C++ compiler is there), else ``xla``. ALiBi models (BLOOM, MPT) get ``xla``
  on TPU / GPU: the Pallas kernels take no slopes yet (logged).

The interface is matmul.py's and reductions.py's: ``name`` says what runs, ``select``
gives it (here with its name: the runner reports both).
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import jax
import jax.numpy as jnp

log = logging.getLogger("jaxinfer")

IMPLEMENTATIONS = ("auto", "xla", "cpp", "pallas")


def name(implementation: str = "auto", backend: str | None = None, kv_quantized: bool = False,
         kv_dtype: Any = jnp.float32, alibi: bool = False) -> str:
    """What serves attention for ``implementation`` on ``backend`` (default: JAX's): "xla",
    "cpp", "pallas-tpu" or "pallas-gpu"; ValueError where it cannot run. ``xla`` and
    ``pallas`` read float and int8 KV pages (``kv_quantized``); ``cpp`` reads float32 and
    int8 pages (not bf16: ``kv_dtype``). ``alibi``: the model adds ALiBi slopes, which
    ``xla`` and ``cpp`` take (not ``pallas``)."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"attention: unknown implementation {implementation!r}; choose one of "
                         f"{', '.join(IMPLEMENTATIONS)}")
    if alibi and implementation == "pallas":
        raise ValueError("attention: 'pallas' does not take ALiBi slopes (BLOOM / MPT); "
                         "use 'xla', 'cpp' or 'auto'")
    backend = backend or jax.default_backend()
    cpp_pages = kv_quantized or jnp.dtype(kv_dtype) == jnp.float32
    if implementation == "auto":
        implementation = _auto(backend, cpp_pages, alibi)
    _check_runs(implementation, backend, cpp_pages, kv_dtype)
    return f"pallas-{backend}" if implementation == "pallas" else implementation


def _auto(backend: str, cpp_pages: bool, alibi: bool) -> str:
    """What ``auto`` means on ``backend`` (the module docstring)."""
    if backend in ("tpu", "gpu"):
        return "xla" if alibi else "pallas"
    return "cpp" if backend == "cpu" and cpp_pages and _cpu_kernel().available() else "xla"


def _check_runs(implementation: str, backend: str, cpp_pages: bool, kv_dtype: Any) -> None:
    """ValueError, saying why, where ``implementation`` cannot run on ``backend``."""
    if implementation == "cpp":
        if backend != "cpu" or not cpp_pages:
            raise ValueError(f"attention: 'cpp' needs the CPU backend and a float32 or int8 KV cache "
                             f"(here: backend {backend!r}, KV {jnp.dtype(kv_dtype).name}); "
                             "use 'xla' or 'auto'")
        if not _cpu_kernel().available():
            raise ValueError(f"attention: the 'cpp' kernel cannot be built here: "
                             f"{_cpu_kernel().unavailable_reason()}")
    if implementation == "pallas" and backend not in ("tpu", "gpu"):
        raise ValueError(f"attention: 'pallas' needs a TPU or GPU backend, this one is {backend!r} "
                         "(use 'xla' or 'auto')")


def select(implementation: str = "auto", backend: str | None = None, kv_quantized: bool = False,
           kv_dtype: Any = jnp.float32, alibi: bool = False) -> tuple[str, Callable]:
    """(``name(...)``, the function that runs it), the choice logged; the arguments are
    ``name``'s."""
    backend = backend or jax.default_backend()
    chosen = name(implementation, backend, kv_quantized, kv_dtype, alibi)
    if alibi and implementation == "auto" and backend in ("tpu", "gpu"):
        log.info("attention: ALiBi model -> the jnp path (the Pallas kernels take no slopes)")
    log.info("attention: %s on backend %s%s", chosen, backend,
             ", int8 KV pages" if kv_quantized else "")
    return chosen, _function(chosen)


def _function(chosen: str) -> Callable:
    """The ragged paged attention of a ``name``."""
    if chosen == "cpp":
        return _cpu_kernel().ragged_paged_attention
    if chosen == "xla":
        from pallas_kernels.attention.xla import ragged_paged_attention
        return ragged_paged_attention
    from pallas_kernels.attention import pallas
    return {"pallas-tpu": pallas.ragged_paged_attention_tpu, "pallas-gpu": pallas.ragged_paged_attention_gpu}[chosen]


def _cpu_kernel() -> Any:
    """pallas_kernels/attention/cpu.py, imported on first use (it builds on first ``available()``)."""
    from pallas_kernels.attention import cpu
    return cpu


# The layer loop's forms (models/layer_loop.py): every layer's pages, a list or one
# ``layer_stack.Stacked``, and a traced layer index that picks one layer's by pointer. Only
# the C++ kernel has them, so the layers loop only where ``select`` chose "cpp" (``can_index``,
# as matmul.can_index for a weight).

def can_index(chosen: str) -> bool:
    """Whether the implementation ``chosen`` (a ``name``) reads every layer's pages by a
    traced layer index (the forms below)."""
    return chosen == "cpp"


def ragged_paged_attention_layer(q: jax.Array, k_pages: Any, v_pages: Any, layer: jax.Array,
                                 *args: Any, **kwargs: Any) -> jax.Array:
    """The attention on layer ``layer``'s pages out of every layer's: the C++ kernel's
    indexed form (pallas_kernels/attention/cpu.py; its arguments after ``layer`` are the
    plain form's after the pages), the same bits as ``ragged_paged_attention`` on that layer."""
    return _cpu_kernel().ragged_paged_attention_layer(q, k_pages, v_pages, layer, *args, **kwargs)


def write_rows_layer(pages: Any, rows: Any, slot_mapping: jax.Array, layer: jax.Array) -> list:
    """The KV write into layer ``layer``'s page arrays out of every layer's, in place: the
    C++ kernel's (pallas_kernels/attention/cpu.py ``write_rows_layer``, which says the
    groups: float32 K, V or int8 Kq, Vq, Ks, Vs); engine/kv_cache.py ``write_kv_layer``
    quantizes int8 rows before it."""
    return _cpu_kernel().write_rows_layer(pages, rows, slot_mapping, layer)
