// ATen's intra-op threads bound one to a CPU each (Linux).
//
// With as many compute threads as cores, Ray's processes (each actor's main thread wakes every 10 ms) and
// the Serve path keep preempting them. An unbound thread can also be moved onto the core its partner runs
// on, and the two then share it while the other core runs the intruder: every parallel region waits for
// the slower half. Bound, a preempted thread waits on its own core for the intruder's few microseconds.
// vLLM's CPU worker binds its OpenMP threads the same way (VLLM_CPU_OMP_THREADS_BIND).

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <cstdint>
#include <vector>

#if defined(__linux__)
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

// Thread i of ATen's pool (the calling thread is thread 0) to cpus[i % len(cpus)]; returns each thread's
// native id, in order (-1 where binding failed or is not supported here).
std::vector<int64_t> bind_threads(std::vector<int64_t> cpus) {
  TORCH_CHECK(!cpus.empty(), "cpus: give at least one CPU");
  for (auto c : cpus) TORCH_CHECK(c >= 0 && c < CPU_SETSIZE, "cpus: ", c, " is not a CPU number");
  const int64_t n = at::get_num_threads();
  std::vector<int64_t> tids(n, -1);
#if defined(__linux__)
  // Grain 1 over n items: thread i of the team takes item i (ATen's OpenMP backend splits evenly).
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      cpu_set_t set;
      CPU_ZERO(&set);
      CPU_SET(static_cast<int>(cpus[i % static_cast<int64_t>(cpus.size())]), &set);
      if (sched_setaffinity(0, sizeof(set), &set) == 0) tids[i] = static_cast<int64_t>(syscall(SYS_gettid));
    }
  });
#endif
  return tids;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(apt_serve, m) { m.def("bind_threads(int[] cpus) -> int[]", &bind_threads); }
