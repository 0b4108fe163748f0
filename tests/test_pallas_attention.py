"""Pallas ragged paged attention vs the engine's pure-jnp reference.

Every case runs on CPU under interpretation: the TPU (Mosaic) kernel under TPU interpret
mode (``pltpu.InterpretParams``: HBM/VMEM, DMAs and semaphores simulated), the GPU (Triton)
kernel under Pallas' generic ``interpret=True``. The same cases run compiled when the test
process sees a TPU or a GPU (subclasses flip ``interpret``); elsewhere those classes skip.

Each case mixes several things at once to keep interpretation time down (compiling the
interpreted kernel dominates): decode and prefill slots in one step, a partial prefill
chunk, an unused slot, kv lengths that are not multiples of the page size, a page table
wider than needed. Unused pages, page 0 (the padding sink) and the tail of each
sequence's last page are NaN, so any read that is not masked by a select fails loudly.
Sweep: page sizes 4/8/16/32, head dims 64/128, GQA ratios 1/3/8, f32 and bf16, sliding
window and logit soft-cap.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.attention.pallas import (ragged_paged_attention_gpu,
                                                   ragged_paged_attention_tpu,
                                                   reference_on_step_layout)

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    H: int
    KVH: int
    D: int
    ps: int
    dtype: object
    num_decode: int
    prefill_chunk: int
    kv_lens: tuple[int, ...]
    q_lens: tuple[int, ...]
    sliding_window: int | None = None
    soft_cap: float | None = None
    kv_block: int | None = None
    rows_per_block: int | None = None
    kv_split_blocks: int | None = None  # GPU only (default: decode splits, prefill not)


CASES = [
    # SmolLM2's heads (9 q / 3 kv, 64): 3 decode slots + full, partial and unused prefill slots
    Case("gqa3-d64-ps16-mixed", 9, 3, 64, 16, jnp.float32, 3, 16,
         kv_lens=(37, 1, 16, 40, 29, 0), q_lens=(1, 1, 1, 16, 5, 0), kv_block=32,
         kv_split_blocks=1),
    # MHA, decode only, several pages per KV block; on GPU unsplit (the others split)
    Case("mha-d128-ps8-decode", 4, 4, 128, 8, jnp.float32, 4, 0,
         kv_lens=(1, 8, 23, 50), q_lens=(1, 1, 1, 1), kv_block=64, kv_split_blocks=0),
    # GQA 8, prefill only, several row blocks and KV blocks, a cached prefix
    Case("gqa8-d128-ps32-prefill", 16, 2, 128, 32, jnp.float32, 0, 24,
         kv_lens=(70, 24), q_lens=(24, 24), kv_block=32, rows_per_block=64),
    # sliding window + soft cap, tiny pages
    Case("gqa3-d64-ps4-window-softcap", 6, 2, 64, 4, jnp.float32, 2, 12,
         kv_lens=(30, 9, 25, 12), q_lens=(1, 1, 12, 7), sliding_window=7, soft_cap=5.0,
         kv_block=8),
    # bf16, MQA (ratio 8), default block sizes
    Case("bf16-gqa8-d64-ps16", 8, 1, 64, 16, jnp.bfloat16, 2, 16,
         kv_lens=(100, 17, 33), q_lens=(1, 1, 16)),
    # bf16, MHA, head_dim 128, sliding window
    Case("bf16-mha-d128-ps16-window", 2, 2, 128, 16, jnp.bfloat16, 1, 8,
         kv_lens=(50, 20), q_lens=(1, 8), sliding_window=10, kv_block=32),
]


def make_inputs(case: Case, seed: int = 0):
    """Random q/K/V; pages not holding a live KV position are NaN."""
    rng = np.random.default_rng(seed)
    S = len(case.kv_lens)
    need = [-(-kv // case.ps) for kv in case.kv_lens]
    P = max(need) + 2                                    # trailing page-0 entries
    N = 1 + sum(need) + 3                                # + never-used pages
    k = np.full((N, case.ps, case.KVH, case.D), np.nan, np.float32)
    v = np.full_like(k, np.nan)
    ids = rng.permutation(np.arange(1, N))
    pt = np.zeros((S, P), np.int32)
    c = 0
    for s in range(S):
        for p in range(need[s]):
            page = ids[c]
            c += 1
            pt[s, p] = page
            n = min(case.ps, case.kv_lens[s] - p * case.ps)
            k[page, :n] = rng.standard_normal((n, case.KVH, case.D))
            v[page, :n] = rng.standard_normal((n, case.KVH, case.D))
    T = case.num_decode + (S - case.num_decode) * case.prefill_chunk
    q = rng.standard_normal((T, case.H, case.D)).astype(np.float32)
    dt = case.dtype
    return (jnp.asarray(q, dt), jnp.asarray(k, dt), jnp.asarray(v, dt),
            jnp.asarray(case.kv_lens, jnp.int32), jnp.asarray(case.q_lens, jnp.int32),
            jnp.asarray(pt))


def static_kwargs(case: Case) -> dict:
    return dict(num_decode=case.num_decode, prefill_chunk=case.prefill_chunk,
                sm_scale=case.D ** -0.5, sliding_window=case.sliding_window,
                soft_cap=case.soft_cap)


def check_case(fn, case: Case, interpret) -> None:
    args = make_inputs(case)
    kw = static_kwargs(case)
    ref = np.asarray(reference_on_step_layout(*args, **kw).astype(jnp.float32))
    if fn is ragged_paged_attention_gpu:
        kw["kv_split_blocks"] = case.kv_split_blocks
    out = fn(*args, **kw, interpret=interpret, kv_block=case.kv_block,
             rows_per_block=case.rows_per_block)
    assert out.shape == args[0].shape and out.dtype == args[0].dtype
    out = np.asarray(out.astype(jnp.float32))
    assert not np.isnan(out).any(), "NaN leaked from an unused page"
    tol = TOL[case.dtype]
    np.testing.assert_allclose(out, ref, rtol=tol, atol=tol)
    # rows past q_len and unused slots are exact zeros
    S = len(case.kv_lens)
    for s in range(case.num_decode, S):
        t0 = case.num_decode + (s - case.num_decode) * case.prefill_chunk
        assert (out[t0 + case.q_lens[s]:t0 + case.prefill_chunk] == 0).all()


def _has(platform: str) -> bool:
    try:
        return bool(jax.devices(platform))
    except RuntimeError:
        return False


class _AttentionCases:
    """Subclasses set the kernel and ``interpret``; every case must match the reference."""

    kernel = None
    interpret = None

    @pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
    def test_matches_reference(self, case):
        check_case(type(self).kernel, case, type(self).interpret)


class TestTPUKernelInterpret(_AttentionCases):
    kernel = ragged_paged_attention_tpu
    interpret = pltpu.InterpretParams()


class TestGPUKernelInterpret(_AttentionCases):
    kernel = ragged_paged_attention_gpu
    interpret = True


@pytest.mark.skipif(not _has("tpu"), reason="compiled Mosaic kernel needs a TPU")
class TestTPUKernelCompiled(_AttentionCases):
    kernel = ragged_paged_attention_tpu
    interpret = False


@pytest.mark.skipif(not _has("gpu"), reason="compiled Triton kernel needs a GPU")
class TestGPUKernelCompiled(_AttentionCases):
    kernel = ragged_paged_attention_gpu
    interpret = False


def test_gpu_flash_decoding_is_batch_and_bucket_invariant():
    """A decode token's bits do not depend on the other slots nor on the page table's
    width, although both change the number of KV splits."""
    case = dataclasses.replace(CASES[0], num_decode=1, prefill_chunk=0, kv_lens=(37,),
                               q_lens=(1,))
    q, k, v, kvl, ql, pt = make_inputs(case)
    kw = dict(num_decode=1, prefill_chunk=0, sm_scale=0.125, interpret=True, kv_block=16,
              kv_split_blocks=1)
    alone = ragged_paged_attention_gpu(q, k, v, kvl, ql, pt, **kw)
    wide = jnp.pad(pt, ((0, 2), (0, 5)))                   # 2 more slots, 5 more pages
    q3 = jnp.concatenate([q, q[::-1] * 0.5, q * 2.0])
    kv3 = jnp.concatenate([kvl, jnp.array([5, 0], jnp.int32)])
    ql3 = jnp.concatenate([ql, jnp.array([1, 0], jnp.int32)])
    wide = wide.at[1, 0].set(pt[0, 1])
    batch = ragged_paged_attention_gpu(q3, k, v, kv3, ql3, wide, **(kw | {"num_decode": 3}))
    np.testing.assert_array_equal(np.asarray(batch[:1]), np.asarray(alone))


def test_tpu_double_buffer_has_no_race():
    """Eager DMAs (a copy lands as soon as it starts) + the interpreter's race detector:
    prefetching block b+1 must never write the buffer block b is read from."""
    case = CASES[3]
    params = pltpu.InterpretParams(dma_execution_mode="eager", detect_races=True)
    check_case(ragged_paged_attention_tpu, case, params)
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as ipc
    assert ipc.races is not None and not ipc.races.races_found


@pytest.mark.parametrize("fn,platform", [(ragged_paged_attention_tpu, "tpu"),
                                         (ragged_paged_attention_gpu, "cuda")])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_lowers_for_the_accelerator(fn, platform, dtype):
    """The kernels lower to Mosaic / Triton IR on this CPU (catches unsupported ops and
    Triton's power-of-two rule without hardware; the device compile is not exercised)."""
    S, nd, chunk, P, N = 4, 2, 32, 8, 64
    q = jax.ShapeDtypeStruct((nd + (S - nd) * chunk, 9, 64), dtype)
    kv = jax.ShapeDtypeStruct((N, 16, 3, 64), dtype)
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)
    extra = {"kv_split_blocks": 2} if fn is ragged_paged_attention_gpu else {}  # flash-decoding
    fn.trace(q, kv, kv, i32(S), i32(S), i32(S, P), num_decode=nd, prefill_chunk=chunk,
             sm_scale=0.125, sliding_window=64, soft_cap=30.0, kv_block=16,
             **extra).lower(lowering_platforms=(platform,))


def _shapes(T=3, H=4, KVH=2, D=64, ps=16, S=3, P=4, N=8):
    f = jnp.float32
    return [jnp.zeros((T, H, D), f), jnp.zeros((N, ps, KVH, D), f), jnp.zeros((N, ps, KVH, D), f),
            jnp.zeros((S,), jnp.int32), jnp.zeros((S,), jnp.int32), jnp.zeros((S, P), jnp.int32)]


@pytest.mark.parametrize("change,kw,match", [
    (lambda a: a.__setitem__(0, jnp.zeros((3, 5, 64))), {}, "num_heads"),
    (lambda a: a.__setitem__(0, jnp.zeros((3, 4, 32))), {}, "head_dim"),
    (lambda a: a.__setitem__(2, jnp.zeros((8, 16, 2, 32))), {}, "v_pages"),
    (lambda a: a.__setitem__(3, jnp.zeros((2,), jnp.int32)), {}, "kv_lens"),
    (lambda a: a.__setitem__(4, jnp.zeros((3,), jnp.float32)), {}, "q_lens"),
    (lambda a: None, {"num_decode": 2}, "T"),
    (lambda a: None, {"num_decode": 4}, "num_decode"),
    (lambda a: None, {"sliding_window": 0}, "sliding_window"),
])
def test_shape_errors_name_the_dimension(change, kw, match):
    args = _shapes()
    change(args)
    static = dict(num_decode=3, prefill_chunk=4, sm_scale=1.0) | kw
    for fn in (ragged_paged_attention_tpu, ragged_paged_attention_gpu):
        with pytest.raises(ValueError, match=match):
            fn(*args, **static)


def test_gpu_kernel_rejects_non_power_of_two_page_size():
    args = _shapes(ps=12)
    with pytest.raises(ValueError, match="page_size"):
        ragged_paged_attention_gpu(*args, num_decode=3, prefill_chunk=4, sm_scale=1.0)


# ---- int8 KV pages (kv_cache_dtype="int8"): the kernels dequantize in VMEM / registers ----

def make_int8_inputs(case: Case, seed: int = 0):
    """make_inputs with K/V quantized per token and KV head (kv_cache.quantize_kv); the
    scales of unused pages and page tails are NaN, so an unmasked read fails loudly."""
    from jaxinfer.engine.kv_cache import QuantizedPages, quantize_kv

    q, k, v, kvl, ql, pt = make_inputs(case, seed)

    def quant(x):
        x = np.asarray(x, np.float32)
        dead = np.isnan(x).any(-1)                                     # [N, ps, KVH]
        N, ps, KVH, D = x.shape
        qv, sc = quantize_kv(jnp.asarray(np.nan_to_num(x).reshape(N * ps, KVH, D)))
        sc = np.where(dead, np.nan, np.asarray(sc).reshape(N, ps, KVH)).astype(np.float32)
        return QuantizedPages(jnp.asarray(qv).reshape(N, ps, KVH, D), jnp.asarray(sc))

    return q.astype(jnp.float32), quant(k), quant(v), kvl, ql, pt


INT8_CASES = [dataclasses.replace(CASES[0], dtype=jnp.float32),
              dataclasses.replace(CASES[3], dtype=jnp.float32)]


@pytest.mark.parametrize("fn,interpret", [(ragged_paged_attention_tpu, pltpu.InterpretParams()),
                                          (ragged_paged_attention_gpu, True)], ids=["tpu", "gpu"])
@pytest.mark.parametrize("case", INT8_CASES, ids=[c.name for c in INT8_CASES])
def test_int8_kv_pages_match_reference(fn, interpret, case):
    args = make_int8_inputs(case)
    kw = static_kwargs(case)
    ref = np.asarray(reference_on_step_layout(*args, **kw))
    if fn is ragged_paged_attention_gpu:
        kw["kv_split_blocks"] = case.kv_split_blocks
    out = np.asarray(fn(*args, **kw, interpret=interpret, kv_block=case.kv_block,
                        rows_per_block=case.rows_per_block))
    assert not np.isnan(out).any(), "NaN leaked from an unused page's scale"
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fn,platform", [(ragged_paged_attention_tpu, "tpu"),
                                         (ragged_paged_attention_gpu, "cuda")])
def test_int8_kv_lowers_for_the_accelerator(fn, platform):
    from jaxinfer.engine.kv_cache import QuantizedPages

    S, nd, chunk, P, N = 4, 2, 32, 8, 64
    q = jax.ShapeDtypeStruct((nd + (S - nd) * chunk, 9, 64), jnp.bfloat16)
    kv = QuantizedPages(jax.ShapeDtypeStruct((N, 16, 3, 64), jnp.int8),
                        jax.ShapeDtypeStruct((N, 16, 3), jnp.float32))
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)   # noqa: E731
    extra = {"kv_split_blocks": 2} if fn is ragged_paged_attention_gpu else {}
    fn.trace(q, kv, kv, i32(S), i32(S), i32(S, P), num_decode=nd, prefill_chunk=chunk,
             sm_scale=0.125, kv_block=16, **extra).lower(lowering_platforms=(platform,))
