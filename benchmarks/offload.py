"""Weight offload: the slowdown of streaming layers from host memory vs all weights resident,
in the same run.

The default model (float32), two engines from one load: ``resident`` and ``offload``
(``--offload-weights host`` with a device budget that keeps the embedding, the head and
the first ``--resident-layers`` layers resident; the rest stream from host memory a layer
ahead). Workloads: batch-1 decode (the workload's decode prompt, ``--new-tokens`` tokens;
decode tok/s after the first token) and the throughput set (32 prompts, ``--new-tokens``
each, tok/s overall). Runs A/B then B/A; the mean of both is reported.

On CPU the host and device memory kinds are the same RAM and XLA drops the copies, so this
measures the code path's overhead; on a GPU the copies are DMA from pinned host memory
(PCIe: ~25 GB/s on a 4th-generation x16 link) overlapped with the previous layer.

    python benchmarks/offload.py --quick
"""

from __future__ import annotations

import time

import common as C


def main() -> None:
    p = C.base_parser(__doc__)
    p.add_argument("--resident-layers", type=int, default=15, help="layers kept in device memory")
    p.add_argument("--new-tokens", type=int, default=64)
    args = p.parse_args()
    from jaxinfer.sampling_params import SamplingParams
    from jaxinfer.engine import offload
    from jaxinfer.engine.engine import Engine
    from jaxinfer.loading import load_model
    from jaxinfer.quantization import prepare_float_for_cpu

    w = C.load_workload(args.workload)
    n_new = 16 if args.quick else args.new_tokens
    prompts = w["throughput"]["prompts"][: 8 if args.quick else 32]
    loaded = load_model(None, "float32")
    other, per = offload.layer_bytes(prepare_float_for_cpu(loaded.model))
    budget = other + sum(per[:args.resident_layers])
    kw = dict(loaded=loaded, progress=False, max_num_seqs=32, max_model_len=512, enable_prefix_caching=False,
              kv_cache_memory=256 << 20)
    engines = {"resident": Engine(**kw), "offload": Engine(**kw, offload_weights="host", device_weight_memory=budget)}
    dev, host = offload.resident_bytes(engines["offload"].runner.state_leaves)
    sp = SamplingParams(temperature=0, max_tokens=n_new, ignore_eos=True)
    res = {"machine": C.machine(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "workload": w["source"], "new_tokens": n_new, "budget_bytes": budget, "device_bytes": dev,
           "host_bytes": host, "load_before": C.load_avg(), "decode_tok_s": {}, "throughput_tok_s": {}}
    for e in engines.values():
        e.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=2))
    tokens = {}
    for order in (("resident", "offload"), ("offload", "resident")):
        for name in order:
            e = engines[name]
            out = e.generate([w["decode"]["ids"]], sp)[0]
            m = out.metrics
            res["decode_tok_s"].setdefault(name, []).append((n_new - 1) / (m.finished_time - m.first_token_time))
            t = time.perf_counter()
            outs = e.generate(prompts, sp)
            res["throughput_tok_s"].setdefault(name, []).append(len(prompts) * n_new / (time.perf_counter() - t))
            tokens[name] = [o.outputs[0].token_ids for o in outs]
    res["load_after"] = C.load_avg()
    res["tokens_identical"] = tokens["resident"] == tokens["offload"]
    mean = {k: {n: sum(v) / len(v) for n, v in res[k].items()} for k in ("decode_tok_s", "throughput_tok_s")}
    C.print_table([
        ("weights on device / in host memory", f"{dev / 2**20:.0f} / {host / 2**20:.0f} MiB (budget {budget / 2**20:.0f} MiB)"),
        ("batch-1 decode tok/s resident / offload", f"{C.fmt(mean['decode_tok_s']['resident'])} / "
                                                    f"{C.fmt(mean['decode_tok_s']['offload'])}"),
        (f"{len(prompts)} prompts tok/s resident / offload", f"{C.fmt(mean['throughput_tok_s']['resident'])} / "
                                                             f"{C.fmt(mean['throughput_tok_s']['offload'])}"),
        ("tokens identical", res["tokens_identical"])],
        f"{C.cpu_model()}, {res['date']}, load {res['load_before']} -> {res['load_after']}")
    C.write_json(args.out, res)


if __name__ == "__main__":
    main()
