"""Ragged paged attention: the fast paths == reference == dense numpy, and batch invariance
(bitwise) of each fast path. Fast paths (the ``impl`` fixture): "xla", the jnp one
(pallas_kernels/attention/xla.py), and "cpp", the C++ kernel (pallas_kernels/attention/cpu.py, skipped
one test at a time only where no C++ compiler exists).

Every page that is not part of a sequence — page 0 (the padding sink), free pages, and the
tail of each sequence's last page — is filled with NaN, so a stray read fails loudly.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import os
import pytest
import shutil

from pallas_kernels.attention.xla import (KV_BLOCK, layout_q_starts, ragged_paged_attention,
                                    ragged_paged_attention_reference)


@dataclass
class Seq:
    kv_len: int      # including this step's tokens
    q_len: int       # 0 = unused slot


@dataclass
class Case:
    q: np.ndarray            # [T, H, D] f32
    k_pages: np.ndarray      # [N, ps, KVH, D]
    v_pages: np.ndarray
    kv_lens: np.ndarray
    q_lens: np.ndarray
    page_table: np.ndarray
    num_decode: int
    prefill_chunk: int
    seq_kv: list             # per slot: (k [kv_len, KVH, D], v) as stored (dtype-rounded), f64


def make_case(seqs: list[Seq], num_decode: int, prefill_chunk: int, *, page_size: int,
              heads: int, kv_heads: int, head_dim: int, max_pages: int | None = None,
              dtype=np.float32, seed: int = 0, spare_pages: int = 3,
              data: dict | None = None) -> Case:
    """Random pages for the given slots. ``data`` (key -> (q, k, v)) lets a test put the
    same sequence into several batches: a Seq given a ``key`` (see ``_key``) takes its
    data from there, or stores what it drew."""
    rng = np.random.default_rng(seed)
    S = len(seqs)
    npages = [-(-s.kv_len // page_size) for s in seqs]
    P = max_pages or max(1, max(npages))
    N = -(-(1 + sum(npages) + spare_pages) // 64) * 64       # few distinct shapes: fewer compiles
    perm = rng.permutation(np.arange(1, N))
    k_pages = np.full((N, page_size, kv_heads, head_dim), np.nan, np.float32)
    v_pages = np.full_like(k_pages, np.nan)
    page_table = np.zeros((S, P), np.int32)
    T = num_decode + (S - num_decode) * prefill_chunk
    q = np.full((T, heads, head_dim), np.nan, np.float32)
    i = 0
    seq_kv = []
    for si, s in enumerate(seqs):
        key = getattr(s, "key", None)
        if data is not None and key is not None and key in data:
            qs, ks, vs = data[key]
        else:
            qs = rng.standard_normal((s.q_len, heads, head_dim)).astype(np.float32)
            ks = rng.standard_normal((s.kv_len, kv_heads, head_dim)).astype(np.float32)
            vs = rng.standard_normal((s.kv_len, kv_heads, head_dim)).astype(np.float32)
            if data is not None and key is not None:
                data[key] = (qs, ks, vs)
        pages = perm[i:i + npages[si]]
        i += npages[si]
        page_table[si, :len(pages)] = pages
        for t in range(s.kv_len):
            k_pages[pages[t // page_size], t % page_size] = ks[t]
            v_pages[pages[t // page_size], t % page_size] = vs[t]
        start = si if si < num_decode else num_decode + (si - num_decode) * prefill_chunk
        q[start:start + s.q_len] = qs
        rnd = lambda x: x.astype(dtype).astype(np.float64)  # noqa: E731
        seq_kv.append((rnd(ks), rnd(vs)))
    # query rows that belong to no sequence: finite garbage (the model feeds padded tokens)
    q = np.where(np.isnan(q), 1.0, q).astype(np.float32)
    return Case(q, k_pages.astype(dtype), v_pages.astype(dtype),
                np.array([s.kv_len for s in seqs], np.int32),
                np.array([s.q_len for s in seqs], np.int32), page_table, num_decode,
                prefill_chunk, seq_kv)


def dense_numpy(c: Case, *, sm_scale, sliding_window=None, soft_cap=None, alibi_slopes=None) -> np.ndarray:
    """Per sequence, contiguous K/V, float64, HF-style repeat_kv; ALiBi as BLOOM adds it
    (slope * key position: a per-row constant away from slope * (key - query position))."""
    T, H, D = c.q.shape
    KVH = c.k_pages.shape[2]
    G = H // KVH
    out = np.zeros((T, H, D), np.float64)
    for si, (k, v) in enumerate(c.seq_kv):
        ql, kl = int(c.q_lens[si]), int(c.kv_lens[si])
        if ql == 0:
            continue
        start = si if si < c.num_decode else c.num_decode + (si - c.num_decode) * c.prefill_chunk
        qs = c.q[start:start + ql].astype(np.float64)                     # [ql, H, D]
        kr, vr = np.repeat(k, G, axis=1), np.repeat(v, G, axis=1)           # [kl, H, D]
        s = np.einsum("qhd,khd->hqk", qs, kr) * sm_scale
        if soft_cap is not None:
            s = soft_cap * np.tanh(s / soft_cap)
        pos = kl - ql + np.arange(ql)
        kv = np.arange(kl)
        if alibi_slopes is not None:
            s = s + np.asarray(alibi_slopes, np.float64)[:, None, None] * kv[None, None, :]
        ok = kv[None, :] <= pos[:, None]
        if sliding_window is not None:
            ok &= kv[None, :] > pos[:, None] - sliding_window
        s = np.where(ok[None], s, -np.inf)
        s = s - s.max(-1, keepdims=True)
        w = np.exp(s)
        w /= w.sum(-1, keepdims=True)
        out[start:start + ql] = np.einsum("hqk,khd->qhd", w, vr)
    return out


@pytest.fixture(params=["xla", "cpp"])
def impl(request) -> str:
    if request.param == "cpp":
        if shutil.which(os.environ.get("CXX", "g++")) is None:
            pytest.skip("no C++ compiler: the CPU attention kernel cannot be built here")
        from pallas_kernels.attention import cpu as cpu_attention
        assert cpu_attention.available(), cpu_attention.unavailable_reason()
    return request.param


def fast(q, k, v, kv_lens, q_lens, pt, impl="xla", **kw):
    if impl == "cpp":
        from pallas_kernels.attention.cpu import ragged_paged_attention as fn
    else:
        fn = ragged_paged_attention
    return fn(q, k, v, kv_lens, q_lens, pt, **kw)


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "soft_cap"))
def ref(q, k, v, kv_lens, pt, q_starts, q_lens, **kw):
    return ragged_paged_attention_reference(q, k, v, kv_lens, pt, q_starts, q_lens, **kw)


def run_both(c: Case, impl: str = "xla", **kw):
    args = (jnp.asarray(c.q), jnp.asarray(c.k_pages), jnp.asarray(c.v_pages),
            jnp.asarray(c.kv_lens), jnp.asarray(c.q_lens), jnp.asarray(c.page_table))
    out = fast(*args, impl=impl, num_decode=c.num_decode, prefill_chunk=c.prefill_chunk, **kw)
    starts = layout_q_starts(len(c.kv_lens), c.num_decode, c.prefill_chunk)
    r = ref(args[0], args[1], args[2], args[3], args[5], starts, args[4], **kw)
    return np.asarray(out), np.asarray(r)


MIX = [Seq(37, 1), Seq(1, 1), Seq(0, 0), Seq(130, 1),           # decode slots (one unused)
       Seq(45, 45), Seq(300, 20), Seq(0, 0), Seq(17, 3)]        # prefill: fresh, continued, unused, short


def used_rows(c: Case) -> np.ndarray:
    T = c.q.shape[0]
    mask = np.zeros(T, bool)
    for si, ql in enumerate(c.q_lens):
        start = si if si < c.num_decode else c.num_decode + (si - c.num_decode) * c.prefill_chunk
        mask[start:start + ql] = True
    return mask


# page sizes 8/16/32, head_dim 64/128, GQA ratios 1/3/8 and MQA, each at least once
@pytest.mark.parametrize("page_size,heads,kv_heads,head_dim", [
    (8, 4, 4, 64), (16, 9, 3, 64), (32, 16, 2, 128), (8, 9, 3, 128), (16, 8, 1, 64)])
def test_fast_matches_reference_and_dense(page_size, heads, kv_heads, head_dim, impl):
    c = make_case(MIX, 4, 48, page_size=page_size, heads=heads, kv_heads=kv_heads,
                  head_dim=head_dim, seed=page_size + heads)
    scale = head_dim ** -0.5
    out, r = run_both(c, impl, sm_scale=scale)
    d = dense_numpy(c, sm_scale=scale)
    assert np.isfinite(out).all() and np.isfinite(r).all()
    np.testing.assert_allclose(r, d, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(out, r, atol=1e-5, rtol=1e-5)
    # rows owned by no sequence (padding) are exact zeros in both
    assert (out[~used_rows(c)] == 0).all() and (r[~used_rows(c)] == 0).all()


@pytest.mark.parametrize("window,cap", [(40, None), (1, 50.0)])
def test_sliding_window_and_soft_cap(window, cap, impl):
    seqs = [Seq(200, 1), Seq(5, 1), Seq(260, 64), Seq(64, 64)]
    c = make_case(seqs, 2, 64, page_size=16, heads=8, kv_heads=2, head_dim=64, seed=7)
    kw = dict(sm_scale=0.3, sliding_window=window, soft_cap=cap)
    out, r = run_both(c, impl, **kw)
    d = dense_numpy(c, **kw)
    np.testing.assert_allclose(r, d, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(out, r, atol=1e-5, rtol=1e-5)


def test_bf16_cache():
    c = make_case(MIX, 4, 48, page_size=16, heads=9, kv_heads=3, head_dim=64,
                  dtype=ml_dtypes.bfloat16, seed=3)
    out, r = run_both(c, sm_scale=0.125)
    d = dense_numpy(c, sm_scale=0.125)
    # both upcast the stored bf16 values to f32, so they agree as tightly as f32 does;
    # the dense reference uses the same rounded values
    np.testing.assert_allclose(out, r, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(r, d, atol=1e-5, rtol=1e-5)


def test_bf16_queries_give_bf16_output(impl):
    c = make_case([Seq(20, 1), Seq(33, 33)], 1, 40, page_size=16, heads=4, kv_heads=2,
                  head_dim=64, dtype=ml_dtypes.bfloat16, seed=4)
    qb = jnp.asarray(c.q).astype(jnp.bfloat16)
    kp, vp = jnp.asarray(c.k_pages), jnp.asarray(c.v_pages)
    if impl == "cpp":      # float32 pages only (the same rounded values)
        kp, vp = kp.astype(jnp.float32), vp.astype(jnp.float32)
    out = fast(qb, kp, vp, jnp.asarray(c.kv_lens), jnp.asarray(c.q_lens),
               jnp.asarray(c.page_table), impl=impl, num_decode=1, prefill_chunk=40,
               sm_scale=0.125)
    assert out.dtype == jnp.bfloat16
    c.q = np.asarray(qb.astype(jnp.float32))
    d = dense_numpy(c, sm_scale=0.125)
    np.testing.assert_allclose(np.asarray(out, np.float32), d, atol=2e-2, rtol=2e-2)


def test_reference_on_contiguous_cu_q_lens_layout():
    """The reference takes any layout: here tokens packed back to back (cu_q_lens)."""
    seqs = [Seq(10, 3), Seq(50, 1), Seq(33, 33)]
    c = make_case(seqs, 0, 33, page_size=8, heads=6, kv_heads=3, head_dim=64, seed=5)
    # repack the prefill layout [3 slots x 33] into contiguous tokens
    cu = np.concatenate([[0], np.cumsum(c.q_lens)]).astype(np.int32)
    q_packed = np.concatenate([c.q[i * 33:i * 33 + ql] for i, ql in enumerate(c.q_lens)])
    r = ref(jnp.asarray(q_packed), jnp.asarray(c.k_pages), jnp.asarray(c.v_pages),
            jnp.asarray(c.kv_lens), jnp.asarray(c.page_table), jnp.asarray(cu[:-1]),
            jnp.asarray(np.diff(cu)), sm_scale=0.125)
    d = dense_numpy(c, sm_scale=0.125)
    d_packed = np.concatenate([d[i * 33:i * 33 + ql] for i, ql in enumerate(c.q_lens)])
    np.testing.assert_allclose(np.asarray(r), d_packed, atol=1e-5, rtol=1e-5)


def test_chunked_prefill_equals_whole_prefill(impl):
    """A prompt computed in chunks (continuing from its cache) == computed at once."""
    n, chunk = 150, 64
    rng = np.random.default_rng(11)
    data = {"a": (rng.standard_normal((n, 8, 64)).astype(np.float32),
                  rng.standard_normal((n, 2, 64)).astype(np.float32),
                  rng.standard_normal((n, 2, 64)).astype(np.float32))}
    whole = make_case([_key(Seq(n, n), "a")], 0, n, page_size=16, heads=8, kv_heads=2,
                      head_dim=64, data=data)
    out_whole, _ = run_both(whole, impl, sm_scale=0.125)
    qa, ka, va = data["a"]
    pieces = []
    for s0 in range(0, n, chunk):
        ql = min(chunk, n - s0)
        d = {"a": (qa[s0:s0 + ql], ka[:s0 + ql], va[:s0 + ql])}
        c = make_case([_key(Seq(s0 + ql, ql), "a")], 0, chunk, page_size=16, heads=8,
                      kv_heads=2, head_dim=64, data=d, max_pages=10)
        out, r = run_both(c, impl, sm_scale=0.125)
        np.testing.assert_allclose(out, r, atol=1e-5, rtol=1e-5)
        pieces.append(out[:ql])
    np.testing.assert_array_equal(np.concatenate(pieces), out_whole[:n])


def _key(s: Seq, key) -> Seq:
    s.key = key
    return s


# --- batch invariance --------------------------------------------------------------------

def _target_output(c: Case, slot: int, impl: str, **kw) -> np.ndarray:
    out = np.asarray(fast(jnp.asarray(c.q), jnp.asarray(c.k_pages), jnp.asarray(c.v_pages),
                          jnp.asarray(c.kv_lens), jnp.asarray(c.q_lens),
                          jnp.asarray(c.page_table), impl=impl, num_decode=c.num_decode,
                          prefill_chunk=c.prefill_chunk, sm_scale=0.125, **kw))
    start = slot if slot < c.num_decode else c.num_decode + (slot - c.num_decode) * c.prefill_chunk
    return out[start:start + int(c.q_lens[slot])]


@pytest.mark.parametrize("alibi", [False, True], ids=["plain", "alibi"])
def test_batch_invariance_decode(impl, alibi):
    """One decoding sequence: same bits alone, among others, at any slot, with any bucket
    (also with ALiBi slopes, which BLOOM / MPT add)."""
    from jaxinfer.models.layers import alibi_slopes

    kw = dict(alibi_slopes=jnp.asarray(alibi_slopes(9, "bloom"))) if alibi else {}
    data = {}
    geo = dict(page_size=16, heads=9, kv_heads=3, head_dim=64, data=data)
    tgt = lambda: _key(Seq(301, 1), "t")  # noqa: E731
    others = lambda n, seed: [_key(Seq(int(x), 1), f"o{seed}_{i}") for i, x in  # noqa: E731
                              enumerate(np.random.default_rng(seed).integers(1, 700, n))]
    alone = _target_output(make_case([tgt()], 1, 0, **geo), 0, impl, **kw)
    variants = [
        (make_case([tgt()], 1, 0, max_pages=64, **geo), 0),                     # longer table
        (make_case(others(5, 1) + [tgt(), Seq(0, 0), Seq(0, 0)], 8, 0, **geo), 5),  # padded slots
        (make_case([tgt()] + others(31, 3) + [Seq(200, 100), Seq(40, 7)], 32, 128, **geo), 0),
        (make_case(others(63, 5)[:40] + [tgt()] + others(63, 5)[40:], 64, 0, **geo), 40),
    ]
    for c, slot in variants:
        np.testing.assert_array_equal(_target_output(c, slot, impl, **kw), alone)


@pytest.mark.parametrize("alibi", [False, True], ids=["plain", "alibi"])
def test_batch_invariance_prefill(impl, alibi):
    """A prefill chunk: same bits whatever else is in the step and whatever the bucket."""
    from jaxinfer.models.layers import alibi_slopes

    kw = dict(alibi_slopes=jnp.asarray(alibi_slopes(9, "bloom"))) if alibi else {}
    data = {}
    geo = dict(page_size=16, heads=9, kv_heads=3, head_dim=64, data=data)
    tgt = lambda: _key(Seq(500, 200), "t")  # noqa: E731
    alone = _target_output(make_case([tgt()], 0, 200, **geo), 0, impl, **kw)
    variants = [
        (make_case([tgt()], 0, 256, max_pages=48, **geo), 0),                  # bigger chunk/table
        (make_case([Seq(30, 1)] * 8 + [Seq(100, 100), tgt(), Seq(0, 0)], 8, 256, **geo), 9),
        (make_case([Seq(800, 30), tgt()], 0, 512, max_pages=80, **geo), 1),
    ]
    for c, slot in variants:
        np.testing.assert_array_equal(_target_output(c, slot, impl, **kw), alone)


def test_same_bits_in_decode_slot_prefill_slot_any_chunk_and_page_size(impl):
    """A token's output depends only on its q, its sequence's K/V and its position: the
    same bits whether it is decoded, ends a prefill chunk of any length, or the pages are
    8, 16 or 32 tokens (all divide KV_BLOCK)."""
    n = 300
    rng = np.random.default_rng(5)
    data = {"a": (rng.standard_normal((n, 9, 64)).astype(np.float32),
                  rng.standard_normal((n, 3, 64)).astype(np.float32),
                  rng.standard_normal((n, 3, 64)).astype(np.float32))}
    qa, ka, va = data["a"]
    geo = dict(heads=9, kv_heads=3, head_dim=64)
    whole = _target_output(make_case([_key(Seq(n, n), "a")], 0, n, page_size=16, data=data,
                                     **geo), 0, impl)
    last = {"a": (qa[-1:], ka, va)}
    tail = {"a": (qa[-37:], ka, va)}
    dec = _target_output(make_case([Seq(50, 1), _key(Seq(n, 1), "a")], 2, 0, page_size=16,
                                   data=last, **geo), 1, impl)
    np.testing.assert_array_equal(dec[0], whole[-1])
    for ps in (8, 16, 32):
        pre = _target_output(make_case([_key(Seq(n, 37), "a")], 0, 64, page_size=ps,
                                       data=tail, **geo), 0, impl)
        np.testing.assert_array_equal(pre, whole[-37:])


def test_all_slots_padded_gives_zeros(impl):
    """A step with no live slot (page table all page 0 = NaN) gives exact zeros."""
    c = make_case([Seq(0, 0), Seq(0, 0), Seq(0, 0)], 2, 16, page_size=16, heads=4,
                  kv_heads=2, head_dim=64)
    out = np.asarray(fast(jnp.asarray(c.q), jnp.asarray(c.k_pages), jnp.asarray(c.v_pages),
                          jnp.asarray(c.kv_lens), jnp.asarray(c.q_lens),
                          jnp.asarray(c.page_table), impl=impl, num_decode=2, prefill_chunk=16,
                          sm_scale=0.125))
    assert (out == 0).all()


def test_shape_errors_name_the_dimension():
    c = make_case([Seq(5, 1)], 1, 0, page_size=16, heads=4, kv_heads=2, head_dim=64)
    with pytest.raises(ValueError, match="T \\(q rows\\)"):
        ragged_paged_attention(jnp.asarray(c.q[:0]), c.k_pages, c.v_pages, c.kv_lens,
                               c.q_lens, c.page_table, num_decode=1, prefill_chunk=0,
                               sm_scale=1.0)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        ragged_paged_attention(jnp.zeros((1, 3, 64)), c.k_pages, c.v_pages, c.kv_lens,
                               c.q_lens, c.page_table, num_decode=1, prefill_chunk=0,
                               sm_scale=1.0)


def test_kv_block_is_a_multiple_of_common_page_sizes():
    assert all(KV_BLOCK % p == 0 for p in (8, 16, 32, 64))


@pytest.mark.skipif(shutil.which(os.environ.get("CXX", "g++")) is None,
                    reason="no C++ compiler: the CPU attention kernel cannot be built here")
def test_cpp_kernel_errors_name_the_problem():
    from pallas_kernels.attention import cpu as cpu_attention
    from pallas_kernels.attention.cpu import ragged_paged_attention as cpp

    assert cpu_attention.available(), cpu_attention.unavailable_reason()
    c = make_case([Seq(40, 1)], 1, 0, page_size=16, heads=4, kv_heads=2, head_dim=64)
    args = [jnp.asarray(x) for x in (c.q, c.k_pages, c.v_pages, c.kv_lens, c.q_lens, c.page_table)]
    kw = dict(num_decode=1, prefill_chunk=0, sm_scale=0.125)
    with pytest.raises(ValueError, match="float32 pages"):
        cpp(args[0], args[1].astype(jnp.bfloat16), args[2].astype(jnp.bfloat16), *args[3:], **kw)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        cpp(jnp.zeros((1, 3, 64)), *args[1:], **kw)
    # checked inside the kernel, at run time: a page index outside the cache, a kv_len
    # longer than the page table, a q_len larger than its slot
    bad_pt = args[5].at[0, 0].set(c.k_pages.shape[0])
    with pytest.raises(Exception, match="page index is out of range"):
        cpp(*args[:5], bad_pt, **kw).block_until_ready()
    with pytest.raises(Exception, match="q_len / kv_len is out of range"):
        cpp(*args[:3], args[3] + 1000, *args[4:], **kw).block_until_ready()
    with pytest.raises(Exception, match="q_len / kv_len is out of range"):
        cpp(*args[:4], args[4] + 1, args[5], **kw).block_until_ready()


@pytest.mark.parametrize("kv_heads", [8, 2])
def test_alibi_matches_reference_and_dense(impl, kv_heads):
    """ALiBi (BLOOM / MPT): the fast path and the reference add slope * (key - query
    position) per head; the dense float64 check adds BLOOM's slope * key position."""
    from jaxinfer.models.layers import alibi_slopes

    c = make_case(MIX, 4, 48, page_size=16, heads=8, kv_heads=kv_heads, head_dim=64, seed=11)
    kw = dict(sm_scale=0.125, alibi_slopes=jnp.asarray(alibi_slopes(8, "bloom")))
    out, r = run_both(c, impl, **kw)
    d = dense_numpy(c, **dict(kw, alibi_slopes=np.asarray(kw["alibi_slopes"])))
    np.testing.assert_allclose(r, d, atol=1e-5, rtol=1e-5)
    rows = used_rows(c)
    np.testing.assert_allclose(out[rows], r[rows], atol=1e-5, rtol=1e-5)
    plain, _ = run_both(c, impl, sm_scale=0.125)
    assert np.abs(plain - out).max() > 1e-2          # the slopes change the result
    with pytest.raises(ValueError, match=r"alibi_slopes: expected \[8\]"):
        run_both(c, impl, sm_scale=0.125, alibi_slopes=jnp.ones(4))


def test_alibi_slopes_follow_transformers():
    """Power-of-two head counts: 2^(-8(h+1)/H) for both rules; otherwise BLOOM's and MPT's
    own constructions (as transformers builds them)."""
    from jaxinfer.models.layers import alibi_slopes

    np.testing.assert_allclose(alibi_slopes(4, "bloom"), [2 ** -2, 2 ** -4, 2 ** -6, 2 ** -8])
    np.testing.assert_allclose(alibi_slopes(4, "mpt"), alibi_slopes(4, "bloom"))
    import torch  # a declared dependency (test extras): missing it fails, never skips
    from transformers.models.bloom.modeling_bloom import _get_alibi_slopes
    from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor

    for h in (6, 12, 20):
        np.testing.assert_allclose(alibi_slopes(h, "bloom"), _get_alibi_slopes(h, torch.device("cpu")).numpy(),
                                   rtol=1e-6)
        mpt = build_mpt_alibi_tensor(h, 2)[:, 0, 0].numpy()        # position -1: -slope
        np.testing.assert_allclose(alibi_slopes(h, "mpt"), -mpt, rtol=1e-6)


def test_alibi_runs_the_cpp_kernel_on_cpu_and_jnp_on_accelerators():
    from jaxinfer.attention import dispatch
    from pallas_kernels.attention import cpu as cpu_attention

    cpu_name = "cpp" if cpu_attention.available() else "xla"
    assert dispatch.select("auto", "cpu", alibi=True)[0] == cpu_name
    assert dispatch.select("auto", "tpu", alibi=True)[0] == "xla"
    assert dispatch.select("xla", "cpu", alibi=True) == ("xla", ragged_paged_attention)
    with pytest.raises(ValueError, match="attention: 'pallas' does not take ALiBi slopes"):
        dispatch.select("pallas", "cpu", alibi=True)


def _loop_equals_unrolled(write_layer, ks, vs, q, kv_lens, q_lens, pt, kw, page_shape: str, seed: int):
    """A lax.fori_loop of ``write_layer`` + the layer-indexed attention over every layer's
    pages (ks, vs; then the same pages stacked) equals the unrolled kv_cache.write_kv +
    attention calls bitwise, and the compiled loop copies no page array of ``page_shape``
    (HLO text) or their stack."""
    from pallas_kernels.attention import cpu as cpu_attention
    from pallas_kernels.layer_stack import Stacked
    from jaxinfer.engine.kv_cache import write_kv

    L, T = len(ks), q.shape[0]
    slots = jnp.asarray((np.arange(T) % 5 + 1) * 16 + np.arange(T) % 16, jnp.int32)   # inside pages 1..5
    rng = np.random.default_rng(seed)
    k_new = jnp.asarray(rng.standard_normal((T, 2, 64)).astype(np.float32))
    v_new = jnp.asarray(rng.standard_normal((T, 2, 64)).astype(np.float32))

    def looped(ks, vs):
        def body(i, c):
            ks, vs, acc = c
            ks, vs = write_layer(ks, vs, k_new * (i + 1.0), v_new, slots, i)
            o = cpu_attention.ragged_paged_attention_layer(q, ks, vs, i, kv_lens, q_lens, pt, **kw)
            return ks, vs, acc + o
        return jax.lax.fori_loop(0, L, body, (ks, vs, jnp.zeros_like(q)))

    def unrolled(ks, vs):
        ks, vs, acc = list(ks), list(vs), jnp.zeros_like(q)
        for i in range(L):
            ks[i], vs[i] = write_kv(ks[i], vs[i], k_new * (i + 1.0), v_new, slots)
            acc = acc + cpu_attention.ragged_paged_attention(q, ks[i], vs[i], kv_lens, q_lens, pt, **kw)
        return ks, vs, acc

    want = jax.jit(unrolled)(ks, vs)
    compiled = jax.jit(looped, donate_argnums=(0, 1)).lower(ks, vs).compile()
    assert not [ln for ln in compiled.as_text().splitlines() if " copy(" in ln and page_shape in ln]
    got = compiled(jax.tree.map(jnp.array, ks), jax.tree.map(jnp.array, vs))
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    # The stacked form (the engine's pool, kv_cache.StackedKV): each kind one [L, ...]
    # operand, the same bits, no copy of the stack either; a layer past L is refused.
    stack = lambda xs: Stacked(jax.tree.map(lambda *a: jnp.stack(a), *xs))   # noqa: E731
    compiled = jax.jit(looped, donate_argnums=(0, 1)).lower(stack(ks), stack(vs)).compile()
    stacked_shape = page_shape.replace("[", f"[{L},", 1)
    assert not [ln for ln in compiled.as_text().splitlines() if " copy(" in ln and stacked_shape in ln]
    got_k, got_v, got_o = compiled(stack(ks), stack(vs))
    for g, w in zip(jax.tree.leaves((got_k, got_v, got_o)), jax.tree.leaves((stack(want[0]), stack(want[1]), want[2]))):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    with pytest.raises(Exception, match="out of range"):
        np.asarray(cpu_attention.ragged_paged_attention_layer(q, stack(ks), stack(vs), jnp.int32(L), kv_lens,
                                                              q_lens, pt, **kw))


@pytest.mark.skipif(shutil.which(os.environ.get("CXX", "g++")) is None,
                    reason="no C++ compiler: the CPU attention kernel cannot be built here")
def test_cpp_layer_indexed_attention_and_write_in_a_loop():
    """The layer loop's kernels (pallas_kernels/attention/cpu.py): every layer's pages as
    operands plus a traced layer index. Attention gives ragged_paged_attention's bits on
    the chosen layer; the write changes only that layer's rows, in place (the kernel fails
    if XLA copied the pages), as kv_cache.write_kv would; and a lax.fori_loop of write +
    attend over the layers equals the unrolled per-layer calls bitwise, with no copy of a
    page array in the loop."""
    from pallas_kernels.attention import cpu as cpu_attention

    assert cpu_attention.available(), cpu_attention.unavailable_reason()
    L = 3
    cases = [make_case([Seq(37, 1), Seq(20, 1), Seq(50, 16)], 2, 16, page_size=16, heads=4, kv_heads=2,
                       head_dim=64, seed=s) for s in range(L)]
    c0 = cases[0]
    kw = dict(num_decode=2, prefill_chunk=16, sm_scale=0.125)
    ks = [jnp.asarray(np.nan_to_num(c.k_pages)) for c in cases]
    vs = [jnp.asarray(np.nan_to_num(c.v_pages)) for c in cases]
    q, kv_lens, q_lens, pt = (jnp.asarray(x) for x in (c0.q, c0.kv_lens, c0.q_lens, c0.page_table))
    for i in range(L):
        got = cpu_attention.ragged_paged_attention_layer(q, ks, vs, jnp.int32(i), kv_lens, q_lens, pt, **kw)
        want = cpu_attention.ragged_paged_attention(q, ks[i], vs[i], kv_lens, q_lens, pt, **kw)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=f"layer {i}")
    _loop_equals_unrolled(cpu_attention.write_kv_layer, ks, vs, q, kv_lens, q_lens, pt, kw,
                          "f32[%d,16,2,64]" % ks[0].shape[0], seed=7)
    with pytest.raises(Exception, match="out of range"):
        np.asarray(cpu_attention.ragged_paged_attention_layer(q, ks, vs, jnp.int32(L), kv_lens, q_lens, pt, **kw))


@pytest.mark.skipif(shutil.which(os.environ.get("CXX", "g++")) is None,
                    reason="no C++ compiler: the CPU attention kernel cannot be built here")
def test_cpp_attention_reads_int8_pages_as_their_dequantized_floats():
    """int8 KV pages (kv_cache.QuantizedPages) in the C++ kernel: the plain and the
    layer-indexed form give exactly the bits of float32 pages holding the dequantized values
    (with and without a sliding window); the layer loop's in-place write
    (kv_cache.write_kv_layer) leaves the pages write_kv leaves, and a fori_loop of write +
    attend equals the unrolled calls bitwise without copying a page array."""
    from pallas_kernels.attention import cpu as cpu_attention
    from jaxinfer.engine.kv_cache import QuantizedPages, quantize_kv, write_kv_layer

    assert cpu_attention.available(), cpu_attention.unavailable_reason()
    L = 3
    cases = [make_case([Seq(37, 1), Seq(20, 1), Seq(50, 16)], 2, 16, page_size=16, heads=4, kv_heads=2,
                       head_dim=64, seed=s) for s in range(L)]
    c0 = cases[0]
    q, kv_lens, q_lens, pt = (jnp.asarray(x) for x in (c0.q, c0.kv_lens, c0.q_lens, c0.page_table))

    def quantized(pages):
        x = jnp.asarray(np.nan_to_num(pages))
        qv, scale = quantize_kv(x.reshape(-1, *x.shape[2:]))
        return QuantizedPages(qv.reshape(x.shape), scale.reshape(x.shape[:3]))

    ks, vs = [quantized(c.k_pages) for c in cases], [quantized(c.v_pages) for c in cases]
    for window in (None, 24):
        kw = dict(num_decode=2, prefill_chunk=16, sm_scale=0.125, sliding_window=window)
        for i in range(L):
            got = cpu_attention.ragged_paged_attention(q, ks[i], vs[i], kv_lens, q_lens, pt, **kw)
            want = cpu_attention.ragged_paged_attention(q, ks[i].dequantize(), vs[i].dequantize(), kv_lens,
                                                        q_lens, pt, **kw)
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=f"layer {i} window {window}")
            got_l = cpu_attention.ragged_paged_attention_layer(q, ks, vs, jnp.int32(i), kv_lens, q_lens, pt, **kw)
            np.testing.assert_array_equal(np.asarray(got_l), np.asarray(want), err_msg=f"layer form {i}")
    kw = dict(num_decode=2, prefill_chunk=16, sm_scale=0.125)
    _loop_equals_unrolled(write_kv_layer, ks, vs, q, kv_lens, q_lens, pt, kw,
                          "s8[%d,16,2,64]" % ks[0].shape[0], seed=8)
    with pytest.raises(ValueError, match="one K and V page array of one shape and kind"):
        cpu_attention.ragged_paged_attention_layer(q, ks[:1] + [ks[1].dequantize()], vs[:2], 0, kv_lens, q_lens, pt,
                                                   **kw)
