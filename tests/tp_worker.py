"""Tensor / data parallel runs for tests/test_parallel.py, in a process of their own.

The device count of JAX's CPU backend is fixed when JAX starts, so the multi-device runs
cannot share the pytest process. Modes (each prints one JSON object on its last line):

* ``grid``: tiny random models x (dp, tp) in the acceptance grid, on 8 virtual CPU devices:
  greedy tokens and, for every sampled token, the logits row it was sampled from.
  With them, the collectives in every compiled step of the tp=2..8 engines (from the HLO).
* ``load``: a tiny HF checkpoint (and its orbax conversion) loaded straight into shards.
* ``default``: the embedded SmolLM2 with tp=3 (and the error for tp=2/4/8).
* ``mp``: one process of a 2-process tp=2 engine over jax.distributed (gloo on CPU);
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

TINY = {
    # heads divide tp 1/2/4; tp 8 repeats each of the 4 KV heads twice
    "llama_8q4kv": dict(architecture="LlamaForCausalLM", num_heads=8, num_kv_heads=4,
                        tie_word_embeddings=False),
    # Qwen3-like (q/k norm) with Qwen2's qkv bias, GQA 4: tp 4 and 8 repeat KV heads
    "qwen_8q2kv": dict(architecture="Qwen3ForCausalLM", num_heads=8, num_kv_heads=2,
                       qk_norm=True, qkv_bias=True, tie_word_embeddings=True),
}
# DP x TP on all 8 devices only: a 2x2 grid added nothing 2x4 and TP 2 alone do not cover
# (CI time; each engine is a sharded compile of its own)
GRID = [(1, 1), (1, 2), (1, 4), (1, 8), (2, 4)]   # (dp, tp)
# The second model repeats KV heads from tp 4 up; its tp 2 cases add nothing the first's
# do not cover, and each engine costs compile time.
GRID_OF = {"llama_8q4kv": GRID, "qwen_8q2kv": [(1, 1), (1, 4), (1, 8), (2, 4)]}
PROMPTS = [[1, 2, 3, 4, 5], list(range(10, 47)), [7] * 19, list(range(100, 160, 3)),
           [42], list(range(300, 270, -1))]


def run_on_fake_devices(script: str, payload: Any, devices: int, timeout: int = 600) -> Any:
    """``python script json(payload)`` with ``devices`` fake CPU devices (the device count
    is fixed when JAX starts, so multi-device runs need a process of their own); the JSON
    object on the last line of its output. The test modules' TP workers use this."""
    import pathlib
    import subprocess

    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = os.pathsep.join([str(pathlib.Path(__file__).parents[1]), env.get("PYTHONPATH", "")])
    p = subprocess.run([sys.executable, script, json.dumps(payload)], capture_output=True, text=True,
                       env=env, timeout=timeout)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


class ByteTokenizer:
    """Enough of the Tokenizer interface for token-id prompts."""

    eos_token_ids = ()

    def encode(self, s):
        return list(s.encode())

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(32 + i % 90) for i in ids)

    def convert_ids_to_tokens(self, ids):
        return [chr(32 + i % 90) for i in ids]


def tiny_loaded(name: str, num_layers: int = 2):
    from flax import nnx

    from jaxinfer.models.config import ModelConfig
    from jaxinfer.loading import LoadedModel
    from jaxinfer.models.llama import LlamaForCausalLM

    cfg = ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=num_layers,
                      head_dim=16, max_position_embeddings=256, **TINY[name])
    model = LlamaForCausalLM(cfg, rngs=nnx.Rngs(0))
    # Random biases and norms (init gives zeros / ones) so that their sharding is exercised,
    # and a spread-out head so greedy decoding is not a toss-up between near-ties.
    import jax
    key = jax.random.key(1)
    for path, p in nnx.iter_graph(model):
        if isinstance(p, nnx.Param) and path[-1] in ("bq", "bk", "bv", "q_norm", "k_norm"):
            key, sub = jax.random.split(key)
            p.set_value(p[...] + 0.3 * jax.random.normal(sub, p[...].shape))
    model.lm_head.set_value(model.lm_head[...] * 30.0)
    return LoadedModel(cfg, model, ByteTokenizer(), {}, name)


def run_engine(loaded, dp: int, tp: int, prompts, max_tokens: int = 8, hlo: bool = False,
               loras: list | None = None, **kw):
    """Greedy outputs, the logits row of every sampled token (per request, in order) and,
    with ``hlo``, the collectives of each compiled step. ``loras``: each prompt's LoRA
    adapter name (tests/lora_tp_worker.py)."""
    import numpy as np

    from jaxinfer.sampling_params import SamplingParams
    from jaxinfer.engine.engine import Engine

    eng = Engine(loaded=loaded, progress=False, tensor_parallel_size=tp, data_parallel_size=dp, **kw)
    rows: dict[str, list] = {}
    dispatch = eng._dispatch

    def capture(rep, sched):
        # read at dispatch: the next step's forward takes this buffer over (donated), and
        # the overlapped loop dispatches it before this step's tokens come back
        launched = dispatch(rep, sched)
        logits = np.asarray(rep.runner.last_logits)
        for slot, e in launched.batch.entries:
            if e.samples:
                rows.setdefault(e.seq.request_id, []).append(logits[slot].tolist())
        return launched

    eng._dispatch = capture
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    ids = [eng.add_request(p, sp, request_id=f"r{i}", lora=loras[i] if loras else None)
           for i, p in enumerate(prompts)]
    outs = eng.run_until_done(ids)
    leaked = eng.stats()["num_free_pages"] != eng.stats()["num_total_pages"]
    res = {"tokens": [o.outputs[0].token_ids for o in outs],
           "logits": [rows[i][:len(o.outputs[0].token_ids)] for i, o in zip(ids, outs)],
           "replicas": len(eng.replicas), "leaked_pages": leaked,
           "preemptions": eng.stats()["num_preemptions_total"],
           "kv_heads_per_device": eng.kv_spec.num_kv_heads // tp}
    if hlo:
        res["hlo"] = {"num_layers": loaded.config.num_layers, "hidden_size": loaded.config.hidden_size,
                      "layer_loop": eng.runner.layer_loop,
                      "buckets": {repr(b): collectives(exe.as_text(), b.num_tokens)
                                  for b, exe in eng.runner.executables.items()}}
    return res


def collectives(text: str, num_tokens: int) -> dict:
    c = {op: _count_ops(text, op) for op in
         ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")}
    c["all_reduce_bytes"] = _op_bytes(text, "all-reduce")
    c["all_gather_bytes"] = _op_bytes(text, "all-gather")
    c["num_tokens"] = num_tokens
    return c


ENGINE_KW = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128, num_pages=40,
                 min_sampler_rows=16, decode_buckets=(4,), mixed_decode_buckets=(0, 4), prefill_buckets=((1, 32),),
                 page_buckets=(8,))


def mode_grid() -> dict:
    import numpy as np

    out = {}
    for name in TINY:
        loaded = tiny_loaded(name)
        runs = {f"{dp}x{tp}": run_engine(loaded, dp, tp, PROMPTS, hlo=dp == 1 and tp > 1, **ENGINE_KW)
                for dp, tp in GRID_OF[name]}
        ref = runs["1x1"]
        res = {}
        for key, r in runs.items():
            err = 0.0
            for a, b in zip(r["logits"], ref["logits"]):
                a, b = np.asarray(a), np.asarray(b)
                err = max(err, float(np.max(np.abs(a - b)) / np.max(np.abs(b))))
            res[key] = {"tokens": r["tokens"], "tokens_equal": r["tokens"] == ref["tokens"],
                        "max_rel_logit_err": err,
                        "replicas": r["replicas"], "leaked_pages": r["leaked_pages"],
                        "kv_heads_per_device": r["kv_heads_per_device"]}
        out[name] = res
        if name == "llama_8q4kv":      # the overlapped loop (default) vs the synchronous one, TP 2
            sync = run_engine(loaded, 1, 2, PROMPTS, async_scheduling=False, **ENGINE_KW)
            out["sync_vs_overlap"] = {"tokens_equal": sync["tokens"] == runs["1x2"]["tokens"],
                                      "logits_equal": sync["logits"] == runs["1x2"]["logits"]}
            out["hlo"] = {k.split("x")[1]: r["hlo"] for k, r in runs.items() if "hlo" in r}
    return out


def _count_ops(hlo: str, op: str) -> int:
    """Instructions of kind ``op`` in HLO text (async start/done pairs count once)."""
    import re

    return len(re.findall(rf"= [^=]*? {re.escape(op)}(?:-start)?\(", hlo))


def _op_bytes(hlo: str, op: str) -> list[int]:
    """Bytes of each ``op`` collective's result (all-reduce, all-gather), in program order."""
    import re

    sizes = {"f32": 4, "bf16": 2, "s32": 4, "f16": 2}
    out = []
    for m in re.finditer(rf"= (f32|bf16|s32|f16)\[([\d,]*)\][^=]*? {op}(?:-start)?\(", hlo):
        n = 1
        for d in filter(None, m.group(2).split(",")):
            n *= int(d)
        out.append(n * sizes[m.group(1)])
    return out


def mode_default(tps: list[int]) -> dict:
    from jaxinfer.loading import load_model

    loaded = load_model(None, "float32")
    tok = loaded.tokenizer
    prompts = [tok.encode("The capital of France is"),
               tok.apply_chat_template([{"role": "user", "content": "Name three planets."}],
                                       add_generation_prompt=True),
               tok.encode("def fibonacci(n):")]
    kw = dict(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256, num_pages=64,
              min_sampler_rows=16, decode_buckets=(4,), mixed_decode_buckets=(0, 4), prefill_buckets=((1, 64),),
              page_buckets=(16,))
    res = {}
    for tp in tps:
        try:
            r = run_engine(loaded, 1, tp, prompts, max_tokens=16, **kw)
            res[str(tp)] = {"tokens": r["tokens"], "logits": r["logits"],
                            "kv_heads_per_device": r["kv_heads_per_device"]}
        except ValueError as e:
            res[str(tp)] = {"error": str(e)}
    ref = res.get("1")
    if ref and "logits" in ref:
        import numpy as np
        for r in res.values():
            if "logits" in r:
                r["max_rel_logit_err"] = max(
                    float(np.max(np.abs(np.asarray(a) - np.asarray(b))) / np.max(np.abs(np.asarray(b))))
                    for a, b in zip(r["logits"], ref["logits"]))
                r["tokens_equal"] = r["tokens"] == ref["tokens"]
    for r in res.values():
        r.pop("logits", None)
    return res


def mode_load(hf_dir: str, tmp: str) -> dict:
    """Weights land in their shards: from safetensors and from an orbax checkpoint restored
    sharded; every device holds only its slice, values equal the unsharded load."""
    import numpy as np

    from jaxinfer import sharding
    from jaxinfer.loading import checkpoint, load_model
    from jaxinfer.models.llama import flat_params, weight_specs

    plain = load_model(hf_dir)
    ref = {k: np.asarray(v) for k, v in flat_params(plain.model).items()}
    saved = checkpoint.save(plain, os.path.join(tmp, "orbax"))
    res = {}
    for source, path in (("safetensors", hf_dir), ("orbax", saved)):
        for tp in (2, 4):
            mesh = sharding.replica_meshes(sharding.make_mesh(tp))[0]
            loaded = load_model(path, mesh=mesh)
            run_cfg = loaded.model.cfg
            bad = []
            for name, arr in flat_params(loaded.model).items():
                spec = weight_specs(run_cfg)[name]
                want = sharding.partition_spec(spec.axes)
                local = {tuple(sh.data.shape) for sh in arr.addressable_shards}
                split = [i for i, a in enumerate(spec.axes) if a and sharding.LOGICAL_AXES[a]]
                shard_shape = tuple(d // tp if i in split else d for i, d in enumerate(arr.shape))
                value = np.asarray(arr)
                if name.rsplit(".", 1)[-1] in ("wk", "wv") and run_cfg.num_kv_heads != plain.config.num_kv_heads:
                    r = run_cfg.num_kv_heads // plain.config.num_kv_heads
                    hd = run_cfg.head_dim
                    value = value.reshape(value.shape[0], -1, r, hd)[:, :, 0].reshape(value.shape[0], -1)
                if (arr.sharding.spec != want or local != {shard_shape}
                        or len(arr.addressable_shards) != tp or not np.array_equal(value, ref[name])):
                    bad.append(name)
            res[f"{source}_tp{tp}"] = {"bad": bad, "num_weights": len(ref),
                                       "kv_heads": run_cfg.num_kv_heads,
                                       "devices": len(next(iter(flat_params(loaded.model).values())).sharding.device_set)}
    return res


def mode_mp(coordinator: str, num_processes: int, process_id: int) -> dict:
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator, num_processes=num_processes, process_id=process_id)
    from jaxinfer.engine.engine import Engine


    loaded = tiny_loaded("llama_8q4kv")
    eng = Engine(loaded=loaded, progress=False, tensor_parallel_size=num_processes, **ENGINE_KW)
    if eng.is_follower:
        res = {"process": process_id, "followed_steps": eng.follow()}
    else:
        from jaxinfer.sampling_params import SamplingParams

        sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        outs = eng.generate(PROMPTS, sp)
        eng.shutdown()
        res = {"process": process_id, "tokens": [o.outputs[0].token_ids for o in outs],
               "steps": eng.num_steps, "devices": [str(d) for d in eng.runner.mesh.devices.flat]}
    finish_distributed(res, process_id)


def finish_distributed(res: dict, process_id: int) -> None:
    """Print this process's result and leave. The result goes out before the closing
    barrier: past it, process 0 exits and takes the coordination service with it, and a
    follower still polling that service is aborted (SIGABRT, seen in CI under load). So a
    follower exits at once and process 0 gives it five seconds."""
    from jax._src import distributed

    sys.stdout.write("\n" + json.dumps(res) + "\n")
    sys.stdout.flush()
    distributed.global_state.client.wait_at_barrier("worker_done", 120_000)
    if process_id == 0:
        time.sleep(5)
    os._exit(0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["grid", "default", "mp", "load"])
    ap.add_argument("--hf-dir", default=None)
    ap.add_argument("--tmp", default=None)
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--tp", default="1,3,2,4,8")
    ap.add_argument("--coordinator", default="127.0.0.1:0")
    ap.add_argument("--num-processes", type=int, default=2)
    ap.add_argument("--process-id", type=int, default=0)
    ap.add_argument("--compilation-cache", default=None)
    a = ap.parse_args()
    import jax

    jax.config.update("jax_num_cpu_devices", 1 if a.mode == "mp" else a.devices)
    if a.compilation_cache:
        from jaxinfer.engine.resources import enable_compilation_cache
        enable_compilation_cache(a.compilation_cache)
    if a.mode == "grid":
        res = mode_grid()
    elif a.mode == "default":
        res = mode_default([int(x) for x in a.tp.split(",")])
    elif a.mode == "load":
        res = mode_load(a.hf_dir, a.tmp)
    else:
        res = mode_mp(a.coordinator, a.num_processes, a.process_id)
    sys.stdout.write("\n" + json.dumps(res) + "\n")
    sys.stdout.flush()
    os._exit(0)   # skip interpreter teardown (jax.distributed shutdown races the other process)


if __name__ == "__main__":
    main()
