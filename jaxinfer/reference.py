"""The reference generator: simple and obviously correct, kept forever as the oracle.

A contiguous KV cache per row (max_len positions, stored as that row's consecutive pages),
one jitted prefill over a right-padded batch and one jitted decode step, the same
on-device sampler as the engine. No scheduling, no page allocation, no buckets: the
engine's outputs are tested against this.

``attention="paged"`` (default) runs the engine's attention function over the contiguous
pages, so with ``batch_invariant=True`` (the engine's default too) a request's tokens here
are the same bits as in any engine batch: equality is exact by construction, not luck.
``attention="dense"`` is a plain masked softmax over the whole cache, an independent
implementation used by the numerics tests against HF transformers.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxinfer.models.config import ModelConfig
from jaxinfer.outputs import Logprob
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.attention.contiguous import contiguous_attention
from jaxinfer.attention import dispatch
from jaxinfer.engine import kv_cache as kvc
from jaxinfer.engine import sampler as S
from jaxinfer import matmul as M
from jaxinfer.models import layers as L
from jaxinfer.models.llama import LlamaForCausalLM

PAGE = 16   # the contiguous cache seen as pages (paged attention); a divisor of KV_BLOCK


@dataclass
class RowResult:
    """One generated row: ids and per-token logprobs, before detokenization and stop strings."""

    token_ids: list[int]
    logprobs: list[Logprob] | None
    finish_reason: str           # "stop" (eos / stop token) or "length"
    stop_reason: int | None = None


@functools.lru_cache(maxsize=None)
def _engine_attention(kv_dtype, alibi: bool = False) -> Callable:
    """The paged attention the engine picks for this backend and cache dtype
    (attention/dispatch.py "auto": the C++ kernel on CPU for float32 pages, else the jnp
    path), so this generator and the engine compute the same bits."""
    return dispatch.select("auto", kv_dtype=kv_dtype, alibi=alibi)[1]


def paged_contiguous_attention(positions: jax.Array, kv_lens: jax.Array, max_len: int,
                               cfg: ModelConfig):
    """AttentionFn over per-layer pages [B * max_len / PAGE, PAGE, KVH, D], row b owning
    pages [b * max_len / PAGE, (b + 1) * max_len / PAGE): the engine's attention on a
    contiguous layout. tokens are [B * seq] row-major at ``positions`` i32[B, seq]."""
    B, seq = positions.shape
    per_row = max_len // PAGE
    page_table = jnp.arange(B * per_row, dtype=jnp.int32).reshape(B, per_row)
    slots = (jnp.arange(B, dtype=jnp.int32)[:, None] * max_len + positions).reshape(-1)
    # Prefill (seq > 1) starts every row at position 0, so its q_len is its kv_len (the
    # right padding past it gives zero rows); decode adds one token per row.
    q_lens = kv_lens if seq > 1 else jnp.ones((B,), jnp.int32)
    alibi = L.model_alibi_slopes(cfg)          # ALiBi models (no tensor parallelism here)
    extra = {} if alibi is None else {"alibi_slopes": jnp.asarray(alibi)}

    def attn(layer: int, q, k, v, cache):
        k_pages, v_pages = kvc.write_kv(cache[0], cache[1], k, v, slots)
        o = _engine_attention(k_pages.dtype, bool(extra))(
            q, k_pages, v_pages, kv_lens, q_lens, page_table, num_decode=B if seq == 1 else 0,
            prefill_chunk=0 if seq == 1 else seq, **cfg.attention_kwargs(layer), **extra)
        return o, (k_pages, v_pages)

    return attn


def _forward(state, tokens, positions, kv_lens, cache, logits_index, *, graphdef,
             paged: bool, invariant: bool):
    """tokens, positions i32[B, seq] -> logits f32[B, V] (at ``logits_index``), cache."""
    model = nnx.merge(graphdef, state)
    B, seq = tokens.shape
    cfg = model.cfg
    if paged:
        max_len = cache[0][0].shape[0] * PAGE // B
        attn = paged_contiguous_attention(positions, kv_lens, max_len, cfg)
    else:
        attn = contiguous_attention(positions, B, seq, cfg)
    mm = M.tiled_matmul if invariant else M.matmul
    return model(tokens.reshape(-1), positions.reshape(-1), cache, attn, logits_index, mm)


def _sample(logits, t: S.SamplingTensors, prompt_mask, counts, *, num_logprobs: int):
    """logits f32[B, V] -> sampled i32[B] (+ logprobs), counts with the samples added."""
    out = S.sample(logits, t, num_logprobs, prompt_mask=prompt_mask, output_counts=counts)
    counts = counts.at[jnp.arange(logits.shape[0]), out.token_ids].add(1)
    return out, counts


# Two jitted functions for every generator, as the engine's runner has (a forward and a
# sampler executable): generators of the same model structure share the forward's
# executables (the graphdef is a hashable static argument), and every generator with the
# same batch and vocabulary shares the sampler's, prefill and decode alike: the sampler is
# most of a small model's compile time.
# Made on first use: the compile options depend on the backend, which importing must not
# initialize (a process sets its CPU device count after importing jaxinfer).
@functools.cache
def _jitted() -> tuple[Callable, Callable]:
    from jaxinfer.engine.resources import compiler_options

    opts = compiler_options()
    return (jax.jit(_forward, static_argnames=("graphdef", "paged", "invariant"), donate_argnames=("cache",),
                    compiler_options=opts),
            jax.jit(_sample, static_argnames=("num_logprobs",), donate_argnames=("counts",), compiler_options=opts))


def _forward_and_sample(state, tokens, positions, kv_lens, cache, logits_index,
                        t: S.SamplingTensors, prompt_mask, counts, *, graphdef, num_logprobs: int,
                        paged: bool, invariant: bool):
    """One step: the forward, then the sampler. -> (SampleOutput, cache, counts)."""
    forward, sample = _jitted()
    logits, cache = forward(state, tokens, positions, kv_lens, cache, logits_index, graphdef=graphdef,
                             paged=paged, invariant=invariant)
    out, counts = sample(logits, t, prompt_mask, counts, num_logprobs=num_logprobs)
    return out, cache, counts


def _pad_len(n: int, minimum: int) -> int:
    """Next power of two >= max(n, minimum): a short ladder of shapes, few compiles."""
    return max(minimum, 1 << (max(n, 1) - 1).bit_length())


class ReferenceGenerator:
    """Generates for a list of token-id prompts at once (a padded batch) or one at a time."""

    def __init__(self, model: LlamaForCausalLM, *, attention: str = "paged",
                 batch_invariant: bool = True):
        if attention not in ("paged", "dense"):
            raise ValueError(f"attention: must be 'paged' or 'dense', got {attention!r}")
        self.cfg = model.cfg
        self.dtype = model.dtype
        self.paged = attention == "paged"
        self.invariant = batch_invariant
        self.graphdef, self.state = nnx.split(model)
        self._step = functools.partial(_forward_and_sample, graphdef=self.graphdef, paged=self.paged,
                                       invariant=batch_invariant)

    def _cache(self, batch: int, max_len: int) -> list[tuple[jax.Array, jax.Array]]:
        if self.paged:
            shape = (batch * max_len // PAGE, PAGE, self.cfg.num_kv_heads, self.cfg.head_dim)
        else:
            shape = (batch, max_len, self.cfg.num_kv_heads, self.cfg.head_dim)
        return [(jnp.zeros(shape, self.dtype), jnp.zeros(shape, self.dtype))
                for _ in range(self.cfg.num_layers)]

    def generate(self, prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams],
                 seeds: Sequence[int], eos_token_ids: Sequence[int] = (), pad_to: int = 0,
                 cache_len: int = 0) -> list[RowResult]:
        """One row per prompt (expand n>1 before calling). Returns ids and logprobs per row;
        stop strings are the caller's (they need text). ``pad_to``: pad prompts and cache to
        at least this many tokens, so calls with different prompt lengths share one compiled
        shape (the results do not depend on the padding). ``cache_len``: the KV cache holds at
        least this many positions (calls with different ``pad_to`` then share the decode
        step's compiled shape)."""
        B, V = len(prompts), self.cfg.vocab_size
        if B == 0:
            return []
        tokens, lens, max_len, prompt_mask = _prompt_batch(prompts, params, V, pad_to, cache_len)
        seq = tokens.shape[1]
        positions = np.broadcast_to(np.arange(seq, dtype=np.int32), (B, seq))
        # Always the full top-K capacity (SamplingParams bounds logprobs by it), as the
        # engine's sampler: one sampler executable per batch shape whatever the requests
        # ask for (the tokens and each logprob do not depend on K).
        k = min(SamplingParams.MAX_LOGPROBS, V)
        cache = self._cache(B, max_len)
        counts = jnp.zeros((B, V), jnp.int32)
        logits_index = np.arange(B, dtype=np.int32) * seq + lens - 1
        steps = np.zeros(B, np.int32)
        t = S.sampling_tensors_from_params(list(params), list(seeds), steps.tolist(), B)
        out, cache, counts = self._step(self.state, tokens, positions, lens, cache, logits_index,
                                        t, prompt_mask, counts, num_logprobs=k)
        results = [RowResult([], [] if p.logprobs is not None else None, "length") for p in params]
        done = np.zeros(B, bool)
        stop_ids = [set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
                    for p in params]
        for step in range(int(max(p.max_tokens for p in params))):
            tok = _take_tokens(out, results, done, params, stop_ids)
            if done.all():
                break
            pos = (lens + step).astype(np.int32)[:, None]
            t = S.sampling_tensors_from_params(list(params), list(seeds), [step + 1] * B, B)
            out, cache, counts = self._step(self.state, tok[:, None].astype(np.int32), pos,
                                            pos[:, 0] + 1, cache, np.arange(B, dtype=np.int32), t,
                                            prompt_mask, counts, num_logprobs=k)
        return results

    def logits(self, prompt: Sequence[int]) -> np.ndarray:
        """f32[len(prompt), V]: every position's logits for one prompt (for numerics tests)."""
        n = len(prompt)
        model = nnx.merge(self.graphdef, self.state)
        tokens = jnp.asarray(prompt, jnp.int32)[None]
        positions = jnp.arange(n, dtype=jnp.int32)[None]
        if self.paged:
            max_len = -(-n // 128) * 128
            attn = paged_contiguous_attention(positions, jnp.array([n], jnp.int32), max_len, self.cfg)
        else:
            max_len = n
            attn = contiguous_attention(positions, 1, n, self.cfg)
        mm = M.tiled_matmul if self.invariant else M.matmul
        logits, _ = model(tokens[0], positions[0], self._cache(1, max_len), attn, None, mm)
        return np.asarray(logits)


def _prompt_batch(prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams], vocab_size: int,
                  pad_to: int, cache_len: int) -> tuple[np.ndarray, np.ndarray, int, np.ndarray]:
    """(tokens i32[B, seq] padded, lengths i32[B], the KV cache's positions per row, the
    prompts' tokens as bool[B, V] for the repetition penalty)."""
    lens = np.array([len(p) for p in prompts], np.int32)
    if lens.min() < 1:
        raise ValueError("prompt: empty token list")
    seq = _pad_len(max(int(lens.max()), pad_to), 16)
    # >= 128, a multiple of the attention's KV block: whole blocks per row.
    max_len = _pad_len(max(seq, pad_to, cache_len, int((lens + [p.max_tokens for p in params]).max())), 128)
    tokens = np.zeros((len(prompts), seq), np.int32)
    prompt_mask = np.zeros((len(prompts), vocab_size), bool)
    for b, p in enumerate(prompts):
        tokens[b, : len(p)] = p
        prompt_mask[b, np.asarray(p)] = True
    return tokens, lens, max_len, prompt_mask


def _take_tokens(out: S.SampleOutput, results: list[RowResult], done: np.ndarray,
                 params: Sequence[SamplingParams], stop_ids: list[set[int]]) -> np.ndarray:
    """One step's sampled tokens into the rows not done yet (their logprobs, a stop token or
    max_tokens ending them); returns the tokens, i32[B]."""
    tok, lp, top_ids, top_lp = (np.asarray(a) for a in (out.token_ids, out.logprobs, out.top_ids, out.top_logprobs))
    for b, r in enumerate(results):
        if done[b]:
            continue
        tid = int(tok[b])
        r.token_ids.append(tid)
        if r.logprobs is not None:
            kk = params[b].logprobs or 0
            r.logprobs.append(Logprob(tid, float(lp[b]), tuple(
                (int(i), float(x)) for i, x in zip(top_ids[b, :kk], top_lp[b, :kk]))))
        if tid in stop_ids[b]:
            done[b], r.finish_reason, r.stop_reason = True, "stop", tid
        elif len(r.token_ids) >= params[b].max_tokens:
            done[b] = True
    return tok
