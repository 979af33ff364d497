// Sharing a call's work items between XLA's intra-op threads (both kernels of cpu_kernels).
//
// Items go to whichever thread asks next (an atomic counter). The calling thread works too and
// waits only for items already taken, so the call finishes even when no pool thread is free;
// state that a late helper may still touch lives in a shared_ptr.

#ifndef BSR_JAX_CPU_KERNELS_WORK_QUEUE_H_
#define BSR_JAX_CPU_KERNELS_WORK_QUEUE_H_

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>

#include "xla/ffi/api/ffi.h"

namespace bsr_jax {

struct WorkQueue {
  std::atomic<int64_t> next{0};
  int64_t done = 0;
  std::mutex mutex;
  std::condition_variable all_done;
};

// One thread's part: drain(next_item) runs items while next_item() returns them (-1: none left).
template <class Drain>
void Work(WorkQueue& q, int64_t items, Drain& drain) {
  bool finished_one = false;
  const auto next_item = [&]() -> int64_t {
    if (finished_one) {
      std::lock_guard<std::mutex> lock(q.mutex);
      if (++q.done == items) q.all_done.notify_all();
    }
    const int64_t t = q.next.fetch_add(1);
    finished_one = t < items;
    return finished_one ? t : -1;
  };
  drain(next_item);
}

// Runs items [0, items) on the calling thread and up to pool.num_threads() - 1 helpers, each with
// its own copy of `drain` (per-thread buffers belong inside it), and returns when all are done.
template <class Drain>
void ShareOut(xla::ffi::ThreadPool pool, int64_t items, Drain drain) {
  auto queue = std::make_shared<WorkQueue>();
  const int64_t helpers = std::min<int64_t>(std::max<int64_t>(pool.num_threads(), 1), items) - 1;
  for (int64_t h = 0; h < helpers; ++h) pool.Schedule([drain, queue, items]() mutable { Work(*queue, items, drain); });
  Work(*queue, items, drain);
  std::unique_lock<std::mutex> lock(queue->mutex);
  queue->all_done.wait(lock, [&] { return queue->done == items; });
}

}  // namespace bsr_jax

#endif  // BSR_JAX_CPU_KERNELS_WORK_QUEUE_H_
