"""Pallas kernels for TPU (Mosaic) and GPU (Triton), each module holding kernel, jitted
wrapper and reference:

* ``ragged_paged_attention``: ``ragged_paged_attention_tpu`` / ``ragged_paged_attention_gpu``,
  the signature of ``jaxinfer.attention.xla.ragged_paged_attention`` plus ``interpret``.
* ``quantized_matmul``: int8 / int4 weight-only matmul (``quantize``, ``QuantizedWeight``,
  ``quantized_matmul_tpu`` / ``_gpu`` / ``_xla`` / ``_reference``).
* ``cpu_matmul``: not Pallas — the CPU int8 matmul, a C++ kernel (``cpu/int8_matmul.cc``)
  called through ``jax.ffi`` and compiled on first use; XLA:CPU has no fused int8 GEMV.

Submodules are imported on use, so importing the package costs nothing.
"""
