"""Multi-LoRA under tensor / data parallelism, for tests/test_lora.py, in a process of its own
(JAX's CPU device count is fixed when it starts: 8 virtual devices here).

``python tests/lora_tp_worker.py DIR``: DIR holds a tiny HF Llama (8 query / 2 KV heads, so
TP 4 repeats KV heads) and adapters a1..a3 (made by the test with peft). For (dp, tp) in
GRID: an engine with all three adapters and two slots generates the same mixed requests;
prints one JSON object: per run the greedy tokens, the logits row of every sampled token,
and (TP 2) the collectives of every compiled step, with and without LoRA.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

GRID = [(1, 1), (1, 2), (1, 4), (2, 2)]          # (dp, tp)
NAMES = ["a1", None, "a2", "a3", "a1", None]
PROMPTS = [[1, 2, 3, 4, 5], list(range(10, 47)), [7] * 19, list(range(100, 160, 3)), [42],
           list(range(300, 270, -1))]
ENGINE_KW = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128, num_pages=40,
                 decode_buckets=(4,), mixed_decode_buckets=(0, 4), prefill_buckets=((1, 32),),
                 page_buckets=(8,), progress=False)


def run(d: str, dp: int, tp: int, lora: bool) -> dict:
    import numpy as np

    from jaxinfer.config import SamplingParams
    from jaxinfer.engine.engine import Engine

    kw = dict(lora_modules={n: f"{d}/{n}" for n in ("a1", "a2", "a3")}, max_loras=2, max_lora_rank=8) if lora else {}
    eng = Engine(d, tensor_parallel_size=tp, data_parallel_size=dp, **ENGINE_KW, **kw)
    rows: dict[str, list] = {}
    post = eng._postprocess

    def capture(rep, sched, entries, packed):
        logits = np.asarray(rep.runner.last_logits)
        for slot, e in entries:
            if e.samples:
                rows.setdefault(e.seq.request_id, []).append(logits[slot].tolist())
        return post(rep, sched, entries, packed)

    eng._postprocess = capture
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    names = NAMES if lora else [None] * len(PROMPTS)
    ids = [eng.add_request(p, sp, request_id=f"r{i}", lora=n) for i, (p, n) in enumerate(zip(PROMPTS, names))]
    outs = eng.run_until_done(ids)
    from tp_worker import collectives

    return {"tokens": [o.outputs[0].token_ids for o in outs], "logits": [rows[i] for i in ids],
            "leaked_pages": eng.stats()["num_free_pages"] != eng.stats()["num_total_pages"],
            "hlo": {repr(b): collectives(exe.as_text(), b.num_tokens) for b, exe in eng.runner.executables.items()}
            if tp == 2 and dp == 1 else {}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--compilation-cache", default=None)
    a = ap.parse_args()
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    if a.compilation_cache:
        from jaxinfer.engine.engine import enable_compilation_cache
        enable_compilation_cache(a.compilation_cache)
    sys.path.insert(0, os.path.dirname(__file__))
    res = {f"{dp}x{tp}": run(a.dir, dp, tp, True) for dp, tp in GRID}
    res["plain_1x2"] = run(a.dir, 1, 2, False)
    sys.stdout.write("\n" + json.dumps(res) + "\n")
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
