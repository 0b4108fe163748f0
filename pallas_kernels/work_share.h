// Work sharing for the C++ CPU kernels (quantized_matmul/int8_matmul.cc,
// f32_matmul/f32_matmul.cc, attention/paged_attention.cc).
//
// A call's work is cut into units that the calling thread and up to num_threads - 1 of
// XLA's intra-op pool threads claim from one atomic counter: no thread waits for a task
// that has not started, so concurrent calls cannot deadlock the pool. Each unit runs on
// one thread with IEEE denormals (XLA's threads may differ in MXCSR), so a result never
// depends on which thread computed it.
#pragma once

#include <xmmintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <thread>

#include "ffi_lite.h"

namespace jaxinfer_cpu {

// IEEE denormals on this thread while alive.
struct IeeeDenormals {
  unsigned saved = _mm_getcsr();
  IeeeDenormals() { _mm_setcsr(saved & ~(_MM_FLUSH_ZERO_ON | 0x0040u /* DAZ */)); }
  ~IeeeDenormals() { _mm_setcsr(saved); }
};

struct Work {
  std::function<void(int64_t)> run;
  int64_t units = 0;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  void drain() {
    IeeeDenormals mode;
    for (int64_t u; (u = next.fetch_add(1, std::memory_order_relaxed)) < units;) {
      run(u);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

// Runs work->run(0 .. units-1) on the caller and, when the call is worth `inline_macs`
// or more, on pool threads too (a helper costs microseconds to wake).
inline void share(jaxinfer_ffi::ThreadPool& pool, const std::shared_ptr<Work>& work, int64_t macs,
                  int64_t inline_macs) {
  int64_t helpers = macs < inline_macs ? 0 : std::max<int64_t>(0, pool.num_threads() - 1);
  helpers = std::min(helpers, work->units - 1);
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([work] { work->drain(); });
  work->drain();
  // Every unit is claimed now; wait only for units a running helper claimed.
  while (work->done.load(std::memory_order_acquire) < work->units) std::this_thread::yield();
}

}  // namespace jaxinfer_cpu
