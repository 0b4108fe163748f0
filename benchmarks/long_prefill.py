"""A long prompt beside short requests (issue #51's "one 10 KB request stalls everyone"):
the latency of 20 plain completions sent while a 64-tool chat request (``tool_choice:
"required"``, ~3,500 prompt tokens with SmolLM2's chat template) prefills, against the same
20 alone, and the long request's time to first token alone and beside them.

It runs a real ``jaxinfer serve`` (``--warmup full``, so no compile lands in the timed
part) from ``--repo`` (default: this checkout; a ``git worktree`` of an older commit
measures the before), with ``--serve-arg`` passed through (e.g.
``--serve-arg=--long-prefill-token-threshold=0``):

    python benchmarks/long_prefill.py [--repo /tmp/hol-before] [--serve-arg=...] [--rounds 3]

Each round uses fresh tool names, so the prefix cache holds none of the long prompt.

``--engine-sweep 0,32,64,128`` instead measures in-process (the checkout first on
PYTHONPATH) on ``Engine()`` (32 sequences,
prefix cache off, stepped by hand): a 3,500-token random prompt, 20 completions of 16
tokens added after its ``--arrive``-th step, for each cap (set on the live scheduler; 0 =
off), against each alone; how the default threshold was chosen (engine/scheduler.py).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
NO_ARGS = {"type": "object", "properties": {}}     # 64 such tools: ~3,500 prompt tokens


def fresh_tools(n: int) -> list[dict]:
    tag = uuid.uuid4().hex[:8]
    return [{"type": "function", "function": {"name": f"fn_{tag}_{i}", "parameters": NO_ARGS,
                                              "description": f"Tool {i}: the weather in a city"}}
            for i in range(n)]


def start_server(repo: Path, port: int, extra: list[str], log: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(repo)}
    cmd = [sys.executable, "-m", "serving.cli", "serve", "--port", str(port), "--warmup", "full", *extra]
    with open(log, "w") as f:
        return subprocess.Popen(cmd, cwd=repo, env=env, stdout=f, stderr=subprocess.STDOUT)


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 1200) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited {proc.returncode} (see its log)")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError("server not ready")


def plain(url: str, model: str) -> float:
    t = time.perf_counter()
    r = httpx.post(url + "/v1/completions", timeout=600, json={
        "model": model, "prompt": "The capital of France is", "max_tokens": 16, "temperature": 0,
        "ignore_eos": True})
    r.raise_for_status()
    return time.perf_counter() - t


def plain_batch(url: str, model: str, n: int) -> list[float]:
    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(lambda _: plain(url, model), range(n)))


def wait_running(url: str, timeout: float = 60) -> None:
    """Until the engine runs a request (/metrics): the long one's prefill is under way (a
    streamed response's headers come with its first token, too late to tell)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
            if line.startswith("jaxinfer:num_requests_running") and float(line.split()[-1]) >= 1:
                return
        time.sleep(0.05)
    raise TimeoutError("the long request never started running")


def long_request(url: str, model: str, n_tools: int) -> dict:
    """Streams the tools request: seconds to its first content and to its end, prompt tokens."""
    body = {"model": model, "messages": [{"role": "user", "content": "Weather in Paris?"}],
            "tools": fresh_tools(n_tools), "tool_choice": "required", "max_tokens": 64, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    t = time.perf_counter()
    out = {"ttft": None, "prompt_tokens": None, "t0": t}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                out["prompt_tokens"] = chunk["usage"]["prompt_tokens"]
            if out["ttft"] is None and any(c.get("delta") for c in chunk.get("choices", ())):
                out["ttft"] = time.perf_counter() - t
    out["total"] = time.perf_counter() - t
    return out


def alongside(url: str, model: str, n_tools: int, n_plain: int, delay: float) -> dict:
    """The long request, then ``n_plain`` plain ones ``delay`` s after it started running."""
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(long_request, url, model, n_tools)
        wait_running(url)
        time.sleep(delay)
        sent = time.perf_counter()
        lat = plain_batch(url, model, n_plain)
        long = pending.result()
    # when the plain ones were sent and the long one's first token came, from its start
    long["plain_sent_after"] = round(sent - long.pop("t0"), 3)
    return {"plain": lat, "long": long}


def summary(xs: list[float]) -> dict:
    return {"median": round(statistics.median(xs), 3), "max": round(max(xs), 3)}


def engine_sweep(caps: list[int], arrive: int, long_len: int = 3500) -> dict:
    from jaxinfer.engine import engine as engine_module
    from jaxinfer.engine.warmup import use_default_mode

    Engine = engine_module.Engine
    SamplingParams = engine_module.SamplingParams     # wherever this checkout defines it

    use_default_mode("full")
    eng = Engine(max_num_seqs=32, enable_prefix_caching=False, progress=False)
    short = eng.tokenizer.encode("The capital of France is")
    short_p = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    long_p = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    rng = random.Random(0)

    def run(with_long: bool, n_short: int) -> dict:
        t0 = time.perf_counter()
        added, done, ttft, step = {}, {}, None, 0
        lid = None
        if with_long:
            lid = eng.add_request([rng.randrange(100, 40000) for _ in range(long_len)], long_p)
        while True:
            if step == (arrive if with_long else 0):
                for _ in range(n_short):
                    added[eng.add_request(short, short_p)] = time.perf_counter()
            if not eng.has_unfinished():
                break
            outs = eng.step()
            now = time.perf_counter()
            for o in outs:
                if o.request_id == lid and ttft is None and o.outputs[0].token_ids:
                    ttft = now - t0
                if o.finished and o.request_id != lid:
                    done[o.request_id] = now - added[o.request_id]
            step += 1
        lat = list(done.values())
        return {"short_median": round(statistics.median(lat), 3) if lat else None,
                "long_ttft": round(ttft, 3) if ttft else None, "steps": step}

    run(False, 20)                                # warm
    res = {"shorts_alone": run(False, 20), "long_alone": run(True, 0)}
    for cap in caps:
        if not hasattr(eng.scheduler, "long_prefill_cap"):
            if cap:
                continue                          # a checkout before the cap: 0 only
        else:
            eng.scheduler.long_prefill_cap = cap
        res[f"beside_cap{cap}"] = run(True, 20)
        print(f"cap {cap}", json.dumps(res[f"beside_cap{cap}"]), flush=True)
    print(json.dumps(res), flush=True)
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repo", default=str(REPO), help="the checkout whose server runs (default: this one)")
    ap.add_argument("--serve-arg", action="append", default=[], help="extra `jaxinfer serve` argument")
    ap.add_argument("--port", type=int, default=8391)
    ap.add_argument("--tools", type=int, default=64)
    ap.add_argument("--plain", type=int, default=20)
    ap.add_argument("--delay", type=float, default=1.0,
                    help="seconds between the long request's start and the others")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--log", default="/tmp/long_prefill_server.log", help="the server's output")
    ap.add_argument("--engine-sweep", default=None, metavar="CAPS",
                    help="in-process Engine() instead, for these comma-separated caps (0 = off)")
    ap.add_argument("--arrive", type=int, default=1, help="--engine-sweep: the long prompt's steps "
                                                          "before the completions are added")
    args = ap.parse_args()
    if args.engine_sweep:
        res = engine_sweep([int(c) for c in args.engine_sweep.split(",")], args.arrive)
        if args.out:
            Path(args.out).write_text(json.dumps(res, indent=1))
        return 0
    url = f"http://127.0.0.1:{args.port}"
    proc = start_server(Path(args.repo), args.port, args.serve_arg, Path(args.log))
    try:
        wait_ready(url, proc)
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        plain(url, model)
        plain_batch(url, model, args.plain)                       # warm: first-request costs
        long_request(url, model, args.tools)                      # warm: the grammar's tokenizer view
        rounds = []
        for _ in range(args.rounds):
            base = plain_batch(url, model, args.plain)
            alone = long_request(url, model, args.tools)
            alone.pop("t0")
            mixed = alongside(url, model, args.tools, args.plain, args.delay)
            rounds.append({"plain_alone": base, "long_alone": alone, **mixed})
            long = mixed["long"]
            before_long = sum(long["plain_sent_after"] + x < long["ttft"] for x in mixed["plain"])
            print(json.dumps({"plain_alone": summary(base), "plain_beside_long": summary(mixed["plain"]),
                              "plain_done_before_long_ttft": before_long,
                              "long_alone": alone, "long_beside_plain": long}), flush=True)
        res = {"repo": args.repo, "serve_args": args.serve_arg, "tools": args.tools, "plain": args.plain,
               "rounds": rounds}
        if args.out:
            Path(args.out).write_text(json.dumps(res, indent=1))
    finally:
        proc.terminate()
        proc.wait(60)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
