"""The CPU float32 matmul (pallas_kernels/f32_matmul/cpu.py + f32_matmul.cc, via
jax.ffi): values against numpy float64, bitwise batch invariance (a row's bits do not
depend on the other rows or on M, across the decode and GEMM paths), errors, and that
jaxinfer/matmul.py routes float32 weights to it on CPU (bf16 stays with XLA)."""

from __future__ import annotations

import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import matmul as routing
from pallas_kernels.f32_matmul import cpu as F

# Without a compiler the engine keeps XLA's dots (test_without_the_kernel_xla_paths).
needs_kernel = pytest.mark.skipif(shutil.which(os.environ.get("CXX", "g++")) is None,
                                  reason="no C++ compiler: the CPU f32 kernel cannot be built here")


def _rand(shape: tuple[int, ...], seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _tol(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """f32 FMA chain over K terms: error <= ~K * eps * sum|x w| (a bound, ~sqrt(K) typical)."""
    return 2 * x.shape[1] * np.finfo(np.float32).eps * (np.abs(x).astype(np.float64) @ np.abs(w))


@needs_kernel
def test_kernel_builds_and_registers():
    assert F.available(), F.unavailable_reason()
    second_build_compiles_nothing(F.build)


def second_build_compiles_nothing(build) -> None:
    """The cached library is found again: the compiler is not run and the file is untouched."""
    from unittest import mock

    from pallas_kernels import cpu_build

    first = build()
    stat = first.stat()
    with mock.patch.object(cpu_build.subprocess, "run", side_effect=AssertionError("compiler ran")):
        second = build()
    assert second == first and second.stat().st_mtime_ns == stat.st_mtime_ns


# (K, N): SmolLM2's (576, 192); odd K; N with a scalar tail (not a multiple of 8) and a
# partial 16-column GEMM panel; N smaller than one vector.
SHAPES = [(576, 192), (77, 37), (64, 200), (130, 5)]


@needs_kernel
@pytest.mark.parametrize("K,N", SHAPES)
def test_values_and_bitwise_batch_invariance(K, N):
    assert F.available()
    w = _rand((K, N), 0)
    xs = _rand((100, K), 1)
    wj = jnp.asarray(w)
    full = np.asarray(F.f32_matmul(jnp.asarray(xs), wj))               # GEMM path, M = 100
    assert np.all(np.abs(full - F.f32_matmul_reference(xs, w)) <= _tol(xs, w))
    # M = 1..3 take the decode tiles, larger M the GEMM: a row's bits are the same in all
    for M in (1, 2, 5, 33):
        got = np.asarray(F.f32_matmul(jnp.asarray(xs[:M]), wj))
        np.testing.assert_array_equal(got, full[:M], err_msg=f"M={M}")
    # each row alone, and the rows in another company (reversed, inside a bigger batch)
    alone = np.concatenate([np.asarray(F.f32_matmul(jnp.asarray(xs[i:i + 1]), wj))
                            for i in range(0, 100, 7)])
    np.testing.assert_array_equal(alone, full[::7])
    rev = np.asarray(F.f32_matmul(jnp.asarray(xs[::-1][:64]), wj))
    np.testing.assert_array_equal(rev, full[::-1][:64])


@needs_kernel
def test_large_k_blocks_keep_the_chain():
    """M = 512 cuts K = 1536 into blocks (partial sums kept in y between them): a row's bits
    still equal the same row computed alone, in one unbroken chain."""
    K, N = 1536, 48
    x, w = _rand((512, K), 2), _rand((K, N), 3)
    full = np.asarray(F.f32_matmul(jnp.asarray(x), jnp.asarray(w)))
    assert np.all(np.abs(full - F.f32_matmul_reference(x, w)) <= _tol(x, w))
    for i in (0, 257, 511):
        np.testing.assert_array_equal(np.asarray(F.f32_matmul(jnp.asarray(x[i:i + 1]), jnp.asarray(w))),
                                      full[i:i + 1])


@needs_kernel
def test_inside_jit_and_empty_batch():
    w = jnp.asarray(_rand((64, 24), 4))
    x = jnp.asarray(_rand((3, 64), 5))
    y = jax.jit(F.f32_matmul)(x, w)
    assert y.dtype == jnp.float32 and y.shape == (3, 24)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(F.f32_matmul(x, w)))
    assert F.f32_matmul(jnp.zeros((0, 64)), w).shape == (0, 24)


def test_errors_name_the_problem():
    w = jnp.zeros((64, 32), jnp.float32)
    with pytest.raises(ValueError, match=r"x: expected \[M, K=64\]"):
        F.f32_matmul(jnp.zeros((2, 32)), w)
    with pytest.raises(ValueError, match="must be float32"):
        F.f32_matmul(jnp.zeros((2, 64), jnp.bfloat16), w)
    with pytest.raises(ValueError, match="must be float32"):
        F.f32_matmul(jnp.zeros((2, 64)), w.astype(jnp.bfloat16))
    with pytest.raises(ValueError, match=r"expected x \[M, K\] and w \[K, N\]"):
        F.f32_matmul(jnp.zeros((64,)), w)


@needs_kernel
def test_layers_route_f32_weights_to_the_kernel():
    """Both engines' dots send float32 weights to the kernel (its bits, for any T), and
    keep bf16 weights on XLA's dot."""
    assert jax.default_backend() == "cpu"
    assert F.available(), F.unavailable_reason()      # registers the kernel (when run alone too)
    w = jnp.asarray(_rand((96, 40), 6))
    x = jnp.asarray(_rand((45, 96), 7))
    want = np.asarray(F.f32_matmul(x, w))
    for mm in (routing.matmul, routing.tiled_matmul):
        for T in (1, 2, 45):
            np.testing.assert_array_equal(np.asarray(jax.jit(mm)(x[:T], w)), want[:T])
        hlo = jax.jit(mm).lower(x, w).as_text()
        assert F.TARGET in hlo
    wb, xb = w.astype(jnp.bfloat16), x.astype(jnp.bfloat16)
    for mm in (routing.matmul, routing.tiled_matmul):
        assert F.TARGET not in jax.jit(mm).lower(xb, wb).as_text()


def test_without_the_kernel_xla_paths(monkeypatch):
    """A host without a compiler: float weights go to XLA's dot (tiled for invariance)."""
    monkeypatch.setattr(F, "available", lambda: False)
    # shapes no other test jits layers.matmul with: jit's trace cache would replay the kernel
    w = jnp.asarray(_rand((88, 40), 6))
    x = jnp.asarray(_rand((45, 88), 7))
    for mm in (routing.matmul, routing.tiled_matmul):
        lowered = jax.jit(mm).lower(x, w).as_text()
        assert F.TARGET not in lowered
        np.testing.assert_allclose(np.asarray(mm(x, w)), np.asarray(x) @ np.asarray(w),
                                   rtol=1e-5, atol=1e-4)
    # tiled_matmul's own invariance (the XLA path): a row alone == the row in the batch
    np.testing.assert_array_equal(np.asarray(routing.tiled_matmul(x[:1], w)),
                                  np.asarray(routing.tiled_matmul(x, w))[:1])


# Panel-major weights: N a multiple of 16; K odd; a long K; one panel; many panels (units
# of several panels whose tiles prefetch the next one).
PANEL_SHAPES = [(576, 192), (77, 48), (1536, 64), (64, 16), (96, 1024)]


@needs_kernel
@pytest.mark.parametrize("K,N", PANEL_SHAPES)
def test_panelled_weights_give_the_same_bits(K, N):
    """A PanelledF32 weight goes through the panel paths (decode tiles for M <= 3, the GEMM
    reading the panels in place from x packed in row tiles of 4 to 6 rows) and gives the
    plain layout's bits for every M, whatever its row tiles (M = 13: 5, 4, 4; M = 32: 6, 6,
    5, 5, 5, 5); ``unpanelled`` restores the weight exactly."""
    w = _rand((K, N), 8)
    wp = F.panel(jnp.asarray(w))
    assert isinstance(wp, F.PanelledF32) and wp.shape == (K, N) and wp.panels.shape == (N // 16, K, 16)
    np.testing.assert_array_equal(np.asarray(wp.unpanelled()), w)
    xs = jnp.asarray(_rand((200, K), 9))
    full = np.asarray(F.f32_matmul(xs, jnp.asarray(w)))
    for M in (1, 2, 3, 4, 5, 7, 13, 32, 37, 64, 200):
        got = np.asarray(F.f32_matmul(xs[:M], wp))
        np.testing.assert_array_equal(got, full[:M], err_msg=f"M={M}")
    assert F.TARGET_PANELS in jax.jit(F.f32_matmul).lower(xs[:4], wp).as_text()


def test_panel_keeps_what_it_cannot_panel():
    w = jnp.zeros((64, 40), jnp.float32)                 # N % 16 != 0: stays plain
    assert F.panel(w) is w
    with pytest.raises(ValueError, match="float32"):
        F.panel(w.astype(jnp.bfloat16))
    wp = F.panel(jnp.zeros((64, 32), jnp.float32))
    with pytest.raises(ValueError, match=r"x: expected \[M, K=64\]"):
        F.f32_matmul(jnp.zeros((2, 32)), wp)
    with pytest.raises(TypeError, match=r"only \[\.\.\.\]"):
        wp[0]


@needs_kernel
def test_float_engine_prepares_the_model_bitwise():
    """quantization.prepare_float_for_cpu: a new module (the given one untouched) whose q/k/v
    and gate/up float32 weights are one weight each and whose matmul weights are panelled;
    every product is bitwise the separate, plain products (each output column is its own
    FMA chain), and the engine's models are prepared so."""
    import pathlib
    import sys

    from jaxinfer.quantization import prepare_float_for_cpu

    sys.path.insert(0, str(pathlib.Path(__file__).parent))
    from tp_worker import tiny_loaded

    model = tiny_loaded("llama_8q4kv").model
    fused = prepare_float_for_cpu(model)
    a, b = model.layers[0], fused.layers[0]
    assert hasattr(a, "wq") and not hasattr(a, "wqkv")          # the original is untouched
    assert hasattr(b, "wqkv") and hasattr(b, "w_gate_up") and not hasattr(b, "wq")
    x = jnp.asarray(_rand((5, a.wq[...].shape[0]), 3))
    for fused_name, parts in (("wqkv", ("wq", "wk", "wv")), ("w_gate_up", ("w_gate", "w_up"))):
        want = np.concatenate([np.asarray(F.f32_matmul(x, getattr(a, p)[...])) for p in parts], axis=1)
        assert isinstance(getattr(b, fused_name)[...], F.PanelledF32)
        np.testing.assert_array_equal(np.asarray(F.f32_matmul(x, getattr(b, fused_name)[...])), want)
    assert isinstance(b.wo[...], F.PanelledF32) and isinstance(fused.lm_head[...], F.PanelledF32)
    xo = jnp.asarray(_rand((5, a.wo[...].shape[0]), 4))
    np.testing.assert_array_equal(np.asarray(F.f32_matmul(xo, b.wo[...])),
                                  np.asarray(F.f32_matmul(xo, a.wo[...])))


@needs_kernel
@pytest.mark.parametrize("panelled", [False, True])
def test_layer_indexed_matmul_in_a_loop_copies_no_weight(panelled):
    """f32_matmul_layer (the layer loop's matmul: every layer's weight as an operand plus a
    traced index) gives f32_matmul's bits for each layer, alone and inside lax.fori_loop,
    where XLA hands the loop-invariant weights to the kernel without copying them; an
    index out of range is an error, not a read past the buffers."""
    assert F.available(), F.unavailable_reason()
    L, K, N = 4, 96, 64
    ws = [jnp.asarray(_rand((K, N), 20 + i)) for i in range(L)]
    if panelled:
        ws = [F.panel(w) for w in ws]
    for M in (1, 5, 33):
        x = jnp.asarray(_rand((M, K), 30 + M))
        for i in range(L):
            np.testing.assert_array_equal(np.asarray(F.f32_matmul_layer(x, ws, jnp.int32(i))),
                                          np.asarray(F.f32_matmul(x, ws[i])), err_msg=f"M={M} layer {i}")
    sq = [jnp.asarray(_rand((N, N), 40 + i)) for i in range(L)]      # square: a chain through layers
    if panelled:
        sq = [F.panel(w) for w in sq]
    x = jnp.asarray(_rand((3, N), 50))

    def looped(x, sq):
        return jax.lax.fori_loop(0, L, lambda i, h: F.f32_matmul_layer(h, sq, i) * 0.1, x)

    def unrolled(x, sq):
        for w in sq:
            x = F.f32_matmul(x, w) * 0.1
        return x

    compiled = jax.jit(looped).lower(x, sq).compile()
    np.testing.assert_array_equal(np.asarray(compiled(x, sq)), np.asarray(jax.jit(unrolled)(x, sq)))
    weight_shape = "f32[4,64,16]" if panelled else "f32[64,64]"
    copies = [ln for ln in compiled.as_text().splitlines() if " copy(" in ln and weight_shape in ln]
    assert not copies, copies
    with pytest.raises(Exception, match="out of range"):
        np.asarray(F.f32_matmul_layer(x, sq, jnp.int32(L)))
    with pytest.raises(ValueError, match="one shape and layout"):
        F.f32_matmul_layer(x, [sq[0], jnp.zeros((N, N + 16), jnp.float32)], jnp.int32(0))
    _stacked_equals_per_layer(F.f32_matmul_layer, x, sq, L)


def _stacked_equals_per_layer(layer_fn, x, ws, L):
    """The stacked form (pallas_kernels/layer_stack.py: one [L, ...] operand per array)
    gives the per-layer form's bits for every layer, inside a loop too without copying the
    stack, and refuses an index past its L."""
    from pallas_kernels.layer_stack import Stacked

    st = Stacked(jax.tree.map(lambda *a: jnp.stack(a), *ws))
    for i in range(L):
        np.testing.assert_array_equal(np.asarray(layer_fn(x, st, jnp.int32(i))),
                                      np.asarray(layer_fn(x, ws, jnp.int32(i))), err_msg=f"stacked, layer {i}")
    compiled = jax.jit(lambda x, st: jax.lax.fori_loop(
        0, L, lambda i, acc: acc + layer_fn(x, st, i), jnp.zeros_like(layer_fn(x, st, 0)))).lower(x, st).compile()
    want = np.zeros_like(np.asarray(layer_fn(x, ws, jnp.int32(0))))
    for i in range(L):                       # the loop's order of float32 sums
        want = want + np.asarray(layer_fn(x, ws, jnp.int32(i)))
    np.testing.assert_array_equal(np.asarray(compiled(x, st)), want)
    hlo = {"float32": "f32", "int8": "s8", "float16": "f16"}
    stacks = {f"{hlo[str(a.dtype)]}[{','.join(map(str, a.shape))}]" for a in jax.tree.leaves(st)}
    assert not [ln for ln in compiled.as_text().splitlines() if " copy(" in ln and any(t in ln for t in stacks)]
    with pytest.raises(Exception, match="out of range"):
        np.asarray(layer_fn(x, st, jnp.int32(L)))


@pytest.mark.parametrize("n", [1, 8, 24, 96])
def test_xla_invariant_matmul_rows_do_not_depend_on_the_batch(n):
    """XLA's own dot in invariant mode (the path of bf16 weights, GPU/TPU, no compiler):
    every row the same bits for any number of rows. Narrow outputs are the case that broke
    on an AVX2-only Zen 3 when 2..32 rows ran unpadded (a MoE router, N = 8)."""
    from jaxinfer import matmul as M

    rng = np.random.RandomState(n)
    x = jnp.asarray(rng.randn(70, 64), jnp.float32)
    w = jnp.asarray(rng.randn(64, n), jnp.float32)
    f = jax.jit(lambda a: M.xla_matmul(a, w, invariant=True))
    full = np.asarray(f(x))
    for m in (1, 2, 3, 4, 8, 17, 31, 32, 33, 64):
        np.testing.assert_array_equal(np.asarray(f(x[:m])), full[:m], err_msg=f"{m} rows")


def _block_quantized(K: int, N: int, seed: int, kind: str) -> np.ndarray:
    """float32 [K, N] as a GGUF dequantizer makes it from blocks of 32 rows of a column
    (gguf-py's numpy formulas): Q4_1 ``d * q + m`` (d, m float16, q 0..15), Q8_0 ``d * q``
    (d float16, q -127..127)."""
    rng = np.random.default_rng(seed)
    B = K // 32
    d = (rng.uniform(0.001, 0.05, (B, 1, N))).astype(np.float16).astype(np.float32)
    if kind == "q4_1":
        q = rng.integers(0, 16, (B, 32, N)).astype(np.float32)
        q[:, 0], q[:, 1] = 0, 15              # the quantizer maps a block's min to 0, max to 15
        m = rng.uniform(-0.5, 0.0, (B, 1, N)).astype(np.float16).astype(np.float32)
        return (d * q + m).reshape(K, N)
    q = rng.integers(-127, 128, (B, 32, N)).astype(np.float32)
    q[:, 0] = 127                            # amax maps to +-127
    return (d * q).reshape(K, N)


@needs_kernel
@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
@pytest.mark.parametrize("K,N", [(576, 192), (1536, 64), (64, 16 * 70)])
def test_coded_weights_give_the_float32_bits(kind, K, N):
    """codes.encode finds exact codes for a block-quantized float32 weight (CodedF32: int8
    codes, a scale and offset per 32 rows of a column): dequantized by the kernel they are
    the very floats, and the matmul gives the float32 weight's bits for every M (decode
    tiles, GEMM, more panels than one 64-panel encode chunk), plain and layer-indexed; a
    tied head's rows (columns_as_rows) are the weight's columns. A weight with one value off
    by an ulp, or random floats, has no codes: encode keeps it float32."""
    from pallas_kernels.f32_matmul.codes import encode

    assert F.available(), F.unavailable_reason()
    w = _block_quantized(K, N, 3, kind)
    wp = F.panel(jnp.asarray(w))
    coded = encode(wp)
    assert isinstance(coded, F.CodedF32) and coded.shape == (K, N) and coded.dtype == jnp.float32
    assert coded.codes.dtype == jnp.int8 and coded.scale.shape == (N // 16, K // 32, 16)
    assert coded.nbytes < wp.nbytes / 3
    np.testing.assert_array_equal(np.asarray(coded.unpanelled()).view(np.uint32), w.view(np.uint32))
    xs = jnp.asarray(_rand((64, K), 9))
    for M in (1, 2, 3, 4, 7, 32, 64):
        np.testing.assert_array_equal(np.asarray(F.f32_matmul(xs[:M], coded)),
                                      np.asarray(F.f32_matmul(xs[:M], wp)), err_msg=f"M={M}")
    assert F.TARGET_CODES in jax.jit(F.f32_matmul).lower(xs[:4], coded).as_text()
    other = encode(F.panel(jnp.asarray(_block_quantized(K, N, 4, kind))))
    for i, ref in enumerate((wp, F.panel(jnp.asarray(_block_quantized(K, N, 4, kind))))):
        np.testing.assert_array_equal(np.asarray(F.f32_matmul_layer(xs[:5], [coded, other], jnp.int32(i))),
                                      np.asarray(F.f32_matmul(xs[:5], ref)), err_msg=f"layer {i}")
    _stacked_equals_per_layer(F.f32_matmul_layer, xs[:5], [coded, other], 2)
    cols = jnp.asarray([0, 5, 17, N - 1], jnp.int32)
    np.testing.assert_array_equal(np.asarray(coded.columns_as_rows(cols)), w[:, np.asarray(cols)].T)
    off = w.copy()
    off[K // 2, N // 3] = np.nextafter(off[K // 2, N // 3], np.float32(np.inf))
    assert encode(F.panel(jnp.asarray(off))) is None
    assert encode(F.panel(jnp.asarray(_rand((K, N), 5)))) is None


@needs_kernel
def test_coded_weight_errors_name_the_problem():
    """Mixed kinds in a layer-indexed call, and codes whose K is not a multiple of 32, are
    refused with a message, not read past a buffer."""
    assert F.available(), F.unavailable_reason()
    from pallas_kernels.f32_matmul.codes import encode

    coded = encode(F.panel(jnp.asarray(_block_quantized(64, 32, 1, "q8_0"))))
    with pytest.raises(ValueError, match="one shape and layout"):
        F.f32_matmul_layer(jnp.zeros((1, 64)), [coded, F.panel(jnp.zeros((64, 32)))], jnp.int32(0))
    assert encode(F.panel(jnp.zeros((48, 32), jnp.float32))) is None          # K % 32: no codes
    bad = F.CodedF32(jnp.zeros((2, 48, 16), jnp.int8), jnp.zeros((2, 1, 16)), jnp.zeros((2, 1, 16)))
    with pytest.raises(Exception, match="K a multiple of 32"):
        F.f32_matmul(jnp.zeros((1, 48)), bad).block_until_ready()
