// SIMD for the CPU attention kernels: W float lanes (AVX-512: 16, AVX2: 8, otherwise 1), bf16 rows
// read as 32-bit lanes and split into even/odd elements, a vectorised exp for x <= 0.
//
// Vector layout. A bf16 row is read 2W elements at a time as W 32-bit lanes: `lane << 16` is the
// even element as a float, `lane & 0xffff0000` the odd one (no shuffles). Rows that meet bf16 data
// are therefore kept "split" per 2W-element chunk:
//     natural  [e0 e1 e2 e3 ... e(2W-1)]      split  [e0 e2 ... e(2W-2) | e1 e3 ... e(2W-1)]
// Every function here has internal linkage: each kernel file includes its own copy.
#pragma once

#include <torch/extension.h>

#include <ATen/Parallel.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace apt_simd {
namespace {

using bf16 = at::BFloat16;

inline float to_float(float v) { return v; }
inline float to_float(bf16 v) {
  uint32_t bits = static_cast<uint32_t>(v.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
inline void store(float* p, float v) { *p = v; }
inline void store(bf16* p, float v) { *p = bf16(v); }  // round to nearest even

// SIMD ------------------------------------------------------------------------------------------
#if defined(__AVX512F__)
constexpr int W = 16;
using vf = __m512;
using vi = __m512i;
inline vf vzero() { return _mm512_setzero_ps(); }
inline vf vset1(float x) { return _mm512_set1_ps(x); }
inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
inline vi vload_raw(const bf16* p) { return _mm512_loadu_si512(p); }  // 2W bf16
inline vf bf16_even(vi r) { return _mm512_castsi512_ps(_mm512_slli_epi32(r, 16)); }
inline vf bf16_odd(vi r) { return _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32(int(0xffff0000)))); }
inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
inline void vstore(float* p, vf v) { _mm512_storeu_ps(p, v); }
inline float vsum(vf v) { return _mm512_reduce_add_ps(v); }
inline vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline float vmax_all(vf v) { return _mm512_reduce_max_ps(v); }
inline vf vround(vf v) { return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline vf vexp2_int(vf i) {  // 2^i for integral i in [-127, 0]
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(i), _mm512_set1_epi32(127)), 23));
}
inline void prefetch(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0); }
inline vf vload_i8(const int8_t* p) {  // W int8 -> W floats (sign-extend, convert)
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline void vstore_bf16(bf16* p, vf v) {  // W floats -> W bf16, round to nearest even (finite values)
#if defined(__AVX512BF16__)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
  return;
#endif
  const __m512i b = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
}
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int W = 8;
using vf = __m256;
using vi = __m256i;
inline vf vzero() { return _mm256_setzero_ps(); }
inline vf vset1(float x) { return _mm256_set1_ps(x); }
inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
inline vi vload_raw(const bf16* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline vf bf16_even(vi r) { return _mm256_castsi256_ps(_mm256_slli_epi32(r, 16)); }
inline vf bf16_odd(vi r) { return _mm256_castsi256_ps(_mm256_and_si256(r, _mm256_set1_epi32(int(0xffff0000)))); }
inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
inline void vstore(float* p, vf v) { _mm256_storeu_ps(p, v); }
inline float vsum(vf v) {
  __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
  return _mm_cvtss_f32(lo);
}
inline vf vmax(vf a, vf b) { return _mm256_max_ps(a, b); }
inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
inline float vmax_all(vf v) {
  __m128 lo = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  lo = _mm_max_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_max_ss(lo, _mm_movehdup_ps(lo));
  return _mm_cvtss_f32(lo);
}
inline vf vround(vf v) { return _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline vf vexp2_int(vf i) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(i), _mm256_set1_epi32(127)), 23));
}
inline void prefetch(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0); }
inline vf vload_i8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline void vstore_bf16(bf16* p, vf v) {
  alignas(32) float f[W];
  _mm256_store_ps(f, v);
  for (int j = 0; j < W; ++j) p[j] = bf16(f[j]);
}
#else
constexpr int W = 1;
using vf = float;
using vi = uint32_t;
inline vf vzero() { return 0.f; }
inline vf vset1(float x) { return x; }
inline vf vload(const float* p) { return *p; }
inline vi vload_raw(const bf16* p) {
  vi r;
  std::memcpy(&r, p, sizeof(r));
  return r;
}
inline vf bf16_even(vi r) {
  const uint32_t b = r << 16;
  float f;
  std::memcpy(&f, &b, sizeof(f));
  return f;
}
inline vf bf16_odd(vi r) {
  const uint32_t b = r & 0xffff0000u;
  float f;
  std::memcpy(&f, &b, sizeof(f));
  return f;
}
inline vf vfma(vf a, vf b, vf c) { return a * b + c; }
inline vf vadd(vf a, vf b) { return a + b; }
inline void vstore(float* p, vf v) { *p = v; }
inline float vsum(vf v) { return v; }
inline vf vmax(vf a, vf b) { return std::max(a, b); }
inline vf vmul(vf a, vf b) { return a * b; }
inline float vmax_all(vf v) { return v; }
inline vf vround(vf v) { return std::nearbyint(v); }
inline vf vexp2_int(vf i) {
  const int32_t bits = (static_cast<int32_t>(i) + 127) << 23;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
inline void prefetch(const void*) {}
inline vf vload_i8(const int8_t* p) { return static_cast<float>(*p); }
inline void vstore_bf16(bf16* p, vf v) { *p = bf16(v); }
#endif

template <typename T>
constexpr bool is_bf16 = std::is_same_v<T, bf16>;

// Split order (see the top) of a row of n elements, n a multiple of 2W; and back.
void split_row(const float* in, float* out, int64_t n) {
  for (int64_t c = 0; c < n; c += 2 * W)
    for (int j = 0; j < W; ++j) {
      out[c + j] = in[c + 2 * j];
      out[c + W + j] = in[c + 2 * j + 1];
    }
}
void unsplit_row(const float* in, float* out, int64_t n) {
  for (int64_t c = 0; c < n; c += 2 * W)
    for (int j = 0; j < W; ++j) {
      out[c + 2 * j] = in[c + j];
      out[c + 2 * j + 1] = in[c + W + j];
    }
}

// Int8 rows (natural order): x = q * s, one scale per ``group`` consecutive elements (cache/quant.py),
// dequantised into float or bf16 (rounded to nearest even, as ``dequantize(...).to(bf16)`` does).
template <typename T>
void dequant_row(const int8_t* q, const float* s, int64_t n, int64_t group, T* out) {
  for (int64_t g0 = 0, gi = 0; g0 < n; g0 += group, ++gi) {
    const vf sv = vset1(s[gi]);
    int64_t i = g0;
    const int64_t end = std::min(n, g0 + group);
#if defined(__AVX512BF16__)
    if constexpr (std::is_same_v<T, bf16>)  // two vectors per conversion and store (halves the bf16 part)
      for (; i + 2 * W <= end; i += 2 * W) {
        const __m512bh r = _mm512_cvtne2ps_pbh(vmul(vload_i8(q + i + W), sv), vmul(vload_i8(q + i), sv));
        _mm512_storeu_si512(out + i, reinterpret_cast<__m512i>(r));
      }
#endif
    for (; i + W <= end; i += W) {
      const vf x = vmul(vload_i8(q + i), sv);
      if constexpr (std::is_same_v<T, bf16>) vstore_bf16(out + i, x); else vstore(out + i, x);
    }
    for (; i < end; ++i) store(out + i, static_cast<float>(q[i]) * s[gi]);
  }
}

// Scalar fallbacks for rows of any length (natural order).
template <typename T>
inline float dot_scalar(const float* a, const T* b, int64_t n) {
  float s = 0.f;
  for (int64_t i = 0; i < n; ++i) s += a[i] * to_float(b[i]);
  return s;
}
template <typename T>
inline void axpy_scalar(float* y, float a, const T* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += a * to_float(x[i]);
}

// exp(x) for x <= 0: 2^(x log2 e) = 2^i * e^f, i = round(x log2 e), |f| <= ln2 / 2, Taylor to
// degree 6 (relative error < 2e-7). Below -87 the result is clamped to ~1e-38 (not 0).
inline vf vexp_nonpositive(vf x) {
  x = vmax(x, vset1(-87.f));
  const vf t = vmul(x, vset1(1.44269504088896341f));
  const vf i = vround(t);
  const vf f = vmul(vadd(t, vmul(i, vset1(-1.f))), vset1(0.693147180559945f));
  vf p = vset1(1.f / 720);
  p = vfma(p, f, vset1(1.f / 120));
  p = vfma(p, f, vset1(1.f / 24));
  p = vfma(p, f, vset1(1.f / 6));
  p = vfma(p, f, vset1(0.5f));
  p = vfma(p, f, vset1(1.f));
  p = vfma(p, f, vset1(1.f));
  return vmul(p, vexp2_int(i));
}

inline float exp_nonpositive(float x) {  // the same, one lane
  x = std::max(x, -87.f);
  const float t = x * 1.44269504088896341f;
  const float i = std::nearbyint(t);
  const float f = (t - i) * 0.693147180559945f;
  const float p = 1.f + f * (1.f + f * (0.5f + f * (1.f / 6 + f * (1.f / 24 + f * (1.f / 120 + f * (1.f / 720))))));
  const int32_t bits = (static_cast<int32_t>(i) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

}  // namespace
}  // namespace apt_simd
