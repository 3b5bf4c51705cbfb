// Hidden-page decode for models without RoPE, with W_k absorbed into the query (see the notes in
// cpu_attention.cpp): scores qk.x and sums p x over the stored x, never forming K or V.

#include "flash_decode.h"

namespace {
using namespace apt_simd;

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

}  // namespace

TORCH_LIBRARY_FRAGMENT(apt_serve, m) {
  m.def("hidden_absorbed(Tensor qk, Tensor hidden, Tensor block_table, Tensor ctx_lens, int part_tokens) -> Tensor");
}

TORCH_LIBRARY_IMPL(apt_serve, CPU, m) { m.impl("hidden_absorbed", &hidden_absorbed); }
