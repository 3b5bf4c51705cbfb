// Decode attention over the paged hybrid cache on CPU, reading pages where they sit, on the
// flash-decoding skeleton of flash_decode.h (SIMD and the bf16 "split" row order: simd.h).
//
// The decode kernels (this file and cpu_hidden.cpp):
//   kv_decode          KV pages   [P, BS, 2, KVH, D]: scores q.k, accumulate v            (out [B,H,D])
//   hidden_absorbed    hidden     [P, TPP, HID] (page stride free), no RoPE:
//                      q.(W_k x + b_k) = (W_k^T q).x + const, so with qk = scale * W_k^T q the scores
//                      are qk.x and the output is W_v (sum p x) + b_v: accumulate x   (y [B,H,HID])
//                      K and V are never formed; the caller applies W_k^T before and W_v after.
//   hidden_projected   hidden pages with RoPE: per page K|V = x W_kv^T + b (one small GEMM into a
//                      thread-local tile), K rotated at the tokens' positions, then as kv_decode;
//                      hidden_int8_projected dequantises each int8 page into an x tile first.
// kv-int8 decode: cpu_kv_int8.cpp; hidden-int8 without RoPE: cpu_hidden.cpp.
// The query (scores) and the accumulator (values) use the split order when the data they meet is
// bf16 and the head dim allows it; accumulators go back to natural order when a partial is written.

#include "flash_decode.h"
#include "work_queue.h"

namespace {
using namespace apt_simd;

// KV pages ----------------------------------------------------------------------------------------
template <typename T>
void kv_decode_impl(const torch::Tensor& q, const torch::Tensor& kv, const torch::Tensor& table,
                    const torch::Tensor& lens, double scale, int64_t part_tokens, torch::Tensor& out,
                    float* lse = nullptr) {
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
  apt_work::WorkQueue work(static_cast<int64_t>(items.size()));
  at::parallel_for(0, work.threads(), 1, [&](int64_t, int64_t) {
    std::vector<float> qf(heads * dim), tmp(dim), s(heads * bs);
    Partial st(heads, dim);
    for (int64_t i; work.take(i);) {
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
  merge(items, partials.data(), heads, dim, batch, out.data_ptr<T>(), nullptr, lse);
}

// lse (undefined, or float32 [B, H]): filled with each head's log-sum-exp of the scores.
torch::Tensor kv_decode_into(const torch::Tensor& q, const torch::Tensor& kv, const torch::Tensor& table,
                             const torch::Tensor& lens, double scale, int64_t part_tokens, torch::Tensor lse) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "q: expected a contiguous [B, H, D] tensor");
  TORCH_CHECK(kv.dim() == 5 && kv.size(2) == 2 && kv.size(4) == q.size(2) && kv.stride(4) == 1 &&
                  kv.stride(3) == kv.size(4) && kv.stride(2) == kv.size(3) * kv.size(4),
              "kv: expected pages [P, BS, 2, KVH, D] with contiguous tokens");
  TORCH_CHECK(q.size(1) % kv.size(3) == 0, "q: query heads must be a multiple of the KV heads");
  TORCH_CHECK(q.scalar_type() == kv.scalar_type(), "q and kv must share a dtype");
  check_table(table, lens, q.size(0));
  auto out = torch::empty_like(q);
  if (q.size(0) == 0) return out;
  float* lse_ptr = lse.defined() ? lse.data_ptr<float>() : nullptr;
  if (q.scalar_type() == torch::kFloat) {
    kv_decode_impl<float>(q, kv, table, lens, scale, part_tokens, out, lse_ptr);
  } else {
    TORCH_CHECK(q.scalar_type() == torch::kBFloat16, "dtype: float32 or bfloat16 only");
    kv_decode_impl<bf16>(q, kv, table, lens, scale, part_tokens, out, lse_ptr);
  }
  return out;
}

torch::Tensor kv_decode(const torch::Tensor& q, const torch::Tensor& kv, const torch::Tensor& table,
                        const torch::Tensor& lens, double scale, int64_t part_tokens) {
  return kv_decode_into(q, kv, table, lens, scale, part_tokens, torch::Tensor());
}

std::tuple<torch::Tensor, torch::Tensor> kv_decode_lse(const torch::Tensor& q, const torch::Tensor& kv,
                                                       const torch::Tensor& table, const torch::Tensor& lens,
                                                       double scale, int64_t part_tokens) {
  auto lse = torch::empty({q.size(0), q.size(1)}, q.options().dtype(torch::kFloat));
  auto out = kv_decode_into(q, kv, table, lens, scale, part_tokens, lse);
  return {out, lse};
}

// Hidden pages, projected per page (RoPE) ----------------------------------------------------------
//   tile [n, 2, KVH, D] = x_page[:n] @ w_kv_t  (model dtype, one GEMM per page, thread-local)
//   kf   [n, KVH, D]    = rotate(tile K + b_k) in float32 at positions t0 .. t0 + n
// x_page is the page itself, or (hidden-int8) the page dequantised into a thread-local x tile.
struct PlainX {
  const torch::Tensor& hidden;
  torch::Tensor rows(int64_t page, int64_t n, torch::Tensor&) const { return hidden.select(0, page).narrow(0, 0, n); }
};

template <typename T>
struct Int8X {  // [P, TPP, HID] int8 + [P, TPP, HID / group] float32 scales
  const torch::Tensor& hidden;
  const torch::Tensor& scale;
  torch::Tensor rows(int64_t page, int64_t n, torch::Tensor& xtile) const {
    const int64_t hid = hidden.size(2), group = hid / scale.size(2);
    const int8_t* x = hidden.data_ptr<int8_t>() + page * hidden.stride(0);
    const float* s = scale.data_ptr<float>() + page * scale.stride(0);
    T* out = xtile.data_ptr<T>();
    for (int64_t t = 0; t < n; ++t)
      dequant_row(x + t * hidden.stride(1), s + t * scale.stride(1), hid, group, out + t * hid);
    return xtile.narrow(0, 0, n);
  }
};

template <typename T, typename Source>
void hidden_projected_impl(const torch::Tensor& q, const Source& source, int64_t tpp, const torch::Tensor& table,
                           const torch::Tensor& lens, const torch::Tensor& w_kv_t, const torch::Tensor& b_kv,
                           const torch::Tensor& cos, const torch::Tensor& sin, int64_t num_kv_heads, double scale,
                           int64_t part_tokens, torch::Tensor& out) {
  const int64_t batch = q.size(0), heads = q.size(1), dim = q.size(2), half = dim / 2;
  const int64_t kvh = num_kv_heads, group = heads / kvh, kv_dim = kvh * dim;
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
  apt_work::WorkQueue work(static_cast<int64_t>(items.size()));
  at::parallel_for(0, work.threads(), 1, [&](int64_t, int64_t) {
    std::vector<float> qf(heads * dim), tmp(dim), s(heads * tpp), kf(tpp * kv_dim);
    Partial st(heads, dim);
    auto tile = torch::empty({tpp, 2 * kv_dim}, w_kv_t.options());
    auto xtile = torch::empty({tpp, w_kv_t.size(0)}, w_kv_t.options());
    for (int64_t i; work.take(i);) {
      const Item& it = items[i];
      load_query(q_base + it.b * heads * dim, heads, dim, float(scale), path.q_split, qf.data(), tmp.data());
      st.init();
      for (int64_t t0 = it.start; t0 < it.end; t0 += tpp) {
        const int64_t page = tab[it.b * max_pages + t0 / tpp];
        const int64_t n = std::min(tpp, it.end - t0);
        auto kv = tile.narrow(0, 0, n);
        at::mm_out(kv, source.rows(page, n, xtile), w_kv_t);
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

// The checks and optional arguments both hidden_projected entries share; then run(bias, cos, sin, out).
template <typename Run>
torch::Tensor projected_entry(const torch::Tensor& q, const torch::Tensor& hidden, const torch::Tensor& table,
                              const torch::Tensor& lens, const torch::Tensor& w_kv_t,
                              const c10::optional<torch::Tensor>& b_kv, const c10::optional<torch::Tensor>& cos,
                              const c10::optional<torch::Tensor>& sin, int64_t num_kv_heads, Run run) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "q: expected a contiguous [B, H, D] tensor");
  TORCH_CHECK(hidden.dim() == 3 && hidden.stride(2) == 1 && hidden.stride(1) == hidden.size(2),
              "hidden: expected pages [P, TPP, HID] with contiguous tokens (page stride free)");
  TORCH_CHECK(num_kv_heads > 0 && q.size(1) % num_kv_heads == 0, "num_kv_heads must divide the query heads");
  TORCH_CHECK(w_kv_t.dim() == 2 && w_kv_t.size(0) == hidden.size(2) && w_kv_t.size(1) == 2 * num_kv_heads * q.size(2),
              "w_kv_t: expected a [HID, 2 * KVH * D] tensor (K columns, then V; e.g. w_kv.t())");
  TORCH_CHECK(w_kv_t.scalar_type() == q.scalar_type(), "q and w_kv_t must share a dtype");
  TORCH_CHECK(q.scalar_type() == torch::kFloat || q.scalar_type() == torch::kBFloat16,
              "dtype: float32 or bfloat16 only");
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
  run(bias, c, s, out);
  return out;
}

torch::Tensor hidden_projected(const torch::Tensor& q, const torch::Tensor& hidden, const torch::Tensor& table,
                               const torch::Tensor& lens, const torch::Tensor& w_kv_t,
                               const c10::optional<torch::Tensor>& b_kv, const c10::optional<torch::Tensor>& cos,
                               const c10::optional<torch::Tensor>& sin, int64_t num_kv_heads, double scale,
                               int64_t part_tokens) {
  TORCH_CHECK(q.scalar_type() == hidden.scalar_type(), "q, hidden and w_kv_t must share a dtype");
  return projected_entry(q, hidden, table, lens, w_kv_t, b_kv, cos, sin, num_kv_heads,
                         [&](const torch::Tensor& bias, const torch::Tensor& c, const torch::Tensor& s,
                             torch::Tensor& out) {
    const PlainX src{hidden};
    if (q.scalar_type() == torch::kFloat)
      hidden_projected_impl<float>(q, src, hidden.size(1), table, lens, w_kv_t, bias, c, s, num_kv_heads, scale,
                                   part_tokens, out);
    else
      hidden_projected_impl<bf16>(q, src, hidden.size(1), table, lens, w_kv_t, bias, c, s, num_kv_heads, scale,
                                  part_tokens, out);
  });
}

torch::Tensor hidden_int8_projected(const torch::Tensor& q, const torch::Tensor& hidden,
                                    const torch::Tensor& hidden_scale, const torch::Tensor& table,
                                    const torch::Tensor& lens, const torch::Tensor& w_kv_t,
                                    const c10::optional<torch::Tensor>& b_kv, const c10::optional<torch::Tensor>& cos,
                                    const c10::optional<torch::Tensor>& sin, int64_t num_kv_heads, double scale,
                                    int64_t part_tokens) {
  TORCH_CHECK(hidden.scalar_type() == torch::kChar, "hidden: expected int8 pages");
  TORCH_CHECK(hidden_scale.scalar_type() == torch::kFloat && hidden_scale.dim() == 3 &&
                  hidden_scale.size(0) == hidden.size(0) && hidden_scale.size(1) == hidden.size(1) &&
                  hidden_scale.size(2) > 0 && hidden.size(2) % hidden_scale.size(2) == 0 &&
                  hidden_scale.stride(2) == 1,
              "hidden_scale: expected float32 scales [P, TPP, HID / group] beside the int8 pages");
  return projected_entry(q, hidden, table, lens, w_kv_t, b_kv, cos, sin, num_kv_heads,
                         [&](const torch::Tensor& bias, const torch::Tensor& c, const torch::Tensor& s,
                             torch::Tensor& out) {
    if (q.scalar_type() == torch::kFloat)
      hidden_projected_impl<float>(q, Int8X<float>{hidden, hidden_scale}, hidden.size(1), table, lens, w_kv_t,
                                   bias, c, s, num_kv_heads, scale, part_tokens, out);
    else
      hidden_projected_impl<bf16>(q, Int8X<bf16>{hidden, hidden_scale}, hidden.size(1), table, lens, w_kv_t,
                                  bias, c, s, num_kv_heads, scale, part_tokens, out);
  });
}

}  // namespace

// Registered as torch ops (torch.ops.apt_serve.*): visible to the profiler, opaque to torch.compile.
TORCH_LIBRARY(apt_serve, m) {
  m.def("kv_decode(Tensor q, Tensor kv, Tensor block_table, Tensor ctx_lens, float scale, int part_tokens) -> Tensor");
  m.def("kv_decode_lse(Tensor q, Tensor kv, Tensor block_table, Tensor ctx_lens, float scale, int part_tokens) "
        "-> (Tensor, Tensor)");
  m.def("hidden_projected(Tensor q, Tensor hidden, Tensor block_table, Tensor ctx_lens, Tensor w_kv_t, Tensor? b_kv, "
        "Tensor? cos, Tensor? sin, int num_kv_heads, float scale, int part_tokens) -> Tensor");
  m.def("hidden_int8_projected(Tensor q, Tensor hidden, Tensor hidden_scale, Tensor block_table, Tensor ctx_lens, "
        "Tensor w_kv_t, Tensor? b_kv, Tensor? cos, Tensor? sin, int num_kv_heads, float scale, int part_tokens) "
        "-> Tensor");
}

TORCH_LIBRARY_IMPL(apt_serve, CPU, m) {
  m.impl("kv_decode", &kv_decode);
  m.impl("kv_decode_lse", &kv_decode_lse);
  m.impl("hidden_projected", &hidden_projected);
  m.impl("hidden_int8_projected", &hidden_int8_projected);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {}
