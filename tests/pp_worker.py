"""Pipeline-parallel runs for tests/test_pipeline.py, in a process of their own (JAX's CPU
device count is fixed when it starts). Modes (each prints one JSON object on its last line):

* ``grid``: a tiny 4-layer Llama (tp_worker's llama_8q4kv) on 8 virtual CPU devices, single
  device vs PP 2, PP 4, TP 2 x PP 2 and DP 2 x PP 2 x TP 2, with a small KV pool (preemption)
  and a 32-token budget (chunked prefill): greedy tokens, every sampled token's logits row,
  preemptions, and the collectives of each compiled step (PP 2, TP 2 x PP 2, TP 2 alone).
* ``default``: the embedded SmolLM2 (30 layers, 9 heads) with PP 2 and TP 3 x PP 2 vs one
  device (and the error for PP 4, which does not divide 30 layers).
* ``mp``: one process of a 2-process PP 2 engine over jax.distributed (gloo on CPU), one
  CPU device and one stage each.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from tp_worker import PROMPTS, finish_distributed, run_engine, tiny_loaded  # noqa: E402

# 7 pages of 16 tokens for six requests of up to 61 tokens (MAX_TOKENS new each): sequences
# are preempted; a 32-token budget chunks the 37- and 30-token prompts; 4 prefill slots of
# 8 and 4 decode slots cut into 2 or 4 equal micro-batches.
MAX_TOKENS = 24
ENGINE_KW = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128, num_pages=7,
                 min_sampler_rows=16, decode_buckets=(4,), mixed_decode_buckets=(0, 4), prefill_buckets=((4, 8),),
                 page_buckets=(8,))
GRID = {"1x1x1": (1, 1, 1), "pp2": (1, 2, 1), "pp4": (1, 4, 1), "tp2pp2": (1, 2, 2), "dp2pp2tp2": (2, 2, 2),
        "tp2": (1, 1, 2)}            # name -> (dp, pp, tp); all with the overlapped loop (the default)
HLO_OF = ("pp2", "tp2pp2", "tp2")


def mode_grid() -> dict:
    loaded = tiny_loaded("llama_8q4kv", num_layers=4)
    res = {name: run_engine(loaded, dp, tp, PROMPTS, MAX_TOKENS, hlo=name in HLO_OF, pipeline_parallel_size=pp,
                            **ENGINE_KW) for name, (dp, pp, tp) in GRID.items()}
    # PP 2 with the synchronous loop: the overlapped one's tokens and logits, bit for bit
    res["pp2_sync"] = run_engine(loaded, 1, 1, PROMPTS, MAX_TOKENS, pipeline_parallel_size=2,
                                 async_scheduling=False, **ENGINE_KW)
    return res


def mode_default(tp3pp2: bool = False) -> dict:
    import numpy as np

    from jaxinfer.loading import load_model

    loaded = load_model(None, "float32")
    tok = loaded.tokenizer
    prompts = [tok.encode("The capital of France is"), tok.encode("def fibonacci(n):"),
               tok.apply_chat_template([{"role": "user", "content": "Name three planets."}],
                                       add_generation_prompt=True)]
    kw = dict(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256, num_pages=64,
              min_sampler_rows=16, decode_buckets=(4,), mixed_decode_buckets=(0, 4), prefill_buckets=((2, 32),), page_buckets=(16,))
    res = {}
    runs = {"1": (1, 1), "pp2": (2, 1), "pp4": (4, 1)} | ({"tp3pp2": (2, 3)} if tp3pp2 else {})
    for name, (pp, tp) in runs.items():
        try:
            r = run_engine(loaded, 1, tp, prompts, 16, pipeline_parallel_size=pp, **kw)
        except ValueError as e:
            res[name] = {"error": str(e)}
            continue
        ref = res.get("1", r)
        res[name] = {"tokens": r["tokens"], "tokens_equal": r["tokens"] == ref["tokens"],
                     "max_rel_logit_err": max(float(np.abs(np.asarray(a) - np.asarray(b)).max() / np.abs(np.asarray(b)).max())
                                              for a, b in zip(r["logits"], ref.get("logits", r["logits"])))}
        if name == "1":
            res[name]["logits"] = r["logits"]
    res["1"].pop("logits")
    return res


def mode_mp(coordinator: str, num_processes: int, process_id: int) -> dict:
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator, num_processes=num_processes, process_id=process_id)

    from jaxinfer.sampling_params import SamplingParams
    from jaxinfer.engine.engine import Engine

    eng = Engine(loaded=tiny_loaded("llama_8q4kv", num_layers=4), progress=False,
                 pipeline_parallel_size=num_processes, **ENGINE_KW)
    if eng.is_follower:
        res = {"process": process_id, "followed_steps": eng.follow()}
    else:
        outs = eng.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
        eng.shutdown()
        res = {"process": process_id, "tokens": [o.outputs[0].token_ids for o in outs], "steps": eng.num_steps,
               "stage_devices": [[str(d) for d in row] for row in eng.runner.mesh.devices[0]]}
    finish_distributed(res, process_id)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["grid", "default", "mp"])
    ap.add_argument("--coordinator", default="127.0.0.1:0")
    ap.add_argument("--num-processes", type=int, default=2)
    ap.add_argument("--process-id", type=int, default=0)
    ap.add_argument("--compilation-cache", default=None)
    ap.add_argument("--tp3pp2", action="store_true", help="default mode: also TP 3 x PP 2 (6 devices)")
    a = ap.parse_args()
    import jax

    jax.config.update("jax_num_cpu_devices", 1 if a.mode == "mp" else 8)
    if a.compilation_cache:
        from jaxinfer.engine.resources import enable_compilation_cache
        enable_compilation_cache(a.compilation_cache)
    if a.mode == "mp":
        res = mode_mp(a.coordinator, a.num_processes, a.process_id)
    else:
        res = mode_grid() if a.mode == "grid" else mode_default(a.tp3pp2)
    sys.stdout.write("\n" + json.dumps(res) + "\n")
    sys.stdout.flush()
    os._exit(0)   # skip interpreter teardown (jax.distributed shutdown races the other process)


if __name__ == "__main__":
    main()
