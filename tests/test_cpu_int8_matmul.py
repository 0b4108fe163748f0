"""The CPU int8 matmul (pallas_kernels/quantized_matmul/cpu.py + int8_matmul.cc, via jax.ffi):
values against the f32 reference on the same quantized weights, bitwise batch invariance
(a row's bits do not depend on the other rows), panel packing, the build's errors."""

from __future__ import annotations

import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.quantized_matmul import cpu as C
from pallas_kernels.quantized_matmul.xla import (QuantizedWeight, quantize,
                                             quantized_matmul_reference, quantized_matmul_xla)
from test_cpu_f32_matmul import second_build_compiles_nothing

# Tests that run the kernel need it built; without a compiler the engine falls back to
# XLA (test_without_the_kernel_int8_takes_the_xla_path checks that path everywhere).
needs_kernel = pytest.mark.skipif(shutil.which(os.environ.get("CXX", "g++")) is None,
                                  reason="no C++ compiler: the CPU int8 kernel cannot be built here")


def _weight(K: int, N: int, seed: int = 0) -> QuantizedWeight:
    w = np.random.default_rng(seed).standard_normal((K, N)).astype(np.float32)
    return quantize(jnp.asarray(w), 8)


def _x(M: int, K: int, seed: int = 1) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).standard_normal((M, K)), jnp.float32)


@needs_kernel
def test_kernel_builds_and_registers():
    assert C.available(), C.unavailable_reason()
    second_build_compiles_nothing(C.build)


# (K, N): SmolLM2's (576, 192) and (64, 96) are packed (K % 64 == 0, N % 32 == 0); (48, 37)
# (scalar tail columns) and (96, 200) stay plain: the kernel's f32 path.
SHAPES = [(576, 192), (64, 96), (48, 37), (96, 200)]


@needs_kernel
@pytest.mark.parametrize("K,N", SHAPES)
def test_matches_reference_and_is_batch_invariant(K, N):
    assert C.available()
    w = _weight(K, N)
    wp = C.pack(w)
    packed = K % 64 == 0 and N % 32 == 0
    assert wp.panel == (32 if packed else 0) and wp.shape == (K, N)
    np.testing.assert_array_equal(np.asarray(wp.unpanelled()), np.asarray(w.q))
    for M in (1, 2, 4, 7):       # the 3-row tiles with each remainder; plain: both tile kinds
        x = _x(M, K, seed=M)
        want = np.asarray(quantized_matmul_reference(x, w))
        got = np.asarray(C.int8_matmul(x, wp))
        # plain: f32 FMA chains; packed: + int16 activations (~1.5e-5 of a block's max)
        tol = (2e-5 if packed else 2e-6) * K ** 0.5 * np.abs(want).max()
        assert np.abs(got - want).max() <= tol, (M, np.abs(got - want).max(), tol)
        # each row alone: the same bits as inside the batch
        alone = np.concatenate([np.asarray(C.int8_matmul(x[i:i + 1], wp)) for i in range(M)])
        np.testing.assert_array_equal(alone, got)
    # the plain layout of a packable weight: the f32 path, same values within tolerance
    if packed:
        x = _x(5, K)
        np.testing.assert_allclose(np.asarray(C.int8_matmul(x, w)), np.asarray(C.int8_matmul(x, wp)),
                                   rtol=0, atol=2e-5 * K ** 0.5 * float(np.abs(np.asarray(C.int8_matmul(x, w))).max()))


@needs_kernel
def test_bf16_activations_and_inside_jit():
    w = C.pack(_weight(128, 64))
    assert w.panel == 32
    x = _x(3, 128).astype(jnp.bfloat16)
    y = jax.jit(C.int8_matmul)(x, w)
    assert y.dtype == jnp.bfloat16 and y.shape == (3, 64)
    want = quantized_matmul_reference(x.astype(jnp.float32), w)
    np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(want), rtol=2e-2, atol=2e-2)


def test_errors_name_the_problem():
    w = C.pack(_weight(64, 64))
    with pytest.raises(ValueError, match=r"x: expected \[M, K=64\]"):
        C.int8_matmul(jnp.zeros((2, 32)), w)
    with pytest.raises(ValueError, match="int8 QuantizedWeight"):
        C.int8_matmul(jnp.zeros((2, 64)), quantize(jnp.ones((64, 64)), 4, 32))
    with pytest.raises(ValueError, match="pack: the CPU kernel takes int8"):
        C.pack(quantize(jnp.ones((64, 64)), 4, 32))
    # a packed weight reaches only this kernel: the XLA path refuses it by name
    with pytest.raises(ValueError, match="panel-packed"):
        quantized_matmul_xla(jnp.zeros((2, 64)), w)


def test_build_errors_are_clear(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXINFER_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", "no-such-compiler-xyz")
    with pytest.raises(RuntimeError, match="no C.. compiler 'no-such-compiler-xyz'"):
        C.build()
    monkeypatch.setenv("CXX", "false")          # a "compiler" that fails
    with pytest.raises(RuntimeError, match="compiling int8_matmul.cc failed"):
        C.build()
    assert not list(tmp_path.iterdir())         # no half-written library left behind


@needs_kernel
def test_engine_packs_int8_weights_on_cpu():
    """On CPU, --quantization int8 packs every matmul weight with K % 64 == 0 and
    N % 32 == 0 for the kernel; the model hook sends them there (tests/test_quantization.py checks the
    engine's tokens against the reference on the same weights)."""
    import sys
    import pathlib

    from flax import nnx
    from jaxinfer.quantization import quantize_model

    sys.path.insert(0, str(pathlib.Path(__file__).parent))
    from tp_worker import tiny_loaded

    model = quantize_model(tiny_loaded("llama_8q4kv").model, "int8")
    ws = [x for x in jax.tree.leaves(nnx.state(model), is_leaf=lambda v: isinstance(v, QuantizedWeight))
          if isinstance(x, QuantizedWeight)]
    assert ws and all(w.bits == 8 for w in ws)
    assert all(w.panel == 32 for w in ws if w.shape[0] % 64 == 0 and w.shape[1] % 32 == 0)
    assert any(w.panel == 32 for w in ws)


@needs_kernel
def test_fused_projections_are_bitwise_the_separate_ones():
    """quantization.fuse_projections: q/k/v and gate/up of a packed model become one weight
    each, and the fused product is bitwise the concatenation of the separate products."""
    import sys
    import pathlib

    from jaxinfer.quantization import fuse_projections, quantize_model

    sys.path.insert(0, str(pathlib.Path(__file__).parent))
    from tp_worker import tiny_loaded

    loaded = tiny_loaded("llama_8q4kv")
    layer = quantize_model(loaded.model, "int8").layers[0]
    assert hasattr(layer, "wqkv") and hasattr(layer, "w_gate_up")
    assert not any(hasattr(layer, p) for p in ("wq", "wk", "wv", "w_gate", "w_up"))
    # the same weights unfused: quantize without fusing, then compare products
    import jaxinfer.quantization as Qz
    orig = Qz.fuse_projections
    Qz.fuse_projections = lambda m: m
    try:
        plain_model = quantize_model(loaded.model, "int8")
        plain = plain_model.layers[0]
    finally:
        Qz.fuse_projections = orig
    x = _x(3, layer.wqkv[...].shape[0])
    want = np.concatenate([np.asarray(C.int8_matmul(x, getattr(plain, p)[...]))
                           for p in ("wq", "wk", "wv")], axis=1)
    np.testing.assert_array_equal(np.asarray(C.int8_matmul(x, layer.wqkv[...])), want)
    want = np.concatenate([np.asarray(C.int8_matmul(x, getattr(plain, p)[...]))
                           for p in ("w_gate", "w_up")], axis=1)
    np.testing.assert_array_equal(np.asarray(C.int8_matmul(x, layer.w_gate_up[...])), want)
    assert fuse_projections(plain_model) is plain_model and hasattr(plain, "wqkv")


def test_without_the_kernel_int8_takes_the_xla_path(monkeypatch):
    """A host without a compiler: int8 weights stay plain, the hook is XLA's, the XLA path
    gets its memory-optimized scheduler, and the matmul still gives the reference values."""
    import sys
    import pathlib

    from flax import nnx
    from jaxinfer import matmul as M
    from jaxinfer.quantization import cpu_compiler_options, quantize_model

    monkeypatch.setattr(C, "available", lambda: False)
    monkeypatch.setattr(C, "unavailable_reason", lambda: "test: no compiler")
    sys.path.insert(0, str(pathlib.Path(__file__).parent))
    from tp_worker import tiny_loaded

    model = quantize_model(tiny_loaded("llama_8q4kv").model, "int8")
    ws = [x for x in jax.tree.leaves(nnx.state(model), is_leaf=lambda v: isinstance(v, QuantizedWeight))
          if isinstance(x, QuantizedWeight)]
    assert ws and all(w.panel == 0 for w in ws)
    assert M.select(True, "cpu") is M.tiled_matmul
    assert cpu_compiler_options(model) is not None
    w, x = _weight(64, 96), _x(3, 64)
    np.testing.assert_allclose(np.asarray(M.matmul(x, w)),
                               np.asarray(quantized_matmul_reference(x, w)), rtol=1e-5, atol=1e-4)


@needs_kernel
@pytest.mark.parametrize("K,N", [(576, 192), (48, 37)])
def test_layer_indexed_matmul_in_a_loop_copies_no_weight(K, N):
    """int8_matmul_layer (the layer loop's int8 matmul: every layer's weight as operands plus
    a traced index) gives int8_matmul's bits for each layer, packed and plain, and inside
    lax.fori_loop XLA passes the weights to the kernel without a copy."""
    assert C.available()
    L = 3
    ws = [C.pack(_weight(K, N, seed=10 + i)) for i in range(L)]
    x = _x(4, K, seed=3)
    for i in range(L):
        np.testing.assert_array_equal(np.asarray(C.int8_matmul_layer(x, ws, jnp.int32(i))),
                                      np.asarray(C.int8_matmul(x, ws[i])), err_msg=f"layer {i}")

    def looped(x, ws):
        return jax.lax.fori_loop(0, L, lambda i, acc: acc + C.int8_matmul_layer(x, ws, i), jnp.zeros((4, N)))

    def unrolled(x, ws):
        return sum((C.int8_matmul(x, w) for w in ws), jnp.zeros((4, N)))

    compiled = jax.jit(looped).lower(x, ws).compile()
    np.testing.assert_array_equal(np.asarray(compiled(x, ws)), np.asarray(jax.jit(unrolled)(x, ws)))
    q_shape = "s8[%s]" % ",".join(map(str, ws[0].q.shape))
    assert not [ln for ln in compiled.as_text().splitlines() if " copy(" in ln and q_shape in ln]
    with pytest.raises(Exception, match="out of range"):
        np.asarray(C.int8_matmul_layer(x, ws, jnp.int32(L)))
    from test_cpu_f32_matmul import _stacked_equals_per_layer

    _stacked_equals_per_layer(C.int8_matmul_layer, x, ws, L)


def _q4_1_weight(K: int, N: int, seed: int = 0) -> jax.Array:
    """A float weight that is exactly a GGUF Q4_1 checkpoint's: per 32 rows of a column,
    d * code + m with d, m float16 and codes 0..15 (each block holding a 0 and a 15)."""
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 16, (K, N)).astype(np.float32)
    codes[::32], codes[1::32] = 0, 15
    d = np.repeat((0.01 * rng.random((K // 32, N)) + 1e-3).astype(np.float16).astype(np.float32), 32, 0)
    m = np.repeat((-0.05 * rng.random((K // 32, N))).astype(np.float16).astype(np.float32), 32, 0)
    return jnp.asarray((codes * d + m).astype(np.float32))


@needs_kernel
@pytest.mark.parametrize("K,N", [(576, 192), (64, 96)])
def test_int4_panels_match_reference_and_are_batch_invariant(K, N):
    """The 4-bit panels (quantize_int4 + int4_matmul, a speculative draft's weights): a Q4_1
    checkpoint's floats come back exactly (its own codes), the product is within int16
    activation rounding of x @ the dequantized weight, each row's bits do not depend on the
    other rows, and the layer form gives each layer's bits."""
    assert C.available()
    w = _q4_1_weight(K, N)
    w4 = C.quantize_int4(w)
    assert (w4.bits, w4.panel, w4.shape, w4.scales.dtype) == (4, 32, (K, N), jnp.float16)
    np.testing.assert_array_equal(np.asarray(C.dequantize_int4(w4)), np.asarray(w))
    # any float weight: within half a step (scale / 2) of the codes' grid
    f = jnp.asarray(np.random.default_rng(5).standard_normal((K, N)), jnp.float32)
    f4 = C.quantize_int4(f)
    step = np.repeat(np.asarray(f4.scales, np.float32).transpose(1, 0, 2).reshape(K // 32, N), 32, 0)
    assert (np.abs(np.asarray(C.dequantize_int4(f4)) - np.asarray(f)) <= 0.51 * step + 1e-3).all()
    for M in (1, 2, 3, 4, 7):     # 1 row: byte halves; 2-3 row tiles: widened codes (same bits)
        x = _x(M, K, seed=M)
        want = np.asarray(x @ C.dequantize_int4(w4))
        got = np.asarray(C.int4_matmul(x, w4))
        # int16 activations per 64, as the packed int8 path (~1.5e-5 of a block's max)
        tol = 2e-5 * K ** 0.5 * np.abs(want).max()
        assert np.abs(got - want).max() <= tol, (M, np.abs(got - want).max(), tol)
        alone = np.concatenate([np.asarray(C.int4_matmul(x[i:i + 1], w4)) for i in range(M)])
        np.testing.assert_array_equal(alone, got)
    ws = [w4, C.quantize_int4(_q4_1_weight(K, N, seed=2))]
    x = _x(3, K)
    for i in range(2):
        np.testing.assert_array_equal(np.asarray(C.int8_matmul_layer(x, ws, jnp.int32(i))),
                                      np.asarray(C.int4_matmul(x, ws[i])), err_msg=f"layer {i}")
    from test_cpu_f32_matmul import _stacked_equals_per_layer

    _stacked_equals_per_layer(C.int8_matmul_layer, x, ws, 2)
    with pytest.raises(ValueError, match=r"x: expected \[M, K=%d\]" % K):
        C.int4_matmul(jnp.zeros((2, K + 32)), w4)
    with pytest.raises(ValueError, match="every one a 4-bit"):
        C.int8_matmul_layer(x, [w4, C.pack(_weight(K, N))], jnp.int32(0))
    assert C.int4_applies(K, N) and not C.int4_applies(48, N) and not C.int4_applies(K, 37)
