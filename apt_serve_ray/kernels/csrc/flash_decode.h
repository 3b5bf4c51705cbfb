// The flash-decoding skeleton shared by the decode kernels: work items (request, partition of
// whole pages), the online-softmax state of an item, the merge of a request's partials, and one
// page of KV-shaped rows (K and V rows of head_dim) attended by every query head.
//
// Flash-decoding: every request's context is cut into partitions of whole pages; a work item
// streams its pages once, keeps an online softmax per query head, and writes a partial (max, sum,
// accumulator). Items run on ATen's OpenMP threads; a second pass merges the partials of each
// request. One thread and a short context give one item per request.
#pragma once

#include "simd.h"

namespace apt_simd {
namespace {

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

// partials: [items, heads, 2 + dout] floats; items of one request are consecutive. lse (null, or
// [batch, heads]): the log of each head's softmax denominator (max + log sum), in the scores' scale,
// so that attention over two segments of a context, each by itself, merges into attention over both.
template <typename Out>
void merge(const std::vector<Item>& items, const float* partials, int64_t heads, int64_t dout, int64_t batch,
           Out* out, const float* bias /* [heads, dout] or null */, float* lse = nullptr) {
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
        if (lse) lse[b * heads + h] = mx + std::log(l);
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

}  // namespace
}  // namespace apt_simd
