"""Multi-LoRA under tensor / data parallelism, for tests/test_lora.py, in a process of its own
(JAX's CPU device count is fixed when it starts: 8 virtual devices here).

``python tests/lora_tp_worker.py DIR``: DIR holds a tiny HF Llama (8 query / 2 KV heads, so
TP 4 repeats KV heads) and adapters a1..a3 (made by the test with peft). For (dp, tp) in
GRID: an engine with all three adapters and two slots generates the same mixed requests;
prints one JSON object: per run the greedy tokens, the logits row of every sampled token,
and (TP 2) the collectives of every compiled step, with and without LoRA.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

GRID = [(1, 1), (1, 2), (1, 4), (2, 2)]          # (dp, tp)
NAMES = ["a1", None, "a2", "a3", "a1", None]       # the adapter of each of tp_worker's PROMPTS


def run(d: str, dp: int, tp: int, lora: bool) -> dict:
    from jaxinfer.loading import load_model
    from tp_worker import ENGINE_KW, PROMPTS, run_engine

    # LoRA unrolls the layers (models/layer_loop.py); the plain engine too, so their steps compare
    kw = (dict(lora_modules={n: f"{d}/{n}" for n in ("a1", "a2", "a3")}, max_loras=2, max_lora_rank=8) if lora
          else dict(layer_loop=False))
    return run_engine(load_model(d, "float32"), dp, tp, PROMPTS, hlo=tp == 2 and dp == 1,
                      loras=NAMES if lora else None, **ENGINE_KW, **kw)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--compilation-cache", default=None)
    a = ap.parse_args()
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    if a.compilation_cache:
        from jaxinfer.engine.resources import enable_compilation_cache
        enable_compilation_cache(a.compilation_cache)
    sys.path.insert(0, os.path.dirname(__file__))
    res = {f"{dp}x{tp}": run(a.dir, dp, tp, True) for dp, tp in GRID}
    res["plain_1x2"] = run(a.dir, 1, 2, False)
    sys.stdout.write("\n" + json.dumps(res) + "\n")
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
