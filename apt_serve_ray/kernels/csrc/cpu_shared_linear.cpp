// A prefill-sized linear layer whose output columns the threads take from a counter (issue 41, the
// second core).
//
// oneDNN splits a GEMM between the threads ahead of time, so when the OS preempts one of them for one of
// the Serve app's wake-ups (thousands a second on two cores), its partner ends its half and waits at the
// barrier: measured, noise that takes 8% of the machine costs a two-thread 384-token prefill 18%. Here the
// weight is kept as oneDNN-packed column chunks; each thread takes the next chunk and runs it through
// oneDNN single-threaded (inside a parallel region oneDNN does not start threads of its own), so a
// preempted thread holds up one chunk, not the layer. Each chunk reads its slice of the weight once.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <cstdint>
#include <string>
#include <vector>

#include "work_queue.h"

namespace {

// x [M, K]; chunks[i]: oneDNN-packed weight of columns [starts[i], starts[i] + widths[i]); bias [n] or none.
at::Tensor shared_linear(const at::Tensor& x_in, at::TensorList chunks, const c10::optional<at::Tensor>& bias,
                         at::IntArrayRef widths, int64_t n) {
  TORCH_CHECK(x_in.dim() == 2, "shared_linear: x [M, K]");
  TORCH_CHECK(!chunks.empty() && chunks.size() == widths.size(), "shared_linear: one width per chunk");
  std::vector<int64_t> starts(widths.size());
  int64_t total = 0;
  for (size_t i = 0; i < widths.size(); ++i) {
    TORCH_CHECK(widths[i] > 0, "shared_linear: widths must be positive");
    starts[i] = total;
    total += widths[i];
  }
  TORCH_CHECK(total == n, "shared_linear: widths sum to ", total, ", not n = ", n);
  TORCH_CHECK(!bias.has_value() || bias->numel() == n, "shared_linear: bias [n]");
  const at::Tensor x = x_in.contiguous();
  at::Tensor y = at::empty({x.size(0), n}, x.options());
  if (x.size(0) == 0) return y;
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  const at::ThreadLocalState state;  // the caller's inference mode and dispatch keys, for the worker threads
  apt_work::WorkQueue work(static_cast<int64_t>(chunks.size()));
  std::vector<std::string> errors(work.threads());
  at::parallel_for(0, work.threads(), 1, [&](int64_t begin, int64_t) {
    at::ThreadLocalStateGuard guard(state);
    try {
      for (int64_t i; work.take(i);) {
        torch::jit::Stack stack;
        stack.emplace_back(x);
        stack.emplace_back(chunks[i]);
        if (bias.has_value()) {
          stack.emplace_back(bias->narrow(0, starts[i], widths[i]));
        } else {
          stack.emplace_back(c10::IValue());
        }
        stack.emplace_back(std::string("none"));
        stack.emplace_back(c10::List<c10::optional<at::Scalar>>());
        stack.emplace_back(std::string(""));
        op.callBoxed(&stack);
        y.narrow(1, starts[i], widths[i]).copy_(stack[0].toTensor());
      }
    } catch (const std::exception& e) {  // an exception must not leave an OpenMP region
      errors[begin] = e.what();
    }
  });
  for (const auto& e : errors) TORCH_CHECK(e.empty(), "shared_linear: ", e);
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(apt_serve, m) {
  m.def("shared_linear(Tensor x, Tensor[] chunks, Tensor? bias, int[] widths, int n) -> Tensor");
}

// The packed chunks are oneDNN tensors, so the call dispatches on MkldnnCPU.
TORCH_LIBRARY_IMPL(apt_serve, CPU, m) { m.impl("shared_linear", &shared_linear); }
TORCH_LIBRARY_IMPL(apt_serve, MkldnnCPU, m) { m.impl("shared_linear", &shared_linear); }
