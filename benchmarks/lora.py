"""Multi-LoRA throughput: the workload's 32-prompt throughput set (``--new-tokens`` each, by
default its 128; EOS ignored, greedy) with its requests spread over 1, 4 and 16 adapters, vs the base model,
in the same run.

Engines, built from one loaded default model (float32): ``plain`` (no LoRA) and ``lora``
(``--max-loras`` slots of rank ``--rank``, 16 adapters loaded). Runs: plain; lora with
every request on the base model (what LoRA costs requests that use none); lora with the
requests spread round-robin over 1, 4 and 16 adapters. Each run is repeated in reversed
order (A..E, E..A), so load drift hits all alike; tok/s = generated tokens / wall time.

The adapters are random rank-``--rank`` PEFT directories written here (safetensors +
adapter_config.json, all seven targets), so nothing is downloaded and peft is not needed.

    python benchmarks/lora.py --quick
    python benchmarks/lora.py --out lora.json
"""

from __future__ import annotations

import json
import os
import tempfile
import time

import common as C


def write_adapters(cfg, n: int, rank: int, out_dir: str) -> list[str]:
    """``n`` random PEFT LoRA directories for a model of ``cfg`` -> their paths."""
    import numpy as np
    from safetensors.numpy import save_file

    from jaxinfer.engine.lora import CONFIG_FILE, WEIGHTS_FILE, lora_targets

    targets = {t.path: (module, t.shape) for module, t in reversed(list(lora_targets(cfg).items()))}
    rng = np.random.default_rng(0)
    paths = []
    for i in range(n):
        d = os.path.join(out_dir, f"adapter{i}")
        os.makedirs(d)
        tensors = {}
        for module, (n_in, n_out) in targets.values():
            key = f"base_model.model.{module}"
            tensors[f"{key}.lora_A.weight"] = (rng.standard_normal((rank, n_in)) * 0.02).astype(np.float32)
            tensors[f"{key}.lora_B.weight"] = (rng.standard_normal((n_out, rank)) * 0.02).astype(np.float32)
        save_file(tensors, os.path.join(d, WEIGHTS_FILE))
        with open(os.path.join(d, CONFIG_FILE), "w") as f:
            json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": [
                "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}, f)
        paths.append(d)
    return paths


def main() -> None:
    p = C.base_parser(__doc__)
    p.add_argument("--rank", type=int, default=16, help="adapter rank (= --max-lora-rank)")
    p.add_argument("--max-loras", type=int, default=16, help="device slots")
    p.add_argument("--adapters", default="1,4,16", help="adapters in the batch, comma-separated")
    p.add_argument("--new-tokens", type=int, default=None, help="new tokens per request (default: the workload's)")
    args = p.parse_args()
    from jaxinfer.sampling_params import SamplingParams
    from jaxinfer.engine.engine import Engine
    from jaxinfer.loading import load_model

    w = C.load_workload(args.workload)
    prompts = w["throughput"]["prompts"]
    n_new = 32 if args.quick else args.new_tokens or w["throughput"]["new_tokens"]
    counts = [int(x) for x in args.adapters.split(",")]
    loaded = load_model(None, "float32")
    tmp = tempfile.mkdtemp(prefix="jaxinfer-lora-bench-")
    paths = write_adapters(loaded.config, max(counts), args.rank, tmp)
    # 512 MiB of KV pages each (32 sequences of the workload's <= 384 tokens need ~570 MB at
    # full length; two engines of the default 1 GiB did not fit the shared machine's RAM)
    # and three step shapes (one decode size, one packed prefill shape, their mix): compiling
    # the default ladder's ~20 shapes twice took over an hour on the shared machine
    kw = dict(loaded=loaded, progress=False, max_num_seqs=32, max_model_len=512, enable_prefix_caching=False,
              kv_cache_memory=512 << 20, decode_buckets=(32,), mixed_decode_buckets=(0, 32),
              prefill_buckets=((16, 32),))
    t0 = time.perf_counter()
    engines = {"plain": Engine(**kw),
               "lora": Engine(**kw, lora_modules={f"a{i}": q for i, q in enumerate(paths)},
                              max_loras=args.max_loras, max_lora_rank=args.rank,
                              max_cpu_loras=max(args.max_loras, len(paths)))}
    startup = time.perf_counter() - t0
    runs = [("plain", "plain", 0), ("lora engine, base requests", "lora", 0)]
    runs += [(f"lora, {k} adapter{'s' * (k > 1)}", "lora", k) for k in counts]
    sp = SamplingParams(temperature=0, max_tokens=n_new, ignore_eos=True)
    for e in engines.values():
        e.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4))
    res = {"machine": C.machine(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "workload": w["source"], "synthetic": w["synthetic"], "new_tokens": n_new, "rank": args.rank,
           "max_loras": args.max_loras, "startup_s": round(startup, 1), "load_before": C.load_avg(),
           "lora_slot_bytes": engines["lora"].runner.lora.nbytes, "tok_s": {}}
    for order in (runs, runs[::-1]):
        for name, eng, k in order:
            loras = [None] * len(prompts) if k == 0 else [f"a{i % k}" for i in range(len(prompts))]
            t = time.perf_counter()
            engines[eng].generate(prompts, sp, lora=loras)
            res["tok_s"].setdefault(name, []).append(len(prompts) * n_new / (time.perf_counter() - t))
    res["load_after"] = C.load_avg()
    plain = sum(res["tok_s"]["plain"]) / 2
    rows = []
    for name, _, _ in runs:
        v = sum(res["tok_s"][name]) / 2
        rows.append((name, f"{C.fmt(v)} tok/s ({v / plain:.2f}x plain; runs {', '.join(C.fmt(x) for x in res['tok_s'][name])})"))
    C.print_table(rows, f"32 prompts x {n_new} new tokens, rank {args.rank}, {args.max_loras} slots, "
                        f"{w['source']}{' (SYNTHETIC)' if w['synthetic'] else ''}; load {res['load_before']} -> "
                        f"{res['load_after']}")
    C.write_json(args.out, res)


if __name__ == "__main__":
    main()
