"""The reference generator on the default model (issue 2's figures).

* load time: GGUF cold (``load_model(None)``: read + dequantize the embedded Q4_1 GGUF to
  float32) and orbax warm (the same params converted once with ``checkpoint.save`` to a
  temporary directory, then ``load_model(that dir)``), each timed in a new process (what a
  start pays), with a second load in that process beside it;
* compile time: the first call of a shape minus a second identical call;
* batch-1 decode tokens/s on the workload's ``decode`` prompt (32 tokens, 128 new, EOS
  ignored): (128 - 1) / (time of the 128-token call - time of a 1-token call);
* prefill tokens/s on the 512-token ``prefill`` prompt: 512 / time to first token (a
  1-token call);
* peak RSS of the process.

    python benchmarks/reference_bench.py [--out /tmp/reference.json] [--quick]
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time

import common as C

_FRESH = """
import json, sys, time
t0 = time.perf_counter()
import jax, jax.numpy
from jaxinfer.loading import load_model
t1 = time.perf_counter()
first = load_model(sys.argv[1] or None).load_seconds
second = load_model(sys.argv[1] or None).load_seconds
print(json.dumps({"imports_s": t1 - t0, "load_s": first, "second_load_in_process_s": second}))
"""


def fresh_load(model: str | None) -> dict:
    """load_model in a new process (what a user's start pays): its first load, and a second
    one in the same process (one-time costs of jax/orbax start-up excluded)."""
    out = subprocess.run([sys.executable, "-c", _FRESH, model or ""], capture_output=True,
                         text=True, cwd=str(C.REPO), check=True)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    r["load_avg"] = C.load_avg()
    return r


def timed(fn, *args, **kw):
    t0 = time.perf_counter()
    out = fn(*args, **kw)
    return out, time.perf_counter() - t0


def main() -> None:
    p = C.base_parser(__doc__)
    p.add_argument("--no-batch-invariant", dest="batch_invariant", action="store_false",
                   help="plain matmuls instead of the batch-invariant ones (default: invariant)")
    p.add_argument("--repeats", type=int, default=2, help="timed repeats per figure (best kept)")
    args = p.parse_args()

    import jax  # noqa: F401  (import time stays out of the load figures)

    from jaxinfer.sampling_params import SamplingParams
    from jaxinfer.loading import checkpoint, load_model
    from jaxinfer.reference import ReferenceGenerator

    w = C.load_workload(args.workload)
    res = {"machine": C.machine(), "workload": w["source"], "synthetic": w["synthetic"],
           "batch_invariant": args.batch_invariant, "quick": args.quick}
    res["matmul_ceiling"] = C.matmul_ceiling()

    # Load times, each in a fresh process (the GGUF file and the orbax files are in the page
    # cache: "cold" means the conversion path, not a cold disk).
    loaded = load_model(None)
    with tempfile.TemporaryDirectory(prefix="jaxinfer-orbax-") as tmp:
        _, res["convert_orbax_s"] = timed(checkpoint.save, loaded, tmp + "/ckpt")
        res["load_gguf_cold"] = fresh_load(None)
        res["load_orbax_warm"] = fresh_load(tmp + "/ckpt")
    res["load_gguf_cold_s"] = res["load_gguf_cold"]["load_s"]
    res["load_orbax_warm_s"] = res["load_orbax_warm"]["load_s"]
    res["load_avg_after_load"] = C.load_avg()

    gen = ReferenceGenerator(loaded.model, batch_invariant=args.batch_invariant)
    dec_ids, n_new = w["decode"]["ids"], w["decode"]["new_tokens"]
    if args.quick:
        n_new = 32
    greedy = lambda n: SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)  # noqa: E731

    def call(ids, n):
        return gen.generate([ids], [greedy(n)], [0])[0]

    # Compile: first call of each shape (prefill seq bucket + decode step) minus a repeat.
    _, first_full = timed(call, dec_ids, n_new)
    _, first_one = timed(call, dec_ids, 1)
    full_t, one_t = [], []
    for _ in range(args.repeats):
        row, t = timed(call, dec_ids, n_new)
        full_t.append(t)
        one_t.append(timed(call, dec_ids, 1)[1])
    full, one = min(full_t), min(one_t)
    res["compile_decode_workload_s"] = first_full - full
    res["decode"] = {"prompt_tokens": len(dec_ids), "new_tokens": n_new,
                     "ttft_s": one, "total_s": full,
                     "e2e_tok_s": n_new / full,
                     "decode_tok_s": (n_new - 1) / (full - one),
                     "ms_per_token": (full - one) / (n_new - 1) * 1e3,
                     "times_full_s": full_t, "times_1tok_s": one_t,
                     "token_ids": row.token_ids, "load_avg": C.load_avg()}

    pre_ids = w["prefill"]["ids"]
    _, first_pre = timed(call, pre_ids, 1)
    pre_t = [timed(call, pre_ids, 1)[1] for _ in range(args.repeats)]
    res["compile_prefill512_s"] = first_pre - min(pre_t)
    res["prefill"] = {"prompt_tokens": len(pre_ids), "ttft_s": min(pre_t),
                      "prefill_tok_s": len(pre_ids) / min(pre_t), "times_s": pre_t,
                      "load_avg": C.load_avg()}
    res["peak_rss_mib"] = C.peak_rss_mib()
    res["load_avg_end"] = C.load_avg()

    d, pf = res["decode"], res["prefill"]
    C.print_table([
        ("machine", f"{res['machine']['cpu']}, {res['machine']['cores']} cores, "
                    f"jax {res['machine']['jax']}, {res['machine']['date']}"),
        ("workload", w["source"] + (" (SYNTHETIC)" if w["synthetic"] else "")),
        ("matmul ceiling f32 2048^3", f"{res['matmul_ceiling']['gflops']} GFLOP/s"),
        ("load GGUF cold (new process)", f"{res['load_gguf_cold_s']:.2f} s (a 2nd load in that "
                                         f"process {res['load_gguf_cold']['second_load_in_process_s']:.2f} s)"),
        ("convert to orbax (once)", f"{res['convert_orbax_s']:.2f} s"),
        ("load orbax warm (new process)", f"{res['load_orbax_warm_s']:.2f} s (a 2nd load in that "
                                          f"process {res['load_orbax_warm']['second_load_in_process_s']:.2f} s)"),
        ("compile (decode workload shapes)", f"{res['compile_decode_workload_s']:.1f} s"),
        ("compile (512-token prefill shape)", f"{res['compile_prefill512_s']:.1f} s"),
        ("batch-1 decode", f"{d['decode_tok_s']:.1f} tok/s ({d['ms_per_token']:.1f} ms/token; "
                           f"end-to-end {d['e2e_tok_s']:.1f} tok/s incl. prefill)"),
        ("prefill 512 tokens", f"{pf['prefill_tok_s']:.0f} tok/s (TTFT {pf['ttft_s'] * 1e3:.0f} ms)"),
        ("peak RSS", f"{res['peak_rss_mib']:.0f} MiB"),
        ("load average start / end", f"{res['machine']['load_avg_start']} / {res['load_avg_end']}"),
    ], f"reference generator, batch_invariant={args.batch_invariant}")
    C.write_json(args.out, res)


if __name__ == "__main__":
    main()
