"""AsyncEngine under load (issue #24): add/abort latency while 64 streams decode, and the
per-step host time at short and long outputs.

The model is a tiny random Llama (2 layers, hidden 64, vocab 512; the default model's
tokenizer decodes its ids), so the device step is short and the host's share shows: this
measures the serving loop, not the model. 64 streams generate ``--max-tokens`` (2048) tokens
each, EOS ignored, consumed as the server consumes them (new text and token ids sliced off
the cumulative output); while the streams hold 128 to ``max_tokens - 256`` tokens, every
10 ms a short request (8 tokens) is added and an earlier one aborted.

Figures:
* add / abort latency (p50 / p99 / max, ms): how long the call takes on the caller's side
  (the AsyncEngine's internal add or inbox post, timed where it runs, waits for its lock
  included; ``abort`` awaited on the event loop);
* per-step host time (ms, median) of the engine thread (``Engine.host_seconds``: schedule,
  batch build, post-processing, outputs) while the streams hold ~64 and ~2048 output
  tokens, and the caller-side cost of turning one step's output into the cumulative one;
* ``--compare-rev REV`` runs the same load with the AsyncEngine of git revision REV (e.g.
  the one before the request queue and deltas) in the same process, for a ratio.

    python benchmarks/async_engine_load.py [--max-tokens 2048] [--compare-rev 6569ab1] [--out r.json]
"""

from __future__ import annotations

import asyncio
import importlib.util
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import common as C

STREAMS = 64
CHURN_EVERY_S = 0.010
# Churn runs between these output lengths, so the host-time windows (~64 tokens and the
# last 64) measure steady decode of the 64 streams, with no prefill of churn requests.
CHURN_FROM = 128
CHURN_STOP_BEFORE = 256
WINDOW = 64
MAX_SEQS = 96


def build_engine(max_tokens: int) -> Any:
    from flax import nnx

    from jaxinfer.engine_args import DEFAULT_CACHE
    from jaxinfer.models.config import ModelConfig
    from jaxinfer.engine.engine import Engine
    from jaxinfer.loading import LoadedModel
    from jaxinfer.loading.default import default_model_path
    from jaxinfer.loading.gguf import open_gguf
    from jaxinfer.loading.tokenizer import Tokenizer
    from jaxinfer.models.llama import LlamaForCausalLM

    tok = Tokenizer.from_gguf_reader(open_gguf(default_model_path()))
    max_len = max_tokens + 64
    cfg = ModelConfig(architecture="LlamaForCausalLM", vocab_size=512, hidden_size=64, intermediate_size=128,
                      num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                      max_position_embeddings=max_len, tie_word_embeddings=True, eos_token_ids=(2,))
    loaded = LoadedModel(cfg, LlamaForCausalLM(cfg, rngs=nnx.Rngs(0)), tok, {}, "tiny-random-llama")
    pages_per_seq = -(-max_len // 16)
    return Engine(loaded=loaded, progress=False, max_num_seqs=MAX_SEQS, max_num_batched_tokens=256,
                  max_model_len=max_len, num_pages=MAX_SEQS * pages_per_seq + 8, max_waiting=256,
                  decode_buckets=(MAX_SEQS,), mixed_decode_buckets=(0, MAX_SEQS),
                  prefill_buckets=((4, 32),), page_buckets=(pages_per_seq,),
                  compilation_cache_dir=DEFAULT_CACHE)


def load_async_engine_class(rev: str | None) -> type:
    if rev is None:
        from jaxinfer.engine.async_engine import AsyncEngine
        return AsyncEngine
    src = subprocess.run(["git", "-C", str(C.REPO), "show", f"{rev}:jaxinfer/engine/async_engine.py"],
                         check=True, capture_output=True, text=True).stdout
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location(f"async_engine_{rev}", f.name)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod.AsyncEngine


def _timed(fn, sink: list[float], only_adds: bool):
    def run(*a, **kw):
        t0 = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            if not only_adds or a[0][0] == "add":     # _post also carries aborts
                sink.append(time.perf_counter() - t0)
    return run


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] * 1e3 if xs else float("nan")


def run_load(engine: Any, cls: type, max_tokens: int, label: str) -> dict[str, Any]:
    from jaxinfer.sampling_params import SamplingParams

    aeng = cls(engine)
    add_s: list[float] = []
    abort_s: list[float] = []
    apply_s: list[tuple[int, float]] = []            # (stream 0's length, seconds) per cumulative update
    # The internal call that adds (old: the locked add_request; new: the inbox post).
    name = "_add" if hasattr(aeng, "_add") else "_post"
    setattr(aeng, name, _timed(getattr(aeng, name), add_s, only_adds=name == "_post"))
    # Per step: (stream 0's output length, host wall seconds as Engine counts them, CPU
    # seconds of this thread in post-processing + building the outputs). On a shared machine
    # the wall figure carries other processes' time; the CPU figure is this thread's own.
    steps: list[tuple[int, float, float]] = []
    lengths = [0]
    cpu = [0.0]
    real_step, real_post = engine.step, engine._postprocess

    c1 = [0.0]                                       # thread CPU clock when postprocess returned

    def step(*a, **kw):
        h0, cpu[0] = engine.host_seconds, 0.0
        c1[0] = time.thread_time()
        out = real_step(*a, **kw)
        post_cpu = cpu[0] + (time.thread_time() - c1[0])      # postprocess + the outputs built after it
        steps.append((lengths[0], engine.host_seconds - h0, post_cpu))
        return out

    def post(*a, **kw):
        t = time.thread_time()
        res = real_post(*a, **kw)
        c1[0] = time.thread_time()
        cpu[0] += c1[0] - t
        return res

    engine.step, engine._postprocess = step, post
    acc_cls = getattr(sys.modules[cls.__module__], "_Cumulative", None)
    real_apply = acc_cls.apply if acc_cls is not None else None
    if acc_cls is not None:              # the caller-side cost of building cumulative outputs
        def apply(self, delta, text):
            t0 = time.perf_counter()
            out = real_apply(self, delta, text)
            apply_s.append((len(out.outputs[0].token_ids), time.perf_counter() - t0))
            return out
        acc_cls.apply = apply
    long_p = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    short_p = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    rng = random.Random(0)

    async def stream(i: int) -> None:
        ntok = nchar = 0
        async for out in aeng.generate([rng.randrange(3, 512) for _ in range(16)], long_p, f"{label}-s{i}"):
            o = out.outputs[0]
            new_ids, new_text = o.token_ids[ntok:], o.text[nchar:]     # what a streamer sends
            ntok, nchar = len(o.token_ids), len(o.text)
            if i == 0:
                lengths[0] = ntok
            del new_ids, new_text

    async def churn(done: asyncio.Event) -> None:
        live: list[tuple[str, asyncio.Task]] = []
        k = 0
        while lengths[0] < CHURN_FROM:
            await asyncio.sleep(CHURN_EVERY_S)
        while not done.is_set() and lengths[0] < max_tokens - CHURN_STOP_BEFORE:
            await asyncio.sleep(CHURN_EVERY_S)
            rid = f"{label}-c{k}"
            k += 1

            async def short(rid=rid) -> None:
                async for _ in aeng.generate([rng.randrange(3, 512) for _ in range(16)], short_p, rid):
                    pass
            live.append((rid, asyncio.ensure_future(short())))
            if len(live) > 4:
                rid0, task0 = live.pop(0)
                t0 = time.perf_counter()
                await aeng.abort(rid0)
                abort_s.append(time.perf_counter() - t0)
                task0.cancel()
        for _, t in live:
            t.cancel()
        await asyncio.gather(*(t for _, t in live), return_exceptions=True)

    async def main() -> float:
        done = asyncio.Event()
        t0 = time.perf_counter()
        ch = asyncio.ensure_future(churn(done))
        await asyncio.gather(*(stream(i) for i in range(STREAMS)))
        wall = time.perf_counter() - t0
        done.set()
        await ch
        await aeng.shutdown()
        return wall

    wall = asyncio.run(main())
    engine.step, engine._postprocess = real_step, real_post
    if acc_cls is not None:
        acc_cls.apply = real_apply

    def host_ms(lo: int, hi: int, col: int = 1) -> float:
        xs = [s[col] for s in steps if lo <= s[0] <= hi]
        return statistics.median(xs) * 1e3 if xs else float("nan")

    def apply_us(lo: int, hi: int) -> float:
        xs = [t for n, t in apply_s if lo <= n <= hi]
        return statistics.median(xs) * 1e6 if xs else float("nan")

    short_lo, short_hi = WINDOW - 16, WINDOW + 16
    long_lo, long_hi = max_tokens - 2 * WINDOW, max_tokens - 1
    return {
        "label": label, "wall_s": wall, "steps": len(steps), "adds": len(add_s), "aborts": len(abort_s),
        "add_ms": {"p50": _pct(add_s, 0.5), "p99": _pct(add_s, 0.99), "max": _pct(add_s, 1.0)},
        "abort_ms": {"p50": _pct(abort_s, 0.5), "p99": _pct(abort_s, 0.99), "max": _pct(abort_s, 1.0)},
        "host_ms_per_step": {f"{short_lo}-{short_hi} tokens": host_ms(short_lo, short_hi),
                             f"{long_lo}-{long_hi} tokens": host_ms(long_lo, long_hi)},
        "postprocess_cpu_ms_per_step": {f"{short_lo}-{short_hi} tokens": host_ms(short_lo, short_hi, 2),
                                        f"{long_lo}-{long_hi} tokens": host_ms(long_lo, long_hi, 2)},
        "caller_us_per_update": {f"{short_lo}-{short_hi} tokens": apply_us(short_lo, short_hi),
                                 f"{long_lo}-{long_hi} tokens": apply_us(long_lo, long_hi)},
    }


def main() -> int:
    p = C.base_parser(__doc__.splitlines()[0])
    p.add_argument("--max-tokens", type=int, default=2048)
    p.add_argument("--compare-rev", default=None,
                   help="also run the AsyncEngine of this git revision (same process, same engine)")
    args = p.parse_args()
    t0 = time.perf_counter()
    engine = build_engine(args.max_tokens)
    print(f"engine built and compiled in {time.perf_counter() - t0:.1f}s (tiny random model)", file=sys.stderr)
    runs = [run_load(engine, load_async_engine_class(None), args.max_tokens, "current")]
    if args.compare_rev:
        runs.append(run_load(engine, load_async_engine_class(args.compare_rev), args.max_tokens,
                             args.compare_rev))
    result = {"machine": C.machine(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "load_avg": C.load_avg(), "streams": STREAMS, "max_tokens": args.max_tokens,
              "churn_every_ms": CHURN_EVERY_S * 1e3, "model": "tiny random Llama (2 layers, hidden 64, vocab 512)",
              "runs": runs, "threads": threading.active_count()}
    for r in runs:
        print(f"\n[{r['label']}] {r['steps']} steps in {r['wall_s']:.1f}s, {r['adds']} adds, {r['aborts']} aborts")
        for k in ("add_ms", "abort_ms"):
            v = r[k]
            print(f"  {k:8s} p50 {v['p50']:.3f}  p99 {v['p99']:.3f}  max {v['max']:.3f}")
        print("  host ms/step (wall): " + ", ".join(f"{k}: {v:.3f}" for k, v in r["host_ms_per_step"].items()))
        print("  postprocess + outputs, CPU ms/step: "
              + ", ".join(f"{k}: {v:.3f}" for k, v in r["postprocess_cpu_ms_per_step"].items()))
        print("  caller us/update (cumulative from deltas): "
              + ", ".join(f"{k}: {v:.1f}" for k, v in r["caller_us_per_update"].items()))
    C.write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
