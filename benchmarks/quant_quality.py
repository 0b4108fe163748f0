"""Quality and memory of weight quantization on the default model (issue 6).

For each MT-Bench question (first turn, chat template): the float32 engine's greedy
continuation of ``--tokens`` tokens; each quantized engine's own greedy continuation
(leading agreement with float32) and, teacher-forced along the float32 continuation, the
mean KL(float32 || quantized) of the next-token distributions (jaxinfer/quality.py).
Also the bytes of the weights in each format. ``kv-int8``: float32 weights, int8 KV pages;
``int8+kv-int8``: int8 weights and int8 KV pages (the smallest configuration, issue 16).

    python benchmarks/quant_quality.py --out /tmp/bench/quant_quality.json     # ~10 min
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "mt_bench_questions.jsonl"
ENGINE_KW = dict(max_num_seqs=16, max_num_batched_tokens=256, max_model_len=1024, num_pages=1100,
                 decode_buckets=(16,), mixed_decode_buckets=(0, 16), prefill_buckets=((1, 256),),
                 page_buckets=(64,))


def prompts(tokenizer, path: Path, n: int) -> list[list[int]]:
    if path.exists():
        qs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        texts = [q["turns"][0] for q in qs]
    else:                                   # synthetic stand-ins, and the report says so
        texts = [f"Write a short story about the number {i}." for i in range(80)]
    return [tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True)
            for t in texts[:n]]


def greedy(loaded, quantization, ps, tokens, kv_cache_dtype="model") -> tuple[list[list[int]], object, float]:
    from jaxinfer.sampling_params import SamplingParams
    from jaxinfer.engine.engine import Engine

    eng = Engine(loaded=loaded, progress=False, warmup="full", quantization=quantization, kv_cache_dtype=kv_cache_dtype,
                 **ENGINE_KW)
    t0 = time.perf_counter()
    outs = eng.generate(ps, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs], eng.loaded.model, time.perf_counter() - t0


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-prompts", type=int, default=80)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--modes", default="int8,int4,kv-int8",
                    help="int8 / int4 weights, kv-int8: float32 weights with int8 KV pages, "
                         "int8+kv-int8: both")
    ap.add_argument("--data", default=str(DATA))
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    from jaxinfer.loading import load_model
    from jaxinfer.quality import compare
    from jaxinfer.quantization import weight_bytes

    loaded = load_model(None, "float32")
    ps = prompts(loaded.tokenizer, Path(a.data), a.num_prompts)
    ref_tokens, ref_model, _ = greedy(loaded, None, ps, a.tokens)
    res = {"prompts": len(ps), "synthetic": not Path(a.data).exists(), "tokens": a.tokens,
           "float32_weight_bytes": weight_bytes(ref_model), "modes": {}}
    print(f"{len(ps)} prompts{' (synthetic)' if res['synthetic'] else ''}, {a.tokens} greedy tokens each\n")
    print("| mode | weight MB | mean KL(f32 ‖ q) | max KL | mean leading agreement | all 32 identical |")
    print("|---|---|---|---|---|---|")
    print(f"| float32 | {res['float32_weight_bytes'] / 1e6:.0f} | 0 | 0 | {a.tokens} / {a.tokens} | 100% |")
    for mode in a.modes.split(","):
        kv = mode.endswith("kv-int8")                  # "kv-int8" or "<weights>+kv-int8"
        quantization = mode.split("+")[0] if "+" in mode else (None if kv else mode)
        toks, model, secs = greedy(loaded, quantization, ps, a.tokens, "int8" if kv else "model")
        r = compare(ref_model, model, ps, ref_tokens, toks, kv_int8=kv)
        r["weight_bytes"] = weight_bytes(model)
        res["modes"][mode] = r
        print(f"| {mode} | {r['weight_bytes'] / 1e6:.0f} | {r['mean_kl']:.5f} | {r['max_kl']:.4f} | "
              f"{r['mean_leading_agreement']:.1f} / {a.tokens} | {100 * r['fully_identical']:.0f}% |")
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
