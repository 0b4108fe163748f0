"""Pipeline vs tensor parallelism at the same device count, on VIRTUAL CPU devices.

The default model (SmolLM2: 30 layers, 9 query / 3 KV heads) on N virtual CPU devices of
this machine (``jax_num_cpu_devices``): one device, TP N and PP N (N = 3: the heads allow
TP 3 and the layers PP 3). All virtual devices share this machine's cores, so the figures
measure each layout's overhead (collectives, micro-batch bookkeeping, the pipeline's
idle ticks computed anyway), not a speed-up: on real chips see the estimate in
benchmarks/RESULTS.md.

Per layout: the throughput set's first 24 prompts (``--new-tokens`` new each, greedy): the
prefill-only run (max_tokens 1) and the full run; decode step time = (full - prefill) /
(new tokens - 1). Layouts run A..C then C..A; the mean of both is reported.

    python benchmarks/pipeline.py --quick
"""

from __future__ import annotations

import time

import common as C


def main() -> None:
    p = C.base_parser(__doc__)
    p.add_argument("--devices", type=int, default=3, help="virtual CPU devices (TP and PP size)")
    p.add_argument("--new-tokens", type=int, default=32)
    args = p.parse_args()
    import jax

    jax.config.update("jax_num_cpu_devices", args.devices)
    from jaxinfer.sampling_params import SamplingParams
    from jaxinfer.engine.engine import Engine
    from jaxinfer.loading import load_model

    w = C.load_workload(args.workload)
    prompts = w["throughput"]["prompts"][: 6 if args.quick else 24]
    n_new = 8 if args.quick else args.new_tokens
    n = args.devices
    layouts = {"1 device": {}, f"TP {n}": dict(tensor_parallel_size=n), f"PP {n}": dict(pipeline_parallel_size=n)}
    loaded = load_model(None, "float32")
    # one decode size and one prefill shape, both cut into 2, 3 or 4 equal micro-batches
    kw = dict(loaded=loaded, progress=False, max_num_seqs=24, max_model_len=512, enable_prefix_caching=False,
              kv_cache_memory=256 << 20, decode_buckets=(24,), mixed_decode_buckets=(0, 24),
              prefill_buckets=((12, 32),), max_num_batched_tokens=384)
    res = {"machine": C.machine(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "virtual_devices": n, "workload": w["source"], "prompts": len(prompts), "new_tokens": n_new,
           "load_before": C.load_avg(), "runs": {}}
    engines = {}
    for name, extra in layouts.items():
        t0 = time.perf_counter()
        engines[name] = Engine(**kw, **extra)
        res["runs"][name] = {"startup_s": round(time.perf_counter() - t0, 1), "prefill_s": [], "full_s": []}
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    full = SamplingParams(temperature=0, max_tokens=n_new, ignore_eos=True)
    tokens = {}
    for order in (list(layouts), list(layouts)[::-1]):
        for name in order:
            e, r = engines[name], res["runs"][name]
            t = time.perf_counter()
            e.generate(prompts, one)
            r["prefill_s"].append(time.perf_counter() - t)
            t = time.perf_counter()
            outs = e.generate(prompts, full)
            r["full_s"].append(time.perf_counter() - t)
            tokens[name] = [o.outputs[0].token_ids for o in outs]
    res["load_after"] = C.load_avg()
    rows = []
    for name, r in res["runs"].items():
        pre, tot = sum(r["prefill_s"]) / 2, sum(r["full_s"]) / 2
        r["decode_step_ms"] = 1000 * (tot - pre) / (n_new - 1)
        r["tokens_equal_1_device"] = tokens[name] == tokens["1 device"]
        rows.append((name, f"prefill {pre:.2f} s, decode step {r['decode_step_ms']:.1f} ms ({len(prompts)} seqs), "
                           f"tokens = 1 device: {r['tokens_equal_1_device']}"))
    C.print_table(rows, f"VIRTUAL CPU devices ({n} sharing {C.cpu_model()}'s cores); {len(prompts)} prompts; "
                        f"load {res['load_before']} -> {res['load_after']}")
    C.write_json(args.out, res)


if __name__ == "__main__":
    main()
