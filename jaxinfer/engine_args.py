"""The engine's command-line options, in one place: ``jaxinfer generate``, ``serve`` and
``bench`` all take them (serving/cli.py, serving/server.py, jaxinfer/bench/cli.py), and
``engine_config`` turns them into the one ``EngineConfig`` (config is read once, here)."""

from __future__ import annotations

import argparse
import json
import os

from jaxinfer.engine_config import DEFAULT_WEIGHT_CACHE, speculative_fields

DEFAULT_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "jaxinfer", "xla")


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="HF checkpoint dir, .gguf file or `jaxinfer convert` output "
                        "(default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Every engine flag, in --help order."""
    add_model_args(p)
    _add_step_args(p)
    _add_speculative_args(p)
    _add_startup_args(p)
    _add_lora_args(p)
    _add_parallel_args(p)


def _add_step_args(p: argparse.ArgumentParser) -> None:
    """What a step holds (sequences, tokens, KV pages) and how steps run and compile."""
    p.add_argument("--max-num-seqs", type=int, default=None, help="sequences per step")
    p.add_argument("--max-num-batched-tokens", type=int, default=512, help="tokens per step")
    p.add_argument("--long-prefill-token-threshold", type=int, default=None, metavar="N",
                   help="most tokens a prompt's chunk takes per step while other requests share the "
                        "engine, so a long prompt does not stall them (default: a sixteenth of "
                        "--max-num-batched-tokens; 0: no cap)")
    p.add_argument("--max-model-len", type=int, default=None, help="prompt + output tokens")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--kv-cache-memory", type=byte_size, default=None, metavar="BYTES",
                   help="KV cache size, e.g. 536870912, 512M or 2G (default: what max-num-seqs "
                        "sequences of max-model-len tokens need, up to 1 GiB on CPU)")
    p.add_argument("--max-waiting", type=int, default=4096, help="waiting sequences before 503")
    p.add_argument("--max-queue-delay-ms", type=int, default=None, metavar="MS",
                   help="refuse a request (503 + Retry-After) when its predicted wait for its first "
                        "token exceeds MS: the prompt tokens queued ahead of it over the measured "
                        "prefill rate (default: off)")
    p.add_argument("--scheduling-policy", choices=["fcfs", "priority"], default="fcfs",
                   help="fcfs: arrival order (a non-zero request priority is refused); priority: "
                        "lower `priority` values first, preempting lower-priority running requests")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV of earlier requests' identical prefixes (on by default)")
    p.add_argument("--host-kv-cache-memory", type=int, default=None, metavar="BYTES",
                   help="host RAM for prefix-cache pages evicted from the device (0 = off; "
                        "default: off on CPU, 10%% of RAM on accelerators)")
    p.add_argument("--enable-prompt-logprobs", action="store_true",
                   help="compile scoring twins of the prefill step shapes, so requests may ask for "
                        "prompt logprobs (OpenAI echo + logprobs, vLLM prompt_logprobs, TGI "
                        "decoder_input_details; what lm_eval's loglikelihood tasks send)")
    p.add_argument("--num-scheduler-steps", type=int, default=1,
                   help="multi-step decode: up to this many decode steps per device call while "
                        "nothing waits for a prefill (single device; outputs stream in runs)")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                   help="the overlapped step loop: schedule and dispatch step N+1 while step N runs "
                        "(same outputs; --no-async-scheduling: the synchronous loop)")
    p.add_argument("--min-sampler-rows", type=int, default=None, metavar="N",
                   help="the sampler sees at least N rows per step (a step's sequences rounded up "
                        "to a power of two otherwise); default: the widest any step needs, so one "
                        "sampler executable serves every step (1: one per power of two, ~26 MiB "
                        "resident each on CPU)")
    p.add_argument("--layer-loop", action=argparse.BooleanOptionalAction, default=True,
                   help="run the model's identical layers as one loop where the CPU kernels allow "
                        "it (one layer per compiled step instead of all: smaller, faster to compile, "
                        "the same tokens); --no-layer-loop unrolls them")
    p.add_argument("--weight-codes", action=argparse.BooleanOptionalAction, default=True,
                   help="keep float32 weights that a GGUF dequantized from Q4_1 / Q8_0 blocks as those "
                        "exact codes (1.25 bytes a weight instead of 4; the kernel computes with the "
                        "same floats, so the same tokens); --no-weight-codes keeps the floats")


def _add_speculative_args(p: argparse.ArgumentParser) -> None:
    """Speculative decoding."""
    g = p.add_argument_group("speculative decoding")
    g.add_argument("--speculative-method", choices=["ngram", "self", "draft"], default=None,
                   help="propose tokens and verify them in one step (greedy and seeded outputs "
                        "unchanged): ngram = prompt lookup; self = the model's own quantized "
                        "copy drafts; draft = the --speculative-model drafts")
    g.add_argument("--speculative-model", default=None, metavar="PATH",
                   help="draft model for --speculative-method draft (same vocabulary as the model)")
    g.add_argument("--speculative-quantization", choices=["auto", "int8", "int4", "none"], default="auto",
                   help="the draft model's weights (self, draft): int8, int4 or as loaded; auto (default): "
                        "int4 on CPU (the C++ 4-bit kernel) or for a quantized model, else int8")
    g.add_argument("--speculative-draft-layers", type=int, default=None, metavar="L",
                   help="self: draft with the model's first L layers only (default: all)")
    g.add_argument("--num-speculative-tokens", type=int, default=7, help="tokens proposed per step")
    g.add_argument("--ngram-prompt-lookup-max", type=int, default=4, help="longest n-gram matched")
    g.add_argument("--ngram-prompt-lookup-min", type=int, default=2, help="shortest n-gram matched")
    g.add_argument("--speculative-disable-by-batch-size", type=int, default=2,
                   help="no speculation while more sequences than this run")
    g.add_argument("--speculative-tree-width", type=int, default=1, metavar="W",
                   help="ngram: verify up to W prompt-lookup continuations (different first tokens) "
                        "in one step and keep the longest accepted (a token tree; each extra one "
                        "costs its rows: pays where rows are nearly free, e.g. a GPU)")
    g.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='vLLM\'s form, e.g. \'{"method": "ngram", "num_speculative_tokens": 5, '
                        '"prompt_lookup_max": 4}\' (methods ngram, self, draft_model; keys model, '
                        'prompt_lookup_min, disable_by_batch_size, quantization, draft_layers, tree_width): its '
                        'keys override the flags above; not with --speculative-method')


def _add_startup_args(p: argparse.ArgumentParser) -> None:
    """Caches a start reuses, the warm-up, and the weights' and KV pages' form and place."""
    p.add_argument("--compilation-cache", default=DEFAULT_CACHE,
                   help="JAX persistent compilation cache dir ('' to disable)")
    # (the config's own "~/..." default: a process that chose another default keeps it)
    p.add_argument("--weight-cache", default=DEFAULT_WEIGHT_CACHE,
                   help="dir of the prepared weights a later start maps instead of converting "
                        "the checkpoint again ('' to disable)")
    p.add_argument("--warmup", choices=["full", "background", "lazy"], default=None,
                   help="when step shapes compile: all before starting (full), those a first "
                        "request needs then the rest in the background (serve's default), or "
                        "the rest when first needed (lazy, generate's default)")
    p.add_argument("--quantization", choices=["int8", "int4"], default=None,
                   help="weight-only quantization of every matmul weight at load time: int8 per output "
                        "channel; int4 on CPU as GGUF's Q4_1 (per 32 rows, the LM head int8), elsewhere "
                        "symmetric per group")
    p.add_argument("--kv-cache-dtype", choices=["auto", "model", "int8"], default="auto",
                   help="KV pages: int8 with a scale per token and head, or the model's dtype "
                        "(model); auto: int8 when --quantization is set and no --speculative-method, "
                        "else the model's dtype")
    p.add_argument("--offload-weights", choices=["none", "host"], default="none",
                   help="host: layers whose weights exceed --device-weight-memory stay in host memory "
                        "and are streamed to the device a layer ahead of use")
    p.add_argument("--device-weight-memory", type=byte_size, default=None, metavar="BYTES",
                   help="device budget for resident weights with --offload-weights host, e.g. 2G")


def _add_lora_args(p: argparse.ArgumentParser) -> None:
    """LoRA adapters."""
    g = p.add_argument_group("LoRA adapters")
    g.add_argument("--enable-lora", action="store_true",
                   help="serve PEFT LoRA adapters beside the base model (implied by --lora-modules)")
    g.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH", type=lora_module,
                   help="adapters to load at start: a request picks one with model=NAME (OpenAI) "
                        "or adapter_id=NAME (TGI)")
    g.add_argument("--max-loras", type=int, default=4, help="adapters one step can mix (device slots)")
    g.add_argument("--max-lora-rank", type=int, default=16, help="the largest adapter rank (<= 64)")
    g.add_argument("--max-cpu-loras", type=int, default=None,
                   help="adapters loaded at once, in host memory (default: 4 x --max-loras)")


def _add_parallel_args(p: argparse.ArgumentParser) -> None:
    """Tensor, data and pipeline parallelism; multi-host."""
    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-parallel-size", "-tp", type=tp_size, default=None,
                   help="devices one model is split over (Megatron-style, within a replica); "
                        "'auto': the largest size the model allows on the visible devices "
                        "(default: 1, or auto with --coordinator)")
    g.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                   help="independent replicas (each its own scheduler and KV cache)")
    g.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1,
                   help="pipeline stages the layers are cut into (each on tensor-parallel-size "
                        "devices); a step's sequences flow through them in micro-batches")
    g.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                   help="multi-host: jax.distributed coordinator (process 0's address)")
    g.add_argument("--num-processes", type=int, default=None, help="multi-host: number of processes")
    g.add_argument("--process-id", type=int, default=None,
                   help="multi-host: this process's index (0 schedules and serves HTTP)")


_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def byte_size(s: str) -> int:
    """Bytes: an integer, or one with a K/M/G/T suffix (powers of 1024; "KiB"/"KB" read alike)."""
    t = s.strip().lower().removesuffix("ib").removesuffix("b")
    num, unit = (t[:-1], t[-1]) if t and t[-1] in _UNITS else (t, "")
    try:
        v = float(num) * _UNITS[unit]
    except ValueError:
        v = 0
    if not 1 <= v < 1 << 50:
        raise argparse.ArgumentTypeError(f"expected a size in bytes such as 536870912, 512M or 2G, got {s!r}")
    return int(v)


def lora_module(s: str) -> tuple[str, str]:
    """--lora-modules NAME=PATH -> (name, path)."""
    name, sep, path = s.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {s!r}")
    return name, path


def tp_size(s: str) -> int:
    if s == "auto":
        return 0
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer or 'auto', got {s!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer or 'auto', got {s!r}")
    return v


def init_distributed(args: argparse.Namespace) -> None:
    """Join a multi-process run (one process per host) when --coordinator is given."""
    if not getattr(args, "coordinator", None):
        if getattr(args, "num_processes", None) or getattr(args, "process_id", None) is not None:
            raise ValueError("--num-processes / --process-id need --coordinator HOST:PORT")
        return
    if args.num_processes is None or args.process_id is None:
        raise ValueError("--coordinator needs --num-processes and --process-id")
    if not 0 <= args.process_id < args.num_processes:
        raise ValueError(f"--process-id {args.process_id} must be in [0, {args.num_processes})")
    import jax

    # CPU hosts need a collectives implementation across processes; GPU/TPU bring their own.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(args.coordinator, num_processes=args.num_processes,
                               process_id=args.process_id)


def engine_config(args: argparse.Namespace, default_max_seqs: int, default_warmup: str = "full"):
    from jaxinfer.engine_config import EngineConfig

    return EngineConfig(
        dtype=args.dtype, page_size=args.page_size, kv_cache_memory=args.kv_cache_memory,
        max_num_seqs=args.max_num_seqs or default_max_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        max_waiting=args.max_waiting, enable_prefix_caching=args.enable_prefix_caching,
        max_queue_delay_ms=args.max_queue_delay_ms, scheduling_policy=args.scheduling_policy,
        host_kv_cache_memory=args.host_kv_cache_memory,
        num_scheduler_steps=args.num_scheduler_steps, async_scheduling=args.async_scheduling, warmup=getattr(args, "warmup", None) or default_warmup,
        compilation_cache_dir=args.compilation_cache or None, weight_cache_dir=args.weight_cache or None,
        tensor_parallel_size=(args.tensor_parallel_size if args.tensor_parallel_size is not None
                              else 0 if args.coordinator else 1),
        data_parallel_size=args.data_parallel_size, quantization=args.quantization,
        pipeline_parallel_size=args.pipeline_parallel_size, offload_weights=args.offload_weights,
        device_weight_memory=args.device_weight_memory,
        kv_cache_dtype=args.kv_cache_dtype,
        enable_prompt_logprobs=args.enable_prompt_logprobs, min_sampler_rows=args.min_sampler_rows,
        layer_loop=args.layer_loop, weight_codes=args.weight_codes,
        **speculative_options(args),
        **lora_options(args))


def lora_options(args: argparse.Namespace) -> dict:
    return dict(enable_lora=args.enable_lora, lora_modules=tuple(args.lora_modules), max_loras=args.max_loras,
                max_lora_rank=args.max_lora_rank, max_cpu_loras=args.max_cpu_loras)


def speculative_options(args: argparse.Namespace) -> dict:
    names = ("speculative_method", "num_speculative_tokens", "ngram_prompt_lookup_max",
             "ngram_prompt_lookup_min", "speculative_disable_by_batch_size", "speculative_model",
             "speculative_quantization", "speculative_draft_layers", "speculative_tree_width")
    out = {n: getattr(args, n) for n in names if hasattr(args, n)}
    if out.get("speculative_quantization") == "none":
        out["speculative_quantization"] = None
    text = getattr(args, "speculative_config", None)
    if text:
        if out.get("speculative_method"):
            raise ValueError("--speculative-config and --speculative-method: give one of them "
                             "(the config names its method)")
        try:
            spec = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--speculative-config: not valid JSON ({e.msg})") from None
        out.update(speculative_fields(spec))
    return out


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--presence-penalty", type=float, default=0.0)
    p.add_argument("--frequency-penalty", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")


def sampling_params(args: argparse.Namespace):
    from jaxinfer.sampling_params import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
        seed=args.seed, stop=tuple(args.stop), ignore_eos=args.ignore_eos)
