// Weight-only int8 matmul for XLA:CPU, called through jax.ffi
// (pallas_kernels/quantized_matmul/cpu.py).
//
//   y[m, n] = scale[n] * sum_k x[m, k] * q[k, n]      x f32 [M, K], q int8, scale f32 [N]
//
// Why it exists: XLA:CPU converts int8 weights to f32 in memory before its dot, so int8
// weights stream no fewer bytes than f32 ones. Here only the int8 bytes are read.
//
// Two weight layouts, told apart by q's rank:
//
//  * packed, q int8 [N/32, K/2, 32, 2] (cpu.py pack; K % 64 == 0, N % 32 == 0): column
//    panels of 32 whose rows come in pairs, (q[2j, n], q[2j+1, n]) adjacent. x is
//    quantized per row and per block of 64 along K to int16 (scale max|x| / 32767), each
//    block's dot is summed exactly in int32 (vpmaddwd: int8 weights widened to int16 times
//    a pair of int16 activations), then y += float(block sum) * x_scale in block order.
//    Half the instructions per weight of converting to f32, which is what bounds a decode
//    step here (measured: the f32 form streamed ~16 GB/s where 2 cores read 29 GB/s).
//    The int16 activations cost ~1.5e-5 of each block's max: next to int8 weights' error,
//    nothing (benchmarks/quant_quality.py measures the end result).
//  * plain, q int8 [K, N] (any shape): int8 -> f32 in registers and one f32 FMA chain per
//    output, k in order.
//
// Batch invariance, by construction, both layouts: an output depends only on its own row
// of x (the activation scales are per row) and is computed in one fixed order (exact
// integer block sums, then blocks in order; or the k-ordered FMA chain), whatever M is,
// whichever rows share the call, and whichever tile or thread computes it.
//
// Work is cut in units (column tile x row block) that the caller and XLA's intra-op
// thread pool claim from one atomic counter: no thread waits for a task that has not
// started, so concurrent calls cannot deadlock the pool.
//
// x86-64 with AVX2 and FMA only (the build passes -mno-avx512f: one tested code path on
// every such CPU); elsewhere the build fails and the engine keeps XLA's path.

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
#error "the CPU int8 kernel needs x86-64 with AVX2 and FMA"
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
constexpr int64_t kInlineMacs = JAXINFER_INLINE_MACS;   // below: no helper thread
#ifndef JAXINFER_PREFETCH
#define JAXINFER_PREFETCH 2048
#endif
// packed: software prefetch this many bytes ahead of the weight stream (it runs into the
// next panel, which is next in memory). All 121 matmuls of a fused int8 decode step: 5.67
// vs 6.14 ms without (min of 15; 4096 ahead: 5.83; claiming 4 panels per unit: no gain).
constexpr int64_t kPrefetch = JAXINFER_PREFETCH;
constexpr int kBlock = 64;        // packed: K per activation scale (int32 sums cannot overflow:
                                  // 32 pairs x 2 x 32767 x 127 < 2^31)
constexpr int kPanel = 32;        // packed: columns per panel (64 bytes per row pair)
constexpr int kPackedRows = 3;    // packed: rows per register tile (12 int32 accumulators)
constexpr int kWideRows = 3;      // plain: M up to this uses the 1-row, 64-column tile
constexpr int kTileVecs = 2;      // plain, larger M: 4 rows x 16 columns
constexpr int kTileRows = 4;

// ---------------------------------------------------------------------------------------
// Packed layout, int16 activations
// ---------------------------------------------------------------------------------------

struct Packed {
  const int16_t* xq;   // [M, K] int16
  const float* xs;     // [M, K / kBlock] activation scales
  const int8_t* q;     // [N/32, K/2, 32, 2]
  const float* scale;  // [N]
  float* y;            // [M, N]
  int64_t M, K, N;
};

// Rows [m0, m0 + R) x the 32 columns of panel `panel`.
template <int R>
void packed_tile(const Packed& p, int64_t m0, int64_t panel) {
  const int64_t nb = p.K / kBlock;
  const int8_t* w = p.q + panel * (p.K / 2) * (kPanel * 2);
  __m256 facc[R][4];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) facc[r][c] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m256i acc[R][4];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < 4; ++c) acc[r][c] = _mm256_setzero_si256();
    const int8_t* wb = w + b * (kBlock / 2) * (kPanel * 2);
    for (int j = 0; j < kBlock / 2; ++j) {
      const int8_t* wj = wb + j * (kPanel * 2);          // 64 bytes: 32 columns x (k, k+1)
      if constexpr (kPrefetch > 0) _mm_prefetch(reinterpret_cast<const char*>(wj + kPrefetch), _MM_HINT_T0);
      __m256i xb[R];
      for (int r = 0; r < R; ++r) {
        int32_t pair;
        std::memcpy(&pair, p.xq + (m0 + r) * p.K + b * kBlock + 2 * j, 4);
        xb[r] = _mm256_set1_epi32(pair);
      }
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) {
        const __m256i wc =
            _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wj + 16 * c)));
        for (int r = 0; r < R; ++r)
          acc[r][c] = _mm256_add_epi32(acc[r][c], _mm256_madd_epi16(wc, xb[r]));
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m256 s = _mm256_set1_ps(p.xs[(m0 + r) * nb + b]);
      for (int c = 0; c < 4; ++c)
        facc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r][c]), s, facc[r][c]);
    }
  }
  const int64_t n0 = panel * kPanel;
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c)
      _mm256_storeu_ps(p.y + (m0 + r) * p.N + n0 + 8 * c,
                       _mm256_mul_ps(facc[r][c], _mm256_loadu_ps(p.scale + n0 + 8 * c)));
}

void packed_rows(const Packed& p, int64_t m0, int64_t rows, int64_t panel) {
  switch (rows) {
    case 1: return packed_tile<1>(p, m0, panel);
    case 2: return packed_tile<2>(p, m0, panel);
    default: return packed_tile<3>(p, m0, panel);
  }
}

// x row m, block b -> int16 values and one f32 scale (max|x| / 32767; 0 for a zero block).
void quantize_rows(const float* x, int64_t M, int64_t K, int16_t* xq, float* xs) {
  const int64_t nb = K / kBlock;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + m * K + b * kBlock;
      float amax = 0.f;
      for (int i = 0; i < kBlock; ++i) amax = std::max(amax, std::fabs(xb[i]));
      const float s = amax / 32767.f;
      const float inv = amax > 0.f ? 32767.f / amax : 0.f;
      xs[m * nb + b] = s;
      for (int i = 0; i < kBlock; ++i)
        xq[m * K + b * kBlock + i] = static_cast<int16_t>(std::lrintf(xb[i] * inv));
    }
}

// ---------------------------------------------------------------------------------------
// 4-bit panels, int16 activations (the GGUF Q4_1 scheme: w = scale * code + offset)
// ---------------------------------------------------------------------------------------
//
// q uint8 [N/32, K/4, 2, 32]: a panel's rows 4t .. 4t+3 ("quad" t) as two 32-byte vectors h;
// byte i of vector h holds, for row 4t + i%4, column 16h + i/4 in its low nibble and column
// 16h + 8 + i/4 in its high one. Codes 0..15; scale and offset f16 [N/32, K/32, 32] (per 32
// rows of a column; float16, as Q4_1 stores them). Activations as in the packed int8 path
// (int16 per row and block of 64: the same rounding, ~1.5e-5 of a block's max), split into
// bytes x = 256 * xh + xl (xh signed, xl unsigned 0..255), so vpmaddubsw multiplies a
// masked vector (8 columns x 4 rows) by each: codes x xh (u8 x s8) and xl x codes (u8 x s8),
// the 4 rows of a column in adjacent byte pairs, summed in int16 lanes (xh: a whole group,
// at most 8 quads x 2 x 15 x 128 = 30720; xl: 4 quads, at most 4 x 2 x 255 x 15 = 30600),
// then vpmaddwd by ones per column. Per 32-row group g of a row:
//   y += xs * (scale * S + offset * X)    S = sum_k xq[k] * code[k] = 256 S_h + S_l (exact
//                                         int32: |S| <= 32 x 15 x 32767 < 2^24, so exact as a
//                                         float too), X = sum_k xq[k], xs the 64-block's scale
// in group order: an output depends on its own row only (batch-invariant by construction).
// Why: half the int8 bytes a weight, and a Q4_1 checkpoint's own codes: a "self" draft
// (jaxinfer/engine/spec_draft.py) then has the target's layer weights. int8 activations (one
// vpmaddubsw a vector) ran ~10% faster but a draft with them agreed with the target on ~93%
// of tokens instead of ~98%; for one row, widening the codes to int16 for vpmaddwd cost
// ~40% more instructions than these byte halves (benchmarks/RESULTS.md, "A 4-bit draft on a
// C++ kernel"); for 2-3 rows the widened codes are shared and win (packed4_wide).

constexpr int kGroup4 = 32;       // 4-bit: K per scale / offset

struct Packed4 {
  const int16_t* xq;       // [M, K] the int16 activations (packed4_wide)
  const uint8_t* xl;       // [M, K] low bytes of the int16 activations
  const int8_t* xh;        // [M, K] high bytes
  const float* xs;         // [M, K / kBlock]
  const int32_t* xsum;     // [M, K / kGroup4]: sum of the int16 activations over each group
  const uint8_t* q;        // [N/32, K/4, 2, 32]
  const uint16_t* scale;   // f16 [N/32, K/32, 32]
  const uint16_t* offset;  // f16 [N/32, K/32, 32]
  float* y;                // [M, N]
  int64_t M, K, N;
};

inline __m256 load_f16(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// Row m0 x the 32 columns of panel `panel`.
void packed4_tile(const Packed4& p, int64_t m0, int64_t panel) {
  constexpr int R = 1;     // one row a tile (see packed4_rows)
  const int64_t ng = p.K / kGroup4, nb = p.K / kBlock;
  const uint8_t* w = p.q + panel * (p.K / 2) * kPanel;
  const uint16_t* sc = p.scale + panel * ng * kPanel;
  const uint16_t* of = p.offset + panel * ng * kPanel;
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  __m256 facc[R][4];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) facc[r][c] = _mm256_setzero_ps();
  for (int64_t g = 0; g < ng; ++g) {
    __m256i hi[R][4], lo[R][4], sum[R][4];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < 4; ++c) hi[r][c] = lo[r][c] = sum[r][c] = _mm256_setzero_si256();
    const uint8_t* wg = w + g * (kGroup4 / 2) * kPanel;
    for (int t = 0; t < kGroup4 / 4; ++t) {
      const uint8_t* wt = wg + t * 2 * kPanel;            // 64 bytes: 32 columns x 4 rows
      if constexpr (kPrefetch > 0) _mm_prefetch(reinterpret_cast<const char*>(wt + kPrefetch), _MM_HINT_T0);
      const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wt));
      const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wt + 32));
      const __m256i wc[4] = {_mm256_and_si256(v0, low), _mm256_and_si256(_mm256_srli_epi16(v0, 4), low),
                             _mm256_and_si256(v1, low), _mm256_and_si256(_mm256_srli_epi16(v1, 4), low)};
      for (int r = 0; r < R; ++r) {
        int32_t qh, ql;
        std::memcpy(&qh, p.xh + (m0 + r) * p.K + g * kGroup4 + 4 * t, 4);
        std::memcpy(&ql, p.xl + (m0 + r) * p.K + g * kGroup4 + 4 * t, 4);
        const __m256i bh = _mm256_set1_epi32(qh), bl = _mm256_set1_epi32(ql);
        for (int c = 0; c < 4; ++c) {
          hi[r][c] = _mm256_add_epi16(hi[r][c], _mm256_maddubs_epi16(wc[c], bh));
          lo[r][c] = _mm256_add_epi16(lo[r][c], _mm256_maddubs_epi16(bl, wc[c]));
        }
      }
      if (t % 4 == 3)          // the low halves' int16 lanes hold 4 quads at most
        for (int r = 0; r < R; ++r)
          for (int c = 0; c < 4; ++c) {
            sum[r][c] = _mm256_add_epi32(sum[r][c], _mm256_madd_epi16(lo[r][c], ones));
            lo[r][c] = _mm256_setzero_si256();
          }
    }
    for (int r = 0; r < R; ++r) {
      const __m256 s = _mm256_set1_ps(p.xs[(m0 + r) * nb + g * kGroup4 / kBlock]);
      const __m256 x0 = _mm256_set1_ps(static_cast<float>(p.xsum[(m0 + r) * ng + g]));
      for (int c = 0; c < 4; ++c) {
        const __m256i S = _mm256_add_epi32(_mm256_slli_epi32(_mm256_madd_epi16(hi[r][c], ones), 8), sum[r][c]);
        const __m256 t = _mm256_fmadd_ps(load_f16(of + g * kPanel + 8 * c), x0,
                                         _mm256_mul_ps(_mm256_cvtepi32_ps(S), load_f16(sc + g * kPanel + 8 * c)));
        facc[r][c] = _mm256_fmadd_ps(t, s, facc[r][c]);
      }
    }
  }
  const int64_t n0 = panel * kPanel;
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) _mm256_storeu_ps(p.y + (m0 + r) * p.N + n0 + 8 * c, facc[r][c]);
}

// Rows [m0, m0 + R) x the 32 columns of panel `panel`, for R > 1 (prefill, batches): the
// codes widened to int16 once per quad and shared by the R rows (vpmaddwd with the rows'
// int16 activations, four at a time), 16 columns per pass so R = 3 rows' accumulators fit
// the 16 registers. Each group's column sum S = sum_k xq[k] * code[k] is the same exact
// int32 as packed4_tile's byte halves (|S| < 2^24), and the float steps after it are
// packed4_tile's in the same order: the same bits as one row at a time (tested), at about
// the int8 path's cost per row instead of ~2.3x it.
template <int R>
void packed4_wide(const Packed4& p, int64_t m0, int64_t panel) {
  const int64_t ng = p.K / kGroup4, nb = p.K / kBlock;
  const uint8_t* w = p.q + panel * (p.K / 2) * kPanel;
  const uint16_t* sc = p.scale + panel * ng * kPanel;
  const uint16_t* of = p.offset + panel * ng * kPanel;
  const __m256i low = _mm256_set1_epi8(0x0F);
  for (int h = 0; h < 2; ++h) {           // columns 16h .. 16h + 15 (vector h of each quad)
    __m256 facc[R][2];
    for (int r = 0; r < R; ++r) facc[r][0] = facc[r][1] = _mm256_setzero_ps();
    for (int64_t g = 0; g < ng; ++g) {
      // acc[r][j]: int32 lanes (2c, 2c+1) = rows (4t, 4t+1) and (4t+2, 4t+3) of column 4j + c
      __m256i acc[R][4];
      for (int r = 0; r < R; ++r)
        for (int j = 0; j < 4; ++j) acc[r][j] = _mm256_setzero_si256();
      const uint8_t* wg = w + g * (kGroup4 / 2) * kPanel + 32 * h;
      for (int t = 0; t < kGroup4 / 4; ++t) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + t * 2 * kPanel));
        __m256i xb[R];
        for (int r = 0; r < R; ++r) {
          int64_t four;
          std::memcpy(&four, p.xq + (m0 + r) * p.K + g * kGroup4 + 4 * t, 8);
          xb[r] = _mm256_set1_epi64x(four);
        }
        for (int n = 0; n < 2; ++n) {     // low nibbles: columns 0..7 of the pass, high: 8..15
          const __m256i c8 = _mm256_and_si256(n ? _mm256_srli_epi16(v, 4) : v, low);
#pragma GCC unroll 2
          for (int q = 0; q < 2; ++q) {
            const __m256i wc = _mm256_cvtepu8_epi16(q ? _mm256_extracti128_si256(c8, 1) : _mm256_castsi256_si128(c8));
            for (int r = 0; r < R; ++r)
              acc[r][2 * n + q] = _mm256_add_epi32(acc[r][2 * n + q], _mm256_madd_epi16(wc, xb[r]));
          }
        }
      }
      for (int r = 0; r < R; ++r) {
        const __m256 s = _mm256_set1_ps(p.xs[(m0 + r) * nb + g * kGroup4 / kBlock]);
        const __m256 x0 = _mm256_set1_ps(static_cast<float>(p.xsum[(m0 + r) * ng + g]));
        for (int n = 0; n < 2; ++n) {
          // pairs summed: [c0 c1 c4 c5 | c2 c3 c6 c7] -> columns 8n .. 8n + 7 in order
          const __m256i S = _mm256_permute4x64_epi64(_mm256_hadd_epi32(acc[r][2 * n], acc[r][2 * n + 1]), 0xD8);
          const int c = 2 * h + n;          // packed4_tile's vector of these 8 columns
          const __m256 tt = _mm256_fmadd_ps(load_f16(of + g * kPanel + 8 * c), x0,
                                            _mm256_mul_ps(_mm256_cvtepi32_ps(S), load_f16(sc + g * kPanel + 8 * c)));
          facc[r][n] = _mm256_fmadd_ps(tt, s, facc[r][n]);
        }
      }
    }
    const int64_t n0 = panel * kPanel + 16 * h;
    for (int r = 0; r < R; ++r)
      for (int n = 0; n < 2; ++n) _mm256_storeu_ps(p.y + (m0 + r) * p.N + n0 + 8 * n, facc[r][n]);
  }
}

// One row: the byte halves (fewest instructions per weight, what decode and a draft run);
// several: the widened codes shared by the rows (same bits).
void packed4_rows(const Packed4& p, int64_t m0, int64_t rows, int64_t panel) {
  switch (rows) {
    case 1: return packed4_tile(p, m0, panel);
    case 2: return packed4_wide<2>(p, m0, panel);
    default: return packed4_wide<3>(p, m0, panel);
  }
}

// ---------------------------------------------------------------------------------------
// Plain layout, f32 activations
// ---------------------------------------------------------------------------------------

struct Plain {
  const float* x;      // [M, K]
  const int8_t* q;     // [K, N]
  const float* scale;  // [N]
  float* y;            // [M, N]
  int64_t M, K, N;
  int64_t nvec;        // columns done with vectors: N rounded down to 8
};

inline __m256 load_q8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// Rows [m0, m0 + R) x columns [n0, n0 + 8C).
template <int R, int C>
void plain_tile(const Plain& p, int64_t m0, int64_t n0) {
  __m256 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  const float* x = p.x + m0 * p.K;
  const int8_t* q = p.q + n0;
  for (int64_t k = 0; k < p.K; ++k) {
    // Every row of a tile is a new page for a wide weight: prefetch 16 rows ahead.
    __builtin_prefetch(q + (k + 16) * p.N);
    if constexpr (R == 1) {
      // Convert and use each vector at once: C accumulators + 2 fit the 16 registers.
      const __m256 xb = _mm256_set1_ps(x[k]);
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) acc[0][c] = _mm256_fmadd_ps(xb, load_q8(q + k * p.N + 8 * c), acc[0][c]);
    } else {
      __m256 w[C];
      for (int c = 0; c < C; ++c) w[c] = load_q8(q + k * p.N + 8 * c);
      for (int r = 0; r < R; ++r) {
        const __m256 xb = _mm256_set1_ps(x[r * p.K + k]);
        for (int c = 0; c < C; ++c) acc[r][c] = _mm256_fmadd_ps(xb, w[c], acc[r][c]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c)
      _mm256_storeu_ps(p.y + (m0 + r) * p.N + n0 + 8 * c,
                       _mm256_mul_ps(acc[r][c], _mm256_loadu_ps(p.scale + n0 + 8 * c)));
}

template <int R, int CMax = 8>
void plain_cols(const Plain& p, int64_t m0, int64_t n0, int64_t cvecs) {
  if (cvecs == CMax) return plain_tile<R, CMax>(p, m0, n0);
  if constexpr (CMax > 1) plain_cols<R, CMax - 1>(p, m0, n0, cvecs);
}

template <int RMax = kTileRows>
void plain_rows(const Plain& p, int64_t m0, int64_t rows, int64_t n0, int64_t cvecs) {
  if (rows == RMax) return plain_cols<RMax, kTileVecs>(p, m0, n0, cvecs);
  if constexpr (RMax > 1) plain_rows<RMax - 1>(p, m0, rows, n0, cvecs);
}

// Scalar tail columns [nvec, N): the same k-ordered fma chain.
void plain_tail(const Plain& p) {
  for (int64_t m = 0; m < p.M; ++m)
    for (int64_t n = p.nvec; n < p.N; ++n) {
      float acc = 0.f;
      for (int64_t k = 0; k < p.K; ++k)
        acc = std::fma(p.x[m * p.K + k], static_cast<float>(p.q[k * p.N + n]), acc);
      p.y[m * p.N + n] = acc * p.scale[n];
    }
}

// ---------------------------------------------------------------------------------------
// The FFI handler (work shared over XLA's pool: work_share.h)
// ---------------------------------------------------------------------------------------

// The packed layouts' work: units of (up to kPackedRows rows) x (one 32-column panel), row
// blocks varying fastest so consecutive units share a panel's weights in cache;
// tile(m0, rows, panel) computes one.
template <class Tile>
void share_panel_units(ffi::ThreadPool& pool, int64_t M, int64_t K, int64_t N, Tile tile) {
  auto work = std::make_shared<Work>();
  const int64_t row_units = (M + kPackedRows - 1) / kPackedRows;
  work->units = row_units * (N / kPanel);
  work->run = [tile, M, row_units](int64_t u) {
    const int64_t m0 = (u % row_units) * kPackedRows;
    tile(m0, std::min<int64_t>(kPackedRows, M - m0), u / row_units);
  };
  share(pool, work, M * K * N, kInlineMacs);
}

ffi::Error Int8MatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                          ffi::AnyBuffer q, ffi::Buffer<ffi::F32> scale,
                          ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), qd = q.dimensions();
  if (q.element_type() != ffi::DataType::S8)
    return ffi::Error::InvalidArgument("int8_matmul: q must be int8");
  if (xd.size() != 2 || (qd.size() != 2 && qd.size() != 4) || scale.dimensions().size() != 1)
    return ffi::Error::InvalidArgument(
        "int8_matmul: expected x [M, K], q [K, N] or [N/32, K/2, 32, 2], scale [N]");
  const int64_t M = xd[0], K = xd[1];
  const bool packed = qd.size() == 4;
  const int64_t N = packed ? qd[0] * kPanel : qd[1];
  const bool ok = packed ? (qd[1] * 2 == K && qd[2] == kPanel && qd[3] == 2 && K % kBlock == 0)
                         : qd[0] == K;
  if (!ok || scale.dimensions()[0] != N)
    return ffi::Error::InvalidArgument("int8_matmul: shapes of x, q and scale disagree");
  if (M == 0 || N == 0) return ffi::Error::Success();
  const int8_t* qp = reinterpret_cast<const int8_t*>(q.untyped_data());
  auto work = std::make_shared<Work>();

  if (packed) {
    std::vector<int16_t> xq(M * K);
    std::vector<float> xs(M * (K / kBlock));
    quantize_rows(x.typed_data(), M, K, xq.data(), xs.data());
    const Packed p{xq.data(), xs.data(), qp, scale.typed_data(), y->typed_data(), M, K, N};
    share_panel_units(pool, M, K, N, [p](int64_t m0, int64_t rows, int64_t panel) { packed_rows(p, m0, rows, panel); });
    return ffi::Error::Success();
  }

  const Plain p{x.typed_data(), qp, scale.typed_data(), y->typed_data(), M, K, N, N / 8 * 8};
  if (M <= kWideRows) {           // 64-column tiles, one row at a time
    work->units = (p.nvec + 63) / 64;
    work->run = [p](int64_t u) {
      const int64_t n0 = u * 64, cvecs = std::min<int64_t>(8, (p.nvec - n0) / 8);
      for (int64_t m = 0; m < p.M; ++m) plain_cols<1>(p, m, n0, cvecs);
    };
  } else {
    const int64_t row_units = (M + kTileRows - 1) / kTileRows;
    work->units = row_units * ((p.nvec + 8 * kTileVecs - 1) / (8 * kTileVecs));
    work->run = [p, row_units](int64_t u) {
      const int64_t n0 = (u / row_units) * 8 * kTileVecs, m0 = (u % row_units) * kTileRows;
      plain_rows(p, m0, std::min<int64_t>(kTileRows, p.M - m0), n0,
                 std::min<int64_t>(kTileVecs, (p.nvec - n0) / 8));
    };
  }
  share(pool, work, M * K * N, kInlineMacs);
  plain_tail(p);
  return ffi::Error::Success();
}

// One layer's weight out of every layer's (the layer loop: benchmarks/layer_loop_probe.py):
// operands x [M, K], layer i32[1], then q_0 .. q_{L-1} and scale_0 .. scale_{L-1}, or the
// two stacks q [L, ...] and scale [L, N] (RemainingArgs::layer); picks the pair by pointer
// (no slice, no copy inside lax.fori_loop), the same bits as above.
ffi::Error Int8MatmulLayerImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> layer,
                               ffi::RemainingArgs ws, ffi::ResultBuffer<ffi::F32> y) {
  if (layer.element_count() != 1 || ws.size() % 2)
    return ffi::Error::InvalidArgument("int8_matmul_layer: expected one i32 layer and (q, scale) per layer");
  const int64_t l = layer.typed_data()[0];
  XLA_FFI_Buffer qv, sv;
  auto q = ws.layer<ffi::AnyBuffer>(0, 2, l, qv);
  auto scale = ws.layer<ffi::Buffer<ffi::F32>>(1, 2, l, sv);
  if (!q.has_value() || !scale.has_value())
    return ffi::Error::InvalidArgument("int8_matmul_layer: layer index out of range, or not int8 q and float32 scales");
  return Int8MatmulImpl(pool, x, *q, *scale, y);
}

// x [M, K] @ a 4-bit panelled weight: codes int8 [N/32, K/4, 2, 32] (bytes of two nibbles),
// scale and offset f16 [N/32, K/32, 32].
ffi::Error Int4MatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> q,
                          ffi::Buffer<ffi::F16> scale, ffi::Buffer<ffi::F16> offset,
                          ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), qd = q.dimensions(), sd = scale.dimensions(), od = offset.dimensions();
  if (xd.size() != 2 || qd.size() != 4 || qd[2] != 2 || qd[3] != kPanel)
    return ffi::Error::InvalidArgument("int4_matmul: expected x [M, K] and q int8 [N/32, K/4, 2, 32]");
  const int64_t M = xd[0], K = xd[1], N = qd[0] * kPanel;
  if (qd[1] * 4 != K || K % kBlock)
    return ffi::Error::InvalidArgument("int4_matmul: x [M, K] and q [N/32, K/4, 2, 32] disagree on K, or K % 64");
  if (sd.size() != 3 || sd[0] != qd[0] || sd[1] != K / kGroup4 || sd[2] != kPanel ||
      od.size() != 3 || od[0] != sd[0] || od[1] != sd[1] || od[2] != sd[2])
    return ffi::Error::InvalidArgument("int4_matmul: scale and offset must be f16 [N/32, K/32, 32]");
  if (M == 0 || N == 0) return ffi::Error::Success();
  std::vector<int16_t> xq(M * K);
  std::vector<float> xs(M * (K / kBlock));
  std::vector<int32_t> xsum(M * (K / kGroup4));
  std::vector<uint8_t> xl(M * K);
  std::vector<int8_t> xh(M * K);
  quantize_rows(x.typed_data(), M, K, xq.data(), xs.data());
  for (int64_t i = 0; i < M * K; ++i) {     // x = 256 * xh + xl, xl unsigned
    xl[i] = static_cast<uint8_t>(xq[i] & 0xFF);
    xh[i] = static_cast<int8_t>(xq[i] >> 8);
  }
  for (int64_t i = 0; i < M * (K / kGroup4); ++i) {   // K % 32 == 0: group i of the flat rows
    int32_t t = 0;
    for (int k = 0; k < kGroup4; ++k) t += xq[i * kGroup4 + k];
    xsum[i] = t;
  }
  const Packed4 p{xq.data(), xl.data(), xh.data(), xs.data(), xsum.data(), reinterpret_cast<const uint8_t*>(q.typed_data()),
                  scale.typed_data(), offset.typed_data(), y->typed_data(), M, K, N};
  share_panel_units(pool, M, K, N, [p](int64_t m0, int64_t rows, int64_t panel) { packed4_rows(p, m0, rows, panel); });
  return ffi::Error::Success();
}

// The layer loop's form: x, layer i32[1], then q_0 .. q_{L-1}, scale_0 .., offset_0 ..
// (3L operands) or the three stacks; picks layer l's by pointer, the same bits as above.
ffi::Error Int4MatmulLayerImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> layer,
                               ffi::RemainingArgs ws, ffi::ResultBuffer<ffi::F32> y) {
  if (layer.element_count() != 1 || ws.size() % 3)
    return ffi::Error::InvalidArgument("int4_matmul_layer: expected one i32 layer and (q, scale, offset) per layer");
  const int64_t l = layer.typed_data()[0];
  XLA_FFI_Buffer qv, sv, ov;
  auto q = ws.layer<ffi::Buffer<ffi::S8>>(0, 3, l, qv);
  auto scale = ws.layer<ffi::Buffer<ffi::F16>>(1, 3, l, sv);
  auto offset = ws.layer<ffi::Buffer<ffi::F16>>(2, 3, l, ov);
  if (!q.has_value() || !scale.has_value() || !offset.has_value())
    return ffi::Error::InvalidArgument("int4_matmul_layer: layer index out of range, or not int8 q and float16 scale / offset");
  return Int4MatmulImpl(pool, x, *q, *scale, *offset, y);
}

}  // namespace

JAXINFER_FFI_HANDLER(JaxinferInt8Matmul, f) {
  auto x = f.arg<ffi::F32>(0);
  auto q = f.any_arg(1);
  auto scale = f.arg<ffi::F32>(2);
  auto y = f.ret<ffi::F32>(0);
  if (!f.ok(3, 1)) return f.error();
  return Int8MatmulImpl(f.pool(), x, q, scale, y);
}

JAXINFER_FFI_HANDLER(JaxinferInt8MatmulLayer, f) {
  auto x = f.arg<ffi::F32>(0);
  auto layer = f.arg<ffi::S32>(1);
  auto y = f.ret<ffi::F32>(0);
  if (!f.ok(2, 1, /*more_args=*/true)) return f.error();
  return Int8MatmulLayerImpl(f.pool(), x, layer, f.args_from(2), y);
}

JAXINFER_FFI_HANDLER(JaxinferInt4Matmul, f) {
  auto x = f.arg<ffi::F32>(0);
  auto q = f.arg<ffi::S8>(1);
  auto scale = f.arg<ffi::F16>(2);
  auto offset = f.arg<ffi::F16>(3);
  auto y = f.ret<ffi::F32>(0);
  if (!f.ok(4, 1)) return f.error();
  return Int4MatmulImpl(f.pool(), x, q, scale, offset, y);
}

JAXINFER_FFI_HANDLER(JaxinferInt4MatmulLayer, f) {
  auto x = f.arg<ffi::F32>(0);
  auto layer = f.arg<ffi::S32>(1);
  auto y = f.ret<ffi::F32>(0);
  if (!f.ok(2, 1, /*more_args=*/true)) return f.error();
  return Int4MatmulLayerImpl(f.pool(), x, layer, f.args_from(2), y);
}
