"""Prompt logprobs (``SamplingParams.prompt_logprobs``): the log-probability of every prompt
token given the ones before it, with the top-k alternatives (what evaluation harnesses
score a model by: OpenAI ``echo`` + ``logprobs``, vLLM ``prompt_logprobs``).

They are computed where the prompt is: in the prefill steps. A step whose chunks ask for
them runs in a scoring bucket (``Bucket.score``, batch.py): its executable computes the
logits of every token position, not only the sampled ones, and scores position ``p``
against the next prompt token (``StepBatch.score_targets``) with ``score_rows`` below.
So chunked prefill, packed prefill and preemption need nothing special: whichever step
computes a position scores it, and a recomputed position gets the same bits again.
Prefix-cache hits would skip positions, so a sequence that wants prompt logprobs never
starts from a cache hit (scheduler.py); siblings (``n > 1``) still share the first
one's prompt pages, whose positions that one scored.

Numerics: a position's logprobs are the sampler's (``sampler.logprobs_of``: log-softmax
with the fixed-order ``row_sum``, exact top-k), so they do not depend on the rows beside
it, the bucket or how the prompt was cut (tests/test_prompt_logprobs.py checks them
against HF transformers alone, batched and chunked).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxinfer.outputs import Logprob
from jaxinfer.engine import sampler as S

ROW_BLOCK = 8      # rows scored per scan step: keeps the [rows, V] temporaries in cache


def score_rows(logits: jax.Array, targets: jax.Array, ks: jax.Array, k: int) -> jax.Array:
    """logits f32[T, V], targets i32[T], ks i32[T] (-1: row not scored) -> packed
    i32[T, 2 + 2k] (``sampler.pack`` layout: target, its logprob, top-k ids and logprobs).
    Blocks of rows none of which is scored skip the work (padding, other requests)."""
    T, V = logits.shape
    blk = max(d for d in range(1, min(ROW_BLOCK, T) + 1) if T % d == 0)

    def body(_, xs):
        x, tgt, kb = xs
        out = lax.cond(jnp.any(kb >= 0), lambda: S.pack(S.logprobs_of(x, tgt, kb, k)),
                       lambda: jnp.zeros((blk, 2 + 2 * k), jnp.int32))
        return None, out

    xs = (logits.astype(jnp.float32).reshape(T // blk, blk, V), targets.reshape(T // blk, blk),
          ks.reshape(T // blk, blk))
    _, out = lax.scan(body, None, xs)
    return out.reshape(T, 2 + 2 * k)


def collect(batch: Any, packed: np.ndarray, sink: Callable[[Any], list | None]) -> None:
    """Host side, after a scoring step: write each scored position's Logprob into
    ``sink(seq)`` (the request's prompt-logprob list, one entry per prompt token, or None
    to drop them) at the index of the token it scores."""
    res = S.unpack(packed)
    for e, row0, pos0, n in batch.scored:
        out = sink(e.seq)
        if out is None:
            continue
        k = e.seq.params.prompt_logprobs
        for i in range(n):
            r = row0 + i
            out[pos0 + i + 1] = Logprob(int(res.token_ids[r]), float(res.logprobs[r]), tuple(
                (int(t), float(v)) for t, v in zip(res.top_ids[r, :k], res.top_logprobs[r, :k])))
