"""The ``jaxinfer bench`` subcommands (argparse only; the work is imported when run).

    jaxinfer bench throughput --dataset-name random --num-prompts 64 --input-len 128 --output-len 64
    jaxinfer bench latency --batch-size 8 --input-len 32 --output-len 128 --num-iters 5
    jaxinfer bench serve --base-url http://127.0.0.1:8000 --request-rate 4 --num-prompts 200 \\
        --dataset-name sharegpt --dataset-path ShareGPT_V3.json --goodput ttft:500 tpot:50
    jaxinfer bench serve --request-rate inf --max-concurrency 8       # starts its own server

Each prints a table, and writes ``--result-dir/<name>.json`` plus two plots
(``<name>_latency_cdf.png``, ``<name>_tokens_per_s.png``) when ``--result-dir`` is given.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import platform
import sys
from typing import Any


def add_bench_parser(sub: Any, add_engine_args: Any, make_app: Any = None) -> None:
    """``make_app(engine)``: the ASGI app ``bench serve`` starts when given no --base-url
    (the caller's server; this package does not import serving)."""
    b = sub.add_parser("bench", help="benchmark: throughput | latency (in-process) | serve (HTTP)")
    bsub = b.add_subparsers(dest="bench_command", required=True)
    for name, doc in (("throughput", "offline throughput: every request queued at once"),
                      ("latency", "batch latency: --batch-size requests, --num-iters times"),
                      ("serve", "load a server (--base-url, or one started here) at a request rate")):
        p = bsub.add_parser(name, help=doc, description=doc)
        _add_common(p)
        if name == "latency":
            p.add_argument("--batch-size", type=int, default=8)
            p.add_argument("--num-iters", type=int, default=5)
            p.add_argument("--num-iters-warmup", type=int, default=1)
        if name == "serve":
            _add_serve(p)
        add_engine_args(p)      # the engine (serve: only when it starts its own server)
        p.set_defaults(func=run, bench_command=name, make_app=make_app)


def _add_common(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("requests")
    g.add_argument("--dataset-name", choices=["random", "jsonl", "sharegpt", "workload"], default="random")
    g.add_argument("--dataset-path", default=None, help="the dataset file (not for random)")
    g.add_argument("--num-prompts", type=int, default=64)
    g.add_argument("--input-len", type=int, default=128, help="random: mean prompt tokens")
    g.add_argument("--output-len", type=int, default=128,
                   help="tokens to generate (random: mean; jsonl: unless a row says output_len)")
    g.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="random: lengths uniform in len * [1 - r, 1 + r] (default 0: fixed)")
    g.add_argument("--sharegpt-output-len", type=int, default=None,
                   help="sharegpt: fixed output length (default: from the reply's length)")
    g.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="let requests stop at EOS (default: generate exactly the output length)")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=0, help="seeds the prompts, their order and arrivals")
    r = p.add_argument_group("report")
    r.add_argument("--percentiles", default="50,90,99", help="latency percentiles (default 50,90,99)")
    r.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                   help="SLOs for goodput, e.g. ttft:500 tpot:50 (keys ttft, tpot, e2e; milliseconds)")
    r.add_argument("--result-dir", default=None, help="write <name>.json and PNG plots here")
    r.add_argument("--result-name", default=None, help="file name stem (default: bench-<command>-<time>)")


def _add_serve(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("load")
    g.add_argument("--base-url", default=None,
                   help="server root, e.g. http://127.0.0.1:8000 (default: start one here from the engine flags)")
    g.add_argument("--served-model", default=None, help="model name to send (default: the first of /v1/models)")
    g.add_argument("--api-key", default=None)
    g.add_argument("--endpoint", choices=["chat", "completions"], default="chat",
                   help="text prompts: /v1/chat/completions (default) or /v1/completions")
    g.add_argument("--request-rate", type=float, default=float("inf"),
                   help="Poisson arrivals in requests/s (default inf: all at once)")
    g.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    g.add_argument("--num-warmups", type=int, default=1, help="requests sent and not counted before timing")
    g.add_argument("--timeout", type=float, default=600.0, help="per-request timeout (s)")


def _percentiles(text: str) -> list[float]:
    try:
        ps = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        ps = []
    if not ps or not all(0 < p < 100 for p in ps):
        raise ValueError(f"--percentiles: expected comma-separated numbers in (0, 100), got {text!r}")
    return ps


def _build_engine(args: argparse.Namespace, max_seqs: int) -> Any:
    from jaxinfer.engine_args import engine_config
    from jaxinfer.engine.engine import Engine

    print("bench: loading the model and compiling ...", file=sys.stderr, flush=True)
    return Engine(args.model, config=engine_config(args, default_max_seqs=max_seqs), progress=True)


def run(args: argparse.Namespace) -> int:
    from jaxinfer.bench import datasets, report

    percentiles = _percentiles(args.percentiles)
    slo = report.parse_slo(args.goodput)
    remote = args.bench_command == "serve" and args.base_url
    engine = None if remote else _build_engine(
        args, max_seqs=args.batch_size if args.bench_command == "latency" else 32)
    vocab = None if engine is None else engine.loaded.config.vocab_size
    requests = datasets.load_requests(
        args.dataset_name, args.dataset_path, args.num_prompts, input_len=args.input_len,
        output_len=args.output_len, spread=args.random_range_ratio, seed=args.seed, vocab_size=vocab,
        sharegpt_output_len=args.sharegpt_output_len)
    extra: dict[str, Any] = {}
    if args.bench_command == "serve":
        results, duration, model = _run_serve(args, engine, requests)
    else:
        from jaxinfer.bench import offline
        from jaxinfer.sampling_params import SamplingParams

        def params_for(req: datasets.BenchRequest) -> SamplingParams:
            return SamplingParams(max_tokens=req.output_len, temperature=args.temperature,
                                  ignore_eos=args.ignore_eos, seed=args.seed if args.temperature else None)

        model = engine.model_name
        if args.bench_command == "throughput":
            results, duration = offline.throughput(engine, requests, params_for)
        else:
            results, duration, iters = offline.latency(engine, requests, params_for, args.batch_size,
                                                       args.num_iters, args.num_iters_warmup)
            extra["batch_latency_ms"] = report._stats(iters, percentiles)
            extra["batch_latencies_s"] = iters
    summary = report.summarize(results, duration, percentiles=percentiles, slo=slo)
    summary.update(extra)
    title = f"jaxinfer bench {args.bench_command} ({model})"
    print(report.format_table(summary, title))
    if "batch_latency_ms" in extra:
        print("batch latency (ms): " + "  ".join(f"{k} {v:.1f}" for k, v in extra["batch_latency_ms"].items()))
    if args.result_dir:
        _write(args, summary, results, model, title)
    return 0 if summary["failed"] == 0 else 1


def _run_serve(args: argparse.Namespace, engine: Any, requests: list) -> tuple[list, float, str]:
    from jaxinfer.bench import serve

    kw = dict(model=args.served_model, endpoint=args.endpoint, rate=args.request_rate,
              max_concurrency=args.max_concurrency, ignore_eos=args.ignore_eos, temperature=args.temperature,
              seed=args.seed, api_key=args.api_key, timeout=args.timeout, warmup=args.num_warmups)
    if args.base_url:
        return asyncio.run(serve.run(args.base_url.rstrip("/"), requests, **kw))
    if args.make_app is None:
        raise ValueError("bench serve: --base-url is required (no server to start here)")
    with serve.serve_app_in_thread(args.make_app(engine)) as url:
        return asyncio.run(serve.run(url, requests, **kw))


def _write(args: argparse.Namespace, summary: dict, results: list, model: str, title: str) -> None:
    from jaxinfer.bench import report

    os.makedirs(args.result_dir, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    stem = args.result_name or f"bench-{args.bench_command}-{now:%Y%m%d-%H%M%S}"
    prefix = os.path.join(args.result_dir, stem)
    config = {k: v for k, v in vars(args).items() if k not in ("func", "api_key", "make_app")}
    config["request_rate"] = str(config.get("request_rate", ""))
    body = {"command": args.bench_command, "model": model, "date_utc": now.isoformat(timespec="seconds"),
            "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
            "config": config, "summary": summary}
    plots = report.plot(results, summary, prefix, title)
    body["plots"] = plots
    report.write_json(prefix + ".json", body, results)
    print(f"results: {prefix}.json" + (f"; plots: {', '.join(plots)}" if plots else ""))
