"""Start-up benchmark: how soon `jaxinfer serve` answers, and how much memory it holds.

For each weight format (float32, int8) the server is started twice with the same fresh
HOME: first with no caches at all (a new user's first start: the C++ kernels and every
step shape are compiled), then again (kernels and compiled steps come from
``~/.cache/jaxinfer``). Each run records, from the moment the process is started:

* ``serving_s``: /health answers 200 (requests are served; buckets may still compile);
* ``ready_s``: /health says "ready" (every bucket compiled: no step compiles any more);
* ``first_token_s``: the first streamed token of a chat request sent as soon as /health
  answered 200 (``ttft_s``: the same, from when the request was sent);
* ``peak_rss_workload_mib``: the server's peak RSS (VmHWM: load, compile, serving) after the
  throughput workload (32 prompts of 16-256 tokens, 128 new tokens each, all at once;
  ``--quick``: 32 new tokens), which is sent as soon as the first token came back;
* ``peak_rss_mib``: its peak RSS once ready (every bucket compiled) or at ``--ready-timeout``.

llama.cpp's server and vLLM are timed the same way where installed (``llama_cpp.server``,
``vllm``); otherwise the result says so.

    python benchmarks/startup.py                          # float32 and int8, cold then warm
    python benchmarks/startup.py --formats float32 --quick --out startup.json

The workload is ../shared/data's token-id workload when present (benchmarks/common.py),
else synthetic token ids of the same shapes (said in the output).
"""

from __future__ import annotations

import concurrent.futures as cf
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import common as C

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rss_mib(pid: int) -> tuple[float, float]:
    """(current, peak) RSS of process ``pid`` in MiB."""
    vals = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("VmRSS", "VmHWM"):
                vals[k] = int(v.split()[0]) / 1024
    return vals["VmRSS"], vals["VmHWM"]


def _first_token(client: Any, url: str, model: str) -> float:
    """Seconds from sending a streamed chat request to its first content chunk."""
    body = {"model": model, "messages": [{"role": "user", "content": "Name three planets."}],
            "max_tokens": 16, "stream": True}
    t0 = time.perf_counter()
    with client.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and '"content"' in line:
                return time.perf_counter() - t0
    raise RuntimeError("no token streamed")


def _workload(client: Any, url: str, model: str, prompts: list[list[int]], new_tokens: int) -> dict:
    def one(ids: list[int]) -> int:
        r = client.post(url + "/v1/completions", timeout=1800,
                        json={"model": model, "prompt": ids, "max_tokens": new_tokens,
                              "ignore_eos": True, "temperature": 0})
        r.raise_for_status()
        return r.json()["usage"]["completion_tokens"]

    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(len(prompts)) as ex:
        tokens = sum(ex.map(one, prompts))
    secs = time.perf_counter() - t0
    return {"requests": len(prompts), "output_tokens": tokens, "seconds": secs, "tok_per_s": tokens / secs}


def run_server(cmd: list[str], home: str, prompts, new_tokens: int, model: str | None = None,
               ready_timeout: float = 1800) -> dict:
    """Start ``cmd`` (a server on the port in it) with HOME=home; time it; stop it. The
    workload runs as soon as the first token came back (while buckets may still compile),
    then /health is polled until "ready" (at most ``ready_timeout`` s from the start)."""
    import httpx

    port = int(cmd[cmd.index("--port") + 1])
    url = f"http://127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items() if k not in ("JAXINFER_KERNEL_CACHE", "XLA_FLAGS")}
    env.update(HOME=home, PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""))
    log = open(os.path.join(home, "server.log"), "a")
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=home)
    res: dict[str, Any] = {"load_avg_start": C.load_avg()}

    def health(client: Any) -> tuple[int, str | None] | None:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}; see {log.name}")
        try:
            r = client.get(url + "/health", timeout=5)
        except httpx.TransportError:
            return None
        json_body = r.headers.get("content-type", "").startswith("application/json")
        return r.status_code, (r.json().get("status") if json_body else None)

    try:
        with httpx.Client() as client:
            while (h := health(client)) is None or h[0] != 200:
                time.sleep(0.1)
            res["serving_s"] = time.perf_counter() - t0
            name = model or client.get(url + "/v1/models").json()["data"][0]["id"]
            res["ttft_s"] = _first_token(client, url, name)
            res["first_token_s"] = time.perf_counter() - t0
            res["workload"] = _workload(client, url, name, prompts, new_tokens)
            res["rss_after_workload_mib"], res["peak_rss_workload_mib"] = _rss_mib(proc.pid)
            res["ready_s"] = None       # not within ready_timeout
            while time.perf_counter() - t0 < ready_timeout:
                h = health(client)
                if h is not None and h[0] == 200 and h[1] in ("ready", "ok", None):
                    res["ready_s"] = time.perf_counter() - t0
                    break
                time.sleep(0.2)
            res["peak_rss_mib"] = _rss_mib(proc.pid)[1]
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
    res["load_avg_end"] = C.load_avg()
    return res


def jaxinfer_cmd(port: int, quantization: str | None, warmup: str | None = None) -> list[str]:
    cmd = [sys.executable, "-m", "serving.cli", "serve", "--port", str(port), "--no-access-log",
           "--log-level", "warning"]
    cmd += ["--quantization", quantization] if quantization else []
    return cmd + (["--warmup", warmup] if warmup else [])


def peers(port: int) -> dict[str, list[str] | str]:
    """Peer servers on the default model, where installed (else why not)."""
    out: dict[str, list[str] | str] = {}
    if importlib.util.find_spec("llama_cpp") is not None:
        from jaxinfer.loading.default import default_model_path

        out["llama.cpp"] = [sys.executable, "-m", "llama_cpp.server", "--model", default_model_path(),
                            "--port", str(port), "--n_threads", str(os.cpu_count() or 1)]
    else:
        out["llama.cpp"] = "not installed (pip install llama-cpp-python[server])"
    out["vllm"] = "not installed" if importlib.util.find_spec("vllm") is None else \
        "installed, but its CPU start-up is not scripted here"
    return out


def main() -> int:
    p = C.base_parser(__doc__.splitlines()[0])
    p.add_argument("--formats", default="float32,int8", help="weight formats: float32,int8")
    p.add_argument("--new-tokens", type=int, default=None,
                   help="new tokens per workload request (default: the workload's, 128)")
    p.add_argument("--keep-home", action="store_true", help="keep the temporary HOMEs (logs, caches)")
    p.add_argument("--ready-timeout", type=float, default=1800,
                   help="stop waiting for /health 'ready' after this many seconds from the start")
    p.add_argument("--phases", default="cold,warm", help="cold,warm (same HOME, in this order)")
    p.add_argument("--baseline", action="store_true",
                   help="also a cold float32 start with --warmup full (every bucket compiled before "
                        "serving, as the server did before background compilation): the same-run baseline")
    args = p.parse_args()

    w = C.load_workload(args.workload)
    prompts = w["throughput"]["prompts"]
    new_tokens = args.new_tokens or (32 if args.quick else w["throughput"]["new_tokens"])
    res: dict[str, Any] = {"machine": C.machine(), "workload": w["source"], "synthetic": w["synthetic"],
                           "new_tokens": new_tokens, "runs": {}}
    rows = []
    for fmt in [f.strip() for f in args.formats.split(",") if f.strip()]:
        if fmt not in ("float32", "int8"):
            p.error(f"--formats: unknown {fmt!r} (float32, int8)")
        home = tempfile.mkdtemp(prefix=f"jaxinfer-startup-{fmt}-")
        for phase in [x.strip() for x in args.phases.split(",") if x.strip()]:
            r = run_server(jaxinfer_cmd(_free_port(), None if fmt == "float32" else fmt), home,
                           prompts, new_tokens, ready_timeout=args.ready_timeout)
            res["runs"][f"jaxinfer {fmt} {phase}"] = r
            rows.append((f"jaxinfer {fmt} {phase}", r))
            print(f"{fmt} {phase}: " + json.dumps(r), file=sys.stderr, flush=True)
        if not args.keep_home:
            import shutil
            shutil.rmtree(home, ignore_errors=True)
    if args.baseline:
        home = tempfile.mkdtemp(prefix="jaxinfer-startup-full-")
        r = run_server(jaxinfer_cmd(_free_port(), None, "full"), home, prompts, new_tokens,
                       ready_timeout=args.ready_timeout)
        res["runs"]["jaxinfer float32 cold, --warmup full"] = r
        rows.append(("float32 cold warmup=full", r))
        print("baseline: " + json.dumps(r), file=sys.stderr, flush=True)
        if not args.keep_home:
            import shutil
            shutil.rmtree(home, ignore_errors=True)
    for name, cmd in peers(_free_port()).items():
        if isinstance(cmd, str):
            res["runs"][name] = cmd
            continue
        home = tempfile.mkdtemp(prefix="jaxinfer-startup-peer-")
        r = run_server(cmd, home, prompts, new_tokens, model="default", ready_timeout=args.ready_timeout)
        res["runs"][name] = r
        rows.append((name, r))
    res["load_avg_end"] = C.load_avg()

    print(f"\nstart-up ({w['source']}, {len(prompts)} prompts x {new_tokens} new tokens; "
          f"load avg at start {res['machine']['load_avg_start']}, end {res['load_avg_end']})")
    print(f"{'run':<26}{'serving s':>10}{'1st tok s':>10}{'TTFT s':>8}{'ready s':>9}"
          f"{'RSS work MiB':>13}{'RSS peak MiB':>13}{'tok/s':>7}{'load':>6}")
    for name, r in rows:
        ready = "-" if r["ready_s"] is None else f"{r['ready_s']:.1f}"
        print(f"{name:<26}{r['serving_s']:>10.1f}{r['first_token_s']:>10.1f}{r['ttft_s']:>8.2f}{ready:>9}"
              f"{r['peak_rss_workload_mib']:>13.0f}{r['peak_rss_mib']:>13.0f}"
              f"{r['workload']['tok_per_s']:>7.1f}{r['load_avg_start'][0]:>6.1f}")
    for name, r in res["runs"].items():
        if isinstance(r, str):
            print(f"{name}: {r}")
    C.write_json(args.out, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
