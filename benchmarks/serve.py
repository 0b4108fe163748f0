"""Serving benchmark, in the manner of ``vllm bench serve``.

The MT-Bench prompts and the rate sweep of ``jaxinfer bench serve`` (whose load generator
and report this calls: ``jaxinfer/bench/``). Sends streamed requests to an
OpenAI-compatible server (jaxinfer serve, or any other) and reports time to first token (TTFT), time per output token (TPOT), inter-token
latency (ITL) and end-to-end latency (mean / median / p99), plus request and token
throughput.

Arrivals are Poisson at ``--request-rate`` requests/s (``inf``: all at once), optionally
capped at ``--max-concurrency`` requests in flight. Prompts are the first turns of
MT-Bench (``../shared/data/mt_bench_questions.jsonl`` from the repo root, or
``--dataset``); synthetic prompts if that file is missing. Output length is fixed with
``--max-tokens`` and ``--ignore-eos`` (on by default) so that runs are comparable.

    python benchmarks/serve.py --base-url http://127.0.0.1:8000 --num-prompts 200 --request-rate 4
    python benchmarks/serve.py --max-concurrency 16 --num-prompts 200 --output-json run.json
    python benchmarks/serve.py --sweep-rates 1,2,4,8 --output-json sweep.json   # + sweep.png

Definitions (as vLLM's): TTFT = first streamed text - request sent; ITL = gaps between
successive streamed chunks; TPOT = (latency - TTFT) / (output tokens - 1) per request;
output tokens are the server's ``usage.completion_tokens`` (``stream_options.include_usage``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:          # `python benchmarks/serve.py` from the repo root
    sys.path.insert(0, REPO)

from jaxinfer.bench import report  # noqa: E402
from jaxinfer.bench import serve as bench_serve  # noqa: E402
from jaxinfer.bench.datasets import BenchRequest  # noqa: E402

DEFAULT_DATASET = os.path.join(REPO, "..", "shared", "data", "mt_bench_questions.jsonl")


# ---------------------------------------------------------------------- prompts

def load_prompts(path: str | None, n: int, seed: int) -> tuple[list[str], str]:
    """``n`` prompts (cycling through the data set if it is smaller), and where they came from."""
    prompts: list[str] = []
    source = "synthetic"
    if path and os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            for line in f:
                line = line.strip()
                if line:
                    turns = json.loads(line).get("turns") or []
                    if turns and isinstance(turns[0], str):
                        prompts.append(turns[0])
        source = os.path.relpath(path, REPO)
    if not prompts:
        if path:
            print(f"note: no prompts in {path!r}; using synthetic prompts", file=sys.stderr)
        topics = ["the sea", "a robot", "compilers", "the moon", "bread", "trains", "chess", "rain"]
        prompts = [f"Write a short essay about {topics[i % len(topics)]} (variant {i})." for i in range(64)]
    rng = random.Random(seed)
    order = list(range(len(prompts)))
    rng.shuffle(order)
    return [prompts[order[i % len(order)]] for i in range(n)], source


# ---------------------------------------------------------------------- one run

async def run_benchmark(args: argparse.Namespace, prompts: list[str], rate: float) -> dict:
    """One run at ``rate``, by ``jaxinfer bench serve``'s load generator and report."""
    reqs = [BenchRequest(p, args.max_tokens) for p in prompts]
    results, duration, args.model = await bench_serve.run(
        args.base_url, reqs, model=args.model, endpoint=args.endpoint, rate=rate,
        max_concurrency=args.max_concurrency, ignore_eos=args.ignore_eos, temperature=args.temperature,
        seed=args.seed, api_key=args.api_key, timeout=args.timeout, warmup=args.warmup)
    s = report.summarize(results, duration, percentiles=(99,))
    s.update(request_rate="inf" if not math.isfinite(rate) else rate, max_concurrency=args.max_concurrency,
             num_prompts=len(results))
    return s


def print_summary(s: dict) -> None:
    print(report.format_table(s, f"request rate {s['request_rate']}, max concurrency "
                                 f"{s['max_concurrency'] or 'none'}"))


# ---------------------------------------------------------------------- plot

def plot_sweep(summaries: list[dict], path: str) -> bool:
    """Latency percentiles and throughput against request rate; False if matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: matplotlib is not installed (pip install matplotlib); skipping the plot", file=sys.stderr)
        return False
    rates = [s["request_rate"] if s["request_rate"] != "inf" else float("nan") for s in summaries]
    finite = [r for r in rates if math.isfinite(r) and r > 0]
    fig, axes = plt.subplots(1, 4, figsize=(18, 4))
    if finite and max(finite) / min(finite) >= 4:     # doubling sweeps read best on a log axis
        for ax in axes:
            ax.set_xscale("log", base=2)
    for ax, key, title in zip(axes, ("ttft_ms", "tpot_ms", "itl_ms"), ("TTFT", "TPOT", "ITL")):
        for stat, style in (("median", "o-"), ("p99", "s--")):
            ax.plot(rates, [s[key][stat] if s[key][stat] is not None else float("nan") for s in summaries],
                    style, label=stat)
        ax.set_title(f"{title} (ms)")
        ax.set_xlabel("request rate (req/s)")
        ax.grid(True, alpha=0.3)
        ax.legend()
    ax = axes[3]
    ax.plot(rates, [s["output_throughput"] for s in summaries], "o-", label="output tok/s")
    ax.set_title("output throughput (tok/s)")
    ax.set_xlabel("request rate (req/s)")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# ---------------------------------------------------------------------- CLI

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (without /v1)")
    p.add_argument("--model", default=None, help="model name to send (default: the first of /v1/models)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--endpoint", choices=["chat", "completions"], default="chat",
                   help="/v1/chat/completions (default, MT-Bench questions via the chat template) "
                        "or /v1/completions (raw prompt)")
    p.add_argument("--dataset", default=DEFAULT_DATASET,
                   help="MT-Bench questions .jsonl (default: ../shared/data/mt_bench_questions.jsonl); "
                        "synthetic prompts if missing")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="Poisson arrival rate in requests/s; inf (default) sends all at once")
    p.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    p.add_argument("--sweep-rates", default=None,
                   help="comma-separated request rates (e.g. 1,2,4): one run each, JSON + PNG plot")
    p.add_argument("--max-tokens", type=int, default=128, help="output tokens per request")
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="let requests stop at EOS (default: generate exactly --max-tokens)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0, help="seeds prompt order and arrival times")
    p.add_argument("--warmup", type=int, default=1, help="requests sent (and not counted) before timing")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout in seconds")
    p.add_argument("--output-json", default=None, help="write the summary (or sweep) here")
    p.add_argument("--plot", default=None, help="PNG for --sweep-rates (default: the JSON path with .png)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.num_prompts < 1 or args.max_tokens < 1:
        raise SystemExit("--num-prompts and --max-tokens must be >= 1")
    prompts, source = load_prompts(args.dataset, args.num_prompts, args.seed)
    rates = ([float(x) for x in args.sweep_rates.split(",") if x.strip()] if args.sweep_rates
             else [args.request_rate])
    config = {k: v for k, v in vars(args).items() if k not in ("api_key",)}
    config["dataset"] = source
    config["request_rate"] = args.request_rate if math.isfinite(args.request_rate) else "inf"
    summaries = []
    for rate in rates:
        s = asyncio.run(run_benchmark(args, prompts, rate))
        config["model"] = args.model
        print_summary(s)
        summaries.append(s)
    report: dict[str, Any] = {"config": config, "results": summaries}
    if args.sweep_rates:
        json_path = args.output_json or "serve_sweep.json"
        plot_path = args.plot or os.path.splitext(json_path)[0] + ".png"
        if plot_sweep(summaries, plot_path):
            report["plot"] = plot_path
            print(f"plot: {plot_path}")
    else:
        json_path = args.output_json
    if json_path:
        with open(json_path, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
        print(f"results: {json_path}")
    return 0 if all(s["failed"] == 0 for s in summaries) else 1


if __name__ == "__main__":
    sys.exit(main())
