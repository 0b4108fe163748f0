"""How far a quantized model strays from its float32 original: next-token KL divergence
along the float32 model's own greedy continuation, and greedy agreement.

Used by benchmarks/quant_quality.py (all MT-Bench prompts) and tests/test_quantization.py
(a few). Teacher-forced: both models see the same tokens (prompt + the float32 greedy
continuation), so one early divergence does not make every later position incomparable.
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxinfer.engine.kv_cache import KVCacheSpec, allocate_kv_cache
from jaxinfer import matmul as M
from jaxinfer.reference import PAGE, paged_contiguous_attention


def _tail_logits(graphdef, state, tokens, n, *, count: int, kv_int8: bool):
    """tokens i32[Lp] (the first n real, then padding) -> f32[count, V]: the logits at
    positions n - count .. n - 1 (each predicts the token after it). ``kv_int8``: K/V go
    through int8 pages (engine/kv_cache.py QuantizedPages), as the engine stores them."""
    model = nnx.merge(graphdef, state)
    cfg = model.cfg
    Lp = tokens.shape[0]
    positions = jnp.arange(Lp, dtype=jnp.int32)
    attn = paged_contiguous_attention(positions[None], n[None], Lp, cfg)
    spec = KVCacheSpec(cfg.num_layers, Lp // PAGE, PAGE, cfg.num_kv_heads, cfg.head_dim,
                       "int8" if kv_int8 else model.dtype)
    cache = allocate_kv_cache(spec)
    idx = n - count + jnp.arange(count, dtype=jnp.int32)
    logits, _ = model(tokens, positions, cache, attn, idx, M.matmul)
    return logits


def tail_logits(model: nnx.Module, tokens: Sequence[int], count: int, kv_int8: bool = False) -> np.ndarray:
    """f32[count, V]: next-token logits at the last ``count`` positions of ``tokens``."""
    n = len(tokens)
    Lp = max(128, -(-n // 128) * 128)        # a short ladder of padded lengths: few compiles
    padded = np.zeros(Lp, np.int32)
    padded[:n] = tokens
    graphdef, state = nnx.split(model)
    key = (graphdef, jax.tree.structure(state), Lp, count, kv_int8)
    if key not in _COMPILED:
        from jaxinfer.engine.resources import compiler_options
        fn = jax.jit(functools.partial(_tail_logits, graphdef, count=count, kv_int8=kv_int8))
        _COMPILED[key] = fn.lower(state, padded, np.int32(n)).compile(compiler_options(model))
    return np.asarray(_COMPILED[key](state, padded, np.int32(n)))


_COMPILED: dict = {}     # (graphdef, state structure, padded length, count) -> executable


def kl_divergence(p_logits: np.ndarray, q_logits: np.ndarray) -> np.ndarray:
    """KL(P || Q) per row, in nats, from logits [..., V] (float64 log-softmax)."""
    lp = _log_softmax(np.asarray(p_logits, np.float64))
    lq = _log_softmax(np.asarray(q_logits, np.float64))
    return np.sum(np.exp(lp) * (lp - lq), axis=-1)


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def leading_agreement(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens two greedy continuations share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def compare(reference: nnx.Module, candidate: nnx.Module, prompts: Sequence[Sequence[int]],
            ref_tokens: Sequence[Sequence[int]], cand_tokens: Sequence[Sequence[int]],
            kv_int8: bool = False) -> dict:
    """Mean next-token KL(reference || candidate) along the reference's continuations, and
    greedy agreement of the candidate's own continuations with them. ``kv_int8``: the
    candidate runs with int8 KV pages."""
    kls, agree = [], []
    for p, rt, ct in zip(prompts, ref_tokens, cand_tokens):
        seq = list(p) + list(rt[:-1])         # position len(p) - 1 + i predicts rt[i]
        count = len(rt)
        kls.append(kl_divergence(tail_logits(reference, seq, count),
                                 tail_logits(candidate, seq, count, kv_int8)))
        agree.append(leading_agreement(rt, ct))
    kl = np.concatenate(kls)
    n = len(ref_tokens[0]) if ref_tokens else 0
    return {"mean_kl": float(kl.mean()), "max_kl": float(kl.max()), "num_positions": int(kl.size),
            "mean_leading_agreement": float(np.mean(agree)), "tokens_per_prompt": n,
            "fully_identical": float(np.mean([a == len(rt) for a, rt in zip(agree, ref_tokens)]))}
