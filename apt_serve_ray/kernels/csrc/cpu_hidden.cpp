// Hidden-page decode for models without RoPE, with W_k absorbed into the query (see the notes in
// cpu_attention.cpp): scores qk.x and sums p x over the stored x, never forming K or V. hidden-int8
// pages take the same path over each page dequantised into a thread-local tile (see Int8Pages).

#include "flash_decode.h"
#include "work_queue.h"

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

// The flash-decoding loop over a request's pages. ``source.rows(page, first, n, tile)`` gives rows
// first .. first + n of a page's x (``tok_stride`` apart) in its element type: the page itself, or
// those rows dequantised into the thread-local tile; ``source.prefetch(page, n)`` starts reading a page.
template <typename Source>
void hidden_absorbed_loop(const torch::Tensor& qk, const Source& source, int64_t tpp, const torch::Tensor& table,
                          const torch::Tensor& lens, int64_t part_tokens, torch::Tensor& y) {
  using T = typename Source::Elem;
  const int64_t batch = qk.size(0), heads = qk.size(1), hid = qk.size(2);
  const float* qk_base = qk.data_ptr<float>();
  const int32_t* tab = table.data_ptr<int32_t>();
  const int64_t max_pages = table.size(1);
  const auto items = make_items(lens.data_ptr<int32_t>(), batch, tpp, part_tokens);
  const int64_t row = 2 + hid;
  // float rows are read in natural order two vectors at a time; bf16 rows split (see the top).
  const bool fast = hid % (2 * W) == 0;
  const bool split = fast && is_bf16<T>;
  std::vector<float> partials(items.size() * heads * row);
  // Tiled sources are attended 32 rows at a time: a bf16 tile is then a bf16 hidden page's size
  // (OPT-125m: 48 KiB); 8, 16, 32 and 64 rows measured within noise of each other.
  const int64_t chunk = Source::kTiled ? std::min<int64_t>(tpp, 32) : tpp;
  apt_work::WorkQueue work(static_cast<int64_t>(items.size()));
  at::parallel_for(0, work.threads(), 1, [&](int64_t, int64_t) {
    std::vector<float> q(heads * hid), s(heads * tpp);
    std::vector<T> tile(Source::kTiled ? chunk * hid : 0);
    Partial st(heads, hid);
    for (int64_t i; work.take(i);) {
      const Item& it = items[i];
      const float* qb = qk_base + it.b * heads * hid;
      if (split)
        for (int64_t h = 0; h < heads; ++h) split_row(qb + h * hid, q.data() + h * hid, hid);
      else
        std::copy(qb, qb + heads * hid, q.begin());
      st.init();
      for (int64_t t0 = it.start; t0 < it.end; t0 += tpp) {
        const int64_t n = std::min(tpp, it.end - t0);
        if (t0 + tpp < it.end)  // the next page, while this one is attended
          source.prefetch(tab[it.b * max_pages + t0 / tpp + 1], std::min(tpp, it.end - t0 - tpp));
        const int64_t page = tab[it.b * max_pages + t0 / tpp];
        for (int64_t r = 0; r < n; r += chunk) {
          const int64_t m = std::min(chunk, n - r);
          hidden_page(source.rows(page, r, m, tile.data()), source.tok_stride, m, heads, hid, q.data(), s.data(),
                      tpp, st, fast);
        }
      }
      st.write(partials.data() + i * heads * row, split);
    }
  });
  merge(items, partials.data(), heads, hid, batch, y.data_ptr<float>(), nullptr);
}

template <typename T>
struct PlainPages {  // [P, TPP, HID] pages of the model's dtype, read where they sit
  using Elem = T;
  static constexpr bool kTiled = false;
  const T* base;
  int64_t page_stride, tok_stride;
  const T* rows(int64_t page, int64_t first, int64_t, T*) const {
    return base + page * page_stride + first * tok_stride;
  }
  void prefetch(int64_t page, int64_t n) const {
    const char* p = reinterpret_cast<const char*>(base + page * page_stride);
    for (int64_t off = 0; off < n * tok_stride * int64_t(sizeof(T)); off += 64) apt_simd::prefetch(p + off);
  }
};

// hidden-int8 pages: [P, TPP, HID] int8 + [P, TPP, HID / group] float32 scales. Each page is
// dequantised, 32 rows at a time, into a tile of the model's dtype (as the reference dequantises)
// that every head then reads: the conversion is paid once per element, not once per head block
// (with 12 heads hidden_page reads each element 6 + 3 times). Measured per layer (OPT-125m shape,
// one thread, AMD EPYC with avx512_bf16): float32 within 5% of hidden pages, bf16 1.15-1.25x: the
// dequantisation's own vector work in a kernel that is already compute-bound (skipping it, as an
// experiment, gave hidden's time). Dequantising in registers instead would repeat it per head block.
template <typename T>
struct Int8Pages {
  using Elem = T;
  static constexpr bool kTiled = true;
  const int8_t* base;
  const float* scales;
  int64_t page_stride, q_tok, s_page, s_tok, hid, group, tok_stride;
  const T* rows(int64_t page, int64_t first, int64_t n, T* tile) const {
    for (int64_t t = 0; t < n; ++t)
      dequant_row(base + page * page_stride + (first + t) * q_tok, scales + page * s_page + (first + t) * s_tok,
                  hid, group, tile + t * hid);
    return tile;
  }
  void prefetch(int64_t page, int64_t n) const {
    const char* p = reinterpret_cast<const char*>(base + page * page_stride);
    for (int64_t off = 0; off < n * q_tok; off += 64) apt_simd::prefetch(p + off);
    const char* sp = reinterpret_cast<const char*>(scales + page * s_page);
    for (int64_t off = 0; off < n * s_tok * int64_t(sizeof(float)); off += 64) apt_simd::prefetch(sp + off);
  }
};

void check_qk(const torch::Tensor& qk) {
  TORCH_CHECK(qk.dim() == 3 && qk.is_contiguous() && qk.scalar_type() == torch::kFloat,
              "qk: expected a contiguous float32 [B, H, HID] tensor");
}

torch::Tensor hidden_absorbed(const torch::Tensor& qk, const torch::Tensor& hidden, const torch::Tensor& table,
                              const torch::Tensor& lens, int64_t part_tokens) {
  check_qk(qk);
  TORCH_CHECK(hidden.dim() == 3 && hidden.stride(2) == 1 && hidden.stride(1) == hidden.size(2) &&
                  hidden.size(2) == qk.size(2),
              "hidden: expected pages [P, TPP, HID] with contiguous tokens (page stride free)");
  check_table(table, lens, qk.size(0));
  auto y = torch::empty_like(qk);
  if (qk.size(0) == 0) return y;
  const int64_t tpp = hidden.size(1);
  if (hidden.scalar_type() == torch::kFloat) {
    PlainPages<float> src{hidden.data_ptr<float>(), hidden.stride(0), hidden.stride(1)};
    hidden_absorbed_loop(qk, src, tpp, table, lens, part_tokens, y);
  } else {
    TORCH_CHECK(hidden.scalar_type() == torch::kBFloat16, "dtype: float32 or bfloat16 only");
    PlainPages<bf16> src{hidden.data_ptr<bf16>(), hidden.stride(0), hidden.stride(1)};
    hidden_absorbed_loop(qk, src, tpp, table, lens, part_tokens, y);
  }
  return y;
}

torch::Tensor hidden_int8_absorbed(const torch::Tensor& qk, const torch::Tensor& hidden,
                                   const torch::Tensor& hidden_scale, const torch::Tensor& table,
                                   const torch::Tensor& lens, bool tile_bf16, int64_t part_tokens) {
  check_qk(qk);
  TORCH_CHECK(hidden.scalar_type() == torch::kChar && hidden.dim() == 3 && hidden.stride(2) == 1 &&
                  hidden.size(2) == qk.size(2),
              "hidden: expected int8 pages [P, TPP, HID] with contiguous rows (page stride free)");
  TORCH_CHECK(hidden_scale.scalar_type() == torch::kFloat && hidden_scale.dim() == 3 &&
                  hidden_scale.size(0) == hidden.size(0) && hidden_scale.size(1) == hidden.size(1) &&
                  hidden_scale.size(2) > 0 && hidden.size(2) % hidden_scale.size(2) == 0 &&
                  hidden_scale.stride(2) == 1,
              "hidden_scale: expected float32 scales [P, TPP, HID / group] beside the int8 pages");
  check_table(table, lens, qk.size(0));
  auto y = torch::empty_like(qk);
  if (qk.size(0) == 0) return y;
  const int64_t hid = hidden.size(2);
  const int64_t group = hid / hidden_scale.size(2);
  if (tile_bf16) {
    Int8Pages<bf16> src{hidden.data_ptr<int8_t>(), hidden_scale.data_ptr<float>(), hidden.stride(0), hidden.stride(1),
                        hidden_scale.stride(0), hidden_scale.stride(1), hid, group, hid};
    hidden_absorbed_loop(qk, src, hidden.size(1), table, lens, part_tokens, y);
  } else {
    Int8Pages<float> src{hidden.data_ptr<int8_t>(), hidden_scale.data_ptr<float>(), hidden.stride(0),
                         hidden.stride(1), hidden_scale.stride(0), hidden_scale.stride(1), hid, group, hid};
    hidden_absorbed_loop(qk, src, hidden.size(1), table, lens, part_tokens, y);
  }
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(apt_serve, m) {
  m.def("hidden_absorbed(Tensor qk, Tensor hidden, Tensor block_table, Tensor ctx_lens, int part_tokens) -> Tensor");
  m.def("hidden_int8_absorbed(Tensor qk, Tensor hidden, Tensor hidden_scale, Tensor block_table, Tensor ctx_lens, "
        "bool tile_bf16, int part_tokens) -> Tensor");
}

TORCH_LIBRARY_IMPL(apt_serve, CPU, m) {
  m.impl("hidden_absorbed", &hidden_absorbed);
  m.impl("hidden_int8_absorbed", &hidden_int8_absorbed);
}
