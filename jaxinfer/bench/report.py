"""Per-request results -> the summary (percentiles, throughput, goodput), its table, JSON
and plots. Definitions are vLLM's: TTFT = first token - request sent; ITL = the gaps
between successive token arrivals (a run of k tokens arriving together counts as k gaps
of 1/k of the wait); TPOT = (E2E - TTFT) / (output tokens - 1) per request; goodput =
requests/s that met every SLO given (``--goodput ttft:500 tpot:50``, milliseconds)."""

from __future__ import annotations

import json
import math
import statistics
import sys
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

SLO_KEYS = ("ttft", "tpot", "e2e")


@dataclass
class RequestResult:
    ok: bool
    start: float = 0.0                   # seconds since the run began
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0                    # seconds
    latency: float = 0.0                 # end to end
    itl: list[float] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)    # since the run began, one per token
    error: str = ""

    @property
    def tpot(self) -> float | None:
        return (self.latency - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


class TokenClock:
    """Turns token-count updates of one request into TTFT, ITL and per-token times."""

    def __init__(self, result: RequestResult, sent: float, run_start: float) -> None:
        self.r, self.sent, self.run_start = result, sent, run_start
        self.count, self.last = 0, None

    def tokens(self, total: int, now: float) -> None:
        k = total - self.count
        if k <= 0:
            return
        if self.last is None:
            self.r.ttft = now - self.sent
            # tokens that came with the first: no gap after it, but still one ITL each,
            # so every request has output_tokens - 1 of them however the stream chunks
            self.r.itl.extend([0.0] * (k - 1))
        else:       # k tokens arrived together: k gaps, each a k-th of the wait
            self.r.itl.extend([(now - self.last) / k] * k)
        self.r.token_times.extend([now - self.run_start] * k)
        self.count, self.last = total, now


def parse_slo(items: Sequence[str] | None) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` -> {"ttft": 0.5, "tpot": 0.05} (seconds)."""
    out: dict[str, float] = {}
    for item in items or ():
        key, sep, val = item.partition(":")
        try:
            ms = float(val)
        except ValueError:
            ms = float("nan")
        if not sep or key not in SLO_KEYS or not math.isfinite(ms) or ms <= 0:
            raise ValueError(f"--goodput: expected KEY:MILLISECONDS with KEY one of {', '.join(SLO_KEYS)}, "
                             f"got {item!r}")
        out[key] = ms / 1000.0
    return out


def _meets(r: RequestResult, slo: dict[str, float]) -> bool:
    vals = {"ttft": r.ttft, "tpot": r.tpot, "e2e": r.latency}
    return all(vals[k] is None or vals[k] <= v for k, v in slo.items())


def percentile(sorted_xs: Sequence[float], p: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if len(sorted_xs) == 1:
        return sorted_xs[0]
    pos = (len(sorted_xs) - 1) * p / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_xs) - 1)
    return sorted_xs[lo] + (sorted_xs[hi] - sorted_xs[lo]) * (pos - lo)


def _stats(xs: Sequence[float], percentiles: Sequence[float]) -> dict[str, float | None]:
    if not xs:
        return {"mean": None, "median": None, **{f"p{p:g}": None for p in percentiles}}
    s = sorted(x * 1000.0 for x in xs)
    return {"mean": statistics.fmean(s), "median": statistics.median(s),
            **{f"p{p:g}": percentile(s, p) for p in percentiles}}


def summarize(results: Sequence[RequestResult], duration: float, *, percentiles: Sequence[float] = (50, 90, 99),
              slo: dict[str, float] | None = None) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            key = (r.error or "unknown").split(":")[0]
            errors[key] = errors.get(key, 0) + 1
    out_tok, in_tok = sum(r.output_tokens for r in ok), sum(r.prompt_tokens for r in ok)
    per_s = (lambda x: x / duration) if duration > 0 else (lambda x: 0.0)
    s: dict[str, Any] = {
        "num_requests": len(results), "completed": len(ok), "failed": len(results) - len(ok), "errors": errors,
        "duration_s": duration, "total_input_tokens": in_tok, "total_output_tokens": out_tok,
        "request_throughput": per_s(len(ok)), "output_throughput": per_s(out_tok),
        "total_token_throughput": per_s(in_tok + out_tok),
        "ttft_ms": _stats([r.ttft for r in ok], percentiles),
        "tpot_ms": _stats([t for r in ok if (t := r.tpot) is not None], percentiles),
        "itl_ms": _stats([x for r in ok for x in r.itl], percentiles),
        "e2e_latency_ms": _stats([r.latency for r in ok], percentiles),
    }
    if slo:
        good = sum(1 for r in ok if _meets(r, slo))
        s["slo_ms"] = {k: v * 1000.0 for k, v in slo.items()}
        s["goodput"] = per_s(good)
        s["slo_attained"] = good / len(results) if results else 0.0
    return s


def _f(x: Any, digits: int = 2) -> str:
    return "n/a" if x is None else f"{x:.{digits}f}"


def format_table(s: dict[str, Any], title: str) -> str:
    w = 40
    lines = ["=" * 60, f" {title} ".center(60, "="),
             f"{'successful requests':<{w}}{s['completed']:>12}",
             f"{'failed requests':<{w}}{s['failed']:>12}" + (f"  {s['errors']}" if s["errors"] else ""),
             f"{'duration (s)':<{w}}{s['duration_s']:>12.2f}",
             f"{'input tokens':<{w}}{s['total_input_tokens']:>12}",
             f"{'output tokens':<{w}}{s['total_output_tokens']:>12}",
             f"{'request throughput (req/s)':<{w}}{s['request_throughput']:>12.2f}",
             f"{'output token throughput (tok/s)':<{w}}{s['output_throughput']:>12.2f}",
             f"{'total token throughput (tok/s)':<{w}}{s['total_token_throughput']:>12.2f}"]
    if "goodput" in s:
        slo = ", ".join(f"{k} <= {v:g} ms" for k, v in s["slo_ms"].items())
        lines.append(f"{'goodput (req/s) [' + slo + ']':<{w}}{s['goodput']:>12.2f}")
        lines.append(f"{'requests within the SLO':<{w}}{100 * s['slo_attained']:>11.1f}%")
    for key, name in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2e_latency_ms", "E2E latency")):
        st = s[key]
        lines.append(f"{'-' * 22} {name} (ms) ".ljust(60, "-"))
        for stat, v in st.items():
            lines.append(f"{'  ' + stat:<{w}}{_f(v):>12}")
    lines.append("=" * 60)
    return "\n".join(lines)


def write_json(path: str, report: dict[str, Any], results: Sequence[RequestResult]) -> None:
    body = dict(report)
    body["requests"] = [{k: v for k, v in asdict(r).items() if k != "token_times"} for r in results]
    with open(path, "w", encoding="utf-8") as f:
        json.dump(body, f, indent=1)


def plot(results: Sequence[RequestResult], summary: dict[str, Any], prefix: str, title: str) -> list[str]:
    """``{prefix}_latency_cdf.png`` and ``{prefix}_tokens_per_s.png``; [] without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: matplotlib is not installed (pip install 'jaxinfer[bench]'); no plots", file=sys.stderr)
        return []
    ok = [r for r in results if r.ok]
    series = (("TTFT", [r.ttft for r in ok]), ("TPOT", [t for r in ok if (t := r.tpot) is not None]),
              ("ITL", [x for r in ok for x in r.itl]), ("E2E latency", [r.latency for r in ok]))
    fig, axes = plt.subplots(1, 4, figsize=(17, 3.8))
    for ax, (name, xs) in zip(axes, series):
        xs = sorted(x * 1000.0 for x in xs)
        if xs:
            ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post")
        ax.set_title(f"{name} CDF")
        ax.set_xlabel("ms")
        ax.set_ylim(0, 1.02)
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("fraction of requests (ITL: of gaps)")
    fig.suptitle(title)
    fig.tight_layout()
    cdf_path = f"{prefix}_latency_cdf.png"
    fig.savefig(cdf_path, dpi=100)
    plt.close(fig)

    times = sorted(t for r in ok for t in r.token_times)
    duration = max(summary["duration_s"], times[-1] if times else 0.0, 1e-3)
    bins = max(1, min(100, len(times) // 20 or 1))
    width = duration / bins
    counts = [0] * bins
    for t in times:
        counts[min(bins - 1, int(t / width))] += 1
    fig, ax = plt.subplots(figsize=(8, 3.8))
    ax.plot([(i + 0.5) * width for i in range(bins)], [c / width for c in counts], "-o", ms=3)
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"{title}: output tokens/s over time ({width:.2g} s bins)")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    tok_path = f"{prefix}_tokens_per_s.png"
    fig.savefig(tok_path, dpi=100)
    plt.close(fig)
    return [cdf_path, tok_path]
