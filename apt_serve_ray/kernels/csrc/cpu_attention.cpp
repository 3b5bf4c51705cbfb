// Decode attention over the paged hybrid cache on CPU, reading pages where they sit.
//
// Flash-decoding: every request's context is cut into partitions of whole pages; a work item
// (request, partition) streams its pages once, keeps an online softmax per query head, and writes
// a partial (max, sum, accumulator). Items run on ATen's OpenMP threads; a second pass merges the
// partials of each request. One thread and a short context give one item per request.
//
// Three readers share that skeleton:
//   kv_decode          KV pages   [P, BS, 2, KVH, D]: scores q.k, accumulate v            (out [B,H,D])
//   hidden_absorbed    hidden     [P, TPP, HID] (page stride free), no RoPE:
//                      q.(W_k x + b_k) = (W_k^T q).x + const, so with qk = scale * W_k^T q the scores
//                      are qk.x and the output is W_v (sum p x) + b_v: accumulate x   (y [B,H,HID])
//                      K and V are never formed; the caller applies W_k^T before and W_v after.
//   hidden_projected   hidden pages with RoPE: per page K|V = x W_kv^T + b (one small GEMM into a
//                      thread-local tile), K rotated at the tokens' positions, then as kv_decode.
//
// Vector layout. W float lanes (AVX-512: 16, AVX2: 8, else 1). A bf16 row is read 2W elements at a
// time as W 32-bit lanes: `lane << 16` is the even element as a float, `lane & 0xffff0000` the odd
// one (no shuffles). Rows that meet bf16 data are therefore kept "split" per 2W-element chunk:
//     natural  [e0 e1 e2 e3 ... e(2W-1)]      split  [e0 e2 ... e(2W-2) | e1 e3 ... e(2W-1)]
// The query (scores) and the accumulator (values) use the split order when the data they meet is
// bf16 and the head dim allows it; accumulators go back to natural order when a partial is written.

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

// Rows of NQ * W elements in registers. float data: NQ loads; bf16 data: NQ / 2 raw loads, split.
template <int NQ, typename T>
inline float score_row(const vf* q, const T* k) {
  vf a = vzero(), b = vzero();
  if constexpr (is_bf16<T>) {
    for (int c = 0; c < NQ / 2; ++c) {
      const vi r = vload_raw(k + 2 * c * W);
      a = vfma(q[2 * c], bf16_even(r), a);
      b = vfma(q[2 * c + 1], bf16_odd(r), b);
    }
  } else {
    for (int c = 0; c < NQ; c += 2) {
      a = vfma(q[c], vload(k + c * W), a);
      if (c + 1 < NQ) b = vfma(q[c + 1], vload(k + (c + 1) * W), b);
    }
  }
  return vsum(vadd(a, b));
}
template <int NQ, typename T>
inline void accumulate_row(vf* acc, vf p, const T* v) {
  if constexpr (is_bf16<T>) {
    for (int c = 0; c < NQ / 2; ++c) {
      const vi r = vload_raw(v + 2 * c * W);
      acc[2 * c] = vfma(p, bf16_even(r), acc[2 * c]);
      acc[2 * c + 1] = vfma(p, bf16_odd(r), acc[2 * c + 1]);
    }
  } else {
    for (int c = 0; c < NQ; ++c) acc[c] = vfma(p, vload(v + c * W), acc[c]);
  }
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

struct Item {
  int64_t b, start, end;  // tokens [start, end) of request b
};

// Partitions of whole pages. part_tokens <= 0: automatic (no split with one thread; otherwise
// about four items per thread, at least four pages each).
std::vector<Item> make_items(const int32_t* lens, int64_t batch, int64_t tpp, int64_t part_tokens) {
  int64_t part = part_tokens;
  if (part <= 0) {
    const int64_t threads = at::get_num_threads();
    if (threads <= 1) {
      part = std::numeric_limits<int64_t>::max() / 2;
    } else {
      int64_t total = 0;
      for (int64_t b = 0; b < batch; ++b) total += lens[b];
      part = std::max<int64_t>(4 * tpp, (total + 4 * threads - 1) / (4 * threads));
    }
  }
  part = std::max<int64_t>(tpp, (part + tpp - 1) / tpp * tpp);
  std::vector<Item> items;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t len = lens[b];
    TORCH_CHECK(len > 0, "ctx_lens: every request needs at least one token, request ", b, " has ", len);
    for (int64_t s = 0; s < len; s += part) items.push_back({b, s, std::min(len, s + part)});
  }
  return items;
}

// Online-softmax state of one item: per head the running max, the sum, the accumulator [dout].
struct Partial {
  std::vector<float> m, l, acc;
  int64_t heads, dout;
  Partial(int64_t heads_, int64_t dout_) : m(heads_), l(heads_), acc(heads_ * dout_), heads(heads_), dout(dout_) {}
  void init() {
    std::fill(m.begin(), m.end(), -std::numeric_limits<float>::infinity());
    std::fill(l.begin(), l.end(), 0.f);
    std::fill(acc.begin(), acc.end(), 0.f);
  }
  // Scores s[h][0..n) of one page -> probabilities in place; rescales acc and l.
  void absorb_scores(float* s, int64_t stride, int64_t n) {
    const int64_t full = n / W * W;
    for (int64_t h = 0; h < heads; ++h) {
      float* sh = s + h * stride;
      vf vm = vset1(m[h]);
      for (int64_t t = 0; t < full; t += W) vm = vmax(vm, vload(sh + t));
      float mx = vmax_all(vm);
      for (int64_t t = full; t < n; ++t) mx = std::max(mx, sh[t]);
      if (mx > m[h]) {
        const float alpha = std::exp(m[h] - mx);  // 0 on the first page (m = -inf)
        l[h] *= alpha;
        float* a = acc.data() + h * dout;
        int64_t d = 0;
        for (; d + W <= dout; d += W) vstore(a + d, vmul(vload(a + d), vset1(alpha)));
        for (; d < dout; ++d) a[d] *= alpha;
        m[h] = mx;
      }
      const vf vmx = vset1(mx);
      vf vs = vzero();
      for (int64_t t = 0; t < full; t += W) {
        const vf p = vexp_nonpositive(vadd(vload(sh + t), vmul(vmx, vset1(-1.f))));
        vstore(sh + t, p);
        vs = vadd(vs, p);
      }
      float sum = vsum(vs);
      for (int64_t t = full; t < n; ++t) {
        sh[t] = exp_nonpositive(sh[t] - mx);
        sum += sh[t];
      }
      l[h] += sum;
    }
  }
  // -> partials row [heads, 2 + dout], the accumulator in natural order.
  void write(float* p, bool acc_split) const {
    const int64_t row = 2 + dout;
    for (int64_t h = 0; h < heads; ++h) {
      p[h * row] = m[h];
      p[h * row + 1] = l[h];
      if (acc_split)
        unsplit_row(acc.data() + h * dout, p + h * row + 2, dout);
      else
        std::copy(acc.begin() + h * dout, acc.begin() + (h + 1) * dout, p + h * row + 2);
    }
  }
};

// partials: [items, heads, 2 + dout] floats; items of one request are consecutive.
template <typename Out>
void merge(const std::vector<Item>& items, const float* partials, int64_t heads, int64_t dout, int64_t batch,
           Out* out, const float* bias /* [heads, dout] or null */) {
  std::vector<int64_t> first(batch + 1, 0);
  for (const auto& it : items) first[it.b + 1]++;
  for (int64_t b = 0; b < batch; ++b) first[b + 1] += first[b];
  const int64_t row = 2 + dout;
  at::parallel_for(0, batch, 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> acc(dout);
    for (int64_t b = b0; b < b1; ++b) {
      for (int64_t h = 0; h < heads; ++h) {
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t i = first[b]; i < first[b + 1]; ++i) mx = std::max(mx, partials[(i * heads + h) * row]);
        float l = 0.f;
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int64_t i = first[b]; i < first[b + 1]; ++i) {
          const float* p = partials + (i * heads + h) * row;
          const float w = std::exp(p[0] - mx);
          l += w * p[1];
          axpy_scalar(acc.data(), w, p + 2, dout);
        }
        const float inv = 1.f / l;
        Out* o = out + (b * heads + h) * dout;
        const float* bh = bias ? bias + h * dout : nullptr;
        for (int64_t d = 0; d < dout; ++d) store(o + d, acc[d] * inv + (bh ? bh[d] : 0.f));
      }
    }
  });
}

// One page, all query heads ------------------------------------------------------------------------
//   K of token t, kv head g: kb + t * k_tok + g * dim      V: vb + t * v_tok + g * dim
// NQ = dim / W vectors per head row in registers (the query, then the accumulator); NQ = 0 is the
// generic path. ahead != 0: bytes from this page to the next, whose rows are prefetched as this
// page's are read (pages are scattered; the hardware prefetchers stop at their boundaries).
template <int NQ, typename TK, typename TV>
void attend_page(const TK* kb, int64_t k_tok, const TV* vb, int64_t v_tok, int64_t n, int64_t heads, int64_t group,
                 int64_t dim, const float* qf, float* s, int64_t s_stride, Partial& st, int64_t ahead) {
  const int64_t k_bytes = dim * int64_t(sizeof(TK)), v_bytes = dim * int64_t(sizeof(TV));
  for (int64_t h = 0; h < heads; ++h) {
    const TK* k = kb + (h / group) * dim;
    float* sh = s + h * s_stride;
    if constexpr (NQ > 0) {
      vf q[NQ];
      for (int c = 0; c < NQ; ++c) q[c] = vload(qf + h * dim + c * W);
      for (int64_t t = 0; t < n; ++t) {
        const TK* kt = k + t * k_tok;
        if (ahead != 0 && h % group == 0)
          for (int64_t off = 0; off < k_bytes; off += 64) prefetch(reinterpret_cast<const char*>(kt) + ahead + off);
        sh[t] = score_row<NQ>(q, kt);
      }
    } else {
      for (int64_t t = 0; t < n; ++t) sh[t] = dot_scalar(qf + h * dim, k + t * k_tok, dim);
    }
  }
  st.absorb_scores(s, s_stride, n);
  for (int64_t h = 0; h < heads; ++h) {
    const TV* v = vb + (h / group) * dim;
    const float* sh = s + h * s_stride;
    float* acc = st.acc.data() + h * dim;
    if constexpr (NQ > 0) {
      vf a[NQ];
      for (int c = 0; c < NQ; ++c) a[c] = vload(acc + c * W);
      for (int64_t t = 0; t < n; ++t) {
        const TV* vt = v + t * v_tok;
        if (ahead != 0 && h % group == 0)
          for (int64_t off = 0; off < v_bytes; off += 64) prefetch(reinterpret_cast<const char*>(vt) + ahead + off);
        accumulate_row<NQ>(a, vset1(sh[t]), vt);
      }
      for (int c = 0; c < NQ; ++c) vstore(acc + c * W, a[c]);
    } else {
      for (int64_t t = 0; t < n; ++t) axpy_scalar(acc, sh[t], v + t * v_tok, dim);
    }
  }
}

template <typename TK, typename TV>
struct PagePath {
  void (*fn)(const TK*, int64_t, const TV*, int64_t, int64_t, int64_t, int64_t, int64_t, const float*, float*,
             int64_t, Partial&, int64_t);
  bool q_split, acc_split;  // rows in split order (see the top)
};

template <typename TK, typename TV>
PagePath<TK, TV> page_path(int64_t dim) {
  const bool needs_pairs = is_bf16<TK> || is_bf16<TV>;
  if (dim % W == 0 && (!needs_pairs || (dim / W) % 2 == 0)) {
    const bool qs = is_bf16<TK>, as = is_bf16<TV>;
    switch (dim / W) {
      case 1: return {attend_page<1, TK, TV>, qs, as};  // float only: bf16 needs pairs of vectors
      case 2: return {attend_page<2, TK, TV>, qs, as};
      case 4: return {attend_page<4, TK, TV>, qs, as};
      case 8: return {attend_page<8, TK, TV>, qs, as};
      case 16: return {attend_page<16, TK, TV>, qs, as};
      default: break;
    }
  }
  return {attend_page<0, TK, TV>, false, false};
}

// The query rows of request b, scaled, in the order the page path reads them.
template <typename T>
void load_query(const T* q, int64_t heads, int64_t dim, float scale, bool split, float* qf, float* tmp) {
  for (int64_t h = 0; h < heads; ++h) {
    float* dst = split ? tmp : qf + h * dim;
    for (int64_t d = 0; d < dim; ++d) dst[d] = to_float(q[h * dim + d]) * scale;
    if (split) split_row(tmp, qf + h * dim, dim);
  }
}

void check_table(const torch::Tensor& table, const torch::Tensor& lens, int64_t batch) {
  TORCH_CHECK(table.dtype() == torch::kInt32 && table.is_contiguous() && table.dim() == 2 && table.size(0) == batch,
              "block_table: expected a contiguous int32 [B, max_pages] tensor");
  TORCH_CHECK(lens.dtype() == torch::kInt32 && lens.is_contiguous() && lens.numel() == batch,
              "ctx_lens: expected a contiguous int32 [B] tensor");
}

// KV pages ----------------------------------------------------------------------------------------
template <typename T>
void kv_decode_impl(const torch::Tensor& q, const torch::Tensor& kv, const torch::Tensor& table,
                    const torch::Tensor& lens, double scale, int64_t part_tokens, torch::Tensor& out) {
  const int64_t batch = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t bs = kv.size(1), kvh = kv.size(3), group = heads / kvh;
  const int64_t page_stride = kv.stride(0), tok_stride = kv.stride(1), v_off = kv.stride(2);
  const T* kv_base = kv.data_ptr<T>();
  const T* q_base = q.data_ptr<T>();
  const int32_t* tab = table.data_ptr<int32_t>();
  const int64_t max_pages = table.size(1);
  const auto items = make_items(lens.data_ptr<int32_t>(), batch, bs, part_tokens);
  const int64_t row = 2 + dim;
  std::vector<float> partials(items.size() * heads * row);
  const auto path = page_path<T, T>(dim);
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> qf(heads * dim), tmp(dim), s(heads * bs);
    Partial st(heads, dim);
    for (int64_t i = i0; i < i1; ++i) {
      const Item& it = items[i];
      load_query(q_base + it.b * heads * dim, heads, dim, float(scale), path.q_split, qf.data(), tmp.data());
      st.init();
      for (int64_t t0 = it.start; t0 < it.end; t0 += bs) {
        const int64_t n = std::min(bs, it.end - t0);
        const T* pg = kv_base + tab[it.b * max_pages + t0 / bs] * page_stride;
        const T* next = t0 + bs < it.end ? kv_base + tab[it.b * max_pages + t0 / bs + 1] * page_stride : pg;
        path.fn(pg, tok_stride, pg + v_off, tok_stride, n, heads, group, dim, qf.data(), s.data(), bs, st,
                reinterpret_cast<const char*>(next) - reinterpret_cast<const char*>(pg));
      }
      st.write(partials.data() + i * heads * row, path.acc_split);
    }
  });
  merge(items, partials.data(), heads, dim, batch, out.data_ptr<T>(), nullptr);
}

torch::Tensor kv_decode(const torch::Tensor& q, const torch::Tensor& kv, const torch::Tensor& table,
                        const torch::Tensor& lens, double scale, int64_t part_tokens) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "q: expected a contiguous [B, H, D] tensor");
  TORCH_CHECK(kv.dim() == 5 && kv.size(2) == 2 && kv.size(4) == q.size(2) && kv.stride(4) == 1 &&
                  kv.stride(3) == kv.size(4) && kv.stride(2) == kv.size(3) * kv.size(4),
              "kv: expected pages [P, BS, 2, KVH, D] with contiguous tokens");
  TORCH_CHECK(q.size(1) % kv.size(3) == 0, "q: query heads must be a multiple of the KV heads");
  TORCH_CHECK(q.scalar_type() == kv.scalar_type(), "q and kv must share a dtype");
  check_table(table, lens, q.size(0));
  auto out = torch::empty_like(q);
  if (q.size(0) == 0) return out;
  if (q.scalar_type() == torch::kFloat) {
    kv_decode_impl<float>(q, kv, table, lens, scale, part_tokens, out);
  } else {
    TORCH_CHECK(q.scalar_type() == torch::kBFloat16, "dtype: float32 or bfloat16 only");
    kv_decode_impl<bf16>(q, kv, table, lens, scale, part_tokens, out);
  }
  return out;
}

// Hidden pages, absorbed (no RoPE) --------------------------------------------------------------------
// Rows are the hidden size (hundreds to thousands), so a page is two small matrix products:
//   scores [H, n] = qk [H, HID] . x [n, HID]^T     blocks of 4 tokens x 2 heads (16 accumulators)
//   acc    [H, HID] += p [H, n] . x [n, HID]       blocks of 4 heads x one 2W-column block, the
//                                                  accumulators in registers across the page's tokens
// Each block reads a 2W-column slice of x once for several heads or tokens. ``fast`` needs HID a
// multiple of 2W (float rows are then read in natural order, bf16 rows split; see the top).
template <typename T>
inline void load_cols(const T* x, vf& e, vf& o) {
  if constexpr (is_bf16<T>) {
    const vi r = vload_raw(x);
    e = bf16_even(r);
    o = bf16_odd(r);
  } else {
    e = vload(x);
    o = vload(x + W);
  }
}

// Scores of tokens [t, t + NT) against heads [h, h + NH) over the whole row.
template <int NT, int NH, typename T>
inline void hidden_scores_block(const T* x0, int64_t tok_stride, const float* q0, int64_t hid, float* s,
                                int64_t s_stride) {
  vf a[NT][NH][2];
  for (int j = 0; j < NT; ++j)
    for (int k = 0; k < NH; ++k) a[j][k][0] = a[j][k][1] = vzero();
  for (int64_t i = 0; i < hid; i += 2 * W) {
    vf qe[NH], qo[NH];
    for (int k = 0; k < NH; ++k) {
      qe[k] = vload(q0 + k * hid + i);
      qo[k] = vload(q0 + k * hid + i + W);
    }
    for (int j = 0; j < NT; ++j) {
      vf e, o;
      load_cols(x0 + j * tok_stride + i, e, o);
      for (int k = 0; k < NH; ++k) {
        a[j][k][0] = vfma(qe[k], e, a[j][k][0]);
        a[j][k][1] = vfma(qo[k], o, a[j][k][1]);
      }
    }
  }
  for (int j = 0; j < NT; ++j)
    for (int k = 0; k < NH; ++k) s[k * s_stride + j] = vsum(vadd(a[j][k][0], a[j][k][1]));
}

// acc[h .. h + NH) columns [i, i + 2W) += sum over the page's n tokens of p[h][t] x[t].
template <int NH, typename T>
inline void hidden_values_block(const T* x0, int64_t tok_stride, int64_t n, const float* p, int64_t s_stride,
                                float* acc, int64_t hid) {
  vf a[NH][2];
  for (int k = 0; k < NH; ++k) {
    a[k][0] = vload(acc + k * hid);
    a[k][1] = vload(acc + k * hid + W);
  }
  for (int64_t t = 0; t < n; ++t) {
    vf e, o;
    load_cols(x0 + t * tok_stride, e, o);
    for (int k = 0; k < NH; ++k) {
      const vf pk = vset1(p[k * s_stride + t]);
      a[k][0] = vfma(pk, e, a[k][0]);
      a[k][1] = vfma(pk, o, a[k][1]);
    }
  }
  for (int k = 0; k < NH; ++k) {
    vstore(acc + k * hid, a[k][0]);
    vstore(acc + k * hid + W, a[k][1]);
  }
}

template <typename T>
void hidden_page(const T* pg, int64_t tok_stride, int64_t n, int64_t heads, int64_t hid, const float* qk, float* s,
                 int64_t s_stride, Partial& st, bool fast) {
  if (!fast) {
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t t = 0; t < n; ++t) s[h * s_stride + t] = dot_scalar(qk + h * hid, pg + t * tok_stride, hid);
    st.absorb_scores(s, s_stride, n);
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t t = 0; t < n; ++t) axpy_scalar(st.acc.data() + h * hid, s[h * s_stride + t], pg + t * tok_stride, hid);
    return;
  }
  int64_t h = 0;
  for (; h + 2 <= heads; h += 2) {
    int64_t t = 0;
    for (; t + 4 <= n; t += 4)
      hidden_scores_block<4, 2>(pg + t * tok_stride, tok_stride, qk + h * hid, hid, s + h * s_stride + t, s_stride);
    for (; t < n; ++t)
      hidden_scores_block<1, 2>(pg + t * tok_stride, tok_stride, qk + h * hid, hid, s + h * s_stride + t, s_stride);
  }
  for (; h < heads; ++h) {
    int64_t t = 0;
    for (; t + 4 <= n; t += 4)
      hidden_scores_block<4, 1>(pg + t * tok_stride, tok_stride, qk + h * hid, hid, s + h * s_stride + t, s_stride);
    for (; t < n; ++t)
      hidden_scores_block<1, 1>(pg + t * tok_stride, tok_stride, qk + h * hid, hid, s + h * s_stride + t, s_stride);
  }
  st.absorb_scores(s, s_stride, n);
  float* acc = st.acc.data();
  for (int64_t i = 0; i < hid; i += 2 * W) {
    int64_t k = 0;
    for (; k + 4 <= heads; k += 4)
      hidden_values_block<4>(pg + i, tok_stride, n, s + k * s_stride, s_stride, acc + k * hid + i, hid);
    for (; k < heads; ++k)
      hidden_values_block<1>(pg + i, tok_stride, n, s + k * s_stride, s_stride, acc + k * hid + i, hid);
  }
}

template <typename T>
void hidden_absorbed_impl(const torch::Tensor& qk, const torch::Tensor& hidden, const torch::Tensor& table,
                          const torch::Tensor& lens, int64_t part_tokens, torch::Tensor& y) {
  const int64_t batch = qk.size(0), heads = qk.size(1), hid = qk.size(2);
  const int64_t tpp = hidden.size(1), page_stride = hidden.stride(0), tok_stride = hidden.stride(1);
  const T* x_base = hidden.data_ptr<T>();
  const float* qk_base = qk.data_ptr<float>();
  const int32_t* tab = table.data_ptr<int32_t>();
  const int64_t max_pages = table.size(1);
  const auto items = make_items(lens.data_ptr<int32_t>(), batch, tpp, part_tokens);
  const int64_t row = 2 + hid;
  // float rows are read in natural order two vectors at a time; bf16 rows split (see the top).
  const bool fast = hid % (2 * W) == 0;
  const bool split = fast && is_bf16<T>;
  std::vector<float> partials(items.size() * heads * row);
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> q(heads * hid), s(heads * tpp);
    Partial st(heads, hid);
    for (int64_t i = i0; i < i1; ++i) {
      const Item& it = items[i];
      const float* qb = qk_base + it.b * heads * hid;
      if (split)
        for (int64_t h = 0; h < heads; ++h) split_row(qb + h * hid, q.data() + h * hid, hid);
      else
        std::copy(qb, qb + heads * hid, q.begin());
      st.init();
      for (int64_t t0 = it.start; t0 < it.end; t0 += tpp) {
        const int64_t n = std::min(tpp, it.end - t0);
        const T* pg = x_base + tab[it.b * max_pages + t0 / tpp] * page_stride;
        if (t0 + tpp < it.end) {  // the next page, while this one is attended
          const char* next = reinterpret_cast<const char*>(x_base + tab[it.b * max_pages + t0 / tpp + 1] * page_stride);
          const int64_t bytes = std::min(tpp, it.end - t0 - tpp) * tok_stride * int64_t(sizeof(T));
          for (int64_t off = 0; off < bytes; off += 64) prefetch(next + off);
        }
        hidden_page(pg, tok_stride, n, heads, hid, q.data(), s.data(), tpp, st, fast);
      }
      st.write(partials.data() + i * heads * row, split);
    }
  });
  merge(items, partials.data(), heads, hid, batch, y.data_ptr<float>(), nullptr);
}

torch::Tensor hidden_absorbed(const torch::Tensor& qk, const torch::Tensor& hidden, const torch::Tensor& table,
                              const torch::Tensor& lens, int64_t part_tokens) {
  TORCH_CHECK(qk.dim() == 3 && qk.is_contiguous() && qk.scalar_type() == torch::kFloat,
              "qk: expected a contiguous float32 [B, H, HID] tensor");
  TORCH_CHECK(hidden.dim() == 3 && hidden.stride(2) == 1 && hidden.stride(1) == hidden.size(2) &&
                  hidden.size(2) == qk.size(2),
              "hidden: expected pages [P, TPP, HID] with contiguous tokens (page stride free)");
  check_table(table, lens, qk.size(0));
  auto y = torch::empty_like(qk);
  if (qk.size(0) == 0) return y;
  if (hidden.scalar_type() == torch::kFloat) {
    hidden_absorbed_impl<float>(qk, hidden, table, lens, part_tokens, y);
  } else {
    TORCH_CHECK(hidden.scalar_type() == torch::kBFloat16, "dtype: float32 or bfloat16 only");
    hidden_absorbed_impl<bf16>(qk, hidden, table, lens, part_tokens, y);
  }
  return y;
}

// Hidden pages, projected per page (RoPE) ----------------------------------------------------------
//   tile [n, 2, KVH, D] = x_page[:n] @ w_kv_t  (model dtype, one GEMM per page, thread-local)
//   kf   [n, KVH, D]    = rotate(tile K + b_k) in float32 at positions t0 .. t0 + n
template <typename T>
void hidden_projected_impl(const torch::Tensor& q, const torch::Tensor& hidden, const torch::Tensor& table,
                           const torch::Tensor& lens, const torch::Tensor& w_kv_t, const torch::Tensor& b_kv,
                           const torch::Tensor& cos, const torch::Tensor& sin, int64_t num_kv_heads, double scale,
                           int64_t part_tokens, torch::Tensor& out) {
  const int64_t batch = q.size(0), heads = q.size(1), dim = q.size(2), half = dim / 2;
  const int64_t kvh = num_kv_heads, group = heads / kvh, kv_dim = kvh * dim;
  const int64_t tpp = hidden.size(1);
  const T* q_base = q.data_ptr<T>();
  const int32_t* tab = table.data_ptr<int32_t>();
  const int64_t max_pages = table.size(1);
  const bool has_bias = b_kv.defined() && b_kv.numel() > 0;
  std::vector<float> bias(2 * kv_dim, 0.f);
  if (has_bias) {
    auto bf = b_kv.to(torch::kFloat).contiguous();
    std::copy(bf.data_ptr<float>(), bf.data_ptr<float>() + 2 * kv_dim, bias.begin());
  }
  const bool has_rope = cos.defined() && cos.numel() > 0;
  torch::Tensor cosf, sinf;
  if (has_rope) {
    cosf = cos.to(torch::kFloat).contiguous();
    sinf = sin.to(torch::kFloat).contiguous();
  }
  const float* cp = has_rope ? cosf.data_ptr<float>() : nullptr;
  const float* sp = has_rope ? sinf.data_ptr<float>() : nullptr;
  const auto items = make_items(lens.data_ptr<int32_t>(), batch, tpp, part_tokens);
  const int64_t row = 2 + dim;
  std::vector<float> partials(items.size() * heads * row);
  const auto path = page_path<float, T>(dim);
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> qf(heads * dim), tmp(dim), s(heads * tpp), kf(tpp * kv_dim);
    Partial st(heads, dim);
    auto tile = torch::empty({tpp, 2 * kv_dim}, w_kv_t.options());
    for (int64_t i = i0; i < i1; ++i) {
      const Item& it = items[i];
      load_query(q_base + it.b * heads * dim, heads, dim, float(scale), path.q_split, qf.data(), tmp.data());
      st.init();
      for (int64_t t0 = it.start; t0 < it.end; t0 += tpp) {
        const int64_t page = tab[it.b * max_pages + t0 / tpp];
        const int64_t n = std::min(tpp, it.end - t0);
        auto kv = tile.narrow(0, 0, n);
        at::mm_out(kv, hidden.select(0, page).narrow(0, 0, n), w_kv_t);
        const T* kvp = kv.data_ptr<T>();
        for (int64_t t = 0; t < n; ++t) {
          const T* kt = kvp + t * 2 * kv_dim;
          float* ko = kf.data() + t * kv_dim;
          for (int64_t c = 0; c < kv_dim; ++c) ko[c] = to_float(kt[c]) + bias[c];
          if (has_rope) {
            const float* c = cp + (t0 + t) * dim;
            const float* sn = sp + (t0 + t) * dim;
            for (int64_t g = 0; g < kvh; ++g) {
              float* k = ko + g * dim;
              for (int64_t d = 0; d < half; ++d) {  // rotate-half
                const float a = k[d], b = k[d + half];
                k[d] = a * c[d] - b * sn[d];
                k[d + half] = b * c[d + half] + a * sn[d + half];
              }
            }
          }
        }
        path.fn(kf.data(), kv_dim, kvp + kv_dim, 2 * kv_dim, n, heads, group, dim, qf.data(), s.data(), tpp, st, 0);
      }
      st.write(partials.data() + i * heads * row, path.acc_split);
    }
  });
  // V's bias comes out of the sum unchanged (the probabilities sum to 1): add it once per head.
  std::vector<float> vbias(heads * dim, 0.f);
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t d = 0; d < dim; ++d) vbias[h * dim + d] = bias[kv_dim + (h / group) * dim + d];
  merge(items, partials.data(), heads, dim, batch, out.data_ptr<T>(), has_bias ? vbias.data() : nullptr);
}

torch::Tensor hidden_projected(const torch::Tensor& q, const torch::Tensor& hidden, const torch::Tensor& table,
                               const torch::Tensor& lens, const torch::Tensor& w_kv_t,
                               const c10::optional<torch::Tensor>& b_kv, const c10::optional<torch::Tensor>& cos,
                               const c10::optional<torch::Tensor>& sin, int64_t num_kv_heads, double scale,
                               int64_t part_tokens) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "q: expected a contiguous [B, H, D] tensor");
  TORCH_CHECK(hidden.dim() == 3 && hidden.stride(2) == 1 && hidden.stride(1) == hidden.size(2),
              "hidden: expected pages [P, TPP, HID] with contiguous tokens (page stride free)");
  TORCH_CHECK(num_kv_heads > 0 && q.size(1) % num_kv_heads == 0, "num_kv_heads must divide the query heads");
  TORCH_CHECK(w_kv_t.dim() == 2 && w_kv_t.size(0) == hidden.size(2) && w_kv_t.size(1) == 2 * num_kv_heads * q.size(2),
              "w_kv_t: expected a [HID, 2 * KVH * D] tensor (K columns, then V; e.g. w_kv.t())");
  TORCH_CHECK(q.scalar_type() == hidden.scalar_type() && w_kv_t.scalar_type() == q.scalar_type(),
              "q, hidden and w_kv_t must share a dtype");
  TORCH_CHECK(q.size(2) % 2 == 0, "head_dim must be even");
  check_table(table, lens, q.size(0));
  auto out = torch::empty_like(q);
  if (q.size(0) == 0) return out;
  const torch::Tensor bias = b_kv.has_value() ? *b_kv : torch::Tensor();
  const torch::Tensor c = cos.has_value() ? *cos : torch::Tensor();
  const torch::Tensor s = sin.has_value() ? *sin : torch::Tensor();
  TORCH_CHECK(c.defined() == s.defined(), "cos and sin go together");
  if (c.defined()) {
    const int64_t max_len = lens.max().item<int32_t>();
    TORCH_CHECK(c.dim() == 2 && c.size(1) == q.size(2) && c.size(0) >= max_len, "cos: expected [>= max ctx, D]");
  }
  if (q.scalar_type() == torch::kFloat) {
    hidden_projected_impl<float>(q, hidden, table, lens, w_kv_t, bias, c, s, num_kv_heads, scale, part_tokens, out);
  } else {
    TORCH_CHECK(q.scalar_type() == torch::kBFloat16, "dtype: float32 or bfloat16 only");
    hidden_projected_impl<bf16>(q, hidden, table, lens, w_kv_t, bias, c, s, num_kv_heads, scale, part_tokens, out);
  }
  return out;
}

}  // namespace

// Registered as torch ops (torch.ops.apt_serve.*): visible to the profiler, opaque to torch.compile.
TORCH_LIBRARY(apt_serve, m) {
  m.def("kv_decode(Tensor q, Tensor kv, Tensor block_table, Tensor ctx_lens, float scale, int part_tokens) -> Tensor");
  m.def("hidden_absorbed(Tensor qk, Tensor hidden, Tensor block_table, Tensor ctx_lens, int part_tokens) -> Tensor");
  m.def("hidden_projected(Tensor q, Tensor hidden, Tensor block_table, Tensor ctx_lens, Tensor w_kv_t, Tensor? b_kv, "
        "Tensor? cos, Tensor? sin, int num_kv_heads, float scale, int part_tokens) -> Tensor");
}

TORCH_LIBRARY_IMPL(apt_serve, CPU, m) {
  m.impl("kv_decode", &kv_decode);
  m.impl("hidden_absorbed", &hidden_absorbed);
  m.impl("hidden_projected", &hidden_projected);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {}
