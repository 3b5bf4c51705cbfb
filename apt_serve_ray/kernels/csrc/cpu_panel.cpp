// Linear layers over the weight packed in panels (models/linear.py, issue 41): y = x W^T + b. Float32 for the few
// rows of a decode step on CPUs with AVX2 and FMA (16-channel panels, below); float32 and bf16 for any rows on
// CPUs with AVX-512 (64-channel panels, further down).
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
#include <type_traits>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <cstring>

#include "work_queue.h"

namespace {

// f(std::integral_constant<int, R>{}, r0) for each block of R <= 6 rows from r0, m rows in all: the kernels
// below keep R rows' sums in registers, so R is a template argument.
template <typename F>
inline void six_rows_at_a_time(int64_t m, F&& f) {
  for (int64_t r0 = 0; r0 < m; r0 += 6) {
    switch (std::min<int64_t>(6, m - r0)) {
      case 1: f(std::integral_constant<int, 1>{}, r0); break;
      case 2: f(std::integral_constant<int, 2>{}, r0); break;
      case 3: f(std::integral_constant<int, 3>{}, r0); break;
      case 4: f(std::integral_constant<int, 4>{}, r0); break;
      case 5: f(std::integral_constant<int, 5>{}, r0); break;
      default: f(std::integral_constant<int, 6>{}, r0); break;
    }
  }
}

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

// AVX-512: panels of 64 output channels, for float32 and bf16 weights --------------------------------------
//   float32  packed [N / 64][K][64]         one input of a panel: four 64-byte vectors
//   bf16     packed [N / 64][K / 2][64][2]  one pair of inputs: four 64-byte vectors, each split into its even
//                                           and odd input as float32 (a shift and a mask: bf16 is float32's
//                                           upper half)
// (N padded to 64 with zero channels; K even for bf16.) A panel is read front to back, prefetched 4 KB ahead
// into L2, and multiplied into R x 4 sixteen-lane float32 sums by FMAs, R <= 6 rows of x (float32; bf16 x is
// converted once a call) broadcast one input at a time (24 sums, the vectors and a broadcast fit AVX-512's 32
// registers). Sums stay float32 to the end; the bias (float32) is added before the one store (one rounding to
// bf16). More rows take the panel again, six at a time, from L2. Each panel is one work item (work_queue.h).
// Why FMAs for bf16 and not AVX512-BF16's vdpbf16ps (two bf16 products into each lane, no split): on an Intel
// Xeon with AVX512-BF16 and no AMX (2026-12-07) vdpbf16ps ran ~17 products a cycle where the split and FMAs ran
// ~25-32, and no faster where the weight's bytes bound the time (1-6 rows). There oneDNN's bf16 linears read
// ~7-9 GB/s of weight on one core and these panels ~10-12: 0.65-0.75x oneDNN's time for OPT-350m's linears at
// 1-64 rows (benchmarks/panel_linear.py --dtype bfloat16).
#if defined(__AVX512F__)
constexpr int64_t WIDE_PANEL = 64;  // channels in an AVX-512 panel (float32 [K][64], bf16 [K/2][64][2])
constexpr int64_t PREFETCH_BYTES = 4096;  // ahead, into L2: the best of 2-64 KB and of into L1 (bf16, Xeon)

template <int R>
inline void store_rows(const __m512 (&acc)[R][4], float* y, int64_t ldy, int64_t nc, const float* bias) {
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < 4; ++j) {
      const int64_t left = std::max<int64_t>(0, std::min<int64_t>(16, nc - 16 * j));
      const __mmask16 mask = static_cast<__mmask16>((1u << left) - 1);
      __m512 v = acc[r][j];
      if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, bias + 16 * j));
      _mm512_mask_storeu_ps(y + r * ldy + 16 * j, mask, v);
    }
  }
}

template <int R>
inline void store_rows(const __m512 (&acc)[R][4], at::BFloat16* y, int64_t ldy, int64_t nc, const float* bias) {
  alignas(64) uint16_t rounded[WIDE_PANEL];
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

inline void prefetch_ahead(const void* row) {
  const char* p = static_cast<const char*>(row) + PREFETCH_BYTES;
  for (int line = 0; line < 4; ++line) _mm_prefetch(p + 64 * line, _MM_HINT_T1);
}

// R rows of float32 x (stride ldx) times one wide panel into y (stride ldy), plus bias: float32 weights
// ([K][64]: 4 vectors an input) or bf16 ([K/2][64][2]: 4 vectors a pair of inputs, each split in two).
template <int R>
inline void wide_rows(const float* x, int64_t ldx, const float* p, int64_t k_in, float* y, int64_t ldy, int64_t nc,
                      const float* bias) {
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = acc[r][2] = acc[r][3] = _mm512_setzero_ps();
  for (int64_t k = 0; k < k_in; ++k) {
    const float* w = p + WIDE_PANEL * k;
    prefetch_ahead(w);
    for (int j = 0; j < 4; ++j) {
      const __m512 wj = _mm512_loadu_ps(w + 16 * j);
      for (int r = 0; r < R; ++r) acc[r][j] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * ldx + k]), wj, acc[r][j]);
    }
  }
  store_rows<R>(acc, y, ldy, nc, bias);
}

template <int R>
inline void wide_rows(const float* x, int64_t ldx, const at::BFloat16* p16, int64_t k_in, at::BFloat16* y,
                      int64_t ldy, int64_t nc, const float* bias) {
  const uint32_t* p = reinterpret_cast<const uint32_t*>(p16);
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = acc[r][2] = acc[r][3] = _mm512_setzero_ps();
  const __m512i hi = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  for (int64_t k = 0; k < k_in / 2; ++k) {
    const uint32_t* w = p + WIDE_PANEL * k;
    prefetch_ahead(w);
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
  store_rows<R>(acc, y, ldy, nc, bias);
}

// y [M, n] = x [M, K] (float32, contiguous) times the wide panels (W of weight type T) plus bias: each panel a
// work item, its rows six at a time.
template <typename T>
void wide_panels(const float* xp, int64_t m, int64_t k_in, const T* pp, int64_t panels, const float* bp, T* yp,
                 int64_t n) {
  apt_work::WorkQueue work(panels);
  at::parallel_for(0, work.threads(), 1, [&](int64_t, int64_t) {
    for (int64_t b; work.take(b);) {
      const int64_t c0 = WIDE_PANEL * b, nc = std::min<int64_t>(WIDE_PANEL, n - c0);
      const T* panel = pp + b * k_in * WIDE_PANEL;
      const float* pb = bp ? bp + c0 : nullptr;
      six_rows_at_a_time(m, [&](auto rows, int64_t r0) {
        wide_rows<decltype(rows)::value>(xp + r0 * k_in, k_in, panel, k_in, yp + r0 * n + c0, n, nc, pb);
      });
    }
  });
}
#endif

constexpr int64_t PANELS_PER_ITEM = 2;

// x [M, K] float32, packed [N/W, K, W] float32 (W 16, or 64 with AVX-512), bias [n] or none -> [M, n].
at::Tensor panel_linear(const at::Tensor& x_in, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                        int64_t n) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat, "panel_linear: x [M, K] float32");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kFloat &&
                  (packed.size(2) == 16 || packed.size(2) == 64) && packed.size(1) == x_in.size(1) &&
                  packed.is_contiguous(),
              "panel_linear: packed [N/W, K, W] float32 (W 16 or 64), K = x's");
  const int64_t width = packed.size(2);
  TORCH_CHECK(n > 0 && n <= width * packed.size(0) && n > width * (packed.size(0) - 1), "panel_linear: n");
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kFloat && bias->numel() == n && bias->is_contiguous()),
              "panel_linear: bias [n] float32");
  const at::Tensor x = x_in.contiguous();
  const int64_t m = x.size(0), k_in = x.size(1), panels = packed.size(0);
  at::Tensor y = at::empty({m, n}, x.options());
  if (width == 64) {
#if defined(__AVX512F__)
    if (m > 0)
      wide_panels<float>(x.data_ptr<float>(), m, k_in, packed.data_ptr<float>(), panels,
                         bias.has_value() ? bias->data_ptr<float>() : nullptr, y.data_ptr<float>(), n);
    return y;
#else
    TORCH_CHECK(false, "panel_linear: 64-channel panels need AVX-512 (panel_wide_native() is false here)");
#endif
  }
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
        six_rows_at_a_time(m, [&](auto rows, int64_t r0) {
          panel_rows<decltype(rows)::value>(xp + r0 * k_in, k_in, panel, k_in, yp + r0 * n + c0, n, nc, pb);
        });
      }
    }
  });
#else
  TORCH_CHECK(false, "panel_linear: needs AVX2 and FMA (panel_native() is false here)");
#endif
  return y;
}

// Whether the AVX-512 panels of 64 channels (float32 and bf16) are built here.
bool panel_wide_native() {
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
  wide_panels<at::BFloat16>(x.data_ptr<float>(), m, 2 * pairs, packed.data_ptr<at::BFloat16>(), panels,
                            bias.has_value() ? bias->data_ptr<float>() : nullptr, y.data_ptr<at::BFloat16>(), n);
#else
  TORCH_CHECK(false, "panel_linear_bf16: needs AVX-512 (panel_wide_native() is false here)");
#endif
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(apt_serve, m) {
  m.def("panel_native() -> bool", &panel_native);
  m.def("panel_linear(Tensor x, Tensor packed, Tensor? bias, int n) -> Tensor");
  m.def("panel_wide_native() -> bool", &panel_wide_native);
  m.def("panel_linear_bf16(Tensor x, Tensor packed, Tensor? bias, int n) -> Tensor");
}

TORCH_LIBRARY_IMPL(apt_serve, CPU, m) {
  m.impl("panel_linear", &panel_linear);
  m.impl("panel_linear_bf16", &panel_linear_bf16);
}
