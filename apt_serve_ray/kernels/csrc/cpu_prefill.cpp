// Causal attention of a prefill chunk over its request's pages, on AVX-512 CPUs.
//
// Query i of the chunk sits at position start_pos + i and attends to keys 0 .. start_pos + i, which
// are all in the request's pages (this step's K/V are written before attention runs). Per kv head
// the context's keys are first packed 16 at a time so that one instruction scores 16 keys:
//
//   bf16 with AVX512-BF16   Kp[block][D/2][16 keys][2]   vdpbf16ps(acc, broadcast(q pair), Kp[block][pair])
//   otherwise               Kp[block][D][16 keys] f32    vfmadd(acc, broadcast(q[d]), Kp[block][d])
//
// then four query rows at a time walk the keys in tiles of 32 with an online softmax. With
// AVX512-BF16 the values are packed too, as pairs of consecutive keys (PackedValues), and the
// weights rounded to bf16 (as flash attention does), so that one vdpbf16ps adds two keys' rows;
// otherwise V rows are read where they sit in the pages and accumulated in float32 (bf16 rows
// split into even/odd lanes; see cpu_attention.cpp). Work items are (query head, 4-row group) on
// ATen's threads.
//
//   q [n, H, D]   k_pages, v_pages [P, BS, KVH, D] (tokens strided)   block_table [>= ceil(ctx / BS)] int32

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "simd.h"
#include "work_queue.h"

#if defined(__AVX512F__)
namespace {

using bf16 = at::BFloat16;
constexpr int kRows = 4;    // query rows per work item
constexpr int kTile = 32;   // keys per softmax update (two blocks of 16)

using apt_simd::to_float;

template <typename T>
constexpr bool kDot = std::is_same_v<T, bf16>
#if defined(__AVX512BF16__)
                      && true;
#else
                      && false;
#endif

// Packed keys of one kv head: bf16 pairs for the dot-product instruction, or float32.
template <typename T>
struct PackedKeys {
  using Elem = std::conditional_t<kDot<T>, uint32_t, float>;  // a bf16 pair, or one float
  std::vector<Elem> data;
  int64_t per_block;  // elements per 16-key block: D/2 pairs x 16, or D x 16

  void reserve(int64_t ctx, int64_t dim) {
    per_block = (kDot<T> ? dim / 2 : dim) * 16;
    data.assign(((ctx + 15) / 16) * per_block, Elem{});
  }

  // Keys j0 .. j1 (j0 a multiple of 16); reserve() first.
  void pack(const T* k_base, int64_t page_stride, int64_t tok_stride, const int32_t* table, int64_t bs,
            int64_t j0, int64_t j1, int64_t dim) {
    for (int64_t j = j0; j < j1; ++j) {
      const T* row = k_base + table[j / bs] * page_stride + (j % bs) * tok_stride;
      Elem* blk = data.data() + (j / 16) * per_block + (j % 16);
      if constexpr (kDot<T>) {
        for (int64_t p = 0; p < dim / 2; ++p) {
          uint32_t pair;
          std::memcpy(&pair, row + 2 * p, sizeof(pair));
          blk[p * 16] = pair;
        }
      } else {
        for (int64_t d = 0; d < dim; ++d) blk[d * 16] = to_float(row[d]);
      }
    }
  }
};

// Values of one kv head as bf16 pairs of consecutive keys (the dot path only):
// Vp[key / 2][D] = (V[2j][d], V[2j+1][d]), so that vdpbf16ps(acc, broadcast(p pair), Vp[pair][16 dims]) adds
// two keys' weighted rows to 16 output lanes in one instruction, in natural dim order. An odd context's
// last pair is padded with zeros (its weight is zero too).
struct PackedValues {
  std::vector<uint32_t> data;

  void reserve(int64_t ctx, int64_t dim) { data.assign(((ctx + 1) / 2) * dim, 0u); }

  // Keys first .. end of ctx (first even); reserve() first.
  void pack(const bf16* v_base, int64_t page_stride, int64_t tok_stride, const int32_t* table, int64_t bs,
            int64_t first, int64_t end, int64_t ctx, int64_t dim) {
    for (int64_t jp = first / 2; jp < (end + 1) / 2; ++jp) {
      const int64_t j0 = 2 * jp, j1 = j0 + 1;
      const bf16* r0 = v_base + table[j0 / bs] * page_stride + (j0 % bs) * tok_stride;
      const bf16* r1 = j1 < ctx ? v_base + table[j1 / bs] * page_stride + (j1 % bs) * tok_stride : nullptr;
      uint32_t* dst = data.data() + jp * dim;
      for (int64_t d = 0; d < dim; d += 16) {
        const __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r0 + d)));
        const __m512i hi = r1 ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r1 + d)))
                              : _mm512_setzero_si512();
        _mm512_storeu_si512(dst + d, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
      }
    }
  }
};

// Accumulate p[r][0..n) x V rows into acc[r] (NV vectors of 16 floats per row; bf16 in split order).
template <typename T, int NV>
inline void accumulate_values(const float* p, const T* const* vrows, int64_t n, int rows, __m512 (*acc)[NV]) {
  for (int64_t j = 0; j < n; ++j) {
    const T* v = vrows[j];
    __m512 vv[NV];
    if constexpr (std::is_same_v<T, bf16>) {
      for (int c = 0; c < NV / 2; ++c) {
        const __m512i raw = _mm512_loadu_si512(v + 32 * c);
        vv[2 * c] = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
        vv[2 * c + 1] = _mm512_castsi512_ps(_mm512_and_si512(raw, _mm512_set1_epi32(int(0xffff0000))));
      }
    } else {
      for (int c = 0; c < NV; ++c) vv[c] = _mm512_loadu_ps(v + 16 * c);
    }
    for (int r = 0; r < rows; ++r) {
      const __m512 pr = _mm512_set1_ps(p[r * kTile + j]);
      for (int c = 0; c < NV; ++c) acc[r][c] = _mm512_fmadd_ps(pr, vv[c], acc[r][c]);
    }
  }
}

// One work item: ROWS consecutive query rows of one head (ROWS a constant, so that the score and output
// accumulators live in registers).
template <typename T, int NV, int ROWS>
void rows_attention(const T* q, int64_t q_stride, int64_t first_pos, const PackedKeys<T>& kp,
                    const PackedValues* vpk, const T* v_base, int64_t page_stride, int64_t tok_stride, const int32_t* table, int64_t bs,
                    int64_t dim, float scale, T* out, int64_t out_stride) {
  using Elem = typename PackedKeys<T>::Elem;
  // Queries: bf16 pairs (dot path) or floats, pre-scaled in the float path.
  constexpr int rows = ROWS;
  alignas(64) Elem qv[kRows][256];
  for (int r = 0; r < rows; ++r) {
    if constexpr (kDot<T>) {
      std::memcpy(qv[r], q + r * q_stride, dim * sizeof(T));
    } else {
      for (int64_t d = 0; d < dim; ++d) qv[r][d] = to_float(q[r * q_stride + d]) * scale;
    }
  }
  const float score_scale = kDot<T> ? scale : 1.f;
  __m512 acc[kRows][NV];
  float m[kRows], l[kRows];
  for (int r = 0; r < kRows; ++r) {
    for (int c = 0; c < NV; ++c) acc[r][c] = _mm512_setzero_ps();
    m[r] = -std::numeric_limits<float>::infinity();
    l[r] = 0.f;
  }
  const int64_t last = first_pos + rows - 1;  // the last row's position: keys 0 .. last
  alignas(64) float p[kRows * kTile];
  alignas(64) uint16_t pb[kRows * kTile];  // the dot path: p as bf16, key order (pairs for vdpbf16ps)
  const T* vrows[kTile];
  for (int64_t t0 = 0; t0 <= last; t0 += kTile) {
    const int64_t n = std::min<int64_t>(kTile, last + 1 - t0);
    __m512 s[kRows][2];
    for (int r = 0; r < kRows; ++r) s[r][0] = s[r][1] = _mm512_setzero_ps();
    // Both blocks of the tile in one pass: 2 x ROWS independent accumulators hide the instruction's latency
    // (one block at a time left ROWS chains, and the dot-product unit mostly waiting).
    const Elem* kb0 = kp.data.data() + (t0 / 16) * kp.per_block;
    const int64_t steps = kDot<T> ? dim / 2 : dim;
    auto score = [&](auto two) {
      constexpr bool kTwo = decltype(two)::value;
      const Elem* kb1 = kb0 + (kTwo ? kp.per_block : 0);
      for (int64_t i = 0; i < steps; ++i) {
        const __m512 kv0 = _mm512_loadu_ps(reinterpret_cast<const float*>(kb0 + i * 16));
        __m512 kv1 = kv0;
        if constexpr (kTwo) kv1 = _mm512_loadu_ps(reinterpret_cast<const float*>(kb1 + i * 16));
        for (int r = 0; r < rows; ++r) {
          if constexpr (kDot<T>) {
#if defined(__AVX512BF16__)
            const __m512bh qr = reinterpret_cast<__m512bh>(_mm512_set1_epi32(int(qv[r][i])));
            s[r][0] = _mm512_dpbf16_ps(s[r][0], qr, reinterpret_cast<__m512bh>(_mm512_castps_si512(kv0)));
            if constexpr (kTwo)
              s[r][1] = _mm512_dpbf16_ps(s[r][1], qr, reinterpret_cast<__m512bh>(_mm512_castps_si512(kv1)));
#endif
          } else {
            const __m512 qr = _mm512_set1_ps(qv[r][i]);
            s[r][0] = _mm512_fmadd_ps(qr, kv0, s[r][0]);
            if constexpr (kTwo) s[r][1] = _mm512_fmadd_ps(qr, kv1, s[r][1]);
          }
        }
      }
    };
    if (n > 16) {
      score(std::true_type{});
    } else {
      score(std::false_type{});
    }
    for (int r = 0; r < rows; ++r) {
      // Causal mask and the tile's tail: key t0 + j is visible to row r iff t0 + j <= first_pos + r.
      const int64_t visible = std::min<int64_t>(n, first_pos + r - t0 + 1);
      __mmask16 keep[2];
      for (int b = 0; b < 2; ++b) {
        const int64_t lo = 16 * b;
        keep[b] = visible <= lo ? 0 : visible >= lo + 16 ? 0xffff : static_cast<__mmask16>((1u << (visible - lo)) - 1);
        s[r][b] = _mm512_mask_mov_ps(_mm512_set1_ps(-std::numeric_limits<float>::infinity()), keep[b],
                                     _mm512_mul_ps(s[r][b], _mm512_set1_ps(score_scale)));
      }
      const float mx = std::max(m[r], _mm512_reduce_max_ps(_mm512_max_ps(s[r][0], s[r][1])));
      const float alpha = std::exp(m[r] - mx);  // 0 on the first tile
      const __m512 vm = _mm512_set1_ps(mx);
      // Masked lanes would give exp(-87) ~ 1e-38 after the clamp: zero them so they add nothing.
      const __m512 q0 = _mm512_maskz_mov_ps(keep[0], apt_simd::vexp_nonpositive(_mm512_sub_ps(s[r][0], vm)));
      const __m512 q1 = _mm512_maskz_mov_ps(keep[1], apt_simd::vexp_nonpositive(_mm512_sub_ps(s[r][1], vm)));
      l[r] = l[r] * alpha + _mm512_reduce_add_ps(_mm512_add_ps(q0, q1));
      m[r] = mx;
      const __m512 va = _mm512_set1_ps(alpha);
      for (int c = 0; c < NV; ++c) acc[r][c] = _mm512_mul_ps(acc[r][c], va);
      if constexpr (kDot<T>) {
#if defined(__AVX512BF16__)
        _mm512_store_si512(pb + r * kTile, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(q1, q0)));
#endif
      } else {
        _mm512_store_ps(p + r * kTile, q0);
        _mm512_store_ps(p + r * kTile + 16, q1);
      }
    }
    if constexpr (kDot<T>) {
#if defined(__AVX512BF16__)
      // Two keys per instruction: the pair's weights broadcast, the pair's value rows packed (PackedValues).
      const uint32_t* vb = vpk->data.data() + (t0 / 2) * dim;
      for (int64_t jp = 0; jp < (n + 1) / 2; ++jp) {
        __m512i vv[NV];
        for (int c = 0; c < NV; ++c) vv[c] = _mm512_loadu_si512(vb + jp * dim + 16 * c);
        for (int r = 0; r < rows; ++r) {
          uint32_t pair;
          std::memcpy(&pair, pb + r * kTile + 2 * jp, sizeof(pair));
          const __m512bh pr = reinterpret_cast<__m512bh>(_mm512_set1_epi32(int(pair)));
          for (int c = 0; c < NV; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], pr, reinterpret_cast<__m512bh>(vv[c]));
        }
      }
#endif
    } else {
      for (int64_t j = 0; j < n; ++j) {
        const int64_t t = t0 + j;
        vrows[j] = v_base + table[t / bs] * page_stride + (t % bs) * tok_stride;
      }
      accumulate_values<T, NV>(p, vrows, n, rows, acc);
    }
  }
  for (int r = 0; r < rows; ++r) {
    alignas(64) float o[256];
    for (int c = 0; c < NV; ++c) _mm512_store_ps(o + 16 * c, _mm512_mul_ps(acc[r][c], _mm512_set1_ps(1.f / l[r])));
    T* dst = out + r * out_stride;
    if constexpr (kDot<T>) {  // natural order already (PackedValues)
      for (int64_t d = 0; d < dim; ++d) dst[d] = bf16(o[d]);
    } else if constexpr (std::is_same_v<T, bf16>) {  // split order per 32 elements -> natural
      for (int64_t c = 0; c < dim; c += 32)
        for (int j = 0; j < 16; ++j) {
          dst[c + 2 * j] = bf16(o[c + j]);
          dst[c + 2 * j + 1] = bf16(o[c + 16 + j]);
        }
    } else {
      for (int64_t d = 0; d < dim; ++d) dst[d] = o[d];
    }
  }
}

template <typename T, int NV>
void prefill_impl(const torch::Tensor& q, const torch::Tensor& kp_t, const torch::Tensor& vp_t,
                  const torch::Tensor& table_t, int64_t start_pos, double scale, torch::Tensor& out) {
  const int64_t n = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t bs = kp_t.size(1), kvh = kp_t.size(2), group = heads / kvh;
  const int64_t ctx = start_pos + n;
  const int32_t* table = table_t.data_ptr<int32_t>();
  std::vector<PackedKeys<T>> keys(kvh);
  std::vector<PackedValues> values(kDot<T> ? kvh : 0);
  for (int64_t g = 0; g < kvh; ++g) {
    keys[g].reserve(ctx, dim);
    if constexpr (kDot<T>) values[g].reserve(ctx, dim);
  }
  // Packing in (kv head, 256 keys) pieces, so that a model with few kv heads packs on every thread too.
  constexpr int64_t kPackKeys = 256;
  const int64_t pieces = (ctx + kPackKeys - 1) / kPackKeys;
  at::parallel_for(0, kvh * pieces, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t g = i / pieces, j0 = (i % pieces) * kPackKeys, j1 = std::min(ctx, j0 + kPackKeys);
      keys[g].pack(kp_t.data_ptr<T>() + g * kp_t.stride(2), kp_t.stride(0), kp_t.stride(1), table, bs, j0, j1, dim);
      if constexpr (kDot<T>)
        values[g].pack(vp_t.data_ptr<T>() + g * vp_t.stride(2), vp_t.stride(0), vp_t.stride(1), table, bs, j0, j1,
                       ctx, dim);
    }
  });
  const int64_t groups = (n + kRows - 1) / kRows, items = heads * groups;
  // Later row groups see more keys (causal): items are taken from a shared counter, the heaviest first, so
  // the threads end together (contiguous ranges gave one thread the light first half and the other three
  // quarters of the work), and a thread the OS preempts holds up only the item it has.
  apt_work::WorkQueue work(items);
  at::parallel_for(0, work.threads(), 1, [&](int64_t, int64_t) {
    for (int64_t i; work.take(i);) {
      const int64_t h = i % heads, row = (groups - 1 - i / heads) * kRows;
      const int64_t g = h / group;
      const T* qr = q.data_ptr<T>() + row * heads * dim + h * dim;
      T* o = out.data_ptr<T>() + row * heads * dim + h * dim;
      const T* vb = vp_t.data_ptr<T>() + g * vp_t.stride(2);
      const PackedValues* vp = kDot<T> ? &values[g] : nullptr;
      switch (std::min<int64_t>(kRows, n - row)) {
#define APT_ROWS(R)                                                                                               \
  case R:                                                                                                         \
    rows_attention<T, NV, R>(qr, heads * dim, start_pos + row, keys[g], vp, vb, vp_t.stride(0), vp_t.stride(1),   \
                             table, bs, dim, float(scale), o, heads * dim);                                       \
    break;
        APT_ROWS(4)
        APT_ROWS(3)
        APT_ROWS(2)
        APT_ROWS(1)
#undef APT_ROWS
      }
    }
  });
}

torch::Tensor prefill_attention(const torch::Tensor& q, const torch::Tensor& k_pages, const torch::Tensor& v_pages,
                                const torch::Tensor& block_table, int64_t start_pos, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "q: expected a contiguous [n, H, D] tensor");
  TORCH_CHECK(k_pages.dim() == 4 && v_pages.sizes() == k_pages.sizes() && k_pages.size(3) == q.size(2) &&
                  k_pages.stride(3) == 1 && v_pages.stride(3) == 1,
              "k_pages, v_pages: expected [P, BS, KVH, D] views with contiguous head rows");
  TORCH_CHECK(q.size(1) % k_pages.size(2) == 0, "q: query heads must be a multiple of the KV heads");
  TORCH_CHECK(q.scalar_type() == k_pages.scalar_type() && v_pages.scalar_type() == q.scalar_type(),
              "q, k_pages and v_pages must share a dtype");
  TORCH_CHECK(block_table.dtype() == torch::kInt32 && block_table.is_contiguous() && block_table.dim() == 1,
              "block_table: expected a contiguous int32 [pages] tensor");
  const int64_t ctx = start_pos + q.size(0);
  TORCH_CHECK(start_pos >= 0 && block_table.numel() * k_pages.size(1) >= ctx,
              "block_table: too few pages for ", ctx, " tokens");
  const int64_t dim = q.size(2);
  TORCH_CHECK(dim % 32 == 0 && dim <= 256, "head_dim: the prefill kernel takes multiples of 32 up to 256");
  auto out = torch::empty_like(q);
  if (q.size(0) == 0) return out;
  const int64_t nv = dim / 16;
#define APT_DISPATCH(T)                                                             \
  switch (nv) {                                                                     \
    case 2: prefill_impl<T, 2>(q, k_pages, v_pages, block_table, start_pos, scale, out); break; \
    case 4: prefill_impl<T, 4>(q, k_pages, v_pages, block_table, start_pos, scale, out); break; \
    case 6: prefill_impl<T, 6>(q, k_pages, v_pages, block_table, start_pos, scale, out); break; \
    case 8: prefill_impl<T, 8>(q, k_pages, v_pages, block_table, start_pos, scale, out); break; \
    default: TORCH_CHECK(false, "head_dim: ", dim, " not compiled in");            \
  }
  if (q.scalar_type() == torch::kFloat) {
    APT_DISPATCH(float)
  } else {
    TORCH_CHECK(q.scalar_type() == torch::kBFloat16, "dtype: float32 or bfloat16 only");
    APT_DISPATCH(bf16)
  }
#undef APT_DISPATCH
  return out;
}

bool prefill_supported(int64_t head_dim) { return head_dim % 32 == 0 && head_dim / 16 <= 8 && head_dim / 16 != 0; }

}  // namespace
#else
namespace {
torch::Tensor prefill_attention(const torch::Tensor& q, const torch::Tensor&, const torch::Tensor&,
                                const torch::Tensor&, int64_t, double) {
  TORCH_CHECK(false, "prefill_attention: this build has no AVX-512 (use the PyTorch path)");
  return q;
}
bool prefill_supported(int64_t) { return false; }
}  // namespace
#endif

TORCH_LIBRARY_FRAGMENT(apt_serve, m) {
  m.def("prefill_attention(Tensor q, Tensor k_pages, Tensor v_pages, Tensor block_table, int start_pos, "
        "float scale) -> Tensor");
  m.def("prefill_supported(int head_dim) -> bool", &prefill_supported);
}

TORCH_LIBRARY_IMPL(apt_serve, CPU, m) { m.impl("prefill_attention", &prefill_attention); }
