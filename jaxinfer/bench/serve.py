"""``bench serve``: a load generator against an OpenAI-compatible server (jaxinfer serve or
any other), in the manner of ``vllm bench serve``.

Arrivals are Poisson at ``--request-rate`` requests/s (``inf``: all at once), optionally
capped at ``--max-concurrency`` in flight. Each request streams (``stream_options.
include_usage``, so token counts are the server's); text prompts go to
``/v1/chat/completions`` (or ``/v1/completions`` with ``--endpoint completions``), token-id
prompts to ``/v1/completions``. Every streamed chunk is timed on arrival.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import random
import socket
import threading
import time
from typing import Any, Iterator, Sequence

from jaxinfer.bench.datasets import BenchRequest
from jaxinfer.bench.report import RequestResult, TokenClock


def request_body(req: BenchRequest, model: str, endpoint: str, ignore_eos: bool,
                 temperature: float) -> tuple[str, dict[str, Any]]:
    body: dict[str, Any] = {"model": model, "max_tokens": req.output_len, "temperature": temperature,
                            "stream": True, "stream_options": {"include_usage": True}}
    if ignore_eos:
        body["ignore_eos"] = True
    if endpoint == "chat" and isinstance(req.prompt, str):
        body["messages"] = [{"role": "user", "content": req.prompt}]
        return "/v1/chat/completions", body
    body["prompt"] = list(req.prompt) if isinstance(req.prompt, tuple) else req.prompt
    return "/v1/completions", body


def _chunk_tokens(chunk: dict) -> int:
    """Tokens in a streamed chunk: one per chunk that carries text (the server streams one
    chunk per token step; the final usage corrects the total)."""
    for c in chunk.get("choices") or []:
        if c.get("text") or (c.get("delta") or {}).get("content"):
            return 1
    return 0


async def send_one(client: Any, path: str, body: dict, run_start: float) -> RequestResult:
    import httpx

    sent = time.perf_counter()
    res = RequestResult(ok=False, start=sent - run_start)
    clock = TokenClock(res, sent, run_start)
    seen = 0
    try:
        async with client.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200].decode(errors='replace')}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = "stream error: " + str(chunk["error"])[:200]
                    return res
                if chunk.get("usage"):
                    res.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    res.output_tokens = chunk["usage"]["completion_tokens"]
                k = _chunk_tokens(chunk)
                if k:
                    seen += k
                    clock.tokens(seen, time.perf_counter())
        res.latency = time.perf_counter() - sent
        res.ok = seen > 0
        if res.ok and res.output_tokens > seen and clock.last is not None:
            # a chunk carried several tokens (the server coalesces a step's output when the
            # client reads late, as under load): count the missing ones at the last text
            # chunk, with no gap (where in the stream they came is not known),
            # as TokenClock does for tokens that come with the first, so every request has
            # output_tokens - 1 ITLs however the stream chunks
            clock.tokens(res.output_tokens, clock.last)
        res.output_tokens = res.output_tokens or seen
        if not res.ok:
            res.error = "no text streamed"
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as e:
        res.error = f"{type(e).__name__}: {e}"
    return res


async def run(base_url: str, requests: Sequence[BenchRequest], *, model: str | None, endpoint: str,
              rate: float, max_concurrency: int | None, ignore_eos: bool, temperature: float,
              seed: int, api_key: str | None, timeout: float,
              warmup: int = 1) -> tuple[list[RequestResult], float, str]:
    """-> (results, seconds from the first arrival to the last answer, model name)."""
    import httpx

    if not (rate > 0):
        raise ValueError(f"--request-rate: expected a positive rate or inf, got {rate}")
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"--max-concurrency: expected >= 1, got {max_concurrency}")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=base_url, headers=headers, limits=limits,
                                 timeout=httpx.Timeout(timeout, connect=30.0)) as client:
        if model is None:
            r = await client.get("/v1/models")
            r.raise_for_status()
            model = r.json()["data"][0]["id"]
        bodies = [request_body(q, model, endpoint, ignore_eos, temperature) for q in requests]
        t = time.perf_counter()
        await asyncio.gather(*(send_one(client, p, b, t) for p, b in bodies[:warmup]))

        async def limited(path: str, body: dict, run_start: float) -> RequestResult:
            if sem is None:
                return await send_one(client, path, body, run_start)
            async with sem:
                return await send_one(client, path, body, run_start)

        tasks = []
        run_start = time.perf_counter()
        for i, (path, body) in enumerate(bodies):
            tasks.append(asyncio.create_task(limited(path, body, run_start)))
            if math.isfinite(rate) and i < len(bodies) - 1:
                await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - run_start, model


@contextlib.contextmanager
def serve_app_in_thread(app: Any, startup_timeout: float = 60.0, graceful_s: float = 5.0,
                        **uvicorn_config: Any) -> Iterator[str]:
    """Run an ASGI app under uvicorn on a free loopback port, in a thread; yield its URL.
    ``uvicorn_config``: more ``uvicorn.Config`` options (e.g. ``http=`` a protocol class)."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on",
                                           timeout_graceful_shutdown=graceful_s, **uvicorn_config))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=graceful_s + 8)
        sock.close()
