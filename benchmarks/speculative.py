"""Speculative decoding: batch-1 decode tok/s with each method vs without, in the same run.

Prompts: MT-Bench first turns of the coding and extraction categories
(``../shared/data/mt_bench_questions.jsonl``) and summarization prompts of our own (a
passage + "summarize it"), chat-templated; without the data file, prompts of our own for
all three (reported as such). Every prompt runs alone (batch 1), greedy, ``--new-tokens``
tokens (EOS ignored), once per engine; decode tok/s = (tokens - 1) / (finish - first
token), so the prefill is left out. The engines (plain, ngram) are built from one loaded
model per dtype and run interleaved prompt by prompt, so machine load hits both alike;
the report gives ratios, acceptance rates, and whether the tokens were identical.

``--llama-cpp``: llama.cpp (llama-cpp-python) on the same GGUF and prompt ids as the peer,
batch 1 greedy, plain vs its prompt-lookup decoding (``LlamaPromptLookupDecoding``, the
binding's speculative drafter; ``--llama-cpp-lookup`` tokens per draft), interleaved prompt
by prompt like ours, with decode tok/s measured the same way and whether the tokens match.

``--guided-json``: every batch-1 request constrained to a JSON object (a grammar: the output
ends when the object closes, so its decode tok/s counts the tokens it has), speculation
under the same mask as plain decoding.

``--repetition-penalty`` / ``--presence-penalty`` / ``--frequency-penalty``: every batch-1
request carries these penalties (plain decoding and speculation alike; before 2026-11-30 a
penalized sequence never speculated).

``--throughput``: also the workload's 32-prompt throughput set at max_num_seqs=32 with and
without speculation (it turns itself off above ``speculative_disable_by_batch_size``).

    python benchmarks/speculative.py --quick
    python benchmarks/speculative.py --quantization none,int8 --throughput --out spec.json
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

import common as C

OWN_PROMPTS = {
    "coding": ["Here is a Python function:\n\ndef mean(xs):\n    total = 0\n    for x in xs:\n"
               "        total += x\n    return total / len(xs)\n\nRewrite it with type hints and a "
               "docstring, and make it raise ValueError on an empty list."],
    "extraction": ["From the text below, list every person's name and city as 'name: city'.\n\n"
                   "Alice Moreau moved from Lyon to Berlin in 2019. Her brother, Jean Moreau, "
                   "stayed in Lyon. Their friend Priya Natarajan lives in Chennai, and Tom Becker "
                   "works in Hamburg."],
}
PASSAGE = ("The city council met on Tuesday to discuss the new bicycle lanes on Main Street. "
           "Supporters said the lanes made the street safer for children cycling to school and "
           "had reduced traffic accidents by a third since they opened in March. Shop owners "
           "complained that the lanes removed forty parking spaces and that fewer customers "
           "came by car. The council agreed to keep the lanes for another year, add a small "
           "car park behind the market, and publish accident figures every three months.")
SUMMARIZE = [f"Summarize the following text in three sentences, reusing its wording:\n\n{PASSAGE}",
             f"Rewrite the following text as a bulleted list of its facts:\n\n{PASSAGE}"]


def prompts(n: int, path) -> tuple[dict[str, list[str]], str]:
    """{category: [prompt text]} and where they came from."""
    out = {"summarization": SUMMARIZE[:n]}
    if not path.exists():
        return {**{k: v[:n] for k, v in OWN_PROMPTS.items()}, **out}, "own prompts (no MT-Bench file)"
    qs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    for cat in ("coding", "extraction"):
        out[cat] = [q["turns"][0] for q in qs if q["category"] == cat][:n]
    return out, f"{path} (coding, extraction) + own summarization prompts"


def method_options(method: str, quant: str | None, k: int, draft_model: str | None,
                   draft_layers: int | None = None) -> dict:
    """EngineConfig fields of one speculative method: "self" drafts with the engine's default
    (speculative_quantization "auto": int4 on CPU), "self:int8" / "self:int4" (any
    "self:<speculative_quantization>") name the draft's weights; with ``draft_layers`` the
    draft is the target's first layers; "ngram:tree<W>" verifies up to W prompt-lookup
    candidates at once (speculative_tree_width)."""
    method, _, option = method.partition(":")
    spec = dict(speculative_method=method, num_speculative_tokens=k)
    if method == "self" and option:
        spec["speculative_quantization"] = option
    if method == "ngram" and option:
        if not option.startswith("tree") or not option[4:].isdigit():
            raise ValueError(f"--methods {method}:{option}: the ngram option is tree<W>, e.g. ngram:tree2")
        spec["speculative_tree_width"] = int(option[4:])
    if method == "self" and draft_layers:
        spec["speculative_draft_layers"] = draft_layers
    if method == "draft":
        spec["speculative_model"] = draft_model
    return spec


WEIGHT_CODES = True    # --no-weight-codes: float32 targets keep their floats (EngineConfig.weight_codes)


def build(loaded, quant: str | None, spec: dict, max_num_seqs: int = 1):
    from jaxinfer.engine.engine import Engine

    # KV pages in the model's dtype for plain and speculating engines alike: what "auto"
    # gives a speculating engine (config.kv_cache_dtype), so both sides of a ratio match
    return Engine(loaded=loaded, progress=False, quantization=quant, max_num_seqs=max_num_seqs,
                  max_model_len=1024, enable_prefix_caching=False, weight_codes=WEIGHT_CODES,
                  kv_cache_dtype="model", **spec)


GUIDED = None          # --guided-json: every batch-1 request constrained to a JSON object
PENALTIES: dict = {}   # --repetition-penalty etc.: every batch-1 request's penalties


def decode_rate(eng, ids: list[int], n_new: int) -> tuple[float, list[int]]:
    from jaxinfer.sampling_params import SamplingParams

    out = eng.generate([ids], SamplingParams(temperature=0, max_tokens=n_new, ignore_eos=True, guided=GUIDED,
                                                **PENALTIES))[0]
    m, n = out.metrics, len(out.outputs[0].token_ids)      # a grammar may end the output early
    return (n - 1) / max(m.finished_time - m.first_token_time, 1e-9), out.outputs[0].token_ids


def spec_counts(eng) -> tuple[int, int]:
    s = eng.stats()
    return s.get("spec_decode_num_draft_tokens", 0), s.get("spec_decode_num_accepted_tokens", 0)


def batch1(loaded, quant: str | None, cats: dict[str, list[str]], n_new: int, k: int,
           methods: list[str], draft_model: str | None, draft_layers: int | None = None) -> dict:
    """Per category: each method's mean decode tok/s, mean per-prompt speed-up over plain,
    acceptance (accepted / proposed draft tokens) and whether every output equals plain's."""
    tok = loaded.tokenizer
    engines = {"plain": build(loaded, quant, {})}
    for m in methods:
        try:
            engines[m] = build(loaded, quant, method_options(m, quant, k, draft_model, draft_layers))
        except ValueError as e:     # e.g. self:int8 on an int8 target (it would draft with itself)
            print(f"{m} skipped for quantization {quant}: {e}")
    methods = [m for m in methods if m in engines]
    warm = tok.apply_chat_template([{"role": "user", "content": "Say hello."}])
    for e in engines.values():
        decode_rate(e, warm, 8)
    res = {}
    for cat, texts in cats.items():
        rates = {m: [] for m in engines}
        times = {m: 0.0 for m in engines}          # decode seconds over all the category's tokens
        counts = {m: [0, 0] for m in methods}
        identical = {m: True for m in methods}
        for text in texts:
            ids = tok.apply_chat_template([{"role": "user", "content": text}])
            toks = {}
            for m, e in engines.items():           # interleaved prompt by prompt: load hits all alike
                d0, a0 = spec_counts(e)
                r, toks[m] = decode_rate(e, ids, n_new)
                rates[m].append(r)
                times[m] += (len(toks[m]) - 1) / r if r else 0.0    # a 1-token output has no decode
                d1, a1 = spec_counts(e)
                if m != "plain":
                    counts[m][0] += d1 - d0
                    counts[m][1] += a1 - a0
            for m in methods:
                identical[m] &= toks[m] == toks["plain"]
        row = {"prompts": len(texts), "plain_tok_s": sum(rates["plain"]) / len(texts)}
        for m in methods:
            d, a = counts[m]
            row[m] = {"tok_s": sum(rates[m]) / len(texts),
                      "speedup": float(np.mean([x / y for x, y in zip(rates[m], rates["plain"]) if y])),
                      # by tokens, not prompts: a grammar's short outputs (--guided-json)
                      # weigh by their length
                      "speedup_tokens": times["plain"] / times[m] if times[m] else None,
                      "draft_tokens": d, "acceptance": a / d if d else None, "greedy_identical": identical[m]}
        res[cat] = row
    return res


def llama_cpp_batch1(tok, cats: dict[str, list[str]], n_new: int, num_pred: int) -> dict:
    """llama.cpp plain vs its prompt-lookup speculation, per category, like ``batch1``."""
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    plain = C.load_llama_cpp()
    # verifying a draft reads the logits of every drafted position: logits_all
    lookup = C.load_llama_cpp(draft_model=LlamaPromptLookupDecoding(num_pred_tokens=num_pred), logits_all=True)
    warm = tok.apply_chat_template([{"role": "user", "content": "Say hello."}])
    for llm in (plain, lookup):
        C.llama_cpp_latency(llm, warm, 8)
    res = {}
    for cat, texts in cats.items():
        rates: dict[str, list[float]] = {"plain": [], "lookup": []}
        identical = True
        for text in texts:
            ids = tok.apply_chat_template([{"role": "user", "content": text}])
            a = C.llama_cpp_latency(plain, ids, n_new)
            b = C.llama_cpp_latency(lookup, ids, n_new)
            rates["plain"].append(a["decode_tok_s"])
            rates["lookup"].append(b["decode_tok_s"])
            identical &= a["token_ids"] == b["token_ids"]
        res[cat] = {"prompts": len(texts), "plain_tok_s": sum(rates["plain"]) / len(texts),
                    "lookup": {"tok_s": sum(rates["lookup"]) / len(texts),
                               "speedup": sum(x / y for x, y in zip(rates["lookup"], rates["plain"])) / len(texts),
                               "greedy_identical": identical}}
    return res


def throughput(loaded, quant: str | None, prompts_ids: list[list[int]], n_new: int, k: int,
               methods: list[str], draft_model: str | None) -> dict:
    """The 32-prompt set at max_num_seqs=32, plain and each method, rounds in alternating
    order (load drift hits all alike); speculation should turn itself off."""
    from jaxinfer.sampling_params import SamplingParams

    ps = SamplingParams(temperature=0, max_tokens=n_new, ignore_eos=True)
    engines = {"plain": build(loaded, quant, {}, 32)}
    for m in methods:
        engines[m] = build(loaded, quant, method_options(m, quant, k, draft_model), 32)
    for e in engines.values():
        e.generate(prompts_ids[:2], SamplingParams(temperature=0, max_tokens=4))
    runs: dict[str, list[float]] = {m: [] for m in engines}
    order = list(engines)
    for rnd in range(2):
        for m in (order if rnd == 0 else order[::-1]):
            t0 = time.perf_counter()
            engines[m].generate(prompts_ids, ps)
            runs[m].append(len(prompts_ids) * n_new / (time.perf_counter() - t0))
    plain = sum(runs["plain"])
    return {"plain_tok_s": plain / 2, "runs": runs,
            **{m: {"tok_s": sum(runs[m]) / 2, "ratio": sum(runs[m]) / plain,
                   "draft_tokens": spec_counts(engines[m])[0]} for m in methods}}


def main() -> None:
    p = C.base_parser(__doc__)
    p.add_argument("--quantization", default="none,int8", help="comma-separated: none, int8")
    p.add_argument("--methods", default="ngram,self",
                   help="comma-separated speculative methods to compare with plain decoding: ngram, self, "
                        "self:int4 / self:int8 (the draft's weights), ngram:tree2 (two prompt-lookup "
                        "candidates verified at once), draft (needs --draft-model)")
    p.add_argument("--draft-model", default=None, help="the draft model of --methods draft")
    p.add_argument("--draft-layers", type=int, default=None,
                   help="--methods self: draft with the target's first N layers")
    p.add_argument("--categories", default="coding,extraction,summarization", help="comma-separated")
    p.add_argument("--prompts", type=int, default=2, help="prompts per category")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--k", type=int, default=7, help="num_speculative_tokens")
    p.add_argument("--mt-bench", default=str(C.DATA / "mt_bench_questions.jsonl"),
                   help="MT-Bench questions JSONL (default: %(default)s; own prompts if missing)")
    p.add_argument("--throughput", action="store_true", help="also batch 32 on the throughput workload")
    p.add_argument("--llama-cpp", action="store_true", help="also llama.cpp plain vs its prompt-lookup decoding")
    p.add_argument("--llama-cpp-lookup", type=int, default=10, help="llama.cpp lookup tokens per draft")
    p.add_argument("--weight-codes", action=argparse.BooleanOptionalAction, default=True,
                   help="float32 targets as their exact weight codes (the engine's default) or as floats")
    p.add_argument("--guided-json", action="store_true",
                   help="batch 1: every request constrained to a JSON object (guided decoding), "
                        "with and without speculation")
    for name, off in (("repetition", 1.0), ("presence", 0.0), ("frequency", 0.0)):
        p.add_argument(f"--{name}-penalty", type=float, default=off, help=f"batch 1: every request's {name} penalty")
    args = p.parse_args()
    global WEIGHT_CODES, GUIDED, PENALTIES
    WEIGHT_CODES = args.weight_codes
    GUIDED = {"json_object": True} if args.guided_json else None
    PENALTIES = {f"{n}_penalty": getattr(args, f"{n}_penalty") for n in ("repetition", "presence", "frequency")}
    if args.quick:
        args.prompts, args.new_tokens = 1, 64
    methods = [m for m in args.methods.split(",") if m]
    if "draft" in methods and not args.draft_model:
        p.error("--methods draft needs --draft-model")
    from jaxinfer.loading import load_model

    loaded = load_model(None, "float32")
    from pathlib import Path

    cats, source = prompts(args.prompts, Path(args.mt_bench))
    cats = {c: cats[c] for c in args.categories.split(",")}
    res = {"machine": C.machine(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "prompts": source, "new_tokens": args.new_tokens, "k": args.k, "methods": methods, "guided": GUIDED, "penalties": PENALTIES, "batch1": {},
           "load_before": C.load_avg()}
    for q in args.quantization.split(","):
        quant = None if q == "none" else q
        res["batch1"][q] = r = batch1(loaded, quant, cats, args.new_tokens, args.k, methods, args.draft_model,
                                                  args.draft_layers)
        C.print_table([(f"{cat}: {m}", f"{C.fmt(v['plain_tok_s'])} -> {C.fmt(v[m]['tok_s'])} tok/s, "
                        f"{v[m]['speedup']:.2f}x (by tokens {v[m]['speedup_tokens'] or 0:.2f}x), acceptance {C.fmt(100 * (v[m]['acceptance'] or 0))}%, "
                        f"identical {v[m]['greedy_identical']}")
                       for cat, v in r.items() for m in methods if m in v], f"batch 1, {q} ({source}), load {C.load_avg()}")
    if args.llama_cpp and not C.llama_cpp_available():
        print("llama_cpp not importable (pip install llama-cpp-python): llama.cpp peer skipped")
    elif args.llama_cpp:
        res["llama_cpp"] = r = llama_cpp_batch1(loaded.tokenizer, cats, args.new_tokens, args.llama_cpp_lookup)
        C.print_table([(f"{cat}: lookup", f"{C.fmt(v['plain_tok_s'])} -> {C.fmt(v['lookup']['tok_s'])} tok/s, "
                        f"{v['lookup']['speedup']:.2f}x, identical {v['lookup']['greedy_identical']}")
                       for cat, v in r.items()], f"llama.cpp batch 1, Q4_1 GGUF ({source})")
    if args.throughput:
        w = C.load_workload(args.workload)
        n_new = 32 if args.quick else w["throughput"]["new_tokens"]
        res["throughput"] = t = throughput(loaded, None, w["throughput"]["prompts"], n_new, args.k, methods,
                                           args.draft_model)
        C.print_table([("plain tok/s", C.fmt(t["plain_tok_s"]))] +
                      [(m, f"{C.fmt(t[m]['tok_s'])} tok/s = {t[m]['ratio']:.3f}x, {t[m]['draft_tokens']} draft tokens")
                       for m in methods],
                      f"batch 32, float32, {w['source']}{' (SYNTHETIC)' if w['synthetic'] else ''}")
    res["load_after"] = C.load_avg()
    C.write_json(args.out, res)


if __name__ == "__main__":
    main()
