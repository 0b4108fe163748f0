"""The kernels, one folder per op, each holding every implementation of it side by side
with the reference it is tested against:

* ``attention/``: ragged paged attention. ``xla.py`` is the pure-jnp version (the
  reference every kernel is tested against, and the path on any backend), ``pallas.py``
  the Mosaic (TPU) and Triton (GPU) kernels, ``cpu.py`` + ``paged_attention.cc`` the
  C++ kernel for XLA:CPU (jax.ffi), with the layer loop's indexed attention and KV write.
* ``quantized_matmul/``: int8 / int4 weight-only matmul. ``xla.py`` holds the weight
  format (``QuantizedWeight``, ``quantize``), the reference and the XLA path,
  ``pallas.py`` the TPU / GPU kernel, ``cpu.py`` + ``int8_matmul.cc`` the C++ int8 kernel.
* ``f32_matmul/``: the float32 matmul's C++ kernel (``cpu.py``, which holds its reference,
  + ``f32_matmul.cc``) and ``codes.py``, float32 weights' exact block codes (``CodedF32``).
* ``row_sum/``: row sums in one fixed order. ``xla.py`` the jnp fold (the reference and
  the path off CPU), ``cpu.py`` + ``row_sum.cc`` the C++ kernel.
* ``alloc/``: arrays allocated untouched on XLA:CPU (``cpu.py`` + ``uninitialized.cc``), so
  the KV pool costs RAM only for the pages requests write.
* ``layer_stack.py``: every layer's weight (or KV pages) for a layer-indexed kernel, one
  per layer or stacked.
* ``cpu_build.py`` + ``ffi_lite.h`` + ``work_share.h``: building, caching and registering
  every C++ kernel; the slice of XLA's FFI they use; their work sharing over XLA's threads.

Kernels import nothing from ``jaxinfer``. Which op runs where is chosen there, in one place
per op (the ops layer, ``tests/test_imports.py``): ``jaxinfer/attention/dispatch.py``,
``jaxinfer/matmul.py``, ``jaxinfer/reductions.py``. Submodules are imported on use, so
importing the package costs nothing.
"""
