"""Row reductions in a fixed order (jaxinfer/reductions.py): a row's sum, its RMSNorm and
its log-softmax are the same bits whatever the number of rows beside it (XLA:CPU's own
reductions are not: RMSNorm over D = 576 differs for 1-5 rows vs 8 or more)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.models import layers as L
from jaxinfer.reductions import row_sum

ROWS = (1, 2, 3, 5, 8, 9, 17)


@pytest.mark.parametrize("n", [1, 2, 7, 64, 77, 576, 1000])
def test_row_sum_is_the_sum(n):
    x = np.random.default_rng(n).normal(size=(3, n)).astype(np.float32)
    got = np.asarray(jax.jit(row_sum)(x))
    np.testing.assert_allclose(got, x.astype(np.float64).sum(-1), rtol=0, atol=1e-5 * np.sqrt(n))


@pytest.mark.parametrize("d", [64, 576])
def test_rms_norm_bits_do_not_depend_on_the_rows_beside(d):
    rng = np.random.default_rng(d)
    x = jnp.asarray(rng.normal(size=(64, d)).astype(np.float32))
    w = jnp.asarray(rng.normal(size=(d,)).astype(np.float32))
    f = jax.jit(lambda a: L.rms_norm(a, w, 1e-5))
    full = np.asarray(f(x))
    for t in ROWS:
        np.testing.assert_array_equal(np.asarray(f(x[:t])), full[:t], err_msg=f"{t} rows")
    ref = np.asarray(x, np.float64)
    ref = np.asarray(w, np.float64) * ref / np.sqrt((ref ** 2).mean(-1, keepdims=True) + 1e-5)
    assert np.abs(full - ref).max() / np.abs(ref).max() < 1e-6


def test_row_sum_bits_do_not_depend_on_the_rows_beside():
    x = jnp.asarray(np.random.default_rng(0).normal(size=(17, 49152)).astype(np.float32))
    f = jax.jit(row_sum)
    full = np.asarray(f(x))
    for t in ROWS:
        np.testing.assert_array_equal(np.asarray(f(x[:t])), full[:t], err_msg=f"{t} rows")


NORMS = {
    "rms_norm_plus_one": (lambda a, w: L.rms_norm_plus_one(a, w, 1e-6),
                          lambda x, w: x / np.sqrt((x ** 2).mean(-1, keepdims=True) + 1e-6) * (1 + w)),
    "layer_norm": (lambda a, w: L.layer_norm(a, w, w[::-1], 1e-5),
                   lambda x, w: (x - x.mean(-1, keepdims=True))
                   / np.sqrt(x.var(-1, keepdims=True) + 1e-5) * w + w[::-1]),
}


@pytest.mark.parametrize("d", [64, 576, 640])
@pytest.mark.parametrize("norm", list(NORMS))
def test_gemma_and_layer_norm_bits_do_not_depend_on_the_rows_beside(norm, d):
    """Gemma's (1 + w) RMSNorm and the GPT families' LayerNorm, as rms_norm above."""
    ours, reference = NORMS[norm]
    rng = np.random.default_rng(d)
    x = jnp.asarray((rng.normal(size=(64, d)) + 0.5).astype(np.float32))
    w = jnp.asarray(rng.normal(size=(d,)).astype(np.float32))
    f = jax.jit(lambda a: ours(a, w))
    full = np.asarray(f(x))
    for t in ROWS:
        np.testing.assert_array_equal(np.asarray(f(x[:t])), full[:t], err_msg=f"{norm}: {t} rows")
    ref = reference(np.asarray(x, np.float64), np.asarray(w, np.float64))
    assert np.abs(full - ref).max() / np.abs(ref).max() < 1e-6


# ---------------------------------------------------------------- the CPU kernel's fold

def _kernel():
    """The C++ kernel, which must build wherever a compiler is (CI has g++): only a machine
    without one skips, as tests/test_cpu_f32_matmul.py does."""
    import os
    import shutil

    from pallas_kernels.row_sum import cpu as cpu_row_sum

    if shutil.which(os.environ.get("CXX", "g++")) is None:
        pytest.skip("no C++ compiler: the CPU row-sum kernel cannot be built here")
    assert cpu_row_sum.available(), f"the CPU row-sum kernel did not build: {cpu_row_sum.unavailable_reason()}"
    return cpu_row_sum


@pytest.mark.parametrize("n", [1, 2, 3, 5, 64, 77, 576, 640, 1001, 49152])
def test_kernel_row_sum_is_the_jnp_fold_bit_for_bit(n):
    """row_sum on CPU runs the C++ fold (one custom call instead of ~40 HLO ops): the same
    IEEE adds as the jnp fold beside it (xla.py, its reference), so the same bits, negative
    zeros and vmap included."""
    from pallas_kernels.row_sum import xla as reference

    C = _kernel()
    x = np.random.default_rng(n).normal(size=(2, 3, n)).astype(np.float32)
    x[0, 0, :] = -0.0                                  # -0 + 0 padding is +0 in both
    got = np.asarray(jax.jit(C.row_sum)(x))
    want = np.asarray(jax.jit(reference.row_sum)(x))
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(np.signbit(got), np.signbit(want))
    np.testing.assert_array_equal(np.asarray(jax.vmap(C.row_sum)(x)), want)
    if n > 1:
        assert "jaxinfer_row_sum" in jax.jit(row_sum).lower(x).as_text()


@pytest.mark.parametrize("n", [1, 3, 576, 577])
def test_kernel_sum_of_squares_rounds_each_square(n):
    """The squares entry (RMSNorm's variance) equals the fold over x * x materialized:
    every square rounded on its own, no FMA."""
    C = _kernel()
    x = jnp.asarray(np.random.default_rng(n).normal(size=(7, n)).astype(np.float32))
    squares = jax.jit(lambda a: a * a)(x)
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda a: C.row_sum(a, squares=True))(x)),
                                  np.asarray(jax.jit(C.row_sum)(squares)))


def _folded_by_hand(x: np.ndarray) -> np.float32:
    """The order row_sum promises, one float32 add at a time: halves folded, x[i] + x[i + half],
    an odd length padded with one 0."""
    x = [np.float32(v) for v in x]
    while len(x) > 1:
        x += [np.float32(0)] * (len(x) % 2)
        half = len(x) // 2
        x = [np.float32(x[i] + x[i + half]) for i in range(half)]
    return x[0]


@pytest.mark.parametrize("row", [[1e8, 1, -1e8], [1e8, 3, -1e8, 1, 1e-3], [1, 2, 3, 4, 5, 6, 7]])
def test_reference_and_kernel_sum_in_the_promised_order(row):
    """pallas_kernels/row_sum/xla.py, the kernel's reference, sums in the fold's order, not
    another (left to right, [1e8, 1, -1e8] would be 0, not 1), and so does the kernel."""
    from pallas_kernels.row_sum import xla as reference

    x = np.asarray([row, row[::-1]], np.float32)
    want = [_folded_by_hand(r) for r in x]
    np.testing.assert_array_equal(np.asarray(jax.jit(reference.row_sum)(x)), want)
    np.testing.assert_array_equal(np.asarray(jax.jit(_kernel().row_sum)(x)), want)


@pytest.mark.parametrize("n", [1, 2, 3, 576, 577, 49152])
def test_kernel_sum_of_squares_is_the_reference_fold_of_the_squares(n):
    """The squares entry against the reference: its fold of the squares computed first
    (a square joined to the next add by an FMA would be other bits), as its own
    ``squares=True`` does run op by op, outside jit."""
    from pallas_kernels.row_sum import xla as reference

    C = _kernel()
    x = jnp.asarray(np.random.default_rng(n).normal(size=(2, 5, n)).astype(np.float32))
    squares = jax.jit(lambda a: a * a)(x)
    got = np.asarray(jax.jit(lambda a: C.row_sum(a, squares=True))(x))
    np.testing.assert_array_equal(got, np.asarray(jax.jit(reference.row_sum)(squares)))
    np.testing.assert_array_equal(got, np.asarray(reference.row_sum(x, squares=True)))


def test_rms_norm_without_the_kernel_is_batch_invariant_too(monkeypatch):
    """The jnp fold (GPU, TPU, no compiler) keeps the guarantee on its own."""
    import jaxinfer.reductions as R

    monkeypatch.setattr(R, "_kernel_applies", lambda x: False)
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.normal(size=(64, 576)).astype(np.float32))
    w = jnp.asarray(rng.normal(size=(576,)).astype(np.float32))
    f = jax.jit(lambda a: L.rms_norm(a, w, 1e-5))
    assert "jaxinfer_row_sum" not in f.lower(x).as_text()
    full = np.asarray(f(x))
    for t in ROWS:
        np.testing.assert_array_equal(np.asarray(f(x[:t])), full[:t], err_msg=f"{t} rows")
