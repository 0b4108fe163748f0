"""Design probe for a loop over layers that keeps every layer's weights and KV pages as
arrays of their own (issues 16 and 22: the 30 unrolled layers are what make each step
executable large and slow to compile; RESULTS.md "Design measurements", 2026-11-27).

The idea: a kernel gets *every* layer's buffer as a variadic operand plus the layer index,
and picks its layer's buffer by pointer, so inside ``lax.fori_loop`` nothing is stacked,
sliced or copied; the KV write is a custom call that aliases every layer's pages in -> out
and writes in place into the indexed one. This probe checks, on a toy model with the
default model's widths (D 576, F 1536, 30 layers, naive C++ kernels built here with g++):
that XLA passes the loop-invariant weights and the loop-carried pages to the kernels
without copies (the write kernel fails if its output is not its input buffer), that both
forms give the same bits, and what the loop saves in compile time and executable size.
It measures the mechanism, not our kernels' speed (its matmul is a plain triple loop).

    python benchmarks/layer_loop_probe.py
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

SOURCE = r'''
#include <cstdint>
#include <cstring>
#include "xla/ffi/api/ffi.h"
namespace ffi = xla::ffi;

// y[T, N] = x[T, K] @ w_idx[K, N]; operands x, idx i32[1], w_0 .. w_{L-1}
static ffi::Error MatmulImpl(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> idx,
                             ffi::RemainingArgs ws, ffi::ResultBuffer<ffi::F32> y) {
  auto w = ws.get<ffi::Buffer<ffi::F32>>(idx.typed_data()[0]);
  if (!w.has_value()) return ffi::Error::InvalidArgument("layer index out of range");
  int64_t T = x.dimensions()[0], K = x.dimensions()[1], N = w->dimensions()[1];
  const float* X = x.typed_data(); const float* W = w->typed_data(); float* Y = y->typed_data();
  for (int64_t t = 0; t < T; ++t) {
    float* yr = Y + t * N; std::memset(yr, 0, N * sizeof(float));
    for (int64_t k = 0; k < K; ++k) {
      float a = X[t * K + k]; const float* wr = W + k * N;
      for (int64_t n = 0; n < N; ++n) yr[n] += a * wr[n];
    }
  }
  return ffi::Error::Success();
}
XLA_FFI_DEFINE_HANDLER_SYMBOL(ProbeMatmul, MatmulImpl,
    ffi::Ffi::Bind().Arg<ffi::Buffer<ffi::F32>>().Arg<ffi::Buffer<ffi::S32>>().RemainingArgs()
        .Ret<ffi::Buffer<ffi::F32>>());

// rows[T, R] into slots of pages_idx, in place; operands idx, slots i32[T], rows,
// pages_0 .. pages_{L-1} [S, R]; results pages_0 .. pages_{L-1}, each aliased to its operand
static ffi::Error WriteImpl(ffi::Buffer<ffi::S32> idx, ffi::Buffer<ffi::S32> slots,
                            ffi::Buffer<ffi::F32> rows, ffi::RemainingArgs pages, ffi::RemainingRets outs) {
  int l = idx.typed_data()[0];
  auto in = pages.get<ffi::Buffer<ffi::F32>>(l);
  auto out = outs.get<ffi::Buffer<ffi::F32>>(l);
  if (!in.has_value() || !out.has_value()) return ffi::Error::InvalidArgument("layer index out of range");
  float* P = (*out)->typed_data();
  if (P != in->typed_data()) return ffi::Error::Internal("pages not aliased: XLA copied them");
  int64_t T = rows.dimensions()[0], R = rows.dimensions()[1];
  for (int64_t t = 0; t < T; ++t)
    std::memcpy(P + int64_t(slots.typed_data()[t]) * R, rows.typed_data() + t * R, R * sizeof(float));
  return ffi::Error::Success();
}
XLA_FFI_DEFINE_HANDLER_SYMBOL(ProbeWrite, WriteImpl,
    ffi::Ffi::Bind().Arg<ffi::Buffer<ffi::S32>>().Arg<ffi::Buffer<ffi::S32>>().Arg<ffi::Buffer<ffi::F32>>()
        .RemainingArgs().RemainingRets());

// a stand-in for attention: o = q + the sum of the first 64 rows of pages_idx
static ffi::Error ReadImpl(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::S32> idx, ffi::RemainingArgs pages,
                           ffi::ResultBuffer<ffi::F32> o) {
  auto p = pages.get<ffi::Buffer<ffi::F32>>(idx.typed_data()[0]);
  if (!p.has_value()) return ffi::Error::InvalidArgument("layer index out of range");
  int64_t T = q.dimensions()[0], R = q.dimensions()[1];
  for (int64_t t = 0; t < T; ++t)
    for (int64_t r = 0; r < R; ++r) {
      float s = q.typed_data()[t * R + r];
      for (int64_t j = 0; j < 64; ++j) s += p->typed_data()[j * R + r];
      o->typed_data()[t * R + r] = s;
    }
  return ffi::Error::Success();
}
XLA_FFI_DEFINE_HANDLER_SYMBOL(ProbeRead, ReadImpl,
    ffi::Ffi::Bind().Arg<ffi::Buffer<ffi::F32>>().Arg<ffi::Buffer<ffi::S32>>().RemainingArgs()
        .Ret<ffi::Buffer<ffi::F32>>());
'''


def build() -> None:
    import jax

    d = Path(tempfile.mkdtemp(prefix="layer_loop_probe_"))
    (d / "probe.cc").write_text(SOURCE)
    subprocess.run(["g++", "-O2", "-march=native", "-std=c++17", "-shared", "-fPIC", "-w",
                    f"-I{jax.ffi.include_dir()}", str(d / "probe.cc"), "-o", str(d / "probe.so")], check=True)
    lib = ctypes.cdll.LoadLibrary(str(d / "probe.so"))
    for name in ("ProbeMatmul", "ProbeWrite", "ProbeRead"):
        jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(lib, name)), platform="cpu")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--rows", default="1,8", help="comma-separated token counts per step")
    args = p.parse_args()

    import jax
    import jax.numpy as jnp

    build()
    L, D, F, R, S = args.layers, 576, 1536, 192, 1024

    def mm(x, i, ws):
        return jax.ffi.ffi_call("ProbeMatmul", jax.ShapeDtypeStruct((x.shape[0], ws[0].shape[1]), jnp.float32))(x, i, *ws)

    def write(i, slots, rows, pages):
        return jax.ffi.ffi_call("ProbeWrite", [jax.ShapeDtypeStruct(q.shape, q.dtype) for q in pages],
                                input_output_aliases={3 + j: j for j in range(len(pages))})(i, slots, rows, *pages)

    def read(q, i, pages):
        return jax.ffi.ffi_call("ProbeRead", jax.ShapeDtypeStruct(q.shape, jnp.float32))(q, i, *pages)

    def layer(x, i, w1s, w2s, pages, slots):
        pages = write(i, slots, x[:, :R], pages)
        x = x.at[:, :R].add(read(x[:, :R], i, pages) * 1e-3)
        return x + mm(jnp.maximum(mm(x, i, w1s), 0.0), i, w2s) * 1e-2, tuple(pages)

    def unrolled(x, slots, w1s, w2s, pages):       # today's form: one layer's buffers per call
        pages, zero = list(pages), jnp.zeros((1,), jnp.int32)
        for j in range(L):
            x, (pages[j],) = layer(x, zero, [w1s[j]], [w2s[j]], [pages[j]], slots)
        return x, tuple(pages)

    def looped(x, slots, w1s, w2s, pages):         # every layer's buffers + the index
        body = lambda j, c: layer(c[0], jnp.reshape(j, (1,)).astype(jnp.int32), w1s, w2s, c[1], slots)  # noqa: E731
        return jax.lax.fori_loop(0, L, body, (x, tuple(pages)))

    from jax.experimental import serialize_executable

    rng = np.random.RandomState(0)
    w1s = [jnp.asarray(rng.randn(D, F).astype(np.float32) * 0.03) for _ in range(L)]
    w2s = [jnp.asarray(rng.randn(F, D).astype(np.float32) * 0.03) for _ in range(L)]
    print(f"{L} layers, weights {2 * L * D * F * 4 / 2**20:.0f} MiB, pages {L * S * R * 4 / 2**20:.0f} MiB")
    for T in (int(t) for t in args.rows.split(",")):
        x = jnp.asarray(rng.randn(T, D).astype(np.float32))
        slots = jnp.arange(T, dtype=jnp.int32) + 5
        outs = {}
        for name, fn in (("unrolled", unrolled), ("loop", looped)):
            pages = tuple(jnp.zeros((S, R), jnp.float32) for _ in range(L))
            t0 = time.perf_counter()
            comp = jax.jit(fn, donate_argnums=(4,)).lower(x, slots, w1s, w2s, pages).compile()
            compile_s = time.perf_counter() - t0
            hlo = comp.as_text().splitlines()
            big_copies = [ln for ln in hlo if " copy(" in ln and ("f32[576,1536]" in ln or "f32[1536,576]" in ln
                                                                    or f"f32[{S},{R}]" in ln)]
            size = len(serialize_executable.serialize(comp)[0])
            y, pages = comp(x, slots, w1s, w2s, pages)
            times = []
            for _ in range(10):
                t0 = time.perf_counter()
                y, pages = comp(x, slots, w1s, w2s, pages)
                jax.block_until_ready(y)
                times.append(time.perf_counter() - t0)
            outs[name] = (np.asarray(y), np.asarray(pages[L // 2]))
            print(f"T={T} {name:8s}: compile {compile_s:.2f} s, {len(hlo)} HLO lines, serialized "
                  f"{size / 1e6:.2f} MB, copies of weights/pages {len(big_copies)}, step {np.median(times) * 1e3:.2f} ms")
        same = all(np.array_equal(a, b) for a, b in zip(outs["unrolled"], outs["loop"]))
        print(f"T={T}: outputs and pages bitwise equal: {same}")


if __name__ == "__main__":
    main()
