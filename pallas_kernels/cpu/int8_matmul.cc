// Weight-only int8 matmul for XLA:CPU, called through jax.ffi (pallas_kernels/cpu_matmul.py).
//
//   y[m, n] = scale[n] * sum_k x[m, k] * q[k, n]      x f32 [M, K], q int8 [K, N], scale f32 [N]
//
// Why it exists: XLA:CPU converts int8 weights to f32 in memory before its dot, so int8
// weights stream no fewer bytes than f32 ones. Here the int8 bytes are converted in
// registers, so batch-1 decode reads a quarter of the bytes.
//
// Batch invariance, by construction: every output is ONE f32 accumulator that takes
// acc = fma(x[m, k], q[k, n], acc) for k = 0, 1, ..., K-1 in that order, then one multiply
// by scale[n]. Which loop order, tile or thread computes it changes nothing, so a row's
// result has the same bits whatever M is or whichever other rows share the call.
//
// Layout: q may be packed in panels of 64 columns, [N/64, K, 64] (cpu_matmul.pack), so
// that a column tile's rows are consecutive bytes. Unpacked, a tile of the LM head
// ([576, 49152]) reads one line per page and ran at 6-8 GB/s instead of 17 (measured).
//
// Two tile shapes, picked by M (both keep the order above):
//  * M <= kWideRows (decode): 64 columns (one cache line of int8 per k) x 1 row, rows in
//    turn: memory-bound, reads the weight once per call.
//  * larger M (prefill): register tiles of kTileRows rows x kTileVecs vectors, k
//    innermost, so each converted weight vector serves several rows.
// Work is split in units (column chunks, or (column tile, row block) pairs) that the
// caller and XLA's intra-op thread pool claim from one atomic counter: no thread waits for
// a task that has not started, so concurrent calls cannot deadlock the pool.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

#if defined(__AVX512F__)
constexpr int kLanes = 16;
#else
constexpr int kLanes = 8;   // AVX2 / NEON-sized vectors: 16 registers, so smaller tiles
#endif
typedef float fvec __attribute__((vector_size(kLanes * 4)));
typedef int8_t bvec __attribute__((vector_size(kLanes)));

// Tuning knobs (benchmarks/kernels.py --cpu-int8 rebuilds with -D to compare).
#ifndef JAXINFER_WIDE_ROWS
#define JAXINFER_WIDE_ROWS 3
#endif
#ifndef JAXINFER_INLINE_MACS
#define JAXINFER_INLINE_MACS (1 << 15)
#endif
constexpr int kWideRows = JAXINFER_WIDE_ROWS;
constexpr int64_t kInlineMacs = JAXINFER_INLINE_MACS;   // below: no helper thread
constexpr int kTileVecs = (kLanes == 16) ? 4 : 2;   // C: vectors per register tile
constexpr int kTileRows = (kLanes == 16) ? 6 : 4;   // R: rows per register tile
constexpr int kWideVecs = 64 / kLanes;   // a cache line of int8 per k: the M <= 3 tile
constexpr int kPrefetch = 16;   // rows ahead (helps unpacked weights only)

// int8 -> f32 in registers. Intrinsics where we know the ISA: GCC 12 scalarizes a
// __builtin_convertvector from int8 lanes (measured 1.2 GB/s instead of memory speed).
inline fvec load_q(const int8_t* p) {
#if defined(__AVX512F__)
  return (fvec)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
#elif defined(__AVX2__)
  return (fvec)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
#else
  bvec b;
  std::memcpy(&b, p, sizeof(b));
  typedef int32_t ivec __attribute__((vector_size(kLanes * 4)));
  return __builtin_convertvector(__builtin_convertvector(b, ivec), fvec);
#endif
}

inline fvec splat(float v) { return fvec{} + v; }

// One FMA with a single rounding, the same instruction for vectors and scalars (the
// build uses -ffp-contract=fast and an FMA-capable -march; the test checks bitwise
// invariance, which would catch a mixture).
inline fvec fma_v(fvec a, fvec b, fvec c) { return a * b + c; }

struct Problem {
  const float* x;      // [M, K]
  const int8_t* q;     // [N / P, K, P]: panels of P columns (P = N: the plain [K, N])
  const float* scale;  // [N]
  float* y;            // [M, N]
  int64_t M, K, N, P;
  int64_t nvec;        // columns handled by vectors: N rounded down to kLanes

  // Weight (k = 0, n0): rows of a panel are P bytes apart. Tiles never straddle panels
  // (P is N or a multiple of 64, the widest tile).
  const int8_t* col(int64_t n0) const { return q + (n0 / P) * K * P + n0 % P; }
};

// Scalar tail columns [nvec, N) for rows [m0, m1): the same k-ordered fma chain.
void tail_columns(const Problem& p, int64_t m0, int64_t m1) {
  for (int64_t m = m0; m < m1; ++m)
    for (int64_t n = p.nvec; n < p.N; ++n) {
      float acc = 0.f;
      for (int64_t k = 0; k < p.K; ++k)
        acc = std::fma(p.x[m * p.K + k], static_cast<float>(p.col(n)[k * p.P]), acc);
      p.y[m * p.N + n] = acc * p.scale[n];
    }
}

// Register tile: rows [m0, m0 + R), vector columns [n0, n0 + C * kLanes).
template <int R, int C>
void tile(const Problem& p, int64_t m0, int64_t n0) {
  fvec acc[R][C];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) acc[r][c] = fvec{};
  const float* x = p.x + m0 * p.K;
  const int8_t* q = p.col(n0);
  const int64_t stride = p.P;
  for (int64_t k = 0; k < p.K; ++k) {
    // Unpacked wide weights put every row of a tile on a new page, where the hardware
    // prefetchers stop: ask for the line kPrefetch rows ahead.
    __builtin_prefetch(q + (k + kPrefetch) * stride);
    if constexpr (R == 1) {
      // One row: convert and use each vector at once, so the C accumulators, x and one
      // temporary fit the 16 AVX2 registers (loading all C first spilled an accumulator:
      // a store-to-load round trip on its chain every k).
      const fvec xb = splat(x[k]);
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) acc[0][c] = fma_v(xb, load_q(q + k * stride + c * kLanes), acc[0][c]);
    } else {
      fvec w[C];
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) w[c] = load_q(q + k * stride + c * kLanes);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const fvec xb = splat(x[r * p.K + k]);
#pragma GCC unroll 8
        for (int c = 0; c < C; ++c) acc[r][c] = fma_v(xb, w[c], acc[r][c]);
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      fvec s;
      std::memcpy(&s, p.scale + n0 + c * kLanes, sizeof(s));
      const fvec out = acc[r][c] * s;
      std::memcpy(p.y + (m0 + r) * p.N + n0 + c * kLanes, &out, sizeof(out));
    }
}

// tile<R, C> for a runtime C in 1..CMax (the last, narrower column tile of a weight).
template <int R, int CMax = kWideVecs>
void tile_cols(const Problem& p, int64_t m0, int64_t n0, int64_t cvecs) {
  if (cvecs == CMax) return tile<R, CMax>(p, m0, n0);
  if constexpr (CMax > 1) tile_cols<R, CMax - 1>(p, m0, n0, cvecs);
}

template <int RMax = kTileRows>
void tile_any(const Problem& p, int64_t m0, int64_t rows, int64_t n0, int64_t cvecs) {
  if (rows == RMax) return tile_cols<RMax, kTileVecs>(p, m0, n0, cvecs);
  if constexpr (RMax > 1) tile_any<RMax - 1>(p, m0, rows, n0, cvecs);
}

// The work of one call as units 0..units-1; run(u) does unit u.
struct Work {
  Problem p;
  bool wide;
  int64_t units, col_units, row_units;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  void run(int64_t u) {
    if (wide) {
      // One cache line of weights per k for each row in turn (rows <= kWideRows).
      const int64_t n0 = u * kWideVecs * kLanes;
      const int64_t cvecs = std::min<int64_t>(kWideVecs, (p.nvec - n0) / kLanes);
      for (int64_t m = 0; m < p.M; ++m) tile_cols<1>(p, m, n0, cvecs);
      return;
    }
    // Row blocks vary fastest, so threads share a column tile's weights in cache.
    const int64_t cu = u / row_units, ru = u % row_units;
    const int64_t n0 = cu * kTileVecs * kLanes;
    const int64_t m0 = ru * kTileRows;
    tile_any(p, m0, std::min<int64_t>(kTileRows, p.M - m0), n0,
             std::min<int64_t>(kTileVecs, (p.nvec - n0) / kLanes));
  }

  void drain() {
    for (int64_t u; (u = next.fetch_add(1, std::memory_order_relaxed)) < units;) {
      run(u);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

ffi::Error Int8MatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                          ffi::Buffer<ffi::S8> q, ffi::Buffer<ffi::F32> scale,
                          ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), qd = q.dimensions();
  if (xd.size() != 2 || qd.size() != 3 || scale.dimensions().size() != 1)
    return ffi::Error::InvalidArgument(
        "int8_matmul: expected x [M, K], q [N/P, K, P], scale [N]");
  const int64_t M = xd[0], K = xd[1], P = qd[2], N = qd[0] * qd[2];
  if (qd[1] != K || scale.dimensions()[0] != N || (qd[0] > 1 && P % 64))
    return ffi::Error::InvalidArgument("int8_matmul: shapes of x, q and scale disagree");

  auto work = std::make_shared<Work>();
  Problem& p = work->p;
  p = Problem{x.typed_data(), q.typed_data(), scale.typed_data(), y->typed_data(),
              M, K, N, P, N / kLanes * kLanes};
  if (M == 0) return ffi::Error::Success();
  work->wide = M <= kWideRows;
  if (work->wide) {
    work->units = (p.nvec + kWideVecs * kLanes - 1) / (kWideVecs * kLanes);
  } else {
    work->row_units = (M + kTileRows - 1) / kTileRows;
    work->col_units = (p.nvec + kTileVecs * kLanes - 1) / (kTileVecs * kLanes);
    work->units = work->row_units * work->col_units;
  }

  // Small products run on the caller alone: a helper costs a few microseconds to wake.
  const int64_t macs = M * K * N;
  int64_t helpers = macs < kInlineMacs ? 0 : std::max<int64_t>(0, pool.num_threads() - 1);
  helpers = std::min(helpers, work->units - 1);
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([work] { work->drain(); });
  work->drain();
  tail_columns(p, 0, M);
  // Every unit was claimed; wait only for units a running helper claimed.
  while (work->done.load(std::memory_order_acquire) < work->units) std::this_thread::yield();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxinferInt8Matmul, Int8MatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
