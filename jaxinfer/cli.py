"""``jaxinfer`` command line: generate, convert, serve, bench.

Config is read here once (flags -> EngineConfig / SamplingParams). The environment
variables jaxinfer itself reads are these three (tests/test_readme.py checks the list):
``$JAXINFER_API_KEY`` (here: the ``serve`` key when no flag gives one), and, in
pallas_kernels/cpu_build.py, ``$CXX`` (the compiler for the C++ CPU kernels, default g++)
and ``$JAXINFER_KERNEL_CACHE`` (where built kernels are kept, default
~/.cache/jaxinfer/kernels): how the kernels are built, not how the engine runs. Nothing
else below the CLI reads the environment (the libraries read their own: XLA_FLAGS, JAX_*).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from typing import Any

DEFAULT_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "jaxinfer", "xla")


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="HF checkpoint dir, .gguf file or `jaxinfer convert` output "
                        "(default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])


def add_engine_args(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    p.add_argument("--max-num-seqs", type=int, default=None, help="sequences per step")
    p.add_argument("--max-num-batched-tokens", type=int, default=512, help="tokens per step")
    p.add_argument("--max-model-len", type=int, default=None, help="prompt + output tokens")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--kv-cache-memory", type=_byte_size, default=None, metavar="BYTES",
                   help="KV cache size, e.g. 536870912, 512M or 2G (default: what max-num-seqs "
                        "sequences of max-model-len tokens need, up to 1 GiB on CPU)")
    p.add_argument("--max-waiting", type=int, default=4096, help="waiting sequences before 503")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV of earlier requests' identical prefixes (on by default)")
    p.add_argument("--host-kv-cache-memory", type=int, default=None, metavar="BYTES",
                   help="host RAM for prefix-cache pages evicted from the device (0 = off; "
                        "default: off on CPU, 10%% of RAM on accelerators)")
    p.add_argument("--num-scheduler-steps", type=int, default=1,
                   help="multi-step decode: up to this many decode steps per device call while "
                        "nothing waits for a prefill (single device; outputs stream in runs)")
    g = p.add_argument_group("speculative decoding")
    g.add_argument("--speculative-method", choices=["ngram"], default=None,
                   help="propose tokens and verify them in one step: ngram = prompt lookup "
                        "(greedy and seeded outputs unchanged)")
    g.add_argument("--num-speculative-tokens", type=int, default=7, help="tokens proposed per step")
    g.add_argument("--ngram-prompt-lookup-max", type=int, default=4, help="longest n-gram matched")
    g.add_argument("--ngram-prompt-lookup-min", type=int, default=2, help="shortest n-gram matched")
    g.add_argument("--speculative-disable-by-batch-size", type=int, default=2,
                   help="no speculation while more sequences than this run")
    p.add_argument("--compilation-cache", default=DEFAULT_CACHE,
                   help="JAX persistent compilation cache dir ('' to disable)")
    p.add_argument("--warmup", choices=["full", "background", "lazy"], default=None,
                   help="when step shapes compile: all before starting (full), those a first "
                        "request needs then the rest in the background (serve's default), or "
                        "the rest when first needed (lazy, generate's default)")
    p.add_argument("--quantization", choices=["int8", "int4"], default=None,
                   help="weight-only quantization of every matmul weight at load time")
    p.add_argument("--kv-cache-dtype", choices=["auto", "int8"], default="auto",
                   help="KV pages: the model's dtype (auto) or int8 with a scale per token and head")
    p.add_argument("--offload-weights", choices=["none", "host"], default="none",
                   help="host: layers whose weights exceed --device-weight-memory stay in host memory "
                        "and are streamed to the device a layer ahead of use")
    p.add_argument("--device-weight-memory", type=_byte_size, default=None, metavar="BYTES",
                   help="device budget for resident weights with --offload-weights host, e.g. 2G")
    g = p.add_argument_group("LoRA adapters")
    g.add_argument("--enable-lora", action="store_true",
                   help="serve PEFT LoRA adapters beside the base model (implied by --lora-modules)")
    g.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH", type=_lora_module,
                   help="adapters to load at start: a request picks one with model=NAME (OpenAI) "
                        "or adapter_id=NAME (TGI)")
    g.add_argument("--max-loras", type=int, default=4, help="adapters one step can mix (device slots)")
    g.add_argument("--max-lora-rank", type=int, default=16, help="the largest adapter rank (<= 64)")
    g.add_argument("--max-cpu-loras", type=int, default=None,
                   help="adapters loaded at once, in host memory (default: 4 x --max-loras)")
    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-parallel-size", "-tp", type=_tp_size, default=None,
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


def _byte_size(s: str) -> int:
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


def _lora_module(s: str) -> tuple[str, str]:
    name, sep, path = s.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {s!r}")
    return name, path


def _tp_size(s: str) -> int:
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
    from jaxinfer.config import EngineConfig

    return EngineConfig(
        dtype=args.dtype, page_size=args.page_size, kv_cache_memory=args.kv_cache_memory,
        max_num_seqs=args.max_num_seqs or default_max_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
        max_waiting=args.max_waiting, enable_prefix_caching=args.enable_prefix_caching,
        host_kv_cache_memory=args.host_kv_cache_memory,
        num_scheduler_steps=args.num_scheduler_steps, warmup=getattr(args, "warmup", None) or default_warmup,
        compilation_cache_dir=args.compilation_cache or None,
        tensor_parallel_size=(args.tensor_parallel_size if args.tensor_parallel_size is not None
                              else 0 if args.coordinator else 1),
        data_parallel_size=args.data_parallel_size, quantization=args.quantization,
        pipeline_parallel_size=args.pipeline_parallel_size, offload_weights=args.offload_weights,
        device_weight_memory=args.device_weight_memory,
        kv_cache_dtype=None if args.kv_cache_dtype == "auto" else args.kv_cache_dtype,
        **speculative_options(args), **lora_options(args))


def speculative_options(args: argparse.Namespace) -> dict:
    names = ("speculative_method", "num_speculative_tokens", "ngram_prompt_lookup_max",
             "ngram_prompt_lookup_min", "speculative_disable_by_batch_size")
    return {n: getattr(args, n) for n in names if hasattr(args, n)}


def lora_options(args: argparse.Namespace) -> dict:
    if not hasattr(args, "lora_modules"):
        return {}
    return dict(enable_lora=args.enable_lora, lora_modules=tuple(args.lora_modules), max_loras=args.max_loras,
                max_lora_rank=args.max_lora_rank, max_cpu_loras=args.max_cpu_loras)


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
    from jaxinfer.config import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
        seed=args.seed, stop=tuple(args.stop), ignore_eos=args.ignore_eos)


def cmd_generate(args: argparse.Namespace) -> int:
    from jaxinfer.engine.engine import Engine

    params = sampling_params(args)
    prompt: Any = args.prompt if args.prompt is not None else sys.stdin.read()
    if not prompt.strip():
        raise ValueError("prompt: empty (pass it as an argument or on stdin)")
    if args.chat:
        prompt = [{"role": "user", "content": prompt}]
    init_distributed(args)
    t0 = time.perf_counter()
    print("loading model and compiling buckets ...", file=sys.stderr)
    engine = Engine(args.model, config=engine_config(args, default_max_seqs=1, default_warmup="lazy"),
                    progress=True)
    if engine.is_follower:
        engine.follow()
        return 0
    print(f"ready in {time.perf_counter() - t0:.1f}s (load {engine.loaded.load_seconds:.1f}s, "
          f"compile {engine.compile_seconds:.1f}s)", file=sys.stderr)
    rid = engine.add_request(prompt, params, lora=args.lora)
    printed = 0
    t1 = time.perf_counter()
    final = None
    while final is None:
        for out in engine.step():
            text = out.outputs[0].text
            sys.stdout.write(text[printed:])
            sys.stdout.flush()
            printed = len(text)
            if out.finished and out.request_id == rid:
                final = out
    dt = time.perf_counter() - t1
    engine.shutdown()
    n = len(final.outputs[0].token_ids)
    sys.stdout.write("\n")
    print(f"[{n} tokens in {dt:.2f}s, {n / dt:.1f} tok/s, finish_reason={final.outputs[0].finish_reason}]",
          file=sys.stderr)
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    from jaxinfer.loading import checkpoint, load_model

    t0 = time.perf_counter()
    loaded = load_model(args.model, args.dtype)
    out = checkpoint.save(loaded, args.output)
    print(f"converted {loaded.source} -> {out} in {time.perf_counter() - t0:.1f}s "
          f"(load it with --model {out})")
    return 0


def resolve_api_key(args: argparse.Namespace, environ: dict[str, str]) -> str | None:
    """The serve API key: --api-key, else --api-key-file, else $JAXINFER_API_KEY (as vLLM reads
    $VLLM_API_KEY), else None. A file or the environment keeps the key out of `ps`."""
    if args.api_key and args.api_key_file:
        raise ValueError("--api-key and --api-key-file: give one of them")
    if args.api_key_file:
        with open(args.api_key_file, encoding="utf-8") as f:
            key = f.readline().strip()
        if not key:
            raise ValueError(f"--api-key-file {args.api_key_file}: the first line is empty")
        if os.stat(args.api_key_file).st_mode & 0o077:
            logging.getLogger("jaxinfer").warning("--api-key-file %s is readable by other users "
                                                  "(chmod 600 it)", args.api_key_file)
        return key
    return args.api_key or environ.get("JAXINFER_API_KEY") or None


def cmd_serve(args: argparse.Namespace) -> int:
    from serving.server import serve_main

    args.api_key = resolve_api_key(args, os.environ)
    init_distributed(args)
    import jax

    if jax.process_count() > 1 and jax.process_index() != 0:
        # Only process 0 serves HTTP; the others replay its steps until it stops.
        from jaxinfer.engine.engine import Engine

        engine = Engine(args.model, config=engine_config(args, default_max_seqs=_serve_max_seqs()),
                        progress=False)
        print(f"jaxinfer: process {jax.process_index()} following process 0", file=sys.stderr, flush=True)
        engine.follow()
        return 0
    return serve_main(args)


def _serve_max_seqs() -> int:
    from serving.server import DEFAULT_SERVE_MAX_SEQS

    return DEFAULT_SERVE_MAX_SEQS


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxinfer", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text from a prompt, streamed to the terminal")
    g.add_argument("prompt", nargs="?", default=None, help="the prompt (default: stdin)")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    g.add_argument("--lora", default=None, metavar="NAME",
                   help="generate with this adapter (one of --lora-modules)")
    add_engine_args(g)
    add_sampling_args(g)
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("convert", help="convert a checkpoint to an orbax dir (fast restarts)")
    add_model_args(c)
    c.add_argument("--output", required=True, help="output directory")
    c.set_defaults(func=cmd_convert)

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_engine_args(s)
    try:
        from serving.server import add_serve_args
        add_serve_args(s)
    except ImportError:   # serving extras missing: the subcommand explains at run time
        pass
    s.set_defaults(func=cmd_serve)

    from jaxinfer.bench.cli import add_bench_parser

    add_bench_parser(sub, add_engine_args)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
