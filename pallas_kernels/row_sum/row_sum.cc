// Row sums in jaxinfer/reductions.py's fixed pairwise order, for XLA:CPU through jax.ffi
// (pallas_kernels/row_sum/cpu.py; targets jaxinfer_row_sum, jaxinfer_row_sum_squares).
//
// A file of its own, not beside the f32 matmul: the sampler's log-softmax needs it, and a
// first start compiles the sampler while the kernels build; in f32_matmul/f32_matmul.cc it
// waited for the largest source (~7 s of g++ on 2 cores), alone it builds in about a second.
//
// The row is folded in halves, x[i] += x[i + half], an odd length first padded with one 0,
// until one value is left: the same IEEE adds on the same operands as the jnp version,
// so the same bits, and no dependence on the number of rows. Why a kernel: the jnp fold
// is ~40 HLO instructions per sum, two or more sums a layer, about half of a 30-layer
// step's HLO: it doubled the compile time and size of every executable (RESULTS
// "Row sums as one C++ custom call"). Rows are independent; the caller's thread runs them.
//

#include <cstdint>
#include <utility>
#include <vector>

#include "ffi_lite.h"

namespace ffi = jaxinfer_ffi;

namespace {

// One level: dst[i] = src[i] + src[i + half] over a row of len values padded to even
// with one 0 (x + 0.0f, not a copy: -0 + 0 is +0 in the jnp fold too). Returns half.
inline int64_t fold_level(const float* __restrict src, int64_t len, float* __restrict dst) {
  const int64_t half = (len + 1) / 2, full = len - half;   // full: pairs with a real partner
  for (int64_t i = 0; i < full; ++i) dst[i] = src[i] + src[i + half];
  if (full < half) dst[full] = src[full] + 0.0f;
  return half;
}

// The first level of a sum of squares: each square rounded on its own, then added
// (contraction into an FMA is off, so the bits are those of x * x, then the fold).
__attribute__((optimize("fp-contract=off")))
inline int64_t fold_level_squares(const float* __restrict src, int64_t len, float* __restrict dst) {
  const int64_t half = (len + 1) / 2, full = len - half;
  for (int64_t i = 0; i < full; ++i) {
    const float a = src[i] * src[i], b = src[i + half] * src[i + half];
    dst[i] = a + b;
  }
  if (full < half) dst[full] = src[full] * src[full] + 0.0f;
  return half;
}

template <bool kSquares>
ffi::Error RowSumImpl(ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions();
  if (xd.size() < 1 || xd.back() < 1)
    return ffi::Error::InvalidArgument("row_sum: expected x [..., N] with N >= 1");
  const int64_t n = xd.back(), rows = x.element_count() / n;
  static thread_local std::vector<float> buf;          // two ping-pong halves
  const int64_t half0 = (n + 1) / 2;
  if (static_cast<int64_t>(buf.size()) < 2 * half0) buf.resize(2 * half0);
  float* t = buf.data();
  float* u = t + half0;
  const float* src = x.typed_data();
  float* out = y->typed_data();
  for (int64_t r = 0; r < rows; ++r) {
    if (n == 1) { out[r] = kSquares ? src[r] * src[r] : src[r]; continue; }
    int64_t len = kSquares ? fold_level_squares(src + r * n, n, t) : fold_level(src + r * n, n, t);
    float* a = t;
    float* b = u;
    while (len > 1) {
      len = fold_level(a, len, b);
      std::swap(a, b);
    }
    out[r] = a[0];
  }
  return ffi::Error::Success();
}

}  // namespace

JAXINFER_FFI_HANDLER(JaxinferRowSum, f) {
  auto x = f.arg<ffi::F32>(0);
  auto y = f.ret<ffi::F32>(0);
  if (!f.ok(1, 1)) return f.error();
  return RowSumImpl<false>(x, y);
}

JAXINFER_FFI_HANDLER(JaxinferRowSumSquares, f) {
  auto x = f.arg<ffi::F32>(0);
  auto y = f.ret<ffi::F32>(0);
  if (!f.ok(1, 1)) return f.error();
  return RowSumImpl<true>(x, y);
}
