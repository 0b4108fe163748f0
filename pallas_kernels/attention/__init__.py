"""Ragged paged attention: the jnp reference / XLA path (``xla.py``), the Pallas TPU and
GPU kernels (``pallas.py``) and the C++ CPU kernel (``cpu.py`` + ``paged_attention.cc``)."""
