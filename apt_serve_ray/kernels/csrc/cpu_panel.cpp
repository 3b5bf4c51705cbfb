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

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <cstring>

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

// bf16 ---------------------------------------------------------------------------------------------
// The same for bf16 weights on CPUs with AVX-512, in panels of 64 output channels, inputs two at a time:
//   packed [N / 64][K / 2][64][2] bf16     (N padded to 64 with zero channels, K even)
// One k-pair of a panel is four 64-byte vectors read front to back; each is split into its even and odd
// input as float32 (a shift and a mask: bf16 is float32's upper half) and multiplied into R x 4 sixteen-lane
// float32 sums by FMAs, R <= 6 rows of x (converted to float32 once per call) broadcast one input at a time
// (24 sums, the vector, its two halves and a broadcast fit AVX-512's 32 registers). Sums stay float32 to the
// end; the bias (float32) is added before one rounding to bf16. More than six rows take the panel again, six
// at a time, from L2. Each panel is one work item (work_queue.h).
// Why FMAs and not AVX512-BF16's vdpbf16ps (two bf16 products into each lane, no split): on an Intel Xeon with
// AVX512-BF16 and no AMX (2026-12-07) vdpbf16ps ran at ~17 products a cycle where the split and two FMAs ran
// ~25-32, and the same where the weight's bytes bound the time (1-6 rows). That CPU's oneDNN bf16 GEMV read
// ~7-9 GB/s on one core; these panels read ~10-12 (benchmarks/panel_linear.py --dtype bfloat16).

#if defined(__AVX512F__)
constexpr int64_t BF16_PANEL = 64;
constexpr int64_t BF16_PREFETCH = 16;  // k-pairs (4 KB) ahead, into L2: the best of 2-64 KB and of into L1

template <int R>
inline void panel_rows_bf16(const float* x, int64_t ldx, const uint32_t* p, int64_t pairs, at::BFloat16* y,
                            int64_t ldy, int64_t nc, const float* bias) {
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = acc[r][2] = acc[r][3] = _mm512_setzero_ps();
  const __m512i hi = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  for (int64_t k = 0; k < pairs; ++k) {
    const uint32_t* w = p + BF16_PANEL * k;
    for (int line = 0; line < 4; ++line)
      _mm_prefetch(reinterpret_cast<const char*>(w + BF16_PANEL * BF16_PREFETCH + 16 * line), _MM_HINT_T1);
    for (int j = 0; j < 4; ++j) {
      const __m512i raw = _mm512_loadu_si512(w + 16 * j);
      const __m512 even = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
      const __m512 odd = _mm512_castsi512_ps(_mm512_and_si512(raw, hi));
      for (int r = 0; r < R; ++r) {
        acc[r][j] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * ldx + 2 * k]), even, acc[r][j]);
        acc[r][j] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * ldx + 2 * k + 1]), odd, acc[r][j]);
      }
    }
  }
  alignas(64) uint16_t rounded[BF16_PANEL];
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < 4; ++j) {
      __m512 v = acc[r][j];
      if (bias) {
        const int64_t left = std::max<int64_t>(0, std::min<int64_t>(16, nc - 16 * j));
        v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << left) - 1), bias + 16 * j));
      }
#if defined(__AVX512BF16__)
      const __m256i b = (__m256i)_mm512_cvtneps_pbh(v);
#else  // round to nearest even (finite values), as at::BFloat16 does
      const __m512i u = _mm512_castps_si512(v);
      const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
      const __m256i b = _mm512_cvtepi32_epi16(
          _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16));
#endif
      _mm256_store_si256(reinterpret_cast<__m256i*>(rounded + 16 * j), b);
    }
    std::memcpy(y + r * ldy, rounded, nc * sizeof(uint16_t));
  }
}
#endif

bool panel_bf16_native() {
#if defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

// x [M, K] bf16 (K even), packed [N/64, K/2, 64, 2] bf16, bias [n] float32 or none -> [M, n] bf16.
at::Tensor panel_linear_bf16(const at::Tensor& x_in, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                             int64_t n) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kBFloat16, "panel_linear_bf16: x [M, K] bfloat16");
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kBFloat16 && packed.size(2) == 64 &&
                  packed.size(3) == 2 && 2 * packed.size(1) == x_in.size(1) && packed.is_contiguous(),
              "panel_linear_bf16: packed [N/64, K/2, 64, 2] bfloat16, K = x's (even)");
  TORCH_CHECK(n > 0 && n <= 64 * packed.size(0) && n > 64 * (packed.size(0) - 1), "panel_linear_bf16: n");
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kFloat && bias->numel() == n && bias->is_contiguous()),
              "panel_linear_bf16: bias [n] float32");
  const int64_t m = x_in.size(0), pairs = x_in.size(1) / 2, panels = packed.size(0);
  at::Tensor y = at::empty({m, n}, x_in.options());
#if defined(__AVX512F__)
  if (m == 0) return y;
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  const float* xp = x.data_ptr<float>();
  const uint32_t* pp = reinterpret_cast<const uint32_t*>(packed.data_ptr<at::BFloat16>());
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  at::BFloat16* yp = y.data_ptr<at::BFloat16>();
  const int64_t k_in = 2 * pairs;
  apt_work::WorkQueue work(panels);
  at::parallel_for(0, work.threads(), 1, [&](int64_t, int64_t) {
    for (int64_t b; work.take(b);) {
      const int64_t c0 = BF16_PANEL * b, nc = std::min<int64_t>(BF16_PANEL, n - c0);
      const uint32_t* panel = pp + b * pairs * BF16_PANEL;
      const float* pb = bp ? bp + c0 : nullptr;
      for (int64_t r0 = 0; r0 < m; r0 += 6) {
        const float* xr = xp + r0 * k_in;
        at::BFloat16* yr = yp + r0 * n + c0;
        switch (std::min<int64_t>(6, m - r0)) {
          case 1: panel_rows_bf16<1>(xr, k_in, panel, pairs, yr, n, nc, pb); break;
          case 2: panel_rows_bf16<2>(xr, k_in, panel, pairs, yr, n, nc, pb); break;
          case 3: panel_rows_bf16<3>(xr, k_in, panel, pairs, yr, n, nc, pb); break;
          case 4: panel_rows_bf16<4>(xr, k_in, panel, pairs, yr, n, nc, pb); break;
          case 5: panel_rows_bf16<5>(xr, k_in, panel, pairs, yr, n, nc, pb); break;
          default: panel_rows_bf16<6>(xr, k_in, panel, pairs, yr, n, nc, pb); break;
        }
      }
    }
  });
#else
  TORCH_CHECK(false, "panel_linear_bf16: needs AVX-512 (panel_bf16_native() is false here)");
#endif
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(apt_serve, m) {
  m.def("panel_native() -> bool", &panel_native);
  m.def("panel_linear(Tensor x, Tensor packed, Tensor? bias, int n) -> Tensor");
  m.def("panel_bf16_native() -> bool", &panel_bf16_native);
  m.def("panel_linear_bf16(Tensor x, Tensor packed, Tensor? bias, int n) -> Tensor");
}

TORCH_LIBRARY_IMPL(apt_serve, CPU, m) {
  m.impl("panel_linear", &panel_linear);
  m.impl("panel_linear_bf16", &panel_linear_bf16);
}
