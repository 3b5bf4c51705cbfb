// Linear layers whose int8 weights stay packed (models/quant.py, issue 43): y = (x W8^T) * scale + b.
//
// A decode step's linear layers are bound by the bytes of weights they read; int8 halves bf16's. The
// weight is packed once at load in blocks of 16 output channels by pairs of inputs:
//   packed [N / 16][K / 2][16][2] int8      (N padded to 16, K to 2, with zeros)
// so that 32 bytes are one block's 16 channels x 2 inputs: sign-extended and converted to 32 bf16 (exact
// for -127..127) they are one operand of vdpbf16ps, which multiplies each channel's pair by the pair of
// x broadcast to every lane and adds both products into that channel's float32 sum. One weight block is
// read once and used for ROWS rows of x; the scale and bias are applied to the float32 sums at the end.
// AVX-512 BF16 only (the caller checks ``woq_native()``; elsewhere torch's own kernel serves).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

bool woq_native() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

#if defined(__AVX512BF16__)
constexpr int64_t ROWS = 4;    // rows of x per pass over the weight blocks
constexpr int64_t BLOCKS = 4;  // 16-channel blocks per pass: R x B independent sums hide vdpbf16ps' latency

inline __m512bh load_block(const int8_t* p) {  // 32 int8 -> 32 bf16, in order
  const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16))));
  return _mm512_cvtne2ps_pbh(hi, lo);
}

// One pair of inputs k: the B blocks' codes (converted to bf16) times each of R rows' pair of x, into acc.
template <int64_t R, int64_t B>
inline void dot_pair(__m512 (&acc)[R][B], const __m512bh (&wv)[B], const uint16_t* x, int64_t ldx, int64_t k) {
  for (int64_t r = 0; r < R; ++r) {
    uint32_t pair;
    std::memcpy(&pair, x + r * ldx + 2 * k, 4);
    const __m512bh xv = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(pair)));
    for (int64_t b = 0; b < B; ++b) acc[r][b] = _mm512_dpbf16_ps(acc[r][b], wv[b], xv);
  }
}

// y[r, c0 .. c0 + 15] = acc * scale + bias (scale null: 1), as bf16; the last block's tail channels masked off.
template <int64_t R, int64_t B>
inline void store_tile(const __m512 (&acc)[R][B], const float* scale, const float* bias, int64_t n0, int64_t n,
                       c10::BFloat16* y, int64_t ldy) {
  for (int64_t b = 0; b < B; ++b) {
    const int64_t c0 = n0 + 16 * b;
    if (c0 >= n) break;
    const __m512 s = scale ? _mm512_loadu_ps(scale + c0) : _mm512_set1_ps(1.f);
    const __m512 bb = bias ? _mm512_loadu_ps(bias + c0) : _mm512_setzero_ps();
    const __mmask16 keep = n - c0 >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << (n - c0)) - 1);
    for (int64_t r = 0; r < R; ++r)
      _mm256_mask_storeu_epi16(y + r * ldy + c0, keep,
                               reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_fmadd_ps(acc[r][b], s, bb))));
  }
}

// R rows of x against B consecutive blocks (w: the first block; a block is kp * 32 bytes).
template <int64_t R, int64_t B>
void tile(const uint16_t* x, int64_t ldx, const int8_t* w, int64_t kp, const float* scale, const float* bias,
          int64_t n0, int64_t n, c10::BFloat16* y, int64_t ldy) {
  __m512 acc[R][B];
  for (int64_t r = 0; r < R; ++r)
    for (int64_t b = 0; b < B; ++b) acc[r][b] = _mm512_setzero_ps();
  const int64_t stride = kp * 32;
  for (int64_t k = 0; k < kp; ++k) {
    __m512bh wv[B];
    for (int64_t b = 0; b < B; ++b) wv[b] = load_block(w + b * stride + k * 32);
    dot_pair<R, B>(acc, wv, x, ldx, k);
  }
  store_tile<R, B>(acc, scale, bias, n0, n, y, ldy);
}

template <int64_t B>
void rows(const uint16_t* x, int64_t m, int64_t k2, const int8_t* w, int64_t kp, const float* sp, const float* bp,
          int64_t n0, int64_t n, c10::BFloat16* y) {
  int64_t r = 0;
  for (; r + ROWS <= m; r += ROWS) tile<ROWS, B>(x + r * k2, k2, w, kp, sp, bp, n0, n, y + r * n, n);
  switch (m - r) {  // the last 1-3 rows in one pass (not one pass a row: each pass converts the blocks again)
    case 3: tile<3, B>(x + r * k2, k2, w, kp, sp, bp, n0, n, y + r * n, n); break;
    case 2: tile<2, B>(x + r * k2, k2, w, kp, sp, bp, n0, n, y + r * n, n); break;
    case 1: tile<1, B>(x + r * k2, k2, w, kp, sp, bp, n0, n, y + r * n, n); break;
    default: break;
  }
}
#endif

// x [M, K] bf16 (K even: the caller pads), packed as above, scale [Npad] and bias [Npad] float32 -> [M, N] bf16.
at::Tensor woq_int8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                           const c10::optional<at::Tensor>& bias, int64_t n) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(), "woq_int8_linear: x [M, K] bf16");
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kChar && packed.size(2) == 16 && packed.size(3) == 2,
              "woq_int8_linear: packed [N/16, K/2, 16, 2] int8");
  const int64_t m = x.size(0), kp = packed.size(1), nb = packed.size(0);
  TORCH_CHECK(x.size(1) == 2 * kp, "woq_int8_linear: x has ", x.size(1), " inputs, the weight ", 2 * kp);
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.numel() == nb * 16 && n <= nb * 16, "woq_int8_linear: scale");
  auto y = at::empty({m, n}, x.options());
#if defined(__AVX512BF16__)
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const int8_t* wp = packed.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  auto* yp = y.data_ptr<at::BFloat16>();  // c10::BFloat16
  const int64_t k2 = 2 * kp;
  // Groups of BLOCKS blocks; the last group may be shorter (and its last block part-filled: masked stores).
  const int64_t groups = (nb + BLOCKS - 1) / BLOCKS;
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t blk = g * BLOCKS, left = std::min(BLOCKS, nb - blk);
      const int8_t* w = wp + blk * kp * 32;
      if (left == BLOCKS) rows<BLOCKS>(xp, m, k2, w, kp, sp, bp, blk * 16, n, yp);
      else for (int64_t b = 0; b < left; ++b) rows<1>(xp, m, k2, w + b * kp * 32, kp, sp, bp, (blk + b) * 16, n, yp);
    }
  });
#else
  TORCH_CHECK(false, "woq_int8_linear: needs AVX-512 BF16 (woq_native() is false here)");
#endif
  return y;
}



// int4, groups of G = 32 inputs (GGUF Q4_1's form, models/quant.py): w = d q + m, q in 0..15, d and m float32
// per channel and group (float16, as GGUF stores them, measured less faithful: largest logit error on the default
// model 1.23 against 0.80, teacher-forced top-1 96.4% against 100%, for an eighth of a byte a weight).
// Packed [N / 16][K / 2][16] bytes: of one block's 32 codes for a pair of inputs, code j in byte j's low nibble
// and code j + 16 in its high nibble. Per group:
//   y[n] += d[n, g] * (x_g . q_g[n]) + m[n, g] * sum(x_g)
// the dot by vdpbf16ps on codes converted to bf16 (exact), folded into the float32 sum at the group's end.
//   dm [N / 16][K / G][16][2] float32: (d, m) per channel of each block and group.
#if defined(__AVX512BF16__)
constexpr int64_t GROUP = 32;

// 16 bytes -> 32 codes -> 32 bf16, in order (low nibbles first): each byte widened to a 16-bit lane, its nibbles
// split, and each code looked up in a table of bf16(0..15) (vpermw) rather than converted through float32 (which
// cost 7 instructions, 3 of them 512-bit conversions, per 32 codes: the one-row kernel was bound by them).
inline __m512bh load_block4(const uint8_t* p) {
  const __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i lo = _mm256_and_si256(w, _mm256_set1_epi16(0x0f));
  const __m256i hi = _mm256_srli_epi16(w, 4);
  const __m512i codes = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
  const __m512i table = _mm512_set_epi16(  // bf16 of 15 .. 0, twice (vpermw reads the index's low 5 bits)
      0x4170, 0x4160, 0x4150, 0x4140, 0x4130, 0x4120, 0x4110, 0x4100, 0x40e0, 0x40c0, 0x40a0, 0x4080, 0x4040,
      0x4000, 0x3f80, 0x0000, 0x4170, 0x4160, 0x4150, 0x4140, 0x4130, 0x4120, 0x4110, 0x4100, 0x40e0, 0x40c0,
      0x40a0, 0x4080, 0x4040, 0x4000, 0x3f80, 0x0000);
  return reinterpret_cast<__m512bh>(_mm512_permutexvar_epi16(codes, table));
}

template <int64_t R, int64_t B>
void tile4(const uint16_t* x, int64_t ldx, const float* xsum, int64_t groups, const uint8_t* w, int64_t kp,
           const float* dm, const float* bias, int64_t n0, int64_t n, c10::BFloat16* y, int64_t ldy) {
  __m512 acc[R][B], dot[R][B];
  for (int64_t r = 0; r < R; ++r)
    for (int64_t b = 0; b < B; ++b) acc[r][b] = _mm512_setzero_ps();
  const int64_t stride = kp * 16, dm_stride = groups * 32;
  constexpr int64_t per_group = GROUP / 2;
  const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  for (int64_t g = 0; g < groups; ++g) {
    for (int64_t r = 0; r < R; ++r)
      for (int64_t b = 0; b < B; ++b) dot[r][b] = _mm512_setzero_ps();
    for (int64_t k = g * per_group; k < (g + 1) * per_group; ++k) {
      __m512bh wv[B];
      for (int64_t b = 0; b < B; ++b) wv[b] = load_block4(w + b * stride + k * 16);
      dot_pair<R, B>(dot, wv, x, ldx, k);
    }
    for (int64_t b = 0; b < B; ++b) {
      const float* p = dm + b * dm_stride + g * 32;  // 16 (d, m) pairs
      const __m512 lo = _mm512_loadu_ps(p), hi = _mm512_loadu_ps(p + 16);
      const __m512 d = _mm512_permutex2var_ps(lo, even, hi);
      const __m512 m = _mm512_permutex2var_ps(lo, odd, hi);
      for (int64_t r = 0; r < R; ++r)
        acc[r][b] = _mm512_fmadd_ps(dot[r][b], d, _mm512_fmadd_ps(m, _mm512_set1_ps(xsum[r * groups + g]), acc[r][b]));
    }
  }
  store_tile<R, B>(acc, nullptr, bias, n0, n, y, ldy);
}

template <int64_t B>
void rows4(const uint16_t* x, const float* xsum, int64_t groups, int64_t m, int64_t k2, const uint8_t* w, int64_t kp,
           const float* dm, const float* bp, int64_t n0, int64_t n, c10::BFloat16* y) {
  int64_t r = 0;
  if constexpr (B == 4) {  // 4 rows x 2 blocks a pass where there are 4 rows: the codes converted once for 4
    for (; r + 4 <= m; r += 4)
      for (int64_t b = 0; b < 4; b += 2)
        tile4<4, 2>(x + r * k2, k2, xsum + r * groups, groups, w + b * kp * 16, kp, dm + b * groups * 32, bp,
                    n0 + 16 * b, n, y + r * n, n);
  }
  for (; r + 2 <= m; r += 2) tile4<2, B>(x + r * k2, k2, xsum + r * groups, groups, w, kp, dm, bp, n0, n, y + r * n, n);
  if (r < m) tile4<1, B>(x + r * k2, k2, xsum + r * groups, groups, w, kp, dm, bp, n0, n, y + r * n, n);
}
#endif

// x [M, K] bf16 (K a multiple of 32), packed [N/16, K/2, 16] uint8, dm [N/16, K/32, 16, 2] float32,
// bias [Npad] float32 -> [M, N] bf16.
at::Tensor woq_int4_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& dm,
                           const c10::optional<at::Tensor>& bias, int64_t n) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(), "woq_int4_linear: x [M, K] bf16");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte && packed.size(2) == 16,
              "woq_int4_linear: packed [N/16, K/2, 16] uint8");
  const int64_t m = x.size(0), kp = packed.size(1), nb = packed.size(0);
  TORCH_CHECK(x.size(1) == 2 * kp && x.size(1) % 32 == 0, "woq_int4_linear: x has ", x.size(1),
              " inputs, the weight ", 2 * kp);
  const int64_t groups = x.size(1) / 32;
  TORCH_CHECK(dm.scalar_type() == at::kFloat && dm.numel() == nb * groups * 32 && n <= nb * 16, "woq_int4_linear: dm");
  auto y = at::empty({m, n}, x.options());
#if defined(__AVX512BF16__)
  const auto xsum = x.view({m, groups, 32}).to(at::kFloat).sum(-1).contiguous();  // [M, groups]
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const float* dp = dm.data_ptr<float>();
  const float* sp = xsum.data_ptr<float>();
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  auto* yp = y.data_ptr<at::BFloat16>();
  const int64_t k2 = 2 * kp, gblocks = (nb + 3) / 4;
  at::parallel_for(0, gblocks, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t blk = g * 4, left = std::min<int64_t>(4, nb - blk);
      const uint8_t* w = wp + blk * kp * 16;
      const float* d = dp + blk * groups * 32;
      if (left == 4) rows4<4>(xp, sp, groups, m, k2, w, kp, d, bp, blk * 16, n, yp);
      else for (int64_t b = 0; b < left; ++b)
        rows4<1>(xp, sp, groups, m, k2, w + b * kp * 16, kp, d + b * groups * 32, bp, (blk + b) * 16, n, yp);
    }
  });
#else
  TORCH_CHECK(false, "woq_int4_linear: needs AVX-512 BF16 (woq_native() is false here)");
#endif
  return y;
}


// Large batches (a prefill chunk): the kernels above convert every code once per ROWS rows, so past a few dozen
// rows they lose to a bf16 GEMM. There the layer's weight is widened instead, transposed, into a bf16 scratch
// [K, Npad] (each group of 32 inputs and block of 16 channels at once; rows of k split across threads), and
// multiplied by oneDNN's bf16 GEMM (at::mm) by the caller. The values are the ones the kernels multiply by.
//   int8: w = q * scale;  int4: w = d q + m (per group)
#if defined(__AVX512BF16__)
// 32 floats of [ch0 t0, ch0 t1, ch1 t0, ...] (lo: channels 0-7, hi: 8-15) -> t0 and t1 over the 16 channels.
inline void deinterleave(__m512 lo, __m512 hi, __m512& t0, __m512& t1) {
  const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  t0 = _mm512_permutex2var_ps(lo, even, hi);
  t1 = _mm512_permutex2var_ps(lo, _mm512_add_epi32(even, _mm512_set1_epi32(1)), hi);
}

inline void store_row16(c10::BFloat16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
}
#endif

// The scratch [K, Npad] bf16 a widened weight is written into: the caller's (reused from call to call: a fresh
// allocation of tens of MB is fresh pages, and faulting them in cost more than the widening on a 1.1B model's layers).
void check_scratch(const at::Tensor& out, int64_t k, int64_t npad, const char* op) {
  TORCH_CHECK(out.scalar_type() == at::kBFloat16 && out.is_contiguous() && out.numel() >= k * npad, op,
              ": out must be a contiguous bf16 scratch of at least ", k * npad, " elements");
}

// packed int8 [N/16, K/2, 16, 2], scale [Npad] float32 -> out: [K, Npad] bf16 (the first K * Npad elements).
void woq_int8_dequant_t(const at::Tensor& packed, const at::Tensor& scale, at::Tensor out) {
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kChar, "woq_int8_dequant_t: packed int8");
  const int64_t nb = packed.size(0), kp = packed.size(1), npad = nb * 16;
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.numel() == npad, "woq_int8_dequant_t: scale");
  check_scratch(out, 2 * kp, npad, "woq_int8_dequant_t");

#if defined(__AVX512BF16__)
  const int8_t* wp = packed.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  auto* dst = out.data_ptr<at::BFloat16>();
  at::parallel_for(0, kp, 16, [&](int64_t k0, int64_t k1) {
    for (int64_t b = 0; b < nb; ++b) {
      const __m512 s = _mm512_loadu_ps(sp + b * 16);
      for (int64_t k = k0; k < k1; ++k) {
        const int8_t* p = wp + (b * kp + k) * 32;
        const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
        const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16))));
        __m512 t0, t1;
        deinterleave(lo, hi, t0, t1);
        store_row16(dst + (2 * k) * npad + b * 16, _mm512_mul_ps(t0, s));
        store_row16(dst + (2 * k + 1) * npad + b * 16, _mm512_mul_ps(t1, s));
      }
    }
  });
#else
  TORCH_CHECK(false, "woq_int8_dequant_t: needs AVX-512 BF16 (woq_native() is false here)");
#endif
}

// packed int4 [N/16, K/2, 16] uint8, dm [N/16, K/32, 16, 2] float32 -> out: [K, Npad] bf16 (the first K * Npad).
void woq_int4_dequant_t(const at::Tensor& packed, const at::Tensor& dm, at::Tensor out) {
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte && packed.size(2) == 16,
              "woq_int4_dequant_t: packed [N/16, K/2, 16] uint8");
  const int64_t nb = packed.size(0), kp = packed.size(1), npad = nb * 16, groups = 2 * kp / 32;
  TORCH_CHECK(2 * kp % 32 == 0 && dm.scalar_type() == at::kFloat && dm.numel() == nb * groups * 32,
              "woq_int4_dequant_t: dm");
  check_scratch(out, 2 * kp, npad, "woq_int4_dequant_t");

#if defined(__AVX512BF16__)
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const float* dp = dm.data_ptr<float>();
  auto* dst = out.data_ptr<at::BFloat16>();
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      for (int64_t b = 0; b < nb; ++b) {
        __m512 d, m;
        const float* q = dp + (b * groups + g) * 32;  // 16 (d, m) pairs
        deinterleave(_mm512_loadu_ps(q), _mm512_loadu_ps(q + 16), d, m);
        for (int64_t k = g * 16; k < (g + 1) * 16; ++k) {
          const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wp + (b * kp + k) * 16));
          const __m128i lo4 = _mm_and_si128(bytes, _mm_set1_epi8(0x0f));
          const __m128i hi4 = _mm_and_si128(_mm_srli_epi16(bytes, 4), _mm_set1_epi8(0x0f));
          __m512 t0, t1;
          deinterleave(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lo4)), _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(hi4)),
                       t0, t1);
          store_row16(dst + (2 * k) * npad + b * 16, _mm512_fmadd_ps(t0, d, m));
          store_row16(dst + (2 * k + 1) * npad + b * 16, _mm512_fmadd_ps(t1, d, m));
        }
      }
    }
  });
#else
  TORCH_CHECK(false, "woq_int4_dequant_t: needs AVX-512 BF16 (woq_native() is false here)");
#endif
}
}  // namespace

TORCH_LIBRARY_FRAGMENT(apt_serve, m) {
  m.def("woq_native() -> bool", &woq_native);
  m.def("woq_int8_linear(Tensor x, Tensor packed, Tensor scale, Tensor? bias, int n) -> Tensor");
  m.def("woq_int4_linear(Tensor x, Tensor packed, Tensor dm, Tensor? bias, int n) -> Tensor");
  m.def("woq_int8_dequant_t(Tensor packed, Tensor scale, Tensor(a!) out) -> ()");
  m.def("woq_int4_dequant_t(Tensor packed, Tensor dm, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(apt_serve, CPU, m) {
  m.impl("woq_int8_linear", &woq_int8_linear);
  m.impl("woq_int4_linear", &woq_int4_linear);
  m.impl("woq_int8_dequant_t", &woq_int8_dequant_t);
  m.impl("woq_int4_dequant_t", &woq_int4_dequant_t);
}
