"""Arrays allocated without being written, on XLA:CPU (``cpu.py`` + ``uninitialized.cc``):
what the engine's paged KV pool needs to cost only the pages requests use."""
