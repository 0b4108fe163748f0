"""The reference generator: simple and obviously correct, kept forever as the oracle.

A contiguous KV cache [B, max_len, kv_heads, head_dim] per layer, one jitted prefill over a
right-padded batch and one jitted decode step, the same on-device sampler as the engine.
No paging, no scheduling, no buckets: the engine's outputs are tested against this.
"""

from __future__ import annotations

import functools
import secrets
from dataclasses import dataclass
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxinfer.config import Logprob, SamplingParams
from jaxinfer.attention.contiguous import contiguous_attention
from jaxinfer.engine import sampler as S
from jaxinfer.models.llama import LlamaForCausalLM


def derive_seed(seed: int | None, index: int) -> int:
    """The sampler seed of sample ``index`` of a request: reproducible for a given request
    seed, fresh randomness when the request gave none. Shared with the engine."""
    if seed is None:
        return secrets.randbits(32)
    return (seed * 0x9E3779B1 + index * 0x85EBCA77) & 0xFFFFFFFF


@dataclass
class RowResult:
    """One generated row: ids and per-token logprobs, before detokenization and stop strings."""

    token_ids: list[int]
    logprobs: list[Logprob] | None
    finish_reason: str           # "stop" (eos / stop token) or "length"
    stop_reason: int | None = None


def _forward_and_sample(graphdef, state, tokens, positions, cache, logits_index,
                        t: S.SamplingTensors, prompt_mask, counts, *, num_logprobs: int):
    """tokens, positions i32[B, seq] -> sampled i32[B] (+ logprobs), cache, counts."""
    model = nnx.merge(graphdef, state)
    B, seq = tokens.shape
    cfg = model.cfg
    attn = contiguous_attention(positions, B, seq, cfg.head_dim ** -0.5, cfg.sliding_window)
    logits, cache = model(tokens.reshape(-1), positions.reshape(-1), cache, attn, logits_index)
    out = S.sample(logits, t, num_logprobs, prompt_mask=prompt_mask, output_counts=counts)
    counts = counts.at[jnp.arange(B), out.token_ids].add(1)
    return out, cache, counts


class ReferenceGenerator:
    """Generates for a list of token-id prompts at once (a padded batch) or one at a time."""

    def __init__(self, model: LlamaForCausalLM):
        self.cfg = model.cfg
        self.dtype = model.dtype
        self.graphdef, self.state = nnx.split(model)
        self._step = jax.jit(functools.partial(_forward_and_sample, self.graphdef),
                             static_argnames=("num_logprobs",), donate_argnames=("cache", "counts"))

    def _cache(self, batch: int, max_len: int) -> list[tuple[jax.Array, jax.Array]]:
        shape = (batch, max_len, self.cfg.num_kv_heads, self.cfg.head_dim)
        return [(jnp.zeros(shape, self.dtype), jnp.zeros(shape, self.dtype))
                for _ in range(self.cfg.num_layers)]

    def generate(self, prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams],
                 seeds: Sequence[int], eos_token_ids: Sequence[int] = ()) -> list[RowResult]:
        """One row per prompt (expand n>1 before calling). Returns ids and logprobs per row;
        stop strings are the caller's (they need text)."""
        B, V = len(prompts), self.cfg.vocab_size
        if B == 0:
            return []
        lens = np.array([len(p) for p in prompts], np.int32)
        if lens.min() < 1:
            raise ValueError("prompt: empty token list")
        seq = int(-(-lens.max() // 16) * 16)            # pad to 16: fewer distinct compiles
        max_len = int(-(-max(seq, int((lens + [p.max_tokens for p in params]).max())) // 64) * 64)
        tokens = np.zeros((B, seq), np.int32)
        for b, p in enumerate(prompts):
            tokens[b, : len(p)] = p
        positions = np.broadcast_to(np.arange(seq, dtype=np.int32), (B, seq))
        prompt_mask = np.zeros((B, V), bool)
        for b, p in enumerate(prompts):
            prompt_mask[b, np.asarray(p)] = True
        k = max((p.logprobs or 0) for p in params)
        cache = self._cache(B, max_len)
        counts = jnp.zeros((B, V), jnp.int32)
        logits_index = np.arange(B, dtype=np.int32) * seq + lens - 1
        steps = np.zeros(B, np.int32)
        t = S.sampling_tensors_from_params(list(params), list(seeds), steps.tolist(), B)
        out, cache, counts = self._step(self.state, tokens, positions, cache, logits_index, t,
                                        prompt_mask, counts, num_logprobs=k)
        results = [RowResult([], [] if p.logprobs is not None else None, "length") for p in params]
        done = np.zeros(B, bool)
        stop_ids = [set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
                    for p in params]
        for step in range(int(max(p.max_tokens for p in params))):
            tok, lp, top_ids, top_lp = (np.asarray(a) for a in
                                        (out.token_ids, out.logprobs, out.top_ids, out.top_logprobs))
            for b in range(B):
                if done[b]:
                    continue
                r, tid = results[b], int(tok[b])
                r.token_ids.append(tid)
                if r.logprobs is not None:
                    kk = params[b].logprobs or 0
                    r.logprobs.append(Logprob(tid, float(lp[b]), tuple(
                        (int(i), float(x)) for i, x in zip(top_ids[b, :kk], top_lp[b, :kk]))))
                if tid in stop_ids[b]:
                    done[b], r.finish_reason, r.stop_reason = True, "stop", tid
                elif len(r.token_ids) >= params[b].max_tokens:
                    done[b] = True
            if done.all():
                break
            pos = (lens + step).astype(np.int32)[:, None]
            t = S.sampling_tensors_from_params(list(params), list(seeds), [step + 1] * B, B)
            out, cache, counts = self._step(self.state, tok[:, None].astype(np.int32), pos, cache,
                                            np.arange(B, dtype=np.int32), t, prompt_mask, counts,
                                            num_logprobs=k)
        return results

    def logits(self, prompt: Sequence[int]) -> np.ndarray:
        """f32[len(prompt), V]: every position's logits for one prompt (for numerics tests)."""
        n = len(prompt)
        model = nnx.merge(self.graphdef, self.state)
        tokens = jnp.asarray(prompt, jnp.int32)[None]
        positions = jnp.arange(n, dtype=jnp.int32)[None]
        attn = contiguous_attention(positions, 1, n, self.cfg.head_dim ** -0.5, self.cfg.sliding_window)
        logits, _ = model(tokens[0], positions[0], self._cache(1, n), attn)
        return np.asarray(logits)
