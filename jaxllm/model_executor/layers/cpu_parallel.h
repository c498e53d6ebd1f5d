// parallel_for over XLA's intra-op thread pool, shared by our CPU kernels (cpu_ffi.py builds
// each kernel with this directory on the include path and this file in its cache key).

#ifndef JAXLLM_CPU_PARALLEL_H_
#define JAXLLM_CPU_PARALLEL_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace jaxllm {

struct ParallelWork {
  std::function<void(int64_t)> body;
  int64_t count = 0;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
};

inline void run_items(ParallelWork& w) {
  for (;;) {
    const int64_t i = w.next.fetch_add(1, std::memory_order_relaxed);
    if (i >= w.count) return;
    w.body(i);
    w.done.fetch_add(1, std::memory_order_release);
  }
}

// body(i) for i in [0, count), on the pool's threads and the calling thread. The caller takes
// items too and then waits only for items already claimed, so a busy or one-thread pool cannot
// deadlock it; it spins briefly (claimed items end within microseconds), then yields its core
// in case a helper needs it.
inline void parallel_for(xla::ffi::ThreadPool& pool, int64_t count,
                         std::function<void(int64_t)> body) {
  auto work = std::make_shared<ParallelWork>();  // outlives a helper that starts late
  work->body = std::move(body);
  work->count = count;
  const int64_t helpers =
      std::min<int64_t>(std::max<int64_t>(1, pool.num_threads()), count) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([work] { run_items(*work); });
  run_items(*work);
  for (int spins = 0; work->done.load(std::memory_order_acquire) < count;) {
    if (++spins < 4096) {
#if defined(__x86_64__)
      __builtin_ia32_pause();
#endif
    } else {
      std::this_thread::yield();
    }
  }
}

}  // namespace jaxllm

#endif  // JAXLLM_CPU_PARALLEL_H_
