"""Where a batch-1 decode step's time goes, by ablation: the same engine step timed with
its parts replaced by near-free stand-ins, each variant in its own process.

* ``full``      — the engine as configured (``--quantization``, batch-invariant or not);
* ``no-matmul`` — every model matmul replaced by a broadcast of its input (same shapes);
* ``no-matmul-no-attention`` — and the attention returns q.

Differences between rows give the matmuls' and the attention's share; what is left in the
last row is the rest of the model (norms, rope, the KV write, residuals: ~30 small XLA ops
per layer) plus the sampler and the host. Outputs of the ablated variants are garbage by
design; only their time means something. The engine runs the workload's ``decode`` prompt
(32 tokens) for 128 new tokens, batch 1, with benchmarks/latency.py's configuration;
ms/step is the median over 3 runs.

    python benchmarks/decode_breakdown.py [--quantization int8] [--no-batch-invariant]
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time

import common as C

VARIANTS = ("full", "no-matmul", "no-matmul-no-attention")


def run_variant(variant: str, quantization: str | None, batch_invariant: bool, ids: list[int]) -> dict:
    import types

    import jax.numpy as jnp

    import latency as LAT
    import jaxinfer.matmul as D
    import pallas_kernels.attention.xla as X
    import pallas_kernels.attention.cpu as CA
    from jaxinfer import Engine
    from jaxinfer.sampling_params import SamplingParams
    from jaxinfer.loading import load_model

    if variant != "full":
        D.select = lambda *a, **k: (lambda x, w: jnp.zeros((x.shape[0], w.shape[1]), x.dtype)
                                           + x[:, :1])
    if variant == "no-matmul-no-attention":
        X.ragged_paged_attention = CA.ragged_paged_attention = lambda q, *a, **k: q
    args = types.SimpleNamespace(max_model_len=640, max_num_batched_tokens=512, max_num_seqs=1,
                                 quantization=quantization, batch_invariant=batch_invariant, num_scheduler_steps=1)
    eng = Engine(loaded=load_model(None), progress=False, **LAT.engine_config(args))
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    runs = []
    for _ in range(4):                  # the first run warms up
        eng.add_request(list(ids), params)
        t0, n = time.perf_counter(), 0
        while eng.has_unfinished():
            eng.step()
            n += 1
        runs.append((time.perf_counter() - t0) / n * 1e3)
    return {"variant": variant, "ms_per_step": statistics.median(runs[1:]), "runs_ms": runs[1:]}


def main() -> None:
    p = C.base_parser(__doc__.split("\n\n")[0])
    p.add_argument("--quantization", default=None, choices=[None, "int8", "int4"])
    p.add_argument("--no-batch-invariant", dest="batch_invariant", action="store_false")
    p.add_argument("--variant", default=None, help=argparse_hidden())
    args = p.parse_args()
    w = C.load_workload(args.workload)
    if args.variant:                     # child process: one variant, JSON on stdout
        print(json.dumps(run_variant(args.variant, args.quantization, args.batch_invariant,
                                     w["decode"]["ids"])))
        return
    rows, res = [], {"machine": C.machine(), "workload": w["source"], "variants": []}
    for v in VARIANTS:
        cmd = [sys.executable, __file__, "--variant", v] + sys.argv[1:]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        r = json.loads(out.strip().splitlines()[-1])
        res["variants"].append(r)
        rows.append((v, f"{r['ms_per_step']:.2f} ms/step ({1e3 / r['ms_per_step']:.1f} tok/s)"))
    ms = {r["variant"]: r["ms_per_step"] for r in res["variants"]}
    rows += [("-> matmuls", f"{ms['full'] - ms['no-matmul']:.2f} ms"),
             ("-> attention", f"{ms['no-matmul'] - ms['no-matmul-no-attention']:.2f} ms"),
             ("-> rest (other ops, sampler, host)", f"{ms['no-matmul-no-attention']:.2f} ms")]
    C.print_table([("machine", f"{res['machine']['cpu']}, {res['machine']['date']}"),
                   ("engine", f"quantization={args.quantization}, "
                              f"batch_invariant={args.batch_invariant}")] + rows,
                  "decode step breakdown (batch 1)")
    C.write_json(args.out, res)


def argparse_hidden():
    import argparse
    return argparse.SUPPRESS


if __name__ == "__main__":
    main()
