"""``jaxinfer bench throughput|latency|serve``: benchmarks in the shape of ``vllm bench``.

- ``datasets``: the requests (JSONL prompts, ShareGPT conversations, the shared token-id
  workload, or synthetic prompts with length distributions);
- ``report``: per-request results -> TTFT / TPOT / ITL / E2E percentiles, tokens/s and
  goodput under an SLO; the table, the JSON and the PNG plots;
- ``offline``: ``throughput`` and ``latency`` on an in-process Engine;
- ``serve``: a load generator against a running server's OpenAI API (or one it starts);
- ``cli``: the subcommands.

Nothing here imports jax until an engine is built, so ``bench serve`` against a remote
server starts quickly.
"""
