"""Tensor-parallel communication: what the compiled step all-reduces, and a paper estimate
of its share of a decode step on accelerator pods.

Part 1 (measured): the default model (SmolLM2-135M) with ``--tp`` on virtual CPU devices;
for each compiled bucket, the collectives in the optimized HLO (count and bytes), and the
bytes all-reduced per token per layer.

Part 2 (paper): the same collective pattern (checked by tests/test_parallel.py: 2 all-reduces
of tokens x hidden per layer, 1 for the embedding, 1 all-gather of the logits) priced with
stated link figures for a TPU v5e-8 slice and an 8x H100 SXM node, for SmolLM2-135M and a
Llama-3-8B-shaped model, batch-1 and batch-32 decode, bf16. No overlap of communication and
compute is assumed (an upper bound on the share).

    python benchmarks/tp_comm.py --tp 3 --out /tmp/bench/tp_comm.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# Assumptions of the paper estimate (per chip / per GPU). Sources: vendor data sheets
# (HBM bandwidth, dense bf16 peak, interconnect) and typical nccl-tests results; the
# per-collective latency is the fixed cost of a small all-reduce.
SYSTEMS = {
    "TPU v5e-8 (2x4 ICI)": dict(hbm=819e9, flops=197e12, busbw=90e9, latency=10e-6,
                                note="ICI 1600 Gbps/chip (4 links); 90 GB/s all-reduce bus bandwidth assumed"),
    "8x H100 SXM (NVLink 4 + NVSwitch)": dict(hbm=3.35e12, flops=989e12, busbw=360e9, latency=8e-6,
                                              note="NVLink 900 GB/s/GPU bidirectional; 360 GB/s all-reduce bus bandwidth assumed (nccl-tests range)"),
}
MODELS = {
    # name: (layers, hidden, vocab, params)
    "SmolLM2-135M": (30, 576, 49152, 134.5e6),
    "Llama-3-8B": (32, 4096, 128256, 8.03e9),
}


def hlo_figures(tp: int, decode_sizes: tuple[int, ...]) -> dict:
    import jax

    jax.config.update("jax_num_cpu_devices", max(8, tp))
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from tp_worker import collectives

    from jaxinfer.engine.engine import Engine

    t0 = time.perf_counter()
    eng = Engine(progress=False, warmup="full", tensor_parallel_size=tp, max_num_seqs=max(decode_sizes),
                 max_num_batched_tokens=64, max_model_len=256, num_pages=64,
                 decode_buckets=decode_sizes, mixed_decode_buckets=(0, max(decode_sizes)), prefill_buckets=((1, 64),),
                 page_buckets=(16,))
    cfg = eng.model_config
    out = {"tp": tp, "num_layers": cfg.num_layers, "hidden": cfg.hidden_size, "vocab": cfg.vocab_size,
           "compile_s": round(time.perf_counter() - t0, 1), "buckets": []}
    for b, exe in sorted(eng.runner.executables.items()):
        c = collectives(exe.as_text(), b.num_tokens)
        ar = c["all_reduce_bytes"]          # ar[0]: the embedding's; then 2 per layer
        out["buckets"].append({
            "tokens": b.num_tokens, "seqs": b.num_seqs, "all_reduces": c["all-reduce"],
            "all_gathers": c["all-gather"], "bytes_per_all_reduce": ar[0],
            "bytes_per_token_per_layer": sum(ar[1:]) / (b.num_tokens * cfg.num_layers),
            "other_collectives": c["reduce-scatter"] + c["all-to-all"] + c["collective-permute"]})
    return out


def estimate(tp: int, batch: int, layers: int, hidden: int, vocab: int, params: float, sysm: dict,
             act_bytes: int = 2, weight_bytes: int = 2) -> dict:
    """One decode step: compute (weight streaming or FLOPs, per device) vs collectives."""
    ring = 2 * (tp - 1) / tp
    ar_bytes = batch * hidden * act_bytes
    n_ar = 2 * layers + 1
    t_ar = n_ar * (sysm["latency"] + ring * ar_bytes / sysm["busbw"])
    gather_bytes = batch * vocab * 4          # f32 logits, all-gathered
    t_ag = sysm["latency"] + (tp - 1) / tp * gather_bytes / sysm["busbw"]
    t_mem = params * weight_bytes / tp / sysm["hbm"]
    t_flop = 2 * params * batch / tp / sysm["flops"]
    compute = max(t_mem, t_flop)
    comm = t_ar + t_ag
    return {"compute_us": compute * 1e6, "all_reduce_us": t_ar * 1e6, "logits_gather_us": t_ag * 1e6,
            "comm_share": comm / (comm + compute)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=3, help="tensor-parallel size for the HLO part")
    ap.add_argument("--no-hlo", action="store_true", help="skip the measured part")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    res = {}
    if not a.no_hlo:
        h = res["hlo"] = hlo_figures(a.tp, (1, 8, 32))
        print(f"## SmolLM2-135M, tp={a.tp}, from the compiled HLO (compile {h['compile_s']} s)\n")
        print("| bucket tokens | all-reduces | bytes each | bytes / token / layer | all-gathers | other |")
        print("|---|---|---|---|---|---|")
        for b in h["buckets"]:
            print(f"| {b['tokens']} | {b['all_reduces']} | {b['bytes_per_all_reduce']} | "
                  f"{b['bytes_per_token_per_layer']:.0f} | {b['all_gathers']} | {b['other_collectives']} |")
    print("\n## Paper estimate, tp=8, bf16 weights and activations, f32 logits\n")
    print("| system | model | batch | compute µs | all-reduce µs | logits all-gather µs | comm share |")
    print("|---|---|---|---|---|---|---|")
    res["estimate"] = []
    for sname, sysm in SYSTEMS.items():
        for mname, (L, D, V, P) in MODELS.items():
            for batch in (1, 32):
                e = estimate(8, batch, L, D, V, P, sysm)
                res["estimate"].append({"system": sname, "model": mname, "batch": batch, **e})
                print(f"| {sname} | {mname} | {batch} | {e['compute_us']:.0f} | {e['all_reduce_us']:.0f} | "
                      f"{e['logits_gather_us']:.0f} | {100 * e['comm_share']:.0f}% |")
    print("\nAssumptions:")
    for sname, sysm in SYSTEMS.items():
        print(f"- {sname}: HBM {sysm['hbm'] / 1e9:.0f} GB/s, {sysm['flops'] / 1e12:.0f} TFLOP/s bf16, "
              f"{sysm['latency'] * 1e6:.0f} µs per collective; {sysm['note']}")
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    os._exit(0)


if __name__ == "__main__":
    main()
