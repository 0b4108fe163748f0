// Ragged paged attention for XLA:CPU, called through jax.ffi (pallas_kernels/attention/cpu.py).
//
// The same step layout and meaning as pallas_kernels/attention/xla.py::ragged_paged_attention:
// q [T, H, D] holds `num_decode` one-token slots, then slots of `prefill_chunk` rows;
// slot s's query j sits at position kv_lens[s] - q_lens[s] + j and attends to KV
// positions [lo, pos] (lo = pos - sliding_window + 1 with a window, else 0) of its pages
// k_pages / v_pages [N, page_size, KVH, D] through page_table [S, P]. Query head h reads
// KV head h / (H / KVH). Rows past q_len and unused slots give exact zeros.
//
// Why it exists: XLA:CPU runs the jnp version as a while loop over 64-token KV blocks,
// each block a page gather (a copy) plus small batched dots: 3-5 ms of a 15-18 ms int8
// batch-1 decode step (benchmarks/decode_breakdown.py), and ~5 ms per layer at 32
// sequences. Here K and V are read in place, once, through the page table.
//
// Batch invariance, by construction: each (query row, head) is computed by one thread in
// one fixed order that depends only on that row's q, its position and its sequence's K/V:
//   scores  s_i = (q . k_i) * sm_scale, i = lo..pos (each dot: 8 lanes over D in order,
//           then one fixed horizontal tree); optional soft cap c * tanh(s / c); optional
//           ALiBi (BLOOM / MPT): s_i += slope[h] * (i - pos)
//   m = max s_i; p_i = exp(s_i - m) (one vector exp); l = sum p_i (lane i - lo mod 8,
//           in order, then the fixed tree); out = (sum_i p_i v_i, i in order) / l.
// Nothing depends on the batch, the bucket, the page size, the slot kind (decode or
// prefill) or the chunking of a prompt. (The numbers differ slightly from xla.py's
// blocked online softmax, so the engine uses one or the other, never both in one run.)
//
// KV pages float32, or int8 with one f32 scale per token and KV head
// (jaxinfer/engine/kv_cache.py QuantizedPages): a unit first dequantizes the rows it reads,
// x = float(q) * scale (one rounding, as QuantizedPages.dequantize), into its thread's
// buffer, then runs the same code: int8 pages give exactly the bits float32 pages holding
// the dequantized values give.
//
// x86-64 with AVX2 and FMA only (built with -mno-avx512f).

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <thread>
#include <vector>

#if !defined(__AVX2__) || !defined(__FMA__)
#error "the CPU attention kernel needs x86-64 with AVX2 and FMA"
#endif
#include <immintrin.h>

#include "ffi_lite.h"
#include "work_share.h"

namespace ffi = jaxinfer_ffi;

namespace {

constexpr int64_t kQueryBlock = 16;        // prefill rows per work unit (share a pointer table)
constexpr int64_t kInlineMacs = 1 << 17;   // below: no helper thread (waking one costs us)
constexpr int64_t kKeyBlock = 64;          // keys per block: 64 x D=64 x 4 B = 16 KB of K in L1

// exp for x <= 0 (Cephes' single-precision polynomial; ~1 ulp). exp(-88.4) and below -> 0.
inline __m256 exp_ps(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-88.3762626647949f);
  x = _mm256_max_ps(x, lo);
  __m256 fx = _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f));
  fx = _mm256_floor_ps(fx);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500E-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894E-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459E-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201E-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.f)));
  __m256i e = _mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127));
  e = _mm256_max_epi32(e, _mm256_setzero_si256());          // 2^-127 and below -> 0
  return _mm256_mul_ps(y, _mm256_castsi256_ps(_mm256_slli_epi32(e, 23)));
}

// Lane sums of 8 vectors a[0..8) -> one vector (r[i] = sum of a[i]'s lanes), each in the
// same fixed tree ((l0+l1)+(l2+l3)) + ((l4+l5)+(l6+l7)): 9 instructions for 8 sums.
inline __m256 hsum8(const __m256* a) {
  const __m256 ab = _mm256_hadd_ps(a[0], a[1]), cd = _mm256_hadd_ps(a[2], a[3]);
  const __m256 ef = _mm256_hadd_ps(a[4], a[5]), gh = _mm256_hadd_ps(a[6], a[7]);
  const __m256 abcd = _mm256_hadd_ps(ab, cd), efgh = _mm256_hadd_ps(ef, gh);
  // abcd = [A_lo B_lo C_lo D_lo | A_hi B_hi C_hi D_hi] (lo: lanes 0-3, hi: lanes 4-7)
  return _mm256_add_ps(_mm256_permute2f128_ps(abcd, efgh, 0x20),
                       _mm256_permute2f128_ps(abcd, efgh, 0x31));
}

struct Args {
  const float* q;          // [T, H, D]
  const float* k;          // [N, ps, KVH, D] float32 pages (nullptr with int8 pages)
  const float* v;
  const int8_t* kq;        // [N, ps, KVH, D] int8 pages (nullptr with float32 pages)
  const int8_t* vq;
  const float* ks;         // [N, ps, KVH] their scales
  const float* vs;
  const int32_t* kv_lens;  // [S]
  const int32_t* q_lens;   // [S]
  const int32_t* pt;       // [S, P]
  float* out;              // [T, H, D]
  int64_t T, H, D, N, ps, KVH, S, P, num_decode, chunk;
  float sm_scale;
  int64_t window;          // 0: none
  float soft_cap;          // 0: none
  const float* alibi;      // [H] slopes; nullptr: none
};

// Scores of one query row against keys krow[0..n): s[i] = (q . k_i) * scale, eight keys
// at a time, each key its own accumulator (8 lanes over D in order, then hsum8's tree).
// A tail group reuses krow[0] for its missing keys and drops those results, so every
// score comes from the same instructions wherever it falls.
void scores(const float* q, const float* const* krow, int64_t n, int64_t D, float scale,
            float* s) {
  const __m256 sv = _mm256_set1_ps(scale);
  for (int64_t i = 0; i < n; i += 8) {
    const float* k[8];
    for (int c = 0; c < 8; ++c) k[c] = krow[i + c < n ? i + c : 0];
    __m256 a[8];
    for (int c = 0; c < 8; ++c) a[c] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
      const __m256 qv = _mm256_loadu_ps(q + d);
#pragma GCC unroll 8
      for (int c = 0; c < 8; ++c) a[c] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[c] + d), a[c]);
    }
    const __m256 r = _mm256_mul_ps(hsum8(a), sv);
    if (i + 8 <= n) {
      _mm256_storeu_ps(s + i, r);
    } else {
      alignas(32) float t[8];
      _mm256_store_ps(t, r);
      std::memcpy(s + i, t, (n - i) * sizeof(float));
    }
  }
}

// In place: s[0..n) -> p_i = exp(s_i - max); returns l = sum p_i (fixed order, see header).
float softmax_numerators(float* s, int64_t n, float soft_cap) {
  if (soft_cap > 0.f)
    for (int64_t i = 0; i < n; ++i) s[i] = soft_cap * std::tanh(s[i] / soft_cap);
  // the max is exact in any order: 8 lanes, then across them
  __m256 mx = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t i0 = 0;
  for (; i0 + 8 <= n; i0 += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(s + i0));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, mx);
  float m = lanes[0];
  for (int c = 1; c < 8; ++c) m = std::max(m, lanes[c]);
  for (; i0 < n; ++i0) m = std::max(m, s[i0]);
  const __m256 mv = _mm256_set1_ps(m);
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 p = exp_ps(_mm256_sub_ps(_mm256_loadu_ps(s + i), mv));
    _mm256_storeu_ps(s + i, p);
    acc = _mm256_add_ps(acc, p);
  }
  if (i < n) {                                   // tail lanes hold exact zeros
    alignas(32) float t[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    std::memcpy(t, s + i, (n - i) * sizeof(float));
    __m256 p = exp_ps(_mm256_sub_ps(_mm256_load_ps(t), mv));
    const __m256 live = _mm256_cmp_ps(_mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7),
                                      _mm256_set1_ps(static_cast<float>(n - i)), _CMP_LT_OQ);
    p = _mm256_and_ps(p, live);
    _mm256_store_ps(t, p);
    std::memcpy(s + i, t, (n - i) * sizeof(float));
    acc = _mm256_add_ps(acc, p);
  }
  __m256 a8[8] = {acc, acc, acc, acc, acc, acc, acc, acc};
  return _mm256_cvtss_f32(hsum8(a8));
}

// acc[0..D) += sum_i p[i] * v_i, i in order (acc starts at zeros: the running sum is
// stored between key blocks, which changes no bits); D in chunks of up to 64 (8 registers).
void weighted_values(const float* p, const float* const* vrow, int64_t n, int64_t D,
                     float* acc_mem) {
  for (int64_t d0 = 0; d0 < D; d0 += 64) {
    const int64_t nv = std::min<int64_t>(8, (D - d0) / 8);
    __m256 acc[8];
    for (int64_t c = 0; c < nv; ++c) acc[c] = _mm256_loadu_ps(acc_mem + d0 + 8 * c);
    if (nv == 8) {
      for (int64_t i = 0; i < n; ++i) {
        const __m256 pi = _mm256_set1_ps(p[i]);
        const float* vi = vrow[i] + d0;
#pragma GCC unroll 8
        for (int c = 0; c < 8; ++c) acc[c] = _mm256_fmadd_ps(pi, _mm256_loadu_ps(vi + 8 * c), acc[c]);
      }
    } else {
      for (int64_t i = 0; i < n; ++i) {
        const __m256 pi = _mm256_set1_ps(p[i]);
        const float* vi = vrow[i] + d0;
        for (int64_t c = 0; c < nv; ++c) acc[c] = _mm256_fmadd_ps(pi, _mm256_loadu_ps(vi + 8 * c), acc[c]);
      }
    }
    for (int64_t c = 0; c < nv; ++c) _mm256_storeu_ps(acc_mem + d0 + 8 * c, acc[c]);
  }
}

// dst[0..D) = float(src[d]) * scale: one int8 KV row dequantized (D a multiple of 8).
inline void dequant_row(const int8_t* src, float scale, float* dst, int64_t D) {
  const __m256 sv = _mm256_set1_ps(scale);
  for (int64_t d = 0; d < D; d += 8) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + d));
    _mm256_storeu_ps(dst + d, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), sv));
  }
}

struct Scratch {
  std::vector<const float*> krow, vrow;
  std::vector<float> kbuf, vbuf;   // int8 pages: the unit's rows dequantized [npos - lo0, D]
  std::vector<float> s;   // [G, npos + 8] scores, then softmax numerators
  std::vector<float> l;   // [G] softmax denominators
};

// One unit: slot `slot`, its query rows [j0, j1), KV head `kvh`. Returns false on a page
// index outside [0, N).
bool run_unit(const Args& a, int64_t slot, int64_t j0, int64_t j1, int64_t kvh, Scratch& w) {
  const int64_t G = a.H / a.KVH, D = a.D;
  const int64_t q_len = a.q_lens[slot], kv_len = a.kv_lens[slot];
  const int64_t row0 = slot < a.num_decode ? slot : a.num_decode + (slot - a.num_decode) * a.chunk;
  const int64_t live_end = std::min(j1, q_len);
  // Rows past q_len: zeros.
  for (int64_t j = std::max(j0, live_end); j < j1; ++j)
    for (int64_t g = 0; g < G; ++g)
      std::memset(a.out + ((row0 + j) * a.H + kvh * G + g) * D, 0, D * sizeof(float));
  if (j0 >= live_end) return true;
  // Key / value row pointers for positions [0, last pos of the block], walked page by page.
  const int64_t npos = kv_len - q_len + live_end;
  w.krow.resize(npos + 4);
  w.vrow.resize(npos + 4);
  const int32_t* pt = a.pt + slot * a.P;
  const int64_t row_stride = a.KVH * D, page_stride = a.ps * row_stride;
  // int8 pages: rows from lo0 (the block's first row's window start; later rows start no
  // earlier) are dequantized into kbuf / vbuf and the row pointers point there.
  const bool q8 = a.kq != nullptr;
  const int64_t pos0 = kv_len - q_len + j0;
  const int64_t lo0 = q8 && a.window > 0 ? std::max<int64_t>(0, pos0 - a.window + 1) : 0;
  if (q8) {
    w.kbuf.resize((npos - lo0) * D);
    w.vbuf.resize((npos - lo0) * D);
  }
  for (int64_t i = 0, pg = 0; i < npos; ++pg) {
    const int64_t page = pt[pg];
    if (page < 0 || page >= a.N) return false;
    const int64_t base = page * page_stride + kvh * D;
    for (int64_t o = 0; o < a.ps && i < npos; ++o, ++i) {
      if (!q8) {
        w.krow[i] = a.k + base + o * row_stride;
        w.vrow[i] = a.v + base + o * row_stride;
      } else if (i >= lo0) {
        const int64_t scale_at = (page * a.ps + o) * a.KVH + kvh;
        float* kd = w.kbuf.data() + (i - lo0) * D;
        float* vd = w.vbuf.data() + (i - lo0) * D;
        dequant_row(a.kq + base + o * row_stride, a.ks[scale_at], kd, D);
        dequant_row(a.vq + base + o * row_stride, a.vs[scale_at], vd, D);
        w.krow[i] = kd;
        w.vrow[i] = vd;
      }
    }
  }
  // Per row, the G query heads that share this KV head go through the keys together in
  // blocks of kKeyBlock, so each block of K (then V) is read from memory once, not G times.
  w.s.resize(G * (npos + 8));
  w.l.resize(G);
  for (int64_t j = j0; j < live_end; ++j) {
    const int64_t pos = kv_len - q_len + j;
    const int64_t lo = a.window > 0 ? std::max<int64_t>(0, pos - a.window + 1) : 0;
    const int64_t n = pos - lo + 1;
    const float* q0 = a.q + ((row0 + j) * a.H + kvh * G) * D;    // G heads, adjacent
    float* o0 = a.out + ((row0 + j) * a.H + kvh * G) * D;
    for (int64_t b = 0; b < n; b += kKeyBlock)
      for (int64_t g = 0; g < G; ++g)
        scores(q0 + g * D, w.krow.data() + lo + b, std::min(kKeyBlock, n - b), D, a.sm_scale,
               w.s.data() + g * (npos + 8) + b);
    if (a.alibi)                                  // per-row: the batch never enters
      for (int64_t g = 0; g < G; ++g) {
        const float slope = a.alibi[kvh * G + g];
        float* s = w.s.data() + g * (npos + 8);
        for (int64_t i = 0; i < n; ++i) s[i] += slope * static_cast<float>(lo + i - pos);
      }
    for (int64_t g = 0; g < G; ++g) w.l[g] = softmax_numerators(w.s.data() + g * (npos + 8), n, a.soft_cap);
    std::memset(o0, 0, G * D * sizeof(float));
    for (int64_t b = 0; b < n; b += kKeyBlock)
      for (int64_t g = 0; g < G; ++g)
        weighted_values(w.s.data() + g * (npos + 8) + b, w.vrow.data() + lo + b,
                        std::min(kKeyBlock, n - b), D, o0 + g * D);
    for (int64_t g = 0; g < G; ++g) {
      const __m256 lv = _mm256_set1_ps(w.l[g]);
      for (int64_t d = 0; d < D; d += 8)
        _mm256_storeu_ps(o0 + g * D + d, _mm256_div_ps(_mm256_loadu_ps(o0 + g * D + d), lv));
    }
  }
  return true;
}

// One layer's KV pages: K and V float32 [N, ps, KVH, D], or int8 values of that shape with
// f32 scales ks, vs [N, ps, KVH] (q8).
struct Pages {
  ffi::AnyBuffer k, v, ks, vs;
  bool q8 = false;
};

// Pages out of operands: (K, V) float32, or (Kq, Vq, Ks, Vs) int8 + f32; none if the
// dtypes are neither.
std::optional<Pages> pages_of(ffi::AnyBuffer k, ffi::AnyBuffer v, std::optional<ffi::AnyBuffer> ks = {},
                              std::optional<ffi::AnyBuffer> vs = {}) {
  if (k.element_type() == ffi::F32 && v.element_type() == ffi::F32 && !ks && !vs) return Pages{k, v, ffi::AnyBuffer(), ffi::AnyBuffer(), false};
  if (k.element_type() == ffi::S8 && v.element_type() == ffi::S8 && ks && vs &&
      ks->element_type() == ffi::F32 && vs->element_type() == ffi::F32)
    return Pages{k, v, *ks, *vs, true};
  return std::nullopt;
}

ffi::Error AttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, const Pages& pages,
                         ffi::Buffer<ffi::S32> kv_lens,
                         ffi::Buffer<ffi::S32> q_lens, ffi::Buffer<ffi::S32> page_table,
                         ffi::Buffer<ffi::F32> alibi_slopes,
                         int64_t num_decode, int64_t prefill_chunk, float sm_scale,
                         int64_t sliding_window, float soft_cap,
                         ffi::ResultBuffer<ffi::F32> out) {
  const auto qd = q.dimensions(), kd = pages.k.dimensions(), ptd = page_table.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || ptd.size() != 2 || pages.v.element_count() != pages.k.element_count())
    return ffi::Error::InvalidArgument("paged_attention: expected q [T, H, D], pages [N, ps, KVH, D], "
                                       "page_table [S, P]");
  if (pages.q8) {
    const auto sd = pages.ks.dimensions();
    if (sd.size() != 3 || sd[0] != kd[0] || sd[1] != kd[1] || sd[2] != kd[2] ||
        pages.vs.element_count() != pages.ks.element_count())
      return ffi::Error::InvalidArgument("paged_attention: int8 pages' scales must be [N, ps, KVH]");
  }
  const auto f32 = [&](const ffi::AnyBuffer& b) { return pages.q8 ? nullptr : static_cast<const float*>(b.untyped_data()); };
  const auto s8 = [&](const ffi::AnyBuffer& b) { return pages.q8 ? static_cast<const int8_t*>(b.untyped_data()) : nullptr; };
  const auto sc = [&](const ffi::AnyBuffer& b) { return pages.q8 ? static_cast<const float*>(b.untyped_data()) : nullptr; };
  Args a{q.typed_data(), f32(pages.k), f32(pages.v), s8(pages.k), s8(pages.v), sc(pages.ks), sc(pages.vs),
         kv_lens.typed_data(), q_lens.typed_data(),
         page_table.typed_data(), out->typed_data(), qd[0], qd[1], qd[2], kd[0], kd[1], kd[2],
         ptd[0], ptd[1], num_decode, prefill_chunk, sm_scale, sliding_window, soft_cap,
         alibi_slopes.element_count() ? alibi_slopes.typed_data() : nullptr};
  if (a.alibi && alibi_slopes.element_count() != static_cast<size_t>(a.H))
    return ffi::Error::InvalidArgument("paged_attention: alibi_slopes must hold one slope per query head");
  if (kd[3] != a.D || a.D % 8 || a.H % a.KVH || a.T != a.num_decode + (a.S - a.num_decode) * a.chunk)
    return ffi::Error::InvalidArgument("paged_attention: shapes disagree (D must be a multiple of 8)");
  int64_t macs = 0;
  for (int64_t s = 0; s < a.S; ++s) {
    const int64_t ql = a.q_lens[s], kl = a.kv_lens[s];
    if (ql < 0 || ql > (s < a.num_decode ? 1 : a.chunk) || kl < ql || kl > a.P * a.ps)
      return ffi::Error::InvalidArgument("paged_attention: a q_len / kv_len is out of range");
    macs += ql * kl;
  }
  macs *= 2 * a.H * a.D;
  // Units: decode slots one each, prefill slots in blocks of kQueryBlock rows; x KVH.
  const int64_t qblocks = (a.chunk + kQueryBlock - 1) / kQueryBlock;
  const int64_t slot_units = a.num_decode + (a.S - a.num_decode) * qblocks;
  auto work = std::make_shared<jaxinfer_cpu::Work>();
  auto failed = std::make_shared<std::atomic<bool>>(false);
  work->units = slot_units * a.KVH;
  work->run = [a, qblocks, failed](int64_t u) {
    thread_local Scratch scratch;
    const int64_t su = u / a.KVH, kvh = u % a.KVH;
    bool ok;
    if (su < a.num_decode) {
      ok = run_unit(a, su, 0, 1, kvh, scratch);
    } else {
      const int64_t p = su - a.num_decode, slot = a.num_decode + p / qblocks;
      const int64_t j0 = (p % qblocks) * kQueryBlock;
      ok = run_unit(a, slot, j0, std::min(a.chunk, j0 + kQueryBlock), kvh, scratch);
    }
    if (!ok) failed->store(true, std::memory_order_relaxed);
  };
  jaxinfer_cpu::share(pool, work, macs, kInlineMacs);
  if (failed->load()) return ffi::Error::InvalidArgument("paged_attention: a page index is out of range");
  return ffi::Error::Success();
}

// The layer loop's forms (benchmarks/layer_loop_probe.py): every layer's pages of a kind
// (K, V; int8: Kq, Vq, Ks, Vs) come either as L operands K_0 .. K_{L-1} or as one stacked
// [L, N, ...] operand (jaxinfer/engine/kv_cache.py StackedKV: one operand instead of L, so
// XLA's loop carries a handful of buffers), and a traced layer index picks layer l by pointer
// (ffi_lite.h RemainingArgs::layer), so inside lax.fori_loop no page array is sliced or copied.
ffi::Error AttentionLayerImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::S32> layer,
                              ffi::Buffer<ffi::S32> kv_lens, ffi::Buffer<ffi::S32> q_lens,
                              ffi::Buffer<ffi::S32> page_table, ffi::Buffer<ffi::F32> alibi_slopes,
                              ffi::RemainingArgs pages, int64_t num_decode, int64_t prefill_chunk,
                              float sm_scale, int64_t sliding_window, float soft_cap,
                              ffi::ResultBuffer<ffi::F32> out) {
  const auto first = pages.get<ffi::AnyBuffer>(0);
  const size_t kinds = first && first->element_type() == ffi::S8 ? 4 : 2;
  if (layer.element_count() != 1 || pages.size() == 0 || pages.size() % kinds)
    return ffi::Error::InvalidArgument("paged_attention_layer: expected one i32 layer and K, V pages per layer "
                                       "(int8: and their scales)");
  const int64_t l = layer.typed_data()[0];
  XLA_FFI_Buffer views[4];
  std::optional<ffi::AnyBuffer> at[4];
  for (size_t i = 0; i < kinds; ++i)
    if (!(at[i] = pages.layer<ffi::AnyBuffer>(i, kinds, l, views[i])))
      return ffi::Error::InvalidArgument("paged_attention_layer: layer index out of range");
  const auto p = kinds == 2 ? pages_of(*at[0], *at[1]) : pages_of(*at[0], *at[1], at[2], at[3]);
  if (!p) return ffi::Error::InvalidArgument("paged_attention_layer: pages must be float32, or int8 with f32 scales");
  return AttentionImpl(pool, q, *p, kv_lens, q_lens, page_table, alibi_slopes, num_decode,
                       prefill_chunk, sm_scale, sliding_window, soft_cap, out);
}

// This step's K/V rows into layer ``layer``'s pages, in place: operands layer i32[1],
// slots i32[T] (page * page_size + offset), then the new rows and every layer's pages:
// float32: k_new, v_new [T, KVH, D], then K and V pages [N, page_size, KVH, D] (L operands
// each, or one stacked [L, N, ...]); int8 (jaxinfer/engine/kv_cache.py QuantizedPages,
// quantized by the caller): kq_new, vq_new s8[T, KVH, D], ks_new, vs_new f32[T, KVH], then
// Kq, Vq, Ks, Vs (scales [N, page_size, KVH]). Results: the same page arrays, each aliased
// to its operand (the caller's input_output_aliases), so only the chosen layer's rows change.
ffi::Error KvWriteLayerImpl(ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> slots,
                            ffi::RemainingArgs rest, ffi::RemainingRets outs) {
  const auto first = rest.get<ffi::AnyBuffer>(0);
  const size_t kinds = first && first->element_type() == ffi::S8 ? 4 : 2;   // new rows = page kinds
  const auto pages = rest.skip(kinds);
  if (layer.element_count() != 1 || rest.size() <= kinds || pages.size() % kinds || outs.size() != pages.size())
    return ffi::Error::InvalidArgument("kv_write_layer: expected one i32 layer, the new rows and K, V pages per "
                                       "layer (int8: and their scales), aliased");
  const int64_t l = layer.typed_data()[0];
  const int64_t T = slots.element_count();
  for (size_t side = 0; side < kinds; ++side) {
    XLA_FFI_Buffer in_view, res_view;
    const auto rows = rest.get<ffi::AnyBuffer>(side);
    const auto in = pages.layer<ffi::AnyBuffer>(side, kinds, l, in_view);
    const auto res = outs.layer<ffi::AnyBuffer>(side, kinds, l, res_view);
    if (!in || !res) return ffi::Error::InvalidArgument("kv_write_layer: layer index out of range");
    if (!rows) return ffi::Error::InvalidArgument("kv_write_layer: operands must be buffers");
    const auto dtype = in->element_type();
    const bool want_s8 = kinds == 4 && side < 2;
    if (dtype != (want_s8 ? ffi::S8 : ffi::F32) || rows->element_type() != dtype || res->element_type() != dtype)
      return ffi::Error::InvalidArgument("kv_write_layer: pages must be float32, or int8 with f32 scales, and "
                                         "the new rows of the pages' dtype");
    char* dst = static_cast<char*>(res->untyped_data());
    if (dst != in->untyped_data())
      return ffi::Error::Internal("kv_write_layer: the pages are not aliased to the results (XLA copied them)");
    const auto pd = in->dimensions();
    if (pd.size() != (want_s8 || kinds == 2 ? 4u : 3u))
      return ffi::Error::InvalidArgument("kv_write_layer: pages must be [N, page_size, KVH, D] (scales [N, page_size, KVH])");
    const int64_t num_slots = pd[0] * pd[1];
    const int64_t row = static_cast<int64_t>(in->element_count()) / num_slots;
    if (static_cast<int64_t>(rows->element_count()) != T * row)
      return ffi::Error::InvalidArgument("kv_write_layer: rows must be [T, KVH, D] of the pages' KVH, D "
                                         "(scales [T, KVH])");
    const int64_t row_bytes = row * (dtype == ffi::S8 ? 1 : 4);
    const char* src = static_cast<const char*>(rows->untyped_data());
    for (int64_t t = 0; t < T; ++t) {
      const int64_t s = slots.typed_data()[t];
      if (s < 0 || s >= num_slots) return ffi::Error::InvalidArgument("kv_write_layer: a slot is out of range");
      std::memcpy(dst + s * row_bytes, src + t * row_bytes, row_bytes);
    }
  }
  return ffi::Error::Success();
}

}  // namespace

// The attention's scalar attributes, the same for the plain and the layer form.
struct AttnAttrs {
  explicit AttnAttrs(jaxinfer_ffi::Frame& f)
      : num_decode(f.attr_i64("num_decode")), chunk(f.attr_i64("prefill_chunk")),
        window(f.attr_i64("sliding_window")), sm_scale(f.attr_f32("sm_scale")), soft_cap(f.attr_f32("soft_cap")) {}
  int64_t num_decode, chunk, window;
  float sm_scale, soft_cap;
};

// Operands q, K, V (float32 pages) or q, Kq, Vq, Ks, Vs (int8 pages and their scales),
// then kv_lens, q_lens, page_table, alibi_slopes.
JAXINFER_FFI_HANDLER(JaxinferPagedAttention, f) {
  auto q = f.arg<ffi::F32>(0);
  const int64_t np = f.any_arg(1).element_type() == ffi::S8 ? 4 : 2;
  const auto p = np == 2 ? pages_of(f.any_arg(1), f.any_arg(2)) : pages_of(f.any_arg(1), f.any_arg(2), f.any_arg(3), f.any_arg(4));
  auto kv_lens = f.arg<ffi::S32>(1 + np), q_lens = f.arg<ffi::S32>(2 + np), page_table = f.arg<ffi::S32>(3 + np);
  auto alibi = f.arg<ffi::F32>(4 + np);
  auto out = f.ret<ffi::F32>(0);
  const AttnAttrs a(f);
  if (!f.ok(5 + np, 1)) return f.error();
  if (!p) return ffi::Error::InvalidArgument("paged_attention: pages must be float32, or int8 with f32 scales");
  return AttentionImpl(f.pool(), q, *p, kv_lens, q_lens, page_table, alibi, a.num_decode, a.chunk,
                       a.sm_scale, a.window, a.soft_cap, out);
}

JAXINFER_FFI_HANDLER(JaxinferPagedAttentionLayer, f) {
  auto q = f.arg<ffi::F32>(0);
  auto layer = f.arg<ffi::S32>(1), kv_lens = f.arg<ffi::S32>(2), q_lens = f.arg<ffi::S32>(3);
  auto page_table = f.arg<ffi::S32>(4);
  auto alibi = f.arg<ffi::F32>(5);
  auto out = f.ret<ffi::F32>(0);
  const AttnAttrs a(f);
  if (!f.ok(6, 1, /*more_args=*/true)) return f.error();
  return AttentionLayerImpl(f.pool(), q, layer, kv_lens, q_lens, page_table, alibi, f.args_from(6),
                            a.num_decode, a.chunk, a.sm_scale, a.window, a.soft_cap, out);
}

JAXINFER_FFI_HANDLER(JaxinferKvWriteLayer, f) {
  auto layer = f.arg<ffi::S32>(0), slots = f.arg<ffi::S32>(1);
  if (!f.ok(4, 0, /*more_args=*/true, /*more_rets=*/true)) return f.error();
  return KvWriteLayerImpl(layer, slots, f.args_from(2), f.rets_from(0));
}
