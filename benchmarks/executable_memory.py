"""What a loaded XLA:CPU step executable costs in resident memory (issue 16).

A loaded XLA:CPU executable keeps its HLO module, a protobuf copy of it and its buffer
assignment, so its size follows its HLO instruction count, not its machine code. This
measures, for the default model's engine (buckets compiled or loaded from the persistent
cache first), one decode forward and the sampler: HLO instructions, serialized size, and
the RSS that each further load of the same serialized executable adds (mean of
``--loads``, heap trimmed before and after). ``--layers``: the same for a tiny random
Llama (hidden 64) with 2 and 30 layers, both through the layer loop: the difference is
what 28 layers' worth of operands (weights and KV pages, carried through the loop one
buffer each) cost per executable.

    python benchmarks/executable_memory.py [--layers] [--loads 10]
"""

from __future__ import annotations

import argparse
import ctypes
import gc
from typing import Any


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def _trim() -> None:
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)


def per_load(compiled: Any, loads: int) -> dict[str, float]:
    """HLO instructions, serialized KiB and MiB per extra load of ``compiled``."""
    import jax

    client = jax.devices()[0].client
    blob = client.serialize_executable(compiled.runtime_executable())
    instrs = sum(1 for line in compiled.as_text().splitlines() if " = " in line)
    kept = []
    _trim()
    before = _rss_mib()
    for _ in range(loads):
        kept.append(client.deserialize_executable(blob, jax.devices()[:1]))
    _trim()
    return {"hlo_instructions": instrs, "serialized_kib": len(blob) / 1024,
            "mib_per_load": (_rss_mib() - before) / loads}


def default_model(loads: int) -> None:
    from jaxinfer.engine.engine import Engine

    eng = Engine(progress=False, warmup="lazy")
    r = eng.runner
    decode = min(b for b in eng.ladders.all_buckets() if b.num_prefill == 0)
    r.compile_bucket(decode)
    print(f"default model, decode-1 forward (layer loop {r.layer_loop}):", per_load(r.executables[decode], loads))
    print(f"default model, sampler (width {decode.sample_rows}):", per_load(r.samplers[decode.sample_rows], loads))
    print(f"buckets on the default ladder: {len(eng.ladders.all_buckets())} forwards, "
          f"{len({b.sample_rows for b in eng.ladders.all_buckets()})} sampler(s)")


def tiny_layers(loads: int) -> None:
    from flax import nnx

    from jaxinfer.models.config import ModelConfig
    from jaxinfer.engine.engine import Engine
    from jaxinfer.loading import LoadedModel, load_model
    from jaxinfer.models.llama import LlamaForCausalLM

    tok = load_model(None).tokenizer
    for n in (2, 30):
        cfg = ModelConfig(architecture="LlamaForCausalLM", vocab_size=49152, hidden_size=64,
                          intermediate_size=128, num_layers=n, num_heads=4, num_kv_heads=2, head_dim=16,
                          max_position_embeddings=1024, tie_word_embeddings=True, eos_token_ids=(2,))
        loaded = LoadedModel(cfg, LlamaForCausalLM(cfg, rngs=nnx.Rngs(0)), tok, {}, "tiny")
        eng = Engine(loaded=loaded, progress=False, max_num_seqs=8, max_num_batched_tokens=64,
                     max_model_len=256, num_pages=64, page_buckets=(16,), decode_buckets=(1,),
                     mixed_decode_buckets=(0, 8), prefill_buckets=((1, 16),), warmup="full")
        r = eng.runner
        b = min(b for b in eng.ladders.all_buckets() if b.num_prefill == 0)
        print(f"tiny Llama, {n} layers (layer loop {r.layer_loop}), decode-1 forward:",
              per_load(r.executables[b], loads))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--loads", type=int, default=10)
    p.add_argument("--layers", action="store_true", help="also the tiny 2- vs 30-layer comparison")
    args = p.parse_args()
    default_model(args.loads)
    if args.layers:
        tiny_layers(args.loads)


if __name__ == "__main__":
    main()
