"""Device KV cache (engine/kv_cache.py): spec arithmetic, allocation, the scatter write."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.engine import kv_cache as kvc


def test_spec_bytes_and_budget():
    spec = kvc.KVCacheSpec(30, 10, 16, 3, 64, jnp.float32)
    assert spec.bytes_per_page == 2 * 30 * 16 * 3 * 64 * 4
    assert spec.total_bytes == 10 * spec.bytes_per_page
    bf = kvc.KVCacheSpec(30, 10, 16, 3, 64, jnp.bfloat16)
    assert bf.bytes_per_page * 2 == spec.bytes_per_page
    n = kvc.KVCacheSpec.num_pages_for_budget(1 << 30, num_layers=30, page_size=16,
                                             num_kv_heads=3, head_dim=64)
    assert n == (1 << 30) // spec.bytes_per_page
    assert spec.with_budget(1 << 30).num_pages == n
    with pytest.raises(ValueError, match="at least 2"):
        kvc.KVCacheSpec.num_pages_for_budget(spec.bytes_per_page, num_layers=30,
                                             page_size=16, num_kv_heads=3, head_dim=64)


@pytest.mark.parametrize("field,kw", [("num_layers", dict(num_layers=0)),
                                      ("page_size", dict(page_size=-16)),
                                      ("num_pages", dict(num_pages=1))])
def test_spec_validation_names_the_field(field, kw):
    args = dict(num_layers=2, num_pages=4, page_size=16, num_kv_heads=2, head_dim=8)
    args.update(kw)
    with pytest.raises(ValueError, match=field):
        kvc.KVCacheSpec(**args)


def test_allocate_is_zero_list_of_layer_pairs():
    spec = kvc.KVCacheSpec(3, 5, 8, 2, 16, jnp.bfloat16)
    cache = kvc.allocate_kv_cache(spec)
    assert len(cache) == 3
    for k, v in cache:
        assert k.shape == v.shape == (5, 8, 2, 16)
        assert k.dtype == v.dtype == jnp.bfloat16
        assert not jnp.any(k) and not jnp.any(v)
    shapes = kvc.kv_cache_shapes(spec)
    assert jax.tree.map(lambda s: (s.shape, s.dtype), shapes) == \
        jax.tree.map(lambda a: (a.shape, a.dtype), cache)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_write_kv_scatters_rows_and_padding_goes_to_page_0(dtype):
    N, ps, KVH, D = 9, 4, 2, 8
    rng = np.random.default_rng(0)
    k0 = rng.standard_normal((N, ps, KVH, D)).astype(np.float32)
    v0 = rng.standard_normal((N, ps, KVH, D)).astype(np.float32)
    # 3 real tokens (page 5 offset 1, page 2 offset 3, page 8 offset 0), 3 padded (page 0)
    slots = np.array([5 * ps + 1, 2 * ps + 3, 8 * ps + 0, 0, 1, 1], np.int32)
    kn = rng.standard_normal((6, KVH, D)).astype(np.float32)
    vn = rng.standard_normal((6, KVH, D)).astype(np.float32)
    f = jax.jit(kvc.write_kv, donate_argnums=(0, 1))
    k, v = f(jnp.asarray(k0, dtype), jnp.asarray(v0, dtype), jnp.asarray(kn), jnp.asarray(vn),
             jnp.asarray(slots))
    k, v = np.array(k.astype(jnp.float32)), np.array(v.astype(jnp.float32))
    rnd = lambda x: np.array(jnp.asarray(x, dtype).astype(jnp.float32))  # noqa: E731
    want_k, want_v = rnd(k0), rnd(v0)
    for t in range(3):
        want_k[slots[t] // ps, slots[t] % ps] = rnd(kn[t])
        want_v[slots[t] // ps, slots[t] % ps] = rnd(vn[t])
    # every page but 0 is exactly as expected: real rows written, nothing else touched
    np.testing.assert_array_equal(k[1:], want_k[1:])
    np.testing.assert_array_equal(v[1:], want_v[1:])
    # page 0 took the padded rows (offset 0 and 1; which duplicate wins is unspecified)
    np.testing.assert_array_equal(k[0, 2:], want_k[0, 2:])
    np.testing.assert_array_equal(k[0, 0], rnd(kn[3]))
    assert any(np.array_equal(k[0, 1], rnd(kn[t])) for t in (4, 5))


def test_write_kv_is_in_place_under_donation():
    """No copy of the cache: the donated buffer is reused and the HLO copies nothing of
    the cache's size."""
    k = jnp.zeros((64, 16, 3, 64))
    v = jnp.zeros((64, 16, 3, 64))
    kn = jnp.ones((4, 3, 64))
    slots = jnp.array([16, 17, 0, 0], jnp.int32)
    f = jax.jit(kvc.write_kv, donate_argnums=(0, 1))
    hlo = f.lower(k, v, kn, kn, slots).compile().as_text()
    cache_copies = [ln for ln in hlo.splitlines()
                    if " copy(" in ln and ("f32[64,16,3,64]" in ln or "f32[1024,3,64]" in ln)]
    assert not cache_copies, cache_copies
    ptr = k.unsafe_buffer_pointer()
    k2, v2 = f(k, v, kn, kn, slots)
    assert k2.unsafe_buffer_pointer() == ptr
    assert float(k2[1, 0, 0, 0]) == 1.0 and float(k2[2, 0, 0, 0]) == 0.0


def test_write_kv_shape_errors():
    k = jnp.zeros((4, 2, 2, 8))
    with pytest.raises(ValueError, match="k_new/v_new"):
        kvc.write_kv(k, k, jnp.zeros((3, 2, 4)), jnp.zeros((3, 2, 4)), jnp.zeros(3, jnp.int32))
    with pytest.raises(ValueError, match="slot_mapping"):
        kvc.write_kv(k, k, jnp.zeros((3, 2, 8)), jnp.zeros((3, 2, 8)), jnp.zeros(2, jnp.int32))


def _resident_bytes(x: jax.Array) -> int:
    """Bytes of ``x``'s buffer in RAM now (mincore over its pages; CPU backend)."""
    import ctypes

    page = os.sysconf("SC_PAGE_SIZE")
    start = x.unsafe_buffer_pointer() // page * page
    n = -(-(x.unsafe_buffer_pointer() + x.nbytes - start) // page)
    vec = (ctypes.c_ubyte * n)()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
    assert libc.mincore(ctypes.c_void_p(start), n * page, vec) == 0, os.strerror(ctypes.get_errno())
    return sum(b & 1 for b in vec) * page


def check_untouched_pool() -> None:
    """Body of the test below, run in a fresh process."""
    assert kvc.lazily_resident()
    spec = kvc.KVCacheSpec(4, 1280, 16, 3, 64, jnp.float32)
    cache = jax.block_until_ready(kvc.allocate_kv_cache(spec, untouched=True))
    assert max(_resident_bytes(x) for x in jax.tree.leaves(cache)) <= 64 << 10
    write = jax.jit(kvc.write_kv, donate_argnums=(0, 1))
    k, v = cache[0]
    ptr = k.unsafe_buffer_pointer()
    rows = jnp.ones((8, 3, 64), jnp.float32)
    slots = jnp.arange(8, dtype=jnp.int32) + 5 * 16                   # page 5, slots 0..7
    k, v = jax.block_until_ready(write(k, v, rows, 2 * rows, slots))
    assert k.unsafe_buffer_pointer() == ptr                             # in place: donation aliased it
    np.testing.assert_array_equal(np.asarray(v[5, :8]), 2 * np.ones((8, 3, 64)))
    assert _resident_bytes(k) <= 64 << 10 and _resident_bytes(v) <= 64 << 10
    spec = kvc.KVCacheSpec(2, 1280, 16, 3, 64, jnp.float32)
    zeroed = jax.block_until_ready(kvc.allocate_kv_cache(spec))
    assert _resident_bytes(zeroed[0][0]) >= spec.num_pages * spec.bytes_per_page // 4 - (64 << 10)

@pytest.mark.skipif(shutil.which(os.environ.get("CXX", "g++")) is None, reason="needs a C++ compiler")
def test_untouched_pool_is_resident_only_where_written():
    """The engine's pool (untouched=True) holds RAM only for the pages a step writes, and a
    donated write updates it in place; the default pool is zero-filled (all resident).

    Run in a fresh process: in a worker that has loaded and freed models, glibc can serve even a
    60 MiB block from memory it mapped before and never gave back (seen in CI: 15 MiB of it
    resident before any write), which says nothing about what the allocation itself touches."""
    code = ("import sys; sys.path.insert(0, sys.argv[1]); "
            "import test_kv_cache as t; t.check_untouched_pool(); print('ok')")
    r = subprocess.run([sys.executable, "-c", code, os.path.dirname(__file__)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout[-2000:] + r.stderr[-4000:]
