"""Where the engine's resident memory goes (issue 16's RSS floors): one ``Engine`` in this
process, every bucket compiled (``warmup="full"``), the throughput workload through
``Engine.generate``, then:

* RSS / anonymous / file-backed MiB and the peak (VmHWM) after the import, after
  ``Engine()`` and after the workload;
* the resident MiB by mapping (``/proc/self/smaps``): the KV pool (one large anonymous
  mapping, resident only where pages were written), the weight cache's memory-mapped
  ``.npy`` files, jaxlib, the C heap and malloc's thread arenas;
* what the compiled steps hold: the runner's forward executables and samplers are dropped
  and the anonymous memory freed is reported per executable (XLA:CPU keeps ~9 MiB per
  loaded step executable of the default model before its weights and KV pages were stacked,
  ~2 MiB after; ~20 MiB per sampler: this is why fewer
  buckets weigh less).

    python benchmarks/memory_breakdown.py --quantization int8 --kv-cache-dtype int8

The workload is ../shared/data's token-id workload when present, else synthetic ids of
the same shapes (benchmarks/common.py, said in the output). Figures: RESULTS.md, "int8 KV
pages in the C++ attention".
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import re
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common as C  # noqa: E402


def rollup() -> dict[str, int]:
    """RSS, anonymous, file-backed and peak MiB of this process."""
    d: dict[str, int] = {}
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            p = line.split()
            if p[0] in ("Rss:", "Anonymous:"):
                d[p[0][:-1].lower()] = int(p[1]) // 1024
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                d["peak"] = int(line.split()[1]) // 1024
    d["file"] = d["rss"] - d["anonymous"]
    return d


def by_mapping(top: int = 12) -> list[tuple[int, str]]:
    """(resident MiB, name) summed per mapped file ('[anon]', '[heap]' for the others),
    largest first; the KV pool shows as the largest anonymous mapping."""
    agg: collections.Counter = collections.Counter()
    name = "[anon]"
    with open("/proc/self/smaps") as f:
        for line in f:
            if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
                parts = line.split()
                name = parts[5] if len(parts) > 5 else "[anon]"
                if "/weights/" in name:
                    name = "weight cache .npy files"
            elif line.startswith("Rss:"):
                agg[name] += int(line.split()[1])
    return [(kib // 1024, n) for n, kib in agg.most_common(top)]


def largest_anonymous(top: int = 8) -> list[tuple[int, int]]:
    """(resident MiB, mapped MiB) of the largest anonymous mappings."""
    out, cur = [], None
    with open("/proc/self/smaps") as f:
        for line in f:
            if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
                parts = line.split()
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                cur = (hi - lo) >> 20 if len(parts) <= 5 else None
            elif line.startswith("Rss:") and cur is not None:
                out.append((int(line.split()[1]) >> 10, cur))
    return sorted(out, reverse=True)[:top]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quantization", default=None, choices=["int8", "int4"])
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "model", "int8"],
                   help="auto: int8 pages with quantized weights (the engine's default)")
    p.add_argument("--workload", default=None, help="token-id workload JSON (default: ../shared/data's)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    res: dict[str, Any] = {"machine": C.machine(), "quantization": args.quantization,
                           "kv_cache_dtype": args.kv_cache_dtype}
    import jax  # noqa: F401  (the runtime's own share)

    res["imported"] = rollup()
    from jaxinfer import Engine
    from jaxinfer.sampling_params import SamplingParams
    from jaxinfer.host_memory import trim_heap
    from jaxinfer.engine.warmup import use_default_mode

    use_default_mode("full")
    t = time.perf_counter()
    eng = Engine(quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype, progress=False)
    res["engine_s"] = time.perf_counter() - t
    res["engine"] = rollup()
    w = C.load_workload(args.workload)
    res["workload"] = w["source"]
    work = w["throughput"]
    t = time.perf_counter()
    outs = eng.generate(work["prompts"], SamplingParams(max_tokens=work["new_tokens"], ignore_eos=True,
                                                        temperature=0))
    secs = time.perf_counter() - t
    res["tok_per_s"] = sum(len(o.outputs[0].token_ids) for o in outs) / secs
    res["after_workload"] = rollup()
    res["by_mapping"] = by_mapping()
    res["largest_anonymous"] = largest_anonymous()
    runner = eng.replicas[0].runner
    for name in ("executables", "samplers", "multi_executables"):
        held = getattr(runner, name)
        n = len(held)
        if not n:
            continue
        gc.collect()
        trim_heap()
        before = rollup()["anonymous"]
        held.clear()
        gc.collect()
        trim_heap()
        freed = before - rollup()["anonymous"]
        res[f"held_by_{name}"] = {"count": n, "mib": freed, "mib_each": freed / n}

    m = res["machine"]
    print(f"\n== memory breakdown ({args.quantization or 'float32'} weights, "
          f"{args.kv_cache_dtype} KV; {m.get('cpu')}, {m.get('cores')} cores, {m.get('date')})")
    print(f"  workload               {res['workload']}: {res['tok_per_s']:.1f} out tok/s")
    for k in ("imported", "engine", "after_workload"):
        r = res[k]
        print(f"  {k:<22} RSS {r['rss']} MiB (anonymous {r['anonymous']}, file {r['file']}), peak {r['peak']}")
    print("  resident by mapping:")
    for mib, name in res["by_mapping"]:
        print(f"    {mib:6d} MiB  {name}")
    print("  largest anonymous mappings (resident / mapped MiB): "
          + ", ".join(f"{a}/{b}" for a, b in res["largest_anonymous"]))
    for name in ("executables", "samplers", "multi_executables"):
        h = res.get(f"held_by_{name}")
        if h:
            print(f"  held by {name:<14} {h['mib']} MiB for {h['count']} ({h['mib_each']:.1f} MiB each)")
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))
        print(f"results written to {args.out}")


if __name__ == "__main__":
    main()
