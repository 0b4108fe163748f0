"""Weight-only int8 / int4 matmul: formats, the XLA path, and the Pallas kernels.

Kernels are compared with the reference on the *same* quantized weights, so the tolerance
is float rounding, not quantization error. Quantization error itself is checked against
its worst-case bound: |x @ (w - dequant(w))| <= |x| @ (step / 2) elementwise. The Pallas
kernels run interpreted on CPU (TPU interpret mode for the Mosaic lowering, generic
interpretation for the Triton one) and compiled when a TPU / GPU is present.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.quantized_matmul.pallas import quantized_matmul_gpu, quantized_matmul_tpu
from pallas_kernels.quantized_matmul.xla import (QuantizedWeight, dequantize, quantize, quantize_int4,
                                                 quantize_int8, quantized_matmul_reference,
                                                 quantized_matmul_xla)

# x in f32: float reordering only; bf16: x and the output are bf16 (one rounding of each)
TOL = {jnp.float32: dict(rtol=2e-5, atol=2e-5), jnp.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def _weights(K, N, seed=0):
    rng = np.random.default_rng(seed)
    w = 0.05 * rng.standard_normal((K, N)).astype(np.float32)
    w[:, 0] = 0.0                                          # an all-zero column: scale 1, q 0
    return jnp.asarray(w)


def _x(M, K, dtype, seed=1):
    return jnp.asarray(np.random.default_rng(seed).standard_normal((M, K)), dtype)


def _step(qw: QuantizedWeight) -> np.ndarray:
    """Quantization step of every weight element, [K, N]."""
    K, N = qw.shape
    s = np.asarray(qw.scales)
    return np.broadcast_to(s, (K, N)) if qw.bits == 8 else np.repeat(s, qw.group, axis=0)


# --------------------------------------------------------------------------- formats

def test_int8_round_trip_within_half_a_step():
    w = _weights(96, 40)
    q, s = quantize_int8(w)
    assert q.dtype == jnp.int8 and q.shape == (96, 40) and s.shape == (40,)
    assert int(jnp.max(jnp.abs(q))) <= 127
    err = np.abs(np.asarray(dequantize(QuantizedWeight(q, s, 8))) - np.asarray(w))
    assert (err <= np.asarray(s) / 2 * (1 + 1e-6)).all()


def test_int4_round_trip_and_packing_layout():
    w = _weights(128, 24)
    packed, scales = quantize_int4(w, group=64)
    assert packed.dtype == jnp.int8 and packed.shape == (64, 24) and scales.shape == (2, 24)
    qw = QuantizedWeight(packed, scales, 4, 64)
    err = np.abs(np.asarray(dequantize(qw)) - np.asarray(w))
    assert (err <= _step(qw) / 2 * (1 + 1e-6)).all()
    # byte i of a column: row 2i in the low nibble, row 2i+1 in the high nibble
    q = np.round(np.asarray(w) / np.repeat(np.asarray(scales), 64, axis=0)).astype(np.int64)
    p = np.asarray(packed).astype(np.int64) & 0xFF
    lo = ((p & 0xF) ^ 8) - 8
    hi = ((p >> 4) ^ 8) - 8
    np.testing.assert_array_equal(lo, q[0::2])
    np.testing.assert_array_equal(hi, q[1::2])


def test_int4_group_must_divide_k():
    with pytest.raises(ValueError, match=r"K .* 576 .*group = 128.*\[64, 32, 16\]"):
        quantize_int4(jnp.zeros((576, 8)), group=128)


def test_quantized_weight_is_a_pytree():
    qw = quantize(_weights(64, 16), 4, group=32)
    leaves, tree = jax.tree_util.tree_flatten(qw)
    assert len(leaves) == 2
    back = jax.tree_util.tree_unflatten(tree, leaves)
    assert back.bits == 4 and back.group == 32 and back.shape == (64, 16)


@pytest.mark.parametrize("bits,group", [(8, 0), (4, 64)])
def test_quantization_error_within_bound(bits, group):
    """SmolLM2's MLP shape: float result vs quantized, elementwise worst-case bound."""
    K, N = 576, 1536
    w, x = _weights(K, N), _x(4, K, jnp.float32)
    qw = quantize(w, bits, group or 128)
    y = np.asarray(quantized_matmul_xla(x, qw))
    y_f = np.asarray(jnp.dot(x, w, precision=jax.lax.Precision.HIGHEST))
    bound = np.abs(np.asarray(x)) @ (_step(qw) / 2)
    assert (np.abs(y - y_f) <= bound + 1e-4).all()
    rel = np.linalg.norm(y - y_f) / np.linalg.norm(y_f)
    # Gaussian weights, this seed: 0.0075 (int8) and 0.107 (int4, groups of 64)
    assert rel < (0.015 if bits == 8 else 0.15), rel


# --------------------------------------------------------------------------- XLA path

@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("M", [1, 7])
def test_xla_path_matches_reference(bits, dtype, M):
    qw = quantize(_weights(576, 192), bits, 64)
    x = _x(M, 576, dtype)
    out = quantized_matmul_xla(x, qw)
    assert out.dtype == dtype and out.shape == (M, 192)
    np.testing.assert_allclose(np.asarray(out, np.float32),
                               np.asarray(quantized_matmul_reference(x, qw), np.float32),
                               **TOL[dtype])


@pytest.mark.parametrize("bits", [8, 4])
def test_xla_path_column_blocks(bits):
    """Weights over 4M elements (an LM head) run in column blocks of 4096."""
    qw = quantize(_weights(576, 8192), bits, 64)
    x = _x(1, 576, jnp.float32)
    np.testing.assert_allclose(np.asarray(quantized_matmul_xla(x, qw)),
                               np.asarray(quantized_matmul_reference(x, qw)), **TOL[jnp.float32])


def test_shape_errors_name_the_dimension():
    qw = quantize(_weights(64, 16), 8)
    with pytest.raises(ValueError, match="K: x has 32 columns"):
        quantized_matmul_xla(jnp.zeros((2, 32)), qw)
    with pytest.raises(ValueError, match="x: expected"):
        quantized_matmul_xla(jnp.zeros((64,)), qw)
    bad = QuantizedWeight(qw.q, jnp.zeros((15,)), 8)
    with pytest.raises(ValueError, match="scales"):
        quantized_matmul_reference(jnp.zeros((2, 64)), bad)


# --------------------------------------------------------------------------- Pallas kernels

KERNEL_CASES = [
    # (M, K, N, bits, group, dtype): decode row (SmolLM2 k/v projection), a small batch,
    # int4 with SmolLM2's K = 576 (group 64), bf16 activations
    (1, 576, 192, 8, 0, jnp.float32),
    (5, 256, 384, 8, 0, jnp.bfloat16),
    (1, 576, 192, 4, 64, jnp.float32),
    (9, 256, 256, 4, 128, jnp.bfloat16),
]
CASE_IDS = [f"M{m}-K{k}-N{n}-int{b}-{jnp.dtype(d).name}" for m, k, n, b, _, d in KERNEL_CASES]


def _has(platform: str) -> bool:
    try:
        return bool(jax.devices(platform))
    except RuntimeError:
        return False


class _KernelCases:
    kernel = None
    interpret = None

    @pytest.mark.parametrize("M,K,N,bits,group,dtype", KERNEL_CASES, ids=CASE_IDS)
    def test_matches_reference_on_same_weights(self, M, K, N, bits, group, dtype):
        qw = quantize(_weights(K, N), bits, group or 128)
        x = _x(M, K, dtype)
        out = type(self).kernel(x, qw, interpret=type(self).interpret)
        assert out.dtype == dtype and out.shape == (M, N)
        ref = quantized_matmul_reference(x, qw)
        np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32),
                                   **TOL[dtype])


class TestTPUKernelInterpret(_KernelCases):
    kernel = quantized_matmul_tpu
    interpret = pltpu.InterpretParams()


class TestGPUKernelInterpret(_KernelCases):
    kernel = quantized_matmul_gpu
    interpret = True


@pytest.mark.skipif(not _has("tpu"), reason="compiled Mosaic kernel needs a TPU")
class TestTPUKernelCompiled(_KernelCases):
    kernel = quantized_matmul_tpu
    interpret = False


@pytest.mark.skipif(not _has("gpu"), reason="compiled Triton kernel needs a GPU")
class TestGPUKernelCompiled(_KernelCases):
    kernel = quantized_matmul_gpu
    interpret = False


@pytest.mark.parametrize("fn,platform", [(quantized_matmul_tpu, "tpu"),
                                         (quantized_matmul_gpu, "cuda")])
@pytest.mark.parametrize("bits", [8, 4])
def test_lowers_for_the_accelerator(fn, platform, bits):
    """Lowering to Mosaic / Triton IR works on this CPU at SmolLM2's MLP shape."""
    x = jax.ShapeDtypeStruct((1, 576), jnp.bfloat16)
    qw = jax.eval_shape(lambda w: quantize(w, bits, 64), jax.ShapeDtypeStruct((576, 1536), jnp.float32))
    fn.trace(x, qw).lower(lowering_platforms=(platform,))


def test_gpu_kernel_rejects_unsupported_group():
    qw = quantize(_weights(96, 32), 4, group=24)
    with pytest.raises(ValueError, match="group"):
        quantized_matmul_gpu(jnp.zeros((1, 96)), qw, interpret=True)
