"""Time to first token of one prompt through each prefill shape that can hold it.

The default ladder's prefill regions are slots of 32 positions (engine/batch.py
``default_ladders``); a prompt longer than a slot is cut into consecutive slots. This
measures, on the default model, whether one prompt cut into n slots of 32 prefills as fast
as a single slot of n * 32 positions, and what a shape twice the prompt's size costs: an
engine per shape (that shape only, decode buckets 1 and 2), the prompt prefilled and one
token sampled, ``--reps`` timed runs after two warm ones (median and min), the sampled
token compared across shapes.

    python benchmarks/prefill_shapes.py                       # 128, 256 and 512 tokens
    python benchmarks/prefill_shapes.py --lengths 256 --reps 9

The prompt is the first tokens of ../shared/data's 512-token prefill prompt when present,
else synthetic ids (said in the output).
"""

from __future__ import annotations

import argparse
import statistics
import time

import common as C

# prompt length -> the shapes compared (slots, positions per slot)
SHAPES = {
    128: ((1, 128), (4, 32), (8, 32)),
    256: ((1, 256), (8, 32), (16, 32), (1, 512)),
    512: ((1, 512), (16, 32)),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", default="128,256,512", help=f"prompt lengths, of {sorted(SHAPES)}")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--out", help="write the results as JSON")
    args = p.parse_args()

    from jaxinfer import Engine
    from jaxinfer.sampling_params import SamplingParams

    w = C.load_workload()
    ids = w["prefill"]["ids"]
    sp = SamplingParams(max_tokens=1, temperature=0)
    rows, res = [], {"machine": C.machine(), "workload": w["source"], "runs": []}
    for n in (int(x) for x in args.lengths.split(",")):
        tokens = set()
        for shape in SHAPES[n]:
            eng = Engine(max_num_seqs=2, max_num_batched_tokens=512, max_model_len=640, prefill_buckets=(shape,),
                         decode_buckets=(1, 2), mixed_decode_buckets=(0, 1), progress=False, warmup="full")
            for _ in range(2):
                eng.generate([ids[:n]], sp)
            times = []
            for _ in range(args.reps):
                t = time.perf_counter()
                out = eng.generate([ids[:n]], sp)
                times.append(time.perf_counter() - t)
            tokens.add(tuple(out[0].outputs[0].token_ids))
            med, best = statistics.median(times) * 1e3, min(times) * 1e3
            res["runs"].append({"prompt": n, "shape": shape, "median_ms": med, "min_ms": best})
            rows.append((f"{n} tokens, {shape[0]} x {shape[1]}", f"median {med:.1f} ms, min {best:.1f} ms"))
            del eng
        rows.append((f"{n} tokens: same token in every shape", len(tokens) == 1))
    C.print_table(rows, "TTFT of one prompt per prefill shape (default model, float32)")
    C.write_json(args.out, res)


if __name__ == "__main__":
    main()
