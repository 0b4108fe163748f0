"""Pure-jnp ragged paged attention: the CPU path of the engine and the reference for kernels.

Two functions share one meaning:

* ``ragged_paged_attention`` — the fast path, on the step layout the batch builder makes
  (engine/batch.py): ``num_decode`` one-token slots, then ``num_prefill`` slots of
  ``prefill_chunk`` token positions each. Used by the engine on CPU.
* ``ragged_paged_attention_reference`` — slow and plain, on the generic ragged description
  (each sequence's first token ``q_starts[s]`` and ``q_lens[s]``; a ``cu_q_lens`` layout is
  ``q_starts = cu_q_lens[:-1]``). The fast path and every Pallas kernel are tested against it.

Semantics (both): K/V of this step are already in the pages. Query ``j`` of sequence ``s``
sits at absolute position ``kv_lens[s] - q_lens[s] + j`` and attends to KV positions
``<= pos`` (and ``> pos - sliding_window`` when a window is set). Query head ``h`` uses KV
head ``h // (H // KVH)`` (HF's repeat_kv). Softmax is in f32 whatever the cache dtype.
Unused slots (q_len 0) and query rows past q_len give exact zeros. Positions past kv_len and
unused page-table entries (page 0) are masked with selects, never multiplied, so NaN
garbage there cannot leak. ALiBi (``alibi_slopes`` f32[H], BLOOM / MPT): query head h adds
``slopes[h] * (kv_pos - pos)`` to its scaled scores (the same softmax as HF's
``slopes * kv_pos``, whose extra per-row constant cancels).

Batch invariance (the fast path): a sequence's output must not depend on what else is in
the step, nor on the bucket (num_decode, num_prefill, prefill_chunk, max_pages_per_seq).
So the KV axis is cut into fixed blocks of ``KV_BLOCK`` absolute token positions, each
block is reduced on its own (its scores' dot over head_dim, its row max, its exp-sum and
its P@V over exactly KV_BLOCK positions), and blocks are folded in increasing order with
the online-softmax update. A block that is entirely masked for a row leaves that row's
running (max, sum, acc) bitwise unchanged (alpha = exp(0) = 1, p = exp(-inf) = 0), so
padding pages, a longer page table, or a trip count set by a longer neighbour change
nothing. The exp-sum is a fixed tree of adds (XLA's reduce changes its order with the
array's size); the two dots rely on XLA:CPU's GEMM summing each output over head_dim (or
the block) in one order whatever the batch and row counts, which holds from KV_BLOCK 64
up and is asserted by the tests. Result: a token's output bits depend only on its q, its
sequence's K/V and its position — not on the batch, the bucket, whether it rides in a
decode or a prefill slot, how its prompt was chunked, or the page size (any divisor of
KV_BLOCK). tests/test_attention_xla.py asserts each of these bitwise.

Layout choices (benchmarks/attention_cpu.py has the figures): per KV block the gathered
pages are laid out K [S, KVH, D, blk] and V [S, KVH, blk, D], and query heads are grouped
as [S, KVH, Q*G, D], so both dots are plain batched GEMMs without hidden transposes. On
CPU the page gather dominates (XLA's gather copies at memcpy speed); the per-block loop
keeps each gathered block small, and stops at the longest sequence rather than at the
page table's width.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

# Tokens per KV block. A property of the numerics (the reduction order), not of the cache:
# every page size that divides it gives the same bits (a larger page makes the block one
# page). Not below 64: with 32-wide blocks XLA's CPU dot (YNNPACK) sums the head_dim
# products of a few query rows (decode) in another order than of many (prefill), so a
# token's bits would depend on which slot kind it rode in; from 64 up the order is the
# same for 1..1024 rows (measured; tests/test_attention_xla.py guards it). 64 and 128
# measured alike for decode and prefill (benchmarks/attention_cpu.py, "block"); 64 stops
# the loop closer to the longest sequence.
KV_BLOCK = 64
# Query tokens per block of a prefill chunk; each query block visits only the KV blocks
# its rows can see, so a causal chunk costs about half its square.
Q_BLOCK = 64

_NEG_INF = float("-inf")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def check_args(q, k_pages, v_pages, kv_lens, q_lens, page_table, num_decode: int,
           prefill_chunk: int) -> None:
    if q.ndim != 3:
        raise ValueError(f"q: expected [T, H, D], got shape {q.shape}")
    if k_pages.ndim != 4 or v_pages.shape != k_pages.shape:
        raise ValueError(f"k_pages/v_pages: expected equal [num_pages, page_size, KVH, D], got "
                         f"{k_pages.shape} and {v_pages.shape}")
    T, H, D = q.shape
    _, _, KVH, Dk = k_pages.shape
    if Dk != D:
        raise ValueError(f"head_dim: q has {D}, k_pages has {Dk}")
    if H % KVH:
        raise ValueError(f"num_heads ({H}) must be a multiple of num_kv_heads ({KVH})")
    if page_table.ndim != 2:
        raise ValueError(f"page_table: expected [S, max_pages_per_seq], got {page_table.shape}")
    S = page_table.shape[0]
    if kv_lens.shape != (S,) or q_lens.shape != (S,):
        raise ValueError(f"kv_lens/q_lens: expected [{S}] (page_table rows), got "
                         f"{kv_lens.shape} and {q_lens.shape}")
    if not 0 <= num_decode <= S:
        raise ValueError(f"num_decode: {num_decode} is outside [0, {S}] (S = page_table rows)")
    want = num_decode + (S - num_decode) * prefill_chunk
    if T != want:
        raise ValueError(f"T (q rows) = {T}, but num_decode + num_prefill * prefill_chunk = "
                         f"{num_decode} + {S - num_decode} * {prefill_chunk} = {want}")


@functools.partial(jax.jit, static_argnames=("num_decode", "prefill_chunk", "sm_scale",
                                             "sliding_window", "soft_cap"))
def ragged_paged_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                           kv_lens: jax.Array, q_lens: jax.Array, page_table: jax.Array, *,
                           num_decode: int, prefill_chunk: int, sm_scale: float,
                           sliding_window: int | None = None,
                           soft_cap: float | None = None,
                           alibi_slopes: jax.Array | None = None) -> jax.Array:
    """Attention of a step's flattened tokens over their sequences' KV pages.

    q [T, H, D]; k_pages, v_pages [N, page_size, KVH, D] (f32 or bf16); kv_lens, q_lens
    i32[S]; page_table i32[S, max_pages_per_seq]. Static: num_decode, prefill_chunk (with
    num_prefill = S - num_decode, T = num_decode + num_prefill * prefill_chunk).
    Returns [T, H, D] in q's dtype.
    """
    check_args(q, k_pages, v_pages, kv_lens, q_lens, page_table, num_decode, prefill_chunk)
    T, H, D = q.shape
    S = page_table.shape[0]
    num_prefill = S - num_decode
    if alibi_slopes is not None and alibi_slopes.shape != (H,):
        raise ValueError(f"alibi_slopes: expected [{H}] (one per query head), got {alibi_slopes.shape}")
    kw = dict(sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
              alibi_slopes=alibi_slopes)
    parts = []
    if num_decode:
        qd = q[:num_decode].reshape(num_decode, 1, H, D)
        parts.append(_attend_slots(qd, k_pages, v_pages, kv_lens[:num_decode],
                                   q_lens[:num_decode], page_table[:num_decode], **kw))
    if num_prefill and prefill_chunk:
        qp = q[num_decode:].reshape(num_prefill, prefill_chunk, H, D)
        parts.append(_attend_slots(qp, k_pages, v_pages, kv_lens[num_decode:],
                                   q_lens[num_decode:], page_table[num_decode:], **kw))
    if not parts:
        return jnp.zeros_like(q)
    out = jnp.concatenate([p.reshape(-1, H, D) for p in parts], axis=0)
    return out.astype(q.dtype)


def _attend_slots(q, k_pages, v_pages, kv_lens, q_lens, page_table, *, sm_scale: float,
                  sliding_window: int | None, soft_cap: float | None, alibi_slopes=None,
                  kv_block: int = KV_BLOCK, q_block: int = Q_BLOCK) -> jax.Array:
    """q [S, Q, H, D]: slot s's query j is at kv_lens[s] - q_lens[s] + j. -> f32[S, Q, H, D].

    Queries are cut into blocks of ``q_block`` (a prefill chunk; decode has one) and each
    query block loops over just the KV blocks its rows can see, so a causal chunk costs
    about half its square. Per row, the blocks skipped are exactly the all-masked ones,
    which would have been no-ops: the bits do not depend on the cut.
    """
    S, Q, H, D = q.shape
    _, ps, KVH, _ = k_pages.shape
    G = H // KVH
    P = page_table.shape[1]
    blk = max(kv_block, ps)
    if blk % ps:
        raise ValueError(f"page_size ({ps}) must divide the KV block ({kv_block})")
    ppb = blk // ps
    nb = _cdiv(P, ppb)
    pt = jnp.pad(page_table, ((0, 0), (0, nb * ppb - P)))           # pad with page 0
    pt = pt.reshape(S, nb, ppb)

    qb = min(Q, q_block)
    nqb = _cdiv(Q, qb)
    qf = q.astype(jnp.float32)
    if nqb * qb != Q:                                               # rows past q_len: masked
        qf = jnp.pad(qf, ((0, 0), (0, nqb * qb - Q), (0, 0), (0, 0)))
    # row r = j * G + g of KV head k in a query block is query head k * G + g of token j
    qk = qf.reshape(S, nqb, qb, KVH, G, D).transpose(1, 0, 3, 2, 4, 5)
    qk = qk.reshape(nqb, S, KVH, qb * G, D)
    start = kv_lens - q_lens                                        # position of query 0
    # ALiBi slope of each row r = j * G + g of KV head k: head k * G + g's
    row_slopes = None if alibi_slopes is None else \
        alibi_slopes.astype(jnp.float32).reshape(KVH, G)[:, jnp.arange(qb * G) % G]   # [KVH, Mb]

    def one_qblock(i, qk_i):
        j = i * qb + jnp.arange(qb * G) // G                        # query index of each row
        qpos = start[:, None] + j[None, :]                          # [S, Mb]
        row_ok = j[None, :] < q_lens[:, None]                       # [S, Mb]
        live = q_lens > i * qb                                      # slots with rows here
        end = start + jnp.minimum(q_lens, (i + 1) * qb)             # one past the last row
        hi = jnp.minimum(_cdiv_arr(jnp.max(jnp.where(live, end, 0)), blk), nb)
        if sliding_window is None:
            lo = jnp.int32(0)
        else:
            first = start + i * qb - sliding_window + 1
            first = jnp.min(jnp.where(live, first, jnp.iinfo(jnp.int32).max))
            lo = jnp.clip(first // blk, 0, hi)
        return _kv_loop(qk_i, qpos, row_ok, lo, hi, k_pages, v_pages, kv_lens, pt, blk=blk,
                        sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
                        row_slopes=row_slopes)

    if nqb == 1:
        out = one_qblock(0, qk[0])[None]
    else:
        out = lax.map(lambda a: one_qblock(*a), (jnp.arange(nqb), qk))
    out = out.reshape(nqb, S, KVH, qb, G, D).transpose(1, 0, 3, 2, 4, 5)
    return out.reshape(S, nqb * qb, H, D)[:, :Q]


def _kv_loop(qk, qpos, row_ok, lo, hi, k_pages, v_pages, kv_lens, pt, *, blk: int,
             sm_scale: float, sliding_window: int | None, soft_cap: float | None,
             row_slopes: jax.Array | None = None):
    """Online softmax of qk [S, KVH, Mb, D] over KV blocks [lo, hi) -> [S, KVH, Mb, D].

    Per block the gathered K is laid out [S, KVH, D, blk] and V [S, KVH, blk, D], so both
    dots are plain batched GEMMs (batch S*KVH, Mb query rows per KV head).
    """
    S, KVH, Mb, D = qk.shape

    def body(b, carry):
        m, l, acc = carry
        pages = lax.dynamic_index_in_dim(pt, b, axis=1, keepdims=False)      # [S, ppb]
        kvpos = b * blk + jnp.arange(blk)                                     # [blk]
        kv_ok = kvpos[None, :] < kv_lens[:, None]                             # [S, blk]
        kb = _gather_block(k_pages, pages)                                    # [S, blk, KVH, D]
        vb = _gather_block(v_pages, pages)
        kb = kb.transpose(0, 2, 3, 1)                                          # [S, KVH, D, blk]
        vb = jnp.where(kv_ok[:, :, None, None], vb, 0.0)
        vb = vb.transpose(0, 2, 1, 3)                                          # [S, KVH, blk, D]
        s = jnp.einsum("skmd,skdn->skmn", qk, kb) * sm_scale                  # [S, KVH, Mb, blk]
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        if row_slopes is not None:                                            # ALiBi
            dist = (kvpos[None, None, :] - qpos[:, :, None]).astype(jnp.float32)   # [S, Mb, blk]
            s = s + row_slopes[None, :, :, None] * dist[:, None]
        ok = kv_ok[:, None, :] & (kvpos[None, None, :] <= qpos[:, :, None]) & row_ok[:, :, None]
        if sliding_window is not None:
            ok &= kvpos[None, None, :] > qpos[:, :, None] - sliding_window
        s = jnp.where(ok[:, None], s, _NEG_INF)
        m_new = jnp.maximum(m, s.max(-1))                                     # [S, KVH, Mb]
        safe = jnp.where(m_new == _NEG_INF, 0.0, m_new)
        p = jnp.exp(s - safe[..., None])
        alpha = jnp.exp(m - safe)
        l = l * alpha + _tree_sum(p)
        acc = acc * alpha[..., None] + jnp.einsum("skmn,sknd->skmd", p, vb)
        return m_new, l, acc

    init = (jnp.full((S, KVH, Mb), _NEG_INF, jnp.float32), jnp.zeros((S, KVH, Mb), jnp.float32),
            jnp.zeros((S, KVH, Mb, D), jnp.float32))
    m, l, acc = lax.fori_loop(lo, hi, body, init)
    return jnp.where(l[..., None] > 0, acc / jnp.where(l > 0, l, 1.0)[..., None], 0.0)


def _gather_block(pages_arr: jax.Array, pages: jax.Array) -> jax.Array:
    """The tokens of ``pages`` i32[S, ppb] as f32[S, ppb * page_size, KVH, D].

    With several pages per block the gather indexes token rows (page * page_size +
    offset) of the [N * page_size, KVH, D] view: ~20% faster on XLA:CPU than gathering
    whole [page_size, KVH, D] slices (measured at page 16; a block of one page is fastest
    as a page gather).

    XLA:CPU has no bf16 gather: gathering a bf16 cache makes it convert the WHOLE cache
    to f32 on every layer (hoisted out of the loop). Gathering the uint16 bits and widening
    with a shift is faster, but the bf16 -> uint16 bitcast of the cache is still a
    whole-cache copy per layer on XLA:CPU (both slower than f32 pages: benchmarks/
    attention_cpu.py; RESULTS.md, "Design measurements"). So on CPU
    keep the KV cache in f32; bf16 pages pay off only where gathers are native (TPU/GPU).
    """
    N, ps, KVH, D = pages_arr.shape
    S, ppb = pages.shape
    if hasattr(pages_arr, "scale"):       # int8 pages (kv_cache.QuantizedPages): q * scale
        rows = (pages[:, :, None] * ps + jnp.arange(ps, dtype=pages.dtype)).reshape(S, ppb * ps)
        q = pages_arr.q.reshape(N * ps, KVH, D)[rows]                          # [S, blk, KVH, D]
        scale = pages_arr.scale.reshape(N * ps, KVH)[rows]                     # [S, blk, KVH]
        return q.astype(jnp.float32) * scale[..., None]
    src = pages_arr
    if src.dtype == jnp.bfloat16:
        src = lax.bitcast_convert_type(src, jnp.uint16)
    if ppb == 1:
        g = src[pages[:, 0]]                                        # [S, ps, KVH, D]
    else:
        rows = (pages[:, :, None] * ps + jnp.arange(ps, dtype=pages.dtype)).reshape(S, ppb * ps)
        g = src.reshape(N * ps, KVH, D)[rows]                       # [S, blk, KVH, D]
    if pages_arr.dtype == jnp.bfloat16:
        return lax.bitcast_convert_type(g.astype(jnp.uint32) << 16, jnp.float32)
    return g.astype(jnp.float32)


def _tree_sum(x: jax.Array) -> jax.Array:
    """Sum over the last axis as a fixed tree of elementwise adds.

    XLA's reduce picks its strategy (and so its association order) from the whole array's
    size, so ``x.sum(-1)`` of one row changes bits when other rows come and go (measured:
    4 sequences or more vs fewer). Halving adds are exact IEEE ops in a fixed order.
    """
    n = x.shape[-1]
    while n > 1:
        h = n // 2
        y = x[..., :h] + x[..., h:2 * h]
        x = jnp.concatenate([y, x[..., 2 * h:]], axis=-1) if n % 2 else y
        n = x.shape[-1]
    return x[..., 0]


def _cdiv_arr(a, b: int):
    return (a + b - 1) // b


def ragged_paged_attention_reference(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                                     kv_lens: jax.Array, page_table: jax.Array,
                                     q_starts: jax.Array, q_lens: jax.Array, *, sm_scale: float,
                                     sliding_window: int | None = None,
                                     soft_cap: float | None = None,
                                     alibi_slopes: jax.Array | None = None) -> jax.Array:
    """Slow, plain attention on the generic ragged description, one query token at a time.

    q [T, H, D]; sequence s owns tokens [q_starts[s], q_starts[s] + q_lens[s]) of q (any
    layout: contiguous as in ``cu_q_lens``, or with gaps). Tokens owned by no sequence
    give zeros. Other arguments as in ``ragged_paged_attention``. Returns [T, H, D].
    """
    if hasattr(k_pages, "scale"):         # int8 pages: the reference reads them dequantized
        k_pages, v_pages = k_pages.dequantize(), v_pages.dequantize()
    T, H, D = q.shape
    _, ps, KVH, _ = k_pages.shape
    G = H // KVH
    S, P = page_table.shape
    L = P * ps
    t = jnp.arange(T)
    owned = (t[None, :] >= q_starts[:, None]) & (t[None, :] < (q_starts + q_lens)[:, None])
    has_seq = owned.any(axis=0)                                            # [T]
    seq = jnp.argmax(owned, axis=0)                                        # [T]

    pos = kv_lens[seq] - q_lens[seq] + (t - q_starts[seq])                 # [T]

    def attend(args):
        qt, s, p, has = args
        k = k_pages[page_table[s]].reshape(L, KVH, D).astype(jnp.float32)
        v = v_pages[page_table[s]].reshape(L, KVH, D).astype(jnp.float32)
        k = jnp.repeat(k, G, axis=1)                                       # [L, H, D]
        v = jnp.repeat(v, G, axis=1)
        kvpos = jnp.arange(L)
        ok = (kvpos <= p) & (kvpos < kv_lens[s]) & has
        if sliding_window is not None:
            ok &= kvpos > p - sliding_window
        sc = jnp.einsum("hd,lhd->hl", qt.astype(jnp.float32), k,
                        precision=lax.Precision.HIGHEST) * sm_scale
        if soft_cap is not None:
            sc = soft_cap * jnp.tanh(sc / soft_cap)
        if alibi_slopes is not None:
            sc = sc + alibi_slopes.astype(jnp.float32)[:, None] * (kvpos - p).astype(jnp.float32)[None, :]
        sc = jnp.where(ok[None, :], sc, _NEG_INF)
        mx = jnp.max(sc, axis=-1, keepdims=True)
        e = jnp.where(ok[None, :], jnp.exp(sc - jnp.where(ok.any(), mx, 0.0)), 0.0)
        w = e / jnp.maximum(e.sum(-1, keepdims=True), jnp.finfo(jnp.float32).tiny)
        v = jnp.where(ok[:, None, None], v, 0.0)
        return jnp.einsum("hl,lhd->hd", w, v, precision=lax.Precision.HIGHEST)

    out = lax.map(attend, (q, seq, pos, has_seq))
    return out.astype(q.dtype)


def layout_q_starts(num_seqs: int, num_decode: int, prefill_chunk: int) -> jax.Array:
    """q_starts of the step layout (for the reference): decode slot i at i, prefill slot j
    at num_decode + j * prefill_chunk."""
    s = jnp.arange(num_seqs)
    return jnp.where(s < num_decode, s, num_decode + (s - num_decode) * prefill_chunk).astype(jnp.int32)
