// Float32 linear layers for the few rows of a decode step, on CPUs with AVX2 and FMA (models/linear.py,
// issue 41): y = x W^T + b.
//
// A decode step's linear layers are bound by reading their weights. The weight is packed once, in panels
// of 16 output channels, the inputs in order within each:
//   packed [N / 16][K][16] float32     (N padded to 16 with zero channels)
// so that one panel is read front to back while R rows of x are broadcast one input at a time into
// R x 2 eight-lane sums (R <= 6: 12 sums, two weight vectors and one broadcast fit AVX2's 16 registers).
// Panels are shared out two at a time from a counter (work_queue.h): where Ray's processes wake up on the
// engine's cores, a preempted thread holds up only the two panels it has, not the call.
// Measured on an AVX2 EPYC (no AVX-512), OPT-125m's linears: 0.83-1.04x oneDNN's packed time at 1-6 rows
// at one thread, 0.84-0.91x at two; 8 rows (two passes) 1.07-1.11x, 16 rows 1.4x (nothing blocked for the
// cache), so the caller sends at most one pass of rows (6) here (benchmarks/panel_linear.py).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#include "work_queue.h"

namespace {

bool panel_native() {
#if defined(__AVX2__) && defined(__FMA__)
  return true;
#else
  return false;
#endif
}

#if defined(__AVX2__) && defined(__FMA__)
// R rows of x (stride ldx) times one panel (K x 16) into y[r, 0 .. nc) (stride ldy), plus bias[0 .. nc).
template <int R>
inline void panel_rows(const float* x, int64_t ldx, const float* p, int64_t k_in, float* y, int64_t ldy,
                       int64_t nc, const float* bias) {
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t k = 0; k < k_in; ++k) {
    const __m256 w0 = _mm256_loadu_ps(p + 16 * k), w1 = _mm256_loadu_ps(p + 16 * k + 8);
    for (int r = 0; r < R; ++r) {
      const __m256 xb = _mm256_broadcast_ss(x + r * ldx + k);
      acc[r][0] = _mm256_fmadd_ps(xb, w0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(xb, w1, acc[r][1]);
    }
  }
  alignas(32) float out[16];
  for (int r = 0; r < R; ++r) {
    _mm256_store_ps(out, acc[r][0]);
    _mm256_store_ps(out + 8, acc[r][1]);
    float* yr = y + r * ldy;
    for (int64_t j = 0; j < nc; ++j) yr[j] = out[j] + (bias ? bias[j] : 0.f);
  }
}
#endif

constexpr int64_t PANELS_PER_ITEM = 2;

// x [M, K] float32, packed [N/16, K, 16] float32, bias [n] or none -> [M, n].
at::Tensor panel_linear(const at::Tensor& x_in, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                        int64_t n) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat, "panel_linear: x [M, K] float32");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kFloat && packed.size(2) == 16 &&
                  packed.size(1) == x_in.size(1) && packed.is_contiguous(),
              "panel_linear: packed [N/16, K, 16] float32, K = x's");
  TORCH_CHECK(n > 0 && n <= 16 * packed.size(0) && n > 16 * (packed.size(0) - 1), "panel_linear: n");
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kFloat && bias->numel() == n && bias->is_contiguous()),
              "panel_linear: bias [n] float32");
  const at::Tensor x = x_in.contiguous();
  const int64_t m = x.size(0), k_in = x.size(1), panels = packed.size(0);
  at::Tensor y = at::empty({m, n}, x.options());
#if defined(__AVX2__) && defined(__FMA__)
  if (m == 0) return y;
  const float* xp = x.data_ptr<float>();
  const float* pp = packed.data_ptr<float>();
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  apt_work::WorkQueue work((panels + PANELS_PER_ITEM - 1) / PANELS_PER_ITEM);
  at::parallel_for(0, work.threads(), 1, [&](int64_t, int64_t) {
    for (int64_t item; work.take(item);) {
      for (int64_t b = item * PANELS_PER_ITEM; b < std::min(panels, (item + 1) * PANELS_PER_ITEM); ++b) {
        const int64_t c0 = 16 * b, nc = std::min<int64_t>(16, n - c0);
        const float* panel = pp + b * k_in * 16;
        const float* pb = bp ? bp + c0 : nullptr;
        for (int64_t r0 = 0; r0 < m; r0 += 6) {
          const float* xr = xp + r0 * k_in;
          float* yr = yp + r0 * n + c0;
          switch (std::min<int64_t>(6, m - r0)) {
            case 1: panel_rows<1>(xr, k_in, panel, k_in, yr, n, nc, pb); break;
            case 2: panel_rows<2>(xr, k_in, panel, k_in, yr, n, nc, pb); break;
            case 3: panel_rows<3>(xr, k_in, panel, k_in, yr, n, nc, pb); break;
            case 4: panel_rows<4>(xr, k_in, panel, k_in, yr, n, nc, pb); break;
            case 5: panel_rows<5>(xr, k_in, panel, k_in, yr, n, nc, pb); break;
            default: panel_rows<6>(xr, k_in, panel, k_in, yr, n, nc, pb); break;
          }
        }
      }
    }
  });
#else
  TORCH_CHECK(false, "panel_linear: needs AVX2 and FMA (panel_native() is false here)");
#endif
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(apt_serve, m) {
  m.def("panel_native() -> bool", &panel_native);
  m.def("panel_linear(Tensor x, Tensor packed, Tensor? bias, int n) -> Tensor");
}

TORCH_LIBRARY_IMPL(apt_serve, CPU, m) { m.impl("panel_linear", &panel_linear); }
