"""Ragged paged attention as Pallas kernels: a TPU (Mosaic) lowering and a GPU (Triton) lowering.

Same meaning and signature as the engine's pure-jnp path (``pallas_kernels/attention/xla.py``,
whose docstring is the contract): q [T, H, D] laid out as ``num_decode`` one-token slots
then ``num_prefill`` slots of ``prefill_chunk`` positions; K/V pages [N, page_size, KVH, D]
already hold this step's K/V; query j of slot s sits at ``kv_lens[s] - q_lens[s] + j`` and
sees KV positions ``<= pos`` (and ``> pos - sliding_window``); query head h reads KV head
h // (H // KVH); softmax in f32; rows past q_len and unused slots give exact zeros; KV
positions past kv_len are masked with selects (never multiplied), so NaN in unused pages
cannot leak.

K/V pages may be int8 (``kv_cache_dtype="int8"``: jaxinfer.engine.kv_cache.QuantizedPages,
values int8 [N, page_size, KVH, D] and one f32 scale per token and KV head): the kernels
move only the int8 values and the scales (the TPU kernel DMAs both per page; the GPU
kernel gathers both) and dequantize on chip, in f32, before the dots.

Entry points (for jaxinfer/attention/dispatch.py; all take the XLA signature plus
``interpret``):

* ``ragged_paged_attention_tpu`` — Mosaic kernel: KV pages stay in HBM and are gathered
  page by page with async DMAs into a double-buffered VMEM block.
* ``ragged_paged_attention_gpu`` — Triton kernel: KV pages are gathered with vector loads
  through the page table.
* ``ragged_paged_attention_reference`` — the engine's slow reference (re-exported, not
  copied), and ``reference_on_step_layout`` which calls it on the step layout.

How the work is cut (both kernels). The wrapper splits the step into its decode part
(S_d slots of one token) and its prefill part (S_p slots of ``prefill_chunk`` tokens), and
runs one ``pallas_call`` per part. Inside a part, the G = H // KVH query heads that share a
KV head are folded into rows: for slot s and KV head k, row r = j * G + g holds token j,
query head k * G + g, so q becomes [S, KVH, rows, D] and both dots are plain 2-D matmuls
([rows, D] x [D, kv_block] and [rows, kv_block] x [kv_block, D]) whatever the GQA ratio.
Rows are cut into blocks of ``rows_per_block``; a row block may end mid-token, which costs
nothing because every row carries its own absolute position. Grid: (slot, KV head, row
block) on GPU, (slot, row block) on TPU, whose one loop walks every KV head's blocks so
that DMAs overlap across heads; either way a (row block, KV head) visits the KV blocks its
rows can see ([lo, hi), computed in the wrapper from the rows' positions and the sliding
window) with the online-softmax update.
Decode (one token, G rows padded to the hardware's minimum) is bandwidth-bound: each KV
byte of a (slot, KV head) is read once for all G query heads. On GPU a decode row block's
KV blocks are also split over several programs (flash-decoding), a split being a fixed
run of ``kv_split_blocks`` KV blocks from position 0, their partial (max, sum, acc) merged
after the kernel in a fixed left-to-right order, so a small batch still fills the SMs
while a token's bits stay independent of the batch and of the page table's width; the TPU
runs its grid sequentially per core and does not split.

Why Triton for the GPU lowering rather than Mosaic GPU (read off the installed jax 0.10.2):
Mosaic GPU targets Hopper and newer only and is programmed at warpgroup level
(``plgpu.kernel``, explicit barriers and TMA; its docs call the API "highly unstable"); its
interpret mode simulates one thread block only, so a grid of (slot, head, row block)
kernels could not be tested on CPU. The Triton lowering runs on Ampere, Hopper and ROCm,
its kernel body is the same blocked jnp code as the TPU one (shared ``_block_update``), it
runs under the generic ``interpret=True`` on CPU with a full grid, and JAX's own bundled
GPU paged attention (the benchmark baseline) is Triton. Its cost: block shapes must be
powers of two (head_dim 64/128/256, page sizes 2^k), and jax now lowers ``pallas_call`` to
Mosaic GPU by default, so the Triton backend is selected explicitly with
``pltriton.CompilerParams``; if upstream drops it, this kernel needs a Mosaic GPU port.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.attention.xla import layout_q_starts, ragged_paged_attention_reference

__all__ = ["ragged_paged_attention_tpu", "ragged_paged_attention_gpu",
           "ragged_paged_attention_reference", "reference_on_step_layout"]

_NEG_INF = float("-inf")
# KV tokens per block when the caller does not choose: 128 keeps the score tile
# [rows, 128] lane-dense on TPU and is a good Triton tile on GPU.
DEFAULT_KV_BLOCK = 128
# Query rows (token x query head of one KV head) per block of a prefill chunk.
DEFAULT_PREFILL_ROWS = 128
# GPU decode: KV blocks per flash-decoding split (4 x 128 = 512 tokens). Fixed, not
# derived from the batch, so the merge order of a sequence's KV never depends on what else
# is in the step. Batch 1 at 8 KV heads and 8k context: 8 x 16 = 128 programs.
GPU_SPLIT_BLOCKS = 4


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _round_up(a: int, b: int) -> int:
    return _cdiv(a, b) * b


def _next_pow2(a: int) -> int:
    return 1 << max(0, (a - 1).bit_length())


def _is_pow2(a: int) -> bool:
    return a > 0 and a & (a - 1) == 0


def _is_int8_pages(pages) -> bool:
    """int8 KV pages (jaxinfer.engine.kv_cache.QuantizedPages: q int8 [N, ps, KVH, D] and
    a f32 scale [N, ps, KVH] per token and KV head)."""
    return hasattr(pages, "scale")


def _kv_operands(k_pages, v_pages) -> tuple:
    """The kernels' K/V operands: (k, v) for float pages, (k_q, v_q, k_scale, v_scale)
    for int8 ones."""
    if _is_int8_pages(k_pages):
        return k_pages.q, v_pages.q, k_pages.scale, v_pages.scale
    return k_pages, v_pages


# ---------------------------------------------------------------------------------------
# Shape validation (errors name the offending dimension)
# ---------------------------------------------------------------------------------------

def _validate(q, k_pages, v_pages, kv_lens, q_lens, page_table, *, num_decode: int,
              prefill_chunk: int, sliding_window, soft_cap, backend: str) -> None:
    if q.ndim != 3:
        raise ValueError(f"q: expected [T, num_heads, head_dim], got shape {q.shape}")
    if k_pages.ndim != 4:
        raise ValueError(f"k_pages: expected [num_pages, page_size, num_kv_heads, head_dim], "
                         f"got shape {k_pages.shape}")
    if v_pages.shape != k_pages.shape:
        raise ValueError(f"v_pages: shape {v_pages.shape} differs from k_pages {k_pages.shape}")
    if v_pages.dtype != k_pages.dtype or _is_int8_pages(v_pages) != _is_int8_pages(k_pages):
        raise ValueError(f"v_pages: dtype {v_pages.dtype} differs from k_pages {k_pages.dtype}")
    if k_pages.dtype == jnp.int8 and not _is_int8_pages(k_pages):
        raise ValueError("k_pages: int8 pages come with their scales (kv_cache.QuantizedPages)")
    if _is_int8_pages(k_pages):
        for name, pg in (("k_pages", k_pages), ("v_pages", v_pages)):
            if pg.scale.shape != pg.q.shape[:3]:
                raise ValueError(f"{name}.scale: expected {pg.q.shape[:3]} (one per token and "
                                 f"KV head), got {pg.scale.shape}")
    T, H, D = q.shape
    _, ps, KVH, Dk = k_pages.shape
    if Dk != D:
        raise ValueError(f"head_dim: q has {D}, k_pages has {Dk}")
    if KVH == 0 or H % KVH:
        raise ValueError(f"num_heads ({H}) must be a multiple of num_kv_heads ({KVH})")
    if page_table.ndim != 2:
        raise ValueError(f"page_table: expected [num_seqs, max_pages_per_seq], got shape "
                         f"{page_table.shape}")
    S = page_table.shape[0]
    for name, a in (("kv_lens", kv_lens), ("q_lens", q_lens)):
        if a.shape != (S,):
            raise ValueError(f"{name}: expected shape ({S},) (page_table rows), got {a.shape}")
    for name, a in (("kv_lens", kv_lens), ("q_lens", q_lens), ("page_table", page_table)):
        if a.dtype != jnp.int32:
            raise ValueError(f"{name}: expected int32, got {a.dtype}")
    if not 0 <= num_decode <= S:
        raise ValueError(f"num_decode: {num_decode} is outside [0, {S}] (S = page_table rows)")
    if prefill_chunk < 0:
        raise ValueError(f"prefill_chunk: must be >= 0, got {prefill_chunk}")
    want = num_decode + (S - num_decode) * prefill_chunk
    if T != want:
        raise ValueError(f"T (q rows) = {T}, but num_decode + num_prefill * prefill_chunk = "
                         f"{num_decode} + {S - num_decode} * {prefill_chunk} = {want}")
    if sliding_window is not None and sliding_window <= 0:
        raise ValueError(f"sliding_window: must be positive, got {sliding_window}")
    if soft_cap is not None and soft_cap == 0:
        raise ValueError("soft_cap: must be nonzero (None disables it)")
    if backend == "gpu":
        # Triton tensors must have power-of-two sizes: the loaded q/out tiles are
        # [rows, head_dim] and the K/V tiles [pages_per_block, page_size, head_dim].
        if not _is_pow2(D):
            raise ValueError(f"head_dim: the Triton kernel needs a power of two, got {D}")
        if not _is_pow2(ps):
            raise ValueError(f"page_size: the Triton kernel needs a power of two, got {ps}")


# ---------------------------------------------------------------------------------------
# Static plan of one part (decode or prefill) and its metadata, computed in the wrapper
# ---------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Plan:
    S: int      # slots in this part
    Q: int      # token positions per slot (1 for decode)
    KVH: int
    G: int      # query heads per KV head
    D: int
    ps: int     # page size
    ppb: int    # pages per KV block
    rb: int     # rows per row block
    nrb: int    # row blocks per (slot, KV head)
    Pp: int     # page-table width padded to a multiple of ppb
    split_blocks: int = 0  # GPU: KV blocks per flash-decoding split (0: no split)

    @property
    def blk(self) -> int:
        return self.ppb * self.ps

    @property
    def rows(self) -> int:
        return self.nrb * self.rb

    @property
    def nb(self) -> int:
        return self.Pp // self.ppb

    @property
    def splits(self) -> int:
        return _cdiv(self.nb, self.split_blocks) if self.split_blocks else 1


def _make_plan(S, Q, H, KVH, D, ps, P, *, backend: str, q_dtype, kv_block, rows_per_block,
               kv_split_blocks=None):
    G = H // KVH
    R = Q * G
    kvb = kv_block or DEFAULT_KV_BLOCK
    ppb = max(1, kvb // ps)
    if backend == "gpu":
        ppb = 1 << (ppb.bit_length() - 1)                 # round down to a power of two
        want = rows_per_block or (DEFAULT_PREFILL_ROWS if Q > 1 else R)
        # tl.dot needs every dim >= 16; tiles must be powers of two
        rb = max(16, _next_pow2(min(want, R)))
    else:
        # (8, 128) f32 / (16, 128) bf16 tiles: row blocks are whole sublane tiles
        sub = 8 if jnp.dtype(q_dtype).itemsize >= 4 else 16
        want = rows_per_block or (DEFAULT_PREFILL_ROWS if Q > 1 else R)
        rb = _round_up(min(want, R), sub)
    if rows_per_block is not None and backend == "tpu" and rows_per_block % 8:
        raise ValueError(f"rows_per_block: must be a multiple of 8 on TPU, got {rows_per_block}")
    nrb = _cdiv(R, rb)
    Pp = _round_up(P, ppb)
    if backend != "gpu":
        split = 0
    elif kv_split_blocks is not None:
        split = kv_split_blocks
    else:
        split = GPU_SPLIT_BLOCKS if Q == 1 else 0
    if split >= Pp // ppb:
        split = 0                                  # one split would hold every block
    return _Plan(S=S, Q=Q, KVH=KVH, G=G, D=D, ps=ps, ppb=ppb, rb=rb, nrb=nrb, Pp=Pp,
                 split_blocks=split)


def _part_inputs(plan: _Plan, q, kv_lens, q_lens, page_table, sliding_window):
    """q [S, Q, H, D] -> (q_rows [S, KVH, rows, D], qpos i32[S, rows], meta i32[S*nrb*4],
    page table i32[S*Pp]).

    qpos is each row's absolute position, -1 for rows that hold no query (past q_len or
    padding): such rows see no KV position and give zeros. meta holds per (slot, row
    block): [lo, hi) of the KV blocks its rows can see, and the slot's kv_len.
    """
    S, Q, KVH, G, D, rb, nrb = plan.S, plan.Q, plan.KVH, plan.G, plan.D, plan.rb, plan.nrb
    R, Rp, blk = Q * G, plan.rows, plan.blk
    qr = q.reshape(S, Q, KVH, G, D).transpose(0, 2, 1, 3, 4).reshape(S, KVH, R, D)
    if Rp != R:
        qr = jnp.pad(qr, ((0, 0), (0, 0), (0, Rp - R), (0, 0)))
    r = jnp.arange(Rp, dtype=jnp.int32)
    j = r // G
    start = kv_lens - q_lens
    valid = (r[None, :] < R) & (j[None, :] < q_lens[:, None])
    qpos = jnp.where(valid, start[:, None] + j[None, :], -1)                 # [S, Rp]
    valid &= qpos >= 0
    qpos = jnp.where(valid, qpos, -1)

    nb = plan.Pp // plan.ppb
    bpos = qpos.reshape(S, nrb, rb)
    pmax = jnp.max(bpos, axis=-1)
    hi = jnp.where(pmax >= 0, jnp.minimum(pmax // blk + 1, nb), 0)
    if sliding_window is None:
        lo = jnp.zeros_like(hi)
    else:
        big = jnp.iinfo(jnp.int32).max
        pmin = jnp.min(jnp.where(bpos >= 0, bpos, big), axis=-1)
        lo = jnp.where(hi > 0, jnp.maximum(pmin - sliding_window + 1, 0) // blk, 0)
        lo = jnp.minimum(lo, hi)
    meta = jnp.stack([lo, hi, jnp.broadcast_to(kv_lens[:, None], (S, nrb)),
                      jnp.zeros_like(lo)], axis=-1).astype(jnp.int32).reshape(-1)
    P = page_table.shape[1]
    pt = jnp.pad(page_table, ((0, 0), (0, plan.Pp - P))).reshape(-1)       # pad with page 0
    return qr, qpos, meta, pt


def _rows_to_tokens(plan: _Plan, out) -> jax.Array:
    """out [S, KVH, rows, D] -> [S * Q, H, D]."""
    S, Q, KVH, G, D = plan.S, plan.Q, plan.KVH, plan.G, plan.D
    out = out[:, :, :Q * G].reshape(S, KVH, Q, G, D).transpose(0, 2, 1, 3, 4)
    return out.reshape(S * Q, KVH * G, D)


# ---------------------------------------------------------------------------------------
# Shared kernel math: one KV block's online-softmax update
# ---------------------------------------------------------------------------------------

def _block_update(carry, q, kb, vb, qpos, kv0, kv_len, *, sm_scale: float,
                  sliding_window: int | None, soft_cap: float | None):
    """Fold KV block [kv0, kv0 + blk) into the running (max, sum, acc) of a row block.

    q [rb, D]; kb, vb [blk, D]; qpos i32[rb, 1] (-1: no query); m, l f32[rb, 1];
    acc f32[rb, D]. K/V past kv_len may be garbage (NaN): scores there are replaced by
    -inf with a select (position > every row's qpos) and V rows there by zero, so
    0 * NaN never happens.
    """
    m, l, acc = carry
    cdt = jnp.promote_types(q.dtype, kb.dtype)
    prec = lax.Precision.HIGHEST if cdt == jnp.float32 else None
    s = lax.dot_general(q.astype(cdt), kb.astype(cdt), (((1,), (1,)), ((), ())),
                        precision=prec, preferred_element_type=jnp.float32)  # [rb, blk]
    s = s * sm_scale
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    rb, blk = s.shape
    kvpos = kv0 + lax.broadcasted_iota(jnp.int32, (rb, blk), 1)
    ok = kvpos <= qpos
    if sliding_window is not None:
        ok = ok & (kvpos > qpos - sliding_window)
    s = jnp.where(ok, s, _NEG_INF)
    m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))                 # [rb, 1]
    safe = jnp.where(m_new == _NEG_INF, 0.0, m_new)
    p = jnp.exp(s - safe)
    alpha = jnp.exp(m - safe)
    l = alpha * l + jnp.sum(p, axis=1, keepdims=True)
    v_ok = (kv0 + lax.broadcasted_iota(jnp.int32, (blk, 1), 0)) < kv_len
    vb = jnp.where(v_ok, vb.astype(cdt), jnp.zeros((), cdt))
    pv = lax.dot_general(p.astype(cdt), vb, (((1,), (0,)), ((), ())), precision=prec,
                         preferred_element_type=jnp.float32)                 # [rb, D]
    return m_new, l, alpha * acc + pv


def _init_carry(rb: int, D: int):
    return (jnp.full((rb, 1), _NEG_INF, jnp.float32), jnp.zeros((rb, 1), jnp.float32),
            jnp.zeros((rb, D), jnp.float32))


def _finish(l, acc, dtype):
    ok = l > 0
    return jnp.where(ok, acc / jnp.where(ok, l, 1.0), 0.0).astype(dtype)


# ---------------------------------------------------------------------------------------
# TPU (Mosaic): K/V pages in HBM, per-page async DMA into a double-buffered VMEM block
# ---------------------------------------------------------------------------------------

def _tpu_kernel(meta_ref,    # SMEM i32[S * nrb * 4]: lo, hi, kv_len, 0 per (slot, row block)
                pt_ref,      # SMEM i32[S * Pp]: page table, padded with page 0
                q_ref,       # [KVH, rb, D]
                qpos_ref,    # i32[rb, 1]
                k_hbm,       # [N, page_size, KVH, D] (HBM; int8 with kv_int8)
                v_hbm,       # [N, page_size, KVH, D] (HBM)
                *refs,       # kv_int8: k / v scales [N, page_size, KVH, 1] (HBM); then
                             # o [KVH, rb, D]; VMEM kbuf, vbuf [2, blk, D]; kv_int8: VMEM
                             # kscale, vscale [2, blk, 1]; DMA semaphores [2 slots, 2 or 4]
                plan: _Plan, sm_scale, sliding_window, soft_cap, kv_int8: bool = False):
    """One grid step = one (slot, row block), all KV heads: a single loop over
    t = (head, KV block) pairs, so the DMA of the next pair (the next head's first block
    included) always overlaps the current one's compute; a step pays one DMA latency
    up front, not one per KV head."""
    if kv_int8:
        ks_hbm, vs_hbm, o_ref, kbuf, vbuf, ksbuf, vsbuf, sems = refs
    else:
        o_ref, kbuf, vbuf, sems = refs
        ks_hbm = vs_hbm = ksbuf = vsbuf = None
    s, i = pl.program_id(0), pl.program_id(1)
    base = (s * plan.nrb + i) * 4
    lo, hi, kv_len = meta_ref[base], meta_ref[base + 1], meta_ref[base + 2]
    nblk = hi - lo
    total = plan.KVH * nblk
    per = jnp.maximum(nblk, 1)               # (no division by zero when total == 0)
    ps, ppb = plan.ps, plan.ppb

    def head_block(t):
        # lax.div / rem (truncating; t, per >= 0): jnp's floor division lowers via sign()
        return lax.div(t, per), lo + lax.rem(t, per)

    def copies(t, slot):
        # One DMA per page and per K/V: [page_size, D] of KV head h. Pages wholly past
        # kv_len are not fetched (their rows are masked anyway).
        h, b = head_block(t)
        out = []
        for p in range(ppb):
            idx = b * ppb + p
            page = pt_ref[s * plan.Pp + idx]
            dst = pl.ds(p * ps, ps)
            cs = [pltpu.make_async_copy(k_hbm.at[page, :, h, :], kbuf.at[slot, dst], sems.at[slot, 0]),
                  pltpu.make_async_copy(v_hbm.at[page, :, h, :], vbuf.at[slot, dst], sems.at[slot, 1])]
            if kv_int8:
                cs += [pltpu.make_async_copy(ks_hbm.at[page, :, h, :], ksbuf.at[slot, dst],
                                             sems.at[slot, 2]),
                       pltpu.make_async_copy(vs_hbm.at[page, :, h, :], vsbuf.at[slot, dst],
                                             sems.at[slot, 3])]
            out.append((idx * ps < kv_len, cs))
        return out

    def start(t, slot):
        for need, cs in copies(t, slot):
            @pl.when(need)
            def _():
                for c in cs:
                    c.start()

    def wait(t, slot):
        for need, cs in copies(t, slot):
            @pl.when(need)
            def _():
                for c in cs:
                    c.wait()

    def block(buf, sbuf, slot):
        if not kv_int8:
            return buf[slot]
        return buf[slot].astype(jnp.float32) * sbuf[slot]          # [blk, D] * [blk, 1]

    @pl.when(total > 0)
    def _():
        start(0, 0)

    @pl.when(total == 0)
    def _():
        o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)     # no query in this row block

    qpos = qpos_ref[...]
    init = _init_carry(plan.rb, plan.D)

    def body(t, carry):
        h, b = head_block(t)
        slot = lax.rem(t, 2)

        @pl.when(t + 1 < total)
        def _():
            start(t + 1, 1 - slot)          # fetch the next (head, block) during this one

        wait(t, slot)
        first = b == lo                     # a new head starts from the empty state
        carry = tuple(jnp.where(first, a, c) for a, c in zip(init, carry))
        carry = _block_update(carry, q_ref[h], block(kbuf, ksbuf, slot), block(vbuf, vsbuf, slot),
                              qpos, b * plan.blk,
                              kv_len, sm_scale=sm_scale, sliding_window=sliding_window,
                              soft_cap=soft_cap)

        @pl.when(b == hi - 1)
        def _():
            o_ref[h] = _finish(carry[1], carry[2], o_ref.dtype)

        return carry

    lax.fori_loop(0, total, body, init)


def _tpu_part(plan: _Plan, q, k_pages, v_pages, kv_lens, q_lens, page_table, *, sm_scale,
              sliding_window, soft_cap, interpret):
    qr, qpos, meta, pt = _part_inputs(plan, q, kv_lens, q_lens, page_table, sliding_window)
    kv_int8 = _is_int8_pages(k_pages)
    kernel = functools.partial(_tpu_kernel, plan=plan, sm_scale=sm_scale,
                               sliding_window=sliding_window, soft_cap=soft_cap, kv_int8=kv_int8)
    row_spec = pl.BlockSpec((None, plan.KVH, plan.rb, plan.D), lambda s, i, *_: (s, 0, i, 0))
    kv = _kv_operands(k_pages, v_pages)
    if kv_int8:       # scales as [N, ps, KVH, 1]: a page's slice DMAs like the values'
        kv = kv[:2] + tuple(x[..., None] for x in kv[2:])
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(plan.S, plan.nrb),
        in_specs=[row_spec,
                  pl.BlockSpec((None, plan.rb, 1), lambda s, i, *_: (s, i, 0))]
                 + [pl.BlockSpec(memory_space=pl.ANY)] * len(kv),
        out_specs=row_spec,
        scratch_shapes=[pltpu.VMEM((2, plan.blk, plan.D), k_pages.dtype),
                        pltpu.VMEM((2, plan.blk, plan.D), v_pages.dtype)]
                       + [pltpu.VMEM((2, plan.blk, 1), jnp.float32)] * (2 * kv_int8)
                       + [pltpu.SemaphoreType.DMA((2, 4 if kv_int8 else 2))])
    out = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct(qr.shape, q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        interpret=interpret,
        name="jaxinfer_ragged_paged_attention_tpu",
    )(meta, pt, qr, qpos[:, :, None], *kv)
    return _rows_to_tokens(plan, out)


# ---------------------------------------------------------------------------------------
# GPU (Triton): pages gathered with vector loads through the page table
# ---------------------------------------------------------------------------------------

def _gpu_kernel(meta_ref,    # i32[S * nrb * 4] (whole array)
                pt_ref,      # i32[S * Pp] (whole array)
                q_ref,       # [rb, D]
                qpos_ref,    # i32[rb]
                k_ref,       # [N, page_size, D]: KV head h of every page (int8 with kv_int8)
                v_ref,       # [N, page_size, D]
                *refs,       # kv_int8: k / v scales f32[N, page_size] first; then
                             # splits == 1: o [rb, D]; else acc f32[rb, D], m, l f32[rb]
                plan: _Plan, sm_scale, sliding_window, soft_cap, kv_int8: bool = False):
    s = pl.program_id(0)
    sp, i = pl.program_id(2), pl.program_id(3)
    base = (s * plan.nrb + i) * 4
    lo, hi, kv_len = meta_ref[base], meta_ref[base + 1], meta_ref[base + 2]
    if plan.splits > 1:                 # this program's share of the KV blocks
        bps = plan.split_blocks
        lo, hi = jnp.maximum(lo, sp * bps), jnp.minimum(hi, (sp + 1) * bps)
    ks_ref, vs_ref, *out_refs = refs if kv_int8 else (None, None, *refs)
    q = q_ref[...]
    qpos = qpos_ref[...][:, None]

    def load(ref, sref, pages):
        x = ref[pages]                                                     # [ppb, ps, D]
        if kv_int8:      # dequantize in registers: only int8 bytes + scales cross HBM
            x = x.astype(jnp.float32) * sref[pages][:, :, None]
        return x.reshape(plan.blk, plan.D)

    def body(b, carry):
        pages = pt_ref[pl.ds(s * plan.Pp + b * plan.ppb, plan.ppb)]        # [ppb]
        kb = load(k_ref, ks_ref, pages)
        vb = load(v_ref, vs_ref, pages)
        return _block_update(carry, q, kb, vb, qpos, b * plan.blk, kv_len,
                             sm_scale=sm_scale, sliding_window=sliding_window,
                             soft_cap=soft_cap)

    m, l, acc = lax.fori_loop(lo, hi, body, _init_carry(plan.rb, plan.D))
    if plan.splits == 1:
        out_refs[0][...] = _finish(l, acc, out_refs[0].dtype)
    else:
        acc_ref, m_ref, l_ref = out_refs
        acc_ref[...] = acc
        m_ref[...] = m.reshape(plan.rb)
        l_ref[...] = l.reshape(plan.rb)


def _combine_splits(acc, m, l, dtype):
    """Partial softmax states over the split axis 2 -> normalized [S, KVH, rows, D].

    Summed left to right in a Python loop, not with XLA's reduce (whose association order
    changes with the number of splits): splits past a sequence's end add exact zeros, so
    a wider page table leaves the bits unchanged."""
    mx = jnp.max(m, axis=2, keepdims=True)
    w = jnp.where(m == _NEG_INF, 0.0, jnp.exp(m - jnp.where(mx == _NEG_INF, 0.0, mx)))
    total, out = w[:, :, 0] * l[:, :, 0], w[:, :, 0, :, None] * acc[:, :, 0]
    for i in range(1, m.shape[2]):
        total = total + w[:, :, i] * l[:, :, i]
        out = out + w[:, :, i, :, None] * acc[:, :, i]
    return _finish(total[..., None], out, dtype)


def _gpu_part(plan: _Plan, q, k_pages, v_pages, kv_lens, q_lens, page_table, *, sm_scale,
              sliding_window, soft_cap, interpret):
    qr, qpos, meta, pt = _part_inputs(plan, q, kv_lens, q_lens, page_table, sliding_window)
    kv_int8 = _is_int8_pages(k_pages)
    kernel = functools.partial(_gpu_kernel, plan=plan, sm_scale=sm_scale,
                               sliding_window=sliding_window, soft_cap=soft_cap, kv_int8=kv_int8)
    N = k_pages.shape[0]
    S, KVH, ns, Rp, D = plan.S, plan.KVH, plan.splits, plan.rows, plan.D
    row_spec = pl.BlockSpec((None, None, plan.rb, D), lambda s, h, sp, i: (s, h, i, 0))
    head_spec = pl.BlockSpec((N, plan.ps, None, D), lambda s, h, sp, i: (0, 0, h, 0))
    scale_spec = pl.BlockSpec((N, plan.ps, None), lambda s, h, sp, i: (0, 0, h))
    if ns == 1:
        out_specs = row_spec
        out_shape = jax.ShapeDtypeStruct(qr.shape, q.dtype)
    else:
        out_specs = [pl.BlockSpec((None, None, None, plan.rb, D),
                                  lambda s, h, sp, i: (s, h, sp, i, 0)),
                     pl.BlockSpec((None, None, None, plan.rb), lambda s, h, sp, i: (s, h, sp, i)),
                     pl.BlockSpec((None, None, None, plan.rb), lambda s, h, sp, i: (s, h, sp, i))]
        out_shape = [jax.ShapeDtypeStruct((S, KVH, ns, Rp, D), jnp.float32),
                     jax.ShapeDtypeStruct((S, KVH, ns, Rp), jnp.float32),
                     jax.ShapeDtypeStruct((S, KVH, ns, Rp), jnp.float32)]
    out = pl.pallas_call(
        kernel,
        grid=(S, KVH, ns, plan.nrb),
        in_specs=[pl.no_block_spec, pl.no_block_spec, row_spec,
                  pl.BlockSpec((None, plan.rb), lambda s, h, sp, i: (s, i)),
                  head_spec, head_spec] + [scale_spec] * (2 * kv_int8),
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=pltriton.CompilerParams(num_warps=4 if plan.rb <= 64 else 8,
                                                num_stages=2),
        interpret=interpret,
        name="jaxinfer_ragged_paged_attention_gpu",
    )(meta, pt, qr, qpos, *_kv_operands(k_pages, v_pages))
    if ns > 1:
        out = _combine_splits(*out, q.dtype)
    return _rows_to_tokens(plan, out)


# ---------------------------------------------------------------------------------------
# Jitted wrappers (the engine's signature + interpret and optional block sizes)
# ---------------------------------------------------------------------------------------

def _run(part_fn, backend, q, k_pages, v_pages, kv_lens, q_lens, page_table, *, num_decode,
         prefill_chunk, sm_scale, sliding_window, soft_cap, interpret, kv_block,
         rows_per_block, kv_split_blocks=None):
    _validate(q, k_pages, v_pages, kv_lens, q_lens, page_table, num_decode=num_decode,
              prefill_chunk=prefill_chunk, sliding_window=sliding_window, soft_cap=soft_cap,
              backend=backend)
    T, H, D = q.shape
    _, ps, KVH, _ = k_pages.shape
    S, P = page_table.shape
    num_prefill = S - num_decode
    kw = dict(sm_scale=float(sm_scale), sliding_window=sliding_window, soft_cap=soft_cap,
              interpret=interpret)
    parts = []
    for lo_s, n, Q in ((0, num_decode, 1), (num_decode, num_prefill, prefill_chunk)):
        if not n or not Q:
            continue
        t0 = 0 if lo_s == 0 else num_decode
        qp = q[t0:t0 + n * Q].reshape(n, Q, H, D)
        plan = _make_plan(n, Q, H, KVH, D, ps, P, backend=backend, q_dtype=q.dtype,
                          kv_block=kv_block, rows_per_block=rows_per_block,
                          kv_split_blocks=kv_split_blocks)
        parts.append(part_fn(plan, qp, k_pages, v_pages, kv_lens[lo_s:lo_s + n],
                             q_lens[lo_s:lo_s + n], page_table[lo_s:lo_s + n], **kw))
    if not parts:
        return jnp.zeros_like(q)
    return jnp.concatenate(parts, axis=0).astype(q.dtype)


_STATIC = ("num_decode", "prefill_chunk", "sm_scale", "sliding_window", "soft_cap",
           "interpret", "kv_block", "rows_per_block", "kv_split_blocks")


@functools.partial(jax.jit, static_argnames=_STATIC[:-1])
def ragged_paged_attention_tpu(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                               kv_lens: jax.Array, q_lens: jax.Array, page_table: jax.Array,
                               *, num_decode: int, prefill_chunk: int, sm_scale: float,
                               sliding_window: int | None = None, soft_cap: float | None = None,
                               interpret: bool | Any = False, kv_block: int | None = None,
                               rows_per_block: int | None = None) -> jax.Array:
    """Mosaic TPU kernel; signature and meaning of ``pallas_kernels.attention.xla.ragged_paged_attention``.

    interpret: False on a TPU; ``pltpu.InterpretParams()`` runs the kernel on CPU with the
    TPU's memories, DMAs and semaphores simulated (tests). kv_block: KV tokens per block
    (rounded down to whole pages; default 128). rows_per_block: query rows (tokens x
    query heads of one KV head) per prefill block, a multiple of 8 (default 128).
    """
    return _run(_tpu_part, "tpu", q, k_pages, v_pages, kv_lens, q_lens, page_table,
                num_decode=num_decode, prefill_chunk=prefill_chunk, sm_scale=sm_scale,
                sliding_window=sliding_window, soft_cap=soft_cap, interpret=interpret,
                kv_block=kv_block, rows_per_block=rows_per_block)


@functools.partial(jax.jit, static_argnames=_STATIC)
def ragged_paged_attention_gpu(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                               kv_lens: jax.Array, q_lens: jax.Array, page_table: jax.Array,
                               *, num_decode: int, prefill_chunk: int, sm_scale: float,
                               sliding_window: int | None = None, soft_cap: float | None = None,
                               interpret: bool | Any = False, kv_block: int | None = None,
                               rows_per_block: int | None = None,
                               kv_split_blocks: int | None = None) -> jax.Array:
    """Triton GPU kernel; signature and meaning of ``pallas_kernels.attention.xla.ragged_paged_attention``.

    interpret: False on a GPU; True runs the same kernel through Pallas' generic
    interpreter on CPU (tests). head_dim and page_size must be powers of two. kv_block and
    rows_per_block as in ``ragged_paged_attention_tpu`` (rounded to powers of two here).
    kv_split_blocks: KV blocks per flash-decoding split (each split its own program, the
    partial softmax states merged after the kernel); 0 disables; default
    GPU_SPLIT_BLOCKS for decode, no split for prefill.
    """
    return _run(_gpu_part, "gpu", q, k_pages, v_pages, kv_lens, q_lens, page_table,
                num_decode=num_decode, prefill_chunk=prefill_chunk, sm_scale=sm_scale,
                sliding_window=sliding_window, soft_cap=soft_cap, interpret=interpret,
                kv_block=kv_block, rows_per_block=rows_per_block,
                kv_split_blocks=kv_split_blocks)


def reference_on_step_layout(q, k_pages, v_pages, kv_lens, q_lens, page_table, *,
                             num_decode: int, prefill_chunk: int, sm_scale: float,
                             sliding_window: int | None = None,
                             soft_cap: float | None = None) -> jax.Array:
    """The engine's reference (generic ragged description) called on the step layout."""
    q_starts = layout_q_starts(page_table.shape[0], num_decode, prefill_chunk)
    return ragged_paged_attention_reference(q, k_pages, v_pages, kv_lens, page_table, q_starts,
                                            q_lens, sm_scale=sm_scale,
                                            sliding_window=sliding_window, soft_cap=soft_cap)
