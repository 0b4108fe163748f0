"""``bench throughput`` and ``bench latency``: an in-process Engine, no HTTP.

Both drive ``add_request`` / ``step`` themselves and time every step's outputs, so the
per-request figures (TTFT, ITL, TPOT, E2E) mean what they mean in ``bench serve``, minus
the network and the server.

- throughput: every request is queued at once (vLLM's offline throughput); the figure of
  merit is tokens/s over the whole run.
- latency: ``--batch-size`` requests at a time, ``--num-iters`` times after
  ``--num-iters-warmup`` untimed ones; the figure of merit is the batch's latency
  percentiles (vLLM's ``bench latency``).
"""

from __future__ import annotations

import time
from typing import Any, Sequence

from jaxinfer.bench.datasets import BenchRequest
from jaxinfer.bench.report import RequestResult, TokenClock


def run_batch(engine: Any, requests: Sequence[BenchRequest], params_for: Any,
              run_start: float | None = None) -> tuple[list[RequestResult], float]:
    """Queue ``requests`` now and step until all finish -> (results, seconds)."""
    t0 = time.perf_counter()
    run_start = t0 if run_start is None else run_start
    results, clocks = {}, {}
    for i, req in enumerate(requests):
        prompt = list(req.prompt) if isinstance(req.prompt, tuple) else req.prompt
        rid = engine.add_request(prompt, params_for(req), request_id=f"bench-{t0}-{i}")
        results[rid] = RequestResult(ok=False, start=t0 - run_start)
        clocks[rid] = TokenClock(results[rid], t0, run_start)
    while engine.has_unfinished():
        outs = engine.step()
        now = time.perf_counter()
        for out in outs:
            r = results.get(out.request_id)
            if r is None:
                continue
            clocks[out.request_id].tokens(len(out.outputs[0].token_ids), now)
            if out.finished:
                r.prompt_tokens = len(out.prompt_token_ids)
                r.output_tokens = len(out.outputs[0].token_ids)
                r.latency = now - t0
                r.ok = out.outputs[0].finish_reason in ("stop", "length")
                if not r.ok:
                    r.error = f"finish_reason {out.outputs[0].finish_reason}"
    return list(results.values()), time.perf_counter() - t0


def throughput(engine: Any, requests: Sequence[BenchRequest], params_for: Any) -> tuple[list[RequestResult], float]:
    return run_batch(engine, requests, params_for)


def latency(engine: Any, requests: Sequence[BenchRequest], params_for: Any, batch_size: int,
            num_iters: int, warmup_iters: int) -> tuple[list[RequestResult], float, list[float]]:
    """-> (results of the timed iterations, their total seconds, each iteration's seconds)."""
    if batch_size < 1 or num_iters < 1 or warmup_iters < 0:
        raise ValueError("--batch-size and --num-iters must be >= 1, --num-iters-warmup >= 0")
    batches = [[requests[(it * batch_size + j) % len(requests)] for j in range(batch_size)]
               for it in range(warmup_iters + num_iters)]
    for b in batches[:warmup_iters]:
        run_batch(engine, b, params_for)
    results: list[RequestResult] = []
    iters: list[float] = []
    run_start = time.perf_counter()
    for b in batches[warmup_iters:]:
        res, secs = run_batch(engine, b, params_for, run_start)
        results += res
        iters.append(secs)
    return results, time.perf_counter() - run_start, iters
