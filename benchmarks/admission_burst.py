"""Admission control under a burst (issue #56): N requests at once against the server over
HTTP, the default model, with ``--max-queue-delay-ms`` (0: off, the old behaviour: all
queued). The issue's floor: the refusals' p99 under 50 ms.

Figures: how many were accepted / refused (503), the refusals' latency (p50 / p99 / max,
ms, from the request's send to its 503, as the client sees it, and from the server's
first sight of the request to its 503 answer: ``refusal_ms_server_side``), and the accepted requests' time to first token
and end-to-end latency (p50 / p99, s; streamed, so the first token's time is seen).

    python benchmarks/admission_burst.py [--requests 500] [--max-queue-delay-ms 2000]
        [--max-num-seqs 32] [--max-tokens 32] [--out r.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

import common as C


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


async def one(http: Any, i: int, max_tokens: int) -> dict:
    body = {"prompt": f"Request {i}: write a short story about a lighthouse keeper.", "max_tokens": max_tokens,
            "ignore_eos": True, "temperature": 0, "stream": True}
    t0 = time.perf_counter()
    first = None
    async with http.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return {"status": r.status_code, "latency": time.perf_counter() - t0,
                    "retry_after": r.headers.get("retry-after")}
        async for line in r.aiter_lines():
            if first is None and line.startswith("data: {"):
                first = time.perf_counter() - t0
    return {"status": 200, "ttft": first, "latency": time.perf_counter() - t0}


async def burst(url: str, n: int, max_tokens: int) -> list[dict]:
    import httpx

    limits = httpx.Limits(max_connections=n, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=3600, limits=limits) as http:
        return await asyncio.gather(*(one(http, i, max_tokens) for i in range(n)))


def report(results: list[dict]) -> dict:
    ok = [r for r in results if r["status"] == 200]
    refused = [r for r in results if r["status"] == 503]
    ms = [1000 * r["latency"] for r in refused]
    return {"accepted": len(ok), "refused": len(refused),
            "other": len(results) - len(ok) - len(refused),
            "refusal_ms": {"p50": pct(ms, 0.5), "p99": pct(ms, 0.99), "max": max(ms, default=float("nan"))},
            "refusals_with_retry_after": sum(r["retry_after"] is not None for r in refused),
            "accepted_ttft_s": {"p50": pct([r["ttft"] for r in ok], 0.5), "p99": pct([r["ttft"] for r in ok], 0.99)},
            "accepted_e2e_s": {"p50": pct([r["latency"] for r in ok], 0.5),
                               "p99": pct([r["latency"] for r in ok], 0.99)}}


class ServerClock:
    """ASGI wrapper: each request's seconds from the server's first sight of it (the ASGI
    call) to its response's start, by status: the server's own share of a refusal's
    latency, without the time a one-process Python client spends queueing its 500 sends."""

    def __init__(self, app: Any) -> None:
        self.app, self.times = app, []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = time.perf_counter()

        async def timed_send(message: dict) -> None:
            if message["type"] == "http.response.start":
                self.times.append((message["status"], time.perf_counter() - t0))
            await send(message)
        await self.app(scope, receive, timed_send)

    def refusal_ms(self) -> dict:
        ms = [1000 * t for status, t in self.times if status == 503]
        return {"p50": pct(ms, 0.5), "p99": pct(ms, 0.99), "max": max(ms, default=float("nan"))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=500)
    ap.add_argument("--max-queue-delay-ms", type=int, default=2000, help="0: off")
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    from jaxinfer.bench.serve import serve_app_in_thread
    from jaxinfer.engine.async_engine import AsyncEngine
    from jaxinfer.engine.engine import Engine
    from serving.app import build_app

    engine = Engine(max_num_seqs=args.max_num_seqs, max_queue_delay_ms=args.max_queue_delay_ms or None,
                    warmup="full", progress=False)
    aeng = AsyncEngine(engine)
    clock = ServerClock(build_app(aeng))
    with serve_app_in_thread(clock) as url:
        t0 = time.perf_counter()
        results = asyncio.run(burst(url, args.requests, args.max_tokens))
        wall = time.perf_counter() - t0
    out = {"args": vars(args), "wall_s": wall, **report(results), "refusal_ms_server_side": clock.refusal_ms()}
    print(json.dumps(out, indent=2))
    C.write_json(args.out, {"machine": C.machine(), **out})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
