"""``jaxinfer`` command line: generate, convert, serve, bench, watermark-detect.

The outermost front door, so it lives with the server it starts (serving -> jaxinfer).

Config is read once (flags -> EngineConfig / SamplingParams, jaxinfer/engine_args.py). The environment
variables jaxinfer itself reads are these four (tests/test_readme.py checks the list):
``$JAXINFER_API_KEY`` (here: the ``serve`` key when no flag gives one); in
pallas_kernels/cpu_build.py, ``$CXX`` (the compiler for the C++ CPU kernels, default g++)
and ``$JAXINFER_KERNEL_CACHE`` (where built kernels are kept, default
~/.cache/jaxinfer/kernels): how the kernels are built, not how the engine runs; in
jaxinfer/loading/weight_cache.py, ``$JAXINFER_WEIGHT_CACHE`` (where the default weight cache
is, default ~/.cache/jaxinfer/weights; how tests hand theirs to the processes they start).
Nothing else below the CLI reads the environment (the libraries read their own: XLA_FLAGS,
JAX_*).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from typing import Any

from jaxinfer.engine_args import (add_engine_args, add_model_args, add_sampling_args, engine_config,
                                  init_distributed, sampling_params)
from jaxinfer.sampling_params import DEFAULT_GAMMA


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


def cmd_watermark_detect(args: argparse.Namespace) -> int:
    """Kirchenbauer et al.'s z-test on a text (jaxinfer/engine/watermark.py): the z-score
    and p-value on stdout (JSON with --json)."""
    import json

    from jaxinfer.engine.watermark import detect_text
    from jaxinfer.loading import load_tokenizer

    if args.text is not None and args.file is not None:
        raise ValueError("text: give it as an argument or with --file, not both")
    if args.file is not None:
        with open(args.file, encoding="utf-8") as f:
            text = f.read()
    else:
        text = args.text if args.text is not None else sys.stdin.read()
    d = detect_text(text, load_tokenizer(args.model), args.gamma,
                    ignore_repeated_bigrams=not args.count_repeated_bigrams)
    if args.json:
        print(json.dumps(d.as_dict()))
    else:
        print(f"z-score {d.z_score:.3f}  p-value {d.p_value:.3g}  "
              f"({d.num_green} of {d.num_scored} scored tokens green, gamma {args.gamma})")
    return 0


def _bench_app(engine: Any) -> Any:
    """``jaxinfer bench serve`` without --base-url: this server's app over ``engine``."""
    from jaxinfer.engine.async_engine import AsyncEngine
    from serving.app import build_app

    return build_app(AsyncEngine(engine))


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

    w = sub.add_parser("watermark-detect", help="z-score and p-value of a text for the watermark "
                                                "(`watermark: true` requests)")
    w.add_argument("text", nargs="?", default=None, help="the text (default: stdin)")
    w.add_argument("--file", default=None, help="read the text from this file")
    add_model_args(w)
    w.add_argument("--gamma", type=float, default=DEFAULT_GAMMA,
                   help="the green-list fraction it was generated with (default: %(default)s, the engine's)")
    w.add_argument("--count-repeated-bigrams", action="store_true",
                   help="score every token, not each (previous, token) pair once")
    w.add_argument("--json", action="store_true", help="print the result as JSON")
    w.set_defaults(func=cmd_watermark_detect)

    from jaxinfer.bench.cli import add_bench_parser

    add_bench_parser(sub, add_engine_args, make_app=_bench_app)
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
