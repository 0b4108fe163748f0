"""The kernels, one folder per op, each holding every implementation of it side by side:

* ``attention/``: ragged paged attention. ``xla.py`` is the pure-jnp version (the
  reference every kernel is tested against, and the path on any backend), ``pallas.py``
  the Mosaic (TPU) and Triton (GPU) kernels, ``cpu.py`` + ``paged_attention.cc`` the
  C++ kernel for XLA:CPU (jax.ffi).
* ``quantized_matmul/``: int8 / int4 weight-only matmul. ``xla.py`` holds the weight
  format (``QuantizedWeight``, ``quantize``), the reference and the XLA path,
  ``pallas.py`` the TPU / GPU kernel, ``cpu.py`` + ``int8_matmul.cc`` the C++ int8 kernel.
* ``f32_matmul/``: the float32 matmul's C++ kernel (``cpu.py`` + ``f32_matmul.cc``).
* ``cpu_build.py`` + ``work_share.h``: building, caching and registering every C++ kernel.

Kernels import nothing from ``jaxinfer`` (which op runs where is chosen there:
``jaxinfer/attention/dispatch.py``, ``jaxinfer/matmul.py``). Submodules are imported on
use, so importing the package costs nothing.
"""
