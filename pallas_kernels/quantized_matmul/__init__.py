"""Weight-only int8 / int4 matmul: the weight format, reference and XLA path
(``xla.py``), the Pallas TPU and GPU kernel (``pallas.py``) and the C++ int8 CPU kernel
(``cpu.py`` + ``int8_matmul.cc``)."""
