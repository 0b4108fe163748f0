"""The float32 matmul's C++ CPU kernel (``cpu.py`` + ``f32_matmul.cc``): every output one
k-ordered FMA chain, so bitwise batch-invariant; its reference is in ``cpu.py``.
``codes.py``: float32 weights' exact block codes (``CodedF32``), which the kernel reads."""
