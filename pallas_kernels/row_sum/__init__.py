"""Row sums in one fixed order on XLA:CPU (``cpu.py`` + ``row_sum.cc``): what
jaxinfer/reductions.py calls so a token's norms and logprobs do not depend on its step."""
