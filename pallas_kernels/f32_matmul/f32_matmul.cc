// float32 matmul for XLA:CPU, called through jax.ffi (pallas_kernels/f32_matmul/cpu.py).
//
//   y[m, n] = sum_k x[m, k] * w[k, n]      x f32 [M, K], w f32 [K, N] (row-major, as stored)
//
// Why it exists: XLA:CPU picks its dot kernel by M and each one sums over K in its own
// order, so a token's logits depended on how many tokens shared its step; the engine's
// batch-invariant mode therefore ran every dot in fixed 32-row tiles (jaxinfer/matmul.py
// tiled_matmul), which cost a third of batch-1 decode speed. Here every output is ONE
// k-ordered FMA chain,
//
//   acc = 0;  for k = 0 .. K-1:  acc = fma(x[m, k], w[k, n], acc);  y[m, n] = acc
//
// on every path (decode tiles, the GEMM micro-tile, the scalar tail column, any thread).
// The GEMM cuts K into blocks and keeps the running sum in y between blocks: a float
// stored and reloaded is the same float, so the chain is unchanged. An output therefore
// depends on its own row of x and the weights only, never on M, on the tile or thread that
// computes it or on which rows share the call: bitwise batch-invariant by construction.
//
// w comes in its stored [K, N] layout or panel-major [N/16][K][16] (cpu.py panel,
// what the engine's float models use: each 16-column panel one sequential stream), or
// panel-major as codes (cpu.py CodedF32: a float32 weight whose values are exactly
// scale * code + offset per 32-row block of a column, e.g. dequantized from a GGUF's Q4_1 /
// Q8_0 blocks): a unit first turns its panels back into those very floats (dequant_panels,
// no FMA contraction) in a thread-local buffer, then runs the same tiles on it, so the
// bits are those of the float32 weight while 1.25 bytes a weight stream instead of 4.
//
//  * decode, M <= 3: rows x 8C-column register tiles run down the whole of K straight
//    from w, so the weights stream from memory once at bandwidth (what bounds decode).
//  * GEMM, M >= 4: register tiles of 4 to 6 rows x 16 columns (12 accumulators, 2 weight
//    vectors, 1 broadcast of x), the rows cut evenly (RowTiles). x is first packed into
//    those row tiles (k-major, by all threads) so a tile's broadcasts read one stream.
//    - panelled w: unit = a few adjacent panels; each tile runs the whole of K in one
//      call (see gemm_unit_panelled for why not K blocks) and prefetches its slice of
//      the unit's next panel.
//    - stored w: the unit copies its w[kc, width] slice per K block into a contiguous
//      buffer (w's row stride maps a column panel onto a few cache sets), then the tiles
//      sweep all M rows, partial sums kept in y between blocks; the K block keeps
//      x[M, kc] in L2. Below M = 64 units are several panels wide, so w is read in long
//      runs, and x is read in place.
//
// Work is cut in units that the caller and XLA's intra-op thread pool claim from one
// atomic counter (as in quantized_matmul/int8_matmul.cc): no thread waits for a task that
// has not started, so concurrent calls cannot deadlock the pool. Each thread sets MXCSR to
// IEEE denormals (no flush-to-zero) while it works, so an output cannot depend on which
// thread ran it.
//
// x86-64 with AVX2 and FMA only (the build passes -mno-avx512f); elsewhere the build fails
// and the engine keeps XLA's path.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#if !defined(__AVX2__) || !defined(__FMA__)
#error "the CPU f32 kernel needs x86-64 with AVX2 and FMA"
#endif
#include <immintrin.h>

#include "ffi_lite.h"
#include "work_share.h"

namespace ffi = jaxinfer_ffi;

namespace {

using jaxinfer_cpu::share;
using jaxinfer_cpu::Work;

// Tuning knobs (a benchmark may rebuild with -D to compare).
#ifndef JAXINFER_INLINE_MACS
#define JAXINFER_INLINE_MACS (1 << 15)
#endif
#ifndef JAXINFER_DECODE_ROWS
#define JAXINFER_DECODE_ROWS 3
#endif
#ifndef JAXINFER_DECODE_VECS
#define JAXINFER_DECODE_VECS 8
#endif
#ifndef JAXINFER_PREFETCH
#define JAXINFER_PREFETCH 16
#endif
#ifndef JAXINFER_PF_STEP
#define JAXINFER_PF_STEP 2
#endif
#ifndef JAXINFER_MAX_KC
#define JAXINFER_MAX_KC 256
#endif
constexpr int64_t kInlineMacs = JAXINFER_INLINE_MACS;  // below: no helper thread
constexpr int kDecodeRows = JAXINFER_DECODE_ROWS;      // M up to this: the decode path
static_assert(kDecodeRows >= 0 && kDecodeRows <= 3, "decode tiles exist for 1 to 3 rows");
constexpr int kDecodeVecs = JAXINFER_DECODE_VECS;      // M == 1 tile width, in 8-float vectors
constexpr int kPrefetch = JAXINFER_PREFETCH;           // decode: rows of w to prefetch ahead
constexpr int kMR = 6, kNR = 16;                       // GEMM register tile
constexpr int64_t kMaxKc = JAXINFER_MAX_KC;            // GEMM K block: at most 16 KiB of w
constexpr int64_t kL2Floats = 64 * 1024;               // x[M, kc] kept under 256 KiB
#ifndef JAXINFER_WIDE_M
#define JAXINFER_WIDE_M 64
#endif
#ifndef JAXINFER_MAX_WIDTH
#define JAXINFER_MAX_WIDTH 512
#endif
constexpr int64_t kWideM = JAXINFER_WIDE_M;            // GEMM: M below this: wide units
constexpr int64_t kMaxWidth = JAXINFER_MAX_WIDTH;      // wide units: at most this many columns
constexpr int64_t kPackFloats = 32 * 1024;             // wide units: packed w under 128 KiB
#ifndef JAXINFER_PANEL_ROWS
#define JAXINFER_PANEL_ROWS 256
#endif
constexpr int64_t kPanelRows = JAXINFER_PANEL_ROWS;    // panelled GEMM: rows x panels a unit
constexpr int64_t kMaxUnitPanels = 8;                  // panelled GEMM: panels a unit, at most

struct Mat {
  const float* x;  // [M, K]
  const float* w;  // [K, N], or panel-major [N/16][K][16] when `panelled`
  float* y;        // [M, N]
  int64_t M, K, N;
  bool panelled = false;
  // A CodedF32 (then w is null, panelled true): codes [N/16][K][16], scale and offset
  // [N/16][K/32][16]; w[k, n] = scale * code + offset of its block (dequant_panels).
  const int8_t* codes = nullptr;
  const float* scale = nullptr;
  const float* offset = nullptr;
};

constexpr int64_t kCodeBlock = 32;   // rows of K per scale / offset

// One coded value: the product rounded, then the sum (no FMA contraction), the formula
// dequant_panels applies eight lanes at a time.
__attribute__((optimize("fp-contract=off")))
inline float dequant_value(float scale, float code, float offset) {
  const float prod = scale * code;
  return prod + offset;
}

// Panels [j0, j0 + count) of a coded w as floats, [count][K][16] at out: each value
// scale * float(code) + offset, the product rounded before the add (no FMA contraction:
// the same two roundings as the numpy / ggml dequantizers, so the same floats).
__attribute__((optimize("fp-contract=off")))
void dequant_panels(const Mat& p, int64_t j0, int64_t count, float* __restrict out) {
  const int64_t blocks = p.K / kCodeBlock;
  for (int64_t j = j0; j < j0 + count; ++j) {
    const int8_t* c = p.codes + j * p.K * kNR;
    const float* sc = p.scale + j * blocks * kNR;
    const float* of = p.offset + j * blocks * kNR;
    for (int64_t b = 0; b < blocks; ++b) {
      const __m256 s0 = _mm256_loadu_ps(sc + b * kNR), s1 = _mm256_loadu_ps(sc + b * kNR + 8);
      const __m256 o0 = _mm256_loadu_ps(of + b * kNR), o1 = _mm256_loadu_ps(of + b * kNR + 8);
      for (int64_t k = b * kCodeBlock; k < (b + 1) * kCodeBlock; ++k) {
        const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c + k * kNR));
        const __m256 f0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q));
        const __m256 f1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q, 8)));
        _mm256_store_ps(out + k * kNR, _mm256_add_ps(_mm256_mul_ps(s0, f0), o0));
        _mm256_store_ps(out + k * kNR + 8, _mm256_add_ps(_mm256_mul_ps(s1, f1), o1));
      }
    }
    out += p.K * kNR;
  }
}

// A thread's buffer for `count` dequantized panels, 64-byte aligned.
float* panel_buffer(const Mat& p, int64_t count) {
  static thread_local std::vector<float> buf;
  const int64_t need = count * p.K * kNR + 16;
  if (static_cast<int64_t>(buf.size()) < need) buf.resize(need);
  return reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(buf.data()) + 63) & ~uintptr_t{63});
}

// Panel j of a panelled w from row k on: 16 floats a row, rows contiguous.
inline const float* panel_at(const Mat& p, int64_t j, int64_t k) {
  return p.w + (j * p.K + k) * kNR;
}

// ---------------------------------------------------------------------------------------
// Decode: rows [m0, m0 + R) x columns [n0, n0 + 8C), the whole of K, straight from w.
// ---------------------------------------------------------------------------------------

template <int R, int C>
void decode_tile(const Mat& p, int64_t m0, int64_t n0) {
  __m256 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  const float* x = p.x + m0 * p.K;
  const float* w = p.w + n0;
  for (int64_t k = 0; k < p.K; ++k) {
    // Each row of a tile is a new page of a wide weight: prefetch ahead, every cache line.
    const float* ahead = w + std::min(k + kPrefetch, p.K - 1) * p.N;
    for (int c = 0; c < C; c += JAXINFER_PF_STEP) __builtin_prefetch(ahead + 8 * c);
    const float* wk = w + k * p.N;
    if constexpr (R == 1) {
      const __m256 xb = _mm256_set1_ps(x[k]);
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) acc[0][c] = _mm256_fmadd_ps(xb, _mm256_loadu_ps(wk + 8 * c), acc[0][c]);
    } else {
      __m256 xb[R];
      for (int r = 0; r < R; ++r) xb[r] = _mm256_set1_ps(x[r * p.K + k]);
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) {
        const __m256 wc = _mm256_loadu_ps(wk + 8 * c);
        for (int r = 0; r < R; ++r) acc[r][c] = _mm256_fmadd_ps(xb[r], wc, acc[r][c]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) _mm256_storeu_ps(p.y + (m0 + r) * p.N + n0 + 8 * c, acc[r][c]);
}

#ifndef JAXINFER_ROW_KB
#define JAXINFER_ROW_KB 8
#endif
#ifndef JAXINFER_ROW_UNITS
#define JAXINFER_ROW_UNITS 2
#endif
constexpr int kRowKb = JAXINFER_ROW_KB;

// M == 1, vectors [v0, v1) of y: k in blocks of kRowKb rows, each block swept in 8-vector
// register tiles whose sums wait in y between blocks. So w is read as kRowKb sequential
// streams over the unit's whole width (a unit is 1/4 of N with 2 threads): measured on
// the 576 x 49152 head, 34 GB/s vs 17-19 for 64-column tiles running down all of K.
void row_unit(const Mat& p, int64_t v0, int64_t v1) {
  float* part = p.y + v0 * 8;   // y holds the partial sums between K blocks
  const int64_t nv = v1 - v0;
  const float* w = p.w + v0 * 8;
  for (int64_t k0 = 0; k0 < p.K; k0 += kRowKb) {
    const int64_t k1 = std::min<int64_t>(p.K, k0 + kRowKb);
    for (int64_t t = 0; t < nv; t += 8) {
      const int cv = static_cast<int>(std::min<int64_t>(8, nv - t));
      __m256 acc[8];
      for (int c = 0; c < 8; ++c)
        acc[c] = (k0 == 0 || c >= cv) ? _mm256_setzero_ps() : _mm256_loadu_ps(part + 8 * (t + c));
      if (cv == 8) {
        for (int64_t k = k0; k < k1; ++k) {
          const __m256 xb = _mm256_set1_ps(p.x[k]);
          const float* wk = w + k * p.N + 8 * t;
#pragma GCC unroll 8
          for (int c = 0; c < 8; ++c) acc[c] = _mm256_fmadd_ps(xb, _mm256_loadu_ps(wk + 8 * c), acc[c]);
        }
      } else {
        for (int64_t k = k0; k < k1; ++k) {
          const __m256 xb = _mm256_set1_ps(p.x[k]);
          const float* wk = w + k * p.N + 8 * t;
          for (int c = 0; c < cv; ++c) acc[c] = _mm256_fmadd_ps(xb, _mm256_loadu_ps(wk + 8 * c), acc[c]);
        }
      }
      for (int c = 0; c < cv; ++c) _mm256_storeu_ps(part + 8 * (t + c), acc[c]);
    }
  }
}

// Columns [n0, n0 + 8 * cvecs) of rows [m0, m0 + R), cvecs <= CMax.
template <int R, int CMax>
void decode_cols(const Mat& p, int64_t m0, int64_t n0, int64_t cvecs) {
  if (cvecs == CMax) return decode_tile<R, CMax>(p, m0, n0);
  if constexpr (CMax > 1) decode_cols<R, CMax - 1>(p, m0, n0, cvecs);
}

// Scalar columns [n0, n1) of every row: the same k-ordered fma chain.
void scalar_cols(const Mat& p, int64_t n0, int64_t n1) {
  for (int64_t m = 0; m < p.M; ++m)
    for (int64_t n = n0; n < n1; ++n) {
      float acc = 0.f;
      for (int64_t k = 0; k < p.K; ++k) acc = std::fma(p.x[m * p.K + k], p.w[k * p.N + n], acc);
      p.y[m * p.N + n] = acc;
    }
}

// Panelled w, rows [m0, m0 + R) x panels [j0, j0 + C), the whole of K: each panel is one
// sequential stream (64 bytes a k), so C streams run at bandwidth without a copy.
// `w`: panel j0's first row (in p.w, or a buffer of dequantized panels).
template <int R, int C>
void panel_decode_tile(const Mat& p, int64_t m0, int64_t j0, const float* w) {
  __m256 acc[R][2 * C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 2 * C; ++c) acc[r][c] = _mm256_setzero_ps();
  const float* x = p.x + m0 * p.K;
  const int64_t stride = p.K * kNR;   // floats from one panel to the next
  for (int64_t k = 0; k < p.K; ++k) {
    __m256 xb[R];
    for (int r = 0; r < R; ++r) xb[r] = _mm256_set1_ps(x[r * p.K + k]);
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) {
      const float* wk = w + c * stride + k * kNR;
      const __m256 b0 = _mm256_load_ps(wk), b1 = _mm256_load_ps(wk + 8);
      for (int r = 0; r < R; ++r) {
        acc[r][2 * c] = _mm256_fmadd_ps(xb[r], b0, acc[r][2 * c]);
        acc[r][2 * c + 1] = _mm256_fmadd_ps(xb[r], b1, acc[r][2 * c + 1]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 2 * C; ++c)
      _mm256_storeu_ps(p.y + (m0 + r) * p.N + j0 * kNR + 8 * c, acc[r][c]);
}

// Panels [j0, j0 + count) of rows [m0, m0 + R), count <= CMax.
template <int R, int CMax>
void panel_decode_cols(const Mat& p, int64_t m0, int64_t j0, int64_t count, const float* w) {
  if (count == CMax) return panel_decode_tile<R, CMax>(p, m0, j0, w);
  if constexpr (CMax > 1) panel_decode_cols<R, CMax - 1>(p, m0, j0, count, w);
}

// ---------------------------------------------------------------------------------------
// GEMM: 6x16 register tiles over a packed w[kc, 16] panel.
// ---------------------------------------------------------------------------------------

// Row tiles of an M-row GEMM: T = ceil(M / 6) tiles of as equal height as can be (M = 32:
// 6, 6, 5, 5, 5, 5), never a thin tail. Why: a 6x16 tile keeps 12 accumulators, enough to
// hide the FMA latency; 2 rows keep 4 and ran at half speed, so M = 32 as 5 x 6 + 2 spent
// 8% of its tile time on the last 2 rows. 4 or 5 rows run within ~5% of 6.
struct RowTiles {
  int64_t count, base, extra;   // `extra` tiles of base + 1 rows first, then base rows
  explicit RowTiles(int64_t M)
      : count((M + kMR - 1) / kMR), base(count ? M / count : 0), extra(count ? M % count : 0) {}
  int64_t start(int64_t t) const { return t * base + std::min(t, extra); }
  int64_t rows(int64_t t) const { return base + (t < extra ? 1 : 0); }
};

// Lines to prefetch while a tile runs (the unit's next panel), spread over its k loop.
struct Prefetch {
  const float* at = nullptr;   // rows of 16 floats, one cache line each
  int64_t lines = 0;
};

// c[R, 16] (ldc) (+)= x[R, kc] (ldx) @ b[kc, 16]: the register tile. The accumulators live
// in registers for the whole loop (no branches in the FMA body: GCC then keeps the arrays
// in ymm). kFirst: the chain starts at zero (c is only written). `pf`: one line every
// kc / pf.lines k, so the next weights stream in while the FMAs run, not in a burst.
template <int R, bool kPackedX, bool kFirst>
__attribute__((noinline)) void micro_tile(const float* x, int64_t ldx, const float* b, int64_t kc,
                                          float* c, int64_t ldc, Prefetch pf) {
  // x[r, k] at x + r * ldx + k, or in a packed row tile (see pack_x) at x + k * R + r.
  __m256 a0[R], a1[R];
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) {
    a0[r] = kFirst ? _mm256_setzero_ps() : _mm256_loadu_ps(c + r * ldc);
    a1[r] = kFirst ? _mm256_setzero_ps() : _mm256_loadu_ps(c + r * ldc + 8);
  }
  auto body = [&](int64_t k) __attribute__((always_inline)) {
    const __m256 b0 = _mm256_load_ps(b + k * kNR), b1 = _mm256_load_ps(b + k * kNR + 8);
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const __m256 xb = _mm256_broadcast_ss(kPackedX ? x + k * R + r : x + r * ldx + k);
      a0[r] = _mm256_fmadd_ps(xb, b0, a0[r]);
      a1[r] = _mm256_fmadd_ps(xb, b1, a1[r]);
    }
  };
  int64_t k = 0;
  if (pf.lines > 0) {
    const int64_t every = std::max<int64_t>(1, kc / pf.lines);
    for (int64_t line = 0; line < pf.lines && k + every <= kc; ++line) {
      _mm_prefetch(reinterpret_cast<const char*>(pf.at + line * kNR), _MM_HINT_T0);
      for (int64_t e = 0; e < every; ++e, ++k) body(k);
    }
  }
#pragma GCC unroll 2
  for (; k < kc; ++k) body(k);
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(c + r * ldc, a0[r]);
    _mm256_storeu_ps(c + r * ldc + 8, a1[r]);
  }
}

// y[m0 .. m0+R, n0 .. n0+ncols) (+)= x[m0 .. m0+R, k0 .. k0+kc) @ b[kc, 16]. `first`: the
// chain starts at zero; otherwise it continues from the partial sums stored in y.
template <int R, bool kPackedX>
void gemm_tile(const Mat& p, const float* xp, int64_t m0, int64_t n0, int ncols, int64_t k0,
               int64_t kc, const float* b, bool first, Prefetch pf) {
  float* y = p.y + m0 * p.N + n0;
  // a packed tile starting at row m0 lies at xp + m0 * K, k-major (see pack_x)
  const float* x = kPackedX ? xp + m0 * p.K + k0 * R : p.x + m0 * p.K + k0;
  if (ncols == kNR) {
    if (first) return micro_tile<R, kPackedX, true>(x, p.K, b, kc, y, p.N, pf);
    return micro_tile<R, kPackedX, false>(x, p.K, b, kc, y, p.N, pf);
  }
  alignas(32) float edge[R * kNR];      // a partial last panel goes through here
  std::memset(edge, 0, sizeof(edge));
  if (!first)
    for (int r = 0; r < R; ++r) std::memcpy(edge + r * kNR, y + r * p.N, ncols * sizeof(float));
  micro_tile<R, kPackedX, false>(x, p.K, b, kc, edge, kNR, pf);
  for (int r = 0; r < R; ++r) std::memcpy(y + r * p.N, edge + r * kNR, ncols * sizeof(float));
}

template <bool kPackedX>
void gemm_rows_as(const Mat& p, const float* xp, int64_t m0, int64_t rows, int64_t n0, int ncols,
                  int64_t k0, int64_t kc, const float* b, bool first, Prefetch pf) {
  switch (rows) {
    case 1: return gemm_tile<1, kPackedX>(p, xp, m0, n0, ncols, k0, kc, b, first, pf);
    case 2: return gemm_tile<2, kPackedX>(p, xp, m0, n0, ncols, k0, kc, b, first, pf);
    case 3: return gemm_tile<3, kPackedX>(p, xp, m0, n0, ncols, k0, kc, b, first, pf);
    case 4: return gemm_tile<4, kPackedX>(p, xp, m0, n0, ncols, k0, kc, b, first, pf);
    case 5: return gemm_tile<5, kPackedX>(p, xp, m0, n0, ncols, k0, kc, b, first, pf);
    default: return gemm_tile<6, kPackedX>(p, xp, m0, n0, ncols, k0, kc, b, first, pf);
  }
}

// xp: x packed by pack_x, or nullptr (tiles read x in place).
void gemm_rows(const Mat& p, const float* xp, int64_t m0, int64_t rows, int64_t n0, int ncols,
               int64_t k0, int64_t kc, const float* b, bool first, Prefetch pf = {}) {
  if (xp) return gemm_rows_as<true>(p, xp, m0, rows, n0, ncols, k0, kc, b, first, pf);
  gemm_rows_as<false>(p, nullptr, m0, rows, n0, ncols, k0, kc, b, first, pf);
}

// Row tile t of x (R rows from m0, see RowTiles) k-major at xp + m0 * K: [k][R]. A tile's
// broadcasts then read one sequential stream instead of R rows K floats apart. Values are
// copied, not changed, so every output's FMA chain is the same.
void pack_x(const Mat& p, const RowTiles& tiles, float* xp, int64_t t) {
  const int64_t m0 = tiles.start(t), rows = tiles.rows(t);
  float* dst = xp + m0 * p.K;
  for (int64_t k = 0; k < p.K; ++k)
    for (int64_t r = 0; r < rows; ++r) dst[k * rows + r] = p.x[(m0 + r) * p.K + k];
}

// Panels [j0, j0 + panels) of a panelled w, all M rows: each row tile runs down the whole
// of K in one call (the panel is already the contiguous b[K][16] the tile wants), so its
// accumulators stay in registers from k = 0 to K - 1 and y is written once. Why not K
// blocks, as for a copied w: between blocks the partial sums went to y, whose rows are N
// floats apart (N = 3072: 12 KiB, every row of a column panel on one L1 set and few L2
// sets), so each block reloaded them from L3; measured on the 30 layers' matmuls, M = 512
// ran at 157 GF/s blocked and 180 K-inner (M = 32: the same). The panel (K x 64 B) stays in
// L1/L2 across the row tiles; the packed x streams from L2 (L3 for M x K past 512 KiB).
void gemm_unit_panelled(const Mat& p, const float* xp, int64_t j0, int64_t panels) {
  const RowTiles rt(p.M);
  float* coded = p.codes ? panel_buffer(p, 1) : nullptr;
  for (int64_t j = j0; j < j0 + panels; ++j) {
    if (coded) dequant_panels(p, j, 1, coded);
    const float* b = coded ? coded : panel_at(p, j, 0);
    // (a coded w's next panel is dequantized from L1-sized codes: nothing to prefetch)
    const float* next = j + 1 < j0 + panels && !coded ? panel_at(p, j + 1, 0) : nullptr;
    // Each tile prefetches its slice of the next panel, spread over its k loop, so the
    // weights stream in while the FMAs run (one thread, M = 32, K = 576: ~88 GF/s against
    // ~70 without; slices only in tiles 1.. gave ~79).
    const int64_t per = next ? (p.K + rt.count - 1) / rt.count : 0;
    for (int64_t t = 0; t < rt.count; ++t) {
      const int64_t from = t * per;
      const Prefetch pf = per ? Prefetch{next + from * kNR, std::clamp<int64_t>(p.K - from, 0, per)}
                              : Prefetch{};
      gemm_rows(p, xp, rt.start(t), rt.rows(t), j * kNR, kNR, 0, p.K, b, true, pf);
    }
  }
}

// A stored [K, N] w: columns [n0, n0 + width) of y (panels of 16), all M rows. Per K block
// the unit copies w[k0 .. k0+kc, n0 .. n0+width) into panel-major b[width/16][kc][16] (zero
// past column N), reading each row of w sequentially across the unit's width, then each
// panel's row tiles sweep all rows. Narrow units (one panel) for large M keep b in L1; wide
// ones for small M read w in long runs, which is what bounds them.
void gemm_unit(const Mat& p, const float* xp, int64_t n0, int64_t width, int64_t kc_max) {
  const int64_t panels = (std::min(width, p.N - n0) + kNR - 1) / kNR;
  static thread_local std::vector<float> buf;
  const int64_t need = panels * kc_max * kNR + 16;
  if (static_cast<int64_t>(buf.size()) < need) buf.resize(need);
  float* b = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(buf.data()) + 63) & ~uintptr_t{63});
  for (int64_t k0 = 0; k0 < p.K; k0 += kc_max) {
    const int64_t kc = std::min(kc_max, p.K - k0);
    for (int64_t k = 0; k < kc; ++k) {
      const float* w = p.w + (k0 + k) * p.N + n0;
      __builtin_prefetch(w + std::min(k + kPrefetch, p.K - 1 - k0) * p.N);
      for (int64_t j = 0; j < panels; ++j) {
        float* bj = b + (j * kc + k) * kNR;
        const int64_t cols = std::min<int64_t>(kNR, p.N - n0 - j * kNR);
        if (cols == kNR) {
          _mm256_store_ps(bj, _mm256_loadu_ps(w + j * kNR));
          _mm256_store_ps(bj + 8, _mm256_loadu_ps(w + j * kNR + 8));
        } else {
          std::memset(bj, 0, kNR * sizeof(float));
          std::memcpy(bj, w + j * kNR, cols * sizeof(float));
        }
      }
    }
    // While the tiles compute, pull the next K block of this unit's w into L2, a few
    // lines before each tile: packing then copies from L2 instead of waiting on memory
    // (for a few rows, M < 64, packing straight from memory was a third of the time).
    const int64_t k1 = k0 + kc, k2 = std::min(p.K, k1 + kc_max);
    const int64_t row_lines = (std::min(width, p.N - n0) * 4 + 63) / 64;
    const int64_t lines = (k2 - k1) * row_lines;
    const RowTiles rt(p.M);
    const int64_t tiles = panels * rt.count;
    const int64_t per_tile = (lines + tiles - 1) / std::max<int64_t>(tiles, 1);
    int64_t next = 0;
    for (int64_t j = 0; j < panels; ++j) {
      const int ncols = static_cast<int>(std::min<int64_t>(kNR, p.N - n0 - j * kNR));
      for (int64_t t = 0; t < rt.count; ++t) {
        for (int64_t e = std::min(lines, next + per_tile); next < e; ++next) {
          const int64_t r = k1 + next / row_lines, l = next % row_lines;
          _mm_prefetch(reinterpret_cast<const char*>(p.w + r * p.N + n0 + 16 * l), _MM_HINT_T1);
        }
        gemm_rows(p, xp, rt.start(t), rt.rows(t), n0 + j * kNR, ncols, k0, kc,
                  b + j * kc * kNR, k0 == 0);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------
// Work sharing
// ---------------------------------------------------------------------------------------

template <int R>
void decode_units(Work& work, const Mat& p, int64_t m0, int64_t nvec) {
  // M == 1 is pure streaming (8 chains hide the FMA latency); more rows need registers.
  constexpr int C = R == 1 ? kDecodeVecs : (R == 2 ? 6 : 4);
  const int64_t tiles = (nvec / 8 + C - 1) / C;
  const bool tail = nvec < p.N;
  work.units = tiles + (tail ? 1 : 0);
  work.run = [p, m0, nvec, tiles](int64_t u) {
    if (u == tiles) return scalar_cols(p, nvec, p.N);
    const int64_t n0 = u * 8 * C;
    decode_cols<R, C>(p, m0, n0, std::min<int64_t>(C, (nvec - n0) / 8));
  };
}

template <int R>
void panel_decode_units(Work& work, const Mat& p) {
  // M == 1: 4 panels = 8 chains hide the FMA latency; more rows need more registers.
  constexpr int C = R == 1 ? 4 : (R == 2 ? 3 : 2);
  const int64_t panels = p.N / kNR;
  work.units = (panels + C - 1) / C;
  work.run = [p, panels](int64_t u) {
    const int64_t j0 = u * C, count = std::min<int64_t>(C, panels - j0);
    float* coded = p.codes ? panel_buffer(p, count) : nullptr;
    if (coded) dequant_panels(p, j0, count, coded);
    panel_decode_cols<R, C>(p, 0, j0, count, coded ? coded : panel_at(p, j0, 0));
  };
}

// y = x @ w for either layout (validated by the handlers).
void matmul(ffi::ThreadPool& pool, const Mat& p) {
  const int64_t M = p.M, K = p.K, N = p.N;
  if (M == 0 || N == 0) return;
  if (K == 0) {   // an empty sum
    std::memset(p.y, 0, M * N * sizeof(float));
    return;
  }
  auto work = std::make_shared<Work>();
  const int64_t nvec = N / 8 * 8;
  if (p.panelled && M <= kDecodeRows) {
    switch (M) {
      case 1: panel_decode_units<1>(*work, p); break;
      case 2: panel_decode_units<2>(*work, p); break;
      default: panel_decode_units<3>(*work, p); break;
    }
  } else
#ifndef JAXINFER_NO_ROWS
  if (M == 1) {
    const int64_t vecs = nvec / 8;
    const int64_t split = JAXINFER_ROW_UNITS * std::max<int64_t>(1, pool.num_threads());
    const int64_t per = std::max<int64_t>(1, (vecs + split - 1) / split);
    const int64_t units = (vecs + per - 1) / per;
    work->units = units + (nvec < N ? 1 : 0);
    work->run = [p, per, vecs, units, nvec](int64_t u) {
      if (u == units) return scalar_cols(p, nvec, p.N);
      row_unit(p, u * per, std::min(vecs, (u + 1) * per));
    };
  } else
#endif
  if (M <= kDecodeRows) {
    switch (M) {
      case 1: decode_units<1>(*work, p, 0, nvec); break;
      case 2: decode_units<2>(*work, p, 0, nvec); break;
      default: decode_units<3>(*work, p, 0, nvec); break;
    }
  } else {
    int64_t kc = std::clamp<int64_t>(kL2Floats / M / 8 * 8, 64, kMaxKc);
    int64_t width = kNR;
    // Wide units only where w must be copied: a panelled w is already one stream a panel,
    // and one-panel units with x packed measured 5-12% faster at M = 4..48 (units of up to
    // 384 columns left the caller waiting ~40 us a call for the helper's last unit).
    const bool wide = M < kWideM && !p.panelled;
    if (wide) {   // a few units per thread, each at most kMaxWidth columns
      const int64_t split = 4 * std::max<int64_t>(1, pool.num_threads());
      width = std::clamp<int64_t>((N + split - 1) / split, kNR, kMaxWidth) / kNR * kNR;
      kc = std::clamp<int64_t>(kPackFloats / width / 8 * 8, 16, kc);   // copies under kPackFloats
    }
    const float* xp = nullptr;
#ifndef JAXINFER_NO_PACK_X
    if (!wide) {   // narrow units each sweep all row tiles: pack x once, all units read it
      static thread_local std::vector<float> xbuf;   // the calling thread's, reused across calls
      if (static_cast<int64_t>(xbuf.size()) < M * K) xbuf.resize(M * K);
      float* xw = xbuf.data();
      auto pack = std::make_shared<Work>();
      const RowTiles tiles(M);
      pack->units = tiles.count;
      pack->run = [p, xw, tiles](int64_t t) { pack_x(p, tiles, xw, t); };
      share(pool, pack, M * K, kInlineMacs);
      xp = xw;
    }
#endif
    if (p.panelled) {
      // Units of a few adjacent panels (a tile prefetches the unit's next panel), cut
      // evenly, at least 4 per thread so no thread waits long for another's last unit,
      // and ~256 rows x panels at most (a panel of 512 rows is one unit).
      const int64_t panels = N / kNR, threads = std::max<int64_t>(1, pool.num_threads());
      const int64_t cap = std::clamp<int64_t>(kPanelRows / M, 1, kMaxUnitPanels);
      const int64_t units = std::max(std::min(panels, 4 * threads), (panels + cap - 1) / cap);
      work->units = units;
      work->run = [p, xp, panels, units](int64_t u) {
        const int64_t j0 = u * panels / units;
        gemm_unit_panelled(p, xp, j0, (u + 1) * panels / units - j0);
      };
    } else {
      work->units = (N + width - 1) / width;
      work->run = [p, xp, width, kc](int64_t u) { gemm_unit(p, xp, u * width, width, kc); };
    }
  }
  share(pool, work, M * K * N, kInlineMacs);
}

ffi::Error F32MatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                         ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2)
    return ffi::Error::InvalidArgument("f32_matmul: expected x [M, K] and w [K, N]");
  const int64_t M = xd[0], K = xd[1], N = wd[1];
  if (wd[0] != K)
    return ffi::Error::InvalidArgument("f32_matmul: x [M, K] and w [K, N] disagree on K");
  matmul(pool, Mat{x.typed_data(), w.typed_data(), y->typed_data(), M, K, N});
  return ffi::Error::Success();
}

// w panel-major [N/16, K, 16] (cpu.py panel): the same FMA chains, no copies.
ffi::Error F32MatmulPanelsImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                               ffi::Buffer<ffi::F32> w, ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 3 || wd[2] != kNR)
    return ffi::Error::InvalidArgument("f32_matmul_panels: expected x [M, K] and w [N/16, K, 16]");
  const int64_t M = xd[0], K = xd[1], N = wd[0] * kNR;
  if (wd[1] != K)
    return ffi::Error::InvalidArgument("f32_matmul_panels: x [M, K] and w [N/16, K, 16] disagree on K");
  matmul(pool, Mat{x.typed_data(), w.typed_data(), y->typed_data(), M, K, N, true});
  return ffi::Error::Success();
}

// One layer's weight out of every layer's: operands x [M, K], layer i32[1], then w_0 ..
// w_{L-1} (all plain [K, N] or all panel-major [N/16, K, 16]) or their stack [L, ...]
// (RemainingArgs::layer); computes x @ w_layer with the same FMA chains as the calls above.
// Why: a loop over layers (lax.fori_loop) can pass every layer's weight as a loop-invariant
// operand and pick one by pointer, where slicing a stacked weight in XLA would copy it each
// iteration (benchmarks/layer_loop_probe.py).
ffi::Error F32MatmulLayerImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> layer,
                              ffi::RemainingArgs ws, ffi::ResultBuffer<ffi::F32> y) {
  if (layer.element_count() != 1) return ffi::Error::InvalidArgument("f32_matmul_layer: layer must be one i32");
  XLA_FFI_Buffer wv;
  auto w = ws.layer<ffi::Buffer<ffi::F32>>(0, 1, layer.typed_data()[0], wv);
  if (!w.has_value())
    return ffi::Error::InvalidArgument("f32_matmul_layer: layer index out of range, or weights not float32");
  const auto xd = x.dimensions(), wd = w->dimensions();
  const bool panelled = wd.size() == 3;
  if (xd.size() != 2 || (wd.size() != 2 && !(panelled && wd[2] == kNR)))
    return ffi::Error::InvalidArgument("f32_matmul_layer: expected x [M, K] and w [K, N] or [N/16, K, 16]");
  const int64_t M = xd[0], K = xd[1], N = panelled ? wd[0] * kNR : wd[1];
  if ((panelled ? wd[1] : wd[0]) != K)
    return ffi::Error::InvalidArgument("f32_matmul_layer: x and w disagree on K");
  if (y->dimensions()[0] != M || y->dimensions()[1] != N)
    return ffi::Error::InvalidArgument("f32_matmul_layer: the output is not [M, N] of this layer's weight");
  matmul(pool, Mat{x.typed_data(), w->typed_data(), y->typed_data(), M, K, N, panelled});
  return ffi::Error::Success();
}

// A coded w's three arrays checked against x [M, K] (K = 0: any K): codes [P, K, 16] int8,
// scale and offset [P, K/32, 16] f32. Fills p's w fields; the error names what is wrong.
ffi::Error coded_mat(ffi::Buffer<ffi::S8> codes, ffi::Buffer<ffi::F32> scale,
                     ffi::Buffer<ffi::F32> offset, int64_t K, Mat& p) {
  const auto cd = codes.dimensions(), sd = scale.dimensions(), od = offset.dimensions();
  if (cd.size() != 3 || cd[2] != kNR || (K && cd[1] != K) || cd[1] % kCodeBlock)
    return ffi::Error::InvalidArgument("coded f32 weight: codes must be int8 [N/16, K, 16], K a multiple of 32");
  if (sd.size() != 3 || od.size() != 3 || sd[0] != cd[0] || sd[1] != cd[1] / kCodeBlock || sd[2] != kNR ||
      od[0] != sd[0] || od[1] != sd[1] || od[2] != kNR)
    return ffi::Error::InvalidArgument("coded f32 weight: scale and offset must be f32 [N/16, K/32, 16]");
  p.K = cd[1];
  p.N = cd[0] * kNR;
  p.panelled = true;
  p.w = nullptr;
  p.codes = codes.typed_data();
  p.scale = scale.typed_data();
  p.offset = offset.typed_data();
  return ffi::Error::Success();
}

// x [M, K] @ a coded w: the same FMA chains as on its float32 panels.
ffi::Error F32MatmulCodesImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> codes,
                              ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::F32> offset,
                              ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions();
  if (xd.size() != 2) return ffi::Error::InvalidArgument("f32_matmul_codes: expected x [M, K]");
  Mat p{x.typed_data(), nullptr, y->typed_data(), xd[0], xd[1], 0};
  if (auto e = coded_mat(codes, scale, offset, xd[1], p); !e.success()) return e;
  matmul(pool, p);
  return ffi::Error::Success();
}

// The layer loop's form for coded weights: x, layer i32[1], then codes_0 .. codes_{L-1},
// scale_0 .., offset_0 .. (3L operands, one shape) or the three stacks, as F32MatmulLayerImpl.
ffi::Error F32MatmulLayerCodesImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> layer,
                                   ffi::RemainingArgs ws, ffi::ResultBuffer<ffi::F32> y) {
  if (layer.element_count() != 1) return ffi::Error::InvalidArgument("f32_matmul_layer_codes: layer must be one i32");
  if (ws.size() % 3) return ffi::Error::InvalidArgument("f32_matmul_layer_codes: expected 3 operands a layer");
  const int64_t l = layer.typed_data()[0];
  XLA_FFI_Buffer cv, sv, ov;
  auto codes = ws.layer<ffi::Buffer<ffi::S8>>(0, 3, l, cv);
  auto scale = ws.layer<ffi::Buffer<ffi::F32>>(1, 3, l, sv), offset = ws.layer<ffi::Buffer<ffi::F32>>(2, 3, l, ov);
  if (!codes || !scale || !offset)
    return ffi::Error::InvalidArgument(
        "f32_matmul_layer_codes: layer index out of range, or not int8 codes, f32 scales and offsets");
  const auto xd = x.dimensions();
  if (xd.size() != 2) return ffi::Error::InvalidArgument("f32_matmul_layer_codes: expected x [M, K]");
  Mat p{x.typed_data(), nullptr, y->typed_data(), xd[0], xd[1], 0};
  if (auto e = coded_mat(*codes, *scale, *offset, xd[1], p); !e.success()) return e;
  if (y->dimensions()[0] != p.M || y->dimensions()[1] != p.N)
    return ffi::Error::InvalidArgument("f32_matmul_layer_codes: the output is not [M, N] of this layer's weight");
  matmul(pool, p);
  return ffi::Error::Success();
}

// A coded w's float32 panels [P, K, 16]: the very floats the matmul above computes with
// (the engine checks a weight's codes against its floats with this before using them).
ffi::Error CodesDequantImpl(ffi::Buffer<ffi::S8> codes, ffi::Buffer<ffi::F32> scale,
                            ffi::Buffer<ffi::F32> offset, ffi::ResultBuffer<ffi::F32> y) {
  Mat p{nullptr, nullptr, nullptr, 0, 0, 0};
  if (auto e = coded_mat(codes, scale, offset, 0, p); !e.success()) return e;
  dequant_panels(p, 0, p.N / kNR, y->typed_data());
  return ffi::Error::Success();
}

// Columns `tokens` of a coded w [K, N] as rows y [T, K] (a tied model's embedding rows
// read from its coded LM head), each value as dequant_panels makes it.
__attribute__((optimize("fp-contract=off")))
ffi::Error CodesRowsImpl(ffi::Buffer<ffi::S32> tokens, ffi::Buffer<ffi::S8> codes, ffi::Buffer<ffi::F32> scale,
                         ffi::Buffer<ffi::F32> offset, ffi::ResultBuffer<ffi::F32> y) {
  Mat p{nullptr, nullptr, nullptr, 0, 0, 0};
  if (auto e = coded_mat(codes, scale, offset, 0, p); !e.success()) return e;
  const int64_t T = tokens.element_count(), blocks = p.K / kCodeBlock;
  const int32_t* t = tokens.typed_data();
  float* out = y->typed_data();
  for (int64_t i = 0; i < T; ++i) {
    const int64_t n = std::clamp<int64_t>(t[i], 0, p.N - 1);   // as jnp indexing clamps
    const int64_t j = n / kNR, c = n % kNR;
    for (int64_t k = 0; k < p.K; ++k) {
      const int64_t s = (j * blocks + k / kCodeBlock) * kNR + c;
      out[i * p.K + k] = dequant_value(p.scale[s], static_cast<float>(p.codes[(j * p.K + k) * kNR + c]),
                                       p.offset[s]);
    }
  }
  return ffi::Error::Success();
}

// A float rounded to float16 precision (as numpy's astype(float16): nearest, ties to even).
#ifdef __F16C__
inline float to_f16_precision(float x) { return _cvtsh_ss(_cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT)); }
#endif

// Codes for a float32 panel-major weight [P, K, 16] (pallas_kernels/f32_matmul/codes.py):
// per block of 32 rows of a column, the first candidate that gives back every value bit
// for bit through dequant_panels' formula (scale * code, rounded, + offset, rounded):
//   affine:    offset = the block's min, scale = (max - min) / 15 at float16 precision,
//              codes 0..15 (a GGUF's Q4_1);
//   symmetric: offset 0, scale = max |v| / 127 at float16 precision, codes -127..127 (Q8_0).
// ok[0] = 1 if every block has codes, else 0 (the weight then stays float32).
__attribute__((optimize("fp-contract=off")))
ffi::Error CodesEncodeImpl(ffi::Buffer<ffi::F32> w, ffi::ResultBuffer<ffi::S8> codes,
                           ffi::ResultBuffer<ffi::F32> scale, ffi::ResultBuffer<ffi::F32> offset,
                           ffi::ResultBuffer<ffi::S32> ok) {
  const auto wd = w.dimensions();
  if (wd.size() != 3 || wd[2] != kNR || wd[1] % kCodeBlock)
    return ffi::Error::InvalidArgument("codes_encode: expected w f32 [N/16, K, 16], K a multiple of 32");
  int32_t* good = ok->typed_data();
  good[0] = 0;
#ifdef __F16C__
  const int64_t blocks = wd[0] * (wd[1] / kCodeBlock);
  const float* v = w.typed_data();
  int8_t* q = codes->typed_data();
  float* sc = scale->typed_data();
  float* of = offset->typed_data();
  for (int64_t b = 0; b < blocks; ++b) {            // blocks are [32][16] runs of w
    const float* vb = v + b * kCodeBlock * kNR;
    for (int64_t c = 0; c < kNR; ++c) {
      float lo = vb[c], hi = vb[c], amax = std::fabs(vb[c]);
      for (int64_t k = 1; k < kCodeBlock; ++k) {
        const float x = vb[k * kNR + c];
        lo = std::min(lo, x);
        hi = std::max(hi, x);
        amax = std::max(amax, std::fabs(x));
      }
      bool found = false;
      for (int cand = 0; cand < 2 && !found; ++cand) {
        const float o = cand == 0 ? lo : 0.0f;
        const float s = to_f16_precision(cand == 0 ? (hi - lo) / 15.0f : amax / 127.0f);
        const float qmin = cand == 0 ? 0.0f : -127.0f, qmax = cand == 0 ? 15.0f : 127.0f;
        if (!std::isfinite(s) || !std::isfinite(o)) continue;
        found = true;
        for (int64_t k = 0; k < kCodeBlock && found; ++k) {
          const float x = vb[k * kNR + c];
          const float code = s == 0.0f ? 0.0f : std::clamp(std::nearbyint((x - o) / s), qmin, qmax);
          const float back = dequant_value(s, code, o);
          uint32_t bx, bb;
          std::memcpy(&bx, &x, 4);
          std::memcpy(&bb, &back, 4);
          found = bx == bb;
          q[b * kCodeBlock * kNR + k * kNR + c] = static_cast<int8_t>(code);
        }
        sc[b * kNR + c] = s;
        of[b * kNR + c] = o;
      }
      if (!found) return ffi::Error::Success();      // good[0] stays 0
    }
  }
  good[0] = 1;
#endif
  return ffi::Error::Success();
}

}  // namespace

JAXINFER_FFI_HANDLER(JaxinferF32Matmul, f) {
  auto x = f.arg<ffi::F32>(0), w = f.arg<ffi::F32>(1);
  auto y = f.ret<ffi::F32>(0);
  if (!f.ok(2, 1)) return f.error();
  return F32MatmulImpl(f.pool(), x, w, y);
}

JAXINFER_FFI_HANDLER(JaxinferF32MatmulPanels, f) {
  auto x = f.arg<ffi::F32>(0), w = f.arg<ffi::F32>(1);
  auto y = f.ret<ffi::F32>(0);
  if (!f.ok(2, 1)) return f.error();
  return F32MatmulPanelsImpl(f.pool(), x, w, y);
}

// Float32 weights or coded ones (int8 codes first: F32MatmulLayerCodesImpl).
JAXINFER_FFI_HANDLER(JaxinferF32MatmulLayer, f) {
  auto x = f.arg<ffi::F32>(0);
  auto layer = f.arg<ffi::S32>(1);
  auto y = f.ret<ffi::F32>(0);
  if (!f.ok(2, 1, /*more_args=*/true)) return f.error();
  const auto ws = f.args_from(2);
  if (ws.size() > 0 && ws.get<ffi::Buffer<ffi::S8>>(0)) return F32MatmulLayerCodesImpl(f.pool(), x, layer, ws, y);
  return F32MatmulLayerImpl(f.pool(), x, layer, ws, y);
}

JAXINFER_FFI_HANDLER(JaxinferF32MatmulCodes, f) {
  auto x = f.arg<ffi::F32>(0);
  auto codes = f.arg<ffi::S8>(1);
  auto scale = f.arg<ffi::F32>(2), offset = f.arg<ffi::F32>(3);
  auto y = f.ret<ffi::F32>(0);
  if (!f.ok(4, 1)) return f.error();
  return F32MatmulCodesImpl(f.pool(), x, codes, scale, offset, y);
}

JAXINFER_FFI_HANDLER(JaxinferCodesDequant, f) {
  auto codes = f.arg<ffi::S8>(0);
  auto scale = f.arg<ffi::F32>(1), offset = f.arg<ffi::F32>(2);
  auto y = f.ret<ffi::F32>(0);
  if (!f.ok(3, 1)) return f.error();
  return CodesDequantImpl(codes, scale, offset, y);
}

JAXINFER_FFI_HANDLER(JaxinferCodesRows, f) {
  auto tokens = f.arg<ffi::S32>(0);
  auto codes = f.arg<ffi::S8>(1);
  auto scale = f.arg<ffi::F32>(2), offset = f.arg<ffi::F32>(3);
  auto y = f.ret<ffi::F32>(0);
  if (!f.ok(4, 1)) return f.error();
  return CodesRowsImpl(tokens, codes, scale, offset, y);
}

JAXINFER_FFI_HANDLER(JaxinferCodesEncode, f) {
  auto w = f.arg<ffi::F32>(0);
  auto codes = f.ret<ffi::S8>(0);
  auto scale = f.ret<ffi::F32>(1), offset = f.ret<ffi::F32>(2);
  auto ok = f.ret<ffi::S32>(3);
  if (!f.ok(1, 4)) return f.error();
  return CodesEncodeImpl(w, codes, scale, offset, ok);
}
