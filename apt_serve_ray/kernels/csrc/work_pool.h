// Threads of our own for decode-sized kernels: the caller waits only for the items other threads hold.
//
// ATen's OpenMP regions end at a barrier that every thread of the team must reach. On a box where the
// Serve app's processes wake up thousands of times a second, a compute thread is preempted several hundred
// times a second; if that happens to the partner before it has entered the region, the caller takes every
// item from the shared counter and then waits at the barrier for the partner's whole preemption, to find
// nothing left to do. A decode step has ~5 parallel regions a layer, each a fraction of a millisecond.
//
// Here the caller publishes a job and works on it at once; a worker joins if it sees the job while the job
// is open, and the caller, once every item is taken, closes the job and waits only for workers that joined
// (each holds at most the item it took). A worker that wakes late finds the job closed and goes back to
// waiting. Workers spin for APT_SERVE_WORK_POOL_SPIN_US (200) between jobs, then sleep on a futex; the
// caller wakes sleepers only when there are any. APT_SERVE_WORK_POOL=0 sends every job to ATen's threads.
//
// One pool per process (``instance``), as many threads as ATen's minus the caller, bound to the CPUs
// ``bind_threads`` gave ATen's (worker i to cpus[(i + 1) % n]). One job at a time: a second caller, or a
// call from inside a parallel region, goes to ATen's threads instead.
#pragma once

#include <ATen/Parallel.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__linux__)
#include <linux/futex.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace apt_work {

class Pool {
 public:
  static Pool& instance() {
    static Pool* pool = new Pool();  // never destroyed: workers may still be parked at exit
    return *pool;
  }

  // Runs body() here and on up to threads - 1 workers that join in time; false (nothing run) where the pool
  // is off, busy with another caller, or called from inside a parallel region.
  template <class F>
  bool run(int64_t threads, F& body) {
    if (!enabled_.load(std::memory_order_relaxed) || threads < 2 || at::in_parallel_region()) return false;
    std::unique_lock<std::mutex> lock(mu_, std::try_to_lock);
    if (!lock.owns_lock()) return false;
    const int64_t want = at::get_num_threads() - 1;
    if (want < 1) return false;
    if (static_cast<int64_t>(workers_.size()) != want || rebind_) restart(want);
    call_ = [](void* f) { (*static_cast<F*>(f))(); };
    arg_ = &body;
    error_ = nullptr;
    max_joiners_.store(threads - 1, std::memory_order_relaxed);
    jobs_.fetch_add(1, std::memory_order_relaxed);
    state_.store((++gen_ << 32) | kOpen, std::memory_order_seq_cst);
    seq_.fetch_add(1, std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) wake_all();
    std::exception_ptr mine;
    try {
      body();
    } catch (...) {
      mine = std::current_exception();
    }
    state_.fetch_and(~kOpen, std::memory_order_acq_rel);
    while ((state_.load(std::memory_order_acquire) & kActive) != 0) pause();
    if (mine) std::rethrow_exception(mine);
    if (error_) std::rethrow_exception(error_);
    return true;
  }

  // The CPUs ATen's threads were bound to (thread 0 the caller's); workers rebind before the next job.
  void set_cpus(const std::vector<int64_t>& cpus) {
    std::lock_guard<std::mutex> lock(mu_);
    cpus_ = cpus;
    rebind_ = true;
  }

  void set_enabled(bool on) { enabled_.store(on, std::memory_order_relaxed); }
  bool enabled() const { return enabled_.load(std::memory_order_relaxed); }
  // {jobs published, jobs a worker joined, workers}: for tests and benchmarks.
  std::vector<int64_t> stats() const {
    return {jobs_.load(), joined_.load(), static_cast<int64_t>(workers_.size())};
  }

 private:
  static constexpr uint64_t kOpen = uint64_t(1) << 31;
  static constexpr uint64_t kActive = kOpen - 1;

  Pool() {
    const char* on = std::getenv("APT_SERVE_WORK_POOL");
    enabled_.store(!(on && on[0] == '0' && on[1] == '\0'));
    const char* spin = std::getenv("APT_SERVE_WORK_POOL_SPIN_US");
    spin_ = std::chrono::microseconds(spin ? std::atoll(spin) : 200);
  }

  static void pause() {
#if defined(__x86_64__)
    _mm_pause();
#else
    std::this_thread::yield();
#endif
  }

  void wake_all() {
#if defined(__linux__)
    syscall(SYS_futex, reinterpret_cast<uint32_t*>(&seq_), FUTEX_WAKE_PRIVATE, INT32_MAX, nullptr, nullptr, 0);
#endif
  }

  void sleep_while(uint32_t seen) {
#if defined(__linux__)
    syscall(SYS_futex, reinterpret_cast<uint32_t*>(&seq_), FUTEX_WAIT_PRIVATE, seen, nullptr, nullptr, 0);
#else
    std::this_thread::sleep_for(std::chrono::microseconds(50));
#endif
  }

  void restart(int64_t n) {
    stop_.store(true);
    seq_.fetch_add(1, std::memory_order_seq_cst);
    wake_all();
    for (auto& t : workers_) t.join();
    workers_.clear();
    stop_.store(false);
    rebind_ = false;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t cpu = cpus_.empty() ? -1 : cpus_[(i + 1) % static_cast<int64_t>(cpus_.size())];
      workers_.emplace_back([this, cpu] { loop(cpu); });
    }
  }

  void loop(int64_t cpu) {
#if defined(__linux__)
    if (cpu >= 0 && cpu < CPU_SETSIZE) {
      cpu_set_t set;
      CPU_ZERO(&set);
      CPU_SET(static_cast<int>(cpu), &set);
      sched_setaffinity(0, sizeof(set), &set);
    }
#endif
    uint32_t seen = seq_.load(std::memory_order_acquire);
    for (;;) {
      uint32_t now;
      auto deadline = std::chrono::steady_clock::now() + spin_;
      for (int spins = 1; (now = seq_.load(std::memory_order_acquire)) == seen; ++spins) {
        pause();
        if (spins % 64 == 0 && std::chrono::steady_clock::now() > deadline) {
          sleepers_.fetch_add(1, std::memory_order_seq_cst);
          if (seq_.load(std::memory_order_seq_cst) == seen) sleep_while(seen);
          sleepers_.fetch_sub(1, std::memory_order_seq_cst);
        }
      }
      seen = now;
      if (stop_.load()) return;
      // Join the open job, if there is room; the caller cannot publish another until we leave.
      uint64_t s = state_.load(std::memory_order_acquire);
      bool joined = false;
      while ((s & kOpen) && static_cast<int64_t>(s & kActive) < max_joiners_.load(std::memory_order_relaxed)) {
        if (state_.compare_exchange_weak(s, s + 1, std::memory_order_acq_rel)) {
          joined = true;
          break;
        }
      }
      if (!joined) continue;
      joined_.fetch_add(1, std::memory_order_relaxed);
      try {
        call_(arg_);
      } catch (...) {
        std::lock_guard<std::mutex> lock(error_mu_);
        if (!error_) error_ = std::current_exception();
      }
      state_.fetch_sub(1, std::memory_order_release);
    }
  }

  std::mutex mu_, error_mu_;
  std::vector<std::thread> workers_;
  std::vector<int64_t> cpus_;
  bool rebind_ = false;
  std::chrono::microseconds spin_{200};
  std::atomic<bool> enabled_{true}, stop_{false};
  // Bits 63..32: the job's number; bit 31: open (workers may join); bits 30..0: workers in it.
  std::atomic<uint64_t> state_{0};
  uint64_t gen_ = 0;
  std::atomic<uint32_t> seq_{0};  // the futex word: one more each job
  std::atomic<int> sleepers_{0};
  std::atomic<int64_t> max_joiners_{0}, jobs_{0}, joined_{0};
  void (*call_)(void*) = nullptr;
  void* arg_ = nullptr;
  std::exception_ptr error_;
};

}  // namespace apt_work
