"""The C++ kernels' own FFI binding (pallas_kernels/ffi_lite.h, on XLA's C API): a call
with the wrong count or type of operands, or a missing attribute, is an error naming
what is wrong, never a crash or a kernel run on garbage; the right call still runs.
(The kernels' results are tested bit for bit in test_cpu_f32_matmul.py,
test_cpu_int8_matmul.py and test_attention_xla.py.)"""

from __future__ import annotations

import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.attention import cpu as attention_cpu
from pallas_kernels.f32_matmul import cpu as f32_cpu

# Only a machine without a compiler skips; where one is, a kernel that fails to build fails here.
pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CXX", "g++")) is None,
                                reason="no C++ compiler: the C++ kernels cannot be built here")


@pytest.fixture(autouse=True, scope="module")
def _kernels_built():
    assert f32_cpu.available(), f32_cpu.unavailable_reason()
    assert attention_cpu.available(), attention_cpu.unavailable_reason()

F32_TARGET = "jaxinfer_f32_matmul"


def _call(target, out, *args, **attrs):
    return jax.ffi.ffi_call(target, out)(*args, **attrs)


def test_right_call_runs():
    x, w = jnp.ones((2, 8), jnp.float32), jnp.full((8, 16), 0.5, jnp.float32)
    y = _call(F32_TARGET, jax.ShapeDtypeStruct((2, 16), jnp.float32), x, w)
    np.testing.assert_array_equal(np.asarray(y), np.full((2, 16), 4.0, np.float32))


def test_wrong_operand_type_is_an_error():
    x, w = jnp.ones((2, 8), jnp.int32), jnp.ones((8, 16), jnp.float32)
    with pytest.raises(Exception, match="operand is missing or of the wrong type"):
        _call(F32_TARGET, jax.ShapeDtypeStruct((2, 16), jnp.float32), x, w).block_until_ready()


def test_wrong_result_type_is_an_error():
    x, w = jnp.ones((2, 8), jnp.float32), jnp.ones((8, 16), jnp.float32)
    with pytest.raises(Exception, match="result is missing or of the wrong type"):
        _call(F32_TARGET, jax.ShapeDtypeStruct((2, 16), jnp.int32), x, w).block_until_ready()


def test_wrong_operand_count_is_an_error():
    x = jnp.ones((2, 8), jnp.float32)
    with pytest.raises(Exception, match="wrong number of operands"):
        _call(F32_TARGET, jax.ShapeDtypeStruct((2, 16), jnp.float32), x, x.T @ x, x).block_until_ready()
    with pytest.raises(Exception, match="operand is missing"):
        _call(F32_TARGET, jax.ShapeDtypeStruct((2, 16), jnp.float32), x).block_until_ready()


def test_missing_attribute_is_an_error():
    q = jnp.zeros((1, 2, 8), jnp.float32)
    pages = jnp.zeros((2, 4, 1, 8), jnp.float32)
    one = jnp.ones((1,), jnp.int32)
    table = jnp.zeros((1, 1), jnp.int32)
    slopes = jnp.zeros((0,), jnp.float32)
    attrs = dict(num_decode=np.int64(1), prefill_chunk=np.int64(1), sm_scale=np.float32(1.0),
                 sliding_window=np.int64(0), soft_cap=np.float32(0.0))
    out = jax.ShapeDtypeStruct(q.shape, jnp.float32)
    args = (q, pages, pages, one, one, table, slopes)
    _call(attention_cpu.TARGET, out, *args, **attrs).block_until_ready()      # the right call
    del attrs["sm_scale"]
    with pytest.raises(Exception, match="attribute is missing or of the wrong type"):
        _call(attention_cpu.TARGET, out, *args, **attrs).block_until_ready()
    attrs["sm_scale"] = np.int64(3)    # an integer where a float32 belongs (not 1: jax caches
    # the call by its attributes, and np.int64(1) == np.float32(1.0) would find the right one)
    with pytest.raises(Exception, match="attribute is missing or of the wrong type"):
        _call(attention_cpu.TARGET, out, *args, **attrs).block_until_ready()
