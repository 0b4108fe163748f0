"""Cost of constrained decoding on the default model, constrained vs not in the same run.

* decode ms/step at batch 1 and 32: every sequence generates exactly ``--tokens`` tokens,
  unconstrained (``ignore_eos``) or constrained by a JSON schema whose ``minItems`` keeps it
  going past ``--tokens`` (so neither batch shrinks); prompts: the project's own, repeated.
  Only steps in which every running sequence decodes are timed (median per run); plain and
  constrained runs alternate ``--repeats`` times. The ratio of the medians, constrained /
  unconstrained, per batch size is the figure (floor: <= 1.15 at batch 32).
* the parts, timed alone and alternating with their baseline (steadier than whole steps
  on a shared machine): the host's mask build for 32 rows, and the sampler with every
  row's mask active vs none;
* the grammar library's compile time per schema: the 54 schemas of tests/guided_schemas.py,
  each compiled fresh (matcher built and its first mask computed, which is when llguidance
  builds its lexer), median and max.

    python benchmarks/guided.py [--tokens 48] [--batches 1,32] [--repeats 3] [--out /tmp/guided.json]
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

import common as C

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

SCHEMA = {"type": "object", "properties": {"items": {"type": "array", "minItems": 60, "items": {
    "type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                     "qty": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["name", "qty"]}}}, "required": ["items"]}
PROMPT = [{"role": "user", "content": "List the items in a kitchen as JSON with a name and a quantity each."}]


def decode_ms_per_step(eng, batch: int, params) -> tuple[float, int]:
    ids = [eng.add_request(PROMPT, params) for _ in range(batch)]
    times = []
    while eng.has_unfinished():
        sched_decode = all(s.num_computed_tokens >= s.num_prompt_tokens
                           for r in ids if r in eng.output.requests for s in eng.output.requests[r].seqs)
        t0 = time.perf_counter()
        eng.step()
        if sched_decode:
            times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times), len(times)


def compile_times() -> dict:
    import numpy as np

    from guided_schemas import SCHEMAS
    from jaxinfer.engine import guided as G
    from jaxinfer.loading import load_model

    tok = load_model(None).tokenizer
    t0 = time.perf_counter()
    comp = G.GrammarCompiler(tok, tok.vocab_size, tok.eos_token_ids)
    tok_s = time.perf_counter() - t0
    secs, masks = [], []
    row = np.zeros(G.mask_width(tok.vocab_size), np.int32)
    for s in SCHEMAS:
        t0 = time.perf_counter()
        m = comp.matcher(G.GuidedDecoding.parse({"json": s}))
        m.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        secs.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        m.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        masks.append(time.perf_counter() - t0)
    return {"tokenizer_setup_s": tok_s, "schemas": len(secs), "compile_ms_median": 1e3 * statistics.median(secs),
            "compile_ms_max": 1e3 * max(secs), "mask_ms_median": 1e3 * statistics.median(masks)}


def parts(batch: int = 32, calls: int = 20) -> dict:
    """The two pieces a constrained step adds, timed alone, alternating with their baseline:
    the host's mask build for ``batch`` JSON-schema rows, and the sampler executable with
    every row's mask active vs none active (random logits of the default vocabulary)."""
    import jax
    import numpy as np

    from jaxinfer.engine import guided as G
    from jaxinfer.engine import sampler as S
    from jaxinfer.engine.runner import sample_fn
    from jaxinfer.loading import load_model

    tok = load_model(None).tokenizer
    v = tok.vocab_size
    comp = G.GrammarCompiler(tok, v, tok.eos_token_ids)
    rows = [(i, G.SequenceConstraints(comp.matcher(G.GuidedDecoding.parse({"json": SCHEMA})), 0, [], [], []), [], ())
            for i in range(batch)]
    host = []
    for _ in range(calls):
        t0 = time.perf_counter()
        m = G.build_mask(batch, v, rows)
        host.append(time.perf_counter() - t0)
    logits = jax.random.normal(jax.random.key(0), (batch, v), np.float32) * 3
    pen = (np.zeros((batch, v), bool), np.zeros((batch, v), np.int32))
    t = S.sampling_tensors_from_params([], [], [], batch)
    on = S.TokenMask(m.bits, m.bias_ids, m.bias_vals, m.active)
    e = G.empty_mask(batch, v)
    off = S.TokenMask(e.bits, e.bias_ids, e.bias_vals, e.active)
    fn = jax.jit(sample_fn)
    rws = np.arange(batch, dtype=np.int32)
    fn(logits, pen, rws, t, on).block_until_ready()
    dev: dict[str, list[float]] = {"none_active": [], "all_active": []}
    for _ in range(calls):
        for name, mask in (("none_active", off), ("all_active", on)):
            t0 = time.perf_counter()
            fn(logits, pen, rws, t, mask).block_until_ready()
            dev[name].append(time.perf_counter() - t0)
    med = lambda xs: 1e3 * statistics.median(xs)  # noqa: E731
    return {"batch": batch, "host_mask_build_ms": med(host), "sampler_ms_no_mask": med(dev["none_active"]),
            "sampler_ms_mask": med(dev["all_active"])}


def main() -> None:
    p = C.base_parser(__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--batches", default="1,32")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--parts-only", action="store_true", help="only the compile times and the parts")
    args = p.parse_args()
    from jaxinfer.sampling_params import SamplingParams
    from jaxinfer.engine.engine import Engine

    batches = [int(b) for b in args.batches.split(",")]
    res = {"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": C.machine(),
           "tokens": args.tokens}
    res["compile"] = compile_times()
    print(json.dumps(res["compile"]), flush=True)
    res["parts"] = parts(max(batches))
    print(json.dumps(res["parts"]), flush=True)
    if args.parts_only:
        return C.write_json(args.out, res)
    eng = Engine(max_num_seqs=max(batches), max_num_batched_tokens=512, max_model_len=256, num_pages=32 * 8 + 8,
                 page_buckets=(16,), decode_buckets=tuple(batches), mixed_decode_buckets=(0, max(batches)),
                 prefill_buckets=((16, 32),), progress=False)
    plain = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    guided = plain.replace(guided={"json": SCHEMA})
    decode_ms_per_step(eng, 1, guided)                     # warm the grammar cache and the path
    for b in batches:
        # plain and constrained runs alternate, so drift on a shared machine hits both alike
        runs: dict[str, list[float]] = {"plain": [], "json_schema": []}
        for _ in range(args.repeats):
            for name, params in (("plain", plain), ("json_schema", guided)):
                runs[name].append(decode_ms_per_step(eng, b, params)[0])
        row = {k + "_ms_per_step": statistics.median(v) for k, v in runs.items()}
        row["runs"] = runs
        row["ratio"] = row["json_schema_ms_per_step"] / row["plain_ms_per_step"]
        res[f"batch_{b}"] = row
        print(b, json.dumps(row), flush=True)
    C.write_json(args.out, res)


if __name__ == "__main__":
    main()
