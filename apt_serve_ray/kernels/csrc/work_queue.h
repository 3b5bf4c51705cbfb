// Work items shared out one at a time from a counter, for the kernels' ATen threads.
//
// at::parallel_for hands each thread one contiguous range. When items differ in cost (a causal prefill's
// later rows, a decode batch's long contexts) one thread ends long before the other, and on a small box
// where Ray's processes wake up hundreds of times a second, a thread the OS preempts holds up the whole
// call while its partner waits at the barrier. Taking items from a shared counter, the threads end
// together and a preempted thread holds up only the item it has:
//
//   WorkQueue work(n);
//   at::parallel_for(0, work.threads(), 1, [&](int64_t, int64_t) {
//     /* per-thread scratch */
//     for (int64_t i; work.take(i);) { /* item i */ }
//   });
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace apt_work {

class WorkQueue {
 public:
  explicit WorkQueue(int64_t items) : items_(items) {}
  // How many threads to start: ATen's, at most one per item.
  int64_t threads() const { return std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), items_)); }
  // The next item into i; false once every item is taken.
  bool take(int64_t& i) {
    i = next_.fetch_add(1, std::memory_order_relaxed);
    return i < items_;
  }

 private:
  const int64_t items_;
  std::atomic<int64_t> next_{0};
};

}  // namespace apt_work
