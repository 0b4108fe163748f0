"""Offline throughput of the engine, in the manner of ``vllm bench throughput``, with HF
transformers' batched ``generate`` measured in the same run on the same ids.

The workload's ``throughput`` set: 32 prompts of 16-256 tokens (4,001 in all), 128 new
tokens each, EOS ignored, all submitted at once (``Engine.generate``). Per engine variant:

* output tokens/s (generated tokens / wall time of ``generate``) and total tokens/s
  (prompt + generated);
* host time per step (scheduling + batch building + sampling-param packing + postprocess,
  ``engine.host_seconds / num_steps``) next to device time per step (dispatch, forward,
  sampler and the one device->host copy, ``engine.device_seconds / num_steps``);
* model FLOP/s as a fraction of the matmul ceiling measured in the same run. Model FLOPs =
  2 x non-embedding weights x tokens fed through the layers (every prompt token plus
  every generated token but the last of each request) + 2 x hidden x vocab x sampled
  tokens (the LM head only runs on rows that sample). Attention's QK/PV dots are left out
  of that figure and reported separately; padding inside buckets is not counted (it is
  work the engine does but not useful work).

Variants (``--variants``, comma-separated, all in one run so their ratios are fair):
``inv`` batch-invariant matmuls (the default), ``fast`` plain matmuls; suffix ``@N`` sets
max_num_batched_tokens (default 512); prefix ``auto:`` uses the engine's default bucket
ladders instead of the tuned ones below, ``single:`` the tuned ladder as it was before
packed prefill (single-slot chunks of 64..256 tokens, so one prompt per step); suffix
``-nopc`` turns prefix caching (on by default) off, so ``inv,inv-nopc`` is its A/B; suffix
``-floats`` runs float32 weights instead of their exact codes (``weight_codes=False``), so
``inv,inv-floats`` is that A/B; suffix ``-kv8`` keeps the KV cache as int8 pages
(``kv_cache_dtype="int8"``), so ``inv,inv-kv8`` is that A/B; suffix ``-sync`` runs the
synchronous step loop (``async_scheduling=False``), so ``inv,inv-sync`` is the overlapped
loop's A/B. The cost of batch invariance is reported as
(fast / inv - 1) when both are run.

Tuned ladders (``tuned``): decode slots 8/16/32, mixed steps 0 or 32 decode slots,
prefill regions of 2, 4, .., budget/32 slots of 32 positions (the scheduler packs as many
prompts into a step as the token budget allows, each cut into 32-token pieces, so a prompt
pads at most 31 positions and a step at most one slot more), page tables of 32 pages
(max_model_len 512). Before packing, one prompt per step in single chunks of 64..256
(every 32) padded +22% and took 31 mixed steps.

``--quantization int8|int4`` quantizes every variant's weights at load time (the HF peer
stays float32). ``--model gemma3-270m``: Gemma 3 270M on both sides (see latency.py).

    python benchmarks/throughput.py [--variants inv,fast] [--no-hf] [--hf-threads 2,1] [--quantization int8] [--out /tmp/throughput.json]
"""

from __future__ import annotations

import gc
import time

import common as C

MAX_MODEL_LEN = 512


def parse_variant(v: str, max_num_seqs: int) -> dict:
    ladder = "tuned"
    if ":" in v:
        ladder, v = v.split(":", 1)
    v, sync = (v[:-5], True) if v.endswith("-sync") else (v, False)
    v, kv8 = (v[:-4], True) if v.endswith("-kv8") else (v, False)
    v, floats = (v[:-7], True) if v.endswith("-floats") else (v, False)
    v, nopc = (v[:-5], True) if v.endswith("-nopc") else (v, False)
    name, _, budget = v.partition("@")
    if name not in ("inv", "fast") or ladder not in ("tuned", "single", "auto"):
        raise SystemExit(f"--variants: unknown variant {v!r} (use [auto:|single:]inv|fast[@tokens][-nopc][-floats][-kv8][-sync])")
    budget = int(budget or 512)
    cfg = dict(dtype="float32", page_size=16, max_num_seqs=max_num_seqs,
               max_num_batched_tokens=budget, max_model_len=MAX_MODEL_LEN,
               batch_invariant=name == "inv", enable_prefix_caching=not nopc, weight_codes=not floats,
               kv_cache_dtype="int8" if kv8 else "model",
               **({"async_scheduling": False} if sync else {}),
               num_pages=max_num_seqs * (MAX_MODEL_LEN // 16) + 8)
    if ladder == "tuned":
        slots = [n for n in range(2, budget // 32 + 1, 2)] or [1]
        cfg.update(decode_buckets=tuple(sorted({min(8, max_num_seqs), min(16, max_num_seqs), max_num_seqs})),
                   mixed_decode_buckets=(0, max_num_seqs),
                   prefill_buckets=tuple((n, 32) for n in slots),
                   page_buckets=(MAX_MODEL_LEN // 16,))
    elif ladder == "single":     # the tuned ladder before packing: one prompt per step
        chunks = [c for c in range(64, 257, 32) if c <= budget] or [budget]
        cfg.update(decode_buckets=tuple(sorted({min(8, max_num_seqs), min(16, max_num_seqs), max_num_seqs})),
                   mixed_decode_buckets=(0, max_num_seqs),
                   prefill_buckets=tuple((1, c) for c in chunks),
                   page_buckets=(MAX_MODEL_LEN // 16,))
    return {"label": f"{ladder}:{name}@{budget}{'-nopc' if nopc else ''}{'-floats' if floats else ''}{'-kv8' if kv8 else ''}",
            "config": cfg}


def model_flops(cfg, prompts, n_new: int) -> dict:
    f = C.model_flops_per_token(cfg)
    fed = sum(len(p) for p in prompts) + len(prompts) * (n_new - 1)
    sampled = len(prompts) * n_new
    ctx = [n for p in prompts for n in range(1, len(p) + n_new)]    # each fed token's context
    return {"tokens_fed": fed, "tokens_sampled": sampled,
            "model_flops": f["per_token"] * fed + f["per_logit_row"] * sampled,
            "attention_flops": C.attention_flops(cfg, ctx),
            "non_embedding_params": f["layer_params"]}


def step_breakdown(steps_log) -> dict:
    """Device time split between steps that carry prefill chunks and pure decode steps,
    with the padding the buckets add (tokens computed / tokens needed)."""
    out = {}
    for kind, rows in (("mixed", [r for r in steps_log if r[0].num_prefill]),
                       ("decode", [r for r in steps_log if not r[0].num_prefill])):
        if not rows:
            continue
        real = sum(r[2] for r in rows)
        padded = sum(r[0].num_tokens * r[3] for r in rows)     # r[3]: steps in the call
        n = sum(r[3] for r in rows)                             # steps (a multi-step call is several)
        out[kind] = {"steps": n, "calls": len(rows), "seconds": sum(r[1] for r in rows),
                     "ms_per_step": sum(r[1] for r in rows) / n * 1e3,
                     "tokens": real, "padded_tokens": padded, "padding_overhead": padded / real - 1}
    buckets: dict[str, list] = {}
    for b, secs, _, k in steps_log:
        key = f"d{b.num_decode}+{b.num_prefill}x{b.prefill_chunk}/p{b.max_pages}"
        buckets.setdefault(key, []).append((secs, k))
    out["buckets"] = {key: {"steps": sum(k for _, k in v), "seconds": sum(t for t, _ in v),
                            "ms_per_step": sum(t for t, _ in v) / sum(k for _, k in v) * 1e3}
                      for key, v in sorted(buckets.items(), key=lambda kv: -sum(t for t, _ in kv[1]))}
    return out


def run_engine(loaded, variant: dict, prompts, n_new: int, flops: dict, ceiling: float) -> dict:
    from jaxinfer import Engine
    from jaxinfer.sampling_params import SamplingParams

    t0 = time.perf_counter()
    engine = Engine(loaded=loaded, progress=False, **variant["config"])
    init = time.perf_counter() - t0
    sp = SamplingParams(temperature=0, max_tokens=n_new, ignore_eos=True)
    t0 = time.perf_counter()
    engine.generate([p[:40] for p in prompts[:6]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    first = time.perf_counter() - t0
    engine.reset_prefix_cache()       # the warm-up's pages must not be hits in the timed run
    steps0, host0, dev0 = engine.num_steps, engine.host_seconds, engine.device_seconds
    la0 = C.load_avg()
    steps_log, pending = [], []
    runner = engine.runner
    dispatch, dispatch_multi, fetch = runner.dispatch, runner.dispatch_multi, runner.fetch

    # Per-step bucket and time (dispatch to fetched result), for the breakdown. The engine
    # calls dispatch or dispatch_multi, then fetch, one step at a time on one replica.
    def timed_dispatch(batch, *rest):
        pending.append((batch, 1, time.perf_counter()))
        return dispatch(batch, *rest)

    def timed_dispatch_multi(batch, *rest):
        pending.append((batch, rest[-1], time.perf_counter()))
        return dispatch_multi(batch, *rest)

    def timed_fetch(h):
        out = fetch(h)
        batch, k, t1 = pending.pop(0)
        steps_log.append((batch.bucket, time.perf_counter() - t1,
                          k * sum(e.num_new_tokens for _, e in batch.entries), k))
        return out

    runner.dispatch, runner.dispatch_multi, runner.fetch = timed_dispatch, timed_dispatch_multi, timed_fetch
    t0 = time.perf_counter()
    outs = engine.generate(prompts, sp)
    secs = time.perf_counter() - t0
    del runner.dispatch, runner.dispatch_multi, runner.fetch
    steps = engine.num_steps - steps0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    n_in = sum(len(p) for p in prompts)
    host, dev = engine.host_seconds - host0, engine.device_seconds - dev0
    r = {"label": variant["label"], "config": variant["config"], "engine_init_s": init,
         "compile_s": engine.compile_seconds, "num_buckets": len(engine.ladders.all_buckets()),
         "first_run_s": first, "seconds": secs, "output_tokens": n_out, "prompt_tokens": n_in,
         "output_tok_s": n_out / secs, "total_tok_s": (n_out + n_in) / secs, "steps": steps,
         "host_us_per_step": host / steps * 1e6, "device_ms_per_step": dev / steps * 1e3,
         "other_s": secs - host - dev,
         "model_gflops": flops["model_flops"] / secs / 1e9,
         "ceiling_fraction": flops["model_flops"] / secs / 1e9 / ceiling,
         "with_attention_gflops": (flops["model_flops"] + flops["attention_flops"]) / secs / 1e9,
         "preemptions": engine.stats()["num_preemptions_total"],
         "prefix_cache_hits": engine.stats()["prefix_cache_hits_total"],
         "breakdown": step_breakdown(steps_log),
         "token_ids": [o.outputs[0].token_ids for o in outs],
         "load_avg_start": la0, "load_avg": C.load_avg()}
    del engine
    gc.collect()
    return r


def main() -> None:
    p = C.base_parser(__doc__)
    p.add_argument("--variants", default="inv,fast",
                   help="engine variants to run, comma-separated (default: %(default)s)")
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--num-scheduler-steps", type=int, default=1,
                   help="multi-step decode for every variant (engine default 1)")
    p.add_argument("--quantization", default=None, choices=["int8", "int4"],
                   help="weight-only quantization of every variant's matmul weights (at load time)")
    p.add_argument("--compilation-cache", default=None, metavar="DIR",
                   help="JAX persistent compilation cache (a second run loads the executables: "
                        "warm start); default none, so compile time is the cold figure")
    C.add_hf_args(p)
    C.add_model_args(p)
    args = p.parse_args()
    variants = [parse_variant(v.strip(), args.max_num_seqs) for v in args.variants.split(",") if v.strip()]
    for v in variants:
        v["config"]["num_scheduler_steps"] = args.num_scheduler_steps
    for v in variants:
        v["config"]["quantization"] = args.quantization
        v["label"] += f"+{args.quantization}" if args.quantization else ""
    for v in variants:     # None: no cache (the engine's default would make a rerun warm)
        v["config"]["compilation_cache_dir"] = args.compilation_cache or None

    loaded, w = C.load_models(args)
    prompts, n_new = w["throughput"]["prompts"], w["throughput"]["new_tokens"]
    if args.quick:
        prompts, n_new = prompts[:8], 32
    res = {"machine": C.machine(), "workload": w["source"], "synthetic": w["synthetic"],
           "quick": args.quick, "args": vars(args), "num_prompts": len(prompts), "new_tokens": n_new}
    res["matmul_ceiling"] = C.matmul_ceiling()
    ceiling = res["matmul_ceiling"]["gflops"]
    flops = res["flops"] = model_flops(loaded.config, prompts, n_new)

    res["engines"] = [run_engine(loaded, v, prompts, n_new, flops, ceiling) for v in variants]

    hf, threads = None, C.hf_thread_list(args)
    if args.hf and C.transformers_available():
        hf, res["hf_load_s"] = C.load_hf_peer(args, loaded)
        C.hf_warmup(hf)
        res["hf_threads"] = {}
        for th in threads:
            C.set_hf_threads(th)
            h = res["hf_threads"][th] = C.hf_throughput(hf, prompts, n_new)
            h["threads"] = th
            h["model_gflops"] = flops["model_flops"] / h["seconds"] / 1e9
        res["hf"] = res["hf_threads"][threads[0]]
    elif args.hf:
        print("transformers/torch not importable: HF peer skipped")
    res["matmul_ceiling_end"] = C.matmul_ceiling()
    end = res["matmul_ceiling_end"]["gflops"]
    for e in res["engines"]:                  # the machine's load drifts: both ends of the run
        e["ceiling_fraction_end"] = e["model_gflops"] / end

    rows = [
        ("machine", f"{res['machine']['cpu']}, {res['machine']['cores']} cores, "
                    f"jax {res['machine']['jax']}, {res['machine']['date']}"),
        ("model", f"{loaded.config.architecture} ({loaded.source})"),
        ("workload", f"{w['source']}{' (SYNTHETIC)' if w['synthetic'] else ''}: {len(prompts)} prompts, "
                     f"{sum(len(x) for x in prompts)} prompt tokens, {n_new} new each"),
        ("matmul ceiling f32 2048^3", f"{ceiling} GFLOP/s (start), "
                                      f"{res['matmul_ceiling_end']['gflops']} (end)"),
        ("model GFLOP per run", f"{flops['model_flops'] / 1e9:.0f} (+ attention "
                                f"{flops['attention_flops'] / 1e9:.0f})"),
    ]
    for e in res["engines"]:
        rows += [(e["label"], f"{e['output_tok_s']:.1f} out tok/s, {e['total_tok_s']:.1f} total tok/s, "
                              f"{e['steps']} steps, host {e['host_us_per_step']:.0f} us/step vs device "
                              f"{e['device_ms_per_step']:.1f} ms/step, {e['ceiling_fraction'] * 100:.0f}%/"
                              f"{e['ceiling_fraction_end'] * 100:.0f}% of start/end ceiling, compile {e['compile_s']:.0f} s ({e['num_buckets']} buckets), "
                              f"preemptions {e['preemptions']}, load {e['load_avg'][0]}")]
        for kind in ("mixed", "decode"):
            b = e["breakdown"].get(kind)
            if b:
                rows.append((f"  {kind} steps", f"{b['steps']} steps, {b['seconds']:.1f} s, {b['ms_per_step']:.0f} ms/step, "
                                                f"{b['tokens']} tokens (+{b['padding_overhead'] * 100:.0f}% padding)"))
    res["batch_invariance_cost"] = {}
    for e in res["engines"]:                 # pair inv with fast of the same ladder and budget
        if ":inv@" not in e["label"]:
            continue
        f = next((x for x in res["engines"] if x["label"] == e["label"].replace(":inv@", ":fast@")), None)
        if f is None:
            continue
        cost = f["output_tok_s"] / e["output_tok_s"] - 1
        res["batch_invariance_cost"][e["label"]] = cost
        same = sum(a == b for a, b in zip(e["token_ids"], f["token_ids"]))
        rows.append((f"batch-invariance cost {e['label'].split(':')[0]}",
                     f"{cost * 100:+.1f}% (fast/inv - 1; {same}/{len(prompts)} outputs identical)"))
    for th, h in res.get("hf_threads", {}).items():
        t = f"HF {th} thr"
        rows.append((t, f"{h['output_tok_s']:.1f} out tok/s, {h['total_tok_s']:.1f} total tok/s "
                        f"({h['seconds']:.0f} s, load {h['load_avg'][0]})"))
        ratios = {e["label"]: e["output_tok_s"] / h["output_tok_s"] for e in res["engines"]}
        h["ratios"] = ratios
        h["floor_throughput_2_5x"] = {k: v >= 2.5 for k, v in ratios.items()}
        for e in res["engines"]:
            same = sum(a == b for a, b in zip(e["token_ids"], h["token_ids"]))
            rows.append((f"ratio {e['label']}/{t}", f"{ratios[e['label']]:.2f}x (floor >= 2.5x: "
                                                    f"{'holds' if ratios[e['label']] >= 2.5 else 'FAILS'}); "
                                                    f"{same}/{len(prompts)} outputs identical to HF"))
    if "hf" in res:
        res["ratios"] = res["hf"]["ratios"]
        res["floor_throughput_2_5x"] = res["hf"]["floor_throughput_2_5x"]
    res["peak_rss_mib"] = C.peak_rss_mib()
    res["load_avg_end"] = C.load_avg()
    rows += [("peak RSS", f"{res['peak_rss_mib']:.0f} MiB"),
             ("load average start / end", f"{res['machine']['load_avg_start']} / {res['load_avg_end']}")]
    C.print_table(rows, "throughput (offline, all requests at once)")
    C.write_json(args.out, res)


if __name__ == "__main__":
    main()
