"""Row sums in one fixed order, so a token's norms and logprobs do not depend on its step:
the jnp fold (``xla.py``: the reference, and the path off CPU) and the C++ kernel for
XLA:CPU (``cpu.py`` + ``row_sum.cc``); jaxinfer/reductions.py chooses."""
