"""On-device sampling: one jittable function serves any mix of requests.

Every ``SamplingParams`` value reaches the device as a per-row array (``SamplingTensors``),
so greedy, seeded, top-k, top-p, min-p and penalized rows share one executable. The only
static inputs are the shapes and ``num_logprobs`` (the executable's top-K capacity).

Semantics (decided here, tested in tests/test_sampler.py):

* Order of processing, as in HF ``generate`` (and TGI for the watermark): watermark bias ->
  penalties -> temperature -> top-k -> top-p
  (on the top-k-renormalized distribution) -> min-p -> draw. Min-p compares
  ``p_i >= min_p * p_max``; renormalizing never changes that ratio and top-k / top-p always
  keep the top token, so min-p acts as an independent mask.
* Ties are ranked by token id (lower id first), like ``torch.argmax`` and ``lax.top_k``.
  Top-k keeps exactly the k best ranks; top-p keeps the ranks whose *exclusive* cumulative
  probability is ``< top_p``: the smallest prefix of the ranking with mass ``>= top_p``,
  never empty. ``top_k <= 0`` or ``>= vocab`` and ``top_p >= 1`` switch a filter off.
* Greedy rows (``temperature == 0``) take the first maximum of the penalized logits.
* Randomness: row key = ``fold_in(key(seed), step)`` (threefry), so a row's token depends
  only on its own logits, parameters, seed and step: not on batch size or neighbours.
  A 64-bit seed is kept whole (jax's own 32-bit seeding would drop the high word).
* Logprobs (the chosen token's and the top-K alternatives') come from the raw model
  logits, before penalties, temperature and filters: vLLM's default ("raw_logprobs").

Cost on a 2-core CPU (V = 49,152) is dominated by passes over [rows, V] arrays, so nothing
sorts a whole row (a stable sort of [128, V] takes ~1.5 s there), and rows are handled a
few at a time (see ``sample``). A sampled row takes one of these exact paths, chosen from
its own parameters only:

* ``1 <= top_k <= topk_cap``: the row's top-k candidates (a two-level ``lax.top_k`` of the
  narrowest width in a small ladder that covers its k) hold every token it can keep; top-p
  and min-p are applied to the ranked candidates and one uniform picks among them by
  inverse CDF.
* otherwise: inverse CDF over the vocabulary in token-id order (chunk sums, then a
  two-level search). A larger ``top_k`` becomes a mask by an exact bisection on the float
  bit patterns. Top-p is done by rejection: rounds of ``num_proposals`` draws from the
  min-p-filtered distribution are checked for nucleus membership in one pass each (a
  token is in the nucleus iff the mass ranked above it is ``< top_p``); the first draw
  that passes is the sample. A row whose ``NUM_ROUNDS * num_proposals`` draws all fail
  (probability ``<= (1 - top_p) ** 12`` by default) draws once more from the nucleus mask
  found by bisection. Either way the token follows the filtered, renormalized
  distribution exactly, up to float32 rounding (each token's probability is realized to
  within about 1e-7).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxinfer.engine_config import MAX_SPECULATIVE_TOKENS
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.engine.watermark import green_mask
from jaxinfer.reductions import row_sum

TOPK_CAP = 256        # rows with 1 <= top_k <= this choose among top-k candidates
NUM_PROPOSALS = 4     # nucleus rejection draws checked per row in one pass over the vocab
NUM_ROUNDS = 3        # passes of NUM_PROPOSALS draws before the exact bisection fallback
# Rows per scan step: keeps [rows, V] temporaries small and in cache. One row a step was
# faster than 4 everywhere measured (default model, 128-row sampler, Zen 3, 2026-11-29:
# a batch-1 greedy step 2.73 -> 1.71 ms, 32 sampled rows 13.8 -> 12.1 ms, the compile
# 7.4 -> 6.7 s): a block of 4 did 4 rows' work for a step's one real row, and 4-row
# temporaries bought nothing over the loop's per-row overhead.
ROW_BLOCK = 1
# Padding rows (no request: ``sampling_tensors_from_params``'s missing / None rows) carry
# this temperature: greedy like temperature 0 wherever read, and ``sample`` skips blocks of
# them, so a sampler wider than a step's rows costs little more than a narrow one.
PAD_TEMPERATURE = -1.0
_CHUNK = 128          # vocab chunk for the two-level argmax and inverse-CDF search
_TOPK_CHUNK = 32      # vocab chunk for the two-level top-k


# ----------------------------------------------------------------------------- tensors

@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingTensors:
    """Per-row sampling parameters for a batch of B rows (numpy on host, jax on device).

    All fields are data, none static: any mix of requests shares one executable.
    """

    temperature: jax.Array         # f32[B]; 0 = greedy
    top_k: jax.Array               # i32[B]; <= 0 or >= vocab = off
    top_p: jax.Array               # f32[B]; >= 1 = off
    min_p: jax.Array               # f32[B]; 0 = off
    repetition_penalty: jax.Array  # f32[B]; 1 = off
    presence_penalty: jax.Array    # f32[B]; 0 = off
    frequency_penalty: jax.Array   # f32[B]; 0 = off
    seed: jax.Array                # u32[B, 2]; (high, low) words of the 64-bit seed = key data
    step: jax.Array                # i32[B]; index of the output token being sampled (0 = first)
    num_logprobs: jax.Array        # i32[B]; -1 = no logprobs, k >= 0 = chosen + top k
    # Watermark (engine/watermark.py): delta added to the green list of the row's previous
    # token before penalties (TGI's order); 0 = off. threshold: the green-list cut.
    watermark_delta: jax.Array     # f32[B]
    watermark_threshold: jax.Array  # u32[B]
    prev_token: jax.Array          # i32[B]; the token fed at this step (the last of the row)
    # Speculative decoding with penalties (engine/speculative.py; -1 = none). A draft token
    # is fed without being counted in the row's penalty state (it may be rejected), so
    # ``draft_before`` lists the draft tokens fed in this verification's earlier slots,
    # which this row's penalties count on top of the state; ``counts_add`` the row's output
    # tokens the state still lacks (its accepted drafts of the previous step), folded in
    # before the step's own tokens.
    draft_before: jax.Array        # i32[B, MAX_SPECULATIVE_TOKENS]
    counts_add: jax.Array          # i32[B, MAX_SPECULATIVE_TOKENS]

    @property
    def batch_size(self) -> int:
        return int(self.temperature.shape[0])


def sampling_tensors_from_params(params: Sequence[SamplingParams | None], seeds: Sequence[int],
                                 steps: Sequence[int], batch_size: int,
                                 prev_tokens: Sequence[int] | None = None,
                                 draft_before: dict[int, Sequence[int]] | None = None,
                                 counts_add: dict[int, Sequence[int]] | None = None) -> SamplingTensors:
    """Host side: numpy arrays for ``batch_size`` rows; missing / None rows are greedy padding.

    ``seeds[i]`` is the row's explicit seed (the engine draws one when ``params.seed`` is
    None); it is taken modulo 2**64. ``steps[i]`` is the index of the token being sampled.
    ``prev_tokens[i]``: the row's last token (needed by watermarked rows only).
    ``draft_before`` / ``counts_add``: {row: tokens} (``SamplingTensors``: why), up to
    MAX_SPECULATIVE_TOKENS each.
    """
    n = len(params)
    if n > batch_size:
        raise ValueError(f"params: {n} rows do not fit batch_size {batch_size}")
    if len(seeds) != n or len(steps) != n:
        raise ValueError(f"seeds/steps: need one per row ({n}), got {len(seeds)} and {len(steps)}")
    f32 = lambda fill: np.full(batch_size, fill, np.float32)  # noqa: E731
    temp, top_p, min_p = f32(PAD_TEMPERATURE), f32(1.0), f32(0.0)
    rep, pres, freq = f32(1.0), f32(0.0), f32(0.0)
    top_k = np.zeros(batch_size, np.int32)
    seed = np.zeros((batch_size, 2), np.uint32)
    step = np.zeros(batch_size, np.int32)
    nlp = np.full(batch_size, -1, np.int32)
    wm_delta = np.zeros(batch_size, np.float32)
    wm_thr = np.zeros(batch_size, np.uint32)
    prev = np.zeros(batch_size, np.int32)
    extra = {}
    for name, given in (("draft_before", draft_before), ("counts_add", counts_add)):
        extra[name] = a = np.full((batch_size, MAX_SPECULATIVE_TOKENS), -1, np.int32)
        for i, toks in (given or {}).items():
            a[i, :len(toks)] = toks
    if prev_tokens is not None:
        if len(prev_tokens) != n:
            raise ValueError(f"prev_tokens: need one per row ({n}), got {len(prev_tokens)}")
        prev[:n] = prev_tokens
    for i, p in enumerate(params):
        if p is None:
            continue
        temp[i], top_p[i], min_p[i] = p.temperature, p.top_p, p.min_p
        top_k[i] = max(p.top_k, 0)
        rep[i], pres[i], freq[i] = p.repetition_penalty, p.presence_penalty, p.frequency_penalty
        s = int(seeds[i]) % (1 << 64)
        seed[i] = (s >> 32, s & 0xFFFFFFFF)
        step[i] = steps[i]
        nlp[i] = -1 if p.logprobs is None else p.logprobs
        if p.beam_width > 1:                 # the search ranks each beam's top candidates
            nlp[i] = SamplingParams.MAX_LOGPROBS
        elif p.best_of is not None and p.best_of > p.n:
            nlp[i] = max(nlp[i], 0)          # ranked by cumulative logprob
        if p.watermark is not None:
            if prev_tokens is None:
                raise ValueError("prev_tokens: watermarked rows need their previous token")
            wm_delta[i], wm_thr[i] = p.watermark.delta, p.watermark.threshold
    return SamplingTensors(temp, top_k, top_p, min_p, rep, pres, freq, seed, step, nlp,
                           wm_delta, wm_thr, prev, extra["draft_before"], extra["counts_add"])


# ----------------------------------------------------------------------------- token mask

@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TokenMask:
    """Per-row constraints built on the host (jaxinfer/engine/guided.py): grammar, bad
    words and min_tokens as allowed-token bits, and a sparse logit bias. Rows with
    ``active`` False are untouched; a block of rows with none skips the work."""

    bits: jax.Array         # i32[B, ceil(V / 32)]: bit j % 32 of word j // 32 = token j allowed
    bias_ids: jax.Array     # i32[B, NB]: token ids whose logits get bias_vals added
    bias_vals: jax.Array    # f32[B, NB]: 0 = padding
    active: jax.Array       # bool[B]


def apply_token_mask(logits: jax.Array, m: TokenMask) -> jax.Array:
    """f32[B, V] logits -> logit bias added, disallowed tokens -inf (active rows only)."""
    b, v = logits.shape
    with jax.named_scope("token_mask"):
        biased = logits.at[jnp.arange(b)[:, None], m.bias_ids].add(m.bias_vals)
        shifts = lax.broadcasted_iota(jnp.int32, (1, 1, 32), 2)
        allowed = ((m.bits[:, :, None] >> shifts) & 1).reshape(b, -1)[:, :v] == 1
        masked = jnp.where(allowed, biased, -jnp.inf)
        return jnp.where(m.active[:, None], masked, logits)


# ----------------------------------------------------------------------------- penalties

def apply_penalties(logits: jax.Array, prompt_mask: jax.Array, output_counts: jax.Array,
                    t: SamplingTensors) -> jax.Array:
    """Repetition (over prompt or output tokens), then frequency and presence (output only).

    logits f32[B, V]; prompt_mask bool[B, V] (token occurs in the prompt); output_counts
    i32[B, V] (occurrences in the output so far). As vLLM: a seen token's logit is divided
    by ``repetition_penalty`` when > 0 and multiplied otherwise; then
    ``logit -= frequency * count + presence * (count > 0)``.
    """
    with jax.named_scope("penalties"):
        out_seen = output_counts > 0
        rep = t.repetition_penalty[:, None]
        penalized = jnp.where(logits > 0, logits / rep, logits * rep)
        logits = jnp.where(prompt_mask | out_seen, penalized, logits)
        logits = logits - t.frequency_penalty[:, None] * output_counts.astype(logits.dtype)
        return logits - jnp.where(out_seen, t.presence_penalty[:, None], 0.0)


def add_counts(counts: jax.Array, rows: jax.Array, tokens: jax.Array) -> jax.Array:
    """``counts`` i32[R, V] with one more occurrence of each ``tokens`` i32[N, K] entry
    (-1: none) in row ``rows[n]`` (i32[N])."""
    return counts.at[jnp.broadcast_to(rows[:, None], tokens.shape), jnp.maximum(tokens, 0)].add(
        (tokens >= 0).astype(counts.dtype))


def any_penalty(t: SamplingTensors) -> jax.Array:
    return jnp.any((t.repetition_penalty != 1) | (t.presence_penalty != 0)
                   | (t.frequency_penalty != 0))


# ----------------------------------------------------------------------------- helpers

def _row_uniforms(t: SamplingTensors, n: int) -> jax.Array:
    """f32[B, n] uniforms in [0, 1): the row's stream for this step, from seed and step only."""
    keys = jax.random.wrap_key_data(t.seed, impl="threefry2x32")
    keys = jax.vmap(jax.random.fold_in)(keys, t.step.astype(jnp.uint32))
    return jax.vmap(lambda k: jax.random.uniform(k, (n,), jnp.float32))(keys)


def _first_max_index(x: jax.Array) -> jax.Array:
    """argmax over the last axis of f32[B, N], first index on ties, like torch.argmax.

    Two levels (chunk maxima, then one chunk): a plain argmax is a slow variadic reduce
    on XLA:CPU, and max + min-index materializes two [B, N] temporaries.
    """
    b, n = x.shape
    nc = -(-n // _CHUNK)
    if nc * _CHUNK != n:
        x = jnp.pad(x, ((0, 0), (0, nc * _CHUNK - n)), constant_values=-jnp.inf)
    xc = x.reshape(b, nc, _CHUNK)
    cmax = jnp.max(xc, axis=-1)                                           # [B, nc]
    m = jnp.max(cmax, axis=-1, keepdims=True)
    c = jnp.argmax(cmax == m, axis=-1)                                    # first chunk with the max
    row = jnp.take_along_axis(xc, c[:, None, None], axis=1)[:, 0]         # [B, CHUNK]
    return (c * _CHUNK + jnp.argmax(row == m, axis=-1)).astype(jnp.int32)


def _top_k(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """``lax.top_k`` over the last axis of f32[B, N] (same values, ids and id tie-break),
    faster on XLA:CPU for small k: the top k chunk maxima pick the k chunks of
    _TOPK_CHUNK tokens that hold every top-k token, and only those are ranked.

    (Exact with ties: chunks are ranked by max, then chunk id, and re-sorted by id, so
    the gathered tokens keep their id order.)
    """
    b, n = x.shape
    nc = -(-n // _TOPK_CHUNK)
    if k * _TOPK_CHUNK * 2 > n:
        return lax.optimization_barrier(tuple(lax.top_k(x, k)))
    if nc * _TOPK_CHUNK != n:
        x = jnp.pad(x, ((0, 0), (0, nc * _TOPK_CHUNK - n)), constant_values=-jnp.inf)
    xc = x.reshape(b, nc, _TOPK_CHUNK)
    # The barriers keep XLA from merging later slices of a result into the sort+slice that
    # its CPU TopK rewrite matches: without them a full sort of the vocabulary runs.
    _, cid = lax.optimization_barrier(tuple(lax.top_k(jnp.max(xc, axis=-1), k)))
    cid = jnp.sort(cid, axis=-1)                                          # [B, k] ascending
    g = jnp.take_along_axis(xc, cid[:, :, None], axis=1).reshape(b, k * _TOPK_CHUNK)
    gv, gi = lax.optimization_barrier(tuple(lax.top_k(g, k)))
    ids = jnp.take_along_axis(cid, gi // _TOPK_CHUNK, axis=1) * _TOPK_CHUNK + gi % _TOPK_CHUNK
    return gv, ids.astype(jnp.int32)


def _last_positive_index(w: jax.Array) -> jax.Array:
    idx = lax.broadcasted_iota(jnp.int32, w.shape, w.ndim - 1)
    return jnp.max(jnp.where(w > 0, idx, 0), axis=-1)


def _search(w: jax.Array, u: jax.Array) -> jax.Array:
    """Inverse CDF: for weights w f32[B, N] >= 0 (some > 0) and uniforms u f32[B, A],
    the first index whose inclusive cumulative weight exceeds ``u * sum(w)``: i32[B, A].

    Chunk sums, a cumsum over chunks, then a cumsum inside the one chunk hit, so the
    [B, N] array is read once. The result always has positive weight (rounding clamps).
    """
    b, n = w.shape
    if n <= 2 * _CHUNK:                      # small (top-k candidates): one level
        incl = jnp.cumsum(w, axis=-1)
        pos = jnp.sum(incl[:, None, :] <= (u * incl[:, -1:])[:, :, None], axis=-1)
        return jnp.minimum(pos, _last_positive_index(w)[:, None]).astype(jnp.int32)
    nc = -(-n // _CHUNK)
    if nc * _CHUNK != n:
        w = jnp.pad(w, ((0, 0), (0, nc * _CHUNK - n)))
    wc = w.reshape(b, nc, _CHUNK)
    sums = jnp.sum(wc, axis=-1)                                           # [B, nc]
    csum = jnp.cumsum(sums, axis=-1)
    target = u * csum[:, -1:]                                             # [B, A]
    chunk = jnp.sum(csum[:, None, :] <= target[:, :, None], axis=-1)     # [B, A]
    chunk = jnp.minimum(chunk, _last_positive_index(sums)[:, None])
    prev = jnp.where(chunk > 0, jnp.take_along_axis(csum, jnp.maximum(chunk - 1, 0), axis=1), 0.0)
    rows = jnp.take_along_axis(wc, chunk[:, :, None], axis=1)            # [B, A, CHUNK]
    inner = jnp.cumsum(rows, axis=-1)
    pos = jnp.sum(inner <= (target - prev)[:, :, None], axis=-1)
    pos = jnp.minimum(pos, _last_positive_index(rows))
    return (chunk * _CHUNK + pos).astype(jnp.int32)


def _ordered_key(s: jax.Array) -> jax.Array:
    """u32 keys with the order of the float values (-0.0 and +0.0 share one key)."""
    b = lax.bitcast_convert_type(jnp.where(s == 0, 0.0, s).astype(jnp.float32), jnp.uint32)
    return jnp.where((b >> 31) == 1, ~b, b | jnp.uint32(0x80000000))


def _bisect_boundary(key: jax.Array, w: jax.Array, thr: jax.Array, eligible: jax.Array) -> jax.Array:
    """Mask of the shortest prefix of the ranking (value desc, id asc) of ``eligible`` tokens
    whose weight reaches ``thr`` (all of them if none does), without sorting: bool[B, V].

    key u32[B, V] (``_ordered_key``), w f32[B, V] >= 0 (zero where not eligible), thr f32[B].
    The boundary value is the largest key t with sum(w[key >= t]) >= thr: a 32-step
    bisection over the u32 range. Tokens tied at t all weigh the same, so the number of
    them kept follows by division, and the id of the last one by a bisection over ids.
    """
    lo = jnp.min(jnp.where(eligible, key, jnp.uint32(0xFFFFFFFF)), axis=-1)
    hi = jnp.max(jnp.where(eligible, key, 0), axis=-1) + jnp.uint32(1)

    def value_step(_, lohi):
        lo, hi = lohi
        mid = lo + (hi - lo) // 2
        ok = jnp.sum(jnp.where(key >= mid[:, None], w, 0.0), axis=-1) >= thr
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)

    t, _ = lax.fori_loop(0, 32, value_step, (lo, hi))
    above = key > t[:, None]
    tie = eligible & (key == t[:, None])
    w_above = jnp.sum(jnp.where(above, w, 0.0), axis=-1)
    w_tie = jnp.max(jnp.where(tie, w, 0.0), axis=-1)
    # the m-th tie (by id) is kept while w_above + (m - 1) * w_tie < thr
    need = jnp.ceil((thr - w_above) / jnp.where(w_tie > 0, w_tie, 1.0))
    keep = jnp.clip(need, 1, jnp.sum(tie, axis=-1)).astype(jnp.int32)
    idx = lax.broadcasted_iota(jnp.int32, key.shape, 1)

    def id_step(_, lohi):                   # smallest id with `keep` ties at or below it
        lo, hi = lohi
        mid = (lo + hi) // 2
        ok = jnp.sum(tie & (idx <= mid[:, None]), axis=-1) >= keep
        return jnp.where(ok, lo, mid + 1), jnp.where(ok, mid, hi)

    n = key.shape[1]
    last, _ = lax.fori_loop(0, max(n - 1, 1).bit_length(), id_step,
                            (jnp.zeros_like(keep), jnp.full_like(keep, n - 1)))
    return eligible & (above | (tie & (idx <= last[:, None])))


# ----------------------------------------------------------------------------- paths

def _sample_from_candidates(s: jax.Array, t: SamplingTensors, u: jax.Array, cap: int) -> jax.Array:
    """Rows with 1 <= top_k <= cap: every keepable token is among the top ``cap``. i32[B].

    A top-k costs more the wider it is, so each row uses the narrowest width of a ladder
    that covers its top_k (rows are grouped by top_k, so a block rarely needs two). The
    width is the row's own choice: its float sums never depend on its neighbours.
    """
    widths = sorted({c for c in (cap // 16, cap // 4, cap) if c >= 1})
    rung = jnp.sum(t.top_k[:, None] > jnp.array(widths[:-1], jnp.int32), axis=1)
    tok = jnp.zeros(s.shape[0], jnp.int32)
    for i, width in enumerate(widths):
        mine = (rung == i) & (t.top_k >= 1) & (t.top_k <= cap)
        tok_i = lax.cond(jnp.any(mine), lambda w=width: _sample_from_top(s, t, u, w), lambda: tok)
        tok = jnp.where(mine, tok_i, tok)
    return tok


def _sample_from_top(s: jax.Array, t: SamplingTensors, u: jax.Array, width: int) -> jax.Array:
    with jax.named_scope(f"top{width}_candidates"):
        cv, ci = _top_k(s, width)                                   # [B, width], ranked
        e = jnp.exp(cv - cv[:, :1])                                 # p / p_max
        rank = lax.broadcasted_iota(jnp.int32, cv.shape, 1)
        wk = jnp.where(rank < t.top_k[:, None], e, 0.0)
        incl = jnp.cumsum(wk, axis=-1)
        excl = jnp.pad(incl, ((0, 0), (1, 0)))[:, :-1]
        in_p = (excl < t.top_p[:, None] * incl[:, -1:]) | (t.top_p[:, None] >= 1)
        keep = (wk > 0) & in_p & (e >= t.min_p[:, None])
        pos = _search(jnp.where(keep, e, 0.0), u[:, :1])
        return jnp.take_along_axis(ci, pos, axis=1)[:, 0]


def _sample_token_order(s: jax.Array, t: SamplingTensors, u: jax.Array, cap: int,
                        num_proposals: int) -> jax.Array:
    """Rows without a small top_k: inverse CDF in token order, top-p by rejection. i32[B].

    u f32[B, NUM_ROUNDS * num_proposals + 1]: the row's uniforms, used in order.
    """
    b, v = s.shape
    e = jnp.exp(s - jnp.max(s, axis=-1, keepdims=True))            # p / p_max
    big_k = (t.top_k > cap) & (t.top_k < v)
    ones = jnp.ones_like(s, dtype=bool)
    with jax.named_scope("large_top_k"):
        in_k = lax.cond(jnp.any(big_k),
                        lambda: _bisect_boundary(_ordered_key(s), jnp.ones_like(s),
                                                 t.top_k.astype(jnp.float32), ones) | ~big_k[:, None],
                        lambda: ones)
    w_k = jnp.where(in_k, e, 0.0)                                   # top-p acts on this
    w = jnp.where(e >= t.min_p[:, None], w_k, 0.0)                  # draws come from this
    nucleus = t.top_p < 1

    def rejection():
        p_mass = t.top_p * jnp.sum(w_k, axis=-1)
        # rows without a nucleus accept their first draw
        tok, done = _nucleus_rejection(s, w, w_k, jnp.where(nucleus, p_mass, jnp.inf), u, num_proposals)

        def fallback():
            with jax.named_scope("nucleus_bisection"):
                mask = _bisect_boundary(_ordered_key(s), w_k, p_mass, in_k)
                w2 = jnp.where(mask & (e >= t.min_p[:, None]), e, 0.0)
                return jnp.where(done, tok, _search(w2, u[:, -1:])[:, 0])

        return lax.cond(jnp.all(done), lambda: tok, fallback)

    return lax.cond(jnp.any(nucleus), rejection, lambda: _search(w, u[:, :1])[:, 0])


def _nucleus_rejection(s: jax.Array, w: jax.Array, w_k: jax.Array, p_mass: jax.Array,
                       u: jax.Array, a: int) -> tuple[jax.Array, jax.Array]:
    """Up to NUM_ROUNDS rounds of ``a`` draws from ``w``; a draw j is accepted iff the
    ``w_k`` mass ranked above it (value desc, id asc) is < p_mass. Rounds stop once every
    row has accepted one; each row keeps its first accepted draw. Returns (tok, done)."""
    b, v = s.shape
    idx = lax.broadcasted_iota(jnp.int32, (1, 1, v), 2)

    def round_(carry):
        r, tok, done = carry
        props = _search(w, lax.dynamic_slice_in_dim(u, r * a, a, axis=1))       # [B, A]
        sj = jnp.take_along_axis(s, props, axis=1)
        sv, sj = s[:, None, :], sj[:, :, None]                                    # [B, 1, V], [B, A, 1]
        ahead = (sv > sj) | ((sv == sj) & (idx < props[:, :, None]))              # ranked above draw
        ok = jnp.sum(jnp.where(ahead, w_k[:, None, :], 0.0), axis=-1) < p_mass[:, None]
        first = jnp.take_along_axis(props, jnp.argmax(ok, axis=1)[:, None], axis=1)[:, 0]
        tok = jnp.where(done, tok, first)
        return r + 1, tok, done | jnp.any(ok, axis=1)

    with jax.named_scope("nucleus_rejection"):
        _, tok, done = lax.while_loop(lambda c: (c[0] < NUM_ROUNDS) & ~jnp.all(c[2]), round_,
                                      (0, jnp.zeros(b, jnp.int32), jnp.zeros(b, bool)))
    return tok, done


# ----------------------------------------------------------------------------- sample

class SampleOutput(NamedTuple):
    token_ids: jax.Array      # i32[B]
    logprobs: jax.Array       # f32[B]: raw log-probability of the chosen token (0 if not asked)
    top_ids: jax.Array        # i32[B, K]: most likely raw tokens (zeros where num_logprobs <= 0)
    top_logprobs: jax.Array   # f32[B, K]: their log-probabilities, descending


def _check_shapes(logits: jax.Array, t: SamplingTensors, num_logprobs: int) -> None:
    if logits.ndim != 2:
        raise ValueError(f"logits: expected [batch, vocab], got shape {logits.shape}")
    b, v = logits.shape
    for f in dataclasses.fields(t):
        x = getattr(t, f.name)
        want = {"seed": (b, 2), "draft_before": (b, MAX_SPECULATIVE_TOKENS),
                "counts_add": (b, MAX_SPECULATIVE_TOKENS)}.get(f.name, (b,))
        if tuple(x.shape) != want:
            raise ValueError(f"SamplingTensors.{f.name}: expected shape {want}, got {tuple(x.shape)}")
    if not 0 <= num_logprobs <= v:
        raise ValueError(f"num_logprobs: must be in [0, vocab={v}], got {num_logprobs}")


def _check_penalty_state(prompt_mask, output_counts, penalty_rows, b: int, v: int):
    if prompt_mask is None and output_counts is None:
        if penalty_rows is not None:
            raise ValueError("penalty_rows: given without prompt_mask and output_counts")
        return None
    if prompt_mask is None or output_counts is None:
        raise ValueError("prompt_mask and output_counts: pass both or neither")
    for name, a in (("prompt_mask", prompt_mask), ("output_counts", output_counts)):
        if a.ndim != 2 or a.shape[1] != v:
            raise ValueError(f"{name}: expected [rows, vocab={v}], got shape {tuple(a.shape)}")
    if prompt_mask.shape != output_counts.shape:
        raise ValueError(f"prompt_mask {tuple(prompt_mask.shape)} and output_counts "
                         f"{tuple(output_counts.shape)}: shapes differ")
    if penalty_rows is None:
        if prompt_mask.shape[0] != b:
            raise ValueError(f"prompt_mask: {prompt_mask.shape[0]} rows for {b} logits rows "
                             "(pass penalty_rows to index a larger state)")
        penalty_rows = jnp.arange(b, dtype=jnp.int32)
    elif tuple(penalty_rows.shape) != (b,):
        raise ValueError(f"penalty_rows: expected shape ({b},), got {tuple(penalty_rows.shape)}")
    return prompt_mask, output_counts, penalty_rows


def sample(logits: jax.Array, t: SamplingTensors, num_logprobs: int = 0, *,
           prompt_mask: jax.Array | None = None, output_counts: jax.Array | None = None,
           penalty_rows: jax.Array | None = None, token_mask: TokenMask | None = None,
           topk_cap: int = TOPK_CAP, num_proposals: int = NUM_PROPOSALS,
           row_block: int = ROW_BLOCK) -> SampleOutput:
    """Sample one token per row. Jittable; ``num_logprobs`` (the top-K width) and the
    tuning knobs ``topk_cap``, ``num_proposals``, ``row_block`` are static; everything in
    ``t`` is data.

    logits f32[B, V] are the raw model logits. With ``prompt_mask`` bool[R, V] and
    ``output_counts`` i32[R, V] the penalties are applied first; logits row i reads penalty
    row ``penalty_rows[i]`` (i32[B]; default: R == B and row i), so a runner can pass its
    whole per-slot penalty state without gathering it (a gather would be a fresh [B, V]
    temporary). Those rows are read only when a row has a penalty. Logprobs always
    describe the raw logits (``t.num_logprobs`` < 0 rows get zeros).

    ``token_mask`` (TokenMask of B rows) is applied after the penalties, before
    temperature; logprobs still describe the raw logits.

    Rows are processed ``row_block`` at a time by a loop, grouped by the work they
    need: XLA:CPU materializes every [rows, V] intermediate (it fuses no elementwise work
    into reductions), and a whole-batch temporary is fresh memory every call, paid for in
    page faults; a block's temporaries stay in cache and are reused. Within a block each
    section (penalties, greedy, sampling paths, logprobs) runs under ``lax.cond`` only if
    one of its rows needs it.
    """
    _check_shapes(logits, t, num_logprobs)
    b, v = logits.shape
    pen = _check_penalty_state(prompt_mask, output_counts, penalty_rows, b, v)
    blk = max(d for d in range(1, min(row_block, b) + 1) if b % d == 0)
    cap = min(topk_cap, v)
    kw = dict(k=num_logprobs, cap=cap, num_proposals=num_proposals)
    logits = logits.astype(jnp.float32)
    # Blocks of rows that take the same path skip the other paths' work: visit rows
    # grouped by path. Each row's result is independent of its block-mates.
    order = jnp.argsort(_row_class(t, v, cap), stable=True).astype(jnp.int32)

    blocks = order.reshape(b // blk, blk)

    def block(rows):                                        # rows: i32[blk]
        tb = jax.tree.map(lambda a: a[rows], t)
        # a verification slot's penalties also count the draft tokens fed before it
        pen_of = None if pen is None else (lambda: (pen[0][pen[2][rows]], add_counts(
            pen[1][pen[2][rows]], jnp.arange(len(rows)), tb.draft_before)))
        mb = None if token_mask is None else jax.tree.map(lambda a: a[rows], token_mask)
        return _sample_block(logits[rows], pen_of, tb, mask=mb, **kw)

    def body(i, out):
        return jax.tree.map(lambda o, r: lax.dynamic_update_index_in_dim(o, r, i, 0), out, block(blocks[i]))

    # Padding rows sort last, so only the first ceil(real / blk) blocks hold a real row:
    # the loop stops there. The rest stay zeros, which nobody reads; a wide sampler (one
    # width for every bucket, engine/runner.py) costs a small step almost nothing more.
    num_blocks = (jnp.sum(t.temperature != PAD_TEMPERATURE) + blk - 1) // blk
    out = jax.tree.map(lambda a: jnp.zeros((b // blk,) + a.shape, a.dtype), jax.eval_shape(block, blocks[0]))
    out = lax.fori_loop(0, num_blocks, body, out)
    inverse = jnp.zeros(b, jnp.int32).at[order].set(jnp.arange(b, dtype=jnp.int32))
    return jax.tree.map(lambda a: a.reshape((b,) + a.shape[2:])[inverse], out)


def _row_class(t: SamplingTensors, v: int, cap: int) -> jax.Array:
    """Which sections a row needs, as a sort key: greedy, top-k candidates (by top_k),
    token order without / with nucleus; then whether it wants top logprobs; then penalties."""
    greedy = t.temperature <= 0
    small_k = ~greedy & (t.top_k >= 1) & (t.top_k <= cap) & (t.top_k < v)
    path = jnp.where(greedy, 0, jnp.where(small_k, t.top_k, jnp.where(t.top_p < 1, cap + 2, cap + 1)))
    path = jnp.where(t.temperature == PAD_TEMPERATURE, cap + 3, path)     # padding: last
    pen = (t.repetition_penalty != 1) | (t.presence_penalty != 0) | (t.frequency_penalty != 0)
    return path * 4 + (t.num_logprobs > 0) * 2 + pen


def _sample_block(raw: jax.Array, pen_of: Callable[[], tuple[jax.Array, jax.Array]] | None,
                  t: SamplingTensors, k: int, cap: int, num_proposals: int,
                  mask: TokenMask | None = None) -> SampleOutput:
    """One block of rows; ``pen_of()`` gathers the block's penalty state."""
    b, v = raw.shape
    x = lax.cond(jnp.any(t.watermark_delta > 0), lambda: _apply_watermark(raw, t), lambda: raw)
    if pen_of is not None:
        x = lax.cond(any_penalty(t), lambda: apply_penalties(x, *pen_of(), t), lambda: x)
    if mask is not None:
        x = lax.cond(jnp.any(mask.active), lambda y: apply_token_mask(y, mask), lambda y: y, x)
    greedy = t.temperature <= 0
    zeros = jnp.zeros(b, jnp.int32)
    with jax.named_scope("greedy"):
        tok = lax.cond(jnp.any(greedy), lambda: _first_max_index(x), lambda: zeros)

    def sampled():
        s = x / jnp.where(greedy, 1.0, t.temperature)[:, None]
        u = _row_uniforms(t, NUM_ROUNDS * num_proposals + 1)
        small_k = ~greedy & (t.top_k >= 1) & (t.top_k <= cap) & (t.top_k < v)
        other = ~greedy & ~small_k
        tok_small = lax.cond(jnp.any(small_k), lambda: _sample_from_candidates(s, t, u, cap),
                             lambda: zeros)
        tok_other = lax.cond(jnp.any(other),
                             lambda: _sample_token_order(s, t, u, cap, num_proposals), lambda: zeros)
        return jnp.where(greedy, tok, jnp.where(small_k, tok_small, tok_other))

    tok = lax.cond(jnp.all(greedy), lambda: tok, sampled)
    return logprobs_of(raw, tok, t.num_logprobs, k)


def _apply_watermark(logits: jax.Array, t: SamplingTensors) -> jax.Array:
    """Kirchenbauer et al.: + delta on the green list of each row's previous token."""
    with jax.named_scope("watermark"):
        green = green_mask(t.prev_token, logits.shape[1], t.watermark_threshold)
        return logits + jnp.where(green, t.watermark_delta[:, None], 0.0)


def logprobs_of(raw: jax.Array, tok: jax.Array, num_logprobs: jax.Array, k: int) -> SampleOutput:
    """raw f32[B, V] logits, tok i32[B] -> tok, its log-probability and the top-``k``
    (static) alternatives, for rows with ``num_logprobs`` (i32[B]) >= 0 (> 0 for the
    alternatives); zeros elsewhere. Also the prompt scorer's (engine/scoring.py)."""
    b = raw.shape[0]
    with jax.named_scope("logprobs"):
        def lse():      # summed in a fixed order: the same bits in any block / batch size
            m = jnp.max(raw, axis=-1)
            return m + jnp.log(row_sum(jnp.exp(raw - m[:, None])))

        lse = lax.cond(jnp.any(num_logprobs >= 0), lse, lambda: jnp.zeros(b, jnp.float32))
        chosen = jnp.take_along_axis(raw, tok[:, None], axis=1)[:, 0] - lse
        chosen = jnp.where(num_logprobs >= 0, chosen, 0.0)
        if k == 0:
            return SampleOutput(tok, chosen, jnp.zeros((b, 0), jnp.int32), jnp.zeros((b, 0), jnp.float32))
        top_v, top_i = lax.cond(jnp.any(num_logprobs > 0),
                                lambda: _top_k(raw, k),
                                lambda: (jnp.zeros((b, k), jnp.float32), jnp.zeros((b, k), jnp.int32)))
        return SampleOutput(tok, chosen, top_i, top_v - lse[:, None])


# ----------------------------------------------------------------------------- transfer

def greedy_output(logits: jax.Array, num_logprobs: int) -> SampleOutput:
    """Greedy tokens of f32[B, V] raw logits (ties to the lowest id: ``sample``'s greedy
    path for a row with no penalty and no mask, the same bits), with no logprobs, shaped
    like ``sample``'s output. For a speculative draft's multi-step decode, which only
    ever proposes greedy tokens: the full sampler in its loop was most of its compile."""
    b = logits.shape[0]
    zf, zi = jnp.zeros((b, num_logprobs), jnp.float32), jnp.zeros((b, num_logprobs), jnp.int32)
    return SampleOutput(_first_max_index(logits.astype(jnp.float32)), jnp.zeros((b,), jnp.float32), zi, zf)


def pack(out: SampleOutput) -> jax.Array:
    """One i32[B, 2 + 2K] array for a single device->host copy (floats bit-cast)."""
    f2i = lambda a: lax.bitcast_convert_type(a.astype(jnp.float32), jnp.int32)  # noqa: E731
    return jnp.concatenate([out.token_ids[:, None], f2i(out.logprobs)[:, None],
                            out.top_ids, f2i(out.top_logprobs)], axis=1)


def unpack(packed: np.ndarray) -> SampleOutput:
    """Host side inverse of ``pack``: numpy arrays."""
    packed = np.asarray(packed, dtype=np.int32)
    k = (packed.shape[1] - 2) // 2
    return SampleOutput(packed[:, 0].copy(), packed[:, 1].view(np.float32).copy(),
                        packed[:, 2:2 + k].copy(), packed[:, 2 + k:].view(np.float32).copy())
